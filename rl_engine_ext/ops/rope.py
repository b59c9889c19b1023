"""rope: public functions, argument checks, references, fake outputs and the op's spec.

    (q_out, k_out) = rope(q, k, positions, inv_freq, style="neox", layout="bhsd", attention_scaling=1.0)

Rotary position embedding of q and k, Hugging Face's ``apply_rotary_pos_emb`` with the angles
computed per token inside the kernel. For the token at integer position ``pos`` and frequency i
(0 <= i < R/2, R = rotary_dim = 2 * len(inv_freq) <= head_dim):

    angle = float32(pos) * inv_freq[i]                 (one fp32 multiply, as HF's fp32 matmul)
    c, s  = cos(angle) * attention_scaling, sin(angle) * attention_scaling     (fp32, full accuracy)
    (a, b) -> (a * c - b * s, b * c + a * s)           (fp32, one rounding to the input dtype)

Pairs (a, b): ``style="neox"`` rotate-half (i, i + R/2) (Llama, Qwen, NeoX), ``style="gptj"``
interleaved (2i, 2i + 1). Elements R .. head_dim-1 are copied unchanged (partial rotary). inv_freq
(fp32, supplied by the caller) carries any frequency scaling (Llama-3, YaRN); attention_scaling is
the factor HF rotary modules multiply cos and sin by (YaRN, LongRoPE; 1.0 otherwise).

Layouts: ``"bhsd"`` q ``[B, Hq, S, D]`` (HF's attention layout), ``"bshd"`` ``[B, S, Hq, D]``,
both with positions ``[B, S]``; ``"thd"`` packed ``[T, Hq, D]`` with positions ``[T]`` (each
packed sequence restarting at 0). k has the same tokens and head_dim, any head count (GQA).
Positions int32/int64 on q's device; strided views of q, k and positions are read in place
(positions may be an expanded ``[1, S] -> [B, S]`` view). Each output is laid out as
``torch.empty_like`` lays out its operand (its strides if dense, else dense in its dimension
order: as torch's elementwise ops, so HF's transposed projection view stays token-major, as HF's
own rotation leaves it), or contiguous where that would not give a unit last stride.
The backward is the transposed rotation (the same with s negated): ``rope_backward``.

Invariance (native kernels): every output element is a function of its own token's position and
values alone (csrc/common/rope.h), so a token gets the same bits in any batch, padding, packing,
chunking, and in a decode step as in the prefill, in every layout and view.
Positions are exact up to 2^24; beyond, float32(pos) rounds to the nearest fp32, as in HF.
"""

from __future__ import annotations

import math

import torch

from .. import contract, testing
from . import _checks
from ._spec import AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "rope"
STYLES = ("neox", "gptj")
LAYOUTS = {"bhsd": "[batch, heads, seq, head_dim]", "bshd": "[batch, seq, heads, head_dim]",
           "thd": "[tokens, heads, head_dim]"}


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The default (unscaled) inverse frequencies as HF's default rope init computes them: fp32
    ``1 / theta ** (arange(0, R, 2) / R)`` on the CPU (HF builds the buffer there; a GPU pow may
    round differently), then moved to ``device``."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return (1.0 / (theta ** exponent)).to(device)


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/rope.h)
# ---------------------------------------------------------------------------------------------


def _tokens(t: torch.Tensor, layout: str) -> tuple[int, ...]:
    return {"bhsd": (t.shape[0], t.shape[2]), "bshd": (t.shape[0], t.shape[1]), "thd": (t.shape[0],)}[layout]


