"""rms_norm: public functions, argument checks, references, fake outputs and the op's spec.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight

fp32 math; x is ``[..., H]`` (hidden states with H=4096, or per-head QK-norm on
``[B, S, heads, 128]``), weight is ``[H]`` in x's dtype. ``mode`` picks the model's casting
(csrc/common/rms_norm_mode.h), with xhat = x * rsqrt(mean(x^2) + eps) in fp32:

* ``"fp32"`` (default): ``round(xhat * w)``, one rounding to x.dtype;
* ``"llama"``: Hugging Face LlamaRMSNorm / Qwen3RMSNorm, ``round(round(xhat) * w)``;
* ``"gemma"``: Hugging Face GemmaRMSNorm, ``round(xhat * (1 + w))`` with ``1 + w`` in fp32.

Invariance (native kernels): each row's output and input gradient depend only on that row.
dweight is a sum over rows taken over fixed tiles of ``rms_norm_tile_rows(H)`` rows, tiles
added to one fp32 accumulator in row order: run-to-run identical, unchanged by zero-gradient
rows appended after the batch (or inserted in whole tiles), and chainable through
``rms_norm_backward(..., dweight_accum=...)`` across micro-batches whose row counts are
multiples of the tile.
"""

from __future__ import annotations

import math

import torch

from .. import contract, testing
from . import _checks
from ._spec import (Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads,
                    ParamModule, Sample, param_grad, seeded_randn)

OP = "rms_norm"
MODES = ("fp32", "llama", "gemma")

# Shared with csrc/common/rms_norm_partition.h (exported by the native library under these names).
RMS_NORM_TILE_ELEMENTS = 131072
RMS_NORM_MIN_TILE_ROWS = 32


def rms_norm_tile_rows(hidden: int) -> int:
    """Rows per dweight tile for hidden size ``hidden``: the micro-batch chaining granularity."""
    rows = RMS_NORM_MIN_TILE_ROWS
    while hidden > 0 and rows * 2 * hidden <= RMS_NORM_TILE_ELEMENTS:
        rows *= 2
    return rows


def is_rms_norm_like(module: torch.nn.Module) -> bool:
    """A 1-D weight and an epsilon (HF's ``variance_epsilon``, or ``eps``). torch.nn's own modules
    with those (LayerNorm, GroupNorm, the batch and instance norms) count only if nn.RMSNorm."""
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, torch.nn.Parameter) and weight.dim() == 1):
        return False
    if not (hasattr(module, "variance_epsilon") or hasattr(module, "eps")):
        return False
    return isinstance(module, torch.nn.RMSNorm) or not type(module).__module__.startswith("torch.nn.")


# The module whose weight rms_norm and add_rms_norm take.
RMS_NORM_MODULE = ParamModule("RMSNorm", is_rms_norm_like, ("weight",))


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/rms_norm.h)
# ---------------------------------------------------------------------------------------------


def check_mode(op: str, mode: str) -> None:
    if mode not in MODES:
        raise _checks.fail(op, f"mode must be 'fp32', 'llama' or 'gemma', got '{mode}'")


def check_forward_args(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, x_name: str = "x") -> None:
    """The checks of the normalised input and the weight (``x_name``: its name in op's schema)."""
    _checks.check_dtype(op, x_name, x)
    _checks.check_dtype(op, "weight", weight)
    if x.dim() < 1:
        raise _checks.fail(op, f"{x_name} must have at least one dimension")
    if weight.dim() != 1:
        raise _checks.fail(op, f"weight must be 1-D, got shape {list(weight.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise _checks.fail(op, f"weight has {weight.shape[0]} elements but {x_name}'s last dimension is {x.shape[-1]}")
    if weight.dtype != x.dtype:
        raise _checks.fail(op, f"weight dtype {weight.dtype} differs from {x_name} dtype {x.dtype}")
    _checks.check_device(op, x_name, x, "weight", weight)
    if not eps >= 0:  # NaN too, as the C++ check
        raise _checks.fail(op, f"eps must be >= 0, got {eps:g}")


def check_like_x(op: str, name: str, t: torch.Tensor, x_name: str, x: torch.Tensor) -> None:
    """A tensor of x's shape, dtype and device (grad_out, residual, grad_residual)."""
    if t.shape != x.shape:
        raise _checks.fail(op, f"{name} shape {list(t.shape)} differs from {x_name} shape {list(x.shape)}")
    _checks.check_same(op, name, t, x_name, x)


def check_backward_args(op, grad_name, grad_out, x_name, x, weight, eps, dweight_accum) -> None:
    check_forward_args(op, x, weight, eps, x_name)
    check_like_x(op, grad_name, grad_out, x_name, x)
    _checks.check_fp32_accum(op, "dweight_accum", dweight_accum, (weight.shape[0],), x, ref_name=x_name)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str = "fp32") -> None:
    check_forward_args(OP, x, weight, eps)
    check_mode(OP, mode)


