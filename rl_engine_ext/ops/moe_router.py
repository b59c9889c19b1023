"""moe_router: public functions, argument checks, references, fake outputs and the op's spec.

    experts = the top_k largest logits per token (descending; ties to the lower expert index;
              NaN ranks above every number, NaNs by index)
    weights = softmax(logits)[experts] in fp32; normalize: divided by their sum (rank order)

the top-k router of a mixture-of-experts layer (Qwen3-MoE / Qwen2-MoE with norm_topk_prob, Mixtral
with normalize=True). logits ``[T, E]`` (bf16/fp16/fp32), ``E <= MOE_ROUTER_MAX_EXPERTS`` (1024),
``1 <= top_k <= min(E, MOE_ROUTER_MAX_TOP_K)`` (32); outputs ``weights`` fp32 ``[T, top_k]`` and
``experts`` int64 ``[T, top_k]``. Every step of the softmax is one IEEE fp32 operation in an order
fixed by E alone (csrc/common/moe_router.h states it; ``_softmax_parts`` below is the same
arithmetic in PyTorch ops), so a token's weights, experts and logit gradient are the same bits
whatever else is in the batch, on the CPU, the GPU and in the reference alike.

Difference from transformers' ``Qwen3MoeTopKRouter`` (softmax in fp32, topk over the
probabilities, divide by their sum): the selection is over the logits. exp is monotone, so the
experts are the same except where two different logits give probabilities that round to the same
fp32 value (torch then picks by its own rule, we by the logits); the exp is ours (within about 2
ulp of expf), so the weights may differ from transformers' in their last bits.

The backward (``moe_router_backward``) goes through the normalisation and the softmax per token,
sums in rank order, one rounding to the logits dtype; the selection has no gradient.
"""

from __future__ import annotations

import torch

from .. import contract
from . import _checks
from ._spec import Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "moe_router"
GRAD_OP = "moe_router_backward"

# Limits shared with the kernels (csrc/common/moe_router.h; the native library exports both).
MOE_ROUTER_MAX_EXPERTS = 1024
MOE_ROUTER_MAX_TOP_K = 32
LANES = 32  # the lanes of the fixed E-sum


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/moe_router.h)
# ---------------------------------------------------------------------------------------------


def _check_logits(op: str, logits: torch.Tensor) -> None:
    _checks.check_dtype(op, "logits", logits)
    if logits.dim() != 2:
        raise _checks.fail(op, f"logits must be 2-D [tokens, experts], got shape {list(logits.shape)}")
    if logits.shape[1] > MOE_ROUTER_MAX_EXPERTS:
        raise _checks.fail(op, f"{logits.shape[1]} experts, more than MOE_ROUTER_MAX_EXPERTS = {MOE_ROUTER_MAX_EXPERTS}")


def _check_top_k(op: str, top_k: int, experts: int) -> None:
    most = min(experts, MOE_ROUTER_MAX_TOP_K)
    if not 1 <= top_k <= most:
        raise _checks.fail(op, f"top_k must be in [1, {most}] (at most the {experts} experts and "
                               f"MOE_ROUTER_MAX_TOP_K = {MOE_ROUTER_MAX_TOP_K}), got {top_k}")


def check_moe_router(logits: torch.Tensor, top_k: int, normalize: bool = True) -> None:
    _check_logits(OP, logits)
    _check_top_k(OP, top_k, logits.shape[1])


def check_moe_router_backward(grad_weights: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor,
                              normalize: bool = True) -> None:
    op = GRAD_OP
    _check_logits(op, logits)
    if grad_weights.dtype != torch.float32:
        raise _checks.fail(op, f"grad_weights must be torch.float32, got {grad_weights.dtype}")
    if experts.dtype != torch.int64:
        raise _checks.fail(op, f"experts must be torch.int64, got {experts.dtype}")
    if experts.dim() != 2 or experts.shape[0] != logits.shape[0]:
        raise _checks.fail(op, f"experts must be [tokens, top_k] with the {logits.shape[0]} tokens of logits, "
                               f"got shape {list(experts.shape)}")
    if grad_weights.shape != experts.shape:
        raise _checks.fail(op, f"grad_weights shape {list(grad_weights.shape)} differs from experts shape "
                               f"{list(experts.shape)}")
    _checks.check_device(op, "experts", experts, "logits", logits)
    _checks.check_device(op, "grad_weights", grad_weights, "logits", logits)
    _check_top_k(op, experts.shape[1], logits.shape[1])


