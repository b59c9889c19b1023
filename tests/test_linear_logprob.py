"""linear_logprob: bit for bit logprob(linear(...)) (forward, entropy, gradients of hidden, weight
and bias, every chunk size), invariance (Axis-A) with weight-gradient chaining, accuracy (Axis-B),
tied embeddings, odd / empty / batched shapes. Registration, opcheck, compile and bad input:
tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import linear_logprob as llp_mod

from conftest import randn

IGNORE = -100
TILE = rl_engine_ext.LINEAR_GRAD_TILE_TOKENS
CHUNK_ENV = llp_mod.CHUNK_TOKENS_ENV
SLICE_ENV = llp_mod.SLICE_COLUMNS_ENV
SLICE = llp_mod.SLICE_COLUMNS


def _problem(tokens, vocab, width, dtype, device, seed=0, ignored_every=5):
    hidden = randn(tokens, width, dtype=dtype, device=device, seed=seed)
    weight = randn(vocab, width, dtype=dtype, device=device, seed=seed + 1, scale=2 * width**-0.5)
    bias = randn(vocab, dtype=dtype, device=device, seed=seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    if ignored_every:
        targets[::ignored_every] = IGNORE
    return hidden, weight, bias, targets.to(device)


def _run(fused, hidden, weight, bias, targets, temperature, use_entropy, cot):
    """(logprob, entropy, d hidden, d weight, d bias) through autograd, fused or unfused."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    if fused:
        lp, ent = rl_engine_ext.linear_logprob(h, w, targets, temperature, True, b)
    else:
        lp, ent = rl_engine_ext.logprob(rl_engine_ext.linear(h, w, b), targets, temperature, True)
    outs, cots = ([lp, ent], list(cot)) if use_entropy else ([lp], [cot[0]])
    torch.autograd.backward(outs, cots)
    return lp.detach(), ent.detach(), h.grad, w.grad, None if b is None else b.grad


SHAPES = [(1, 37, 24), (3, 1000, 64), (200, 1000, 64), (130, 4099, 33)]


@pytest.mark.parametrize("chunk,columns", [(None, None), (TILE, SLICE), (2 * TILE, 3 * SLICE)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_equals_unfused_bitwise(device, dtype, shape, chunk, columns, monkeypatch):
    """Every output and gradient is the unfused pair's, bit for bit, whatever the forward's chunk
    size and the backward's vocabulary slice width (one slice, several, a last partial one whose
    rows are not 16-byte aligned), with and without bias, entropy term and temperature."""
    if chunk is not None:
        monkeypatch.setenv(CHUNK_ENV, str(chunk))
        monkeypatch.setenv(SLICE_ENV, str(columns))
    tokens, vocab, width = shape
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=tokens + vocab)
    cot = (randn(tokens, dtype=torch.float32, device=device, seed=1),
           randn(tokens, dtype=torch.float32, device=device, seed=2))
    for b, temperature, use_entropy in ((bias, 0.8, True), (None, 1.0, False), (bias, 1.0, False), (None, 1.3, True)):
        fused = _run(True, hidden, weight, b, targets, temperature, use_entropy, cot)
        unfused = _run(False, hidden, weight, b, targets, temperature, use_entropy, cot)
        for name, x, y in zip(("logprob", "entropy", "d hidden", "d weight", "d bias"), fused, unfused):
            assert (x is None and y is None) or torch.equal(x, y), name


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["sm90", "sm80", "simt"])
@pytest.mark.parametrize("tokens", [40, 200], ids=["decode-tiles", "large-tiles"])
def test_vocabulary_slices_on_every_gemm_path(path, tokens, monkeypatch):
    """On each GPU GEMM family: d hidden continued through vocabulary slices from an fp32
    accumulator, and the weight gradient written in bf16 by its GEMM (autograd), are the unfused
    pair's bits (the GEMM configurations differ below and above 64 tokens)."""
    from test_linear import _gpu_paths
    if path not in _gpu_paths():
        pytest.skip(f"{path} cannot run on this device")
    monkeypatch.setenv("RL_ENGINE_EXT_LINEAR_PATH", path)
    monkeypatch.setenv(SLICE_ENV, str(2 * SLICE))
    hidden, weight, bias, targets = _problem(tokens, 1000, 136, torch.bfloat16, "cuda", seed=tokens)
    cot = (randn(tokens, dtype=torch.float32, device="cuda", seed=1),
           randn(tokens, dtype=torch.float32, device="cuda", seed=2))
    fused = _run(True, hidden, weight, bias, targets, 0.9, True, cot)
    unfused = _run(False, hidden, weight, bias, targets, 0.9, True, cot)
    for name, x, y in zip(("logprob", "entropy", "d hidden", "d weight", "d bias"), fused, unfused):
        assert torch.equal(x, y), name


