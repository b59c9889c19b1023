"""add_rms_norm: fused == unfused bit for bit (forward and gradients, every mode), invariance
(Axis-A) with dweight chaining, accuracy (Axis-B), odd and empty shapes, layouts, non-finite
locality. Registration, opcheck, compile and bad input: tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import add_rms_norm as add_mod

from conftest import randn

EPS = 1e-6
MODES = ["fp32", "llama", "gemma"]


def _inputs(rows, hidden, dtype, device, seed=0):
    x = randn(rows, hidden, dtype=dtype, device=device, seed=seed, scale=2.0)
    residual = randn(rows, hidden, dtype=dtype, device=device, seed=seed + 1, scale=4.0)
    w = randn(hidden, dtype=dtype, device=device, seed=seed + 2, scale=0.5) + 1
    return x, residual, w


def _grads(fused: bool, x, residual, w, dy, dres, mode):
    """(y, new_residual, dx, dresidual, dweight) through autograd, fused or as an HF model runs it
    unfused (new_residual used downstream with cotangent dres, or not at all when dres is None)."""
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, residual, w))
    if fused:
        y, s = rl_engine_ext.add_rms_norm(xg, rg, wg, EPS, mode)
    else:
        s = xg + rg
        y = rl_engine_ext.rms_norm(s, wg, EPS, mode)
    outs, cots = ([y, s], [dy, dres]) if dres is not None else ([y], [dy])
    torch.autograd.backward(outs, cots)
    return y.detach(), s.detach(), xg.grad, rg.grad, wg.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", [1, 7, 128, 4095, 4096])
@pytest.mark.parametrize("residual_used", [True, False])
def test_fused_equals_unfused_bitwise(device, dtype, mode, hidden, residual_used):
    rows = 37
    x, residual, w = _inputs(rows, hidden, dtype, device, seed=hidden)
    dy = randn(rows, hidden, dtype=dtype, device=device, seed=5)
    dres = randn(rows, hidden, dtype=dtype, device=device, seed=6) if residual_used else None
    fused = _grads(True, x, residual, w, dy, dres, mode)
    unfused = _grads(False, x, residual, w, dy, dres, mode)
    for name, a, b in zip(("y", "new_residual", "dx", "dresidual", "dweight"), fused, unfused):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", MODES)
def test_backward_op_equals_rms_norm_backward_plus_grad_residual(device, dtype, mode):
    x, residual, w = _inputs(70, 4095, dtype, device, seed=7)
    dy = randn(70, 4095, dtype=dtype, device=device, seed=8)
    dres = randn(70, 4095, dtype=dtype, device=device, seed=9)
    _, s = rl_engine_ext.add_rms_norm(x, residual, w, EPS, mode)
    acc = randn(4095, dtype=torch.float32, device=device, seed=10)
    dx, dw = rl_engine_ext.rms_norm_backward(dy, s, w, EPS, acc, mode)
    got_dx, got_dw = rl_engine_ext.add_rms_norm_backward(dy, dres, s, w, EPS, acc, mode)
    assert torch.equal(got_dx, dx + dres) and torch.equal(got_dw, dw)
    got_dx, got_dw = rl_engine_ext.add_rms_norm_backward(dy, None, s, w, EPS, acc, mode)
    assert torch.equal(got_dx, dx) and torch.equal(got_dw, dw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hidden", [128, 4095])
def test_invariance_forward_gradients_and_chaining(device, dtype, mode, hidden):
    rows = 257 if device == "cpu" else 4097
    x, residual, w = _inputs(rows, hidden, dtype, device, seed=rows)

    def chain(row_inputs, cotangents, accum):
        _, s = rl_engine_ext.add_rms_norm(*row_inputs, w, EPS, mode)
        _, dweight = rl_engine_ext.add_rms_norm_backward(cotangents[0], cotangents[1], s, w, EPS,
                                                         None if accum is None else accum["weight"], mode)
        return {"weight": dweight}

    report = testing.check_invariance(
        lambda x, residual, weight: rl_engine_ext.add_rms_norm(x, residual, weight, EPS, mode),
        [x, residual], {"weight": w}, seed=rows,
        weight_grad_tile=rl_engine_ext.rms_norm_tile_rows(hidden), weight_grad_chain=chain)
    testing.assert_invariant(report)


@pytest.mark.parametrize("mode", MODES)
def test_accuracy(device, dtype, mode):
    x, residual, w = _inputs(67, 4095, dtype, device, seed=11)
    y, s = rl_engine_ext.add_rms_norm(x, residual, w, EPS, mode)
    y_true, s_true = add_mod.reference_forward_fp32(x, residual, w, EPS, mode)
    tol = contract.tolerance("add_rms_norm", dtype, "forward")
    torch.testing.assert_close(s.float(), s_true, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(y.float(), y_true, atol=tol.atol, rtol=tol.rtol)


def test_empty(device, dtype):
    x = torch.empty(0, 4096, dtype=dtype, device=device)
    w = randn(4096, dtype=dtype, device=device, seed=12)
    y, s = rl_engine_ext.add_rms_norm(x, x, w, EPS)
    assert y.shape == s.shape == (0, 4096)
    acc = randn(4096, dtype=torch.float32, device=device, seed=13)
    dx, dw = rl_engine_ext.add_rms_norm_backward(x, x, x, w, EPS, acc)
    assert dx.shape == (0, 4096) and torch.equal(dw, acc)
    xe = torch.empty(2, 0, 3, 0, dtype=dtype, device=device)
    assert rl_engine_ext.add_rms_norm(xe, xe, torch.empty(0, dtype=dtype, device=device), EPS)[0].shape == xe.shape


@pytest.mark.parametrize("hidden", [128, 4095, 4096])
def test_strided_and_misaligned_equal_contiguous(device, dtype, hidden):
    """Row-strided views and rows off 16-byte alignment (the element-wise load path) give the
    bits of contiguous aligned rows (the vector path), forward and backward."""
    rows = 37
    x, residual, w = _inputs(rows, hidden, dtype, device, seed=14)
    dy = randn(rows, hidden, dtype=dtype, device=device, seed=15)
    dres = randn(rows, hidden, dtype=dtype, device=device, seed=16)

    def misaligned(t):
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = flat[1:].view_as(t)
        out.copy_(t)
        return out

    def strided(t):
        wide = torch.zeros(rows, 2 * hidden, dtype=t.dtype, device=t.device)
        wide[:, :hidden] = t
        return wide[:, :hidden]

    y, s = rl_engine_ext.add_rms_norm(x, residual, w, EPS)
    dx, dw = rl_engine_ext.add_rms_norm_backward(dy, dres, s, w, EPS)
    for layout in (misaligned, strided):
        y2, s2 = rl_engine_ext.add_rms_norm(layout(x), layout(residual), w, EPS)
        assert torch.equal(y2, y) and torch.equal(s2, s)
        dx2, dw2 = rl_engine_ext.add_rms_norm_backward(layout(dy), layout(dres), layout(s), w, EPS)
        assert torch.equal(dx2, dx) and torch.equal(dw2, dw)
    # Only the residual off alignment: the whole row takes the element-wise path, same bits.
    y3, s3 = rl_engine_ext.add_rms_norm(x, misaligned(residual), w, EPS)
    assert torch.equal(y3, y) and torch.equal(s3, s)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_non_finite_stays_in_its_row(device, op, mode):
    rows, hidden = 9, 4095
    x, residual, w = _inputs(rows, hidden, torch.bfloat16, device, seed=17)
    dy = randn(rows, hidden, dtype=torch.bfloat16, device=device, seed=18)

    def run(x):
        xg, rg, wg = x.clone().requires_grad_(), residual.clone().requires_grad_(), w.clone().requires_grad_()
        y = rl_engine_ext.rms_norm(xg, wg, EPS, mode) if op == "rms_norm" else \
            rl_engine_ext.add_rms_norm(xg, rg, wg, EPS, mode)[0]
        y.backward(dy)
        return y.detach(), xg.grad

    clean = run(x)
    bad = x.clone()
    bad[4, 10] = float("nan")
    bad[4, 11] = float("inf")
    dirty = run(bad)
    keep = [r for r in range(rows) if r != 4]
    for a, b in zip(clean, dirty):
        assert torch.equal(a[keep], b[keep])
