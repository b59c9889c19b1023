"""Generic tests over the op registry (rl_engine_ext.ops.SPECS): every op gets them by being
registered. Op-specific tests (every-M rows, layouts, chaining, paths) live in test_<op>.py.

This file also runs whole without the native library (test_fallback_without_native_library runs
it in a subprocess with RL_ENGINE_EXT_NO_NATIVE=1): every test here holds for the native ops and
for the pure-PyTorch references the shim registers in their place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rl_engine_ext
from rl_engine_ext import _native, _shim, autocast
from rl_engine_ext.ops import SPECS, op_defs

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC_IDS = [s.name for s in SPECS]


def _op(name: str):
    return getattr(torch.ops.rl_align, name)


def _map_tensors(args, fn):
    """fn on every tensor argument, and on each tensor of a Tensor[] argument (rank_sum's parts)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return fn(a)
        if isinstance(a, list) and a and all(isinstance(t, torch.Tensor) for t in a):
            return [fn(t) for t in a]
        return a

    return tuple(one(a) for a in args)


def _detached(args):
    return _map_tensors(args, lambda t: t.detach())


@pytest.fixture(params=SPECS, ids=SPEC_IDS)
def spec(request):
    return request.param


# ------------------------------------------------------------------------------------------
# Registration: schemas, kernels per device, constants
# ------------------------------------------------------------------------------------------


def test_schema_block_and_registry_agree():
    """schemas.def (the one schema block) names exactly the registry's ops, and torch.ops holds
    exactly those schemas (native or shim)."""
    declared = _shim.schemas()
    assert set(declared) == set(op_defs())
    for name, schema in declared.items():
        assert str(_op(name).default._schema) == f"rl_align::{schema}"


def test_native_kernels_per_device(spec):
    """A native build has a CPU kernel for every op, and a CUDA kernel for every op when torch and
    the build have CUDA; without the native library nothing is native and every op still runs."""
    for op in spec.ops:
        if rl_engine_ext.NATIVE_AVAILABLE:
            assert rl_engine_ext.has_native_kernel(op.name, "cpu"), op.name
            if torch.cuda.is_available() and os.environ.get("RL_ENGINE_EXT_CPU_ONLY", "0") != "1":
                assert rl_engine_ext.has_native_kernel(op.name, "cuda"), op.name
        else:
            assert not rl_engine_ext.has_native_kernel(op.name, "cpu")
        for device_type in ("meta", "xpu", "mps"):
            assert rl_engine_ext.has_native_kernel(op.name, device_type) is False
        for key in _shim.SHIM_DISPATCH_KEYS:  # native or shim: every device runs the op
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_align::{op.name}", key)


def test_autocast_kernels_exactly_where_a_rule_is_given(spec):
    """An op with an autocast rule (OpDef.autocast) has a kernel at each autocast key of
    rl_engine_ext.autocast; an op without one has none there (autocast passes it through)."""
    for op in spec.ops:
        for device_type in autocast.AUTOCAST_DEVICE_TYPES:
            key = "Autocast" + _native.dispatch_key(device_type)
            has = torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_align::{op.name}", key)
            assert has == (op.autocast is not None), (op.name, key)


def test_has_native_kernel_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown device type 'foo'"):
        rl_engine_ext.has_native_kernel("rms_norm", "foo")
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        rl_engine_ext.has_native_kernel("nope", "cpu")


def test_constants_match_the_native_library(spec):
    """Values shared with the kernels are defined once in Python and exported by the native
    library under the same names; they must agree."""
    assert all(getattr(rl_engine_ext, name, value) == value for name, value in spec.constants.items())
    if rl_engine_ext.NATIVE_AVAILABLE:
        for name, value in spec.constants.items():
            assert getattr(_native.NATIVE_MODULE, name) == value, name


def test_exports_are_package_attributes(spec):
    for name, obj in spec.exports.items():
        assert getattr(rl_engine_ext, name) is obj and name in rl_engine_ext.__all__


# ------------------------------------------------------------------------------------------
# opcheck, torch.compile, meta
# ------------------------------------------------------------------------------------------


def _opcheck_samples(spec, device, dtype):
    """Every sample where the native library is loaded (a kernel per variant). Without it (the
    no-native rerun) the first sample of each op: the shim registers one reference, fake and
    autograd per op whatever the variant; the other tests here run every variant through them, and
    the native run opchecks the shared fakes on every variant."""
    samples = spec.samples(device, dtype)
    if rl_engine_ext.NATIVE_AVAILABLE:
        return samples
    return list({sample.op: sample for sample in reversed(samples)}.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_opcheck(spec, device, dtype):
    for sample in _opcheck_samples(spec, device, dtype):
        torch.library.opcheck(_op(sample.op).default, sample.args)


def test_torch_compile_fullgraph_matches_eager(spec, device):
    """Each op compiles without a graph break and gives eager's bits, outputs and gradients."""
    torch._dynamo.reset()
    seen = set()
    for sample in spec.samples(device, torch.bfloat16):
        if sample.op in seen:
            continue
        seen.add(sample.op)
        op = _op(sample.op)
        compiled = torch.compile(lambda *a, op=op: op(*a), fullgraph=True)
        eager_args = _map_tensors(sample.args, lambda t: t.detach().clone().requires_grad_(t.requires_grad))
        compiled_args = _map_tensors(sample.args, lambda t: t.detach().clone().requires_grad_(t.requires_grad))
        want, got = op(*eager_args), compiled(*compiled_args)
        want, got = (want,) if isinstance(want, torch.Tensor) else want, (got,) if isinstance(got, torch.Tensor) else got
        for w, g in zip(want, got):
            assert torch.equal(g, w), sample.op
        if want[0].requires_grad and want[0].numel():
            cot = torch.ones_like(want[0])
            want[0].backward(cot)
            got[0].backward(cot)
            for we, ge in zip(eager_args, compiled_args):
                if isinstance(we, torch.Tensor) and we.requires_grad:
                    assert torch.equal(ge.grad, we.grad), sample.op


def test_meta_tensors_give_the_real_shapes(spec, device):
    """All-meta arguments run the fake kernel: same shapes and dtypes as the real outputs."""
    for sample in spec.samples(device, torch.float32):
        args = _detached(sample.args)
        real = _op(sample.op)(*args)
        meta = _op(sample.op)(*_map_tensors(args, lambda t: t.to("meta")))
        real, meta = (real,) if isinstance(real, torch.Tensor) else real, (meta,) if isinstance(meta, torch.Tensor) else meta
        for r, m in zip(real, meta):
            assert m.device.type == "meta" and m.shape == r.shape and m.dtype == r.dtype, sample.op


def test_one_meta_argument_is_an_error(spec, device):
    """A call mixing real tensors with a meta tensor reaches the fake kernel, which must raise
    (it used to hand back an uninitialised tensor on the real device)."""
    for sample in spec.samples(device, torch.float32):
        args = _detached(sample.args)
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            mixed = args[:i] + (a.to("meta"),) + args[i + 1 :]
            if all(t.device.type == "meta" for t in mixed if isinstance(t, torch.Tensor)):
                continue  # a single tensor argument: an all-meta call is legitimate
            with pytest.raises(RuntimeError, match=rf"rl_align::{sample.op}: .*meta"):
                _op(sample.op)(*mixed)


def test_backward_and_inference_ops_are_not_differentiable(spec, device):
    """Differentiating through an op without a derivative (backward ops, the KV-cache op) raises
    rather than silently treating it as a constant."""
    for op in spec.ops:
        if op.autograd is not None:
            continue
        sample = next(s for s in spec.samples(device, torch.float32) if s.op == op.name)
        args = _map_tensors(sample.args, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()))
        out = _op(op.name)(*args)
        first = out if isinstance(out, torch.Tensor) else out[0]
        with pytest.raises(RuntimeError, match="not implemented"):
            first.sum().backward()


def _outputs(out):
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def test_graph_recorded_only_when_a_gradient_is_needed(spec, device):
    """A differentiable op records a graph node when grad mode is on and an input requires grad,
    and otherwise calls the kernel directly (csrc/autograd/common.h: the node costs host time at
    decode sizes): same bits either way, no output requiring grad without a node, and a
    forward-mode tangent still raises instead of being dropped."""
    import torch.autograd.forward_ad as fwAD

    for op in spec.ops:
        if op.autograd is None:
            continue
        for sample in (s for s in spec.samples(device, torch.float32) if s.op == op.name):
            plain = _detached(sample.args)
            grad_args = _map_tensors(sample.args, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()))
            with_graph = _outputs(_op(op.name)(*grad_args))
            assert any(o.requires_grad for o in with_graph), op.name
            with torch.no_grad():
                no_grad = _outputs(_op(op.name)(*grad_args))
            direct = _outputs(_op(op.name)(*plain))
            for outs in (no_grad, direct):
                assert not any(o.requires_grad for o in outs), op.name
                for o, w in zip(outs, with_graph):
                    assert torch.equal(o, w.detach()), op.name
            if not rl_engine_ext.NATIVE_AVAILABLE:
                continue  # torch.library's autograd: forward mode is torch's business
            first = next(i for i, a in enumerate(plain) if isinstance(a, torch.Tensor) and a.is_floating_point())
            with fwAD.dual_level():
                dual = fwAD.make_dual(plain[first], torch.ones_like(plain[first]))
                with pytest.raises(RuntimeError, match="jvp"):
                    _op(op.name)(*(plain[:first] + (dual,) + plain[first + 1 :]))


