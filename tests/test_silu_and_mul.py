"""silu_and_mul: invariance (Axis-A) in both layouts, fused == two-tensor bits, accuracy (Axis-B),
odd / empty / strided / misaligned inputs (both sides of the 16-byte vector path), non-finite
values, autograd. Registration, opcheck, compile, bad input and the fallback:
tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import silu_and_mul as silu_mod

from conftest import randn

# 4096 and 12288: Qwen3-8B-like rows, whole 16-byte groups; 1, 7, 129: odd I (element path for
# every dtype; 7 and 129 leave a partial group).
INTERS = [1, 7, 129, 4096]
LAYOUTS = ["fused", "separate"]


def _row_counts(device: str, inter: int) -> list[int]:
    if device == "cuda":
        return [1, 3, 257, 4097] + ([16384] if inter >= 4096 else [70000])
    return [1, 3, 257] if inter >= 4096 else [1, 3, 257, 1500]


def _fused_input(rows: int, inter: int, dtype, device, seed: int) -> torch.Tensor:
    return randn(rows, 2 * inter, dtype=dtype, device=device, seed=seed, scale=3.0)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inter = gate_up.shape[-1] // 2
    return gate_up[..., :inter].contiguous(), gate_up[..., inter:].contiguous()


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inter", INTERS)
def test_invariance_forward_and_gradients(device, dtype, inter, layout):
    """Every row of y and of the input gradients is bitwise independent of the batch."""
    for rows in _row_counts(device, inter):
        gate_up = _fused_input(rows, inter, dtype, device, seed=rows + inter)
        if layout == "fused":
            report = testing.check_invariance(rl_engine_ext.silu_and_mul, [gate_up], seed=rows)
        else:
            report = testing.check_invariance(rl_engine_ext.silu_and_mul, list(_halves(gate_up)), seed=rows)
        testing.assert_invariant(report)


@pytest.mark.parametrize("inter", INTERS + [12288])
def test_fused_equals_two_tensors(device, dtype, inter):
    """The gate_up layout and the gate / up layout give the same bits, forward and backward,
    whether gate and up are separate tensors or views of one gate_up (HF's chunk)."""
    rows = 33
    gate_up = _fused_input(rows, inter, dtype, device, seed=inter)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=inter + 1)
    gate, up = _halves(gate_up)
    view_gate, view_up = gate_up.chunk(2, dim=-1)
    y = rl_engine_ext.silu_and_mul(gate_up)
    assert y.shape == (rows, inter) and y.dtype == dtype
    assert torch.equal(rl_engine_ext.silu_and_mul(gate, up), y)
    assert torch.equal(rl_engine_ext.silu_and_mul(view_gate, view_up), y)
    d_gate_up = rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    assert d_gate_up.shape == gate_up.shape and d_gate_up.dtype == dtype
    for g, u in ((gate, up), (view_gate, view_up)):
        d_gate, d_up = rl_engine_ext.silu_and_mul_backward(dy, g, u)
        assert torch.equal(torch.cat([d_gate, d_up], dim=-1), d_gate_up)


def test_cpu_thread_count_changes_no_bit():
    gate_up = _fused_input(300, 777, torch.bfloat16, "cpu", seed=5)
    dy = randn(300, 777, dtype=torch.bfloat16, device="cpu", seed=6)
    want = rl_engine_ext.silu_and_mul(gate_up), rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = rl_engine_ext.silu_and_mul(gate_up), rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------
