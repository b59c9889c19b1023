"""logprob: public functions, argument checks, references, fake outputs and the op's spec.

    z = logits / temperature (fp32),  logprob = z[target] - logsumexp(z),  entropy = -sum p log p

per token, from logits ``[..., V]`` (bf16/fp16/fp32) and targets ``[...]`` (int32/int64); fp32
results. The sum over V runs in a fixed order that depends only on V (csrc/common/logprob.h), so a
token's log-prob, entropy and gradient are the same bits whatever else is in the batch. A target
equal to ``ignore_index`` gives logprob 0, entropy 0 and a zero gradient; any other target outside
``[0, V)`` is an IndexError on the CPU and a device-side assert on CUDA (no host sync). The
logits are scaled by float32(1 / temperature), so the temperature must lie in [MIN_TEMPERATURE,
MAX_TEMPERATURE] (about [2.9e-39, 8.5e37]), where that is a normal float32 number; any other
temperature (<= 0, inf, NaN included) is a ValueError.

The backward is elementwise from the saved lse and entropy: grad_logits = (g * (onehot - p) +
gh * p * (E_p[z] - z)) / temperature, rounded once to the logits dtype, no reduction.
"""

from __future__ import annotations

import math
import re

import torch

from .. import contract
from . import _checks
from ._spec import AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "logprob"
GRAD_OP = "logprob_backward"
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/logprob.h)
# ---------------------------------------------------------------------------------------------


# The kernels scale the logits by float32(1 / temperature), which must be a normal float32 number:
# below MIN_TEMPERATURE it overflows to inf (every result NaN); above MAX_TEMPERATURE it is subnormal
# (few bits left) or 0 (every logit scaled to 0, and a masked -inf logit to NaN). Temperatures
# outside the range are refused rather than approximated by the T -> 0 or T -> inf limits.
MIN_TEMPERATURE = 1.0 / torch.finfo(torch.float32).max
MAX_TEMPERATURE = 1.0 / torch.finfo(torch.float32).tiny


def temperature_error(temperature: float) -> str | None:
    """Why the log-prob kernels refuse ``temperature`` (a message naming the argument and the
    allowed range), or None: the one copy of the rule in Python (C++: check_temperature,
    csrc/host/logprob.h)."""
    if MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        return None
    return (f"temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (1 / temperature a normal float32 "
            f"number), got {temperature:g}")


def check_temperature(op: str, temperature: float) -> None:
    error = temperature_error(temperature)
    if error is not None:
        raise _checks.fail(op, error)


def check_targets(op: str, targets: torch.Tensor, shape: list[int], ref_name: str, ref: torch.Tensor) -> None:
    _checks.check_device(op, "targets", targets, ref_name, ref)
    if targets.dtype not in (torch.int32, torch.int64):
        raise _checks.fail(op, f"targets must be torch.int32 or torch.int64, got {targets.dtype}")
    if list(targets.shape) != list(shape):
        raise _checks.fail(op, f"targets shape {list(targets.shape)} must be {ref_name} shape without the last "
                               f"dimension {list(shape)}")


def _check_row_stat(op: str, name: str, t: torch.Tensor, targets: torch.Tensor) -> None:
    _checks.check_device(op, name, t, "targets", targets)
    if t.dtype != torch.float32:
        raise _checks.fail(op, f"{name} must be torch.float32, got {t.dtype}")
    if t.shape != targets.shape:
        raise _checks.fail(op, f"{name} shape {list(t.shape)} differs from targets shape {list(targets.shape)}")


def check_backward_stats(op: str, grad_logprob, grad_entropy, entropy, lse, targets) -> None:
    _check_row_stat(op, "grad_logprob", grad_logprob, targets)
    if grad_entropy is not None:
        _check_row_stat(op, "grad_entropy", grad_entropy, targets)
    _check_row_stat(op, "entropy", entropy, targets)
    _check_row_stat(op, "lse", lse, targets)


