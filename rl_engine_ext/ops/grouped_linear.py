"""grouped_linear: the mixture-of-experts expert GEMMs, one launch for every expert.

    y[i] = x[i] @ weight[e].T        for the rows i of expert e: group_offsets[e] <= i < group_offsets[e + 1]

x [T, K] holds the tokens (token copies, one per routed expert) sorted by expert, ``group_offsets``
[E + 1] (int32 / int64) the experts' row ranges, weight [E, N, K] the experts' weights (transformers'
``gate_up_proj`` / ``down_proj`` layout: expert e's is an nn.Linear weight [N, K]). No bias.

Invariance: row i of expert e is ``linear(x[i], weight[e])`` bit for bit: the same fp32 chain over K
in the same k16 chunks, whatever the number of rows routed to e or to any other expert, on every
path (one grouped launch on sm_90a; elsewhere one linear GEMM per expert). The input gradient
likewise (``linear_grad_input``'s bits per row). The weight gradient of expert e is
``linear_grad_weight`` over that expert's rows in order (its own chain over its tokens, from
``dweight_accum[e]`` or zero): run-to-run identical, and chainable across micro-batches through
``dweight_accum`` (bit for bit the one-pass sum when each expert's tokens per micro-batch but the
last are a multiple of ``LINEAR_GRAD_TILE_TOKENS``, as for linear). No split-K, no atomics.

``validate=True`` reads the offsets on the host (a synchronisation on CUDA) and raises for offsets
that do not start at 0, decrease, or end elsewhere than T. ``validate=False`` reads them on the
device only: offsets[0] and offsets[E] are taken as 0 and T, and each other offset is clamped into
[previous offset, T], so every row belongs to exactly one expert and nothing is read or written out
of bounds; valid offsets give the validated result. (Off the sm_90a path the per-expert GEMMs need
the offsets on the host: a synchronisation either way.)
"""

from __future__ import annotations

import torch

from . import _checks
from ._spec import Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads, ParamModule, Sample, param_grad, seeded_randn
from .linear import LINEAR_GRAD_TILE_TOKENS, _matmul_fp32, reference_grad_weight

OP = "grouped_linear"
GRAD_INPUT_OP = "grouped_linear_grad_input"
GRAD_WEIGHT_OP = "grouped_linear_grad_weight"

# The kind of module whose 3-D expert weights grouped_linear takes: transformers' *MoeExperts
# (gate_up_proj [E, 2I, H], down_proj [E, H, I]), for rl_engine_ext.main_grad.
EXPERTS_MODULE = ParamModule(
    "MoE experts", lambda module: type(module).__name__.endswith("MoeExperts")
    and isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter), ("gate_up_proj", "down_proj"))


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/grouped_linear.h)
# ---------------------------------------------------------------------------------------------


def _check_weight(op: str, weight: torch.Tensor) -> None:
    _checks.check_dtype(op, "weight", weight)
    if weight.dim() != 3:
        raise _checks.fail(op, f"weight must be 3-D [experts, out, in], got shape {list(weight.shape)}")


def _check_offsets(op: str, group_offsets: torch.Tensor, experts: int, ref: torch.Tensor) -> None:
    _checks.check_device(op, "group_offsets", group_offsets, "x" if op != GRAD_INPUT_OP else "grad_out", ref)
    if group_offsets.dtype not in (torch.int32, torch.int64):
        raise _checks.fail(op, f"group_offsets must be int32 or int64, got {group_offsets.dtype}")
    if group_offsets.dim() != 1 or group_offsets.shape[0] != experts + 1:
        raise _checks.fail(op, f"group_offsets must have shape [{experts + 1}] (experts + 1), "
                               f"got {list(group_offsets.shape)}")