def _check_experts_in_range(experts: torch.Tensor, num_experts: int) -> None:
    """The first bad expert id in row-major order (value-dependent: a fake kernel cannot see it)."""
    flat = experts.reshape(-1)
    bad = (flat < 0) | (flat >= num_experts)
    if bool(bad.any()):
        first = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(f"rl_align::{GRAD_OP}: expert {first} out of range for {num_experts} experts")


# ---------------------------------------------------------------------------------------------
# The arithmetic (csrc/common/moe_router.h, op for op in PyTorch: the same bits) and the references
# ---------------------------------------------------------------------------------------------

_F32 = torch.float32
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _c(value: float, like: torch.Tensor) -> torch.Tensor:
    """An fp32 constant (rounded once to fp32, as the C++ literal)."""
    return torch.tensor(value, dtype=_F32, device=like.device)


def moe_exp(d: torch.Tensor) -> torch.Tensor:
    """moe_exp of csrc/common/moe_router.h on fp32 d <= 0 (or NaN), elementwise, the same bits."""
    n = torch.round(d * _c(1.44269504088896341, d))  # round half to even, as rintf
    keep = n >= -125.0
    n = torch.where(keep, n, torch.zeros_like(n))
    r = (d - n * _c(0.693359375, d)) - n * _c(-2.12194440e-4, d)
    z = r * r
    p = _c(_EXP_POLY[0], d).expand_as(r)
    for coef in _EXP_POLY[1:]:
        p = p * r + _c(coef, d)
    y = (p * z + r) + 1.0
    pow2 = ((n.to(torch.int32) + 127) << 23).view(_F32)  # 2^n exactly
    out = torch.where(keep, y * pow2, torch.zeros_like(y))
    return torch.where(torch.isnan(d), d, out)


def lane_tree(v: torch.Tensor) -> torch.Tensor:
    """The fixed tree over the last dimension (32 lane sums): v[l] += v[l + h], h = 16 .. 1."""
    h = v.shape[-1] // 2
    while h > 0:
        v = v[..., :h] + v[..., h : 2 * h]
        h //= 2
    return v[..., 0].contiguous()


def _softmax_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, S) for fp32 logits x [T, E]: e = moe_exp(x - m), S their sum in the 32-lane order."""
    finite_max = torch.where(torch.isnan(x), torch.full_like(x, -torch.inf), x).amax(-1, keepdim=True)  # as fmaxf
    e = moe_exp(x - finite_max)
    t, n = e.shape
    padded = torch.nn.functional.pad(e, (0, (-n) % LANES))
    padded = padded.view(t, padded.shape[1] // LANES, LANES)
    lanes = torch.zeros(t, LANES, dtype=_F32, device=x.device)
    for b in range(padded.shape[1]):
        lanes = lanes + padded[:, b]
    return e, lane_tree(lanes).unsqueeze(-1)


def select_experts(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k first indices per row in the selection order (NaN first, then larger values,
    ties and NaNs by lower index): a stable descending sort, which ranks NaN above +inf."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()


def _rank_sum(terms: torch.Tensor) -> torch.Tensor:
    """((t_0 + t_1) + t_2) + ... over the last dimension, in rank order."""
    acc = terms[:, 0]
    for r in range(1, terms.shape[1]):
        acc = acc + terms[:, r]
    return acc.unsqueeze(-1)


def reference_moe_router(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """The fallback kernel: the kernels' arithmetic op for op (the same bits)."""
    check_moe_router(logits, top_k, normalize)
    x = logits.float()
    experts = select_experts(x, top_k)
    e, s = _softmax_parts(x)
    w = (e / s).gather(1, experts)
    if normalize:
        w = w / _rank_sum(w)
    return w, experts


def reference_moe_router_backward(grad_weights: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor,
                                  normalize: bool = True) -> torch.Tensor:
    check_moe_router_backward(grad_weights, logits, experts, normalize)
    _check_experts_in_range(experts, logits.shape[1])
    x = logits.float()
    e, s = _softmax_parts(x)
    p_all = e / s
    p = p_all.gather(1, experts)
    g = grad_weights
    if normalize:
        s2 = _rank_sum(p)
        dq = (g - _rank_sum(g * (p / s2))) / s2
    else:
        dq = g
    c = _rank_sum(p * dq)
    dp = torch.zeros_like(x)
    seen = torch.zeros_like(x, dtype=torch.bool)
    for r in range(experts.shape[1]):
        idx = experts[:, r : r + 1]
        d = dq[:, r : r + 1]
        dp.scatter_(1, idx, torch.where(seen.gather(1, idx), dp.gather(1, idx) + d, d))
        seen.scatter_(1, idx, True)
    return (p_all * (dp - c)).to(logits.dtype)


