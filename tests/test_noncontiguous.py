"""Non-contiguous arguments give the contiguous call's bits (issue 31), for every op of the registry
(rl_engine_ext.ops.SPECS): each tensor argument of each sample (``OpSpec.samples``), forward and
backward ops, is replaced by the same values in another layout, and the outputs and the arguments
after the call must equal the contiguous call's bit for bit (or both calls raise the same
exception type). A new op gets these tests by being registered.

Layouts: transposed (reversed storage order), a strided slice of a larger buffer (every other
entry of the first dimension, padding after the last, gaps holding values that would show if
read), and stride 0 (a dimension expanded from one entry; its contiguous reference is the same
values made dense). The autograd test runs the differentiable ops' samples with every argument that
requires grad and every upstream gradient in one of these layouts and compares outputs and
gradients.

test_cpu_cases_under_malloc_debugging reruns the CPU cases with glibc's malloc debugging: freed
memory overwritten and large blocks unmapped when freed, so a kernel that reads a temporary
after it died (as logprob and silu_and_mul did) fails visibly instead of reading stale values.
(The C++ side cannot compile that bug in the first place: descriptor builders take Lvalue<...>
arguments, csrc/host/common.h.)
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import Callable

import pytest
import torch

import rl_engine_ext
from rl_engine_ext.ops import SPECS, op_defs
from rl_engine_ext.ops._spec import OPS

HERE = os.path.dirname(os.path.abspath(__file__))

# The pure-PyTorch references that stand in for a missing native library promise no bitwise
# invariance (torch's reductions follow the layout): these tests are the native kernels'.
pytestmark = pytest.mark.skipif(not rl_engine_ext.NATIVE_AVAILABLE, reason="checks the native kernels")

# (strided, dense reference) for a tensor, or None where the layout does not apply to it.
Layout = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


def _transposed(x: torch.Tensor):
    if x.dim() < 2:
        return None
    rev = list(range(x.dim()))[::-1]
    return x.permute(rev).contiguous().permute(rev), x


def _gap_value(dtype: torch.dtype):
    """What the gaps of a strided slice hold: NaN, or an index no op accepts."""
    if dtype.is_floating_point:
        return float("nan")
    return True if dtype == torch.bool else -7


def _strided_slice(x: torch.Tensor):
    """x at a storage offset, every other entry of dim 0, 3 entries of padding after each last-dim
    row (one dimension: every other entry)."""
    if x.dim() == 0:
        return None
    shape = [2 * x.shape[0] + 1, *x.shape[1:]]
    if x.dim() > 1:
        shape[-1] += 3
    buffer = torch.full(shape, _gap_value(x.dtype), dtype=x.dtype, device=x.device)
    view = buffer[1::2]
    if x.dim() > 1:
        view = view[..., : x.shape[-1]]
    return view.copy_(x), x


def _expanded(x: torch.Tensor):
    """Stride 0 in the first dimension of size > 1: that dimension's first entry repeated."""
    dim = next((d for d in range(x.dim()) if x.shape[d] > 1), None)
    if dim is None:
        return None
    e = x.narrow(dim, 0, 1).expand(x.shape)
    return e, e.contiguous()


LAYOUTS: dict[str, Layout] = {"transposed": _transposed, "strided_slice": _strided_slice, "expanded": _expanded}


@pytest.fixture(params=SPECS, ids=[s.name for s in SPECS])
def spec(request):
    return request.param


@pytest.fixture(params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


def _bits(t):
    """t with its bits as integers (NaN payloads and signed zeros compared too)."""
    if t is None or not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.device == b.device and torch.equal(_bits(a), _bits(b))


def _as_tuple(out) -> tuple:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _call(op_name: str, args: tuple):
    """("ok", outputs) or ("raised", the exception's type)."""
    try:
        return "ok", _as_tuple(getattr(OPS, op_name)(*args))
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return "raised", type(e)


def _arg_names(op_name: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.rl_align, op_name).default._schema.arguments]


def _detached(args: tuple) -> tuple:
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _assert_same_call(where: str, want_args: tuple, want, got_args: tuple, got) -> None:
    assert got[0] == want[0], f"{where}: {got} vs the contiguous call's {want}"
    if want[0] == "raised":
        assert got[1] is want[1], f"{where}: raised {got[1].__name__}, the contiguous call {want[1].__name__}"
        return
    assert len(got[1]) == len(want[1]), where
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        assert _same_bits(g, w), f"{where}: output {i} differs from the contiguous call's"
    for i, (g, w) in enumerate(zip(got_args, want_args)):  # what an op writes into its arguments
        if isinstance(w, torch.Tensor):
            assert _same_bits(g, w), f"{where}: argument {i} after the call differs from the contiguous call's"


def _refused_on_device(op_name: str, original: torch.Tensor, dense: torch.Tensor, args: tuple) -> bool:
    """Index values changed by a layout (stride 0 repeats one entry) that the op refuses, on a GPU:
    with validate=False the CUDA kernels check them with a device-side assert, which would end the
    process's CUDA context. The CPU call of the same arguments (which raises instead) tells; the
    CPU case checks that both layouts are refused alike."""
    if original.device.type == "cpu" or original.is_floating_point() or torch.equal(dense, original):
        return False
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    return _call(op_name, cpu_args)[0] == "raised"