def _validate_offsets(op: str, group_offsets: torch.Tensor, rows: int, validate: bool) -> None:
    """validate=True: the offsets' values (the references read them on the host; the fake kernel sees
    no values)."""
    if not validate:
        return
    o = group_offsets.cpu().long()
    if o[0] != 0 or o[-1] != rows:
        raise _checks.fail(op, f"group_offsets must start at 0 and end at the number of rows ({rows}), got "
                               f"{int(o[0])} .. {int(o[-1])}")
    if bool((o[1:] < o[:-1]).any()):
        raise _checks.fail(op, "group_offsets must be non-decreasing")


def _check_rows(op: str, name: str, t: torch.Tensor) -> None:
    _checks.check_dtype(op, name, t)
    if t.dim() != 2:
        raise _checks.fail(op, f"{name} must be 2-D [rows, features], got shape {list(t.shape)}")


def check_grouped_linear(x, weight, group_offsets, validate=True) -> None:
    _check_rows(OP, "x", x)
    _check_weight(OP, weight)
    if weight.shape[2] != x.shape[1]:
        raise _checks.fail(OP, f"weight is {list(weight.shape)} ([experts, out, in]) but x's last dimension is {x.shape[1]}")
    _checks.check_same(OP, "weight", weight, "x", x)
    _check_offsets(OP, group_offsets, weight.shape[0], x)


def check_grouped_linear_grad_input(grad_out, weight, group_offsets, validate=True) -> None:
    _check_rows(GRAD_INPUT_OP, "grad_out", grad_out)
    _check_weight(GRAD_INPUT_OP, weight)
    if grad_out.shape[1] != weight.shape[1]:
        raise _checks.fail(GRAD_INPUT_OP, f"grad_out's last dimension must be weight.size(1) = {weight.shape[1]}, "
                                          f"got shape {list(grad_out.shape)}")
    _checks.check_same(GRAD_INPUT_OP, "weight", weight, "grad_out", grad_out)
    _check_offsets(GRAD_INPUT_OP, group_offsets, weight.shape[0], grad_out)


def check_grouped_linear_grad_weight(grad_out, x, group_offsets, dweight_accum=None, validate=True,
                                     fp32_param_grad=True) -> None:
    op = GRAD_WEIGHT_OP
    _check_rows(op, "grad_out", grad_out)
    _check_rows(op, "x", x)
    if grad_out.shape[0] != x.shape[0]:
        raise _checks.fail(op, f"grad_out {list(grad_out.shape)} and x {list(x.shape)} must have the same rows")
    _checks.check_same(op, "x", x, "grad_out", grad_out)
    experts = group_offsets.shape[0] - 1 if group_offsets.dim() == 1 else -1
    if experts < 0:
        raise _checks.fail(op, f"group_offsets must be 1-D [experts + 1], got shape {list(group_offsets.shape)}")
    _check_offsets(op, group_offsets, experts, x)
    _checks.check_fp32_accum(op, "dweight_accum", dweight_accum, (experts, grad_out.shape[1], x.shape[1]), x)
    if dweight_accum is not None and not fp32_param_grad:
        raise _checks.fail(op, "dweight_accum needs fp32_param_grad=True (the chain continues in fp32)")


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def device_offsets(group_offsets: torch.Tensor, rows: int) -> list[int]:
    """The offsets as the kernels read them without validation: 0, each clamped into [previous, rows],
    rows (valid offsets unchanged)."""
    o = group_offsets.cpu().long().tolist()
    out = [0]
    for v in o[1:-1]:
        out.append(min(max(v, out[-1]), rows))
    return out + [rows] if len(o) > 1 else out


def _groups(group_offsets: torch.Tensor, rows: int):
    o = device_offsets(group_offsets, rows)
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1)]


def reference_grouped_linear(x, weight, group_offsets, validate=True) -> torch.Tensor:
    """Per expert, linear's dtype path (fp32 sums in PyTorch's order, one rounding)."""
    check_grouped_linear(x, weight, group_offsets, validate)
    _validate_offsets(OP, group_offsets, x.shape[0], validate)
    y = x.new_empty(x.shape[0], weight.shape[1])
    for e, a, b in _groups(group_offsets, x.shape[0]):
        y[a:b] = _matmul_fp32(x[a:b], weight[e].t()).to(x.dtype)
    return y