# ------------------------------------------------------------------------------------------
# Bad input: the native op, the reference and the fake raise the same
# ------------------------------------------------------------------------------------------


def _assert_raises_everywhere(op_name: str, args: tuple, error: type[Exception], match: str, value_dependent: bool):
    pattern = rf"rl_align::{op_name}: .*{match}"
    with pytest.raises(error, match=pattern):
        _op(op_name)(*args)
    with pytest.raises(error, match=pattern):
        op_defs()[op_name].reference(*args)
    if not value_dependent:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake_args = _map_tensors(args, mode.from_tensor)
            with pytest.raises(error, match=pattern):
                _op(op_name)(*fake_args)


def test_bad_inputs(spec, device):
    bad = spec.bad_inputs(device)
    assert bad, "every op lists its bad inputs"
    for case in bad:
        _assert_raises_everywhere(case.op, case.args, case.error, case.match, case.value_dependent)


@pytest.mark.parametrize("bad_dtype", [torch.float64, torch.float8_e4m3fn], ids=["fp64", "fp8"])
def test_unsupported_dtypes(spec, device, bad_dtype):
    """The dtype policy: every floating input in an unsupported dtype is a ValueError naming the
    op and the dtype."""
    for sample in spec.samples(device, torch.float32):
        args = _map_tensors(_detached(sample.args), lambda t: t.to(bad_dtype) if t.is_floating_point() else t)
        _assert_raises_everywhere(sample.op, args, ValueError, str(bad_dtype).removeprefix("torch."), False)


