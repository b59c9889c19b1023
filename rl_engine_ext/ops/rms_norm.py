"""rms_norm: public functions, argument checks, references, fake outputs and the op's spec.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight

fp32 math, one rounding to x.dtype at the end; x is ``[..., H]`` (hidden states with H=4096,
or per-head QK-norm on ``[B, S, heads, 128]``), weight is ``[H]`` in x's dtype.

Invariance (native kernels): each row's output and input gradient depend only on that row.
dweight is a sum over rows taken over fixed tiles of ``rms_norm_tile_rows(H)`` rows, tiles
added to one fp32 accumulator in row order: run-to-run identical, unchanged by zero-gradient
rows appended after the batch (or inserted in whole tiles), and chainable through
``rms_norm_backward(..., dweight_accum=...)`` across micro-batches whose row counts are
multiples of the tile.
"""

from __future__ import annotations

import torch

from .. import contract, testing
from . import _checks
from ._spec import Autograd, BadInput, InvarianceCase, OpDef, OpSpec, Sample, seeded_randn

OP = "rms_norm"

# Shared with csrc/common/rms_norm_partition.h (exported by the native library under these names).
RMS_NORM_TILE_ELEMENTS = 131072
RMS_NORM_MIN_TILE_ROWS = 32


def rms_norm_tile_rows(hidden: int) -> int:
    """Rows per dweight tile for hidden size ``hidden``: the micro-batch chaining granularity."""
    rows = RMS_NORM_MIN_TILE_ROWS
    while hidden > 0 and rows * 2 * hidden <= RMS_NORM_TILE_ELEMENTS:
        rows *= 2
    return rows


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/rms_norm.h)
# ---------------------------------------------------------------------------------------------