def reference_grouped_linear_fp32(x, weight, group_offsets, validate=True) -> torch.Tensor:
    check_grouped_linear(x, weight, group_offsets, validate)
    _validate_offsets(OP, group_offsets, x.shape[0], validate)
    y = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float32, device=x.device)
    for e, a, b in _groups(group_offsets, x.shape[0]):
        y[a:b] = _matmul_fp32(x[a:b].float(), weight[e].float().t())
    return y


def reference_grouped_linear_grad_input(grad_out, weight, group_offsets, validate=True) -> torch.Tensor:
    check_grouped_linear_grad_input(grad_out, weight, group_offsets, validate)
    _validate_offsets(GRAD_INPUT_OP, group_offsets, grad_out.shape[0], validate)
    dx = grad_out.new_empty(grad_out.shape[0], weight.shape[2])
    for e, a, b in _groups(group_offsets, grad_out.shape[0]):
        dx[a:b] = _matmul_fp32(grad_out[a:b], weight[e]).to(grad_out.dtype)
    return dx


def reference_grouped_linear_grad_weight(grad_out, x, group_offsets, dweight_accum=None, validate=True,
                                         fp32_param_grad=True) -> torch.Tensor:
    """Per expert, linear_grad_weight's reference over the expert's rows (rounded once to x's dtype
    without fp32_param_grad)."""
    check_grouped_linear_grad_weight(grad_out, x, group_offsets, dweight_accum, validate, fp32_param_grad)
    _validate_offsets(GRAD_WEIGHT_OP, group_offsets, x.shape[0], validate)
    experts = group_offsets.shape[0] - 1
    dw = torch.empty(experts, grad_out.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    for e, a, b in _groups(group_offsets, x.shape[0]):
        dw[e] = reference_grad_weight(grad_out[a:b], x[a:b], None if dweight_accum is None else dweight_accum[e])
    return dw if fp32_param_grad else dw.to(x.dtype)


def _empty_forward(x, weight, group_offsets, validate=True):
    return x.new_empty((x.shape[0], weight.shape[1]))


def _empty_grad_input(grad_out, weight, group_offsets, validate=True):
    return grad_out.new_empty((grad_out.shape[0], weight.shape[2]))


def _empty_grad_weight(grad_out, x, group_offsets, dweight_accum=None, validate=True, fp32_param_grad=True):
    return x.new_empty((group_offsets.shape[0] - 1, grad_out.shape[1], x.shape[1]),
                       dtype=torch.float32 if fp32_param_grad else x.dtype)


def _setup_context(ctx, inputs, output):
    x, weight, group_offsets, validate = inputs
    ctx.save_for_backward(x, weight, group_offsets)
    # The forward validated the offsets (or chose not to): the backward reads them on the device.
    ctx.validate = False


def _backward(ctx, grad, accums=None):
    x, weight, group_offsets = ctx.saved_tensors
    (weight_accum,) = accums or (None,)
    grad = grad.contiguous()
    dx = OPS.grouped_linear_grad_input(grad, weight, group_offsets, ctx.validate) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        # Autograd: the kernel rounds the fp32 sums to the weight's dtype itself (the bits of
        # param_grad's cast, without the fp32 tensor); main_grad: the fp32 chain.
        dw = OPS.grouped_linear_grad_weight(grad, x, group_offsets, weight_accum, ctx.validate, accums is not None)
        dw = param_grad(dw, weight.dtype, accums)
    return dx, dw, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
                   validate: bool = True) -> torch.Tensor:
    """Per-expert ``x @ weight[e].T`` over the experts' row ranges (differentiable in x and weight):
    every row linear's bits (module docstring)."""
    return OPS.grouped_linear(x, weight, group_offsets, validate)


def grouped_linear_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
                              validate: bool = True) -> torch.Tensor:
    """Per-expert ``grad_out @ weight[e]``: each row linear_grad_input's bits."""
    return OPS.grouped_linear_grad_input(grad_out, weight, group_offsets, validate)