# Layouts: strided and misaligned inputs (both sides of the 16-byte vector path)
# ------------------------------------------------------------------------------------------


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values at an address one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.parametrize("inter", [7, 129, 4096, 12288])
def test_misaligned_inputs_match_aligned(device, dtype, inter):
    """Misaligned rows take the element-by-element path, aligned rows of whole 16-byte groups
    the vector path: the same bits, forward and backward, in both layouts."""
    rows = 37
    gate_up = _fused_input(rows, inter, dtype, device, seed=inter + 2)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=inter + 3)
    gate, up = _halves(gate_up)
    assert gate_up.data_ptr() % 16 == 0
    mis_gate_up, mis_dy, mis_gate, mis_up = (_misaligned_copy(t) for t in (gate_up, dy, gate, up))
    assert torch.equal(rl_engine_ext.silu_and_mul(mis_gate_up), rl_engine_ext.silu_and_mul(gate_up))
    assert torch.equal(rl_engine_ext.silu_and_mul(mis_gate, up), rl_engine_ext.silu_and_mul(gate, up))
    assert torch.equal(rl_engine_ext.silu_and_mul_backward(mis_dy, mis_gate_up),
                       rl_engine_ext.silu_and_mul_backward(dy, gate_up))
    for got, want in zip(rl_engine_ext.silu_and_mul_backward(dy, gate, mis_up),
                         rl_engine_ext.silu_and_mul_backward(dy, gate, up)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("inter", [129, 4096])
def test_strided_and_noncontiguous_inputs(device, dtype, inter):
    """Row-strided views are read in place, non-contiguous inputs copied: contiguous bits."""
    rows = 9
    wide = randn(rows, 2 * inter + 24, dtype=dtype, device=device, seed=7, scale=3.0)
    gate_up = wide[:, 8 : 8 + 2 * inter]
    assert not gate_up.is_contiguous()
    dy_wide = randn(rows, inter + 8, dtype=dtype, device=device, seed=8)
    dy = dy_wide[:, :inter]
    assert torch.equal(rl_engine_ext.silu_and_mul(gate_up), rl_engine_ext.silu_and_mul(gate_up.contiguous()))
    assert torch.equal(rl_engine_ext.silu_and_mul_backward(dy, gate_up),
                       rl_engine_ext.silu_and_mul_backward(dy.contiguous(), gate_up.contiguous()))
    transposed = randn(2 * inter, rows, dtype=dtype, device=device, seed=9).t()
    assert torch.equal(rl_engine_ext.silu_and_mul(transposed), rl_engine_ext.silu_and_mul(transposed.contiguous()))
    # 3-D and a stride-0 (expanded) grad_out, as autograd hands out for y.sum().backward().
    gate_up3 = gate_up.contiguous().view(3, 3, 2 * inter)
    ones = torch.ones((), dtype=dtype, device=device).expand(3, 3, inter)
    assert torch.equal(rl_engine_ext.silu_and_mul_backward(ones, gate_up3),
                       rl_engine_ext.silu_and_mul_backward(ones.contiguous(), gate_up3))


def test_empty_inputs(device, dtype):
    for shape in ((0, 64), (3, 0), (2, 0, 8)):
        gate_up = torch.empty(*shape, dtype=dtype, device=device)
        out_shape = (*shape[:-1], shape[-1] // 2)
        y = rl_engine_ext.silu_and_mul(gate_up)
        assert y.shape == out_shape and y.dtype == dtype
        dy = torch.empty(out_shape, dtype=dtype, device=device)
        assert rl_engine_ext.silu_and_mul_backward(dy, gate_up).shape == gate_up.shape
        gate = torch.empty(out_shape, dtype=dtype, device=device)
        assert rl_engine_ext.silu_and_mul(gate, gate).shape == out_shape
        assert all(t.shape == out_shape for t in rl_engine_ext.silu_and_mul_backward(dy, gate, gate))


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the fp32 ground truth
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", INTERS)
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_forward_accuracy(device, dtype, inter, rows):
    gate_up = _fused_input(rows, inter, dtype, device, seed=rows * inter)
    got = rl_engine_ext.silu_and_mul(gate_up)
    tol = contract.tolerance("silu_and_mul", dtype, "forward")
    truth = silu_mod.reference_forward_fp32(gate_up)
    torch.testing.assert_close(got.float(), truth, atol=tol.atol, rtol=tol.rtol)
    # The dtype path rounds once; expf implementations differ by an ulp or two in fp32 at most.
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), silu_mod.reference_silu_and_mul(gate_up).float(), atol=ulp, rtol=ulp)