def check_rms_norm_backward(grad_out, x, weight, eps, dweight_accum=None, mode="fp32") -> None:
    op = "rms_norm_backward"
    check_backward_args(op, "grad_out", grad_out, "x", x, weight, eps, dweight_accum)
    check_mode(op, mode)


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _weight_factor(weight: torch.Tensor, mode: str) -> torch.Tensor:
    w = weight.float()
    return 1.0 + w if mode == "gemma" else w


def normalize(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """fp32 y of ``mode`` before its final rounding; ``dtype`` is the llama mode's rounding of xhat."""
    xhat = x.float() * _inv_rms(x.float(), eps)
    if mode == "llama":
        return xhat.to(dtype).float() * weight.float()
    return xhat * _weight_factor(weight, mode)


def reference_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: str = "fp32") -> torch.Tensor:
    """The dtype path: fp32 math, the mode's roundings to x.dtype (what the kernels compute)."""
    check_rms_norm(x, weight, eps, mode)
    return normalize(x, weight, eps, mode, x.dtype).to(x.dtype)


def reference_forward_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: str = "fp32") -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast and TF32 off."""
    check_rms_norm(x, weight, eps, mode)
    with contract.fp32_reference_mode():
        return normalize(x.float(), weight.float(), eps, mode, torch.float32)


def backward_math(grad_out, x, weight, eps, dweight_accum, mode):
    """(grad_x rounded to x.dtype, tile-sequential fp32 dweight); arguments already checked."""
    hidden = x.shape[-1]
    xf = x.float().reshape(-1, hidden)
    g = grad_out.float().reshape(-1, hidden)
    inv_rms = _inv_rms(xf, eps)
    xhat = xf * inv_rms
    gw = g * _weight_factor(weight, mode)
    c = (gw * xhat).mean(-1, keepdim=True)
    grad_x = (inv_rms * (gw - xhat * c)).to(x.dtype).reshape(x.shape)
    dweight = (
        dweight_accum.float().clone()
        if dweight_accum is not None
        else torch.zeros(hidden, dtype=torch.float32, device=x.device)
    )
    h = xhat.to(x.dtype).float() if mode == "llama" else xhat
    tile = rms_norm_tile_rows(hidden)
    for start in range(0, xf.shape[0], tile):
        dweight = dweight + (g[start : start + tile] * h[start : start + tile]).sum(0)
    return grad_x, dweight


def reference_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    dweight_accum: torch.Tensor | None = None,
    mode: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward in PyTorch ops, with the kernels' tile-sequential dweight (fp32)."""
    check_rms_norm_backward(grad_out, x, weight, eps, dweight_accum, mode)
    return backward_math(grad_out, x, weight, eps, dweight_accum, mode)


