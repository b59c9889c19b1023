"""grouped_linear / _grad_input / _grad_weight: every row is linear's row with its expert's weight, bit
for bit (forward and input gradient), each expert's weight gradient linear_grad_weight's chain over its
own rows; on every path (sm90's one grouped launch, the per-expert flow, sm80, simt, CPU), for groups
empty, tiny, straddling tiles, on both sides of the small-tile switch, with K / N tails; a NaN or inf
in one expert's rows stays there (the weight gradient's zeroed tail rows); unvalidated offsets are
clamped as documented; the weight gradient chains. Registration, opcheck, bad input and the fallback:
tests/test_registry.py."""

from __future__ import annotations

import math

import pytest
import torch

import rl_engine_ext as rl
from rl_engine_ext import testing
from rl_engine_ext.ops import grouped_linear as G

from conftest import device_with_forced_paths, fused_and_split_kernels, randn

device = device_with_forced_paths("RL_ENGINE_EXT_LINEAR_PATH", ("sm80", "simt"))

# Group sizes: empty groups, single rows, a group straddling a 64- and a 128-row tile, one past them.
COUNTS = {
    "small": [0, 1, 5, 0, 17, 2],
    "straddle": [63, 0, 129, 1, 64, 65],
    "large": [300, 7, 0, 190],
}
# (N, K): whole 64-wide blocks; K not a multiple of 8 (the padded-operand path) and N not of 64 (a
# 3-D map's zero fill inside each expert: the grad input's reduction tail).
SHAPES = [(96, 128), (40, 100), (136, 72)]


def _offsets(counts, device):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int64, device=device)


def _ranges(offsets):
    o = offsets.tolist()
    return [(e, o[e], o[e + 1]) for e in range(len(o) - 1)]


def _inputs(counts, n, k, dtype, device, seed=0):
    rows = sum(counts)
    x = randn(rows, k, dtype=dtype, device=device, seed=seed, scale=2.0)
    w = randn(len(counts), n, k, dtype=dtype, device=device, seed=seed + 1, scale=2.0 / math.sqrt(k))
    dy = randn(rows, n, dtype=dtype, device=device, seed=seed + 2, scale=2.0)
    return x, w, dy, _offsets(counts, device)


def _per_expert(x, w, dy, offsets):
    """linear's ops expert by expert: what the grouped ops must equal bit for bit."""
    y = torch.cat([rl.linear(x[a:b], w[e]) for e, a, b in _ranges(offsets)])
    dx = torch.cat([rl.linear_grad_input(dy[a:b], w[e]) for e, a, b in _ranges(offsets)])
    dw = torch.stack([rl.linear_grad_weight(dy[a:b], x[a:b]) for e, a, b in _ranges(offsets)])
    return y, dx, dw


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("counts", list(COUNTS), ids=str)
def test_rows_are_linears_rows(device, dtype, counts, shape):
    n, k = shape
    x, w, dy, offsets = _inputs(COUNTS[counts], n, k, dtype, device)
    y, dx, dw = _per_expert(x, w, dy, offsets)
    assert torch.equal(rl.grouped_linear(x, w, offsets), y)
    assert torch.equal(rl.grouped_linear(x, w, offsets.int(), False), y)
    assert torch.equal(rl.grouped_linear_grad_input(dy, w, offsets), dx)
    assert torch.equal(rl.grouped_linear_grad_weight(dy, x, offsets), dw)
    assert torch.equal(rl.grouped_linear_grad_weight(dy, x, offsets, None, False, False), dw.to(dtype))
    accum = randn(*dw.shape, dtype=torch.float32, device=device, seed=7)
    chained = torch.stack([rl.linear_grad_weight(dy[a:b], x[a:b], accum[e]) if b > a else accum[e]
                           for e, a, b in _ranges(offsets)])
    assert torch.equal(rl.grouped_linear_grad_weight(dy, x, offsets, accum), chained)


