"""add_rms_norm: the residual add fused into rms_norm (a decoder layer's pre-norm step).

    new_residual = round(x + residual)        (to x.dtype, as the unfused ``x + residual``)
    y = rms_norm(new_residual, weight, eps, mode)

Bit for bit the unfused pair, forward and backward (the gradient of x and of residual is
``round(round(rms_norm_backward's dx) + grad_residual)``, autograd's accumulation order), in one
pass over memory: read x, residual, weight; write y, new_residual. ``mode`` as rms_norm's
(rl_engine_ext/ops/rms_norm.py). Invariance and dweight chaining: those of rms_norm (same row
arithmetic, same ``rms_norm_tile_rows(H)`` tiles, chainable through ``dweight_accum``).
"""

from __future__ import annotations

import math

import torch

from .. import contract
from . import rms_norm as rms
from ._spec import (Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads, Sample,
                    param_grad, seeded_randn)

OP = "add_rms_norm"
EPS = rms.EPS


def check_add_rms_norm(x, residual, weight, eps, mode="fp32") -> None:
    rms.check_forward_args(OP, x, weight, eps)
    rms.check_like_x(OP, "residual", residual, "x", x)
    rms.check_mode(OP, mode)


def check_add_rms_norm_backward(grad_y, grad_residual, new_residual, weight, eps, dweight_accum=None,
                                mode="fp32") -> None:
    op = "add_rms_norm_backward"
    rms.check_backward_args(op, "grad_y", grad_y, "new_residual", new_residual, weight, eps, dweight_accum)
    if grad_residual is not None:
        rms.check_like_x(op, "grad_residual", grad_residual, "new_residual", new_residual)
    rms.check_mode(op, mode)


def reference_forward(x, residual, weight, eps=EPS, mode="fp32"):
    """The dtype path: (y, new_residual), the unfused pair in PyTorch ops."""
    check_add_rms_norm(x, residual, weight, eps, mode)
    new_residual = x + residual
    return rms.normalize(new_residual, weight, eps, mode, x.dtype).to(x.dtype), new_residual


def reference_forward_fp32(x, residual, weight, eps=EPS, mode="fp32"):
    """Ground truth: fp32 inputs and math, (y, new_residual) in fp32."""
    check_add_rms_norm(x, residual, weight, eps, mode)
    with contract.fp32_reference_mode():
        new_residual = x.float() + residual.float()
        return rms.normalize(new_residual, weight.float(), eps, mode, torch.float32), new_residual


def reference_backward(grad_y, grad_residual, new_residual, weight, eps=EPS, dweight_accum=None, mode="fp32"):
    """rms_norm's backward (dx rounded), then grad_residual added in the dtype."""
    check_add_rms_norm_backward(grad_y, grad_residual, new_residual, weight, eps, dweight_accum, mode)
    grad_input, dweight = rms.backward_math(grad_y, new_residual, weight, eps, dweight_accum, mode)
    return (grad_input if grad_residual is None else grad_input + grad_residual), dweight


def _empty_forward(x, residual, weight, eps, mode="fp32"):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _empty_backward(grad_y, grad_residual, new_residual, *unused):
    return rms.empty_backward(grad_y, new_residual)


def _setup_context(ctx, inputs, output):
    _, _, weight, eps, mode = inputs
    ctx.set_materialize_grads(False)  # as csrc/autograd/rms_norm.cpp: unused outputs give None
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    ctx.mode = mode


