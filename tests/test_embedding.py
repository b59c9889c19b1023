"""embedding: invariance (Axis-A), accuracy (Axis-B), the weight gradient's one-chain-per-row
contract (run to run, any micro-batch split, zero-gradient and padding tokens), ids shapes and
dtypes, layouts, vector vs element paths, out-of-range ids. Registration, opcheck, compile and
bad input: tests/test_registry.py."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import embedding as emb_mod
from rl_engine_ext.ops.embedding import seeded_ids

from conftest import assert_device_assert, randn

HIDDEN_SIZES = [128, 4095, 4096]


def _chain(vocab: int, padding_idx: int | None = None):
    def chain(rows, cotangents, accum):
        return {"weight": rl_engine_ext.embedding_grad_weight(cotangents[0], rows[0], vocab, padding_idx,
                                                              None if accum is None else accum["weight"])}

    return chain


def _token_counts(device: str) -> list[int]:
    return [1, 3, 257, 2000] if device == "cuda" else [1, 3, 257]


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness (rows = tokens)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_invariance_forward_and_weight_gradient(device, dtype, hidden):
    """A token's row is bitwise independent of the batch; dweight is run-to-run identical,
    unchanged by zero-gradient padding tokens and chainable at micro-batches of 1, 2 and 3 tokens."""
    vocab = 97
    weight = randn(vocab, hidden, dtype=dtype, device=device, seed=1)
    for tokens in _token_counts(device):
        ids = seeded_ids(tokens, vocab=vocab, device=device, seed=tokens)
        report = testing.check_invariance(
            lambda ids, weight: rl_engine_ext.embedding(ids, weight), [ids], {"weight": weight}, seed=tokens,
            weight_grad_tile=1, weight_grad_chain=_chain(vocab),
        )
        testing.assert_invariant(report)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("shape", [(5,), (2, 3), (3, 0), (0,), ()], ids=str)
def test_any_ids_shape_and_dtype(device, dtype, id_dtype, shape):
    vocab, hidden = 11, 40
    weight = randn(vocab, hidden, dtype=dtype, device=device, seed=2)
    ids = seeded_ids(*shape, vocab=vocab, device=device, seed=3, dtype=id_dtype)
    out = rl_engine_ext.embedding(ids, weight)
    assert out.shape == (*shape, hidden) and out.dtype == dtype
    assert torch.equal(out, F.embedding(ids.long(), weight))
    dy = randn(*shape, hidden, dtype=dtype, device=device, seed=4)
    got = rl_engine_ext.embedding_grad_weight(dy, ids, vocab)
    assert got.shape == (vocab, hidden) and got.dtype == torch.float32
    assert torch.equal(got, emb_mod.reference_grad_weight(dy, ids, vocab))


# ------------------------------------------------------------------------------------------
# The weight gradient: one sequential chain per row
# ------------------------------------------------------------------------------------------


def _grad_problem(device, dtype, tokens=300, vocab=37, hidden=72, seed=5):
    ids = seeded_ids(tokens, vocab=vocab, device=device, seed=seed)
    dy = randn(tokens, hidden, dtype=dtype, device=device, seed=seed + 1)
    acc = randn(vocab, hidden, dtype=torch.float32, device=device, seed=seed + 2)
    return ids, dy, acc, vocab


def test_gradient_is_the_token_order_chain(device, dtype):
    """Bit for bit the reference's chain: accum (or 0), then each token of the row in token order."""
    ids, dy, acc, vocab = _grad_problem(device, dtype)
    for accum in (None, acc):
        got = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, accum)
        assert torch.equal(got, emb_mod.reference_grad_weight(dy, ids, vocab, None, accum))
        assert torch.equal(got, rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, accum))  # run to run