def grouped_linear_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, group_offsets: torch.Tensor,
                               dweight_accum: torch.Tensor | None = None, validate: bool = True,
                               fp32_param_grad: bool = True) -> torch.Tensor:
    """fp32 [E, N, K]: expert e's ``dweight_accum[e] (or 0) + grad_out[rows]^T @ x[rows]``, linear_grad_weight's
    chain over its rows (an expert without rows keeps its accumulator, or 0); ``fp32_param_grad=False``:
    rounded once to x's dtype."""
    return OPS.grouped_linear_grad_weight(grad_out, x, group_offsets, dweight_accum, validate, fp32_param_grad)


def expert_offsets(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts + 1] group offsets of rows sorted by expert id (``expert_ids`` any shape of
    ids in [0, num_experts)): 0, then the running counts. On the ids' device, no synchronisation
    (torch.bincount reads the largest id on the host; integer scatter-adds are exact in any order)."""
    ids = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _autocast_args(device, act):
    return (seeded_randn(7, 40, dtype=act, device=device, seed=1).requires_grad_(),
            seeded_randn(3, 24, 40, dtype=torch.float32, device=device, seed=2, scale=40**-0.5).requires_grad_(),
            _offsets([2, 0, 5], device))


def _per_expert_linear(x, weight, group_offsets):
    """torch's counterpart: F.linear per expert over its rows."""
    return torch.cat([torch.nn.functional.linear(x[a:b], weight[e]) for e, a, b in _groups(group_offsets, x.shape[0])])


def _offsets(counts: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int64, device=device)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    w = seeded_randn(4, 24, 40, dtype=dtype, device=device, seed=1, scale=40**-0.5)
    x = seeded_randn(13, 40, dtype=dtype, device=device, seed=2)
    dy = seeded_randn(13, 24, dtype=dtype, device=device, seed=3)
    offs = _offsets([5, 0, 7, 1], device)
    return [
        Sample(OP, (x, w, offs, True)),
        Sample(OP, (x.clone().requires_grad_(), w.clone().requires_grad_(), offs, True)),
        Sample(OP, (x, w, offs.int(), False)),
        Sample(OP, (torch.empty(0, 40, dtype=dtype, device=device), w, _offsets([0, 0, 0, 0], device), True)),
        Sample(GRAD_INPUT_OP, (dy, w, offs, True)),
        Sample(GRAD_WEIGHT_OP, (dy, x, offs, None, True, True)),
        Sample(GRAD_WEIGHT_OP, (dy, x, offs, None, True, False)),
        Sample(GRAD_WEIGHT_OP, (dy, x, offs, torch.ones(4, 24, 40, device=device), False, True)),
    ]


