"""linear: public functions, fake kernels and the pure-PyTorch references.

    y = x @ weight.T (+ bias)        weight [N, K] (nn.Linear layout), x [..., K]

bf16/fp16 inputs multiply on tensor cores with fp32 accumulation and one rounding to the input
dtype; fp32 inputs use true fp32 FMA (never TF32). The backward is three ops: the input gradient
``linear_grad_input(dy, W) = dy @ W``, and the weight and bias gradients, returned in fp32.

Invariance (native kernels): every element's sum over K runs from k = 0 upwards in fixed chunks
(16 on tensor cores, 1 on the FMA paths) on one fp32 accumulator, and the kernel family is
chosen from (dtype, device) only, never from the number of tokens. So a row of y (and of
grad_x) depends only on its own row, bit for bit, for every M. The weight gradient's sum over
tokens is the same kind of chain with tokens as the reduction: run-to-run identical, unchanged by
zero-gradient padding rows after the batch (or before it in whole tiles), and chainable through
``dweight_accum``: micro-batches whose token counts are multiples of
``LINEAR_GRAD_TILE_TOKENS`` (64) reproduce the one-batch result bit for bit. The bias gradient
sums tiles of 64 tokens, each sequentially, tiles in order, with the same guarantees.
"""

from __future__ import annotations

import torch

from .. import contract
from .._native import NATIVE_AVAILABLE

OP = "linear"

# Mirrors kLinearGradTileTokens in csrc/common/gemm_problem.h.
LINEAR_GRAD_TILE_TOKENS = 64


def _check_same(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"rl_align::{op}: {name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")
    if t.device != ref.device:
        raise RuntimeError(f"rl_align::{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _check_weight(op: str, weight: torch.Tensor) -> None:
    contract.check_dtype(op, weight.dtype, "weight")
    if weight.dim() != 2:
        raise ValueError(f"rl_align::{op}: weight must be 2-D [out, in], got shape {list(weight.shape)}")


def _check_accum(op: str, name: str, accum: torch.Tensor | None, shape: tuple[int, ...], ref: torch.Tensor) -> None:
    if accum is None:
        return
    if accum.dtype != torch.float32:
        raise ValueError(f"rl_align::{op}: {name} must be torch.float32, got {accum.dtype}")
    if tuple(accum.shape) != shape:
        raise ValueError(f"rl_align::{op}: {name} must have shape {list(shape)}, got {list(accum.shape)}")
    if accum.device != ref.device:
        raise RuntimeError(f"rl_align::{op}: {name} is on {accum.device} but the inputs are on {ref.device}")


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    contract.check_dtype(OP, x.dtype, "x")
    _check_weight(OP, weight)
    if x.dim() < 1:
        raise ValueError(f"rl_align::{OP}: x must have at least one dimension")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"rl_align::{OP}: weight is {list(weight.shape)} ([out, in]) but x's last dimension is {x.shape[-1]}")
    _check_same(OP, "weight", weight, "x", x)
    if bias is not None:
        contract.check_dtype(OP, bias.dtype, "bias")
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(f"rl_align::{OP}: bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
        _check_same(OP, "bias", bias, "x", x)


def _check_grad_input(grad_out: torch.Tensor, weight: torch.Tensor) -> None:
    op = "linear_grad_input"
    contract.check_dtype(op, grad_out.dtype, "grad_out")
    _check_weight(op, weight)
    if grad_out.dim() < 1 or grad_out.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rl_align::{op}: grad_out's last dimension must be weight.size(0) = {weight.shape[0]}, "
            f"got shape {list(grad_out.shape)}"
        )
    _check_same(op, "weight", weight, "grad_out", grad_out)


def _check_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, accum: torch.Tensor | None) -> None:
    op = "linear_grad_weight"
    contract.check_dtype(op, grad_out.dtype, "grad_out")
    contract.check_dtype(op, x.dtype, "x")
    if grad_out.dim() < 1 or x.dim() != grad_out.dim() or grad_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"rl_align::{op}: grad_out {list(grad_out.shape)} and x {list(x.shape)} must agree in every "
            "dimension but the last"
        )
    _check_same(op, "x", x, "grad_out", grad_out)
    _check_accum(op, "dweight_accum", accum, (grad_out.shape[-1], x.shape[-1]), x)


def _check_grad_bias(grad_out: torch.Tensor, accum: torch.Tensor | None) -> None:
    op = "linear_grad_bias"
    contract.check_dtype(op, grad_out.dtype, "grad_out")
    if grad_out.dim() < 1:
        raise ValueError(f"rl_align::{op}: grad_out must have at least one dimension")
    _check_accum(op, "dbias_accum", accum, (grad_out.shape[-1],), grad_out)


# ---------------------------------------------------------------------------------------------
# References (also the fallback when the native library is absent)
# ---------------------------------------------------------------------------------------------


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with contract.fp32_reference_mode():
        return a.float() @ b.float()


