"""A patched Qwen3 trained under FSDP2 (torch.distributed.fsdp.fully_shard), one rank of it: what
tests/test_fsdp.py runs on gloo CPU ranks and scripts/gpu_distributed.py on NCCL GPU ranks (Qwen3-8B
layer dimensions there). Each run reports its per-token log-probs, digests of its sharded gradients'
bits and of its parameters after an optimizer step, and which collectives summed the gradients."""

from __future__ import annotations

import time

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
# Qwen3-8B's layer dimensions (its config); num_hidden_layers set by the caller.
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def build_model(dims: dict, device: str) -> torch.nn.Module:
    """The same bf16 weights on every rank and in the single-process reference (seeded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**dims, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype=torch.bfloat16)


def rank_batch(rank: int, dims: dict, batch: int, seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s token ids and attention mask (right padding, rows of different lengths)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, dims["vocab_size"], (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids.to(device), mask.to(device)


def digest(t: torch.Tensor) -> int:
    """An order-sensitive checksum of a tensor's bits (integer arithmetic: the same on any device)."""
    bits = t.detach().contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1000003 + 1
    return int((bits * weights).sum())


def fsdp_train(rank: int, world: int, dims: dict, wrap: str, comm: str, device: str, batch: int = 2, seq: int = 24,
               timed_steps: int = 0) -> dict:
    """One rank: the patched model sharded per decoder layer + root (wrap "layers") or as one unit
    (wrap "root": one reduce-scatter message of every gradient), gradients reduce-scattered by the
    invariant collective (comm "invariant") or NCCL's / gloo's own ("torch"); log-probs, a backward,
    an AdamW step, the log-probs again. With ``timed_steps``, that many more steps are timed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import rl_engine_ext as rl
    from rl_engine_ext import distributed as rd

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    model = build_model(dims, str(dev))
    rl.patch(model)
    mesh = init_device_mesh(device, (world,))
    if wrap == "layers":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if comm == "invariant":
        rd.use_invariant_reduce_scatter(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = rank_batch(rank, dims, batch, seq, str(dev))

    def step() -> torch.Tensor:
        lp = rl.token_logprobs(model, ids, mask)
        (-lp.sum() / (batch * seq)).backward()
        return lp

    with rl.record_kernels() as ran:
        lp = step()
    grads = {name: digest(p.grad.to_local()) for name, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        lp_after = rl.token_logprobs(model, ids, mask)
    model.reshard()  # FSDP2 keeps the root unsharded after a forward with no backward
    params = {name: digest(p.to_local()) for name, p in model.named_parameters()}
    from rl_engine_ext import hf

    result = {"logprobs": lp.detach().cpu(), "logprobs_after_step": lp_after.cpu(), "grads": grads,
              "forward_method_left": hf._FSDP_FORWARD_METHOD in vars(model),
              "params": params, "rank_sum_calls": sum(n for (k, _), n in ran.counts.items() if k == "rank_sum")}
    if timed_steps:
        times = []
        for _ in range(timed_steps):
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            step()
            optimizer.step()
            optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result["step_seconds"] = times
    return result


def single_process_logprobs(dims: dict, world: int, device: str, batch: int = 2, seq: int = 24) -> list[torch.Tensor]:
    """Each rank's batch through the unsharded patched model in one process: what the FSDP2 ranks'
    log-probs must equal bit for bit."""
    import rl_engine_ext as rl

    model = build_model(dims, device)
    rl.patch(model)
    out = []
    with torch.no_grad():
        for rank in range(world):
            ids, mask = rank_batch(rank, dims, batch, seq, device)
            out.append(rl.token_logprobs(model, ids, mask).cpu())
    return out