def test_differentiable(device, dtype):
    """grouped_linear's autograd: the gradient ops' bits (the weight's rounded once to its dtype)."""
    x, w, dy, offsets = _inputs(COUNTS["straddle"], 96, 128, dtype, device, seed=3)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    rl.grouped_linear(xr, wr, offsets).backward(dy)
    assert torch.equal(xr.grad, rl.grouped_linear_grad_input(dy, w, offsets))
    assert torch.equal(wr.grad, rl.grouped_linear_grad_weight(dy, x, offsets).to(dtype))


def test_many_experts_few_rows(device):
    """Decode and prefill routing at Qwen3-30B-A3B's expert count (128, top-8 of 1 and 64 tokens):
    most experts empty or a few rows; and 1025 experts (past the grouped launch's table: one GEMM per
    expert), same bits."""
    for tokens, experts in ((1, 128), (64, 128), (3, 1025)):
        ids = torch.randint(0, experts, (tokens, 8), generator=torch.Generator().manual_seed(tokens))
        counts = torch.bincount(ids.flatten(), minlength=experts).tolist()
        x, w, dy, offsets = _inputs(counts, 64, 64, torch.bfloat16, device, seed=tokens)
        y, dx, dw = _per_expert(x, w, dy, offsets)
        assert torch.equal(rl.grouped_linear(x, w, offsets, False), y)
        assert torch.equal(rl.grouped_linear_grad_input(dy, w, offsets, False), dx)
        assert torch.equal(rl.grouped_linear_grad_weight(dy, x, offsets, None, False), dw)


