"""linear_tree / linear_tree_grad_input / tree_linear: the tree is the leaves' own linear chains added
over rank_sum's tree (on every path, fused or leaf by leaf), a rank's subtree completes to the same
bits at every tensor-parallel degree, rows are invariant for every M (both sides of the sm90 decode /
tree-tile switch and of the fused kernel's k rule), NaN stays in its row, the weight gradient chains.
Registration, opcheck, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import math

import pytest
import torch

import rl_engine_ext as rl
from rl_engine_ext import testing
from rl_engine_ext.ops.rank_sum import tree_sum_fp32

from conftest import device_with_forced_paths, fused_and_split_kernels, randn

device = device_with_forced_paths("RL_ENGINE_EXT_LINEAR_PATH", ("sm80", "simt"))

# (N, K): a fused-kernel shape on sm90 (K a multiple of 8 x 64), a leaf-by-leaf one (K / 8 = 129),
# and Qwen3-8B's o / k,v projections' shapes at a reduced N (the dX leaves of k and v: 2 k-blocks).
SHAPES = [(96, 512), (40, 1032), (128, 1024)]
ROWS = [1, 3, 64, 65, 130]


def _inputs(m, n, k, dtype, device, seed=0):
    x = randn(m, k, dtype=dtype, device=device, seed=seed, scale=2.0)
    w = randn(n, k, dtype=dtype, device=device, seed=seed + 1, scale=2.0 / math.sqrt(k))
    b = randn(n, dtype=dtype, device=device, seed=seed + 2)
    dy = randn(m, n, dtype=dtype, device=device, seed=seed + 3, scale=2.0)
    return x, w, b, dy


def _leaf_tree(leaf_sums, bias, dtype, partial):
    total = tree_sum_fp32(leaf_sums)
    return total if partial else (total + bias.float() if bias is not None else total).to(dtype)


@pytest.mark.parametrize("leaves", [2, 4, 8])
@pytest.mark.parametrize("partial", [False, True], ids=["rounded", "partial"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_tree_is_the_leaves_added_over_the_tree(device, dtype, shape, leaves, partial):
    """Each leaf is linear's own fp32 chain over its slice (linear_tree with 1 leaf, partial), and
    the leaves are added over rank_sum's tree, then bias, one rounding: bit for bit."""
    n, k = shape
    x, w, b, dy = _inputs(65, n, k, dtype, device)
    bias = None if partial else b
    kl, nl = k // leaves, n // leaves
    sums = [rl.linear_tree(x[:, i * kl:(i + 1) * kl], w[:, i * kl:(i + 1) * kl], None, 1, True) for i in range(leaves)]
    assert torch.equal(rl.linear_tree(x, w, bias, leaves, partial), _leaf_tree(sums, bias, dtype, partial))
    sums = [rl.linear_tree_grad_input(dy[:, i * nl:(i + 1) * nl], w[i * nl:(i + 1) * nl], 1, True)
            for i in range(leaves)]
    assert torch.equal(rl.linear_tree_grad_input(dy, w, leaves, partial), _leaf_tree(sums, None, dtype, partial))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_subtrees_complete_the_tree(device, dtype, world):
    """What a row-parallel layer at TP = world computes (each rank's partial over its leaves, the
    partials through rank_sum, bias, rounding) is the 8-leaf tree's bits; and the column-parallel
    input gradient likewise."""
    n, k = 128, 1024
    x, w, b, dy = _inputs(33, n, k, dtype, device, seed=5)
    kr, nr = k // world, n // world
    parts = [rl.linear_tree(x[:, r * kr:(r + 1) * kr], w[:, r * kr:(r + 1) * kr], None, 8 // world, True)
             for r in range(world)]
    assert torch.equal((rl.rank_sum(parts) + b.float()).to(dtype), rl.linear_tree(x, w, b))
    parts = [rl.linear_tree_grad_input(dy[:, r * nr:(r + 1) * nr], w[r * nr:(r + 1) * nr], 8 // world, True)
             for r in range(world)]
    assert torch.equal(rl.rank_sum(parts).to(dtype), rl.linear_tree_grad_input(dy, w))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_invariant_for_every_m(device, dtype, shape):
    n, k = shape
    x, w, b, dy = _inputs(max(ROWS) + 7, n, k, dtype, device, seed=9)
    full = rl.linear_tree(x, w, b)
    full_dx = rl.linear_tree_grad_input(dy, w)
    full_partial = rl.linear_tree(x, w, None, 4, True)
    for m in ROWS:
        for start in (0, x.shape[0] - m):
            rows = slice(start, start + m)
            for what, got, want in (("y", rl.linear_tree(x[rows], w, b), full[rows]),
                                    ("dx", rl.linear_tree_grad_input(dy[rows], w), full_dx[rows]),
                                    ("partial", rl.linear_tree(x[rows], w, None, 4, True), full_partial[rows])):
                drift = testing.compare(what, f"rows[{start}:{start + m}]", got, want)
                assert drift is None, str(drift)


def test_tree_is_not_the_plain_chain(device):
    """The tree has bits of its own (so the tests above could fail): on K = 4096 it differs from
    linear somewhere, and stays within linear's accuracy."""
    x, w, b, _ = _inputs(64, 256, 4096, torch.bfloat16, device, seed=11)
    tree, plain = rl.linear_tree(x, w, b), rl.linear(x, w, b)
    assert not torch.equal(tree, plain)
    truth = x.double() @ w.double().t() + b.double()
    err = lambda y: float((y.double() - truth).abs().max())  # noqa: E731
    assert err(tree) <= 2 * err(plain) + 1e-6


def test_non_finite_stays_in_its_row(device, dtype):
    x, w, b, dy = _inputs(40, 96, 512, dtype, device, seed=13)
    clean_y, clean_dx = rl.linear_tree(x, w, b), rl.linear_tree_grad_input(dy, w)
    x[7, 100], dy[9, 3] = float("nan"), float("inf")
    y, dx = rl.linear_tree(x, w, b), rl.linear_tree_grad_input(dy, w)
    assert torch.isnan(y[7]).all() and not torch.isnan(dx[7]).any()
    keep = [i for i in range(40) if i != 7]
    assert torch.equal(y[keep], clean_y[keep])
    keep = [i for i in range(40) if i != 9]
    assert torch.equal(dx[keep], clean_dx[keep])


def test_tree_linear_autograd_and_weight_gradient_chain(device, dtype):
    """tree_linear's backward: linear_tree_grad_input for x, linear's weight and bias gradients
    (chainable over micro-batches of LINEAR_GRAD_TILE_TOKENS tokens)."""
    tile = rl.LINEAR_GRAD_TILE_TOKENS
    x, w, b, dy = _inputs(2 * tile, 96, 512, dtype, device, seed=17)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = rl.tree_linear(xs, ws, bs)
    y.backward(dy)
    assert torch.equal(y, rl.linear_tree(x, w, b))
    assert torch.equal(xs.grad, rl.linear_tree_grad_input(dy, w))
    assert torch.equal(ws.grad, rl.linear_grad_weight(dy, x).to(dtype))
    assert torch.equal(bs.grad, rl.linear_grad_bias(dy).to(dtype))
    chained = rl.linear_grad_weight(dy[tile:], x[tile:], rl.linear_grad_weight(dy[:tile], x[:tile]))
    assert torch.equal(chained, rl.linear_grad_weight(dy, x))


def test_empty_and_degenerate_shapes(device):
    w = torch.ones(16, 8, device=device, dtype=torch.bfloat16)
    b = torch.arange(16, device=device, dtype=torch.bfloat16)
    assert rl.linear_tree(torch.ones(0, 8, device=device, dtype=torch.bfloat16), w, b).shape == (0, 16)
    y = rl.linear_tree(torch.ones(3, 0, device=device, dtype=torch.bfloat16), torch.ones(16, 0, device=device,
                                                                                          dtype=torch.bfloat16), b)
    assert torch.equal(y, b.expand(3, 16))
    assert rl.linear_tree_grad_input(torch.ones(0, 16, device=device, dtype=torch.bfloat16), w).shape == (0, 8)
    x3 = torch.ones(2, 3, 8, device=device, dtype=torch.bfloat16)
    assert rl.linear_tree(x3, w, b, 8).shape == (2, 3, 16)
    assert rl.linear_tree(x3, w, None, 4, True).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("leaves", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 17, 64, 65, 300])
def test_fused_kernel_equals_leaf_by_leaf(monkeypatch, leaves, m):
    """sm90's one-launch tree (K and N multiples of leaves x 64) gives the leaf-by-leaf flow's bits
    (one GEMM per leaf, then rank_sum), forward and input gradient, rounded and partial."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused tree kernel is sm90's")
    x, w, b, dy = _inputs(m, 1024, 2048, torch.bfloat16, "cuda", seed=leaves + m)
    calls = lambda: (rl.linear_tree(x, w, b, leaves), rl.linear_tree(x, w, None, leaves, True),  # noqa: E731
                     rl.linear_tree_grad_input(dy, w, leaves), rl.linear_tree_grad_input(dy, w, leaves, True))
    fused, split = fused_and_split_kernels(monkeypatch, "RL_ENGINE_EXT_LINEAR_TREE_FUSED", calls)
    assert fused.get(("linear_gemm", "cuda/sm90")) == 4
    assert ("rank_sum", "cuda/simt") not in fused
    assert split.get(("linear_gemm", "cuda/sm90")) == 4 * leaves
    assert split.get(("rank_sum", "cuda/simt")) == 4


def test_tree_linear_noncontiguous_arguments(device, dtype):
    """tree_linear (a Python autograd Function, outside the registry's autograd sweep) with a strided
    x, a transposed weight view and a strided upstream gradient: the contiguous call's bits, forward
    and backward."""
    x, w, b, dy = _inputs(33, 96, 512, dtype, device, seed=19)
    layouts = {"contiguous": (x, w, dy),
               "strided": (torch.stack([x, x], 2)[..., 0], w.t().contiguous().t(), torch.stack([dy, dy], 2)[..., 0])}
    assert not any(t.is_contiguous() for t in layouts["strided"])
    results = {}
    for name, (xs, ws, g) in layouts.items():
        xs, ws, bs = (t.detach().requires_grad_() for t in (xs, ws, b.clone()))
        y = rl.tree_linear(xs, ws, bs)
        y.backward(g)
        results[name] = (y.detach(), xs.grad, ws.grad, bs.grad)
    for got, want in zip(results["strided"], results["contiguous"]):
        assert torch.equal(got, want)