def test_chunk_sizes_chain_the_weight_gradient(device, dtype, monkeypatch):
    """The backward op's fp32 sums are the same bits for any chunk size and when the tokens come
    in micro-batches of multiples of LINEAR_GRAD_TILE_TOKENS through dweight_accum / dbias_accum."""
    tokens, vocab, width = 5 * TILE + 7, 300, 48
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=3)
    g = randn(tokens, dtype=torch.float32, device=device, seed=4)
    gh = randn(tokens, dtype=torch.float32, device=device, seed=5)
    _, ent, lse = torch.ops.rl_align.linear_logprob(hidden, weight, targets, bias, 1.0, IGNORE)
    whole = rl_engine_ext.linear_logprob_backward(g, gh, hidden, weight, bias, targets, ent, lse)
    for columns in (SLICE, 3 * SLICE):
        monkeypatch.setenv(SLICE_ENV, str(columns))
        got = rl_engine_ext.linear_logprob_backward(g, gh, hidden, weight, bias, targets, ent, lse)
        assert all(torch.equal(a, b) for a, b in zip(got, whole))
        # Rounded to the parameters' dtypes by the op: the fp32 sums rounded once.
        _, dw, db = rl_engine_ext.linear_logprob_backward(g, gh, hidden, weight, bias, targets, ent, lse,
                                                          fp32_param_grads=False)
        assert dw.dtype == dtype and torch.equal(dw, whole[1].to(dtype)) and torch.equal(db, whole[2].to(dtype))
    monkeypatch.delenv(SLICE_ENV)
    for micro in (TILE, 2 * TILE):
        dw = db = None
        dh = []
        for s in range(0, tokens, micro):
            part = slice(s, s + micro)
            h_part, dw, db = rl_engine_ext.linear_logprob_backward(
                g[part], gh[part], hidden[part], weight, bias, targets[part], ent[part], lse[part],
                dweight_accum=dw, dbias_accum=db)
            dh.append(h_part)
        assert torch.equal(torch.cat(dh), whole[0]) and torch.equal(dw, whole[1]) and torch.equal(db, whole[2])


def test_bad_chunk_size_is_an_error(device, monkeypatch):
    hidden, weight, _, targets = _problem(4, 16, 8, torch.float32, device)
    for bad in ("63", "0", "-64", "abc"):
        monkeypatch.setenv(CHUNK_ENV, bad)
        with pytest.raises(ValueError, match="RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS must be a positive multiple of 64"):
            rl_engine_ext.linear_logprob(hidden, weight, targets)
    monkeypatch.delenv(CHUNK_ENV)
    h = hidden.clone().requires_grad_()
    lp = rl_engine_ext.linear_logprob(h, weight, targets)
    for bad in ("32", "0", "x"):
        monkeypatch.setenv(SLICE_ENV, bad)
        with pytest.raises(ValueError, match="RL_ENGINE_EXT_LINEAR_LOGPROB_SLICE_COLUMNS must be a positive multiple of 64"):
            lp.sum().backward(retain_graph=True)


