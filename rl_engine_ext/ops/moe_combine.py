"""moe_combine: public functions, argument checks, references, fake outputs and the op's spec.

    out[t] = round(sum over r = 0 .. k-1 of weights[t, r] * expert_out[positions[t, r]])

the combine of a mixture-of-experts layer: each token's k expert outputs (rows of ``expert_out``
``[R, H]``, e.g. the grouped GEMM's output in expert order) weighted by its router weights
(``[T, k]``, bf16/fp16/fp32; None = 1: the backward of the dispatch gather) and summed in rank
order in fp32, products then sums (no fused multiply-add), one rounding to expert_out's dtype
(csrc/common/moe_combine.h; ``_forward_math`` below is the same arithmetic in PyTorch ops, so the
CPU, the GPU and the reference give the same bits). ``positions`` int64 ``[T, k]``: rows of
expert_out, in [0, R) (IndexError on the CPU, a device-side assert on CUDA).

Backward: grad_expert_out[positions[t, r]] = round(weights[t, r] * grad_out[t]) (rows that no
position names: 0; positions are expected not to repeat; where one does, the last (t, r) in
row-major order owns the row, on every path), grad_weights[t, r] = the dot product of grad_out[t]
and that row in fp32, in a fixed order set by H alone (8-column chunks over 32 lanes, then a fixed
tree), one rounding to weights' dtype. No atomics; each token's results depend only on its own rows.
"""

from __future__ import annotations

import torch

from . import _checks
from .moe_router import lane_tree
from ._spec import Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "moe_combine"
GRAD_OP = "moe_combine_backward"
LANES = 32  # the lanes of grad_weights' H-sum
CHUNK = 8  # columns per lane step


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/moe_combine.h)
# ---------------------------------------------------------------------------------------------


def _check_inputs(op: str, expert_out: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None) -> None:
    _checks.check_dtype(op, "expert_out", expert_out)
    if expert_out.dim() != 2:
        raise _checks.fail(op, f"expert_out must be 2-D [rows, hidden], got shape {list(expert_out.shape)}")
    if positions.dtype != torch.int64:
        raise _checks.fail(op, f"positions must be torch.int64, got {positions.dtype}")
    if positions.dim() != 2:
        raise _checks.fail(op, f"positions must be 2-D [tokens, top_k], got shape {list(positions.shape)}")
    _checks.check_device(op, "positions", positions, "expert_out", expert_out)
    if weights is not None:
        _checks.check_dtype(op, "weights", weights)
        if weights.shape != positions.shape:
            raise _checks.fail(op, f"weights shape {list(weights.shape)} differs from positions shape "
                                   f"{list(positions.shape)}")
        _checks.check_device(op, "weights", weights, "expert_out", expert_out)


def check_moe_combine(expert_out: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None) -> None:
    _check_inputs(OP, expert_out, positions, weights)


def check_moe_combine_backward(grad_out: torch.Tensor, expert_out: torch.Tensor, positions: torch.Tensor,
                               weights: torch.Tensor | None = None) -> None:
    _check_inputs(GRAD_OP, expert_out, positions, weights)
    tokens, hidden = positions.shape[0], expert_out.shape[1]
    if grad_out.dim() != 2 or list(grad_out.shape) != [tokens, hidden]:
        raise _checks.fail(GRAD_OP, f"grad_out shape {list(grad_out.shape)} must be [tokens, hidden] = "
                                    f"[{tokens}, {hidden}]")
    _checks.check_same(GRAD_OP, "grad_out", grad_out, "expert_out", expert_out)


def _check_positions_in_range(op: str, positions: torch.Tensor, rows: int) -> None:
    """The first bad position in row-major order (value-dependent: a fake kernel cannot see it)."""
    flat = positions.reshape(-1)
    bad = (flat < 0) | (flat >= rows)
    if bool(bad.any()):
        first = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(f"rl_align::{op}: position {first} out of range for {rows} rows of expert_out")


# ---------------------------------------------------------------------------------------------
# The arithmetic (csrc/common/moe_combine.h, op for op in PyTorch: the same bits) and the references
# ---------------------------------------------------------------------------------------------