def reference_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dtype path: fp32 products and sums, one rounding to x.dtype (summation order is
    PyTorch's, so this matches the kernels within the contract, not bit for bit)."""
    _check_linear(x, weight, bias)
    y = _matmul_fp32(x, weight.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_forward_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast and TF32 off."""
    _check_linear(x, weight, bias)
    y = _matmul_fp32(x.float(), weight.float().t())
    return y + bias.float() if bias is not None else y


def reference_grad_input(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_grad_input(grad_out, weight)
    return _matmul_fp32(grad_out, weight).to(grad_out.dtype)


def reference_grad_weight(
    grad_out: torch.Tensor, x: torch.Tensor, dweight_accum: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [N, K]: the accumulator plus the tile sums, tiles of LINEAR_GRAD_TILE_TOKENS in order."""
    _check_grad_weight(grad_out, x, dweight_accum)
    g = grad_out.reshape(-1, grad_out.shape[-1]).float()
    xf = x.reshape(-1, x.shape[-1]).float()
    dw = dweight_accum.clone() if dweight_accum is not None else g.new_zeros(g.shape[1], xf.shape[1])
    for start in range(0, g.shape[0], LINEAR_GRAD_TILE_TOKENS):
        tile = slice(start, start + LINEAR_GRAD_TILE_TOKENS)
        dw = dw + _matmul_fp32(g[tile].t(), xf[tile])
    return dw


def reference_grad_bias(grad_out: torch.Tensor, dbias_accum: torch.Tensor | None = None) -> torch.Tensor:
    _check_grad_bias(grad_out, dbias_accum)
    g = grad_out.reshape(-1, grad_out.shape[-1]).float()
    db = dbias_accum.clone() if dbias_accum is not None else g.new_zeros(g.shape[1])
    for start in range(0, g.shape[0], LINEAR_GRAD_TILE_TOKENS):
        db = db + g[start : start + LINEAR_GRAD_TILE_TOKENS].sum(0)
    return db


class _ReferenceLinear(torch.autograd.Function):
    """Autograd for the fallback path, built from the reference backward pieces."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return reference_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = reference_grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = reference_grad_weight(grad, x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = reference_grad_bias(grad).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T (+ bias)`` (differentiable), a drop-in for F.linear."""
    if not NATIVE_AVAILABLE:
        return _ReferenceLinear.apply(x, weight, bias)
    return torch.ops.rl_align.linear(x, weight, bias)


def linear_grad_input(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_out @ weight``: the input gradient of linear, in the input dtype."""
    if not NATIVE_AVAILABLE:
        return reference_grad_input(grad_out, weight)
    return torch.ops.rl_align.linear_grad_input(grad_out, weight)


def linear_grad_weight(
    grad_out: torch.Tensor, x: torch.Tensor, dweight_accum: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``dweight_accum (or 0) + grad_out^T @ x`` over all tokens.

    Chaining: feeding each micro-batch's result into the next call's ``dweight_accum``
    reproduces the one-batch result bit for bit when every micro-batch but the last has a
    multiple of ``LINEAR_GRAD_TILE_TOKENS`` tokens.
    """
    if not NATIVE_AVAILABLE:
        return reference_grad_weight(grad_out, x, dweight_accum)
    return torch.ops.rl_align.linear_grad_weight(grad_out, x, dweight_accum)


def linear_grad_bias(grad_out: torch.Tensor, dbias_accum: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``dbias_accum (or 0) + grad_out`` summed over tokens; chains like linear_grad_weight."""
    if not NATIVE_AVAILABLE:
        return reference_grad_bias(grad_out, dbias_accum)
    return torch.ops.rl_align.linear_grad_bias(grad_out, dbias_accum)


# ---------------------------------------------------------------------------------------------
# Fake kernels for the native ops (autograd is registered in C++: csrc/autograd.cpp)
# ---------------------------------------------------------------------------------------------

if NATIVE_AVAILABLE:

    @torch.library.register_fake("rl_align::linear")
    def _linear_fake(x, weight, bias=None):
        _check_linear(x, weight, bias)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("rl_align::linear_grad_input")
    def _linear_grad_input_fake(grad_out, weight):
        _check_grad_input(grad_out, weight)
        return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))

    @torch.library.register_fake("rl_align::linear_grad_weight")
    def _linear_grad_weight_fake(grad_out, x, dweight_accum=None):
        _check_grad_weight(grad_out, x, dweight_accum)
        return x.new_empty((grad_out.shape[-1], x.shape[-1]), dtype=torch.float32)

    @torch.library.register_fake("rl_align::linear_grad_bias")
    def _linear_grad_bias_fake(grad_out, dbias_accum=None):
        _check_grad_bias(grad_out, dbias_accum)
        return grad_out.new_empty((grad_out.shape[-1],), dtype=torch.float32)