def _check(op: str, qn: str, q: torch.Tensor, kn: str, k: torch.Tensor, positions: torch.Tensor,
           inv_freq: torch.Tensor, style: str, layout: str, attention_scaling: float) -> None:
    if style not in STYLES:
        raise _checks.fail(op, f"style must be 'neox' or 'gptj', got '{style}'")
    if layout not in LAYOUTS:
        raise _checks.fail(op, f"layout must be 'bhsd', 'bshd' or 'thd', got '{layout}'")
    dims = 3 if layout == "thd" else 4
    _checks.check_dtype(op, qn, q)
    _checks.check_dtype(op, kn, k)
    for name, t in ((qn, q), (kn, k)):
        if t.dim() != dims:
            raise _checks.fail(op, f"{name} must be {dims}-D {LAYOUTS[layout]} for layout '{layout}', "
                                   f"got shape {list(t.shape)}")
    _checks.check_same(op, kn, k, qn, q)
    if q.shape[-1] != k.shape[-1]:
        raise _checks.fail(op, f"{qn} head_dim {q.shape[-1]} differs from {kn} head_dim {k.shape[-1]}")
    tokens = _tokens(q, layout)
    if tokens != _tokens(k, layout):
        raise _checks.fail(op, f"{qn} {list(q.shape)} and {kn} {list(k.shape)} must have the same tokens (batch and seq)")
    if positions.dtype not in (torch.int32, torch.int64):
        raise _checks.fail(op, f"positions must be torch.int32 or torch.int64, got {positions.dtype}")
    if tuple(positions.shape) != tokens:
        what = "[tokens]" if layout == "thd" else "[batch, seq]"
        raise _checks.fail(op, f"positions must have shape {list(tokens)} ({what}), got {list(positions.shape)}")
    _checks.check_device(op, "positions", positions, qn, q)
    if inv_freq.dtype != torch.float32:
        raise _checks.fail(op, f"inv_freq must be torch.float32, got {inv_freq.dtype}")
    if inv_freq.dim() != 1:
        raise _checks.fail(op, f"inv_freq must be 1-D [rotary_dim / 2], got shape {list(inv_freq.shape)}")
    if 2 * inv_freq.shape[0] > q.shape[-1]:
        raise _checks.fail(op, f"inv_freq has {inv_freq.shape[0]} frequencies but head_dim is {q.shape[-1]} "
                               "(rotary_dim = 2 * frequencies must be <= head_dim)")
    _checks.check_device(op, "inv_freq", inv_freq, qn, q)
    if not math.isfinite(attention_scaling):
        raise _checks.fail(op, f"attention_scaling must be finite, got {attention_scaling}")


def check_rope(q, k, positions, inv_freq, style, layout, attention_scaling) -> None:
    _check(OP, "q", q, "k", k, positions, inv_freq, style, layout, attention_scaling)