def _bad_inputs(device: str) -> list[BadInput]:
    x = torch.ones(5, 8, device=device)
    w = torch.ones(2, 4, 8, device=device)
    dy = torch.ones(5, 4, device=device)
    offs = torch.tensor([0, 2, 5], device=device)
    bad = [
        BadInput(OP, (x.double(), w.double(), offs, True), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput(OP, (x, w[0], offs, True), ValueError, "weight must be 3-D"),
        BadInput(OP, (x[None], w, offs, True), ValueError, "x must be 2-D"),
        BadInput(OP, (torch.ones(5, 7, device=device), w, offs, True), ValueError, "last dimension"),
        BadInput(OP, (x.bfloat16(), w, offs, True), ValueError, "weight dtype torch.float32 differs from x dtype"),
        BadInput(OP, (x, w, offs.float(), True), ValueError, "group_offsets must be int32 or int64"),
        BadInput(OP, (x, w, offs[:2], True), ValueError, r"group_offsets must have shape \[3\]"),
        BadInput(OP, (x, w, torch.tensor([0, 2, 4], device=device), True), ValueError,
                 "must start at 0 and end at the number of rows", value_dependent=True),
        BadInput(OP, (x, w, torch.tensor([0, 4, 2, 5], device=device), True), ValueError,
                 r"group_offsets must have shape \[3\]"),
        BadInput(OP, (x, torch.ones(3, 4, 8, device=device), torch.tensor([0, 4, 2, 5], device=device), True),
                 ValueError, "non-decreasing", value_dependent=True),
        BadInput(GRAD_INPUT_OP, (torch.ones(5, 3, device=device), w, offs, True), ValueError, "last dimension"),
        BadInput(GRAD_WEIGHT_OP, (dy, torch.ones(4, 8, device=device), offs, None, True, True), ValueError, "same rows"),
        BadInput(GRAD_WEIGHT_OP, (dy, x, offs, torch.ones(2, 4, 8, device=device).bfloat16(), True, True), ValueError,
                 "dweight_accum must be torch.float32"),
        BadInput(GRAD_WEIGHT_OP, (dy, x, offs, torch.ones(2, 8, 4, device=device), True, True), ValueError,
                 "dweight_accum must have shape"),
        BadInput(GRAD_WEIGHT_OP, (dy, x, offs, torch.ones(2, 4, 8, device=device), True, False), ValueError,
                 "dweight_accum needs fp32_param_grad=True"),
    ]
    if device != "cpu":
        bad += [
            BadInput(OP, (x, w.cpu(), offs, True), RuntimeError, "weight is on cpu"),
            BadInput(OP, (x, w, offs.cpu(), True), RuntimeError, "group_offsets is on cpu"),
        ]
    return bad


def _routed(x: torch.Tensor, experts: int) -> torch.Tensor:
    """A token's expert from its own values (the invariance case's router): the sign pattern of two features."""
    return ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()) % experts


def _invariance_case(device: str, dtype: torch.dtype, rows: int, experts: int, out_features: int,
                     in_features: int) -> InvarianceCase:
    x = seeded_randn(rows, in_features, dtype=dtype, device=device, seed=rows)
    weight = seeded_randn(experts, out_features, in_features, dtype=dtype, device=device, seed=in_features,
                          scale=in_features**-0.5)

    def fn(x):
        # Each token routed by its own values, sorted by expert, through the grouped GEMM, unsorted:
        # a token's row must not depend on the others (how many share its expert, or precede it).
        ids = _routed(x, experts)
        order = torch.sort(ids, stable=True).indices
        y = grouped_linear(x[order], weight, expert_offsets(ids, experts))
        return y[torch.argsort(order)]

    def accuracy():
        ids = _routed(x, experts)
        order = torch.sort(ids, stable=True).indices
        offs = expert_offsets(ids, experts)
        return (grouped_linear(x[order], weight, offs), reference_grouped_linear_fp32(x[order], weight, offs))

    # The weight gradient is a sum over each expert's tokens, whose chains padding rows before the batch
    # would enter at random experts: tests/test_grouped_linear.py checks it (bitwise per expert,
    # chaining, run to run); the harness checks the rows and their input gradients.
    return InvarianceCase(fn=fn, rows=[x], accuracy=accuracy)


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef(OP, check_grouped_linear, reference_grouped_linear, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((1,), EXPERTS_MODULE)), Autocast.LOWER_PRECISION),
        OpDef(GRAD_INPUT_OP, check_grouped_linear_grad_input, reference_grouped_linear_grad_input, _empty_grad_input),
        OpDef(GRAD_WEIGHT_OP, check_grouped_linear_grad_weight, reference_grouped_linear_grad_weight, _empty_grad_weight),
    ),
    exports={
        "grouped_linear": grouped_linear,
        "grouped_linear_grad_input": grouped_linear_grad_input,
        "grouped_linear_grad_weight": grouped_linear_grad_weight,
        "expert_offsets": expert_offsets,
    },
    reference_fp32=reference_grouped_linear_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "experts": 4, "out_features": 384, "in_features": 256},
                  {"rows": 70, "experts": 3, "out_features": 40, "in_features": 96}),
    invariance_case=_invariance_case,
    autocast_cases=(AutocastCase(OP, _autocast_args, grouped_linear, _per_expert_linear),),
)