@pytest.mark.parametrize("inter", [7, 4096])
def test_gradient_accuracy(device, dtype, inter):
    rows = 67
    gate_up = _fused_input(rows, inter, dtype, device, seed=13)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=14)
    got = rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    truth_in = gate_up.float().requires_grad_()
    with contract.fp32_reference_mode():
        gate, up = truth_in.chunk(2, dim=-1)
        (F.silu(gate) * up).backward(dy.float())
    tol = contract.tolerance("silu_and_mul", dtype, "gradient")
    torch.testing.assert_close(got.float(), truth_in.grad, atol=tol.atol, rtol=tol.rtol)


# ------------------------------------------------------------------------------------------
# Non-finite values and large |gate|
# ------------------------------------------------------------------------------------------

EXTREME_GATES = [float("-inf"), -1e4, -200.0, -100.0, -89.0, -88.0, -20.0, 20.0, 89.0, 1e4, float("inf")]


def test_large_and_infinite_gates_take_their_limits(device, dtype):
    """No NaN where the true value is finite: silu(-inf) = 0, d silu / dg = 0 at -inf and 1 at
    +inf; large finite |g| stay finite (and fp32 values are close to the float64 truth)."""
    gates = torch.tensor(EXTREME_GATES, dtype=torch.float64)
    up = torch.full_like(gates, 1.5)
    dy = torch.full_like(gates, 0.75)
    gate_t, up_t, dy_t = (t.to(device=device, dtype=dtype) for t in (gates, up, dy))
    y = rl_engine_ext.silu_and_mul(gate_t, up_t).double().cpu()
    d_gate, d_up = (t.double().cpu() for t in rl_engine_ext.silu_and_mul_backward(dy_t, gate_t, up_t))
    g = gate_t.double().cpu()
    finite = g.isfinite()
    assert not y.isnan().any() and not d_gate.isnan().any() and not d_up.isnan().any()
    assert torch.equal(y[~finite], torch.tensor([0.0, float("inf")], dtype=torch.float64))
    assert torch.equal(d_gate[~finite], torch.tensor([0.0, 0.75 * 1.5], dtype=torch.float64))
    assert torch.equal(d_up[~finite], torch.tensor([0.0, float("inf")], dtype=torch.float64))
    s = torch.sigmoid(g[finite])
    want_y = g[finite] * s * 1.5
    want_dg = 0.75 * 1.5 * s * (1 + g[finite] * (1 - s))
    rel = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    # Where exp(-g) overflows (g < -88.72) silu is taken as -0: |true silu| < 2.7e-37 there. fp16
    # values below its smallest normal lose relative precision.
    tiny = max(torch.finfo(dtype).tiny, 1e-36)
    torch.testing.assert_close(y[finite], want_y, rtol=rel, atol=tiny)
    torch.testing.assert_close(d_gate[finite], want_dg, rtol=rel, atol=tiny)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_finite_values_stay_in_their_element(device, dtype, layout):
    """A NaN / Inf in one element changes no other element's bits (forward and backward), and a
    NaN input gives NaN outputs in its own element."""
    rows, inter = 6, 136
    gate_up = _fused_input(rows, inter, dtype, device, seed=21)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=22)
    dirty = gate_up.clone()
    hits = [(1, 3, float("nan")), (2, inter + 5, float("nan")), (3, 7, float("inf")), (4, inter + 9, float("-inf")),
            (5, 11, float("-inf"))]
    for r, c, v in hits:
        dirty[r, c] = v

    def run(gu):
        if layout == "fused":
            return rl_engine_ext.silu_and_mul(gu), rl_engine_ext.silu_and_mul_backward(dy, gu)
        gate, up = _halves(gu)
        return rl_engine_ext.silu_and_mul(gate, up), torch.cat(rl_engine_ext.silu_and_mul_backward(dy, gate, up), -1)

    y, d = run(gate_up)
    y_dirty, d_dirty = run(dirty)
    touched_y = torch.zeros_like(y, dtype=torch.bool)
    touched_d = torch.zeros_like(d, dtype=torch.bool)
    for r, c, _ in hits:
        touched_y[r, c % inter] = True
        touched_d[r, c % inter] = touched_d[r, c % inter + inter] = True
    assert torch.equal(y_dirty[~touched_y], y[~touched_y])
    assert torch.equal(d_dirty[~touched_d], d[~touched_d])
    assert y_dirty[1, 3].isnan() and y_dirty[2, 5].isnan()
    assert d_dirty[1, 3].isnan() and d_dirty[1, 3 + inter].isnan() and d_dirty[2, 5].isnan()
    assert y_dirty[5, 11] == 0 and d_dirty[5, 11] == 0 and d_dirty[5, 11 + inter] == 0


