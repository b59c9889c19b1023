"""A tensor-parallel patched Hugging Face Qwen3 whose log-probs, generations and gradients are the
same bits at TP = 1, 2, 4, 8: a TP sampler and a trainer at another degree (or under FSDP2) agree.

Each rank builds the same model (random weights from a config, nothing downloaded) and patches it
with its group (``rl_engine_ext.patch(model, tp_group=...)``), which keeps the rank's shards. Then:
per-token log-probs of a padded batch and a packed one (``rl_engine_ext.token_logprobs``), greedy
``generate_with_logprobs`` (the sampler) and the trainer's log-probs of what it generated, a
backward of a policy-gradient-style loss. With ``--check``, rank 0 also runs the same model
unsharded in one process with the same numerics (``patch(model, tp_invariant=True)``, TP = 1) and
prints whether every result (the gradients' shards gathered) is the same bits.

    torchrun --nproc_per_node 2 examples/tp_qwen3.py --check                  # CPU ranks (gloo)
    torchrun --nproc_per_node 4 examples/tp_qwen3.py --device cuda --dims qwen3-8b --check

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 set here before the process group starts).
README, "Tensor parallelism".
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

DIMS = {
    # heads 8 / kv heads 4: splits over 1, 2, 4 ranks; every split dimension a multiple of 8 leaves; wide
    # enough that the sums' order shows in the bits (tests: the plain patched model differs)
    "tiny": dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=16),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def build_model(dims: dict, device, tp_group=None, tp_invariant: bool = False, patched: bool = True,
                tied: bool = False):
    """The model, the same bf16 weights on every rank (seeded); patched with ``tp_group`` (its
    shards kept) or ``tp_invariant`` (unsharded, TP = 1), or left unpatched. ``tied``: the LM head
    shares the embedding's weight (Qwen3 0.6B-4B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**dims, max_position_embeddings=4096, tie_word_embeddings=tied)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype=torch.bfloat16)
    if patched:
        rl.patch(model, tp_group=tp_group, tp_invariant=tp_invariant)
    return model


def make_batch(dims: dict, device, batch: int = 3, seq: int = 12):
    """Right-padded token ids of three lengths, and a per-token loss weight."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, dims["vocab_size"], (batch, seq), generator=g)
    lengths = torch.tensor([seq, seq - 3, seq // 2, seq - 1] * batch)[:batch]
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    weights = torch.randn(batch, seq, generator=g)
    return ids.to(device), mask.to(device), weights.to(device)


def digest(t: torch.Tensor) -> int:
    """An order-sensitive checksum of a tensor's bits (integer arithmetic, on its device)."""
    bits = t.detach().contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).long()
    return int((bits * (torch.arange(bits.numel(), device=bits.device) % 65521 + 1)).sum()) % (1 << 61)


def run(model, dims: dict, device, batch: int = 3, seq: int = 12, new_tokens: int = 4, grad_as=None) -> dict:
    """Every result the ranks compare: log-probs (padded, packed), the loss's gradients (whole:
    shards gathered; a collective; each kept as ``grad_as(tensor)``, default a CPU copy), the
    sampler's tokens and log-probs and the trainer's of them."""
    grad_as = grad_as or (lambda t: t.cpu())
    ids, mask, weights = make_batch(dims, device, batch, seq)
    model.zero_grad(set_to_none=True)
    lp = rl.token_logprobs(model, ids, mask)
    (lp * weights).sum().backward()
    grads = {k: (None if v is None else grad_as(v)) for k, v in rl.tp_full_tensors(model, grads=True).items()}
    lengths = mask.sum(1)
    packed_ids = torch.cat([ids[b, :n] for b, n in enumerate(lengths.tolist())])
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)
    with torch.no_grad():
        packed = rl.token_logprobs(model, packed_ids, cu_seqlens=cu)
        prompts = ids[:2, : seq // 2]
        gen = rl.generate_with_logprobs(model, prompts, torch.ones_like(prompts), do_sample=False,
                                        max_new_tokens=new_tokens, pad_token_id=0)
        trainer = rl.token_logprobs(model, gen.sequences, gen.attention_mask)
    return {"logprobs": lp.detach().cpu(), "packed": packed.cpu(), "grads": grads, "gen_tokens": gen.sequences.cpu(),
            "gen_logprobs": gen.logprobs.cpu(), "gen_trainer": torch.where(gen.completion_mask, trainer, 0.0).cpu()}


def differences(a: dict, b: dict) -> list[str]:
    """The results of two runs that are not the same bits (names)."""
    out = [k for k in ("logprobs", "packed", "gen_tokens", "gen_logprobs") if not torch.equal(a[k], b[k])]
    same = lambda x, y: torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y  # noqa: E731
    out += [f"grad {k}" for k in a["grads"] if not same(a["grads"][k], b["grads"][k])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dims", default="tiny", choices=sorted(DIMS))
    parser.add_argument("--check", action="store_true", help="compare with TP = 1 (unsharded) on rank 0")
    args = parser.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dims = DIMS[args.dims]
    result = run(build_model(dims, device, tp_group=dist.group.WORLD), dims, device)
    sampler_is_trainer = torch.equal(result["gen_logprobs"], result["gen_trainer"])
    if rank == 0:
        print(f"TP = {world}: generate_with_logprobs == token_logprobs of its tokens: {sampler_is_trainer}")
    ok = sampler_is_trainer
    if args.check and rank == 0:
        diff = differences(result, run(build_model(dims, device, tp_invariant=True), dims, device))
        print(f"TP = {world} vs TP = 1 (one process): log-probs, packed, generate, {len(result['grads'])} gradients: "
              + ("all the same bits" if not diff else f"DIFFER: {diff}"))
        ok = ok and not diff
    flags = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    # The model holds the process group (patched modules reference themselves: freed only by the
    # cycle collector), and a gloo group first freed during interpreter exit can abort the process
    # ("terminate called without an active exception"): free it now, then tear down together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if not flags.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
