"""linear: invariance (Axis-A), accuracy (Axis-B), every GPU path, odd and empty shapes, layouts.
Registration, opcheck, compile, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import math

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import linear as lin

from conftest import randn

TILE = rl_engine_ext.LINEAR_GRAD_TILE_TOKENS

# (N, K): the five Qwen3-8B projections and odd shapes (N, K not multiples of 64, K % 8 != 0, K=1).
QWEN_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
ODD_SHAPES = [(1000, 4095), (33, 100), (4097, 1), (96, 8), (257, 136)]
CPU_SHAPES = [(96, 64), (33, 100), (130, 257), (5, 1)]

# Row counts on both sides of every sm90 configuration switch (decode m <= 64, medium while the
# 128x256 tiles are fewer than the SMs, large) and of the 128-row tiles.
GPU_ROW_COUNTS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 255, 257, 511, 513,
                  1000, 1025, 2047, 2049, 4095, 4097, 8191, 8192]
CPU_ROW_COUNTS = [1, 2, 3, 17, 64, 65, 129]


def _weights(n: int, k: int, dtype, device, seed: int = 1, bias: bool = False):
    w = randn(n, k, dtype=dtype, device=device, seed=seed, scale=1 / math.sqrt(max(k, 1)))
    b = randn(n, dtype=dtype, device=device, seed=seed + 1) if bias else None
    return w, b


def _gpu_paths() -> list[str]:
    """The GPU kernel families this device can run, for the bf16/fp16 inputs."""
    if not torch.cuda.is_available():
        return []
    major, minor = torch.cuda.get_device_capability()
    paths = ["simt"]
    if major >= 8:
        paths.append("sm80")
    if (major, minor) == (9, 0):
        paths.append("sm90")
    return paths


# ------------------------------------------------------------------------------------------
# Axis-A: rows of y and of grad_x for every M
# ------------------------------------------------------------------------------------------


def _assert_rows_match(fn, full_in: torch.Tensor, full_out: torch.Tensor, row_counts, seed: int, what: str):
    gen = torch.Generator().manual_seed(seed)
    total = full_in.shape[0]
    for m in row_counts:
        if m > total:
            continue
        start = int(torch.randint(0, total - m + 1, (1,), generator=gen))
        got = fn(full_in[start : start + m])
        drift = testing.compare(what, f"rows[{start}:{start + m}]", got, full_out[start : start + m])
        assert drift is None, str(drift)


@pytest.mark.parametrize("shape", QWEN_SHAPES + ODD_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.cuda
@pytest.mark.gpu_memory_heavy
def test_rows_invariant_for_every_m_cuda(dtype, shape):
    """y and grad_x rows computed in a batch of M (at a random offset) equal the rows of one
    8192-row batch, for M from 1 to 8192 across every kernel configuration switch."""
    n, k = shape
    device = "cuda"
    counts = GPU_ROW_COUNTS if dtype != torch.float32 else [m for m in GPU_ROW_COUNTS if m <= 2049]
    total = counts[-1]
    w, b = _weights(n, k, dtype, device, bias=(n, k) in ODD_SHAPES)
    x = randn(total, k, dtype=dtype, device=device, seed=2)
    y_full = rl_engine_ext.linear(x, w, b)
    _assert_rows_match(lambda xs: rl_engine_ext.linear(xs, w, b), x, y_full, counts, 3, "y")
    del y_full
    dy = randn(total, n, dtype=dtype, device=device, seed=4)
    dx_full = rl_engine_ext.linear_grad_input(dy, w)
    _assert_rows_match(lambda g: rl_engine_ext.linear_grad_input(g, w), dy, dx_full, counts, 5, "grad_x")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_invariant_for_every_m_cpu(dtype, shape):
    n, k = shape
    w, b = _weights(n, k, dtype, "cpu", bias=True)
    x = randn(CPU_ROW_COUNTS[-1], k, dtype=dtype, device="cpu", seed=2)
    y_full = rl_engine_ext.linear(x, w, b)
    _assert_rows_match(lambda xs: rl_engine_ext.linear(xs, w, b), x, y_full, CPU_ROW_COUNTS, 3, "y")
    dy = randn(CPU_ROW_COUNTS[-1], n, dtype=dtype, device="cpu", seed=4)
    dx_full = rl_engine_ext.linear_grad_input(dy, w)
    _assert_rows_match(lambda g: rl_engine_ext.linear_grad_input(g, w), dy, dx_full, CPU_ROW_COUNTS, 5, "grad_x")


def _chain(weight: torch.Tensor, with_bias: bool):
    def chain(rows, cotangents, accum):
        (x,) = rows
        (dy,) = cotangents
        out = {"weight": rl_engine_ext.linear_grad_weight(dy, x, None if accum is None else accum["weight"])}
        if with_bias:
            out["bias"] = rl_engine_ext.linear_grad_bias(dy, None if accum is None else accum["bias"])
        return out

    return chain


def _harness_cases(device: str):
    if device == "cuda":
        return [((4096, 4096), 1000), ((1000, 4095), 257), ((24576, 4096), 130), ((33, 100), 64 * 5 + 3)]
    # Same structure at CPU-affordable sizes: square, odd K, wide N, odd N and K.
    return [((96, 64), 257), ((100, 63), 130), ((384, 64), 70), ((33, 100), 64 * 2 + 3)]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.gpu_memory_heavy  # chunks of one row keep a weight gradient per row: 64 GB for fp32 4096x4096
def test_invariance_harness(device, dtype, case):
    """The shared harness: batch of 1, sub-batches, padding, chunks, repeats, row gradients, and
    dW/db run-to-run, padding invariance and chaining at LINEAR_GRAD_TILE_TOKENS."""
    (n, k), rows = _harness_cases(device)[case]
    with_bias = case % 2 == 1
    w, b = _weights(n, k, dtype, device, bias=with_bias)
    x = randn(rows, k, dtype=dtype, device=device, seed=rows)
    params = {"weight": w} if b is None else {"weight": w, "bias": b}
    report = testing.check_invariance(
        lambda x, weight, bias=None: rl_engine_ext.linear(x, weight, bias),
        [x],
        params,
        seed=rows,
        weight_grad_tile=TILE,
        weight_grad_chain=_chain(w, with_bias),
    )
    testing.assert_invariant(report)


def test_grad_weight_chains_bitwise(device, dtype):
    """Micro-batches of multiples of the tile, folded through dweight_accum / dbias_accum,
    reproduce the one-batch gradients bit for bit (the last micro-batch may be ragged)."""
    n, k, tokens = (512, 384, 64 * 7 + 5) if device == "cuda" else (40, 72, 64 * 3 + 5)
    x = randn(tokens, k, dtype=dtype, device=device, seed=11)
    dy = randn(tokens, n, dtype=dtype, device=device, seed=12)
    start = randn(n, k, dtype=torch.float32, device=device, seed=13)
    whole_w = rl_engine_ext.linear_grad_weight(dy, x, start)
    whole_b = rl_engine_ext.linear_grad_bias(dy)
    for micro in (TILE, 2 * TILE, 3 * TILE):
        acc_w, acc_b = start, None
        for s in range(0, tokens, micro):
            acc_w = rl_engine_ext.linear_grad_weight(dy[s : s + micro], x[s : s + micro], acc_w)
            acc_b = rl_engine_ext.linear_grad_bias(dy[s : s + micro], acc_b)
        assert torch.equal(acc_w, whole_w), f"dW chain of {micro}-token micro-batches drifted"
        assert torch.equal(acc_b, whole_b), f"db chain of {micro}-token micro-batches drifted"
    # The accumulator is an input, never written in place.
    assert torch.equal(start, randn(n, k, dtype=torch.float32, device=device, seed=13))


def test_cpu_result_independent_of_thread_count():
    w, b = _weights(130, 257, torch.float32, "cpu", bias=True)
    x = randn(65, 257, dtype=torch.float32, device="cpu", seed=3)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rl_engine_ext.linear(x, w, b)
        torch.set_num_threads(max(2, saved))
        many = rl_engine_ext.linear(x, w, b)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, many)


# ------------------------------------------------------------------------------------------
# Every GPU kernel family (forced through RL_ENGINE_EXT_LINEAR_PATH)
# ------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["sm90", "sm80", "simt"])
@pytest.mark.parametrize("dtype_", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu_memory_heavy
def test_each_gpu_path(monkeypatch, path, dtype_):
    """Each family on its own: accuracy against the fp32 ground truth for forward, grad_x, dW and
    db, and row invariance across its thresholds."""
    if path not in _gpu_paths():
        pytest.skip(f"{path} cannot run on this device")
    monkeypatch.setenv("RL_ENGINE_EXT_LINEAR_PATH", path)
    device = "cuda"
    for (n, k), total in (((384, 200), 700), ((4096, 4096), 1500), ((72, 8), 66)):
        w, b = _weights(n, k, dtype_, device, bias=True)
        x = randn(total, k, dtype=dtype_, device=device, seed=5)
        dy = randn(total, n, dtype=dtype_, device=device, seed=6)
        _assert_accurate(x, w, b, dy)
        y_full = rl_engine_ext.linear(x, w, b)
        _assert_rows_match(lambda xs: rl_engine_ext.linear(xs, w, b), x, y_full, GPU_ROW_COUNTS, 7, f"y[{path}]")
        dx_full = rl_engine_ext.linear_grad_input(dy, w)
        _assert_rows_match(lambda g: rl_engine_ext.linear_grad_input(g, w), dy, dx_full, GPU_ROW_COUNTS, 8,
                           f"grad_x[{path}]")


# The sm90 tile configurations (csrc/cuda/linear_kernels.h), forced through
# RL_ENGINE_EXT_SM90_GEMM_CONFIG. An MN-major B (grad input, grad weight) is loaded in whole 64-column
# rows of the 128-byte swizzle, so the 32- and 48-column tiles and the 96-column multicast slices
# cannot take it.
SM90_CONFIGS = ["decode32", "decode48", "decode64", "medium", "medium_pair", "wide_pair", "large"]
SM90_CONFIGS_K_MAJOR_B_ONLY = {"decode32", "decode48", "wide_pair"}


@pytest.mark.cuda
@pytest.mark.parametrize("config", SM90_CONFIGS)
def test_every_sm90_config_gives_the_same_bits(monkeypatch, config):
    """Each forced tile configuration gives the automatic choice's bits for y, grad_x and dW (fresh
    and chained from an accumulator): the tiles are speed only. Shapes: partial row and column tiles,
    K tails, decode rows and rows beyond every configuration's switch."""
    if "sm90" not in _gpu_paths():
        pytest.skip("sm90 cannot run on this device")
    device, dtype_ = "cuda", torch.bfloat16
    for m, n, k in ((1, 1000, 4095), (17, 6144, 512), (100, 257, 136), (513, 4096, 1024), (1100, 392, 264)):
        w, b = _weights(n, k, dtype_, device, bias=True)
        x = randn(m, k, dtype=dtype_, device=device, seed=5)
        dy = randn(m, n, dtype=dtype_, device=device, seed=6)
        accum = randn(n, k, dtype=torch.float32, device=device, seed=7)
        runs = {"y": lambda: rl_engine_ext.linear(x, w, b),
                "grad_x": lambda: rl_engine_ext.linear_grad_input(dy, w),
                "dW": lambda: rl_engine_ext.linear_grad_weight(dy, x),
                "dW chained": lambda: rl_engine_ext.linear_grad_weight(dy, x, accum)}
        monkeypatch.delenv("RL_ENGINE_EXT_SM90_GEMM_CONFIG", raising=False)
        want = {what: run() for what, run in runs.items()}
        monkeypatch.setenv("RL_ENGINE_EXT_SM90_GEMM_CONFIG", config)
        for what, run in runs.items():
            if what != "y" and config in SM90_CONFIGS_K_MAJOR_B_ONLY:
                with pytest.raises(RuntimeError, match="RL_ENGINE_EXT_SM90_GEMM_CONFIG"):
                    run()
                continue
            drift = testing.compare(what, f"{config} {m}x{n}x{k}", run(), want[what])
            assert drift is None, str(drift)