def reference_forward_fp32(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """Ground truth: (weights, experts) from torch's fp32 softmax (autocast off), transformers'
    arithmetic with our selection rule."""
    check_moe_router(logits, top_k, normalize)
    with contract.fp32_reference_mode():
        x = logits.float()
        experts = select_experts(x, top_k)
        w = torch.softmax(x, dim=-1).gather(1, experts)
        if normalize:
            w = w / w.sum(-1, keepdim=True)
        return w, experts


def _setup_context(ctx, inputs, output):
    logits, top_k, normalize = inputs
    _, experts = output
    ctx.save_for_backward(logits, experts)
    ctx.normalize = normalize
    ctx.mark_non_differentiable(experts)


def _backward(ctx, grad_weights, grad_experts):
    logits, experts = ctx.saved_tensors
    if grad_weights is None:
        grad_weights = torch.zeros(experts.shape, dtype=torch.float32, device=logits.device)
    return OPS.moe_router_backward(grad_weights, logits, experts, ctx.normalize), None, None


def _empty_outputs(logits, top_k, normalize=True):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def moe_router(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant top-k routing (differentiable in logits through the weights): ``(weights fp32
    [T, top_k], experts int64 [T, top_k])``, experts in descending logit order (ties to the lower
    index), weights their softmax probabilities, divided by their sum when ``normalize``."""
    return OPS.moe_router(logits, int(top_k), bool(normalize))


def moe_router_backward(grad_weights: torch.Tensor, logits: torch.Tensor, experts: torch.Tensor,
                        normalize: bool = True) -> torch.Tensor:
    """grad_logits in the logits dtype from the weights' fp32 gradient (the experts of the forward)."""
    return OPS.moe_router_backward(grad_weights, logits, experts, bool(normalize))


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for tokens, experts, top_k in ((5, 8, 2), (7, 129, 8), (0, 16, 4)):
        logits = seeded_randn(tokens, experts, dtype=dtype, device=device, seed=51, scale=2.0)
        _, ids = reference_moe_router(logits, top_k)
        g = seeded_randn(tokens, top_k, dtype=torch.float32, device=device, seed=52)
        out += [
            Sample(OP, (logits, top_k, True)),
            Sample(OP, (logits.clone().requires_grad_(), top_k, False)),
            Sample(GRAD_OP, (g, logits, ids, True)),
            Sample(GRAD_OP, (g, logits, ids, False)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    logits = seeded_randn(4, 16, dtype=torch.bfloat16, device=device, seed=53)
    ids = torch.tensor([[0, 3], [15, 2], [1, 4], [7, 8]], device=device)
    g = torch.zeros(4, 2, device=device)
    big = torch.zeros(2, MOE_ROUTER_MAX_EXPERTS + 1, device=device)
    bad = [
        BadInput(OP, (logits.double(), 2, True), ValueError, "unsupported dtype torch.float64 for logits"),
        BadInput(OP, (logits[0], 2, True), ValueError, r"logits must be 2-D \[tokens, experts\], got shape \[16\]"),
        BadInput(OP, (logits, 0, True), ValueError, r"top_k must be in \[1, 16\] .*got 0"),
        BadInput(OP, (logits, 17, True), ValueError, r"top_k must be in \[1, 16\] \(at most the 16 experts"),
        BadInput(OP, (logits[:, :0], 1, True), ValueError, r"top_k must be in \[1, 0\]"),
        BadInput(OP, (torch.zeros(2, 64, device=device), 33, True), ValueError,
                 r"top_k must be in \[1, 32\] .*MOE_ROUTER_MAX_TOP_K = 32\), got 33"),
        BadInput(OP, (big, 2, True), ValueError, "1025 experts, more than MOE_ROUTER_MAX_EXPERTS = 1024"),
        BadInput(GRAD_OP, (g.bfloat16(), logits, ids, True), ValueError, "grad_weights must be torch.float32"),
        BadInput(GRAD_OP, (g, logits, ids.int(), True), ValueError, "experts must be torch.int64, got torch.int32"),
        BadInput(GRAD_OP, (g[:3], logits, ids[:3], True), ValueError,
                 r"experts must be \[tokens, top_k\] with the 4 tokens of logits, got shape \[3, 2\]"),
        BadInput(GRAD_OP, (g[:, :1], logits, ids, True), ValueError,
                 r"grad_weights shape \[4, 1\] differs from experts shape \[4, 2\]"),
        BadInput(GRAD_OP, (g, logits.float()[:, :1], ids, True), ValueError, r"top_k must be in \[1, 1\]"),
        BadInput(GRAD_OP, (g, logits.half()[0], ids, True), ValueError, "logits must be 2-D"),
    ]
    if device == "cpu":  # on CUDA an out-of-range expert id is a device-side assert (tests/test_moe_router.py)
        bad += [
            BadInput(GRAD_OP, (g, logits, torch.tensor([[0, 3], [16, 2], [1, -1], [7, 8]]), True), IndexError,
                     "expert 16 out of range for 16 experts", True),
            BadInput(GRAD_OP, (g, logits, torch.tensor([[0, 3], [1, 2], [1, -1], [7, 8]]), True), IndexError,
                     "expert -1 out of range for 16 experts", True),
        ]
    else:
        bad += [
            BadInput(GRAD_OP, (g, logits, ids.cpu(), True), RuntimeError, "experts is on cpu"),
            BadInput(GRAD_OP, (g.cpu(), logits, ids, True), RuntimeError, "grad_weights is on cpu"),
        ]
    return bad


def seeded_router_logits(tokens: int, experts: int, *, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """Router logits with ties: a few tokens repeat a logit value across experts."""
    logits = seeded_randn(tokens, experts, dtype=torch.float32, device="cpu", seed=seed, scale=2.0)
    logits[::5, 1::3] = logits[::5, :1]  # every 5th token: ties with expert 0
    return logits.to(dtype=dtype, device=device)


def _invariance_case(device: str, dtype: torch.dtype, tokens: int, experts: int, top_k: int) -> InvarianceCase:
    logits = seeded_router_logits(tokens, experts, dtype=dtype, device=device, seed=tokens + experts)

    def accuracy():
        # The expert ids ride along as floats: any other choice is off by at least 1.
        w, ids = moe_router(logits, top_k)
        w_ref, ids_ref = reference_forward_fp32(logits, top_k)
        return torch.cat([w, ids.float()], -1), torch.cat([w_ref, ids_ref.float()], -1)

    return InvarianceCase(fn=lambda logits: moe_router(logits, top_k), rows=[logits], accuracy=accuracy)


def _host_cost_args(device, dims, tokens):
    experts = dims.get("num_experts", 128)
    top_k = dims.get("num_experts_per_tok", 8)
    logits = seeded_randn(tokens, experts, dtype=torch.bfloat16, device=device, seed=1).requires_grad_()
    return {OP: (logits, top_k, True)}


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        # No autocast rule: torch's softmax runs in fp32 under autocast, and the router computes in
        # fp32 from any input dtype already (the conversion of bf16/fp16 logits is exact, so casting
        # them first would change no bit); topk and gather have no rule.
        OpDef(OP, check_moe_router, reference_moe_router, _empty_outputs, Autograd(_setup_context, _backward)),
        OpDef(GRAD_OP, check_moe_router_backward, reference_moe_router_backward,
              lambda g, logits, experts, normalize=True: logits.new_empty(logits.shape)),
    ),
    exports={"moe_router": moe_router, "moe_router_backward": moe_router_backward,
             "MOE_ROUTER_MAX_EXPERTS": MOE_ROUTER_MAX_EXPERTS, "MOE_ROUTER_MAX_TOP_K": MOE_ROUTER_MAX_TOP_K},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"tokens": 257, "experts": 128, "top_k": 8}, {"tokens": 1029, "experts": 60, "top_k": 4}),
    invariance_case=_invariance_case,
    constants={"MOE_ROUTER_MAX_EXPERTS": MOE_ROUTER_MAX_EXPERTS, "MOE_ROUTER_MAX_TOP_K": MOE_ROUTER_MAX_TOP_K},
    host_cost_args=_host_cost_args,
)
