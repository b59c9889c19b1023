"""Autocast: under torch.autocast every op casts its floating-point arguments by its rule
(``OpDef.autocast``, the rule of its torch counterpart) and runs the path of the cast dtype.

Per op and autocast (CPU bf16; CUDA bf16 and fp16), with fp32 parameters and fp32 or bf16
activations: the output dtypes are the torch counterpart's; the outputs are bit for bit the op
called on explicitly cast arguments (the casts each case states: the policy table, written out a
second time), and so are the gradients, which reach every leaf in its own dtype;
torch.compile(fullgraph=True) gives eager's bits; with autocast off nothing is cast. The rules of
all ops are registered in one place (rl_engine_ext/autocast.py); test_registry.py checks that every
op has autocast kernels exactly where its OpDef has a rule. The cases come from the registry (each
family's ``OpSpec.autocast_cases``), so a new op brings its own; this file holds only the casts.
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

import rl_engine_ext as rl
from rl_engine_ext.ops import SPECS, op_defs
from rl_engine_ext.ops._spec import Autocast, AutocastCase

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


def _floats_to(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _widest(args: tuple) -> torch.dtype:
    return functools.reduce(torch.promote_types,
                            [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()])


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


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


# The casts each rule makes, written out a second time (rl_engine_ext/autocast.py registers them):
# ``explicit(args, device, autocast_dtype)`` casts a case's arguments as its op's rule says autocast will.
EXPLICIT_CASTS = {Autocast.LOWER_PRECISION: _lower_precision, Autocast.NORM: _norm, Autocast.PROMOTE: _promote,
                  None: _no_cast}


@dataclass(frozen=True)
class Case:
    """One op under autocast: its registry case (``AutocastCase``: arguments, public function, torch
    counterpart) with the casts of its registered rule, and whether it has a backward."""

    op: str
    make: Callable[[str, torch.dtype], tuple]
    ours: Callable[..., Any]
    counterpart: Callable[..., Any]
    explicit: Callable[[tuple, str, torch.dtype], tuple]
    differentiable: bool


def _case(c: AutocastCase) -> Case:
    op = op_defs()[c.op]
    return Case(c.op, c.make, c.ours, c.counterpart, EXPLICIT_CASTS[op.autocast], op.autograd is not None)


# Every family's cases (OpSpec.autocast_cases): a new op brings its own.
CASES = [_case(c) for s in SPECS for c in s.autocast_cases]
CASE_IDS = [c.op for c in CASES]


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
    """Every op with a rule has a case (one each), and every rule has its explicit casts here."""
    assert {name for name, op in op_defs().items() if op.autocast is not None} <= set(CASE_IDS)
    assert len(CASE_IDS) == len(set(CASE_IDS))
    assert set(EXPLICIT_CASTS) == set(Autocast) | {None}


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
    h, w, t, b = next(c for c in CASES if c.op == "linear_logprob").make(device, torch.bfloat16)
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