@pytest.mark.parametrize("split", ["1", "3", "7", "random"])
def test_chaining_any_split(device, dtype, split):
    """Micro-batches of any size chained through dweight_accum give the one-batch bits (the
    accumulator passed in is not modified)."""
    ids, dy, acc, vocab = _grad_problem(device, dtype, tokens=90)
    if split == "random":
        cuts = sorted(torch.randperm(89, generator=torch.Generator().manual_seed(6))[:11].add(1).tolist())
    else:
        cuts = list(range(int(split), 90, int(split)))
    bounds = [0, *cuts, 90]
    for start_acc in (None, acc):
        whole = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, start_acc)
        running = start_acc
        for a, b in zip(bounds[:-1], bounds[1:]):
            before = None if running is None else running.clone()
            nxt = rl_engine_ext.embedding_grad_weight(dy[a:b], ids[a:b], vocab, None, running)
            assert running is None or torch.equal(running, before)
            running = nxt
        assert torch.equal(running, whole)


def test_zero_gradient_and_padding_tokens_change_nothing(device, dtype):
    """Tokens with a zero gradient (anywhere) and tokens whose id is padding_idx (any gradient)
    leave every bit of dweight as it was."""
    ids, dy, acc, vocab = _grad_problem(device, dtype, tokens=200)
    pad = 7
    real = ids != pad
    ids, dy = ids[real], dy[real]
    gen = torch.Generator().manual_seed(8)
    extra = 150
    pos = torch.randperm(len(ids) + extra, generator=gen)
    is_extra = torch.zeros(len(ids) + extra, dtype=torch.bool)
    is_extra[pos[:extra]] = True
    extra_ids = seeded_ids(extra, vocab=vocab, device=device, seed=9)
    extra_ids[1::2] = pad  # half padding tokens with random gradients, half zero-gradient tokens
    extra_dy = randn(extra, dy.shape[1], dtype=dtype, device=device, seed=10)
    extra_dy[::2] = 0
    is_extra = is_extra.to(device)
    mixed_ids = torch.empty(len(is_extra), dtype=ids.dtype, device=device)
    mixed_dy = torch.empty(len(is_extra), dy.shape[1], dtype=dtype, device=device)
    mixed_ids[~is_extra], mixed_ids[is_extra] = ids, extra_ids
    mixed_dy[~is_extra], mixed_dy[is_extra] = dy, extra_dy
    for accum in (None, acc):
        want = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, pad, accum)
        assert torch.equal(rl_engine_ext.embedding_grad_weight(mixed_dy, mixed_ids, vocab, pad, accum), want)
        assert torch.equal(rl_engine_ext.embedding_grad_weight(mixed_dy, mixed_ids, vocab, pad - vocab, accum), want)
        assert torch.equal(want[pad], torch.zeros_like(want[pad]) if accum is None else accum[pad])


def test_one_id_for_every_token_is_one_long_chain(device):
    tokens = 20000 if device == "cuda" else 3000
    ids = torch.full((tokens,), 3, dtype=torch.int32, device=device)
    dy = randn(tokens, 40, dtype=torch.bfloat16, device=device, seed=11)
    got = rl_engine_ext.embedding_grad_weight(dy, ids, 5)
    chain = torch.zeros(40, dtype=torch.float32, device=device)
    for t in range(tokens):
        chain = chain + dy[t].float()
    assert torch.equal(got[3], chain)
    assert torch.equal(got[[0, 1, 2, 4]], torch.zeros(4, 40, device=device))


def test_nonfinite_gradient_stays_in_its_row(device):
    ids, dy, acc, vocab = _grad_problem(device, torch.bfloat16)
    clean = rl_engine_ext.embedding_grad_weight(dy, ids, vocab)
    dy = dy.clone()
    dy[17, 5] = float("nan")
    dirty = rl_engine_ext.embedding_grad_weight(dy, ids, vocab)
    other = torch.arange(vocab, device=device) != ids[17]
    assert torch.equal(dirty[other], clean[other]) and torch.isnan(dirty[ids[17], 5])


def test_cpu_result_independent_of_thread_count():
    ids, dy, acc, vocab = _grad_problem("cpu", torch.float32, tokens=2000, vocab=3000, hidden=33)
    w = acc.bfloat16()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, 2, acc), rl_engine_ext.embedding(ids, w)
        torch.set_num_threads(max(2, saved))
        many = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, 2, acc), rl_engine_ext.embedding(ids, w)
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


