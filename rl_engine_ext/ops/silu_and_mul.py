"""silu_and_mul: public functions, argument checks, references, fake outputs and the op's spec.

    y = silu(gate) * up,    silu(g) = g * sigmoid(g)

the SwiGLU activation of LLaMA / Qwen MLPs. fp32 math, one rounding to the input dtype; the
operation order (one full-accuracy exp, no fused multiply-add) and the limits taken at large |g|
and at infinities are stated once, in csrc/common/silu_and_mul.h, and mirrored by ``_forward_math``
and ``_backward_math`` below. Two layouts, the same bits:

* ``silu_and_mul(gate_up)``: gate_up ``[..., 2I]``, gate = ``gate_up[..., :I]``, up =
  ``gate_up[..., I:]`` (vLLM / Liger layout); the backward gives d(gate_up).
* ``silu_and_mul(gate, up)``: two ``[..., I]`` tensors (HF's gate_proj / up_proj outputs); the
  backward gives d gate and d up.

Invariance: every output element depends only on the gate and up element at its own position
(and the gradient elements on grad_out there too), whatever else is in the batch, and whether the
GPU reads the row as 16-byte vectors or element by element. A NaN stays in its own element.
"""

from __future__ import annotations

import torch

from .. import contract
from . import _checks
from ._spec import Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "silu_and_mul"


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/silu_and_mul.h)
# ---------------------------------------------------------------------------------------------


def _check_gate_up(op: str, gate_up: torch.Tensor) -> None:
    _checks.check_dtype(op, "gate_up", gate_up)
    if gate_up.dim() < 1:
        raise _checks.fail(op, "gate_up must have at least one dimension")
    if gate_up.shape[-1] % 2:
        raise _checks.fail(op, f"gate_up's last dimension must be even (gate then up), got {gate_up.shape[-1]}")


