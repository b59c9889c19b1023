"""Strict mode (rl_engine_ext/strict_mode.py) and kernel provenance (rl_engine_ext/provenance.py,
csrc/host/provenance.h): under strict mode every fallback off the batch-invariant kernels raises
(a module patch() leaves on torch, a declined or watched aten op under the aten mode, a reference
kernel); outside it the same calls warn or run as before; record_kernels counts the native
launches (every CPU binding), backward included, only inside its block, from every thread."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import rl_engine_ext as rl
from rl_engine_ext import _shim, strict_mode
from rl_engine_ext.ops import SPECS, op_defs
from rl_engine_ext.strict_mode import StrictModeError

from test_aten_mode import _float32_matmul_precision, _unroutable_cases
from test_hf import _model

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "rl_engine_ext")


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          cwd=os.path.dirname(HERE), timeout=300)


# ---------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------


def test_public_names():
    for name in ("strict", "set_strict", "is_strict", "StrictModeError", "record_kernels", "KernelRecord"):
        assert name in rl.__all__
    assert rl.strict is strict_mode.strict and issubclass(rl.StrictModeError, RuntimeError)


def test_strict_nests_and_restores():
    assert not rl.is_strict()
    with rl.strict():
        assert rl.is_strict()
        with rl.strict(False):
            assert not rl.is_strict()
            with rl.set_strict(True):
                assert rl.is_strict()
            assert not rl.is_strict()
        assert rl.is_strict()
    assert not rl.is_strict()
    with pytest.raises(ZeroDivisionError), rl.strict():
        1 / 0
    assert not rl.is_strict()
    rl.set_strict(True)
    try:
        assert rl.is_strict()
    finally:
        rl.set_strict(False)
    assert not rl.is_strict()


def test_environment_variable():
    done = _run_python("import rl_engine_ext as rl; print(rl.is_strict())", RL_ENGINE_EXT_STRICT="1")
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    done = _run_python("import rl_engine_ext", RL_ENGINE_EXT_STRICT="yes")
    assert done.returncode != 0 and "RL_ENGINE_EXT_STRICT must be 0 or 1, got 'yes'" in done.stderr


def test_every_warning_is_strict_aware():
    """Every warnings.warn of the package sits in a function that calls strict_mode.refuse too,
    but for the no-native import warning (module level; each reference call refuses: _shim)."""
    unhandled = []
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(PACKAGE, name)).read())
            for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
                inner = {id(n) for f in ast.walk(scope) if isinstance(f, ast.FunctionDef) and f is not scope
                         for n in ast.walk(f)}  # calls of nested functions belong to those
                calls = {ast.unparse(n.func) for n in ast.walk(scope) if isinstance(n, ast.Call) and id(n) not in inner}
                if "warnings.warn" in calls and "strict_mode.refuse" not in calls:
                    unhandled.append(f"{name}:{getattr(scope, 'name', '<module>')}")
    assert unhandled == ["_native.py:<module>"]


# ---------------------------------------------------------------------------------------------
# The fallbacks strict mode refuses
# ---------------------------------------------------------------------------------------------


def test_patch_refuses_a_module_it_would_leave_on_torch():
    model = _model("qwen3", "cpu")
    model.model.extra = torch.nn.LayerNorm(4)
    with rl.strict(), pytest.raises(StrictModeError, match=r"model\.extra \(LayerNorm\) on torch's kernels"):
        rl.patch(model)
    assert rl.patch_handle(model) is None and "forward" not in vars(model.model.layers[0])  # nothing changed
    with warnings.catch_warnings(record=True) as caught:  # outside strict mode: the warning, as before
        warnings.simplefilter("always")
        handle = rl.patch(model)
    assert [str(w.message) for w in caught if "left on torch's kernels" in str(w.message)] == [
        "rl_engine_ext.patch: left on torch's kernels (not batch invariant): model.extra (LayerNorm)"]
    with rl.strict(), pytest.raises(StrictModeError, match=r"model\.late \(LayerNorm\)"):
        model.model.late = torch.nn.LayerNorm(4)  # attached to a patched model
    assert not hasattr(model.model, "late")
    handle.revert()


def test_aten_mode_refuses_declined_and_watched_ops():
    """Every call the mode leaves on torch's kernels (docs/aten_mode.md's unroutable cases, softmax,
    layer norm) raises under strict mode, but for a reduction over the whole tensor (a batch-level
    number); integer reductions (exact in any order) and routed calls run."""
    cases = _unroutable_cases("cpu")
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    cases["softmax"] = lambda: torch.softmax(x, -1)
    cases["layer_norm"] = lambda: torch.nn.functional.layer_norm(x, [8])
    with _float32_matmul_precision("high"), rl.batch_invariant_mode(), rl.strict():
        for name, fn in cases.items():
            if name == "mean all":
                fn()
                continue
            with pytest.raises(StrictModeError, match=r"aten::\w+\(.*\) would run torch's kernel"):
                fn()
        assert torch.equal(torch.ones(3, 4, dtype=torch.long).sum(-1), torch.full((3,), 4))
        x.sum((0, 1)), x.float().mean()
        torch.mm(x, x.t())
    with _float32_matmul_precision("high"), rl.batch_invariant_mode():  # outside strict: torch's kernel
        assert torch.equal(cases["softmax"](), torch.softmax(x, -1))


def test_aten_mode_hf_model_under_strict_mode():
    """An unpatched Hugging Face Qwen3 (SDPA) runs its forward and loss under the aten mode and
    strict mode without a refusal (every per-token op it reaches is routed); its backward is refused
    where autograd sums the RMSNorm weight's gradient over batch and sequence with torch's sum
    (aten::sum over dims [0, 1]: not a tiled, chainable sum like rl_align.rms_norm's)."""
    from test_aten_mode import _padded_batch, _tiny_qwen3

    model = _tiny_qwen3("cpu")
    ids, mask, positions, _ = _padded_batch("cpu", "right")
    with rl.batch_invariant_mode(), rl.strict():
        loss = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                     labels=ids.masked_fill(mask == 0, -100)).loss
        with pytest.raises(StrictModeError, match=r"aten::sum\(bfloat16\[4, 24, 64\], \[0, 1\], True\)"):
            loss.backward()
    assert torch.isfinite(loss)