def _tensor_slots(args: tuple):
    """(label suffix, tensor, put) for every tensor argument and every tensor of a Tensor[] argument
    (rank_sum's parts); put(args, t) gives args with that tensor replaced by t."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            yield i, "", a, lambda args, t, i=i: args[:i] + (t,) + args[i + 1 :]
        elif isinstance(a, list):
            for j, t in enumerate(a):
                if isinstance(t, torch.Tensor):
                    yield i, f"[{j}]", t, lambda args, t, i=i, j=j: args[:i] + (args[i][:j] + [t] + args[i][j + 1 :],) + args[i + 1 :]


def test_noncontiguous_arguments_give_the_contiguous_bits(spec, device, dtype, layout):
    make = LAYOUTS[layout]
    for sample in spec.samples(device, dtype):
        args = _detached(sample.args)
        names = _arg_names(sample.op)
        for i, index, a, put in _tensor_slots(args):
            if (pair := make(a)) is None:
                continue
            strided, dense = pair
            want_args = put(args, dense.clone())
            got_args = put(args, strided)
            if _refused_on_device(sample.op, a, dense, want_args):
                continue
            want = _call(sample.op, want_args)
            got = _call(sample.op, got_args)
            where = f"{sample.op}({names[i]}{index} {layout} {list(a.shape)} {a.dtype})"
            _assert_same_call(where, want_args, want, got_args, got)


def _differentiable_samples(spec, device, dtype):
    for sample in spec.samples(device, dtype):
        if op_defs()[sample.op].autograd is not None and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in sample.args
        ):
            yield sample


def _forward_and_grads(op_name: str, args: tuple, grad_of: list[int], cotangents: list):
    """(outputs, gradients of args[grad_of]) with cotangents[k] the upstream gradient of output k."""
    outputs = _as_tuple(getattr(OPS, op_name)(*args))
    differentiable = [k for k, o in enumerate(outputs) if o.requires_grad]
    grads = torch.autograd.grad([outputs[k] for k in differentiable], [args[i] for i in grad_of],
                                [cotangents[k] for k in differentiable], allow_unused=True)
    return [o.detach() for o in outputs], list(grads)


def test_noncontiguous_autograd_gives_the_contiguous_gradients(spec, device, dtype, layout):
    """Differentiable ops through autograd (OPS.<op>, what the public functions call): every
    argument that requires grad and every upstream gradient in the layout, outputs and input
    gradients bitwise equal to the contiguous call's. (The other arguments' layouts are
    test_noncontiguous_arguments_give_the_contiguous_bits's.)"""
    make = LAYOUTS[layout]

    def pair(t: torch.Tensor):
        return make(t) or (t, t)

    for sample in _differentiable_samples(spec, device, dtype):
        grad_of = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor) and a.requires_grad]
        pairs = [pair(a) if i in grad_of else (a, a) for i, a in enumerate(_detached(sample.args))]
        strided_args = tuple(s.requires_grad_() if i in grad_of else s for i, (s, _) in enumerate(pairs))
        dense_args = tuple(d.clone().requires_grad_() if i in grad_of else d for i, (_, d) in enumerate(pairs))
        with torch.no_grad():
            outputs = _as_tuple(getattr(OPS, sample.op)(*_detached(dense_args)))
        cotangent_pairs = [pair(torch.randn(o.shape, generator=torch.Generator().manual_seed(7 + k)).to(o))
                           if o.is_floating_point() else (None, None) for k, o in enumerate(outputs)]
        want = _forward_and_grads(sample.op, dense_args, grad_of, [d for _, d in cotangent_pairs])
        got = _forward_and_grads(sample.op, strided_args, grad_of, [s for s, _ in cotangent_pairs])
        where = f"{sample.op} with {layout} arguments {[list(sample.args[i].shape) for i in grad_of]}"
        for k, (g, w) in enumerate(zip(got[0], want[0])):
            assert _same_bits(g, w), f"{where}: output {k} differs from the contiguous call's"
        for i, g, w in zip(grad_of, got[1], want[1]):
            assert _same_bits(g, w), f"{where}: the gradient of argument {i} differs from the contiguous call's"


def _malloc_debug_library() -> str | None:
    """glibc >= 2.34 honours MALLOC_CHECK_ only with libc_malloc_debug.so preloaded."""
    with open("/proc/self/maps") as maps:
        libc = next((line.split()[-1] for line in maps if os.path.basename(line.split()[-1]).startswith("libc.so")), None)
    candidate = libc and os.path.join(os.path.dirname(libc), "libc_malloc_debug.so.0")
    return candidate if candidate and os.path.exists(candidate) else None


def test_cpu_cases_under_malloc_debugging():
    """The CPU cases of this file pass with glibc's malloc debugging on: freed memory overwritten
    (MALLOC_PERTURB_), blocks of 4 KiB and more unmapped when freed (MALLOC_MMAP_THRESHOLD_: a read
    after free is a segmentation fault) and heap consistency checked (MALLOC_CHECK_=3). Without
    them a kernel reading a freed temporary usually still finds its values there."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc debugging only")
    env = dict(os.environ, MALLOC_PERTURB_="165", MALLOC_MMAP_THRESHOLD_="4096", MALLOC_CHECK_="3")
    debug = _malloc_debug_library()
    if debug:
        env["LD_PRELOAD"] = ":".join(p for p in (debug, os.environ.get("LD_PRELOAD")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "test_noncontiguous.py"),
         "-k", "cpu and not malloc_debugging", "-m", "not cuda"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n" + done.stdout[-5000:] + done.stderr[-3000:]