@pytest.mark.cuda
def test_forcing_an_unknown_sm90_config_is_an_error(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_EXT_SM90_GEMM_CONFIG", "huge")
    w, _ = _weights(8, 8, torch.bfloat16, "cuda")
    if "sm90" not in _gpu_paths():
        pytest.skip("sm90 cannot run on this device")
    with pytest.raises(ValueError, match="RL_ENGINE_EXT_SM90_GEMM_CONFIG"):
        rl_engine_ext.linear(torch.ones(2, 8, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.cuda
def test_auto_path_is_the_tensor_core_kernel():
    """bf16 on a Hopper GPU runs the wgmma kernel (sm80's mma.sync elsewhere), not the FMA tiles."""
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        pytest.skip("no tensor-core path below sm_80")
    expected = "linear_gemm_sm90_kernel" if (major, minor) == (9, 0) else "linear_gemm_sm80"
    w, _ = _weights(256, 256, torch.bfloat16, "cuda")
    x = randn(64, 256, dtype=torch.bfloat16, device="cuda", seed=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rl_engine_ext.linear(x, w)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(expected in name for name in names), names


@pytest.mark.cuda
def test_forcing_an_unknown_path_is_an_error(monkeypatch):
    monkeypatch.setenv("RL_ENGINE_EXT_LINEAR_PATH", "cublas")
    w, _ = _weights(8, 8, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="RL_ENGINE_EXT_LINEAR_PATH"):
        rl_engine_ext.linear(torch.ones(2, 8, device="cuda", dtype=torch.bfloat16), w)


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the fp32 ground truth
# ------------------------------------------------------------------------------------------


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype, kind: str, what: str):
    tol = contract.tolerance("linear", dtype, kind)
    torch.testing.assert_close(got.float(), want.float(), atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what}: {m}")


def _assert_accurate(x, w, b, dy):
    dtype = x.dtype
    with contract.fp32_reference_mode():
        xf, wf, dyf = x.double(), w.double(), dy.double()
        y_ref = xf @ wf.t() + (b.double() if b is not None else 0)
        dx_ref = dyf @ wf
        dw_ref = dyf.t() @ xf
        db_ref = dyf.sum(0)
    _assert_close(rl_engine_ext.linear(x, w, b), y_ref, dtype, "forward", "y")
    _assert_close(rl_engine_ext.linear_grad_input(dy, w), dx_ref, dtype, "gradient", "grad_x")
    _assert_close(rl_engine_ext.linear_grad_weight(dy, x), dw_ref, dtype, "gradient", "grad_weight")
    _assert_close(rl_engine_ext.linear_grad_bias(dy), db_ref, dtype, "gradient", "grad_bias")


@pytest.mark.parametrize("shape", [(96, 64), (33, 100), (130, 257), (7, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 3, 77])
def test_accuracy_against_fp32(device, dtype, shape, rows):
    n, k = shape
    w, b = _weights(n, k, dtype, device, bias=True)
    x = randn(rows, k, dtype=dtype, device=device, seed=rows)
    dy = randn(rows, n, dtype=dtype, device=device, seed=rows + 1)
    _assert_accurate(x, w, b, dy)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", QWEN_SHAPES[:2] + [(4096, 12288)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.gpu_memory_heavy
def test_accuracy_qwen_shapes_cuda(dtype, shape):
    n, k = shape
    w, _ = _weights(n, k, dtype, "cuda")
    x = randn(300, k, dtype=dtype, device="cuda", seed=1)
    dy = randn(300, n, dtype=dtype, device="cuda", seed=2)
    _assert_accurate(x, w, None, dy)


def test_autograd_matches_the_reference_backward(device, dtype):
    n, k = 72, 136
    w, b = _weights(n, k, dtype, device, bias=True)
    x = randn(2, 5, k, dtype=dtype, device=device, seed=3)
    dy = randn(2, 5, n, dtype=dtype, device=device, seed=4)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    rl_engine_ext.linear(xs, ws, bs).backward(dy)
    assert xs.grad.dtype == dtype and ws.grad.dtype == dtype and bs.grad.dtype == dtype
    assert torch.equal(xs.grad, rl_engine_ext.linear_grad_input(dy, w))
    assert torch.equal(ws.grad, rl_engine_ext.linear_grad_weight(dy, x).to(dtype))
    assert torch.equal(bs.grad, rl_engine_ext.linear_grad_bias(dy).to(dtype))
    # Only some inputs requiring grad.
    xo = x.clone().requires_grad_()
    rl_engine_ext.linear(xo, w).backward(dy)
    assert torch.equal(xo.grad, xs.grad)
    wo = w.clone().requires_grad_()
    rl_engine_ext.linear(x, wo).backward(dy)
    assert torch.equal(wo.grad, ws.grad)


def test_reference_fallback_matches_contract(device, dtype):
    """The pure-PyTorch path (used without the native library) meets the same tolerances."""
    w, b = _weights(40, 72, dtype, device, bias=True)
    x = randn(9, 72, dtype=dtype, device=device, seed=1)
    dy = randn(9, 40, dtype=dtype, device=device, seed=2)
    _assert_close(lin.reference_forward(x, w, b), lin.reference_forward_fp32(x, w, b), dtype, "forward", "ref y")
    _assert_close(lin.reference_grad_input(dy, w), rl_engine_ext.linear_grad_input(dy, w), dtype, "gradient", "ref dx")
    _assert_close(lin.reference_grad_weight(dy, x), rl_engine_ext.linear_grad_weight(dy, x), dtype, "gradient", "ref dw")
    _assert_close(lin.reference_grad_bias(dy), rl_engine_ext.linear_grad_bias(dy), dtype, "gradient", "ref db")


# ------------------------------------------------------------------------------------------
# Odd and empty shapes, layouts
# ------------------------------------------------------------------------------------------


def test_empty_and_degenerate_shapes(device, dtype):
    w, b = _weights(6, 5, dtype, device, bias=True)
    assert rl_engine_ext.linear(torch.empty(0, 5, dtype=dtype, device=device), w).shape == (0, 6)
    assert rl_engine_ext.linear_grad_input(torch.empty(0, 6, dtype=dtype, device=device), w).shape == (0, 5)
    x0 = torch.empty(0, 5, dtype=dtype, device=device)
    dy0 = torch.empty(0, 6, dtype=dtype, device=device)
    assert torch.equal(rl_engine_ext.linear_grad_weight(dy0, x0), torch.zeros(6, 5, device=device))
    acc = randn(6, 5, dtype=torch.float32, device=device, seed=1)
    assert torch.equal(rl_engine_ext.linear_grad_weight(dy0, x0, acc), acc)
    assert torch.equal(rl_engine_ext.linear_grad_bias(dy0), torch.zeros(6, device=device))
    # K = 0: y is the bias (or zeros); N = 0: empty y, zero grad_x.
    wk0 = torch.empty(6, 0, dtype=dtype, device=device)
    x3 = torch.empty(3, 0, dtype=dtype, device=device)
    assert torch.equal(rl_engine_ext.linear(x3, wk0, b), b.expand(3, 6))
    assert torch.equal(rl_engine_ext.linear(x3, wk0), torch.zeros(3, 6, dtype=dtype, device=device))
    wn0 = torch.empty(0, 5, dtype=dtype, device=device)
    x = randn(3, 5, dtype=dtype, device=device, seed=2)
    assert rl_engine_ext.linear(x, wn0).shape == (3, 0)
    assert torch.equal(rl_engine_ext.linear_grad_input(torch.empty(3, 0, dtype=dtype, device=device), wn0),
                       torch.zeros(3, 5, dtype=dtype, device=device))


def test_layouts_give_the_same_bits(device, dtype):
    """Non-contiguous, row-strided, 3-D and misaligned (odd storage offset) inputs give the same
    bits as the contiguous 2-D call: operands that the kernels can't read in place are copied,
    values unchanged."""
    n, k = 40, 64
    w, b = _weights(n, k, dtype, device, bias=True)
    x = randn(12, k, dtype=dtype, device=device, seed=3)
    want = rl_engine_ext.linear(x, w, b)
    strided = torch.zeros(12, k + 8, dtype=dtype, device=device)
    strided[:, :k] = x
    transposed = x.t().contiguous().t()
    flat = torch.zeros(12 * k + 1, dtype=dtype, device=device)
    flat[1:] = x.reshape(-1)
    misaligned = flat[1:].view(12, k)
    for name, xv in (("row-strided", strided[:, :k]), ("transposed", transposed), ("misaligned", misaligned),
                     ("3-D", x.view(3, 4, k))):
        got = rl_engine_ext.linear(xv, w, b).reshape(12, n)
        assert torch.equal(got, want), name
    w_t = w.t().contiguous().t()
    assert torch.equal(rl_engine_ext.linear(x, w_t, b), want)
    dy = randn(12, n, dtype=dtype, device=device, seed=4)
    dy_flat = torch.zeros(12 * n + 1, dtype=dtype, device=device)
    dy_flat[1:] = dy.reshape(-1)
    assert torch.equal(rl_engine_ext.linear_grad_weight(dy_flat[1:].view(12, n), misaligned),
                       rl_engine_ext.linear_grad_weight(dy, x))
    assert torch.equal(rl_engine_ext.linear_grad_input(dy_flat[1:].view(12, n), w), rl_engine_ext.linear_grad_input(dy, w))