def test_reference_kernel_refuses_and_counts():
    """The shim's kernel for a device without a native kernel (here XPU): StrictModeError under
    strict mode, otherwise one warning and a count of (op, "reference")."""
    kernel = _shim._reference_kernel(op_defs()["silu_and_mul"], "XPU")
    x = torch.randn(3, 8)
    with rl.strict(), pytest.raises(StrictModeError, match=r"rl_align::silu_and_mul would run its pure-PyTorch "
                                                          r"reference.*no native kernel for XPU"):
        kernel(x)
    with rl.record_kernels() as ran, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel(x)
        kernel(x)
    assert ran.counts == {("silu_and_mul", "reference"): 2}
    assert len([w for w in caught if "no native kernel for XPU" in str(w.message)]) == 1


def test_no_native_library():
    """RL_ENGINE_EXT_NO_NATIVE=1 (every op on its reference): a call raises under strict mode; outside
    it runs and record_kernels counts the forward and backward references."""
    code = (
        "import torch, rl_engine_ext as rl\n"
        "x = torch.randn(3, 8, requires_grad=True); w = torch.ones(8, requires_grad=True)\n"
        "try:\n"
        "    with rl.strict(): rl.rms_norm(x, w, 1e-6)\n"
        "except rl.StrictModeError as e: print('refused:', e)\n"
        "with rl.record_kernels() as ran: rl.rms_norm(x, w, 1e-6).sum().backward()\n"
        "print(ran.counts)\n"
    )
    done = _run_python(code, RL_ENGINE_EXT_NO_NATIVE="1")
    assert done.returncode == 0, done.stderr
    assert "refused: rl_engine_ext strict mode: rl_align::rms_norm would run its pure-PyTorch reference" in done.stdout
    assert "the native library is not loaded: disabled by RL_ENGINE_EXT_NO_NATIVE=1" in done.stdout
    assert "{('rms_norm', 'reference'): 1, ('rms_norm_backward', 'reference'): 1}" in done.stdout


# ---------------------------------------------------------------------------------------------
# record_kernels
# ---------------------------------------------------------------------------------------------

native = pytest.mark.skipif(not rl.NATIVE_AVAILABLE, reason="counts native launches")


@native
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_cpu_binding_counts_its_launches(spec):
    """Each op of the registry, on inputs that are not empty, counts native CPU launches only."""
    checked = set()
    for sample in spec.samples("cpu", torch.float32):
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in sample.args)
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        if any(t.numel() == 0 for t in tensors):
            continue  # nothing to launch
        with rl.record_kernels() as ran:
            getattr(torch.ops.rl_align, sample.op)(*args)
        assert ran.counts and {path for _, path in ran.counts} == {"cpu"}, (sample.op, ran.counts)
        checked.add(sample.op)
    assert checked == {op.name for op in spec.ops}


@native
def test_patched_model_step_counts_every_family():
    """A tiny patched Qwen3's forward + backward: every kernel family that ran, forward and backward
    (the C++ autograd functions'), counted on the CPU path."""
    model = _model("qwen3", "cpu")
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with rl.patch(model), rl.record_kernels() as ran:
        (-rl.token_logprobs(model, ids).sum()).backward()
    kernels = {kernel for kernel, _ in ran.counts}
    assert kernels == {"embedding_fwd", "embedding_bwd", "rms_norm_fwd", "rms_norm_bwd", "linear_gemm", "rope_fwd",
                       "rope_bwd", "attention_fwd", "attention_bwd", "silu_and_mul_fwd", "silu_and_mul_bwd",
                       "logprob_fwd", "logprob_bwd"}, ran.counts
    assert {path for _, path in ran.counts} == {"cpu"}
    layers = model.config.num_hidden_layers
    assert ran.counts[("attention_fwd", "cpu")] == ran.counts[("attention_bwd", "cpu")] == layers


@native
def test_counts_only_inside_the_block_and_nested():
    x, w = torch.randn(4, 8), torch.ones(8)
    rl.rms_norm(x, w, 1e-6)
    with rl.record_kernels() as outer:
        assert outer.counts == {}
        rl.rms_norm(x, w, 1e-6)
        with rl.record_kernels() as inner:
            rl.rms_norm(x, w, 1e-6)
        assert outer.counts == {("rms_norm_fwd", "cpu"): 2}  # live inside the block
    rl.rms_norm(x, w, 1e-6)
    assert inner.counts == {("rms_norm_fwd", "cpu"): 1} and outer.counts == {("rms_norm_fwd", "cpu"): 2}
    with rl.record_kernels() as empty:
        pass
    assert empty.counts == {}
    with pytest.raises(RuntimeError, match="no recorder is active"):
        torch.ops.rl_align.kernel_record_stop()


@native
def test_counts_from_two_threads():
    x, w = torch.randn(4, 8), torch.ones(8)
    calls = 200

    def work():
        for _ in range(calls):
            rl.rms_norm(x, w, 1e-6)

    with rl.record_kernels() as ran:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert ran.counts == {("rms_norm_fwd", "cpu"): 2 * calls}
