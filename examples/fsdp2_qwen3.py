"""FSDP2 training of a patched Hugging Face Qwen3 whose gradients are summed over the ranks in one
fixed order, whatever the batch, the message sizes or the number of FSDP units.

Each rank builds the same model (random weights from a config, nothing downloaded), patches it
(``rl_engine_ext.patch``), shards it with ``torch.distributed.fsdp.fully_shard`` (one unit per
decoder layer, the root holding the rest) and sets the invariant reduce-scatter
(``rl_engine_ext.distributed.use_invariant_reduce_scatter``). Then a few training steps on each
rank's own batch: per-token log-probs (``rl_engine_ext.token_logprobs``, which runs through FSDP's
forward hooks), a policy-gradient-style loss, backward, AdamW. Printed on rank 0: the loss per step,
a digest of the sharded gradients' bits (the same digest on every rerun, and with ``--one-unit``,
where the whole model is one FSDP unit and every gradient travels in one message), and whether the
first step's log-probs equal the unsharded model's in one process bit for bit (``--check``).

    torchrun --nproc_per_node 2 examples/fsdp2_qwen3.py --check             # CPU ranks (gloo)
    torchrun --nproc_per_node 4 examples/fsdp2_qwen3.py --device cuda --dims qwen3-8b --check

Keep NCCL_NVLS_ENABLE=0 (set here before the process group starts) where NVLink multicast must stay
off. README, "Many GPUs".
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rl_engine_ext as rl  # noqa: E402
from rl_engine_ext import distributed as rd  # noqa: E402

DIMS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def build_model(dims: dict, device: torch.device | str) -> torch.nn.Module:
    """The patched model, the same bf16 weights on every rank (seeded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    config = Qwen3Config(**dims, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype=torch.bfloat16)
    rl.patch(model)
    return model


def rank_batch(rank: int, dims: dict, batch: int, seq: int, device: torch.device):
    """Rank ``rank``'s token ids, right-padded rows of different lengths."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, dims["vocab_size"], (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask.to(device)


def digest(tensors) -> int:
    """An order-sensitive checksum of the tensors' bits (integer arithmetic)."""
    total = 0
    for t in tensors:
        bits = t.detach().contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).long()
        total = (total * 1000003 + int((bits * (torch.arange(bits.numel(), device=bits.device) % 65521 + 1)).sum())) % (1 << 61)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dims", default="tiny", choices=sorted(DIMS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--one-unit", action="store_true", help="the whole model as one FSDP unit")
    parser.add_argument("--check", action="store_true", help="compare with the unsharded model in one process")
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dims = DIMS[args.dims]
    model = build_model(dims, device)
    mesh = init_device_mesh(args.device, (world,))
    if not args.one_unit:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = rd.use_invariant_reduce_scatter(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, mask = rank_batch(rank, dims, args.batch, args.seq, device)
    advantages = torch.linspace(-1.0, 1.0, args.batch, device=device)[:, None]  # one per sequence

    first_logprobs = None
    for step in range(args.steps):
        lp = rl.token_logprobs(model, ids, mask)
        loss = -(advantages * lp).sum() / mask.sum()
        loss.backward()
        if step == 0:
            first_logprobs = lp.detach()
            grads = digest(p.grad.to_local() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses = [torch.zeros(1, device=device) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        if rank == 0:
            print(f"step {step}: loss per rank {[round(float(x), 6) for x in losses]}")
    if rank == 0:
        print(f"{world} ranks, {units} FSDP units, first step's sharded gradients on rank 0: digest {grads}")
    if args.check:
        alone = build_model(dims, device)
        with torch.no_grad():
            same = torch.equal(rl.token_logprobs(alone, ids, mask), first_logprobs)
        flags = torch.tensor([int(same)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # an exact minimum: any order
        if rank == 0:
            print(f"log-probs == the unsharded model's in one process, every rank: {bool(flags.item())}")
        if not flags.item():
            raise SystemExit(1)
    # The model and the mesh hold the process group (patched modules reference themselves: freed
    # only by the cycle collector), and a gloo group first freed during interpreter exit can abort
    # the process ("terminate called without an active exception"): free them now, then tear down
    # together.
    model = optimizer = mesh = alone = None  # noqa: F841
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