def check_rope_backward(grad_q, grad_k, positions, inv_freq, style, layout, attention_scaling) -> None:
    _check("rope_backward", "grad_q", grad_q, "grad_k", grad_k, positions, inv_freq, style, layout, attention_scaling)


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """fp32 angles float32(pos) * inv_freq, shaped to broadcast over the layout's heads."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.unsqueeze(2 if layout == "bshd" else 1)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, style: str) -> torch.Tensor:
    """(a, b) -> (a c - b s, b c + a s) over the pairs of the first R = 2 * c.shape[-1] elements."""
    r = 2 * c.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    a, b = (rot[..., : r // 2], rot[..., r // 2 :]) if style == "neox" else (rot[..., 0::2], rot[..., 1::2])
    ya, yb = a * c - b * s, b * c + a * s
    out = torch.cat([ya, yb], -1) if style == "neox" else torch.stack([ya, yb], -1).flatten(-2)
    return torch.cat([out, rest], -1)


def _reference(check, q, k, positions, inv_freq, style, layout, attention_scaling, inverse):
    check(q, k, positions, inv_freq, style, layout, attention_scaling)
    angles = _angles(positions, inv_freq, layout)
    c, s = torch.cos(angles) * attention_scaling, torch.sin(angles) * attention_scaling
    s = -s if inverse else s
    return tuple(_output_like(t).copy_(_rotate(t.float(), c, s, style)) for t in (q, k))


def reference_forward(q, k, positions, inv_freq, style="neox", layout="bhsd", attention_scaling=1.0):
    """The dtype path: fp32 angles, cos/sin and rotation, one rounding (what the kernels compute)."""
    return _reference(check_rope, q, k, positions, inv_freq, style, layout, attention_scaling, False)


def reference_backward(grad_q, grad_k, positions, inv_freq, style="neox", layout="bhsd", attention_scaling=1.0):
    """The transposed rotation of the gradients (sin negated), fp32 math, one rounding."""
    return _reference(check_rope_backward, grad_q, grad_k, positions, inv_freq, style, layout, attention_scaling, True)


def reference_forward_fp32(q, k, positions, inv_freq, style="neox", layout="bhsd", attention_scaling=1.0):
    """Ground truth (fp32 outputs): the op's fp32 angle (float32(pos) * inv_freq, part of its
    definition, as in HF), then cos, sin and the rotation of fp32 inputs in float64."""
    check_rope(q, k, positions, inv_freq, style, layout, attention_scaling)
    with contract.fp32_reference_mode():
        angles = _angles(positions, inv_freq, layout).double()
        c, s = torch.cos(angles) * attention_scaling, torch.sin(angles) * attention_scaling
        return tuple(_rotate(t.float().double(), c, s, style).float() for t in (q, k))


def _output_like(t: torch.Tensor) -> torch.Tensor:
    """The output layout rule (C++: rope_output_like in csrc/host/rope.h)."""
    out = torch.empty_like(t)
    if out.dim() and out.shape[-1] > 1 and out.stride(-1) != 1:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out


def _empty(q, k, *args):
    return _output_like(q), _output_like(k)


def _setup_context(ctx, inputs, output):
    _, _, positions, inv_freq, style, layout, attention_scaling = inputs
    ctx.save_for_backward(positions, inv_freq)
    ctx.rope_args = (style, layout, attention_scaling)


def _backward(ctx, grad_q, grad_k):
    positions, inv_freq = ctx.saved_tensors
    dq, dk = OPS.rope_backward(grad_q, grad_k, positions, inv_freq, *ctx.rope_args)
    return (dq if ctx.needs_input_grad[0] else None, dk if ctx.needs_input_grad[1] else None,
            None, None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, style: str = "neox",
         layout: str = "bhsd", attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant rotary position embedding of q and k (differentiable in q and k)."""
    return OPS.rope(q, k, positions, inv_freq, style, layout, attention_scaling)


