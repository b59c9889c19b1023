"""rms_norm: public functions, fake kernels, autograd and the pure-PyTorch references.

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

from .. import contract
from .._native import NATIVE_AVAILABLE

OP = "rms_norm"

# Mirrors rms_norm_dweight_tile_rows in csrc/common/rms_norm_partition.h.
_TILE_ELEMENTS = 131072
_MIN_TILE_ROWS = 32


def rms_norm_tile_rows(hidden: int) -> int:
    """Rows per dweight tile for hidden size ``hidden``: the micro-batch chaining granularity."""
    rows = _MIN_TILE_ROWS
    while hidden > 0 and rows * 2 * hidden <= _TILE_ELEMENTS:
        rows *= 2
    return rows


def _check_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """The native kernels' argument checks, for the reference path (same errors, same types)."""
    contract.check_dtype(OP, x.dtype, "x")
    contract.check_dtype(OP, weight.dtype, "weight")
    if x.dim() < 1:
        raise ValueError(f"rl_align::{OP}: x must have at least one dimension")
    if weight.dim() != 1:
        raise ValueError(f"rl_align::{OP}: weight must be 1-D, got shape {list(weight.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rl_align::{OP}: weight has {weight.shape[0]} elements but x's last dimension is {x.shape[-1]}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"rl_align::{OP}: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise RuntimeError(f"rl_align::{OP}: x is on {x.device} but weight is on {weight.device}")
    if eps < 0:
        raise ValueError(f"rl_align::{OP}: eps must be >= 0, got {eps}")


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def _normalize_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * inv_rms * weight.float()


def reference_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The dtype path: fp32 math, one rounding to x.dtype (what the kernels compute)."""
    _check_args(x, weight, eps)
    return _normalize_fp32(x, weight, eps).to(x.dtype)


def reference_forward_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast and TF32 off."""
    _check_args(x, weight, eps)
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
    _check_args(x, weight, eps)
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


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dimension (differentiable)."""
    if not NATIVE_AVAILABLE:
        return reference_forward(x, weight, eps)
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
    if not NATIVE_AVAILABLE:
        return reference_backward(grad_out, x, weight, eps, dweight_accum)
    return torch.ops.rl_align.rms_norm_backward(grad_out, x, weight, eps, dweight_accum)


# ---------------------------------------------------------------------------------------------
# Fake kernels for the native ops (autograd is registered in C++: csrc/autograd.cpp)
# ---------------------------------------------------------------------------------------------

if NATIVE_AVAILABLE:

    @torch.library.register_fake("rl_align::rms_norm")
    def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_args(x, weight, eps)
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("rl_align::rms_norm_backward")
    def _rms_norm_backward_fake(grad_out, x, weight, eps, dweight_accum=None):
        _check_args(x, weight, eps)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
        return grad_x, x.new_empty((x.shape[-1],), dtype=torch.float32)