def test_nonfinite_stays_in_its_expert(device, dtype):
    """NaN and inf in expert 1's rows (and their gradients): experts 0 and 2 keep their bits. Expert
    0's weight gradient reads a partial token block whose tail rows are expert 1's (zeroed first)."""
    counts = [37, 5, 90]
    x, w, dy, offsets = _inputs(counts, 96, 128, dtype, device, seed=5)
    y, dx, dw = _per_expert(x, w, dy, offsets)
    bad_x, bad_dy = x.clone(), dy.clone()
    bad_x[37:42, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    bad_dy[37:42, 5:7] = torch.tensor([float("inf"), float("nan")], dtype=dtype)
    keep = torch.cat([torch.arange(0, 37), torch.arange(42, 132)]).to(device)
    assert torch.equal(rl.grouped_linear(bad_x, w, offsets).index_select(0, keep), y.index_select(0, keep))
    assert torch.equal(rl.grouped_linear_grad_input(bad_dy, w, offsets).index_select(0, keep), dx.index_select(0, keep))
    got = rl.grouped_linear_grad_weight(bad_dy, bad_x, offsets)
    assert torch.equal(got[0], dw[0]) and torch.equal(got[2], dw[2])
    assert not torch.isfinite(got[1]).all()


def test_unvalidated_offsets_are_clamped(device):
    """validate=False: offsets[0] and offsets[E] read as 0 and T, the others clamped into [previous,
    T] (G.device_offsets), so every row has one expert and nothing is out of bounds."""
    x, w, dy, _ = _inputs([10, 10, 10, 10], 40, 64, torch.bfloat16, device, seed=9)
    for raw in ([5, 12, 3, 70, -4], [-3, -1, 50, 20, 2], [0, 40, 40, 40, 40]):
        given = torch.tensor(raw, device=device)
        clamped = torch.tensor(G.device_offsets(given, 40), device=device)
        y, dx, dw = _per_expert(x, w, dy, clamped)
        assert torch.equal(rl.grouped_linear(x, w, given, False), y)
        assert torch.equal(rl.grouped_linear_grad_input(dy, w, given, False), dx)
        assert torch.equal(rl.grouped_linear_grad_weight(dy, x, given, None, False), dw)


def test_weight_gradient_chains_over_micro_batches(device):
    """Two micro-batches through dweight_accum == one pass, when each expert's rows per micro-batch but
    the last are a multiple of LINEAR_GRAD_TILE_TOKENS (64); any split == the per-expert chain."""
    tile = rl.LINEAR_GRAD_TILE_TOKENS
    first, second = [tile, 0, 2 * tile], [5, 70, 33]
    x1, w, dy1, o1 = _inputs(first, 96, 128, torch.bfloat16, device, seed=11)
    x2, _, dy2, o2 = _inputs(second, 96, 128, torch.bfloat16, device, seed=12)
    acc = rl.grouped_linear_grad_weight(dy2, x2, o2, rl.grouped_linear_grad_weight(dy1, x1, o1))
    # One pass over both micro-batches' rows, each expert's in order.
    xs, dys, counts = [], [], []
    for e in range(3):
        xs += [x1[o1[e]:o1[e + 1]], x2[o2[e]:o2[e + 1]]]
        dys += [dy1[o1[e]:o1[e + 1]], dy2[o2[e]:o2[e + 1]]]
        counts.append(first[e] + second[e])
    whole = rl.grouped_linear_grad_weight(torch.cat(dys), torch.cat(xs), _offsets(counts, device))
    assert torch.equal(acc, whole)


@pytest.mark.cuda
@pytest.mark.parametrize("counts", list(COUNTS), ids=str)
def test_grouped_launch_equals_per_expert_flow(monkeypatch, counts):
    """sm90's one grouped launch per op (offsets read on the device) gives the per-expert flow's bits
    (one linear GEMM per non-empty expert)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grouped launch is sm90's")
    x, w, dy, offsets = _inputs(COUNTS[counts], 136, 72, torch.bfloat16, "cuda", seed=13)
    accum = randn(len(COUNTS[counts]), 136, 72, dtype=torch.float32, device="cuda", seed=14)
    calls = lambda: (rl.grouped_linear(x, w, offsets), rl.grouped_linear_grad_input(dy, w, offsets),  # noqa: E731
                     rl.grouped_linear_grad_weight(dy, x, offsets), rl.grouped_linear_grad_weight(dy, x, offsets, accum),
                     rl.grouped_linear_grad_weight(dy, x, offsets, None, True, False))
    grouped, split = fused_and_split_kernels(monkeypatch, "RL_ENGINE_EXT_GROUPED_LINEAR_FUSED", calls)
    assert grouped.get(("linear_gemm", "cuda/sm90")) == 5
    nonempty = sum(1 for c in COUNTS[counts] if c)
    assert split.get(("linear_gemm", "cuda/sm90")) == 5 * nonempty


@pytest.mark.cuda
def test_unvalidated_call_captures_in_a_cuda_graph():
    """validate=False reads the offsets on the device only: the forward and backward capture in a CUDA
    graph, and a replay after new offsets are written routes the rows by them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grouped launch (no host copy of the offsets) is sm90's")
    from conftest import capture_cuda_graph

    x, w, dy, offsets = _inputs([40, 0, 24], 96, 128, torch.bfloat16, "cuda", seed=15)
    graph, (y, dw) = capture_cuda_graph(lambda: (rl.grouped_linear(x, w, offsets, False),
                                                 rl.grouped_linear_grad_weight(dy, x, offsets, None, False)))
    offsets.copy_(_offsets([10, 30, 24], "cuda"))
    graph.replay()
    want_y, _, want_dw = _per_expert(x, w, dy, offsets)
    assert torch.equal(y, want_y) and torch.equal(dw, want_dw)


def test_invariance_harness(device, dtype):
    """Tokens routed by their own values, sorted, grouped, unsorted: every token's row and input
    gradient are the same alone, in sub-batches, padded, chunked (rl_engine_ext.testing)."""
    case = G.SPEC.invariance_case(device, dtype, rows=150, experts=4, out_features=96, in_features=128)
    testing.assert_invariant(testing.check_invariance(case.fn, case.rows))