def _check_forward_args(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _checks.check_dtype(op, "x", x)
    _checks.check_dtype(op, "weight", weight)
    if x.dim() < 1:
        raise _checks.fail(op, "x must have at least one dimension")
    if weight.dim() != 1:
        raise _checks.fail(op, f"weight must be 1-D, got shape {list(weight.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise _checks.fail(op, f"weight has {weight.shape[0]} elements but x's last dimension is {x.shape[-1]}")
    if weight.dtype != x.dtype:
        raise _checks.fail(op, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    _checks.check_device(op, "x", x, "weight", weight)
    if eps < 0:
        raise _checks.fail(op, f"eps must be >= 0, got {eps}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_forward_args(OP, x, weight, eps)


def check_rms_norm_backward(grad_out, x, weight, eps, dweight_accum=None) -> None:
    op = "rms_norm_backward"
    _check_forward_args(op, x, weight, eps)
    if grad_out.shape != x.shape:
        raise _checks.fail(op, f"grad_out shape {list(grad_out.shape)} differs from x shape {list(x.shape)}")
    if grad_out.dtype != x.dtype:
        raise _checks.fail(op, f"grad_out dtype {grad_out.dtype} differs from x dtype {x.dtype}")
    _checks.check_device(op, "grad_out", grad_out, "x", x)
    _checks.check_fp32_accum(op, "dweight_accum", dweight_accum, (weight.shape[0],), x, ref_name="x")


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def _normalize_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * inv_rms * weight.float()


def reference_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The dtype path: fp32 math, one rounding to x.dtype (what the kernels compute)."""
    check_rms_norm(x, weight, eps)
    return _normalize_fp32(x, weight, eps).to(x.dtype)


def reference_forward_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast and TF32 off."""
    check_rms_norm(x, weight, eps)
    with contract.fp32_reference_mode():
        return _normalize_fp32(x.float(), weight.float(), eps)


def reference_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    dweight_accum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in PyTorch ops, with the kernels' tile-sequential dweight (fp32)."""
    check_rms_norm_backward(grad_out, x, weight, eps, dweight_accum)
    hidden = x.shape[-1]
    xf = x.float().reshape(-1, hidden)
    g = grad_out.float().reshape(-1, hidden)
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * inv_rms
    gw = g * weight.float()
    c = (gw * xhat).mean(-1, keepdim=True)
    grad_x = (inv_rms * (gw - xhat * c)).to(x.dtype).reshape(x.shape)
    dweight = (
        dweight_accum.float().clone()
        if dweight_accum is not None
        else torch.zeros(hidden, dtype=torch.float32, device=x.device)
    )
    tile = rms_norm_tile_rows(hidden)
    for start in range(0, xf.shape[0], tile):
        dweight = dweight + (g[start : start + tile] * xhat[start : start + tile]).sum(0)
    return grad_x, dweight


def _empty_forward(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _empty_backward(grad_out, x, weight, eps, dweight_accum=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[-1],), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.rl_align.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps, None)
    return (grad_x if ctx.needs_input_grad[0] else None,
            grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dimension (differentiable)."""
    return torch.ops.rl_align.rms_norm(x, weight, eps)


def rms_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    dweight_accum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight fp32) with grad_weight = dweight_accum (or 0) + this batch's sum.

    Chaining: feeding each micro-batch's grad_weight into the next call's ``dweight_accum``
    reproduces the one-batch result bit for bit when every micro-batch but the last has a
    multiple of ``rms_norm_tile_rows(H)`` rows.
    """
    return torch.ops.rl_align.rms_norm_backward(grad_out, x, weight, eps, dweight_accum)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------

EPS = 1e-6


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape in ((5, 128), (2, 3, 4095), (0, 64)):
        x = seeded_randn(*shape, dtype=dtype, device=device, seed=22)
        w = seeded_randn(shape[-1], dtype=dtype, device=device, seed=23)
        dy = seeded_randn(*shape, dtype=dtype, device=device, seed=24)
        acc = seeded_randn(shape[-1], dtype=torch.float32, device=device, seed=25)
        out += [
            Sample("rms_norm", (x, w, EPS)),
            Sample("rms_norm", (x.clone().requires_grad_(), w.clone().requires_grad_(), EPS)),
            Sample("rms_norm_backward", (dy, x, w, EPS, None)),
            Sample("rms_norm_backward", (dy, x, w, EPS, acc)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    x = seeded_randn(4, 16, dtype=torch.bfloat16, device=device, seed=18)
    w = seeded_randn(16, dtype=torch.bfloat16, device=device, seed=19)
    acc = torch.zeros(16, device=device)
    bad = [
        BadInput("rms_norm", (x, w[:15], EPS), ValueError, "weight has 15 elements"),
        BadInput("rms_norm", (x, w.view(2, 8), EPS), ValueError, "weight must be 1-D"),
        BadInput("rms_norm", (x, w.float(), EPS), ValueError, "weight dtype torch.float32 differs from x dtype"),
        BadInput("rms_norm", (x, w, -1.0), ValueError, "eps must be >= 0"),
        BadInput("rms_norm", (x[0, 0], w[:1], EPS), ValueError, "at least one dimension"),
        BadInput("rms_norm", (x.double(), w.double(), EPS), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput("rms_norm", (x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), EPS), ValueError,
                 "unsupported dtype torch.float8_e4m3fn"),
        BadInput("rms_norm_backward", (x[:3], x, w, EPS, None), ValueError, "grad_out shape"),
        BadInput("rms_norm_backward", (x.float(), x, w, EPS, None), ValueError, "grad_out dtype"),
        BadInput("rms_norm_backward", (x, x, w, EPS, acc.bfloat16()), ValueError, "dweight_accum must be torch.float32"),
        BadInput("rms_norm_backward", (x, x, w, EPS, acc[:15]), ValueError, r"dweight_accum must have shape \[16\]"),
        BadInput("rms_norm_backward", (x.int(), x.int(), w.int(), EPS, None), ValueError, "unsupported dtype torch.int32"),
    ]
    if device != "cpu":
        bad += [
            BadInput("rms_norm", (x, w.cpu(), EPS), RuntimeError, "weight is on cpu"),
            BadInput("rms_norm_backward", (x.cpu(), x, w, EPS, None), RuntimeError, "grad_out is on cpu"),
            BadInput("rms_norm_backward", (x, x, w, EPS, acc.cpu()), RuntimeError, "dweight_accum is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, hidden: int) -> InvarianceCase:
    x = seeded_randn(rows, hidden, dtype=dtype, device=device, seed=rows, scale=2.0)
    weight = seeded_randn(hidden, dtype=dtype, device=device, seed=hidden, scale=0.5) + 1

    def chain(row_inputs, cotangents, accum):
        _, dweight = rms_norm_backward(cotangents[0], row_inputs[0], weight, EPS, None if accum is None else accum["weight"])
        return {"weight": dweight}

    return InvarianceCase(
        fn=lambda x, weight: rms_norm(x, weight, EPS),
        rows=[x],
        params={"weight": weight},
        weight_grad_tile=rms_norm_tile_rows(hidden),
        weight_grad_chain=chain,
        accuracy=lambda: (rms_norm(x, weight, EPS), reference_forward_fp32(x, weight, EPS)),
    )


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef("rms_norm", check_rms_norm, reference_forward, _empty_forward, Autograd(_setup_context, _backward)),
        OpDef("rms_norm_backward", check_rms_norm_backward, reference_backward, _empty_backward),
    ),
    exports={"rms_norm": rms_norm, "rms_norm_backward": rms_norm_backward, "rms_norm_tile_rows": rms_norm_tile_rows},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "hidden": 4096}, {"rows": 1029, "hidden": 128}),
    invariance_case=_invariance_case,
    constants={"RMS_NORM_TILE_ELEMENTS": RMS_NORM_TILE_ELEMENTS, "RMS_NORM_MIN_TILE_ROWS": RMS_NORM_MIN_TILE_ROWS},
)