def _empty_forward(x, weight, eps, mode="fp32"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def empty_backward(grad_out, x, *unused):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((x.shape[-1],), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, eps, mode = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.mode = mode


def _backward(ctx, grad, accums=None):
    x, weight = ctx.saved_tensors
    (weight_accum,) = accums or (None,)
    grad_x, grad_weight = OPS.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps, weight_accum, ctx.mode)
    return (grad_x if ctx.needs_input_grad[0] else None,
            param_grad(grad_weight, weight.dtype, accums) if ctx.needs_input_grad[1] else None, None, None)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: str = "fp32") -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dimension (differentiable); ``mode``: the module doc."""
    return OPS.rms_norm(x, weight, eps, mode)


def rms_norm_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    dweight_accum: torch.Tensor | None = None,
    mode: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight fp32) with grad_weight = dweight_accum (or 0) + this batch's sum.

    Chaining: feeding each micro-batch's grad_weight into the next call's ``dweight_accum``
    reproduces the one-batch result bit for bit when every micro-batch but the last has a
    multiple of ``rms_norm_tile_rows(H)`` rows.
    """
    return OPS.rms_norm_backward(grad_out, x, weight, eps, dweight_accum, mode)


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
        out += [Sample("rms_norm", (x, w, EPS, mode)) for mode in MODES[1:]]
        out += [Sample("rms_norm_backward", (dy, x, w, EPS, acc, mode)) for mode in MODES[1:]]
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
        BadInput("rms_norm", (x, w, math.nan), ValueError, "eps must be >= 0, got nan"),
        BadInput("rms_norm_backward", (x, x, w, math.nan, None), ValueError, "eps must be >= 0, got nan"),
        BadInput("rms_norm", (x[0, 0], w[:1], EPS), ValueError, "at least one dimension"),
        BadInput("rms_norm", (x.double(), w.double(), EPS), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput("rms_norm", (x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), EPS), ValueError,
                 "unsupported dtype torch.float8_e4m3fn"),
        BadInput("rms_norm_backward", (x[:3], x, w, EPS, None), ValueError, "grad_out shape"),
        BadInput("rms_norm_backward", (x.float(), x, w, EPS, None), ValueError, "grad_out dtype"),
        BadInput("rms_norm_backward", (x, x, w, EPS, acc.bfloat16()), ValueError, "dweight_accum must be torch.float32"),
        BadInput("rms_norm_backward", (x, x, w, EPS, acc[:15]), ValueError, r"dweight_accum must have shape \[16\]"),
        BadInput("rms_norm_backward", (x.int(), x.int(), w.int(), EPS, None), ValueError, "unsupported dtype torch.int32"),
        BadInput("rms_norm", (x, w, EPS, "qwen"), ValueError, "mode must be 'fp32', 'llama' or 'gemma', got 'qwen'"),
        BadInput("rms_norm_backward", (x, x, w, EPS, None, "Llama"), ValueError, "mode must be"),
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


def _autocast_args(device, act):
    return (seeded_randn(3, 5, 64, dtype=act, device=device, seed=17).requires_grad_(),
            seeded_randn(64, dtype=torch.float32, device=device, seed=18).requires_grad_())


def _host_cost_args(device, dims, tokens):
    h = dims["hidden_size"]
    return {OP: (seeded_randn(tokens, h, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),
                 (seeded_randn(h, dtype=torch.bfloat16, device=device, seed=2, scale=0.1) + 1).requires_grad_(),
                 1e-6, "llama")}


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef("rms_norm", check_rms_norm, reference_forward, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((1,), RMS_NORM_MODULE)), Autocast.NORM),
        OpDef("rms_norm_backward", check_rms_norm_backward, reference_backward, empty_backward),
    ),
    exports={"rms_norm": rms_norm, "rms_norm_backward": rms_norm_backward, "rms_norm_tile_rows": rms_norm_tile_rows},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "hidden": 4096}, {"rows": 1029, "hidden": 128}),
    invariance_case=_invariance_case,
    constants={"RMS_NORM_TILE_ELEMENTS": RMS_NORM_TILE_ELEMENTS, "RMS_NORM_MIN_TILE_ROWS": RMS_NORM_MIN_TILE_ROWS},
    autocast_cases=(AutocastCase(OP, _autocast_args, lambda x, w: rms_norm(x, w, 1e-6),
                                 lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)),),
    host_cost_args=_host_cost_args,
)
