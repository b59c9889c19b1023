"""linear: public functions, argument checks, references, fake outputs and the op's spec.

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
from . import _checks
from ._spec import (Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads,
                    ParamModule, Sample, param_grad, seeded_randn)

OP = "linear"

# Shared with kLinearGradTileTokens in csrc/common/gemm_problem.h (exported by the native library).
LINEAR_GRAD_TILE_TOKENS = 64

# The modules whose weight and bias linear (and linear_logprob: an LM head) takes: nn.Linear, and
# the mixture-of-experts routers (transformers' *MoeTopKRouter: a bare [E, H] weight that the
# patched router multiplies with linear).
LINEAR_MODULE = ParamModule("nn.Linear", lambda module: isinstance(module, torch.nn.Linear)
                            or type(module).__name__.endswith("MoeTopKRouter"), ("weight", "bias"))


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/linear.h)
# ---------------------------------------------------------------------------------------------


def _check_weight(op: str, weight: torch.Tensor) -> None:
    _checks.check_dtype(op, "weight", weight)
    if weight.dim() != 2:
        raise _checks.fail(op, f"weight must be 2-D [out, in], got shape {list(weight.shape)}")


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, op: str = OP) -> None:
    _checks.check_dtype(op, "x", x)
    _check_weight(op, weight)
    if x.dim() < 1:
        raise _checks.fail(op, "x must have at least one dimension")
    if weight.shape[1] != x.shape[-1]:
        raise _checks.fail(op, f"weight is {list(weight.shape)} ([out, in]) but x's last dimension is {x.shape[-1]}")
    _checks.check_same(op, "weight", weight, "x", x)
    if bias is not None:
        _checks.check_dtype(op, "bias", bias)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise _checks.fail(op, f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
        _checks.check_same(op, "bias", bias, "x", x)


def check_grad_input(grad_out: torch.Tensor, weight: torch.Tensor, *, op: str = "linear_grad_input") -> None:
    _checks.check_dtype(op, "grad_out", grad_out)
    _check_weight(op, weight)
    if grad_out.dim() < 1 or grad_out.shape[-1] != weight.shape[0]:
        raise _checks.fail(op, f"grad_out's last dimension must be weight.size(0) = {weight.shape[0]}, "
                               f"got shape {list(grad_out.shape)}")
    _checks.check_same(op, "weight", weight, "grad_out", grad_out)


def check_grad_weight(grad_out: torch.Tensor, x: torch.Tensor, dweight_accum: torch.Tensor | None = None) -> None:
    op = "linear_grad_weight"
    _checks.check_dtype(op, "grad_out", grad_out)
    _checks.check_dtype(op, "x", x)
    if grad_out.dim() < 1 or x.dim() != grad_out.dim() or grad_out.shape[:-1] != x.shape[:-1]:
        raise _checks.fail(op, f"grad_out {list(grad_out.shape)} and x {list(x.shape)} must agree in every "
                               "dimension but the last")
    _checks.check_same(op, "x", x, "grad_out", grad_out)
    _checks.check_fp32_accum(op, "dweight_accum", dweight_accum, (grad_out.shape[-1], x.shape[-1]), x)


def check_grad_bias(grad_out: torch.Tensor, dbias_accum: torch.Tensor | None = None) -> None:
    op = "linear_grad_bias"
    _checks.check_dtype(op, "grad_out", grad_out)
    if grad_out.dim() < 1:
        raise _checks.fail(op, "grad_out must have at least one dimension")
    _checks.check_fp32_accum(op, "dbias_accum", dbias_accum, (grad_out.shape[-1],), grad_out)


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with contract.fp32_reference_mode():
        return a.float() @ b.float()


def reference_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dtype path: fp32 products and sums, one rounding to x.dtype (summation order is
    PyTorch's, so this matches the kernels within the contract, not bit for bit)."""
    check_linear(x, weight, bias)
    y = _matmul_fp32(x, weight.t())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def reference_forward_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast and TF32 off."""
    check_linear(x, weight, bias)
    y = _matmul_fp32(x.float(), weight.float().t())
    return y + bias.float() if bias is not None else y


def reference_grad_input(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_grad_input(grad_out, weight)
    return _matmul_fp32(grad_out, weight).to(grad_out.dtype)


def reference_grad_weight(
    grad_out: torch.Tensor, x: torch.Tensor, dweight_accum: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 [N, K]: the accumulator plus the tile sums, tiles of LINEAR_GRAD_TILE_TOKENS in order."""
    check_grad_weight(grad_out, x, dweight_accum)
    g = grad_out.reshape(-1, grad_out.shape[-1]).float()
    xf = x.reshape(-1, x.shape[-1]).float()
    dw = dweight_accum.clone() if dweight_accum is not None else g.new_zeros(g.shape[1], xf.shape[1])
    for start in range(0, g.shape[0], LINEAR_GRAD_TILE_TOKENS):
        tile = slice(start, start + LINEAR_GRAD_TILE_TOKENS)
        dw = dw + _matmul_fp32(g[tile].t(), xf[tile])
    return dw