# ------------------------------------------------------------------------------------------
# Autograd through the public function
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("needs", ["both", "gate", "up"])
def test_autograd_two_tensors(device, dtype, needs):
    """HF layout: gate and up requiring grad get the backward op's bits; a tensor that does not
    require grad gets none."""
    rows, inter = 11, 200
    gate_up = _fused_input(rows, inter, dtype, device, seed=26)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=27)
    gate, up = (t.requires_grad_(needs in ("both", name)) for t, name in zip(_halves(gate_up), ("gate", "up")))
    rl_engine_ext.silu_and_mul(gate, up).backward(dy)
    want_gate, want_up = rl_engine_ext.silu_and_mul_backward(dy, gate.detach(), up.detach())
    assert (gate.grad is not None) == (needs != "up") and (up.grad is not None) == (needs != "gate")
    if gate.grad is not None:
        assert torch.equal(gate.grad, want_gate)
    if up.grad is not None:
        assert torch.equal(up.grad, want_up)


def test_autograd_fused_and_through_views(device, dtype):
    """The fused op's gradient, and the two-tensor op on chunk views of one leaf, both give
    silu_and_mul_backward's d(gate_up)."""
    rows, inter = 5, 64
    gate_up = _fused_input(rows, inter, dtype, device, seed=28)
    dy = randn(rows, inter, dtype=dtype, device=device, seed=29)
    want = rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    leaf = gate_up.clone().requires_grad_()
    rl_engine_ext.silu_and_mul(leaf).backward(dy)
    assert torch.equal(leaf.grad, want)
    leaf = gate_up.clone().requires_grad_()
    rl_engine_ext.silu_and_mul(*leaf.chunk(2, dim=-1)).backward(dy)
    assert torch.equal(leaf.grad, want)


@pytest.mark.cuda
def test_grid_stride_past_the_grid_y_limit():
    """More row groups than the grid's y-limit (65535): the rows past it are visited by the
    grid-stride loop and match the same rows computed alone, forward and backward."""
    rows, inter = 66000, 1024  # fp32: 256 groups per row, one row per block
    gate_up = randn(rows, 2 * inter, dtype=torch.float32, device="cuda", seed=40, scale=3.0)
    dy = randn(rows, inter, dtype=torch.float32, device="cuda", seed=41)
    y = rl_engine_ext.silu_and_mul(gate_up)
    d = rl_engine_ext.silu_and_mul_backward(dy, gate_up)
    for start in (0, 65530, rows - 7):
        part = slice(start, start + 7)
        assert torch.equal(y[part], rl_engine_ext.silu_and_mul(gate_up[part]))
        assert torch.equal(d[part], rl_engine_ext.silu_and_mul_backward(dy[part], gate_up[part]))
