"""Autocast: under torch.autocast every op casts its floating-point arguments by its rule
(``OpDef.autocast``, the rule of its torch counterpart) and runs the path of the cast dtype.

Per op and autocast (CPU bf16; CUDA bf16 and fp16), with fp32 parameters and fp32 or bf16
activations: the output dtypes are the torch counterpart's; the outputs are bit for bit the op
called on explicitly cast arguments (the casts each case states: the policy table, written out a
second time), and so are the gradients, which reach every leaf in its own dtype;
torch.compile(fullgraph=True) gives eager's bits; with autocast off nothing is cast. The rules of
all ops are registered in one place (rl_engine_ext/autocast.py); test_registry.py checks that every
op has autocast kernels exactly where its OpDef has a rule.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import rl_engine_ext as rl
from rl_engine_ext.ops import op_defs
from rl_engine_ext.ops._spec import Autocast

from conftest import randn

HERE = os.path.dirname(os.path.abspath(__file__))

# (device, autocast dtype); the CUDA runs skip cleanly without a GPU (conftest).
AUTOCAST_RUNS = [
    pytest.param(("cpu", torch.bfloat16), id="cpu-bf16"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.cuda),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=pytest.mark.cuda),
]
# Activations in fp32 (autocast takes them to the lower-precision path) or bf16 beside fp32
# parameters (a dtype mismatch without autocast).
ACTIVATION_DTYPES = [torch.float32, torch.bfloat16]
TEMPERATURE = 0.9
EPS = 1e-6


def _floats_to(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _widest(args: tuple) -> torch.dtype:
    return functools.reduce(torch.promote_types,
                            [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()])


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What logprob replaces: log_softmax of the fp32 logits, gathered at the targets, and the entropy."""
    logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _hf_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """Hugging Face's apply_rotary_pos_emb (cos and sin in fp32, cast to the activations' dtype)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)

    def rotate(x):
        half = x.shape[-1] // 2
        x_rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * emb.cos().to(x.dtype) + x_rot * emb.sin().to(x.dtype)

    return rotate(q), rotate(k)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@dataclass(frozen=True)
class Case:
    """One op under autocast. ``make(device, activation_dtype)`` builds its arguments (float leaves
    require grad where the op is differentiable); ``ours`` and ``counterpart`` (the torch
    expression the op replaces) take them; ``explicit(args, device, autocast_dtype)`` casts them
    as the op's rule says autocast will."""

    op: str
    make: Callable[[str, torch.dtype], tuple]
    ours: Callable[..., Any]
    counterpart: Callable[..., Any]
    explicit: Callable[[tuple, str, torch.dtype], tuple]
    differentiable: bool = True


def _lower_precision(args, device, dtype):
    return _floats_to(args, dtype)


def _norm(args, device, dtype):
    """fp32 where torch's rms_norm has an autocast rule on the device (CUDA in torch 2.13, not in
    2.11); elsewhere the promoted dtype of the normalised inputs (the weight, last, follows)."""
    torch_rule = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "Autocast" + device.upper())
    return _floats_to(args, torch.float32 if torch_rule else _widest(args[:-1]))


def _promote(args, device, dtype):
    return _floats_to(args, _widest(args))


def _no_cast(args, device, dtype):
    return args


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    return t.requires_grad_(grad)


def _targets(shape, vocab: int, device: str) -> torch.Tensor:
    t = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(7))
    t.view(-1)[::4] = -100  # ignored tokens
    return t.to(device)


def _linear_args(device, act):
    return (_leaf(randn(2, 5, 40, dtype=act, device=device, seed=1)),
            _leaf(randn(24, 40, dtype=torch.float32, device=device, seed=2, scale=40**-0.5)),
            _leaf(randn(24, dtype=torch.float32, device=device, seed=3)))