def _check_logprob_args(op: str, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    _checks.check_dtype(op, "logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise _checks.fail(op, f"logits must have a last (vocabulary) dimension of size > 0, got shape {list(logits.shape)}")
    check_targets(op, targets, list(logits.shape[:-1]), "logits", logits)
    check_temperature(op, temperature)


def check_logprob(logits, targets, temperature=1.0, ignore_index=IGNORE_INDEX) -> None:
    _check_logprob_args(OP, logits, targets, temperature)


def check_logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse, temperature, ignore_index) -> None:
    _check_logprob_args(GRAD_OP, logits, targets, temperature)
    check_backward_stats(GRAD_OP, grad_logprob, grad_entropy, entropy, lse, targets)


def check_targets_in_range(op: str, targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The first bad target in row order (value-dependent: a fake kernel cannot see it)."""
    flat = targets.reshape(-1).long()
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        first = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(f"rl_align::{op}: target {first} out of range for a vocabulary of {vocab} "
                         f"(ignore_index {ignore_index})")


# ---------------------------------------------------------------------------------------------
# The arithmetic (csrc/common/logprob.h, in PyTorch ops) and the references
# ---------------------------------------------------------------------------------------------


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = logits * (1 / temperature) in fp32 (the reciprocal rounded once to fp32, as the kernels)."""
    return logits.float() * (1.0 / temperature)


def _forward_math(z: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """(logprob, entropy, lse) in fp32 from fp32 scaled logits: the kernels' formulas (m the row
    max, d = z - m, -inf logits contributing nothing), PyTorch's summation order."""
    m = z.amax(-1, keepdim=True)
    masked = z == -math.inf
    d = torch.where(masked, torch.zeros_like(z), z - m)
    e = torch.where(masked, torch.zeros_like(z), torch.exp(d))
    log_s = torch.log(e.sum(-1))
    u = (e * d).sum(-1)
    ignored = targets == ignore_index
    safe = torch.where(ignored, torch.zeros_like(targets), targets).long()
    z_target = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    m = m.squeeze(-1)
    zero = torch.zeros_like(log_s)
    logprob = torch.where(ignored, zero, (z_target - m) - log_s)
    entropy = torch.where(ignored, zero, log_s - u / e.sum(-1))
    return logprob, entropy, m + log_s


def _backward_math(grad_logprob, grad_entropy, z, targets, entropy, lse, temperature, ignore_index):
    """fp32 d logits (before the rounding to the logits dtype)."""
    inv_t = 1.0 / temperature
    p = torch.exp(z - lse.unsqueeze(-1))
    ignored = targets == ignore_index
    safe = torch.where(ignored, torch.zeros_like(targets), targets).long()
    onehot = torch.zeros_like(z).scatter_(-1, safe.unsqueeze(-1), 1.0)
    dz = grad_logprob.unsqueeze(-1) * (onehot - p)
    if grad_entropy is not None:
        ez = (lse - entropy).unsqueeze(-1)
        term = (grad_entropy.unsqueeze(-1) * p) * (ez - z)
        dz = torch.where(p == 0, dz, dz + term)
    return torch.where(ignored.unsqueeze(-1), torch.zeros_like(dz), dz * inv_t)


def reference_logprob(logits, targets, temperature=1.0, ignore_index=IGNORE_INDEX):
    """The fallback kernel: the kernels' formulas in fp32 (PyTorch's summation order)."""
    check_logprob(logits, targets, temperature, ignore_index)
    check_targets_in_range(OP, targets, logits.shape[-1], ignore_index)
    return _forward_math(_scaled(logits, temperature), targets, ignore_index)


def reference_logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse, temperature, ignore_index):
    check_logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse, temperature, ignore_index)
    check_targets_in_range(GRAD_OP, targets, logits.shape[-1], ignore_index)
    dz = _backward_math(grad_logprob, grad_entropy, _scaled(logits, temperature), targets, entropy, lse,
                        temperature, ignore_index)
    return dz.to(logits.dtype)


def float64_truth(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int):
    """(logprob, entropy) in fp32 from a float64 log_softmax of ``logits`` (any float dtype)."""
    with contract.fp32_reference_mode():
        logp = torch.log_softmax(logits.double() / temperature, dim=-1)
        ignored = targets == ignore_index
        safe = torch.where(ignored, torch.zeros_like(targets), targets).long()
        lp = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        p = logp.exp()
        ent = -torch.where(p == 0, torch.zeros_like(p), p * logp).sum(-1)
        zero = torch.zeros_like(lp)
        return torch.where(ignored, zero, lp).float(), torch.where(ignored, zero, ent).float()


def reference_forward_fp32(logits, targets, temperature=1.0, ignore_index=IGNORE_INDEX):
    """Ground truth: (logprob, entropy) in fp32 by a float64 log_softmax, autocast off. (An fp32
    log_softmax is not a ground truth here: over V = 151936 it is itself off by up to 3e-5 at
    |logprob| ~ 30, measured on the CPU, beyond the contract's fp32 atol.)"""
    check_logprob(logits, targets, temperature, ignore_index)
    return float64_truth(logits, targets, temperature, ignore_index)


def _row_stats(ref: torch.Tensor, shape) -> tuple[torch.Tensor, ...]:
    return tuple(ref.new_empty(tuple(shape), dtype=torch.float32) for _ in range(3))


def _setup_context(ctx, inputs, output):
    logits, targets, temperature, ignore_index = inputs
    _, entropy, lse = output
    ctx.save_for_backward(logits, targets, entropy, lse)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logprob, grad_entropy, grad_lse):
    logits, targets, entropy, lse = ctx.saved_tensors
    grad_logits = OPS.logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse,
                                       ctx.temperature, ctx.ignore_index)
    return grad_logits, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False,
            ignore_index: int = IGNORE_INDEX):
    """Batch-invariant per-token log-probs (differentiable): fp32 ``logprob[...]`` of each target
    under ``softmax(logits / temperature)``, and with ``return_entropy`` also the entropy of that
    distribution: ``(logprob, entropy)``. Targets equal to ``ignore_index`` give 0 and no gradient.
    ``temperature`` in [MIN_TEMPERATURE, MAX_TEMPERATURE] (about [2.9e-39, 8.5e37]), else a ValueError."""
    lp, entropy, _ = OPS.logprob(logits, targets, float(temperature), int(ignore_index))
    return (lp, entropy) if return_entropy else lp


def logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse, temperature: float = 1.0,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """grad_logits in the logits dtype from the forward's entropy and lse (``torch.ops.rl_align.logprob``'s
    second and third outputs); ``grad_entropy`` None: no entropy term."""
    return OPS.logprob_backward(grad_logprob, grad_entropy, logits, targets, entropy, lse,
                                float(temperature), int(ignore_index))


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _targets(shape, vocab: int, device, seed: int, ignored_every: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, tuple(shape), generator=g)
    if ignored_every:
        flat = t.view(-1)
        flat[::ignored_every] = IGNORE_INDEX
    return t.to(device)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape, vocab in (((5,), 37), ((2, 3), 129), ((0,), 16)):
        logits = seeded_randn(*shape, vocab, dtype=dtype, device=device, seed=41, scale=3.0)
        targets = _targets(shape, vocab, device, seed=42, ignored_every=3)
        lp, ent, lse = reference_logprob(logits, targets, 0.7)
        g = seeded_randn(*shape, dtype=torch.float32, device=device, seed=43)
        gh = seeded_randn(*shape, dtype=torch.float32, device=device, seed=44)
        out += [
            Sample(OP, (logits, targets, 1.0, IGNORE_INDEX)),
            Sample(OP, (logits.clone().requires_grad_(), targets.int(), 0.7, IGNORE_INDEX)),
            Sample(GRAD_OP, (g, gh, logits, targets, ent, lse, 0.7, IGNORE_INDEX)),
            Sample(GRAD_OP, (g, None, logits, targets, ent, lse, 0.7, IGNORE_INDEX)),
        ]
    return out


# How the checks refuse a temperature outside [MIN_TEMPERATURE, MAX_TEMPERATURE] (then the value).
TEMPERATURE_OUT_OF_RANGE = (r"temperature must be in \[2.93874e-39, 8.50706e\+37\] \(1 / temperature a normal float32 "
                            r"number\), got ")


