"""A patched Qwen3 trained under FSDP2 (torch.distributed.fsdp.fully_shard), one rank of it: what
tests/test_fsdp.py runs on gloo CPU ranks and scripts/gpu_distributed.py on NCCL GPU ranks (Qwen3-8B
layer dimensions there). Each run reports its per-token log-probs, digests of its sharded gradients'
bits and of its parameters after an optimizer step, and which collectives summed the gradients."""

from __future__ import annotations

import importlib.util
import os
import time

import torch

# The model, the ranks' batches and the digest are the runnable example's (examples/fsdp2_qwen3.py).
_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "fsdp2_qwen3.py")
_spec = importlib.util.spec_from_file_location("fsdp2_qwen3", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

TINY = example.DIMS["tiny"]
QWEN3_8B = example.DIMS["qwen3-8b"]  # Qwen3-8B's layer dimensions; num_hidden_layers set by the caller
build_model = example.build_model  # patched, the same bf16 weights on every rank (seeded)
rank_batch = example.rank_batch


def digest(t: torch.Tensor) -> int:
    """An order-sensitive checksum of a tensor's bits (integer arithmetic: the same on any device)."""
    return example.digest([t])


class TorchReduceScatter:
    """FSDP2's default reduce-scatter (torch.distributed's, NCCL on GPUs) as a custom comm, so one
    model switches between it and the invariant one (the control of the GPU script and benchmark)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def fsdp_train(rank: int, world: int, dims: dict, wrap: str, comm: str, device: str, batch: int = 2, seq: int = 24,
               timed_steps: int = 0, declare: bool = False) -> dict:
    """One rank: the patched model sharded per decoder layer + root (wrap "layers") or as one unit
    (wrap "root": one reduce-scatter message of every gradient), gradients reduce-scattered by the
    invariant collective (comm "invariant") or NCCL's / gloo's own ("torch"); log-probs, a backward,
    an AdamW step, the log-probs again. With ``timed_steps``, that many more steps are timed. With
    ``declare``, the first step declares its loss's cotangents (token_logprobs(grad_logprob=))."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import rl_engine_ext as rl
    from rl_engine_ext import distributed as rd

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    model = build_model(dims, dev)
    mesh = init_device_mesh(device, (world,))
    if wrap == "layers":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if comm == "invariant":
        rd.use_invariant_reduce_scatter(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = rank_batch(rank, dims, batch, seq, str(dev))

    def step(grad_logprob=None) -> torch.Tensor:
        lp = rl.token_logprobs(model, ids, mask, grad_logprob=grad_logprob)
        (-lp.sum() / (batch * seq)).backward()
        return lp

    # The loss's cotangent as autograd computes it: -(1 / (batch * seq)), rounded in fp32.
    declared = -(torch.ones(ids.shape, device=ids.device) / (batch * seq)) if declare else None
    with rl.record_kernels() as ran:
        lp = step(declared)
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
              "params": params, "rank_sum_calls": sum(n for (k, _), n in ran.counts.items() if k == "rank_sum"),
              "linear_gemm_calls": sum(n for (k, _), n in ran.counts.items() if k == "linear_gemm")}
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
    out = []
    with torch.no_grad():
        for rank in range(world):
            ids, mask = rank_batch(rank, dims, batch, seq, device)
            out.append(rl.token_logprobs(model, ids, mask).cpu())
    return out
