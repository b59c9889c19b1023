"""moe_combine: invariance (Axis-A) of each token's output and of its gradients (its rows and its
weights) whatever the batch and wherever its rows sit in expert_out; the kernels equal to the
reference's op-for-op arithmetic bit for bit (and CUDA to the CPU); accuracy (Axis-B) and
gradients against torch's fp32 gather / multiply / sum and its autograd; weights None == ones;
repeated positions (the last owner wins); empty shapes, strided and misaligned inputs; out-of-range
positions. Registration, opcheck, compile, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import moe_combine as combine_mod

from conftest import assert_device_assert, randn

# (top_k, hidden): Qwen3-30B-A3B (8, 2048), Mixtral-like (2, 4096); odd hidden sizes take the
# element path and leave partial chunks / groups.
SHAPES = [(8, 2048), (2, 4095), (4, 129), (1, 7)]
W_DTYPES = [torch.float32, torch.bfloat16, None]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return testing.compare("t", "", a, b) is None


def _inputs(tokens, top_k, hidden, dtype, device, seed, w_dtype=torch.float32, extra_rows=5):
    _, positions = combine_mod.dispatch_positions(tokens, top_k, 4 * top_k, device=device, seed=seed)
    expert_out = randn(tokens * top_k + extra_rows, hidden, dtype=dtype, device=device, seed=seed + 1)
    weights = None
    if w_dtype is not None:
        weights = torch.softmax(randn(tokens, top_k, dtype=torch.float32, device=device, seed=seed + 2), -1).to(w_dtype)
    return expert_out, positions, weights


def _torch_combine(expert_out, positions, weights):
    """The expression moe_combine replaces, in fp32."""
    x = expert_out.float()[positions]
    if weights is not None:
        x = x * weights.float().unsqueeze(-1)
    return x.sum(1)


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k,hidden", SHAPES)
def test_invariance_forward_and_gradients(device, dtype, top_k, hidden):
    """A token's output row, the gradient of its k expert rows and of its weights are bitwise
    independent of the batch; the rows are laid out in expert order for each batch, so they also sit
    at other positions of expert_out in every layout."""
    fn = combine_mod.combine_case_fn(top_k, 4 * top_k)
    for tokens in (1, 3, 130) if device == "cuda" or hidden < 1000 else (1, 37):
        ids, _ = combine_mod.dispatch_positions(tokens, top_k, 4 * top_k, device=device, seed=tokens)
        rows = randn(tokens, top_k, hidden, dtype=dtype, device=device, seed=hidden + tokens)
        weights = torch.softmax(randn(tokens, top_k, dtype=torch.float32, device=device, seed=tokens), -1)
        report = testing.check_invariance(fn, [rows, weights, ids], seed=tokens)
        testing.assert_invariant(report)
        if device == "cuda" or hidden < 1000:
            no_weights = testing.check_invariance(lambda r, i: fn(r, None, i), [rows, ids], seed=tokens)
            testing.assert_invariant(no_weights)


def test_nan_stays_in_its_token(device):
    expert_out, positions, weights = _inputs(20, 4, 256, torch.bfloat16, device, seed=3)
    clean = rl_engine_ext.moe_combine(expert_out, positions, weights)
    dirty = expert_out.clone()
    dirty[positions[7, 2], 11] = float("nan")
    got = rl_engine_ext.moe_combine(dirty, positions, weights)
    others = [t for t in range(20) if t != 7]
    assert torch.equal(got[others], clean[others]) and torch.isnan(got[7, 11])


# ------------------------------------------------------------------------------------------
# The arithmetic: kernels == reference bit for bit, CUDA == CPU
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=["w_fp32", "w_bf16", "no_weights"])
@pytest.mark.parametrize("top_k,hidden", SHAPES + [(3, 1), (8, 300)])
def test_kernels_equal_the_reference_and_the_cpu(device, dtype, top_k, hidden, w_dtype):
    """Forward, grad_expert_out and grad_weights are the reference's op-for-op arithmetic
    (csrc/common/moe_combine.h: rank order, no FMA; grad_weights' 32-lane order): the same bits; the
    GPU gives the CPU's."""
    expert_out, positions, weights = _inputs(37, top_k, hidden, dtype, device, seed=hidden, w_dtype=w_dtype)
    dy = randn(37, hidden, dtype=dtype, device=device, seed=hidden + 9)
    out = rl_engine_ext.moe_combine(expert_out, positions, weights)
    grad_x, grad_w = rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights)
    assert _same(out, combine_mod.reference_moe_combine(expert_out, positions, weights))
    want_x, want_w = combine_mod.reference_moe_combine_backward(dy, expert_out, positions, weights)
    assert _same(grad_x, want_x) and _same(grad_w, want_w)
    assert grad_x.dtype == dtype and grad_w.dtype == (w_dtype or dtype)
    assert grad_w.shape == ((37, top_k) if w_dtype is not None else (0,))
    if device != "cpu":
        cpu = [t.cpu() if t is not None else None for t in (dy, expert_out, positions, weights)]
        assert _same(out.cpu(), rl_engine_ext.moe_combine(*cpu[1:]))
        cpu_x, cpu_w = rl_engine_ext.moe_combine_backward(*cpu)
        assert _same(grad_x.cpu(), cpu_x) and _same(grad_w.cpu(), cpu_w)


