"""Shared fixtures: every op test runs on CPU and, where a GPU is present, on CUDA."""

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

# torch's own deprecation noise, not ours: two torch modules build TorchScript with the deprecated
# torch.jit API when first imported, one warning per function: torch.utils.mkldnn (imported by
# inductor on the first torch.compile) and torch._decomp.decompositions_for_jvp (by forward-mode
# AD's first make_dual). Imported here once with exactly those warnings silenced; any other use of
# torch.jit still warns.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script(_method)?` is deprecated", category=DeprecationWarning)
    import torch._decomp.decompositions_for_jvp  # noqa: F401
    import torch.utils.mkldnn  # noqa: F401

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (tests then run one process at a time)
    fcntl = None

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NO_CUDA = "no CUDA device"  # the skip reason of every CUDA case on a machine without one


@contextlib.contextmanager
def _one_process_at_a_time(name: str):
    if fcntl is None:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), f"rl_engine_ext_{name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _fp32_grad_accumulation_reverted(monkeypatch):
    """Every fp32_grad_accumulation handle a test creates is reverted when it ends. torch.compile
    guards on the number of live handles (rl_engine_ext/main_grad.py), so handles a test drops
    unreverted would pile up in a pytest-xdist worker until a later compiled test passes torch's
    recompile limit (8), as a process holding many live handles would."""
    import rl_engine_ext

    handles = []
    create = rl_engine_ext.fp32_grad_accumulation

    def tracked(*args, **kwargs):
        handles.append(create(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(rl_engine_ext, "fp32_grad_accumulation", tracked)
    yield
    for handle in handles:
        handle.revert()


@pytest.fixture(autouse=True)
def _gpu_memory_discipline(request):
    """pytest-xdist workers (``pytest -n N``) share the one GPU, and a process's cached allocations
    starve the others: the CUDA tests marked gpu_memory_heavy (tens of GB each) take a lock shared by
    the workers, so they run one at a time, and every test's cached GPU memory goes back to the
    driver when it ends. One pytest process alone takes no lock."""
    if not torch.cuda.is_available():
        yield
        return
    heavy = (os.environ.get("PYTEST_XDIST_WORKER") is not None and request.node.get_closest_marker("cuda") is not None
             and request.node.get_closest_marker("gpu_memory_heavy") is not None)
    with _one_process_at_a_time("gpu_memory_heavy") if heavy else contextlib.nullcontext():
        yield
        torch.cuda.empty_cache()


MARKERS = ("cuda: needs a CUDA device", "slow: long-running sweep",
           "gpu_memory_heavy: a CUDA test holding tens of GB of GPU memory; pytest-xdist workers run these one at a "
           "time (_gpu_memory_discipline)")


def pytest_configure(config):
    # Here rather than in pyproject.toml: the tests also run outside the source tree, against an
    # installed wheel (scripts/check_packaging.sh).
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


def _float32_on_a_forced_path(item) -> bool:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return str(params.get("device", "")).startswith("cuda/") and params.get("dtype") == torch.float32


def pytest_collection_modifyitems(config, items):
    # A forced path (device_with_forced_paths) is a tensor-core path: it runs bf16 and fp16 only, and
    # float32 takes the FMA kernels whatever is forced elsewhere; those runs are not collected.
    forced_float32 = [item for item in items if _float32_on_a_forced_path(item)]
    if forced_float32:
        config.hook.pytest_deselected(items=forced_float32)
        items[:] = [item for item in items if not _float32_on_a_forced_path(item)]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Says what the bare `s` of a CPU run are: the CUDA cases, skipped for want of a device."""
    skipped = terminalreporter.stats.get("skipped", [])
    cuda = sum(1 for report in skipped if isinstance(report.longrepr, tuple) and report.longrepr[2].endswith(NO_CUDA))
    if cuda:
        terminalreporter.write_line(f"{cuda} CUDA cases skipped: {NO_CUDA} (torch {torch.__version__} sees none)")
    if len(skipped) > cuda:
        terminalreporter.write_line(f"{len(skipped) - cuda} other cases skipped (-rs lists them with their reasons)")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def device_with_forced_paths(env_var: str, paths: tuple[str, ...]):
    """A `device` fixture for a test module (assign it to `device` there) whose GPU kernels come in
    several paths: params cpu, cuda (the default path) and one cuda-<path> per forced path, where
    env_var=<path> is set for the test; its value is the torch device, "cpu" or "cuda". float32
    runs are not collected on a forced path (pytest_collection_modifyitems); a test that picks
    float32 or a head_dim the forced paths cannot run parametrizes `device` over DEVICES itself."""
    forced = [pytest.param(f"cuda/{path}", marks=pytest.mark.cuda, id=f"cuda-{path}") for path in paths]

    @pytest.fixture(params=DEVICES + forced)
    def device(request, monkeypatch) -> str:
        torch_device, _, path = request.param.partition("/")
        if path:
            monkeypatch.setenv(env_var, path)
        return torch_device

    return device


@pytest.fixture(params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture
def own_compile():
    """torch.compile in this test traces and compiles its own graphs: torch 2.11's on-disk compile
    caches (shared by processes) key graphs without the autocast state. Set with torch's
    config.patch, not monkeypatch: pytest >= 9.2's monkeypatch deletes a torch config entry on
    undo (the entries are not in the config module's __dict__)."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield


def capture_cuda_graph(step):
    """(graph, step's outputs): ``step`` run once on a side stream (one-time setup stays outside
    the capture), then captured in a CUDA graph; replay the graph to rerun it on its buffers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def fused_and_split_kernels(monkeypatch, env_var: str, calls):
    """Runs ``calls()`` (a tuple of tensors) as is, then with ``env_var=0`` (the one-launch kernel
    off), checks the two runs give the same bits and returns their rl_engine_ext.record_kernels
    counts: (fused, split)."""
    import rl_engine_ext

    with rl_engine_ext.record_kernels() as fused_record:
        fused = calls()
    monkeypatch.setenv(env_var, "0")
    with rl_engine_ext.record_kernels() as split_record:
        split = calls()
    assert len(fused) == len(split)
    for a, b in zip(fused, split):
        assert torch.equal(a, b)
    return fused_record.counts, split_record.counts


def assert_device_assert(setup: str, call: str, message: str) -> None:
    """Runs `setup` (Python lines, torch and rl_engine_ext imported) and `call` on CUDA in a
    subprocess (a device-side assert loses the CUDA context for the rest of the process) and
    checks that it failed with a device-side assert that printed `message`."""
    script = f"import torch, rl_engine_ext\n{setup}out = {call}\ntorch.cuda.synchronize()\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert message in output, output
    assert "device-side assert" in output, output


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, device: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Fresh random values from a seeded CPU generator (the same values on every device)."""
    t = torch.randn(*shape, generator=make_generator(seed), dtype=torch.float32) * scale
    return t.to(dtype=dtype, device=device)


SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def needs_script(name: str):
    """Skip marker of the tests of scripts/NAME.py: the packaging run outside the tree has no scripts/."""
    return pytest.mark.skipif(not os.path.isfile(os.path.join(SCRIPTS, f"{name}.py")),
                              reason=f"needs the source tree (scripts/{name}.py)")


def nvcc_path() -> str | None:
    """The nvcc that builds tests/cpp and scripts/*.cu programs: $NVCC, /usr/local/cuda/bin or PATH."""
    for path in (os.environ.get("NVCC"), "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if path and os.path.isfile(path):
            return path
    return None


def load_script(name: str):
    """scripts/NAME.py imported as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