def reference_grad_bias(grad_out: torch.Tensor, dbias_accum: torch.Tensor | None = None) -> torch.Tensor:
    check_grad_bias(grad_out, dbias_accum)
    g = grad_out.reshape(-1, grad_out.shape[-1]).float()
    db = dbias_accum.clone() if dbias_accum is not None else g.new_zeros(g.shape[1])
    for start in range(0, g.shape[0], LINEAR_GRAD_TILE_TOKENS):
        db = db + g[start : start + LINEAR_GRAD_TILE_TOKENS].sum(0)
    return db


def _empty_forward(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _empty_grad_input(grad_out, weight):
    return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]))


def _empty_grad_weight(grad_out, x, dweight_accum=None):
    return x.new_empty((grad_out.shape[-1], x.shape[-1]), dtype=torch.float32)


def _empty_grad_bias(grad_out, dbias_accum=None):
    return grad_out.new_empty((grad_out.shape[-1],), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad, accums=None):
    x, weight = ctx.saved_tensors
    weight_accum, bias_accum = accums or (None, None)
    grad = grad.contiguous()
    grad_x = OPS.linear_grad_input(grad, weight) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = param_grad(OPS.linear_grad_weight(grad, x, weight_accum), weight.dtype, accums)
    grad_b = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_b = param_grad(OPS.linear_grad_bias(grad, bias_accum), ctx.bias_dtype, accums)
    return grad_x, grad_w, grad_b


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T (+ bias)`` (differentiable), a drop-in for F.linear."""
    return OPS.linear(x, weight, bias)


def linear_grad_input(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad_out @ weight``: the input gradient of linear, in the input dtype."""
    return OPS.linear_grad_input(grad_out, weight)