def _linear_logprob_args(device, act):
    return (_leaf(randn(2, 5, 32, dtype=act, device=device, seed=4)),
            _leaf(randn(70, 32, dtype=torch.float32, device=device, seed=5, scale=2 * 32**-0.5)),
            _targets((2, 5), 70, device),
            _leaf(randn(70, dtype=torch.float32, device=device, seed=6)))


def _attention_args(device, act):
    # q from a projection in the activation dtype, k and v in fp32: autocast casts all three.
    return (_leaf(randn(2, 4, 16, 64, dtype=act, device=device, seed=8)),
            _leaf(randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=9)),
            _leaf(randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=10)))


def _varlen_args(device, act):
    return (_leaf(randn(12, 4, 64, dtype=act, device=device, seed=11)),
            _leaf(randn(12, 2, 64, dtype=torch.float32, device=device, seed=12)),
            _leaf(randn(12, 2, 64, dtype=torch.float32, device=device, seed=13)),
            torch.tensor([0, 5, 12], dtype=torch.int32, device=device))


def _kvcache_args(device, act):
    return (randn(2, 4, 1, 64, dtype=act, device=device, seed=14),
            randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=15),
            randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=16),
            torch.tensor([5, 16], dtype=torch.int32, device=device))


def _rms_norm_args(device, act):
    return (_leaf(randn(3, 5, 64, dtype=act, device=device, seed=17)),
            _leaf(randn(64, dtype=torch.float32, device=device, seed=18)))


def _add_rms_norm_args(device, act):
    # x from a projection in the activation dtype; the residual stream in fp32 (fp32 embedding).
    return (_leaf(randn(3, 5, 64, dtype=act, device=device, seed=19)),
            _leaf(randn(3, 5, 64, dtype=torch.float32, device=device, seed=20)),
            _leaf(randn(64, dtype=torch.float32, device=device, seed=21)))


def _logprob_args(device, act):
    return _leaf(randn(2, 5, 70, dtype=act, device=device, seed=22, scale=3.0)), _targets((2, 5), 70, device)


def _rope_args(device, act):
    return (_leaf(randn(2, 4, 6, 64, dtype=act, device=device, seed=23)),
            _leaf(randn(2, 2, 6, 64, dtype=act, device=device, seed=24)),
            torch.arange(12, device=device).view(2, 6) + 3,
            rl.rope_inv_freq(64, device=device))


def _silu_mul_args(device, act):
    return (_leaf(randn(3, 5, 24, dtype=act, device=device, seed=25)),
            _leaf(randn(3, 5, 24, dtype=torch.float32, device=device, seed=26)))


def _embedding_args(device, act):
    ids = torch.tensor([[1, 7, 7, 0, 49], [3, 3, 2, 8, 1]], device=device)
    return ids, _leaf(randn(50, 32, dtype=act, device=device, seed=27))


CASES = [
    Case("linear", _linear_args, rl.linear, F.linear, _lower_precision),
    Case("linear_logprob", _linear_logprob_args,
         lambda h, w, t, b: rl.linear_logprob(h, w, t, TEMPERATURE, True, b),
         lambda h, w, t, b: _token_logprobs(F.linear(h, w, b), t),
         _lower_precision),
    Case("attention", _attention_args, rl.attention, _sdpa, _lower_precision),
    Case("attention_varlen", _varlen_args, rl.attention_varlen,
         lambda q, k, v, cu: _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1),
         _lower_precision),
    Case("attention_kvcache", _kvcache_args, lambda q, k, v, lens: rl.attention_kvcache(q, k, v, lens),
         lambda q, k, v, lens: _sdpa(q, k, v), _lower_precision, differentiable=False),
    Case("rms_norm", _rms_norm_args, lambda x, w: rl.rms_norm(x, w, EPS),
         lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS), _norm),
    Case("add_rms_norm", _add_rms_norm_args, lambda x, r, w: rl.add_rms_norm(x, r, w, EPS),
         lambda x, r, w: (F.rms_norm(x + r, (x.shape[-1],), w, EPS), x + r), _norm),
    Case("logprob", _logprob_args, lambda z, t: rl.logprob(z, t, TEMPERATURE, return_entropy=True),
         _token_logprobs, _no_cast),
    Case("rope", _rope_args, rl.rope, _hf_rope, _no_cast),
    Case("silu_and_mul", lambda device, act: (_leaf(randn(3, 5, 48, dtype=act, device=device, seed=28)),),
         rl.silu_and_mul, lambda gu: F.silu(gu[..., :24]) * gu[..., 24:], _no_cast),
    Case("silu_mul", _silu_mul_args, rl.silu_and_mul, lambda gate, up: F.silu(gate) * up, _promote),
    Case("embedding", _embedding_args, rl.embedding, F.embedding, _no_cast),
]
CASE_IDS = [c.op for c in CASES]