def _forward_math(x: torch.Tensor, positions: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """fp32 [T, H] from fp32 expert rows x [R, H] and fp32 weights (or None)."""
    tokens, k = positions.shape
    acc = x.new_zeros(tokens, x.shape[1])
    for r in range(k):
        term = x.index_select(0, positions[:, r])
        if w is not None:
            term = w[:, r : r + 1] * term
        acc = term if r == 0 else acc + term
    return acc


def owners(positions: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the last t * k + r (row-major) whose position names each row, -1 for none."""
    flat = positions.reshape(-1)
    owner = torch.full((rows,), -1, dtype=torch.int64, device=positions.device)
    return owner.scatter_reduce(0, flat, torch.arange(flat.numel(), device=flat.device), reduce="amax")


def dot_fixed_order(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum over the last dimension of g * x (fp32, broadcast) in the kernels' order: 8-column chunks
    to 32 lanes round robin, each lane's products added onto 0 in column order, then the tree."""
    prod = g * x
    hidden = prod.shape[-1]
    padded = torch.nn.functional.pad(prod, (0, (-hidden) % (LANES * CHUNK)))
    steps = padded.view(*prod.shape[:-1], padded.shape[-1] // (LANES * CHUNK), LANES, CHUNK)
    lanes = prod.new_zeros(*prod.shape[:-1], LANES)
    for c in range(steps.shape[-3]):
        for j in range(CHUNK):
            lanes = lanes + steps[..., c, :, j]
    return lane_tree(lanes)


def reference_moe_combine(expert_out: torch.Tensor, positions: torch.Tensor,
                          weights: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback kernel: the kernels' arithmetic op for op (the same bits)."""
    check_moe_combine(expert_out, positions, weights)
    _check_positions_in_range(OP, positions, expert_out.shape[0])
    w = weights.float() if weights is not None else None
    return _forward_math(expert_out.float(), positions, w).to(expert_out.dtype)


def reference_moe_combine_backward(grad_out: torch.Tensor, expert_out: torch.Tensor, positions: torch.Tensor,
                                   weights: torch.Tensor | None = None):
    check_moe_combine_backward(grad_out, expert_out, positions, weights)
    _check_positions_in_range(GRAD_OP, positions, expert_out.shape[0])
    tokens, k = positions.shape
    rows, hidden = expert_out.shape
    owner = owners(positions, rows)
    named = owner >= 0
    safe = torch.where(named, owner, torch.zeros_like(owner))
    if tokens * k == 0:
        grad_x = expert_out.new_zeros(rows, hidden)
    else:
        g_rows = grad_out.index_select(0, torch.div(safe, k, rounding_mode="floor"))
        if weights is not None:
            g_rows = (weights.float().reshape(-1)[safe].unsqueeze(-1) * g_rows.float()).to(expert_out.dtype)
        grad_x = torch.where(named.unsqueeze(-1), g_rows, torch.zeros_like(g_rows))
    if weights is None:
        return grad_x, expert_out.new_empty(0)
    x = expert_out.float().index_select(0, positions.reshape(-1)).view(tokens, k, hidden)
    grad_w = dot_fixed_order(grad_out.float().unsqueeze(1), x)
    return grad_x, grad_w.to(weights.dtype)


def reference_forward_fp32(expert_out: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None):
    """Ground truth: torch's fp32 gather, product and sum (the expression moe_combine replaces)."""
    check_moe_combine(expert_out, positions, weights)
    _check_positions_in_range(OP, positions, expert_out.shape[0])
    x = expert_out.float()[positions]
    if weights is not None:
        x = x * weights.float().unsqueeze(-1)
    return x.sum(1)


def _setup_context(ctx, inputs, output):
    expert_out, positions, weights = inputs
    ctx.save_for_backward(expert_out, positions, weights)


def _backward(ctx, grad):
    expert_out, positions, weights = ctx.saved_tensors
    grad_x, grad_w = OPS.moe_combine_backward(grad, expert_out, positions, weights)
    return (grad_x if ctx.needs_input_grad[0] else None, None,
            grad_w if weights is not None and ctx.needs_input_grad[2] else None)


def _empty_forward(expert_out, positions, weights=None):
    return expert_out.new_empty((positions.shape[0], expert_out.shape[1]))


def _empty_backward(grad_out, expert_out, positions, weights=None):
    grad_w = weights.new_empty(weights.shape) if weights is not None else expert_out.new_empty(0)
    return expert_out.new_empty(expert_out.shape), grad_w


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def moe_combine(expert_out: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant MoE combine (differentiable in expert_out and weights): ``[T, H]`` in
    expert_out's dtype, ``out[t] = sum_r weights[t, r] * expert_out[positions[t, r]]`` in fp32 in
    rank order, one rounding; ``weights`` None sums the rows (weight 1)."""
    return OPS.moe_combine(expert_out, positions, weights)


def moe_combine_backward(grad_out: torch.Tensor, expert_out: torch.Tensor, positions: torch.Tensor,
                         weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_expert_out in expert_out's dtype, grad_weights in weights' dtype, or an empty [0]
    tensor without weights)."""
    return OPS.moe_combine_backward(grad_out, expert_out, positions, weights)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def dispatch_positions(tokens: int, top_k: int, experts: int, *, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] distinct per token, positions [T, k]): the rows of each (t, r) when the
    T * k assignments are sorted by expert (stably), as a grouped-GEMM dispatch lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    order = torch.sort(ids.reshape(-1), stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel())
    return ids.to(device), positions.view(tokens, top_k).to(device)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for tokens, top_k, hidden, w_dtype in ((5, 2, 128, torch.float32), (7, 8, 4095, dtype), (0, 4, 64, torch.float32),
                                           (3, 0, 16, torch.float32)):
        _, pos = dispatch_positions(tokens, top_k, 16, device=device, seed=61)
        x = seeded_randn(tokens * top_k + 3, hidden, dtype=dtype, device=device, seed=62)
        w = seeded_randn(tokens, top_k, dtype=w_dtype, device=device, seed=63)
        dy = seeded_randn(tokens, hidden, dtype=dtype, device=device, seed=64)
        out += [
            Sample(OP, (x, pos, w)),
            Sample(OP, (x.clone().requires_grad_(), pos, w.clone().requires_grad_())),
            Sample(OP, (x.clone().requires_grad_(), pos, None)),
            Sample(GRAD_OP, (dy, x, pos, w)),
            Sample(GRAD_OP, (dy, x, pos, None)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    x = seeded_randn(8, 16, dtype=torch.bfloat16, device=device, seed=65)
    pos = torch.tensor([[0, 3], [5, 2], [1, 4]], device=device)
    w = torch.ones(3, 2, device=device)
    dy = seeded_randn(3, 16, dtype=torch.bfloat16, device=device, seed=66)
    bad = [
        BadInput(OP, (x.double(), pos, w), ValueError, "unsupported dtype torch.float64 for expert_out"),
        BadInput(OP, (x[0], pos, w), ValueError, r"expert_out must be 2-D \[rows, hidden\], got shape \[16\]"),
        BadInput(OP, (x, pos.int(), w), ValueError, "positions must be torch.int64, got torch.int32"),
        BadInput(OP, (x, pos.float(), w), ValueError, "positions must be torch.int64, got torch.float32"),
        BadInput(OP, (x, pos[0], w), ValueError, r"positions must be 2-D \[tokens, top_k\], got shape \[2\]"),
        BadInput(OP, (x, pos, w[:, :1]), ValueError, r"weights shape \[3, 1\] differs from positions shape \[3, 2\]"),
        BadInput(OP, (x, pos, w.int()), ValueError, "unsupported dtype torch.int32 for weights"),
        BadInput(GRAD_OP, (dy[:2], x, pos, w), ValueError, r"grad_out shape \[2, 16\] must be \[tokens, hidden\] = \[3, 16\]"),
        BadInput(GRAD_OP, (dy[0], x, pos, None), ValueError, r"grad_out shape \[16\] must be"),
        BadInput(GRAD_OP, (dy.float(), x, pos, w), ValueError, "grad_out dtype torch.float32 differs from expert_out dtype"),
        BadInput(GRAD_OP, (dy, x, pos.int(), None), ValueError, "positions must be torch.int64"),
        BadInput(GRAD_OP, (dy, x, pos, w.double()), ValueError, "unsupported dtype torch.float64 for weights"),
    ]
    if device == "cpu":  # on CUDA an out-of-range position is a device-side assert (tests/test_moe_combine.py)
        bad += [
            BadInput(OP, (x, torch.tensor([[0, 3], [8, 2], [-1, 4]]), w), IndexError,
                     "position 8 out of range for 8 rows of expert_out", True),
            BadInput(OP, (x, torch.tensor([[0, 3], [1, 2], [-1, 4]]), None), IndexError,
                     "position -1 out of range for 8 rows of expert_out", True),
            BadInput(GRAD_OP, (dy, x, torch.tensor([[0, 3], [1, 99], [2, 4]]), w), IndexError,
                     "position 99 out of range for 8 rows", True),
        ]
    else:
        bad += [
            BadInput(OP, (x, pos.cpu(), w), RuntimeError, "positions is on cpu"),
            BadInput(OP, (x, pos, w.cpu()), RuntimeError, "weights is on cpu"),
            BadInput(GRAD_OP, (dy.cpu(), x, pos, w), RuntimeError, "grad_out is on cpu"),
        ]
    return bad


def combine_case_fn(top_k: int, experts: int):
    """fn(expert_rows [T, k, H], weights [T, k], ids [T, k]) for the invariance harness: the rows
    laid out in expert order for the batch at hand (so a token's rows sit at other positions in
    every batch), then moe_combine."""

    def fn(expert_rows, weights, ids):
        tokens, k, hidden = expert_rows.shape
        order = torch.sort(ids.reshape(-1), stable=True).indices
        positions = torch.empty_like(order)
        positions[order] = torch.arange(order.numel(), device=order.device)
        expert_out = expert_rows.reshape(tokens * k, hidden)[order]
        return moe_combine(expert_out, positions.view(tokens, k), weights)

    return fn


def _invariance_case(device: str, dtype: torch.dtype, tokens: int, hidden: int, top_k: int) -> InvarianceCase:
    experts = 4 * top_k
    ids, _ = dispatch_positions(tokens, top_k, experts, device=device, seed=tokens)
    rows = seeded_randn(tokens, top_k, hidden, dtype=dtype, device=device, seed=hidden)
    weights = torch.softmax(seeded_randn(tokens, top_k, dtype=torch.float32, device=device, seed=top_k), -1)
    fn = combine_case_fn(top_k, experts)
    flat_pos = torch.arange(tokens * top_k, device=device).view(tokens, top_k)
    expert_out = rows.reshape(tokens * top_k, hidden)
    return InvarianceCase(
        fn=fn,
        rows=[rows, weights, ids],
        accuracy=lambda: (fn(rows, weights, ids), reference_forward_fp32(expert_out, flat_pos, weights)),
    )


def _host_cost_args(device, dims, tokens):
    h = dims["hidden_size"]
    top_k = dims.get("num_experts_per_tok", 8)
    _, pos = dispatch_positions(tokens, top_k, dims.get("num_experts", 128), device=device, seed=1)
    return {OP: (seeded_randn(tokens * top_k, h, dtype=torch.bfloat16, device=device, seed=2).requires_grad_(), pos,
                 seeded_randn(tokens, top_k, dtype=torch.float32, device=device, seed=3).requires_grad_())}


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        # No autocast rule: the torch expression it replaces (index, multiply, sum) has none either
        # (elementwise type promotion). The combine computes in fp32 from any mix of dtypes already
        # and returns expert_out's dtype (the activation dtype under autocast), where torch's
        # promotion would give fp32 for fp32 weights.
        OpDef(OP, check_moe_combine, reference_moe_combine, _empty_forward, Autograd(_setup_context, _backward)),
        OpDef(GRAD_OP, check_moe_combine_backward, reference_moe_combine_backward, _empty_backward),
    ),
    exports={"moe_combine": moe_combine, "moe_combine_backward": moe_combine_backward},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"tokens": 257, "hidden": 2048, "top_k": 8}, {"tokens": 1029, "hidden": 129, "top_k": 2}),
    invariance_case=_invariance_case,
    host_cost_args=_host_cost_args,
)