def _bad_inputs(device: str) -> list[BadInput]:
    logits = seeded_randn(4, 16, dtype=torch.bfloat16, device=device, seed=45)
    t = _targets((4,), 16, device, seed=46)
    g = torch.zeros(4, device=device)
    bad = [
        BadInput(OP, (logits.double(), t, 1.0, -100), ValueError, "unsupported dtype torch.float64 for logits"),
        BadInput(OP, (logits[0, 0], t[0], 1.0, -100), ValueError, "logits must have a last"),
        BadInput(OP, (logits[:, :0], t, 1.0, -100), ValueError, r"vocabulary\) dimension of size > 0, got shape \[4, 0\]"),
        BadInput(OP, (logits, t.float(), 1.0, -100), ValueError, "targets must be torch.int32 or torch.int64, got torch.float32"),
        BadInput(OP, (logits, t[:3], 1.0, -100), ValueError, r"targets shape \[3\] must be logits shape without the last dimension \[4\]"),
        *(BadInput(OP, (logits, t, temperature, -100), ValueError, TEMPERATURE_OUT_OF_RANGE + re.escape(shown))
          for temperature, shown in ((0.0, "0"), (-1.0, "-1"), (math.inf, "inf"), (math.nan, "nan"), (1e-39, "1e-39"),
                                     (math.nextafter(MIN_TEMPERATURE, 0.0), "2.93874e-39"), (1e38, "1e+38"))),
        BadInput(GRAD_OP, (g.bfloat16(), None, logits, t, g, g, 1.0, -100), ValueError, "grad_logprob must be torch.float32"),
        BadInput(GRAD_OP, (g[:3], None, logits, t, g, g, 1.0, -100), ValueError, r"grad_logprob shape \[3\] differs from targets shape \[4\]"),
        BadInput(GRAD_OP, (g, g[:2], logits, t, g, g, 1.0, -100), ValueError, r"grad_entropy shape \[2\] differs"),
        BadInput(GRAD_OP, (g, None, logits, t, g.half(), g, 1.0, -100), ValueError, "entropy must be torch.float32"),
        BadInput(GRAD_OP, (g, None, logits, t, g, g[None], 1.0, -100), ValueError, r"lse shape \[1, 4\] differs"),
        BadInput(GRAD_OP, (g, None, logits, t, g, g, 1e-39, -100), ValueError, TEMPERATURE_OUT_OF_RANGE + "1e-39"),
    ]
    if device == "cpu":  # on CUDA an out-of-range target is a device-side assert (tests/test_logprob.py)
        bad += [
            BadInput(OP, (logits, torch.tensor([0, 16, 3, 1]), 1.0, -100), IndexError,
                     r"target 16 out of range for a vocabulary of 16 \(ignore_index -100\)", True),
            BadInput(OP, (logits, torch.tensor([0, 1, -1, 1], dtype=torch.int32), 1.0, -100), IndexError,
                     "target -1 out of range", True),
            BadInput(OP, (logits, torch.tensor([0, 1, -100, 1]), 1.0, 5), IndexError, "target -100 out of range", True),
            BadInput(GRAD_OP, (g, None, logits, torch.tensor([0, 99, 3, 1]), g, g, 1.0, -100), IndexError,
                     "target 99 out of range", True),
        ]
    else:
        bad += [
            BadInput(OP, (logits, t.cpu(), 1.0, -100), RuntimeError, "targets is on cpu"),
            BadInput(GRAD_OP, (g.cpu(), None, logits, t, g, g, 1.0, -100), RuntimeError, "grad_logprob is on cpu"),
            BadInput(GRAD_OP, (g, None, logits, t, g, g.cpu(), 1.0, -100), RuntimeError, "lse is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, vocab: int) -> InvarianceCase:
    logits = seeded_randn(rows, vocab, dtype=dtype, device=device, seed=rows + vocab, scale=4.0)
    targets = _targets((rows,), vocab, device, seed=rows, ignored_every=17)
    return InvarianceCase(
        fn=lambda logits, targets: logprob(logits, targets, 0.8, return_entropy=True),
        rows=[logits, targets],
        accuracy=lambda: (torch.stack(logprob(logits, targets, 0.8, return_entropy=True)),
                          torch.stack(reference_forward_fp32(logits, targets, 0.8))),
    )


AUTOCAST_TEMPERATURE = 0.9


def torch_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """What logprob replaces in torch: log_softmax of the fp32 logits, gathered at the targets, and the entropy."""
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _autocast_args(device, act):
    return (seeded_randn(2, 5, 70, dtype=act, device=device, seed=22, scale=3.0).requires_grad_(),
            _targets((2, 5), 70, device, seed=7, ignored_every=4))


SPEC = OpSpec(
    name=OP,
    op_class="logprob",
    ops=(
        OpDef(OP, check_logprob, reference_logprob, lambda logits, targets, *rest: _row_stats(logits, targets.shape),
              Autograd(_setup_context, _backward)),
        OpDef(GRAD_OP, check_logprob_backward, reference_logprob_backward,
              lambda g, gh, logits, *rest: logits.new_empty(logits.shape)),
    ),
    exports={"logprob": logprob, "logprob_backward": logprob_backward, "MIN_TEMPERATURE": MIN_TEMPERATURE,
             "MAX_TEMPERATURE": MAX_TEMPERATURE},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 67, "vocab": 32000}, {"rows": 257, "vocab": 1001}),
    invariance_case=_invariance_case,
    autocast_cases=(AutocastCase(OP, _autocast_args,
                                 lambda z, t: logprob(z, t, AUTOCAST_TEMPERATURE, return_entropy=True),
                                 lambda z, t: torch_token_logprobs(z, t, AUTOCAST_TEMPERATURE)),),
)
