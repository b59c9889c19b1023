"""The batch-invariant mixture-of-experts layer, built from rl_align ops.

    out[t] = sum over r = 0 .. k-1 of weights[t, r] * expert_{experts[t, r]}(hidden[t])
    expert_e(x) = down_proj[e] @ (silu(gate) * up),  gate | up = gate_up_proj[e] @ x

``moe_experts`` is what the patched Hugging Face ``*MoeExperts`` modules run (rl_engine_ext/hf.py),
and a function any model can call with its router's choices. The steps:

1. **Sort.** The ``T * k`` (token, rank) pairs, flattened in token-major order (flat index
   ``t * k + r``), are sorted by expert with a stable sort: ties by flat index, so an expert's rows
   are its tokens in token order (rank order within a token). ``positions[t, r]`` is the row where
   pair (t, r) landed (the inverse permutation); the experts' row ranges (group offsets) are the
   sorted ids' ``searchsorted`` of ``0 .. E``: integers, exact.
2. **Dispatch.** Row i of the sorted batch is a copy of its token's hidden state (a gather:
   exact). Its backward sums a token's k row gradients with ``moe_combine(grad, positions, None)``:
   in rank order, fp32, one rounding; no atomics, no ``index_add``.
3. **Experts.** ``grouped_linear`` with ``gate_up_proj`` [E, 2I, H], ``silu_and_mul`` (gate the
   first I columns, up the last I, as transformers' ``chunk(2)``), ``grouped_linear`` with
   ``down_proj`` [E, H, I]: every row is ``linear``'s bits for its expert's weights, whatever the
   number of rows routed to it or to any other expert.
4. **Combine.** ``moe_combine(y, positions, weights)``: the token's k expert outputs times their
   weights summed in rank order in fp32, rounded once to the hidden dtype. ``weights`` enter as
   given (the patched router's are fp32; transformers' own router rounds them to the model dtype
   first).

So a token's output (and its input gradient, under a fixed upstream gradient) depends only on its
own hidden state, its experts and weights: bit for bit the same whatever else is in the batch. The
weight gradients of expert e are ``grouped_linear_grad_weight``'s chain over e's rows in order;
through ``rl_engine_ext.main_grad`` (fp32_grad_accumulation: the experts' ``gate_up_proj`` and
``down_proj`` of transformers' ``*MoeExperts`` modules get ``main_grad``) they chain across
micro-batches, bit for bit the one-batch sum when each expert's rows per micro-batch but the last
are a multiple of LINEAR_GRAD_TILE_TOKENS (64): routing decides that, not the micro-batch size.

No host synchronisation on this path (``validate=False``; the native grouped GEMM reads the
offsets on the device on the sm_90a path; elsewhere it runs one GEMM per expert, which reads them
on the host): decode steps can be captured in CUDA graphs. An expert no token chose has an empty
row range. Expert ids outside [0, E) are not detected with ``validate=False`` (no host read): such a
row is counted with expert 0 (below 0) or E - 1 (E and above), nothing is read or written out of
bounds; ``validate=True`` reads the ids and raises.
"""

from __future__ import annotations

import torch

from . import main_grad as _mg
from .ops.moe_combine import moe_combine
from .ops.silu_and_mul import silu_and_mul

FN = "rl_engine_ext.moe_experts"


class _Dispatch(torch.autograd.Function):
    """x_sorted = hidden[tokens] (row i: a copy of the hidden state of the token whose pair landed
    at row i); the backward sums each token's k rows, named by ``positions`` [T, k], in rank order
    with moe_combine (fp32, one rounding)."""

    @staticmethod
    def forward(hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return hidden.index_select(0, tokens)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return moe_combine(grad.contiguous(), positions, None), None, None


def _check(hidden, experts, weights, gate_up_proj, down_proj) -> None:
    for name, t in (("hidden", hidden), ("experts", experts), ("weights", weights), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{FN}: {name} must be a tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"{FN}: hidden must be 2-D [tokens, hidden], got shape {list(hidden.shape)}")
    tokens, width = hidden.shape
    if experts.dtype != torch.int64 or experts.dim() != 2 or experts.shape[0] != tokens:
        raise ValueError(f"{FN}: experts must be int64 [tokens, k] = [{tokens}, k], got {experts.dtype} "
                         f"{list(experts.shape)}")
    if tuple(weights.shape) != tuple(experts.shape) or not weights.is_floating_point():
        raise ValueError(f"{FN}: weights must be floating point of experts' shape {list(experts.shape)}, got "
                         f"{weights.dtype} {list(weights.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"{FN}: gate_up_proj and down_proj must be 3-D [experts, out, in], got "
                         f"{list(gate_up_proj.shape)} and {list(down_proj.shape)}")
    num_experts, two_i, h = gate_up_proj.shape
    if h != width or two_i % 2 or tuple(down_proj.shape) != (num_experts, width, two_i // 2):
        raise ValueError(f"{FN}: with hidden [{tokens}, {width}], gate_up_proj must be [E, 2I, {width}] and "
                         f"down_proj [E, {width}, I], got {list(gate_up_proj.shape)} and {list(down_proj.shape)}")
    for name, t in (("experts", experts), ("weights", weights), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj)):
        if t.device != hidden.device:
            raise ValueError(f"{FN}: {name} is on {t.device} but hidden is on {hidden.device}")


def moe_experts(hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, *, validate: bool = False) -> torch.Tensor:
    """The experts' weighted sum per token, [T, H] in hidden's dtype (differentiable in hidden,
    weights, gate_up_proj and down_proj): ``hidden`` [T, H]; ``experts`` int64 [T, k], each token's
    k experts in [0, E) (a token may name any subset; an expert nobody names is fine); ``weights``
    [T, k] (fp32 from ``moe_router``; any float dtype); ``gate_up_proj`` [E, 2I, H] (gate rows
    first, then up: transformers' ``*MoeExperts`` layout) and ``down_proj`` [E, H, I] in hidden's
    dtype. Each token's row is bit for bit the same whatever else is in the batch (module doc).
    ``validate=True`` reads the expert ids and the offsets on the host (a synchronisation on
    CUDA) and raises for ids outside [0, E); the default reads nothing on the host."""
    _check(hidden, experts, weights, gate_up_proj, down_proj)
    tokens, k = experts.shape
    num_experts = gate_up_proj.shape[0]
    if validate and experts.numel() and not torch.compiler.is_compiling():
        low, high = int(experts.min()), int(experts.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"{FN}: expert ids must be in [0, {num_experts}), got {low} .. {high}")
    flat = experts.reshape(-1)
    # Stable: an expert's rows are its (token, rank) pairs in flat order (tokens in order).
    ids, order = torch.sort(flat, stable=True)
    rows = torch.arange(flat.numel(), device=flat.device)
    positions = torch.empty_like(order).scatter_(0, order, rows).view(tokens, k)
    # Offsets from the sorted ids: [E + 1], no data-dependent size, no host read (bincount reads
    # the largest id on the host on CUDA).
    offsets = torch.searchsorted(ids, torch.arange(num_experts + 1, device=flat.device, dtype=ids.dtype))
    x = _Dispatch.apply(hidden, torch.div(order, k, rounding_mode="floor"), positions)
    h = _mg.grouped_linear(x, gate_up_proj, offsets, validate)
    y = _mg.grouped_linear(silu_and_mul(h), down_proj, offsets, validate)
    return moe_combine(y, positions, weights)
