"""Self-tests of the invariance harness: it passes invariant functions and catches each kind of
batch dependence, with a readable report."""

from __future__ import annotations

import pytest
import torch

from rl_engine_ext import testing


def _rows(n: int, h: int = 48, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over decades so that fp32 summation order shows in the bits.
    return (torch.randn(n, h, generator=g) * torch.logspace(-3, 3, h)).to(dtype)


def _fixed_order_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Each row summed left to right: the same order whatever the batch."""
    acc = torch.zeros(x.shape[0], 1, dtype=x.dtype)
    for j in range(x.shape[1]):
        acc = acc + x[:, j : j + 1]
    return acc


def _tile_chain(tile: int):
    """A correct chainable weight-gradient: fp32 rows summed in order inside tiles of `tile`
    rows, tile sums added to the accumulator in order."""

    def chain(rows, cotangents, accum):
        (x,), (dy,) = rows, cotangents
        acc = accum["w"].clone() if accum is not None else torch.zeros(x.shape[1])
        contrib = (dy.float() * x.float())
        for s in range(0, x.shape[0], tile):
            tile_sum = torch.zeros(x.shape[1])
            for r in range(s, min(s + tile, x.shape[0])):
                tile_sum = tile_sum + contrib[r]
            acc = acc + tile_sum
        return {"w": acc}

    return chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_function_passes(dtype):
    x = _rows(40, dtype=dtype)
    w = _rows(1, dtype=dtype, seed=1)[0]
    # w is closed over: autograd's own sum over rows for dw is not padding invariant (see below).
    report = testing.check_invariance(lambda x: x * w + _fixed_order_row_sum(x), [x])
    testing.assert_invariant(report)
    assert {c.split("[")[0].split("#")[0] for c in report.configs} == {"batch1", "subbatch", "pad", "chunks", "repeat"}


def test_cross_row_dependence_is_caught():
    report = testing.check_invariance(lambda x: x - x.mean(0), [_rows(20)], grad=False)
    assert not report.ok
    kinds = {d.config.split("[")[0] for d in report.drifts}
    assert {"batch1", "pad", "chunks"} <= kinds
    assert all(d.max_abs > 0 and d.num_diff > 0 and d.tensor == "out[0]" for d in report.drifts)


def test_batch_size_dependent_reduction_order_is_caught():
    def fn(x):
        # Large batches sum each row in reverse order: the values agree, the bits don't.
        return x.flip(1).cumsum(1)[:, -1:] if x.shape[0] > 4 else _fixed_order_row_sum(x)

    report = testing.check_invariance(fn, [_rows(30)], grad=False)
    assert not report.ok
    assert any(d.config.startswith("batch1") for d in report.drifts)
    assert all(d.max_rel < 1e-3 for d in report.drifts)  # tiny rounding drift, still caught


def test_nondeterminism_is_caught_by_repeat():
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        return x + calls["n"] * 1e-3

    report = testing.check_invariance(fn, [_rows(8)], grad=False, single_rows=0, subbatches=0, pads=(), chunk_sizes=())
    assert [d.config for d in report.drifts] == ["repeat#0"]


def test_first_diverging_op_is_named():
    x = _rows(16)

    def chain(bad_stage: str):
        def fn(x):
            a = testing.probe("stage1", x - x.mean(0) if bad_stage == "stage1" else x * 2)
            return testing.probe("stage2", a - a.mean(0) if bad_stage == "stage2" else a + 1)

        return fn

    for stage in ("stage1", "stage2"):
        report = testing.check_invariance(chain(stage), [x], grad=False)
        assert not report.ok
        assert {d.first_op for d in report.drifts} == {stage}


def test_row_gradient_dependence_is_caught():
    class BatchDependentGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * (1 + 1e-3 * g.shape[0])

    report = testing.check_invariance(BatchDependentGrad.apply, [_rows(10)])
    assert not report.ok
    assert {d.tensor for d in report.drifts} == {"grad[x0]"}


def test_weight_gradient_checks():
    x = _rows(40)
    w = _rows(1, seed=1)[0]
    tile = 4
    report = testing.check_invariance(
        lambda x, w: x * w, [x], {"w": w}, weight_grad_tile=tile, weight_grad_chain=_tile_chain(tile)
    )
    # autograd's own dw (a torch.sum over rows) may drift under padding; the chain must not.
    assert not any(d.config.startswith("chain") for d in report.drifts)
    assert any(c.startswith("chain[micro=") for c in report.configs)

    def whole_batch_chain(rows, cotangents, accum):
        # torch.sum over all rows at once: its tree depends on the batch length.
        (x,), (dy,) = rows, cotangents
        acc = accum["w"] if accum is not None else torch.zeros(x.shape[1])
        return {"w": acc + (dy * x).flip(0).sum(0)}

    report = testing.check_invariance(
        lambda x, w: x * w, [x], {"w": w}, weight_grad_tile=tile, weight_grad_chain=whole_batch_chain
    )
    assert any(d.config.startswith("chain[micro=") and d.tensor == "chain[w]" for d in report.drifts)


def test_weight_gradient_padding_dependence_is_caught():
    class ReverseSumGrad(torch.autograd.Function):
        """dw is a pairwise tree over the whole batch: the tree's shape, and so the rounding of
        the real rows' partial sums, moves when padding rows change the row count."""

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x)
            return x * w

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            contrib = g * x
            n = contrib.shape[0]
            pairwise = contrib.reshape(n, -1)
            while pairwise.shape[0] > 1:  # pairwise tree over the whole batch
                if pairwise.shape[0] % 2:
                    pairwise = torch.cat([pairwise, torch.zeros_like(pairwise[:1])])
                pairwise = pairwise[0::2] + pairwise[1::2]
            return g * 2, pairwise[0]

    report = testing.check_invariance(
        lambda x, w: ReverseSumGrad.apply(x, w), [_rows(37)], {"w": _rows(1, seed=2)[0]}
    )
    assert any(d.tensor == "wgrad[w]" and d.config.startswith("pad[") for d in report.drifts)


def test_integer_row_inputs():
    table = _rows(50, h=8)
    ids = torch.randint(0, 50, (30,), generator=torch.Generator().manual_seed(3))
    report = testing.check_invariance(lambda ids, table: table[ids], [ids], {"table": table})
    testing.assert_invariant(report)


def test_report_format_and_errors():
    report = testing.check_invariance(lambda x: x - x.mean(0), [_rows(6)], grad=False)
    text = report.format()
    assert "out[0]" in text and "max abs diff" in text and "elements differ" in text and "batch1[row=" in text
    with pytest.raises(AssertionError, match="drifts"):
        report.raise_if_failed()
    with pytest.raises(ValueError, match="at least one row"):
        testing.check_invariance(lambda x: x, [torch.empty(0, 3)])


def test_compare_counts_and_nan():
    a = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    b = torch.tensor([1.0, float("nan"), 3.5, 4.0])
    drift = testing.compare("t", "c", a, b)
    assert drift.num_diff == 1 and drift.max_abs == pytest.approx(0.5) and drift.max_rel == pytest.approx(0.5 / 3.5)
    assert testing.compare("t", "c", a, a.clone()) is None
    assert testing.compare("t", "c", a, torch.tensor([1.0, 2.0, 3.0, 4.0])).num_diff == 1