# ------------------------------------------------------------------------------------------
# The shim: references where there is no native kernel
# ------------------------------------------------------------------------------------------


def test_reference_runs_where_no_native_kernel(spec, device):
    """On a device without a native kernel (every device without the native library; CUDA
    tensors with a CPU-only build) the op runs its reference, warning once per (op, device) when
    the native library is loaded; a native kernel never warns."""
    for sample in spec.samples(device, torch.float32):
        args = _detached(sample.args)
        native = rl_engine_ext.has_native_kernel(sample.op, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _op(sample.op)(*args)
            again = _op(sample.op)(*args)
        ours = [w for w in caught if f"rl_align::{sample.op} has no native kernel" in str(w.message)]
        if native or not rl_engine_ext.NATIVE_AVAILABLE:
            assert not ours, sample.op
        else:
            # warned at most once per (op, device) over the whole session
            assert len(ours) <= 1 and _native.dispatch_key(device) in str(ours[0].message) if ours else True
            want = op_defs()[sample.op].reference(*args)
            for g, w in zip((got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want):
                assert torch.equal(g, w), sample.op
        for g, a in zip((got,) if isinstance(got, torch.Tensor) else got, (again,) if isinstance(again, torch.Tensor) else again):
            assert torch.equal(g, a), sample.op


def test_fallback_without_native_library():
    """This whole file passes with RL_ENGINE_EXT_NO_NATIVE=1 (the shim defines every schema and
    registers the references, fakes and autograd), and the import warns exactly once."""
    if not rl_engine_ext.NATIVE_AVAILABLE:
        pytest.fail("run from the native suite only (the subprocess below deselects this test)")
    env = dict(os.environ, RL_ENGINE_EXT_NO_NATIVE="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "test_registry.py"),
         "-k", "not test_fallback_without_native_library", "-m", "not cuda"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(HERE),
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    script = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import rl_engine_ext\n"
        "msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]\n"
        "assert len(msgs) == 1 and 'NOT guaranteed' in msgs[0], msgs\n"
        "assert not rl_engine_ext.NATIVE_AVAILABLE and 'RL_ENGINE_EXT_NO_NATIVE' in rl_engine_ext.NATIVE_UNAVAILABLE_REASON\n"
        "print('one warning')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "one warning" in done.stdout, done.stdout + done.stderr


def test_native_load_failure_names_the_torch_the_build_requires():
    """A native library that fails to load (a build for another torch: libtorch's C++ API differs
    between minor releases) leaves the references on, with one warning that names the torch the
    installed build requires (from its metadata) and the torch that is installed."""
    script = (
        "import importlib.abc, importlib.machinery, importlib.metadata, sys, warnings\n"
        "class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        return importlib.machinery.ModuleSpec(name, self) if name == 'rl_engine_ext._C' else None\n"
        "    def create_module(self, spec): return None\n"
        "    def exec_module(self, module): raise ImportError('undefined symbol: _ZN3c1010TensorImpl')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import rl_engine_ext, torch\n"
        "reason = rl_engine_ext.NATIVE_UNAVAILABLE_REASON\n"
        "assert not rl_engine_ext.NATIVE_AVAILABLE and 'undefined symbol' in reason, reason\n"
        "assert any(reason in str(w.message) for w in caught), [str(w.message) for w in caught]\n"
        "try:\n"
        "    wanted = [r for r in importlib.metadata.requires('rl_engine_ext') or [] if r.startswith('torch')]\n"
        "except importlib.metadata.PackageNotFoundError:\n"
        "    wanted = []\n"
        "if wanted:\n"
        "    assert f'this build requires {wanted[0]} and torch {torch.__version__} is installed' in reason, reason\n"
        "print('named' if wanted else 'no metadata')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RL_ENGINE_EXT_NO_NATIVE"}  # also under the no-native rerun
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=os.path.dirname(HERE),
                          env=env)
    assert done.returncode == 0 and done.stdout.strip() in ("named", "no metadata"), done.stdout + done.stderr