def _check_gate_and_up(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    _checks.check_dtype(op, "gate", gate)
    _checks.check_dtype(op, "up", up)
    if gate.dim() < 1:
        raise _checks.fail(op, "gate must have at least one dimension")
    if up.shape != gate.shape:
        raise _checks.fail(op, f"up shape {list(up.shape)} differs from gate shape {list(gate.shape)}")
    _checks.check_same(op, "up", up, "gate", gate)


def _check_grad_out(op: str, grad_out: torch.Tensor, shape: list[int], ref_name: str, ref: torch.Tensor) -> None:
    if list(grad_out.shape) != list(shape):
        raise _checks.fail(op, f"grad_out shape {list(grad_out.shape)} differs from the output shape {list(shape)}")
    _checks.check_same(op, "grad_out", grad_out, ref_name, ref)


def _halved(gate_up: torch.Tensor) -> list[int]:
    return [*gate_up.shape[:-1], gate_up.shape[-1] // 2]


def check_silu_and_mul(gate_up: torch.Tensor) -> None:
    _check_gate_up("silu_and_mul", gate_up)


def check_silu_and_mul_backward(grad_out: torch.Tensor, gate_up: torch.Tensor) -> None:
    op = "silu_and_mul_backward"
    _check_gate_up(op, gate_up)
    _check_grad_out(op, grad_out, _halved(gate_up), "gate_up", gate_up)


def check_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    _check_gate_and_up("silu_mul", gate, up)


def check_silu_mul_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    op = "silu_mul_backward"
    _check_gate_and_up(op, gate, up)
    _check_grad_out(op, grad_out, list(gate.shape), "gate", gate)


# ---------------------------------------------------------------------------------------------
# The arithmetic (csrc/common/silu_and_mul.h, in PyTorch ops) and the references
# ---------------------------------------------------------------------------------------------


def _sigmoid_and_silu(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s = 1 / (1 + exp(-g)); silu = g * s, -0 where s == 0 (g below about -88.7, where exp
    overflows and g * s would be NaN at g = -inf)."""
    s = 1.0 / (1.0 + torch.exp(-g))
    silu = torch.where(s == 0, torch.full_like(g, -0.0), g * s)
    return s, silu


def _forward_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp32 in, fp32 out."""
    return _sigmoid_and_silu(gate)[1] * up


def _backward_math(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fp32 from fp32 inputs."""
    s, silu = _sigmoid_and_silu(gate)
    one_minus_s = 1.0 - s
    g_term = torch.where(one_minus_s == 0, torch.zeros_like(gate), gate * one_minus_s)
    dsilu = torch.where(s == 0, torch.full_like(gate, -0.0), s * (1.0 + g_term))
    return (dy * up) * dsilu, dy * silu


def _split(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = gate_up.shape[-1] // 2
    return gate_up[..., :half], gate_up[..., half:]


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The dtype path: fp32 math, one rounding to the input dtype (what the kernels compute)."""
    check_silu_and_mul(gate_up)
    gate, up = _split(gate_up)
    return _forward_math(gate.float(), up.float()).to(gate_up.dtype)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_silu_mul(gate, up)
    return _forward_math(gate.float(), up.float()).to(gate.dtype)


def reference_silu_and_mul_backward(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul_backward(grad_out, gate_up)
    gate, up = _split(gate_up)
    d_gate, d_up = _backward_math(grad_out.float(), gate.float(), up.float())
    return torch.cat([d_gate, d_up], dim=-1).to(gate_up.dtype)


def reference_silu_mul_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    check_silu_mul_backward(grad_out, gate, up)
    d_gate, d_up = _backward_math(grad_out.float(), gate.float(), up.float())
    return d_gate.to(gate.dtype), d_up.to(gate.dtype)


def reference_forward_fp32(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Ground truth: fp32 inputs and math, fp32 output, autocast off (either layout)."""
    if up is None:
        check_silu_and_mul(gate_up)
        gate, up = _split(gate_up)
    else:
        check_silu_mul(gate_up, up)
        gate = gate_up
    with contract.fp32_reference_mode():
        return _forward_math(gate.float(), up.float())


def _dense_like(t: torch.Tensor, shape=None) -> torch.Tensor:
    return t.new_empty(t.shape if shape is None else shape)


def _setup_silu_and_mul(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward_silu_and_mul(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return OPS.silu_and_mul_backward(grad, gate_up)


def _setup_silu_mul(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_silu_mul(ctx, grad):
    gate, up = ctx.saved_tensors
    d_gate, d_up = OPS.silu_mul_backward(grad, gate, up)
    return (d_gate if ctx.needs_input_grad[0] else None, d_up if ctx.needs_input_grad[1] else None)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def silu_and_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``silu(gate) * up`` (differentiable).

    One tensor: gate_up ``[..., 2I]`` -> ``[..., I]`` with gate = ``gate_up[..., :I]`` and up =
    ``gate_up[..., I:]``. Two tensors: ``silu_and_mul(gate, up)``, both ``[..., I]``. Both layouts
    give the same bits.
    """
    if up is None:
        return OPS.silu_and_mul(gate_up)
    return OPS.silu_mul(gate_up, up)


def silu_and_mul_backward(grad_out: torch.Tensor, gate_up: torch.Tensor, up: torch.Tensor | None = None):
    """d(gate_up) ``[..., 2I]`` for the one-tensor layout, (d gate, d up) for the two-tensor one,
    in the input dtype."""
    if up is None:
        return OPS.silu_and_mul_backward(grad_out, gate_up)
    return OPS.silu_mul_backward(grad_out, gate_up, up)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape in ((5, 128), (2, 3, 7), (0, 64)):
        gu = seeded_randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device, seed=31, scale=3.0)
        gate = seeded_randn(*shape, dtype=dtype, device=device, seed=32, scale=3.0)
        up = seeded_randn(*shape, dtype=dtype, device=device, seed=33)
        dy = seeded_randn(*shape, dtype=dtype, device=device, seed=34)
        out += [
            Sample("silu_and_mul", (gu,)),
            Sample("silu_and_mul", (gu.clone().requires_grad_(),)),
            Sample("silu_and_mul_backward", (dy, gu)),
            Sample("silu_mul", (gate, up)),
            Sample("silu_mul", (gate.clone().requires_grad_(), up.clone().requires_grad_())),
            Sample("silu_mul_backward", (dy, gate, up)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    gu = seeded_randn(4, 16, dtype=torch.bfloat16, device=device, seed=35)
    gate, up = gu[:, :8], gu[:, 8:]
    dy = seeded_randn(4, 8, dtype=torch.bfloat16, device=device, seed=36)
    bad = [
        BadInput("silu_and_mul", (gu[:, :15],), ValueError, "last dimension must be even"),
        BadInput("silu_and_mul", (gu[0, 0],), ValueError, "gate_up must have at least one dimension"),
        BadInput("silu_and_mul", (gu.double(),), ValueError, "unsupported dtype torch.float64 for gate_up"),
        BadInput("silu_and_mul", (gu.int(),), ValueError, "unsupported dtype torch.int32 for gate_up"),
        BadInput("silu_and_mul_backward", (dy[:3], gu), ValueError, r"grad_out shape \[3, 8\] differs"),
        BadInput("silu_and_mul_backward", (gu, gu), ValueError, r"grad_out shape \[4, 16\] differs"),
        BadInput("silu_and_mul_backward", (dy.float(), gu), ValueError, "grad_out dtype torch.float32 differs"),
        BadInput("silu_and_mul_backward", (dy, gu[:, :7]), ValueError, "last dimension must be even"),
        BadInput("silu_mul", (gate, up[:, :7]), ValueError, r"up shape \[4, 7\] differs from gate shape \[4, 8\]"),
        BadInput("silu_mul", (gate, up.half()), ValueError, "up dtype torch.float16 differs from gate dtype"),
        BadInput("silu_mul", (gate[0, 0], up[0, 0]), ValueError, "gate must have at least one dimension"),
        BadInput("silu_mul", (gate.double(), up), ValueError, "unsupported dtype torch.float64 for gate"),
        BadInput("silu_mul", (gate, up.to(torch.float8_e4m3fn)), ValueError, "unsupported dtype torch.float8_e4m3fn for up"),
        BadInput("silu_mul_backward", (dy[:2], gate, up), ValueError, r"grad_out shape \[2, 8\] differs"),
        BadInput("silu_mul_backward", (dy.half(), gate, up), ValueError, "grad_out dtype torch.float16 differs"),
        BadInput("silu_mul_backward", (dy, gate, up[:3]), ValueError, "up shape"),
    ]
    if device != "cpu":
        bad += [
            BadInput("silu_mul", (gate, up.cpu()), RuntimeError, "up is on cpu"),
            BadInput("silu_and_mul_backward", (dy.cpu(), gu), RuntimeError, "grad_out is on cpu"),
            BadInput("silu_mul_backward", (dy, gate, up.cpu()), RuntimeError, "up is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, inter: int) -> InvarianceCase:
    gate_up = seeded_randn(rows, 2 * inter, dtype=dtype, device=device, seed=rows + inter, scale=3.0)
    return InvarianceCase(
        fn=silu_and_mul,
        rows=[gate_up],
        accuracy=lambda: (silu_and_mul(gate_up), reference_forward_fp32(gate_up)),
    )


def _autocast_args(device, act):
    return (seeded_randn(3, 5, 48, dtype=act, device=device, seed=28).requires_grad_(),)


def _autocast_silu_mul_args(device, act):
    return (seeded_randn(3, 5, 24, dtype=act, device=device, seed=25).requires_grad_(),
            seeded_randn(3, 5, 24, dtype=torch.float32, device=device, seed=26).requires_grad_())


def _host_cost_args(device, dims, tokens):
    inter = dims["intermediate_size"]
    return {OP: (seeded_randn(tokens, 2 * inter, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),)}


SPEC = OpSpec(
    name=OP,
    op_class="elementwise",
    ops=(
        OpDef("silu_and_mul", check_silu_and_mul, reference_silu_and_mul, lambda gu: _dense_like(gu, _halved(gu)),
              Autograd(_setup_silu_and_mul, _backward_silu_and_mul)),
        OpDef("silu_and_mul_backward", check_silu_and_mul_backward, reference_silu_and_mul_backward,
              lambda dy, gu: _dense_like(gu)),
        OpDef("silu_mul", check_silu_mul, reference_silu_mul, lambda gate, up: _dense_like(gate),
              Autograd(_setup_silu_mul, _backward_silu_mul), Autocast.PROMOTE),
        OpDef("silu_mul_backward", check_silu_mul_backward, reference_silu_mul_backward,
              lambda dy, gate, up: (_dense_like(gate), _dense_like(gate))),
    ),
    exports={"silu_and_mul": silu_and_mul, "silu_and_mul_backward": silu_and_mul_backward},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "inter": 4096}, {"rows": 1029, "inter": 129}),
    invariance_case=_invariance_case,
    autocast_cases=(
        AutocastCase("silu_and_mul", _autocast_args, silu_and_mul,
                     lambda gu: torch.nn.functional.silu(gu[..., :24]) * gu[..., 24:]),
        AutocastCase("silu_mul", _autocast_silu_mul_args, silu_and_mul,
                     lambda gate, up: torch.nn.functional.silu(gate) * up),
    ),
    host_cost_args=_host_cost_args,
)