def rope_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  style: str = "neox", layout: str = "bhsd",
                  attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k) of rope: the transposed rotation of the incoming gradients."""
    return OPS.rope_backward(grad_q, grad_k, positions, inv_freq, style, layout, attention_scaling)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def packed_positions(tokens: int, seed: int, max_len: int = 50, device: str | torch.device = "cpu") -> torch.Tensor:
    """int64 [tokens]: packed sequences of random lengths (1..max_len), each counting from 0."""
    g = torch.Generator().manual_seed(seed)
    parts, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(1, max_len + 1, (1,), generator=g)))
        parts.append(torch.arange(n))
        left -= n
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)


def _operands(shape_q, shape_k, dtype, device, seed):
    return (seeded_randn(*shape_q, dtype=dtype, device=device, seed=seed),
            seeded_randn(*shape_k, dtype=dtype, device=device, seed=seed + 1))


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    cases = [  # (q shape, k shape, positions, inv_freq length, style, layout, scaling)
        ((7, 4, 64), (7, 2, 64), packed_positions(7, 3, 4), 32, "neox", "thd", 1.0),
        ((2, 4, 5, 32), (2, 1, 5, 32), torch.randint(0, 4000, (2, 5), generator=g, dtype=torch.int32), 8, "gptj",
         "bhsd", 0.9),
        ((2, 5, 3, 48), (2, 5, 3, 48), torch.arange(5).expand(2, 5), 24, "neox", "bshd", 1.0),
        ((0, 4, 64), (0, 2, 64), torch.zeros(0, dtype=torch.int64), 32, "neox", "thd", 1.0),
    ]
    out = []
    for i, (sq, sk, pos, nfreq, style, layout, scaling) in enumerate(cases):
        q, k = _operands(sq, sk, dtype, device, 30 + 2 * i)
        dq, dk = _operands(sq, sk, dtype, device, 50 + 2 * i)
        pos = pos.to(device)
        inv_freq = rope_inv_freq(2 * nfreq, 1e4, device)
        tail = (pos, inv_freq, style, layout, scaling)
        out += [
            Sample("rope", (q, k) + tail),
            Sample("rope", (q.clone().requires_grad_(), k.clone().requires_grad_()) + tail),
            Sample("rope_backward", (dq, dk) + tail),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    q, k = _operands((3, 4, 16), (3, 2, 16), torch.bfloat16, device, 60)
    pos = torch.arange(3, device=device)
    f = rope_inv_freq(16, 1e4, device)
    ok = (pos, f, "neox", "thd", 1.0)
    bad = [
        BadInput("rope", (q, k, pos, f, "rotate", "thd", 1.0), ValueError, "style must be 'neox' or 'gptj', got 'rotate'"),
        BadInput("rope", (q, k, pos, f, "neox", "sbhd", 1.0), ValueError, "layout must be 'bhsd', 'bshd' or 'thd'"),
        BadInput("rope", (q, k, pos, f, "neox", "bhsd", 1.0), ValueError, r"q must be 4-D \[batch, heads, seq, head_dim\]"),
        BadInput("rope", (q, k.float()) + ok, ValueError, "k dtype torch.float32 differs from q dtype torch.bfloat16"),
        BadInput("rope", (q, k[..., :8]) + ok, ValueError, "q head_dim 16 differs from k head_dim 8"),
        BadInput("rope", (q, k[:2]) + ok, ValueError, "must have the same tokens"),
        BadInput("rope", (q, k, pos.float(), f, "neox", "thd", 1.0), ValueError,
                 "positions must be torch.int32 or torch.int64, got torch.float32"),
        BadInput("rope", (q, k, pos[:2], f, "neox", "thd", 1.0), ValueError, r"positions must have shape \[3\]"),
        BadInput("rope", (q, k, pos, f.bfloat16(), "neox", "thd", 1.0), ValueError,
                 "inv_freq must be torch.float32, got torch.bfloat16"),
        BadInput("rope", (q, k, pos, f.view(2, 4), "neox", "thd", 1.0), ValueError, "inv_freq must be 1-D"),
        BadInput("rope", (q, k, pos, rope_inv_freq(18, 1e4, device), "neox", "thd", 1.0), ValueError,
                 "inv_freq has 9 frequencies but head_dim is 16"),
        BadInput("rope", (q, k, pos, f, "neox", "thd", math.inf), ValueError, "attention_scaling must be finite"),
        BadInput("rope", (q.double(), k.double()) + ok, ValueError, "unsupported dtype torch.float64 for q"),
        BadInput("rope_backward", (q, k.half()) + ok, ValueError, "grad_k dtype torch.float16 differs from grad_q dtype"),
        BadInput("rope_backward", (q, k, pos.view(1, 3), f, "neox", "bshd", 1.0), ValueError,
                 r"grad_q must be 4-D \[batch, seq, heads, head_dim\]"),
        BadInput("rope_backward", (q[None], k[None], pos[None, :2], f, "neox", "bshd", 1.0), ValueError,
                 r"positions must have shape \[1, 3\] \(\[batch, seq\]\)"),
    ]
    if device != "cpu":
        bad += [
            BadInput("rope", (q, k.cpu()) + ok, RuntimeError, "k is on cpu"),
            BadInput("rope", (q, k, pos.cpu(), f, "neox", "thd", 1.0), RuntimeError, "positions is on cpu"),
            BadInput("rope_backward", (q, k, pos, f.cpu(), "neox", "thd", 1.0), RuntimeError, "inv_freq is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, heads_q: int, heads_kv: int, head_dim: int, rotary_dim: int,
                     gptj: int = 0, tokens: int = 0, batch: int = 0, seq: int = 0) -> InvarianceCase:
    """``tokens``: packed (thd) sequences of random lengths, the harness's rows being tokens;
    else ``batch`` x ``seq`` (bhsd, rows = sequences) at random start positions, plus a decode
    step of each sequence's last position against its prefill and the bshd view of the batch."""
    style = "gptj" if gptj else "neox"
    inv_freq = rope_inv_freq(rotary_dim, 1e6, device)
    if tokens:
        layout = "thd"
        q, k = _operands((tokens, heads_q, head_dim), (tokens, heads_kv, head_dim), dtype, device, tokens)
        positions = packed_positions(tokens, tokens, device=device)
    else:
        layout = "bhsd"
        q, k = _operands((batch, heads_q, seq, head_dim), (batch, heads_kv, seq, head_dim), dtype, device, seq)
        g = torch.Generator().manual_seed(seq)
        positions = (torch.randint(0, 40000, (batch, 1), generator=g) + torch.arange(seq)).to(device)

    def fn(q, k, positions):
        return rope(q, k, positions, inv_freq, style, layout)

    def extra():
        if layout == "thd":  # one batch of packed sequences is also a bshd batch of one row
            got = rope(q[None], k[None], positions[None], inv_freq, style, "bshd")
            return [d for d in (testing.compare(f"out[{i}]", "bshd[1 row] vs thd", g[0], w)
                                for i, (g, w) in enumerate(zip(got, fn(q, k, positions)))) if d is not None]
        whole = fn(q, k, positions)
        decode = fn(q[:, :, -1:], k[:, :, -1:], positions[:, -1:])
        bshd = rope(q.transpose(1, 2), k.transpose(1, 2), positions, inv_freq, style, "bshd")
        drifts = [testing.compare(f"out[{i}]", "decode[last position] vs prefill", d, w[:, :, -1:])
                  for i, (d, w) in enumerate(zip(decode, whole))]
        drifts += [testing.compare(f"out[{i}]", "bshd view vs bhsd", b.transpose(1, 2), w)
                   for i, (b, w) in enumerate(zip(bshd, whole))]
        return [d for d in drifts if d is not None]

    def accuracy():
        got = fn(q, k, positions)
        truth = reference_forward_fp32(q, k, positions, inv_freq, style, layout)
        return torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in truth])

    return InvarianceCase(fn=fn, rows=[q, k, positions], accuracy=accuracy, extra_forward=extra)


