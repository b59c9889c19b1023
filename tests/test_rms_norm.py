"""rms_norm: invariance (Axis-A), accuracy (Axis-B), layouts, odd shapes, the GPU limit.
Registration, opcheck, compile, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import rms_norm as rms_mod

from conftest import randn

EPS = 1e-6
HIDDEN_SIZES = [128, 4095, 4096]


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


def _row_counts(device: str, hidden: int) -> list[int]:
    if device == "cuda":
        return [1, 2, 3, 31, 257, 1000, 4097, 16384] if hidden >= 4095 else [1, 3, 257, 4097, 16384]
    return [1, 3, 257] if hidden >= 4095 else [1, 3, 257, 1500]


def _chain(weight: torch.Tensor):
    def chain(rows, cotangents, accum):
        (x,) = rows
        (dy,) = cotangents
        _, dweight = rl_engine_ext.rms_norm_backward(
            dy, x, weight, EPS, None if accum is None else accum["weight"]
        )
        return {"weight": dweight}

    return chain


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_invariance_forward_and_gradients(device, dtype, hidden):
    """Rows and row gradients are bitwise independent of the batch; dweight is run-to-run
    identical, padding invariant and chainable at the documented tile."""
    weight = randn(hidden, dtype=dtype, device=device, seed=1, scale=0.5) + 1
    for rows in _row_counts(device, hidden):
        x = randn(rows, hidden, dtype=dtype, device=device, seed=rows, scale=2.0)
        report = testing.check_invariance(
            lambda x, weight: rl_engine_ext.rms_norm(x, weight, EPS),
            [x],
            {"weight": weight},
            seed=rows,
            weight_grad_tile=rl_engine_ext.rms_norm_tile_rows(hidden),
            weight_grad_chain=_chain(weight),
        )
        testing.assert_invariant(report)


def test_invariance_qk_norm_layout(device, dtype):
    """QK-norm on [B, S, heads, 128]: a sequence's output and dq do not depend on the other
    sequences. (The harness's rows are sequences here, 264 norm rows each, so dweight's tiles of
    1024 norm rows don't align with them; dweight is covered by the 2-D tests.)"""
    q = randn(6, 33, 8, 128, dtype=dtype, device=device, seed=7)
    weight = randn(128, dtype=dtype, device=device, seed=8) + 1
    report = testing.check_invariance(lambda q: rl_engine_ext.rms_norm(q, weight, EPS), [q], seed=3)
    testing.assert_invariant(report)


@pytest.mark.parametrize("hidden", [128, 4095, 4096])
def test_unaligned_rows_match_aligned_rows(device, dtype, hidden):
    """Rows that can't be read as 16-byte vectors take the element-wise load path; it must give
    the same bits as the vector path (same elements per thread, same order)."""
    rows = 37
    weight = randn(hidden, dtype=dtype, device=device, seed=2) + 1
    flat = randn(rows * hidden + 1, dtype=dtype, device=device, seed=3)
    unaligned = flat[1:].view(rows, hidden)
    aligned = unaligned.clone()
    assert unaligned.data_ptr() % 16 != 0 and aligned.data_ptr() % 16 == 0
    assert torch.equal(rl_engine_ext.rms_norm(unaligned, weight, EPS), rl_engine_ext.rms_norm(aligned, weight, EPS))
    dy = randn(rows, hidden, dtype=dtype, device=device, seed=4)
    dy_unaligned = randn(rows * hidden + 1, dtype=dtype, device=device, seed=4)[1:].view(rows, hidden)
    dy_unaligned.copy_(dy)
    got = rl_engine_ext.rms_norm_backward(dy_unaligned, unaligned, weight, EPS)
    want = rl_engine_ext.rms_norm_backward(dy, aligned, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_strided_and_noncontiguous_inputs(device, dtype):
    """Row-strided views are read in place, non-contiguous inputs are copied: same bits."""
    hidden = 4096
    weight = randn(hidden, dtype=dtype, device=device, seed=5) + 1
    wide = randn(9, 2 * hidden, dtype=dtype, device=device, seed=6)
    strided = wide[:, :hidden]
    assert not strided.is_contiguous()
    assert torch.equal(rl_engine_ext.rms_norm(strided, weight, EPS), rl_engine_ext.rms_norm(strided.contiguous(), weight, EPS))
    transposed = randn(hidden, 9, dtype=dtype, device=device, seed=7).t()
    assert torch.equal(
        rl_engine_ext.rms_norm(transposed, weight, EPS), rl_engine_ext.rms_norm(transposed.contiguous(), weight, EPS)
    )


def test_chaining_does_not_modify_accumulator(device):
    hidden = 4096
    tile = rl_engine_ext.rms_norm_tile_rows(hidden)
    x = randn(3 * tile + 5, hidden, dtype=torch.bfloat16, device=device, seed=9)
    dy = randn(3 * tile + 5, hidden, dtype=torch.bfloat16, device=device, seed=10)
    w = randn(hidden, dtype=torch.bfloat16, device=device, seed=11)
    _, whole = rl_engine_ext.rms_norm_backward(dy, x, w, EPS)
    _, first = rl_engine_ext.rms_norm_backward(dy[:tile], x[:tile], w, EPS)
    saved = first.clone()
    _, chained = rl_engine_ext.rms_norm_backward(dy[tile:], x[tile:], w, EPS, first)
    assert torch.equal(first, saved)
    assert torch.equal(chained, whole)


def test_tile_rows_matches_documentation():
    assert rl_engine_ext.rms_norm_tile_rows(4096) == 32
    assert rl_engine_ext.rms_norm_tile_rows(4095) == 32
    assert rl_engine_ext.rms_norm_tile_rows(1024) == 128
    assert rl_engine_ext.rms_norm_tile_rows(128) == 1024


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the fp32 ground truth
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_forward_accuracy(device, dtype, hidden, rows):
    x = randn(rows, hidden, dtype=dtype, device=device, seed=rows + hidden, scale=3.0)
    w = randn(hidden, dtype=dtype, device=device, seed=12, scale=0.5) + 1
    got = rl_engine_ext.rms_norm(x, w, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    tol = contract.tolerance("rms_norm", dtype, "forward")
    truth = rms_mod.reference_forward_fp32(x, w, EPS)
    torch.testing.assert_close(got.float(), truth, atol=tol.atol, rtol=tol.rtol)
    # The dtype path of the reference rounds the same fp32 value once: at most one ulp apart.
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), rms_mod.reference_forward(x, w, EPS).float(), atol=ulp * 8, rtol=ulp)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_gradient_accuracy(device, dtype, hidden):
    rows = 67
    x = randn(rows, hidden, dtype=dtype, device=device, seed=13, scale=2.0)
    w = randn(hidden, dtype=dtype, device=device, seed=14, scale=0.5) + 1
    dy = randn(rows, hidden, dtype=dtype, device=device, seed=15)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rl_engine_ext.rms_norm(xg, wg, EPS).backward(dy)
    assert xg.grad.dtype == dtype and wg.grad.dtype == dtype

    xt, wt = x.float().requires_grad_(), w.float().requires_grad_()
    with contract.fp32_reference_mode():
        rms_mod.normalize(xt, wt, EPS, "fp32", torch.float32).backward(dy.float())
    tol = contract.tolerance("rms_norm", dtype, "gradient")
    torch.testing.assert_close(xg.grad.float(), xt.grad, atol=tol.atol, rtol=tol.rtol)
    # dweight sums `rows` terms: scale the tolerance by the magnitude of the sum.
    scale = max(1.0, xt.grad.abs().max().item(), wt.grad.abs().max().item())
    torch.testing.assert_close(wg.grad.float(), wt.grad, atol=tol.atol * scale, rtol=tol.rtol)


@settings(max_examples=25, deadline=None)
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    hidden=st.integers(1, 300),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_shape_fuzz_cpu(lead, hidden, dtype):
    """Any leading dims, any H: accurate, and the first row alone gives the same bits."""
    x = randn(*lead, hidden, dtype=dtype, device="cpu", seed=hidden)
    w = randn(hidden, dtype=dtype, device="cpu", seed=hidden + 1)
    got = rl_engine_ext.rms_norm(x, w, EPS)
    tol = contract.tolerance("rms_norm", dtype, "forward")
    torch.testing.assert_close(got.float(), rms_mod.reference_forward_fp32(x, w, EPS), atol=tol.atol, rtol=tol.rtol)
    rows = x.reshape(-1, hidden)
    assert torch.equal(rl_engine_ext.rms_norm(rows[:1], w, EPS), got.reshape(-1, hidden)[:1])


# ------------------------------------------------------------------------------------------
# Odd shapes and bad input
# ------------------------------------------------------------------------------------------


def test_empty_batch(device, dtype):
    x = torch.empty(0, 4096, dtype=dtype, device=device)
    w = randn(4096, dtype=dtype, device=device, seed=16)
    y = rl_engine_ext.rms_norm(x, w, EPS)
    assert y.shape == (0, 4096) and y.dtype == dtype
    dx, dw = rl_engine_ext.rms_norm_backward(x, x, w, EPS)
    assert dx.shape == (0, 4096) and torch.equal(dw, torch.zeros(4096, device=device))
    acc = randn(4096, dtype=torch.float32, device=device, seed=17)
    assert torch.equal(rl_engine_ext.rms_norm_backward(x, x, w, EPS, acc)[1], acc)
    xe = torch.empty(2, 0, 3, 0, dtype=dtype, device=device)
    assert rl_engine_ext.rms_norm(xe, torch.empty(0, dtype=dtype, device=device), EPS).shape == xe.shape


@pytest.mark.cuda
def test_rejects_hidden_beyond_gpu_limit():
    hidden = 65536 + 8
    x = torch.ones(1, hidden, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="exceeds the GPU kernel's limit"):
        rl_engine_ext.rms_norm(x, x[0], EPS)


# ------------------------------------------------------------------------------------------
# Autograd
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("needs", ["x", "weight"])
def test_autograd_with_one_input_requiring_grad(device, needs):
    """The C++ autograd node returns only the gradients that are asked for, and they match the
    gradients of the both-inputs case bit for bit."""
    x = randn(9, 256, dtype=torch.bfloat16, device=device, seed=26)
    w = randn(256, dtype=torch.bfloat16, device=device, seed=27)
    dy = randn(9, 256, dtype=torch.bfloat16, device=device, seed=28)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    rl_engine_ext.rms_norm(xa, wa, EPS).backward(dy)
    xb, wb = x.clone().requires_grad_(needs == "x"), w.clone().requires_grad_(needs == "weight")
    rl_engine_ext.rms_norm(xb, wb, EPS).backward(dy)
    if needs == "x":
        assert wb.grad is None and torch.equal(xb.grad, xa.grad)
    else:
        assert xb.grad is None and torch.equal(wb.grad, wa.grad)


# ------------------------------------------------------------------------------------------
# Casting modes (fp32 / llama / gemma)
# ------------------------------------------------------------------------------------------

MODES = ["fp32", "llama", "gemma"]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: str) -> torch.Tensor:
    """Hugging Face's module formulas in plain torch: LlamaRMSNorm (= Qwen3RMSNorm) for "llama",
    GemmaRMSNorm for "gemma"; "fp32" is ours (fp32 product, one rounding)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "llama":
        return w * h.to(x.dtype)
    if mode == "gemma":
        return (h * (1.0 + w.float())).type_as(x)
    return (h * w.float()).to(x.dtype)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of the dtype (ordered integer view of the bits)."""
    int_type, sign = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.float16: (torch.int16, 0x7FFF),
                      torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]

    def ordered(t):
        i = t.contiguous().view(int_type).long()
        return torch.where(i < 0, -(i & sign), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", [128, 4095])
def test_mode_invariance(device, dtype, mode, hidden):
    weight = randn(hidden, dtype=dtype, device=device, seed=1, scale=0.5) + 1
    rows = 257 if device == "cpu" else 4097
    x = randn(rows, hidden, dtype=dtype, device=device, seed=rows, scale=2.0)

    def chain(rows_, cotangents, accum):
        _, dweight = rl_engine_ext.rms_norm_backward(cotangents[0], rows_[0], weight, EPS,
                                                     None if accum is None else accum["weight"], mode)
        return {"weight": dweight}

    report = testing.check_invariance(
        lambda x, weight: rl_engine_ext.rms_norm(x, weight, EPS, mode), [x], {"weight": weight}, seed=rows,
        weight_grad_tile=rl_engine_ext.rms_norm_tile_rows(hidden), weight_grad_chain=chain)
    testing.assert_invariant(report)


def test_mode_fp32_is_the_default(device):
    x = randn(9, 4095, dtype=torch.bfloat16, device=device, seed=40)
    w = randn(4095, dtype=torch.bfloat16, device=device, seed=41)
    dy = randn(9, 4095, dtype=torch.bfloat16, device=device, seed=42)
    assert torch.equal(rl_engine_ext.rms_norm(x, w, EPS), rl_engine_ext.rms_norm(x, w, EPS, "fp32"))
    got, want = rl_engine_ext.rms_norm_backward(dy, x, w, EPS), rl_engine_ext.rms_norm_backward(dy, x, w, EPS, None, "fp32")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", [128, 4096])
def test_mode_matches_hf_formula_bitwise_on_exact_sums(device, dtype, mode, hidden):
    """Inputs whose sum of squares is exact in fp32 in any order (multiples of 1/8 up to 2: at
    most 21 significant bits), H a power of two (mean = sum * 1/H = sum / H exactly): the one
    difference between the kernels and HF's module formulas (the summation order of the mean)
    is gone, and every mode equals its HF formula bit for bit."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randint(-16, 17, (33, hidden), generator=g).float() / 8).to(dtype=dtype, device=device)
    w = randn(hidden, dtype=dtype, device=device, seed=43, scale=0.5) + 1
    assert torch.equal(rl_engine_ext.rms_norm(x, w, EPS, mode), hf_rms_norm(x, w, EPS, mode))


@pytest.mark.parametrize("mode", MODES)
def test_mode_matches_hf_formula_within_ulps(device, dtype, mode):
    """Random inputs: torch's mean sums in another order, so inv_rms may differ in its last fp32
    bits. Measured (CPU, 257 x 4096, scale 3): bf16/fp16 differ on < 0.01% of the elements, by
    1 ulp ("fp32", "gemma") or at most 2 ulps ("llama": h one ulp off, then a second rounding);
    fp32 outputs carry inv_rms's own error: ~26% of the elements, at most 5 ulps (< 1e-6 relative)."""
    hidden = 4096
    x = randn(257, hidden, dtype=dtype, device=device, seed=44, scale=3.0)
    w = randn(hidden, dtype=dtype, device=device, seed=45, scale=0.5) + 1
    diff = ulp_diff(rl_engine_ext.rms_norm(x, w, EPS, mode), hf_rms_norm(x, w, EPS, mode))
    if dtype == torch.float32:
        assert diff.max().item() <= 8
    else:
        assert diff.max().item() <= (2 if mode == "llama" else 1)
        assert (diff > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize("mode", MODES)
def test_mode_equals_reference_formula(device, dtype, mode):
    """The kernels compute the reference's formula (rounding for rounding): bitwise where the
    sum of squares is exact, whatever the mode."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(-16, 17, (17, 4096), generator=g).float() / 8).to(dtype=dtype, device=device)
    w = randn(4096, dtype=dtype, device=device, seed=46, scale=0.5) + 1
    assert torch.equal(rl_engine_ext.rms_norm(x, w, EPS, mode), rms_mod.reference_forward(x, w, EPS, mode))


@pytest.mark.parametrize("mode", MODES)
def test_mode_llama_and_fp32_differ_as_documented(mode):
    """The modes are different formulas: on bf16, llama's two roundings differ from fp32's one
    on a sizeable fraction of the elements, gemma's (1 + w) differs from w everywhere."""
    x = randn(64, 4096, dtype=torch.bfloat16, device="cpu", seed=47)
    w = randn(4096, dtype=torch.bfloat16, device="cpu", seed=48, scale=0.5) + 1
    ours = rl_engine_ext.rms_norm(x, w, EPS, "fp32")
    other = rl_engine_ext.rms_norm(x, w, EPS, mode)
    frac = (ours != other).float().mean().item()
    assert frac == 0.0 if mode == "fp32" else frac > 0.05


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", [1, 7, 4095])
def test_mode_accuracy_forward_and_gradients(device, dtype, mode, hidden):
    rows = 67
    x = randn(rows, hidden, dtype=dtype, device=device, seed=49, scale=2.0)
    w = randn(hidden, dtype=dtype, device=device, seed=50, scale=0.5) + 1
    dy = randn(rows, hidden, dtype=dtype, device=device, seed=51)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rl_engine_ext.rms_norm(xg, wg, EPS, mode)
    y.backward(dy)
    tol = contract.tolerance("rms_norm", dtype, "forward")
    torch.testing.assert_close(y.float(), rms_mod.reference_forward_fp32(x, w, EPS, mode), atol=tol.atol, rtol=tol.rtol)
    xt, wt = x.float().requires_grad_(), w.float().requires_grad_()
    with contract.fp32_reference_mode():
        rms_mod.normalize(xt, wt, EPS, mode, torch.float32).backward(dy.float())
    gtol = contract.tolerance("rms_norm", dtype, "gradient")
    torch.testing.assert_close(xg.grad.float(), xt.grad, atol=gtol.atol, rtol=gtol.rtol)
    scale = max(1.0, xt.grad.abs().max().item(), wt.grad.abs().max().item())
    torch.testing.assert_close(wg.grad.float(), wt.grad, atol=gtol.atol * scale, rtol=gtol.rtol)