# ------------------------------------------------------------------------------------------
# padding_idx, autograd
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [None, 0, 4, -1])
def test_autograd_matches_torch_embedding(device, dtype, padding_idx):
    """Forward == F.embedding (the padding row is returned as it is); weight.grad is
    embedding_grad_weight in weight's dtype and within the gradient tolerance of torch's."""
    vocab, hidden = 13, 256
    ids = seeded_ids(4, 33, vocab=vocab, device=device, seed=12)
    ids[0, :5] = 4
    weight = randn(vocab, hidden, dtype=dtype, device=device, seed=13)
    dy = randn(4, 33, hidden, dtype=dtype, device=device, seed=14)
    ours_w = weight.clone().requires_grad_()
    theirs_w = weight.float().requires_grad_()
    out = rl_engine_ext.embedding(ids, ours_w, padding_idx)
    assert torch.equal(out, F.embedding(ids, weight, padding_idx))
    out.backward(dy)
    F.embedding(ids, theirs_w, padding_idx).backward(dy.float())
    assert ours_w.grad.dtype == dtype
    assert torch.equal(ours_w.grad, rl_engine_ext.embedding_grad_weight(dy, ids, vocab, padding_idx).to(dtype))
    tol = contract.tolerance("embedding", dtype, "gradient")
    torch.testing.assert_close(ours_w.grad.float(), theirs_w.grad.to(dtype).float(), atol=tol.atol, rtol=tol.rtol)
    if padding_idx is not None:
        assert not ours_w.grad[padding_idx].any()


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the fp32 ground truth
# ------------------------------------------------------------------------------------------


def test_forward_is_exact(device, dtype):
    ids = seeded_ids(300, vocab=50, device=device, seed=15)
    weight = randn(50, 4095, dtype=dtype, device=device, seed=16, scale=3.0)
    got = rl_engine_ext.embedding(ids, weight)
    truth = emb_mod.reference_forward_fp32(ids, weight)
    assert torch.equal(got.float(), truth)
    tol = contract.tolerance("embedding", dtype, "forward")
    torch.testing.assert_close(got.float(), truth, atol=tol.atol, rtol=tol.rtol)


def test_gradient_accuracy(device, dtype):
    ids, dy, acc, vocab = _grad_problem(device, dtype, tokens=1500, vocab=20, hidden=4096)
    got = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, acc)
    truth = acc.double().index_add(0, ids, dy.double()).float()
    tol = contract.tolerance("embedding", dtype, "gradient")
    torch.testing.assert_close(got, truth, atol=tol.atol, rtol=tol.rtol)


# ------------------------------------------------------------------------------------------
# Layouts and the vector/element paths
# ------------------------------------------------------------------------------------------


def test_strided_weight_and_grad_out(device, dtype):
    """Row-strided views are read in place, other layouts copied: same bits as contiguous."""
    vocab, hidden = 30, 256
    ids = seeded_ids(6, 7, vocab=vocab, device=device, seed=17)
    wide = randn(vocab, 2 * hidden, dtype=dtype, device=device, seed=18)
    transposed = randn(hidden, vocab, dtype=dtype, device=device, seed=19).t()
    for weight in (wide[:, :hidden], wide[:, 1 : hidden + 1], transposed):
        assert torch.equal(rl_engine_ext.embedding(ids, weight), rl_engine_ext.embedding(ids, weight.contiguous()))
    dy_wide = randn(6, 7, 2 * hidden, dtype=dtype, device=device, seed=20)
    dy_t = randn(6, hidden, 7, dtype=dtype, device=device, seed=21).transpose(1, 2)
    for dy in (dy_wide[..., :hidden], dy_wide[..., 3 : hidden + 3], dy_t, dy_wide[:, :1, :hidden].expand(6, 7, hidden)):
        want = rl_engine_ext.embedding_grad_weight(dy.contiguous(), ids, vocab)
        assert torch.equal(rl_engine_ext.embedding_grad_weight(dy, ids, vocab), want)
    acc = randn(vocab, 2 * hidden, dtype=torch.float32, device=device, seed=22)[:, :hidden]
    assert torch.equal(rl_engine_ext.embedding_grad_weight(dy_t, ids, vocab, None, acc),
                       rl_engine_ext.embedding_grad_weight(dy_t, ids, vocab, None, acc.contiguous()))