def test_forward_is_the_rank_order_sum_of_products():
    """Spelled out once: out = round(((w0 x0 + w1 x1) + w2 x2) ...) with fp32 products and sums,
    in rank order: (1e8 + 1) - 1e8 = 0 but (1e8 - 1e8) + 1 = 1."""
    x = torch.tensor([[1e8, 1.0], [1.0, 3.0], [-1e8, 5.0]], dtype=torch.float32)
    positions = torch.tensor([[0, 1, 2], [0, 2, 1]])
    out = rl_engine_ext.moe_combine(x, positions, torch.ones(2, 3))
    assert out[0, 0] == 0.0 and out[1, 0] == 1.0 and out[0, 1] == 9.0
    w = torch.tensor([[0.5, 0.25, 2.0], [1.0, 1.0, 1.0]])
    assert torch.equal(rl_engine_ext.moe_combine(x, positions, w)[0], ((0.5 * x[0] + 0.25 * x[1]) + 2.0 * x[2]))


def test_weights_none_equals_weights_one(device, dtype):
    expert_out, positions, _ = _inputs(30, 4, 300, dtype, device, seed=4)
    dy = randn(30, 300, dtype=dtype, device=device, seed=5)
    ones = torch.ones(30, 4, device=device)
    assert torch.equal(rl_engine_ext.moe_combine(expert_out, positions), rl_engine_ext.moe_combine(expert_out, positions, ones))
    grad_none, empty = rl_engine_ext.moe_combine_backward(dy, expert_out, positions)
    grad_ones, _ = rl_engine_ext.moe_combine_backward(dy, expert_out, positions, ones)
    assert torch.equal(grad_none, grad_ones) and empty.shape == (0,)


def test_repeated_positions_last_owner_wins(device, dtype):
    """A row named twice gets the gradient of its last (t, r) in row-major order, on every path;
    rows named by nobody get 0."""
    expert_out = randn(6, 40, dtype=dtype, device=device, seed=6)
    positions = torch.tensor([[0, 1], [1, 2], [4, 1], [2, 0]], device=device)
    weights = randn(4, 2, dtype=torch.float32, device=device, seed=7)
    dy = randn(4, 40, dtype=dtype, device=device, seed=8)
    grad_x, grad_w = rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights)
    row = lambda t, r: (weights[t, r] * dy[t].float()).to(dtype)  # noqa: E731
    assert torch.equal(grad_x[1], row(2, 1)) and torch.equal(grad_x[2], row(3, 0)) and torch.equal(grad_x[0], row(3, 1))
    assert torch.equal(grad_x[4], row(2, 0))
    assert not grad_x[3].any() and not grad_x[5].any()
    want = combine_mod.reference_moe_combine_backward(dy, expert_out, positions, weights)
    assert _same(grad_x, want[0]) and _same(grad_w, want[1])


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against torch's fp32 combine and its autograd
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=["w_fp32", "w_bf16", "no_weights"])
@pytest.mark.parametrize("top_k,hidden", [(8, 2048), (2, 4095)])
def test_accuracy_forward_and_gradients(device, dtype, top_k, hidden, w_dtype):
    expert_out, positions, weights = _inputs(65, top_k, hidden, dtype, device, seed=top_k, w_dtype=w_dtype)
    out = rl_engine_ext.moe_combine(expert_out, positions, weights)
    tol = contract.tolerance("moe_combine", dtype)
    torch.testing.assert_close(out.float(), combine_mod.reference_forward_fp32(expert_out, positions, weights),
                               atol=tol.atol, rtol=tol.rtol)

    dy = randn(65, hidden, dtype=dtype, device=device, seed=top_k + 3)
    x = expert_out.clone().requires_grad_()
    w = weights.clone().requires_grad_() if weights is not None else None
    rl_engine_ext.moe_combine(x, positions, w).backward(dy)
    with contract.fp32_reference_mode():
        x32 = expert_out.float().requires_grad_()
        w32 = weights.float().requires_grad_() if weights is not None else None
        _torch_combine(x32, positions, w32).backward(dy.float())
    gtol = contract.tolerance("moe_combine", dtype, "gradient")
    torch.testing.assert_close(x.grad.float(), x32.grad, atol=gtol.atol, rtol=gtol.rtol)
    if w is not None:
        assert w.grad.dtype == w_dtype
        wtol = contract.tolerance("moe_combine", w_dtype, "gradient")
        # grad_weights sums H products: its error grows like sqrt(H) times the terms' (fp32 sum,
        # bf16 inputs exact), so compare relative to the sum of |terms|.
        scale = (dy.float().unsqueeze(1).abs() * expert_out.float()[positions].abs()).sum(-1)
        err = (w.grad.float() - w32.grad).abs()
        assert (err <= wtol.atol + wtol.rtol * scale).all()