# The rule each case's ``explicit`` spells out, checked against the op's registered rule so the two
# tables cannot drift apart.
EXPLICIT_RULES = {_lower_precision: Autocast.LOWER_PRECISION, _norm: Autocast.NORM, _promote: Autocast.PROMOTE,
                  _no_cast: None}


@pytest.fixture(params=AUTOCAST_RUNS)
def run(request) -> tuple[str, torch.dtype]:
    return request.param


def _autocast(device: str, dtype: torch.dtype):
    return torch.autocast(device, dtype=dtype)


def _grads(outputs: tuple, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the leaves for fixed cotangents of the differentiable outputs."""
    outs = [o for o in outputs if o.requires_grad]
    cotangents = [randn(*o.shape, dtype=o.dtype, device=o.device, seed=99 + i) for i, o in enumerate(outs)]
    return list(torch.autograd.grad(outs, leaves, cotangents))


def _assert_equal(got: tuple, want: tuple, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype, f"{what}[{i}]: dtype {g.dtype}, want {w.dtype}"
        assert torch.equal(g, w), f"{what}[{i}] differs"


def test_cases_state_the_registered_rules():
    """Every op with a rule has a case here, and each case's explicit casts are its op's rule."""
    assert {name for name, op in op_defs().items() if op.autocast is not None} <= set(CASE_IDS)
    for case in CASES:
        assert op_defs()[case.op].autocast is EXPLICIT_RULES[case.explicit], case.op


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("act", ACTIVATION_DTYPES, ids=["fp32_act", "bf16_act"])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's CPU rms_norm, mixed dtypes
def test_output_dtypes_are_the_torch_counterparts(case, act, run):
    device, dtype = run
    args = case.make(device, act)
    with torch.no_grad(), _autocast(device, dtype):
        ours, theirs = _as_tuple(case.ours(*args)), _as_tuple(case.counterpart(*args))
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("act", ACTIVATION_DTYPES, ids=["fp32_act", "bf16_act"])
def test_outputs_and_gradients_are_the_op_on_explicitly_cast_arguments(case, act, run):
    """Bit for bit, forward and backward; every gradient in its leaf's dtype (fp32 parameters get
    fp32 gradients through the casts' backward)."""
    device, dtype = run
    args = case.make(device, act)
    with _autocast(device, dtype):
        got = _as_tuple(case.ours(*args))
    want = _as_tuple(case.ours(*case.explicit(args, device, dtype)))
    _assert_equal(got, want, f"{case.op} outputs")
    if not case.differentiable:
        return
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    got_grads, want_grads = _grads(got, leaves), _grads(want, leaves)
    assert [g.dtype for g in got_grads] == [leaf.dtype for leaf in leaves]
    _assert_equal(tuple(got_grads), tuple(want_grads), f"{case.op} gradients")


def test_linear_logprob_is_logprob_of_linear_under_autocast(run):
    """The fused op's promise (bit for bit the unfused pair) holds under autocast: its GEMM casts like
    linear, and logprob takes the lower-precision logits uncast."""
    device, dtype = run
    h, w, t, b = _linear_logprob_args(device, torch.bfloat16)
    with _autocast(device, dtype):
        fused = rl.linear_logprob(h, w, t, TEMPERATURE, True, b)
        logits = rl.linear(h, w, b)
        unfused = rl.logprob(logits, t, TEMPERATURE, return_entropy=True)
    assert logits.dtype == dtype
    _assert_equal(fused, unfused, "linear_logprob vs logprob(linear)")


# torch 2.11's inductor drops an fp32 gradient's round trip through the autocast dtype (the op's
# backward rounds, the cast's backward widens back) even with emulate_precision_casts (H100 run);
# 2.13 keeps it (CPU).
INDUCTOR_KEEPS_CAST_ROUNDING = torch.__version__ >= "2.13"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@torch._inductor.config.patch(emulate_precision_casts=True)
def test_compile_fullgraph_matches_eager(case, run, own_compile):
    """bf16 activations beside fp32 parameters, autocast around the compiled call: eager's bits,
    forward and backward; the same compiled function called without autocast then casts nothing.
    (Inductor otherwise fuses a cast down and back up into nothing: an fp32 parameter's gradient,
    which eager rounds to the autocast dtype in the op's backward and casts back to fp32, would
    keep its fp32 bits.)"""
    device, dtype = run
    compiled = torch.compile(case.ours, fullgraph=True)
    args = case.make(device, torch.bfloat16)
    with _autocast(device, dtype):
        want, got = _as_tuple(case.ours(*args)), _as_tuple(compiled(*args))
    _assert_equal(got, want, f"{case.op} compiled outputs")
    if case.differentiable:
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        got_grads, want_grads = tuple(_grads(got, leaves)), tuple(_grads(want, leaves))
        if INDUCTOR_KEEPS_CAST_ROUNDING:
            _assert_equal(got_grads, want_grads, f"{case.op} compiled gradients")
        else:  # an fp32 parameter's gradient keeps its fp32 bits (no rounding to the dtype it ran in)
            ran_in = [cast.dtype for cast, a in zip(case.explicit(args, device, dtype), args)
                      if isinstance(a, torch.Tensor) and a.requires_grad]
            for g, w, op_dtype in zip(got_grads, want_grads, ran_in, strict=True):
                assert g.dtype == w.dtype
                torch.testing.assert_close(g.to(op_dtype), w.to(op_dtype), rtol=0, atol=0)
    uniform = case.make(device, torch.float32)
    _assert_equal(_as_tuple(compiled(*uniform)), _as_tuple(case.ours(*uniform)), f"{case.op} compiled, no autocast")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("outside", ["no_autocast", "autocast_disabled_inside"])
def test_nothing_is_cast_without_autocast(case, outside, run):
    """fp32 arguments stay on the fp32 path (the torch counterpart's dtypes without autocast), and
    mixed dtypes are still an error for every op that casts them under autocast."""
    device, dtype = run
    region = _autocast(device, dtype) if outside == "autocast_disabled_inside" else contextlib.nullcontext()
    fp32_args = case.make(device, torch.float32)
    mixed_args = case.make(device, torch.bfloat16)
    with torch.no_grad(), region, torch.autocast(device, enabled=False):
        ours, theirs = _as_tuple(case.ours(*fp32_args)), _as_tuple(case.counterpart(*fp32_args))
        assert [t.dtype for t in ours] == [t.dtype for t in theirs]
        if op_defs()[case.op].autocast is not None:
            with pytest.raises(ValueError, match="dtype"):
                case.ours(*mixed_args)


def test_autocast_without_native_library():
    """The CPU tests of this file pass on the shim's references (RL_ENGINE_EXT_NO_NATIVE=1): the
    rules are registered for the no-native path too."""
    if not rl.NATIVE_AVAILABLE:
        pytest.fail("run from the native suite only (the subprocess below deselects this test)")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "test_autocast.py"),
         "-k", "not without_native and not compile", "-m", "not cuda"],
        env=dict(os.environ, RL_ENGINE_EXT_NO_NATIVE="1"), capture_output=True, text=True, cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