@pytest.mark.parametrize("hidden", [8, 64, 4096, 4095, 13])
def test_misaligned_inputs_match_aligned(device, dtype, hidden):
    """16-byte vector paths (aligned rows, hidden a multiple of the vector) and element paths
    (misaligned base, odd hidden) give the same bits, forward and backward."""
    vocab, tokens = 40, 130
    ids = seeded_ids(tokens, vocab=vocab, device=device, seed=23)

    def misaligned(t):
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16 != 0
        return view

    weight = randn(vocab, hidden, dtype=dtype, device=device, seed=24)
    assert torch.equal(rl_engine_ext.embedding(ids, misaligned(weight)), rl_engine_ext.embedding(ids, weight))
    dy = randn(tokens, hidden, dtype=dtype, device=device, seed=25)
    acc = randn(vocab, hidden, dtype=torch.float32, device=device, seed=26)
    want = rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, acc)
    assert torch.equal(rl_engine_ext.embedding_grad_weight(misaligned(dy), ids, vocab, None, acc), want)
    assert torch.equal(rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, misaligned(acc)), want)
    assert torch.equal(want, emb_mod.reference_grad_weight(dy, ids, vocab, None, acc))


def test_empty_and_tiny_shapes(device):
    w = randn(4, 24, dtype=torch.bfloat16, device=device, seed=27)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    assert rl_engine_ext.embedding(ids, w).shape == (0, 24)
    acc = randn(4, 24, dtype=torch.float32, device=device, seed=28)
    dy = torch.empty(0, 24, dtype=torch.bfloat16, device=device)
    assert torch.equal(rl_engine_ext.embedding_grad_weight(dy, ids, 4), torch.zeros(4, 24, device=device))
    assert torch.equal(rl_engine_ext.embedding_grad_weight(dy, ids, 4, None, acc), acc)
    one = torch.zeros(3, dtype=torch.int32, device=device)
    assert torch.equal(rl_engine_ext.embedding(one, w[:1]), w[:1].expand(3, 24))
    assert rl_engine_ext.embedding(one, w[:1, :0]).shape == (3, 0)
    assert rl_engine_ext.embedding_grad_weight(dy[:, :0], ids, 0).shape == (0, 0)


# ------------------------------------------------------------------------------------------
# Out-of-range ids
# ------------------------------------------------------------------------------------------


def test_out_of_range_ids_raise_on_cpu():
    w = randn(16, 8, dtype=torch.float32, device="cpu", seed=29)
    dy = randn(5, 8, dtype=torch.float32, device="cpu", seed=30)
    for ids, first in ((torch.tensor([1, 2, 16, -1, 3]), 16), (torch.tensor([1, -3, 99, 0, 0], dtype=torch.int32), -3)):
        msg = rf"id {first} out of range for 16 embeddings"
        for fn in (rl_engine_ext.embedding, emb_mod.reference_forward):
            with pytest.raises(IndexError, match=r"rl_align::embedding: " + msg):
                fn(ids, w)
        for fn in (rl_engine_ext.embedding_grad_weight, emb_mod.reference_grad_weight):
            with pytest.raises(IndexError, match=r"rl_align::embedding_grad_weight: " + msg):
                fn(dy, ids, 16)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["embedding", "embedding_grad_weight"])
def test_out_of_range_ids_assert_on_cuda(op):
    """A device-side assert that names the op and prints the id (the context is lost afterwards,
    so it runs in a subprocess)."""
    call = ("rl_engine_ext.embedding(ids, w)" if op == "embedding"
            else "rl_engine_ext.embedding_grad_weight(w[:3], ids, 16)")
    setup = ("w = torch.randn(16, 64, device='cuda', dtype=torch.bfloat16)\n"
             "ids = torch.tensor([1, 99, 2], device='cuda')\n")
    assert_device_assert(setup, call, f"rl_align::{op}: id 99 out of range for 16 embeddings")