def test_python_autograd_formula_matches_the_native_one(device):
    expert_out, positions, weights = _inputs(9, 4, 64, torch.bfloat16, device, seed=10)
    dy = randn(9, 64, dtype=torch.bfloat16, device=device, seed=11)
    x, w = expert_out.clone().requires_grad_(), weights.clone().requires_grad_()
    rl_engine_ext.moe_combine(x, positions, w).backward(dy)
    ctx = type("Ctx", (), {"save_for_backward": lambda self, *t: setattr(self, "saved_tensors", t),
                           "needs_input_grad": (True, False, True)})()
    combine_mod._setup_context(ctx, (expert_out, positions, weights), None)
    grad_x, _, grad_w = combine_mod._backward(ctx, dy)
    assert torch.equal(grad_x, x.grad) and torch.equal(grad_w, w.grad)


# ------------------------------------------------------------------------------------------
# Shapes, layouts and errors
# ------------------------------------------------------------------------------------------


def test_empty_shapes(device, dtype):
    for tokens, top_k, rows, hidden in ((0, 4, 5, 64), (3, 0, 5, 64), (3, 2, 6, 0), (0, 0, 0, 8)):
        _, positions = combine_mod.dispatch_positions(tokens, top_k, 8, device=device, seed=1)
        expert_out = randn(rows, hidden, dtype=dtype, device=device, seed=2)
        weights = torch.ones(tokens, top_k, device=device, dtype=dtype)
        out = rl_engine_ext.moe_combine(expert_out, positions, weights)
        assert out.shape == (tokens, hidden) and out.dtype == dtype and not out.any()
        dy = torch.ones(tokens, hidden, dtype=dtype, device=device)
        grad_x, grad_w = rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights)
        assert grad_x.shape == (rows, hidden) and grad_w.shape == (tokens, top_k) and grad_w.dtype == dtype
        assert not grad_w.any()
        if top_k == 0 or tokens == 0:
            assert not grad_x.any()


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("hidden", [256, 4095])
def test_strided_and_misaligned_inputs(device, dtype, hidden):
    """Row-strided and misaligned expert_out / grad_out take the element path: the same bits."""
    expert_out, positions, weights = _inputs(11, 4, hidden, dtype, device, seed=12)
    dy = randn(11, hidden, dtype=dtype, device=device, seed=13)
    want = (rl_engine_ext.moe_combine(expert_out, positions, weights),
            *rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights))
    wide = torch.zeros(expert_out.shape[0], hidden + 24, dtype=dtype, device=device)
    wide[:, 8 : 8 + hidden] = expert_out
    for x, g in ((wide[:, 8 : 8 + hidden], dy), (_misaligned_copy(expert_out), _misaligned_copy(dy))):
        got = (rl_engine_ext.moe_combine(x, positions, weights), *rl_engine_ext.moe_combine_backward(g, x, positions, weights))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    transposed = expert_out.t().contiguous().t()
    assert torch.equal(rl_engine_ext.moe_combine(transposed, positions.t().contiguous().t(), weights), want[0])


def test_cpu_thread_count_changes_no_bit():
    expert_out, positions, weights = _inputs(300, 8, 512, torch.bfloat16, "cpu", seed=14)
    dy = randn(300, 512, dtype=torch.bfloat16, device="cpu", seed=15)
    want = (rl_engine_ext.moe_combine(expert_out, positions, weights),
            *rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = (rl_engine_ext.moe_combine(expert_out, positions, weights),
               *rl_engine_ext.moe_combine_backward(dy, expert_out, positions, weights))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_out_of_range_positions_raise_on_cpu():
    x = randn(8, 16, dtype=torch.float32, device="cpu", seed=16)
    positions = torch.tensor([[0, 1], [9, 2]])
    for fn in (rl_engine_ext.moe_combine, combine_mod.reference_moe_combine):
        with pytest.raises(IndexError, match=r"rl_align::moe_combine: position 9 out of range for 8 rows of expert_out"):
            fn(x, positions)
    for fn in (rl_engine_ext.moe_combine_backward, combine_mod.reference_moe_combine_backward):
        with pytest.raises(IndexError, match=r"rl_align::moe_combine_backward: position 9 out of range"):
            fn(torch.zeros(2, 16), x, positions, torch.ones(2, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["moe_combine", "moe_combine_backward"])
def test_out_of_range_positions_assert_on_cuda(op):
    call = ("rl_engine_ext.moe_combine(x, positions, w)" if op == "moe_combine"
            else "rl_engine_ext.moe_combine_backward(dy, x, positions, w)")
    setup = ("x = torch.randn(8, 64, device='cuda', dtype=torch.bfloat16)\n"
             "positions = torch.tensor([[1, 2], [3, 99]], device='cuda')\n"
             "w = torch.ones(2, 2, device='cuda')\n"
             "dy = torch.randn(2, 64, device='cuda', dtype=torch.bfloat16)\n")
    assert_device_assert(setup, call, f"rl_align::{op}: position 99 out of range for 8 rows of expert_out")