def _backward(ctx, grad_y, grad_residual, accums=None):
    if grad_y is None:
        return grad_residual, grad_residual, None, None, None
    new_residual, weight = ctx.saved_tensors
    (weight_accum,) = accums or (None,)
    grad_input, grad_weight = OPS.add_rms_norm_backward(
        grad_y.contiguous(), grad_residual, new_residual, weight, ctx.eps, weight_accum, ctx.mode)
    return (grad_input if ctx.needs_input_grad[0] else None, grad_input if ctx.needs_input_grad[1] else None,
            param_grad(grad_weight, weight.dtype, accums) if ctx.needs_input_grad[2] else None, None, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 mode: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), differentiable, bit for bit the unfused pair."""
    return OPS.add_rms_norm(x, residual, weight, eps, mode)


def add_rms_norm_backward(grad_y, grad_residual, new_residual, weight, eps=1e-6, dweight_accum=None, mode="fp32"):
    """(grad of x and of residual, grad_weight fp32 = dweight_accum (or 0) + this batch's sum);
    chaining as rms_norm_backward."""
    return OPS.add_rms_norm_backward(grad_y, grad_residual, new_residual, weight, eps,
                                     dweight_accum, mode)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape in ((5, 128), (2, 3, 4095), (0, 64)):
        x = seeded_randn(*shape, dtype=dtype, device=device, seed=32)
        r = seeded_randn(*shape, dtype=dtype, device=device, seed=33)
        w = seeded_randn(shape[-1], dtype=dtype, device=device, seed=34)
        dy = seeded_randn(*shape, dtype=dtype, device=device, seed=35)
        acc = seeded_randn(shape[-1], dtype=torch.float32, device=device, seed=36)
        for mode in rms.MODES:
            out += [
                Sample(OP, (x, r, w, EPS, mode)),
                Sample(OP, (x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_(), EPS,
                            mode)),
                Sample("add_rms_norm_backward", (dy, r, x, w, EPS, None, mode)),
                Sample("add_rms_norm_backward", (dy, None, x, w, EPS, acc, mode)),
            ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    x = seeded_randn(4, 16, dtype=torch.bfloat16, device=device, seed=38)
    w = seeded_randn(16, dtype=torch.bfloat16, device=device, seed=39)
    acc = torch.zeros(16, device=device)
    bwd = "add_rms_norm_backward"
    bad = [
        BadInput(OP, (x, x[:3], w, EPS), ValueError, r"residual shape \[3, 16\] differs from x shape"),
        BadInput(OP, (x, x.half(), w, EPS), ValueError, "residual dtype torch.float16 differs from x dtype"),
        BadInput(OP, (x, x, w[:15], EPS), ValueError, "weight has 15 elements"),
        BadInput(OP, (x, x, w, -1.0), ValueError, "eps must be >= 0"),
        BadInput(OP, (x, x, w, math.nan), ValueError, "eps must be >= 0, got nan"),
        BadInput(OP, (x.double(), x.double(), w.double(), EPS), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput(OP, (x, x, w, EPS, "qwen"), ValueError, "mode must be 'fp32', 'llama' or 'gemma', got 'qwen'"),
        BadInput(bwd, (x[:3], None, x, w, EPS), ValueError, "grad_y shape"),
        BadInput(bwd, (x, x[:3], x, w, EPS), ValueError, "grad_residual shape"),
        BadInput(bwd, (x, x.float(), x, w, EPS), ValueError, "grad_residual dtype torch.float32 differs from new_residual"),
        BadInput(bwd, (x, None, x, w[:15], EPS), ValueError, "weight has 15 elements but new_residual's last"),
        BadInput(bwd, (x, None, x, w, EPS, acc[:15]), ValueError, r"dweight_accum must have shape \[16\]"),
        BadInput(bwd, (x, None, x, w, EPS, None, "gemma2"), ValueError, "mode must be"),
    ]
    if device != "cpu":
        bad += [
            BadInput(OP, (x, x.cpu(), w, EPS), RuntimeError, "residual is on cpu"),
            BadInput(bwd, (x, x.cpu(), x, w, EPS), RuntimeError, "grad_residual is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, hidden: int) -> InvarianceCase:
    x = seeded_randn(rows, hidden, dtype=dtype, device=device, seed=rows, scale=2.0)
    residual = seeded_randn(rows, hidden, dtype=dtype, device=device, seed=rows + 1, scale=4.0)
    weight = seeded_randn(hidden, dtype=dtype, device=device, seed=hidden, scale=0.5) + 1

    def chain(row_inputs, cotangents, accum):
        _, new_residual = add_rms_norm(*row_inputs, weight, EPS)
        _, dweight = add_rms_norm_backward(cotangents[0], cotangents[1], new_residual, weight, EPS,
                                           None if accum is None else accum["weight"])
        return {"weight": dweight}

    def accuracy():
        got = torch.cat([t.flatten() for t in add_rms_norm(x, residual, weight, EPS)])
        return got, torch.cat([t.flatten() for t in reference_forward_fp32(x, residual, weight, EPS)])

    return InvarianceCase(
        fn=lambda x, residual, weight: add_rms_norm(x, residual, weight, EPS),
        rows=[x, residual],
        params={"weight": weight},
        weight_grad_tile=rms.rms_norm_tile_rows(hidden),
        weight_grad_chain=chain,
        accuracy=accuracy,
    )


def _autocast_args(device, act):
    # x from a projection in the activation dtype; the residual stream in fp32 (fp32 embedding).
    return (seeded_randn(3, 5, 64, dtype=act, device=device, seed=19).requires_grad_(),
            seeded_randn(3, 5, 64, dtype=torch.float32, device=device, seed=20).requires_grad_(),
            seeded_randn(64, dtype=torch.float32, device=device, seed=21).requires_grad_())


def _host_cost_args(device, dims, tokens):
    h = dims["hidden_size"]
    return {OP: (seeded_randn(tokens, h, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),
                 seeded_randn(tokens, h, dtype=torch.bfloat16, device=device, seed=2).requires_grad_(),
                 (seeded_randn(h, dtype=torch.bfloat16, device=device, seed=3, scale=0.1) + 1).requires_grad_(),
                 1e-6, "llama")}


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef(OP, check_add_rms_norm, reference_forward, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((2,), rms.RMS_NORM_MODULE)), Autocast.NORM),
        OpDef("add_rms_norm_backward", check_add_rms_norm_backward, reference_backward, _empty_backward),
    ),
    exports={"add_rms_norm": add_rms_norm, "add_rms_norm_backward": add_rms_norm_backward},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "hidden": 4096}, {"rows": 1029, "hidden": 128}),
    invariance_case=_invariance_case,
    autocast_cases=(AutocastCase(
        OP, _autocast_args, lambda x, r, w: add_rms_norm(x, r, w, 1e-6),
        lambda x, r, w: (torch.nn.functional.rms_norm(x + r, (x.shape[-1],), w, 1e-6), x + r)),),
    host_cost_args=_host_cost_args,
)