def test_slice_width_rule():
    """The backward's slice: logits of at most LINEAR_LOGPROB_CHUNK_ELEMENTS, a multiple of 64
    columns, at least one unit; the native constant is the Python one."""
    assert rl_engine_ext.LINEAR_LOGPROB_SLICE_COLUMNS == SLICE == 64
    assert llp_mod.linear_logprob_slice_columns(4096) == 32768
    assert llp_mod.linear_logprob_slice_columns(16384) == 8192
    assert llp_mod.linear_logprob_slice_columns(3000) == (1 << 27) // 3000 // 64 * 64
    assert llp_mod.linear_logprob_slice_columns(1 << 30) == 64
    assert llp_mod.linear_logprob_slice_columns(0) == 1 << 27


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness (gradients and weight-gradient chaining)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(260, 1000, 64), (70, 4099, 33)], ids=lambda s: "x".join(map(str, s)))
def test_invariance_forward_gradients_and_chaining(device, dtype, shape, monkeypatch):
    monkeypatch.setenv(CHUNK_ENV, str(TILE))  # several chunks and slices in every layout
    monkeypatch.setenv(SLICE_ENV, str(2 * SLICE))
    rows, vocab, width = shape
    case = llp_mod.SPEC.invariance_case(device, dtype, rows=rows, vocab=vocab, width=width)
    report = testing.check_invariance(case.fn, case.rows, case.params, weight_grad_tile=case.weight_grad_tile,
                                      weight_grad_chain=case.weight_grad_chain, seed=rows)
    testing.assert_invariant(report)


# ------------------------------------------------------------------------------------------
# Axis-B, shapes, tied embeddings
# ------------------------------------------------------------------------------------------


def test_accuracy_against_fp32(device, dtype):
    hidden, weight, bias, targets = _problem(97, 3000, 128, dtype, device, seed=6)
    lp, ent = rl_engine_ext.linear_logprob(hidden, weight, targets, 0.9, True, bias)
    want_lp, want_ent = llp_mod.reference_forward_fp32(hidden, weight, targets, bias, 0.9)
    tol = contract.tolerance("linear_logprob", dtype)
    torch.testing.assert_close(lp, want_lp, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ent, want_ent, atol=tol.atol, rtol=tol.rtol)


def test_batched_hidden_and_empty(device, dtype):
    hidden, weight, bias, targets = _problem(6, 50, 16, dtype, device, seed=7)
    lp = rl_engine_ext.linear_logprob(hidden.view(2, 3, 16), weight, targets.view(2, 3), bias=bias)
    assert lp.shape == (2, 3) and torch.equal(lp.view(6), rl_engine_ext.linear_logprob(hidden, weight, targets, bias=bias))
    h0 = torch.empty(0, 16, dtype=dtype, device=device, requires_grad=True)
    w = weight.clone().requires_grad_()
    lp0, ent0 = rl_engine_ext.linear_logprob(h0, w, targets[:0], return_entropy=True)
    assert lp0.shape == (0,)
    (lp0.sum() + ent0.sum()).backward()
    assert h0.grad.shape == (0, 16) and not w.grad.any()


def test_tied_embedding_gradients_add(device, dtype):
    """A weight shared by the embedding and the LM head gets the sum of both gradients, as in the
    unfused model."""
    tokens, vocab, width = 70, 500, 32
    _, weight, _, targets = _problem(tokens, vocab, width, dtype, device, seed=8)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(9)).to(device)

    def run(fused):
        w = weight.clone().requires_grad_()
        h = rl_engine_ext.embedding(ids, w) * 1.5
        if fused:
            lp = rl_engine_ext.linear_logprob(h, w, targets)
        else:
            lp = rl_engine_ext.logprob(rl_engine_ext.linear(h, w), targets)
        lp.sum().backward()
        return lp.detach(), w.grad

    fused, unfused = run(True), run(False)
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