def linear_grad_weight(
    grad_out: torch.Tensor, x: torch.Tensor, dweight_accum: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``dweight_accum (or 0) + grad_out^T @ x`` over all tokens.

    Chaining: feeding each micro-batch's result into the next call's ``dweight_accum``
    reproduces the one-batch result bit for bit when every micro-batch but the last has a
    multiple of ``LINEAR_GRAD_TILE_TOKENS`` tokens.
    """
    return OPS.linear_grad_weight(grad_out, x, dweight_accum)


def linear_grad_bias(grad_out: torch.Tensor, dbias_accum: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``dbias_accum (or 0) + grad_out`` summed over tokens; chains like linear_grad_weight."""
    return OPS.linear_grad_bias(grad_out, dbias_accum)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _weights(n: int, k: int, dtype: torch.dtype, device: str, seed: int = 1):
    w = seeded_randn(n, k, dtype=dtype, device=device, seed=seed, scale=k**-0.5)
    return w, seeded_randn(n, dtype=dtype, device=device, seed=seed + 1)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    w, b = _weights(24, 40, dtype, device)
    x = seeded_randn(3, 5, 40, dtype=dtype, device=device, seed=1)
    dy = seeded_randn(3, 5, 24, dtype=dtype, device=device, seed=2)
    return [
        Sample("linear", (x, w, b)),
        Sample("linear", (x.clone().requires_grad_(), w.clone().requires_grad_(), None)),
        Sample("linear", (x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_())),
        Sample("linear", (torch.empty(0, 40, dtype=dtype, device=device), w, b)),
        Sample("linear_grad_input", (dy, w)),
        Sample("linear_grad_weight", (dy, x, None)),
        Sample("linear_grad_weight", (dy, x, torch.ones(24, 40, device=device))),
        Sample("linear_grad_bias", (dy, None)),
        Sample("linear_grad_bias", (dy, torch.ones(24, device=device))),
    ]


def _bad_inputs(device: str) -> list[BadInput]:
    x = torch.ones(3, 8, device=device)
    w = torch.ones(4, 8, device=device)
    dy = torch.ones(3, 4, device=device)
    bad = [
        BadInput("linear", (x.double(), w.double(), None), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput("linear", (x.int(), w.int(), None), ValueError, "unsupported dtype torch.int32"),
        BadInput("linear", (x, torch.ones(8, device=device), None), ValueError, "weight must be 2-D"),
        BadInput("linear", (torch.ones(3, 7, device=device), w, None), ValueError, "last dimension"),
        BadInput("linear", (x[0, 0], w, None), ValueError, "at least one dimension"),
        BadInput("linear", (x.bfloat16(), w, None), ValueError, "weight dtype torch.float32 differs from x dtype"),
        BadInput("linear", (x, w, torch.ones(5, device=device)), ValueError, "bias must have shape"),
        BadInput("linear", (x, w, torch.ones(4, device=device).half()), ValueError, "bias dtype"),
        BadInput("linear_grad_input", (torch.ones(3, 5, device=device), w), ValueError, "last dimension"),
        BadInput("linear_grad_input", (dy.double(), w.double()), ValueError, "unsupported dtype"),
        BadInput("linear_grad_weight", (dy, torch.ones(2, 8, device=device), None), ValueError, "every dimension but the last"),
        BadInput("linear_grad_weight", (dy, x, torch.ones(4, 8, device=device).bfloat16()), ValueError,
                 "dweight_accum must be torch.float32"),
        BadInput("linear_grad_weight", (dy, x, torch.ones(8, 4, device=device)), ValueError, "dweight_accum must have shape"),
        BadInput("linear_grad_bias", (dy, torch.ones(5, device=device)), ValueError, "dbias_accum must have shape"),
        BadInput("linear_grad_bias", (dy[0, 0], None), ValueError, "at least one dimension"),
    ]
    if device != "cpu":
        bad += [
            BadInput("linear", (x, w.cpu(), None), RuntimeError, "weight is on cpu"),
            BadInput("linear", (x, w, torch.ones(4).cpu()), RuntimeError, "bias is on cpu"),
            BadInput("linear_grad_weight", (dy, x, torch.ones(4, 8)), RuntimeError, "dweight_accum is on cpu"),
        ]
    return bad


def invariance_case_for(forward):
    """The status-matrix case builder of a linear-shaped op ``forward(x, weight, bias)`` whose weight
    and bias gradients are linear's (linear; linear_tree's tree_linear)."""

    def case(device: str, dtype: torch.dtype, rows: int, out_features: int, in_features: int) -> InvarianceCase:
        x = seeded_randn(rows, in_features, dtype=dtype, device=device, seed=rows)
        weight = seeded_randn(out_features, in_features, dtype=dtype, device=device, seed=in_features) * in_features**-0.5
        bias = seeded_randn(out_features, dtype=dtype, device=device, seed=out_features)

        def chain(row_inputs, cotangents, accum):
            dy, x_rows = cotangents[0], row_inputs[0]
            return {
                "weight": linear_grad_weight(dy, x_rows, None if accum is None else accum["weight"]),
                "bias": linear_grad_bias(dy, None if accum is None else accum["bias"]),
            }

        return InvarianceCase(
            fn=lambda x, weight, bias: forward(x, weight, bias),
            rows=[x],
            params={"weight": weight, "bias": bias},
            weight_grad_tile=LINEAR_GRAD_TILE_TOKENS,
            weight_grad_chain=chain,
            accuracy=lambda: (forward(x, weight, bias), reference_forward_fp32(x, weight, bias)),
        )

    return case


def _autocast_args(device, act):
    return (seeded_randn(2, 5, 40, dtype=act, device=device, seed=1).requires_grad_(),
            seeded_randn(24, 40, dtype=torch.float32, device=device, seed=2, scale=40**-0.5).requires_grad_(),
            seeded_randn(24, dtype=torch.float32, device=device, seed=3).requires_grad_())


def _host_cost_args(device, dims, tokens):
    h = dims["hidden_size"]
    return {OP: (seeded_randn(tokens, h, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),
                 seeded_randn(h, h, dtype=torch.bfloat16, device=device, seed=2, scale=h**-0.5).requires_grad_())}


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef("linear", check_linear, reference_forward, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((1, 2), LINEAR_MODULE)), Autocast.LOWER_PRECISION),
        OpDef("linear_grad_input", check_grad_input, reference_grad_input, _empty_grad_input),
        OpDef("linear_grad_weight", check_grad_weight, reference_grad_weight, _empty_grad_weight),
        OpDef("linear_grad_bias", check_grad_bias, reference_grad_bias, _empty_grad_bias),
    ),
    exports={
        "linear": linear,
        "linear_grad_input": linear_grad_input,
        "linear_grad_weight": linear_grad_weight,
        "linear_grad_bias": linear_grad_bias,
        "LINEAR_GRAD_TILE_TOKENS": LINEAR_GRAD_TILE_TOKENS,
    },
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "out_features": 512, "in_features": 1024},
                  {"rows": 130, "out_features": 33, "in_features": 100}),
    invariance_case=invariance_case_for(linear),
    constants={"LINEAR_GRAD_TILE_TOKENS": LINEAR_GRAD_TILE_TOKENS},
    autocast_cases=(AutocastCase(OP, _autocast_args, linear, torch.nn.functional.linear),),
    host_cost_args=_host_cost_args,
)
