"""Workers of the tensor-parallel tests (tests/test_tensor_parallel.py) and the GPU script
(scripts/gpu_tensor_parallel.py): one rank each. The model, the batch and the comparison are the
runnable example's (examples/tp_qwen3.py)."""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.distributed as dist

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "tp_qwen3.py")
_spec = importlib.util.spec_from_file_location("tp_qwen3", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

TINY = example.DIMS["tiny"]
QWEN3_8B = example.DIMS["qwen3-8b"]
build_model, run, differences = example.build_model, example.run, example.differences


def _device(rank: int, device: str) -> torch.device:
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def build_family(family: str, tp_group=None, tp_invariant: bool = False):
    """A tiny Llama (attention biases: q/k/v's sharded, o's whole) or Qwen2 (q/k/v biases), patched
    like the example's Qwen3."""
    import rl_engine_ext as rl
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    dims = {k: v for k, v in TINY.items() if k != "head_dim"}
    if family == "llama":
        config = LlamaConfig(**dims, head_dim=TINY["head_dim"], attention_bias=True, max_position_embeddings=512,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**dims, max_position_embeddings=512, tie_word_embeddings=False))
    model = model.to(torch.bfloat16)
    rl.patch(model, tp_group=tp_group, tp_invariant=tp_invariant)
    return model


def family_rank(rank: int, world: int, family: str) -> dict | None:
    result = run(build_family(family, tp_group=dist.group.WORLD), TINY, "cpu")
    return result if rank == 0 else None