def _hf_rope(q, k, positions, inv_freq):
    """The torch counterpart: Hugging Face's apply_rotary_pos_emb (cos and sin in fp32, cast to the
    activations' dtype)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)

    def rotate(x):
        half = x.shape[-1] // 2
        x_rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * emb.cos().to(x.dtype) + x_rot * emb.sin().to(x.dtype)

    return rotate(q), rotate(k)


def _autocast_args(device, act):
    return (seeded_randn(2, 4, 6, 64, dtype=act, device=device, seed=23).requires_grad_(),
            seeded_randn(2, 2, 6, 64, dtype=act, device=device, seed=24).requires_grad_(),
            torch.arange(12, device=device).view(2, 6) + 3,
            rope_inv_freq(64, device=device))


def _host_cost_args(device, dims, tokens):
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    return {OP: (seeded_randn(tokens, hq, d, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),
                 seeded_randn(tokens, hkv, d, dtype=torch.bfloat16, device=device, seed=2).requires_grad_(),
                 torch.arange(tokens, device=device), rope_inv_freq(d, 1e6, device), "neox", "thd", 1.0)}


SPEC = OpSpec(
    name=OP,
    op_class="elementwise",
    ops=(
        OpDef("rope", check_rope, reference_forward, _empty, Autograd(_setup_context, _backward)),
        OpDef("rope_backward", check_rope_backward, reference_backward, _empty),
    ),
    exports={"rope": rope, "rope_backward": rope_backward, "rope_inv_freq": rope_inv_freq},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"tokens": 1029, "heads_q": 32, "heads_kv": 8, "head_dim": 128, "rotary_dim": 128},
                  {"batch": 5, "seq": 77, "heads_q": 4, "heads_kv": 2, "head_dim": 64, "rotary_dim": 32, "gptj": 1}),
    invariance_case=_invariance_case,
    autocast_cases=(AutocastCase(OP, _autocast_args, rope, _hf_rope),),
    host_cost_args=_host_cost_args,
)