def layer_inputs(device, m=5, k=256, n=48, dtype=torch.bfloat16, seed=3):
    """x [m, k], a weight [n, k] and bias, a cotangent dy [m, n]: large-ish values so that the
    order of a sum shows in its bits."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = (torch.randn(n, k, generator=g) * 3).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = (torch.randn(m, n, generator=g) * 3).to(dtype)
    return [t.to(device) for t in (x, w, b, dy)]


def layers(rank: int, world: int, device: str = "cpu") -> dict:
    """The column- and row-parallel linears on this rank's shards, forward and backward, and the
    naive row-parallel sum (each rank's plain linear, rounded, then summed) as control."""
    from rl_engine_ext import distributed, linear
    from rl_engine_ext import tensor_parallel as tpm

    dev = _device(rank, device)
    tp = tpm.tp_group(dist.group.WORLD if dist.is_initialized() else None)
    x, w, b, dy = layer_inputs(dev)
    out = {}
    # column-parallel: this rank's output rows; the input gradient summed over all ranks' rows
    rows = tp.shard(w.shape[0])
    xc = x.clone().requires_grad_()
    wc = w[rows].clone().requires_grad_()
    bc = b[rows].clone().requires_grad_()
    y = tpm.column_parallel_linear(xc, wc, bc, tp)
    y.backward(dy[:, rows])
    whole = lambda t, dim: torch.cat(tpm.gather_ranks(t.contiguous(), tp).unbind(0), dim=dim)  # noqa: E731
    out["column"] = (whole(y.detach(), -1), xc.grad, whole(wc.grad, 0), whole(bc.grad, 0))
    # row-parallel: this rank's input columns, the bias whole
    cols = tp.shard(x.shape[1])
    xr = x[:, cols].clone().requires_grad_()
    wr = w[:, cols].clone().requires_grad_()
    br = b.clone().requires_grad_()
    y = tpm.row_parallel_linear(xr, wr, br, tp)
    y.backward(dy)
    out["row"] = (y.detach(), whole(xr.grad, -1), whole(wr.grad, 1), br.grad)
    naive = linear(x[:, cols], w[:, cols])
    if tp.world > 1:
        distributed.all_reduce(naive)
    out["naive_row"] = naive + b
    return {k: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() for k, v in out.items()} if rank == 0 else None


def model_rank(rank: int, world: int, dims: dict, device: str = "cpu", digests: bool = False,
               tied: bool = False, seq: int = 12) -> dict | None:
    """A TP = world run of the example's model (the group: every rank); rank 0's results (the
    gradients as digests of their bits with ``digests``: Qwen3-8B-sized ones stay on the GPU)."""
    dev = _device(rank, device)
    result = run(build_model(dims, dev, tp_group=dist.group.WORLD, tied=tied), dims, dev, seq=seq,
                 grad_as=example.digest if digests else None)
    return result if rank == 0 else None


def lifecycle(model) -> dict:
    """What a copy, a save and an attached module do to a tensor-parallel patched model: the copy's
    log-probs == the model's (True) or the error each raised."""
    import copy
    import io

    import rl_engine_ext as rl

    ids, mask, _ = example.make_batch(TINY, "cpu")
    with torch.no_grad():
        ref = rl.token_logprobs(model, ids, mask)
    out = {}
    for what, make in (("deepcopy", lambda: copy.deepcopy(model)), ("save", lambda: _save_load(model, io, torch))):
        try:
            with torch.no_grad():
                out[what] = torch.equal(rl.token_logprobs(make(), ids, mask), ref)
        except (TypeError, ValueError) as e:
            out[what] = str(e)
    try:
        model.model.layers[0].self_attn.extra = torch.nn.Linear(4, 4)
        out["attach"] = ""
    except ValueError as e:
        out["attach"] = str(e)
    return out


def _save_load(model, io, torch):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def lifecycle_rank(rank: int, world: int) -> dict | None:
    out = lifecycle(build_model(TINY, "cpu", tp_group=dist.group.WORLD))
    return out if rank == 0 else None


def batch_invariance_rank(rank: int, world: int) -> dict | None:
    """TP = world: each sequence's log-probs and entropies alone (1 row, 1 token chunk) and inside
    the padded batch, and again packed: the same bits (rank 0's)."""
    import rl_engine_ext as rl

    model = build_model(TINY, "cpu", tp_group=dist.group.WORLD)
    ids, mask, _ = example.make_batch(TINY, "cpu", batch=3, seq=20)
    with torch.no_grad():
        batch_lp, batch_ent = rl.token_logprobs(model, ids, mask, return_entropy=True)
        alone = [rl.token_logprobs(model, ids[b:b + 1, :int(mask[b].sum())], return_entropy=True) for b in range(3)]
    return {"batch": (batch_lp, batch_ent), "mask": mask, "alone": alone} if rank == 0 else None


def fsdp_trainer_rank(rank: int, world: int, dims: dict, device: str = "cpu") -> torch.Tensor:
    """The TP-invariant model (unsharded numerics) under FSDP2 over all ranks, each rank on the
    example's batch: its log-probs (every rank's should be TP = 1's and the TP samplers')."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import rl_engine_ext as rl
    from rl_engine_ext import distributed

    dev = _device(rank, device)
    model = build_model(dims, dev, tp_invariant=True)
    mesh = init_device_mesh(device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    distributed.use_invariant_reduce_scatter(model)
    ids, mask, weights = example.make_batch(dims, dev)
    lp = rl.token_logprobs(model, ids, mask)
    (lp * weights).sum().backward()  # FSDP2's reduce-scatter of the tree-mode gradients runs
    return lp.detach().cpu()


def refusals(rank: int, world: int, cases: tuple[str, ...]) -> dict[str, str]:
    """{case: the ValueError a bad tensor-parallel patch raises on this rank ('' if none)}."""
    import rl_engine_ext as rl

    bad_dims = {"heads": dict(num_key_value_heads=1, num_attention_heads=2), "leaves": dict(intermediate_size=516)}
    out = {}
    for case in cases:
        try:
            model = build_model(dict(TINY, **bad_dims.get(case, {})), "cpu", tp_group=dist.group.WORLD)
            if case == "revert":
                rl.unpatch(model)
            out[case] = ""
        except ValueError as e:
            out[case] = str(e)
    return out
