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


# ------------------------------------------------------------------------------------------
# The fused-gradient mode: cotangents declared at forward time
# ------------------------------------------------------------------------------------------


def _declared_run(hidden, weight, bias, targets, temperature, declared, incoming, ignore_index=IGNORE):
    """((logprob, entropy, d hidden, d weight, d bias), the backward's rl_align kernel launches) through autograd:
    linear_logprob with the cotangents ``declared`` (None: today's call, no declaration), then the
    backward with ``incoming`` (grad_logprob or None, grad_entropy or None)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    kwargs = {} if declared is None else {"grad_logprob": declared[0], "grad_entropy": declared[1]}
    lp, ent = rl_engine_ext.linear_logprob(h, w, targets, temperature, True, b, ignore_index, **kwargs)
    pairs = [(o, c) for o, c in zip((lp, ent), incoming) if c is not None]
    with rl_engine_ext.record_kernels() as ran:
        torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    return (lp.detach(), ent.detach(), h.grad, w.grad, None if b is None else b.grad), sum(ran.counts.values())


def _assert_same(got, want):
    """The same bits (-0.0 is not 0.0; a NaN equals the same NaN)."""
    for name, x, y in zip(("logprob", "entropy", "d hidden", "d weight", "d bias"), got, want):
        assert (x is None and y is None) or (x.dtype == y.dtype and x.shape == y.shape), name
        if x is not None:
            bits = torch.int16 if x.element_size() == 2 else torch.int32
            assert torch.equal(x.view(bits), y.view(bits)), name


@pytest.mark.parametrize("chunk", [None, TILE, 2 * TILE])
@pytest.mark.parametrize("shape", [(1, 37, 24), (130, 4099, 33), (200, 1000, 64)], ids=lambda s: "x".join(map(str, s)))
def test_fused_gradient_mode_is_the_unfused_flow_bitwise(device, dtype, shape, chunk, monkeypatch):
    """Declared cotangents that match: every output and gradient is today's forward + backward with
    those cotangents, bit for bit, and the backward runs no GEMM (the gradients come from the
    forward's 3 GEMMs a chunk: no rl_align kernel runs); with and without bias and entropy cotangent, ignored tokens,
    temperatures, one chunk or several (T not a multiple of 64)."""
    if chunk is not None:
        monkeypatch.setenv(CHUNK_ENV, str(chunk))
        monkeypatch.setenv(SLICE_ENV, str(3 * SLICE))  # the unfused backward in several slices
    tokens, vocab, width = shape
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=tokens + vocab)
    g = randn(tokens, dtype=torch.float32, device=device, seed=1)
    gh = randn(tokens, dtype=torch.float32, device=device, seed=2)
    for b, temperature, cot in ((bias, 0.8, (g, gh)), (None, 1.0, (g, None)), (bias, 1.0, (g, None)),
                                (None, 1.3, (g, gh)), (bias, 0.7, (None, gh))):
        want, _ = _declared_run(hidden, weight, b, targets, temperature, None, cot)
        got, backward_kernels = _declared_run(hidden, weight, b, targets, temperature, cot, cot)
        _assert_same(got, want)
        assert backward_kernels == 0


def test_fused_gradient_op_is_forward_then_backward(device, dtype, monkeypatch):
    """linear_logprob_fused_grad == linear_logprob + linear_logprob_backward, fp32 sums from
    accumulators or rounded to the parameters' dtypes, for every chunk size; micro-batches of whole
    tiles chain through dweight_accum / dbias_accum."""
    tokens, vocab, width = 3 * TILE + 5, 300, 40
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=11)
    g = randn(tokens, dtype=torch.float32, device=device, seed=12)
    gh = randn(tokens, dtype=torch.float32, device=device, seed=13)
    accums = (randn(vocab, width, dtype=torch.float32, device=device, seed=14),
              randn(vocab, dtype=torch.float32, device=device, seed=15))
    for chunk in (None, TILE, 2 * TILE):
        if chunk is not None:
            monkeypatch.setenv(CHUNK_ENV, str(chunk))
        for b, e, acc, fp32 in ((bias, gh, (None, None), True), (bias, None, accums, True), (None, gh, (accums[0], None), True),
                                (bias, gh, (None, None), False), (None, None, (None, None), False)):
            _, ent_b, lse_b = torch.ops.rl_align.linear_logprob(hidden, weight, targets, b, 0.9, IGNORE)
            want = rl_engine_ext.linear_logprob_backward(g, e, hidden, weight, b, targets, ent_b, lse_b, 0.9, IGNORE,
                                                         *acc, fp32)
            got = rl_engine_ext.linear_logprob_fused_grad(hidden, weight, targets, g, e, b, 0.9, IGNORE, *acc, fp32)
            fwd = torch.ops.rl_align.linear_logprob(hidden, weight, targets, b, 0.9, IGNORE)
            assert all(torch.equal(x, y) for x, y in zip(got[:3], fwd))
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(got[3:], want))
    dw = db = None
    dh = []
    for s in range(0, tokens, 2 * TILE):
        part = slice(s, s + 2 * TILE)
        out = rl_engine_ext.linear_logprob_fused_grad(hidden[part], weight, targets[part], g[part], gh[part], bias,
                                                      0.9, IGNORE, dw, db)
        dh.append(out[3])
        dw, db = out[4], out[5]
    whole = rl_engine_ext.linear_logprob_fused_grad(hidden, weight, targets, g, gh, bias, 0.9, IGNORE)
    assert torch.equal(torch.cat(dh), whole[3]) and torch.equal(dw, whole[4]) and torch.equal(db, whole[5])


def test_fused_gradient_mode_mismatch_runs_the_backward(device, dtype, monkeypatch):
    """Incoming cotangents that differ from the declared ones in any bit (a value, -0.0 for 0.0, an
    entropy gradient declared but unused or used but undeclared) give the unfused results with the
    incoming cotangents, through the ordinary backward."""
    monkeypatch.setenv(CHUNK_ENV, str(TILE))
    tokens, vocab, width = 150, 500, 32
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=21)
    g = randn(tokens, dtype=torch.float32, device=device, seed=22)
    gh = randn(tokens, dtype=torch.float32, device=device, seed=23)
    g_other = g.clone()
    g_other[77] += 1.0
    zeros, minus_zeros = torch.zeros_like(g), -torch.zeros_like(g)
    for declared, incoming in (((g, gh), (g_other, gh)), ((g, gh), (g, g_other)), ((g, gh), (g, None)),
                               ((g, None), (g, gh)), ((minus_zeros, gh), (None, gh)), ((zeros, None), (minus_zeros, None))):
        want, _ = _declared_run(hidden, weight, bias, targets, 0.9, None, incoming)
        got, backward_kernels = _declared_run(hidden, weight, bias, targets, 0.9, declared, incoming)
        _assert_same(got, want)
        assert backward_kernels > 0
    # An unused logprob sends back zeros: a declared +0 gradient matches.
    want, _ = _declared_run(hidden, weight, bias, targets, 0.9, None, (None, gh))
    got, backward_kernels = _declared_run(hidden, weight, bias, targets, 0.9, (zeros, gh), (None, gh))
    _assert_same(got, want)
    assert backward_kernels == 0


def test_fused_gradient_mode_nan_token_stays_in_its_row(device, dtype, monkeypatch):
    """A NaN in one token's hidden changes no other token's logprob, entropy or d hidden."""
    monkeypatch.setenv(CHUNK_ENV, str(TILE))
    tokens, vocab, width = 140, 300, 32
    hidden, weight, _, targets = _problem(tokens, vocab, width, dtype, device, seed=31)
    g = randn(tokens, dtype=torch.float32, device=device, seed=32)
    bad = hidden.clone()
    bad[71, 5] = float("nan")  # not an ignored token (every 5th is)
    clean, _ = _declared_run(hidden, weight, None, targets, 1.0, (g, None), (g, None))
    dirty, _ = _declared_run(bad, weight, None, targets, 1.0, (g, None), (g, None))
    keep = torch.arange(tokens, device=device) != 71
    for x, y in zip(clean[:3], dirty[:3]):
        assert torch.equal(x[keep], y[keep])
    assert dirty[0][71].isnan() and dirty[2][71].isnan().any() and not clean[2].isnan().any()
    _assert_same(dirty, _declared_run(bad, weight, None, targets, 1.0, None, (g, None))[0])


def test_fused_gradient_mode_frozen_parameters_and_no_grad(device):
    """Only the gradients asked for come back; without a gradient the declaration is checked and
    the forward alone runs."""
    hidden, weight, bias, targets = _problem(70, 200, 16, torch.float32, device, seed=41)
    g = randn(70, dtype=torch.float32, device=device, seed=42)
    h = hidden.clone().requires_grad_()
    lp = rl_engine_ext.linear_logprob(h, weight, targets, bias=bias, grad_logprob=g)
    lp.backward(g)
    h2 = hidden.clone().requires_grad_()
    rl_engine_ext.linear_logprob(h2, weight, targets, bias=bias).backward(g)
    assert torch.equal(h.grad, h2.grad) and weight.grad is None
    with torch.no_grad():
        plain = rl_engine_ext.linear_logprob(h, weight, targets, grad_logprob=g)
        assert torch.equal(plain, rl_engine_ext.linear_logprob(h, weight, targets)) and not plain.requires_grad
        with pytest.raises(ValueError, match="rl_align::linear_logprob_fused_grad: grad_logprob shape"):
            rl_engine_ext.linear_logprob(h, weight, targets, grad_logprob=g[:3])


def test_fused_gradient_mode_bad_declarations(device):
    hidden, weight, _, targets = _problem(8, 16, 8, torch.float32, device, seed=51)
    h = hidden.clone().requires_grad_()
    g = torch.zeros(8, device=device)
    with pytest.raises(ValueError, match="rl_align::linear_logprob: grad_entropy is given but return_entropy=False"):
        rl_engine_ext.linear_logprob(h, weight, targets, grad_logprob=g, grad_entropy=g)
    for bad, match in ((g.double(), "grad_logprob must be torch.float32"), (g.bfloat16(), "grad_logprob must be"),
                       (g[:4], r"grad_logprob shape \[4\] differs"), (g.view(2, 4), "grad_logprob shape")):
        with pytest.raises(ValueError, match=match):
            rl_engine_ext.linear_logprob(h, weight, targets, grad_logprob=bad)
    with pytest.raises(ValueError, match="grad_entropy must be torch.float32"):
        rl_engine_ext.linear_logprob(h, weight, targets, return_entropy=True, grad_logprob=g, grad_entropy=g.half())
    if device == "cuda":
        with pytest.raises(RuntimeError, match="grad_logprob is on cpu"):
            rl_engine_ext.linear_logprob(h, weight, targets, grad_logprob=g.cpu())


def test_fused_gradient_mode_empty_and_batched(device, dtype):
    hidden, weight, bias, targets = _problem(6, 50, 16, dtype, device, seed=61)
    g = randn(2, 3, dtype=torch.float32, device=device, seed=62)
    for fused in (False, True):
        h = hidden.view(2, 3, 16).clone().requires_grad_()
        w = weight.clone().requires_grad_()
        kwargs = {"grad_logprob": g} if fused else {}
        rl_engine_ext.linear_logprob(h, w, targets.view(2, 3), bias=bias, **kwargs).backward(g)
        if fused:
            assert torch.equal(h.grad, want[0]) and torch.equal(w.grad, want[1])
        want = (h.grad, w.grad)
    h0 = torch.empty(0, 16, dtype=dtype, device=device, requires_grad=True)
    w = weight.clone().requires_grad_()
    g0 = torch.empty(0, device=device)
    lp0, ent0 = rl_engine_ext.linear_logprob(h0, w, targets[:0], return_entropy=True, grad_logprob=g0, grad_entropy=g0)
    (lp0.sum() + ent0.sum()).backward()
    assert h0.grad.shape == (0, 16) and w.grad.dtype == dtype and not w.grad.any()


def test_fused_gradient_mode_under_autocast():
    """The fused-gradient op has no autocast rule (its cotangents stay fp32): linear_logprob casts
    hidden, weight and bias as its own rule does, and gets the undeclared call's bits."""
    hidden, weight, bias, targets = _problem(40, 100, 16, torch.float32, "cpu", seed=71)
    g = randn(40, dtype=torch.float32, device="cpu", seed=72)
    outs = []
    for kwargs in ({}, {"grad_logprob": g}):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = rl_engine_ext.linear_logprob(h, w, targets, bias=b, **kwargs)
        lp.backward(g)
        outs.append((lp, h.grad, w.grad, b.grad))
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(*outs))


def test_fused_gradient_mode_chains_main_grad(device, dtype, monkeypatch):
    """rl_engine_ext.main_grad.linear_logprob with declared cotangents: micro-batches of whole tiles
    leave the main_grad bits of the undeclared calls (several chunks each), and a chain continued
    between a micro-batch's forward and backward (another micro-batch's backward first) is
    continued as it is, not overwritten with the stale sum."""
    from rl_engine_ext import main_grad

    monkeypatch.setenv(CHUNK_ENV, str(TILE))
    tokens, vocab, width = 4 * TILE + 9, 300, 24
    hidden, weight, bias, targets = _problem(tokens, vocab, width, dtype, device, seed=81)
    g = randn(tokens, dtype=torch.float32, device=device, seed=82)
    gh = randn(tokens, dtype=torch.float32, device=device, seed=83)
    parts = [slice(0, 2 * TILE), slice(2 * TILE, tokens)]

    def run(declare, interleave):
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        handle = main_grad.fp32_grad_accumulation(torch.nn.Module())
        try:
            for p in (w, b):
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
            dh, pending = [], []
            for part in parts:
                h = hidden[part].clone().requires_grad_()
                kwargs = {"grad_logprob": g[part], "grad_entropy": gh[part]} if declare else {}
                lp, ent = main_grad.linear_logprob(h, w, targets[part], 0.9, True, b, **kwargs)
                pending.append((h, lp, ent, part))
                if not interleave:
                    torch.autograd.backward([lp, ent], [g[part], gh[part]])
            for h, lp, ent, part in (reversed(pending) if interleave else ()):
                torch.autograd.backward([lp, ent], [g[part], gh[part]])
            dh = [h.grad for h, *_ in pending]
            assert w.grad is None and b.grad is None
            return dh, w.main_grad.clone(), b.main_grad.clone()
        finally:
            handle.revert()

    for interleave in (False, True):
        want, got = run(False, interleave), run(True, interleave)
        assert all(torch.equal(x, y) for x, y in zip(want[0], got[0]))
        assert torch.equal(want[1], got[1]) and torch.equal(want[2], got[2])


def test_fused_gradient_mode_surrogate_loss(device):
    """README's pattern: the cotangent computed from the sampler's log-probs (the trainer's bits)
    and a surrogate loss whose gradient is its bits: the stash is used, and the results are the
    undeclared call's."""
    hidden, weight, _, targets = _problem(100, 300, 32, torch.bfloat16, device, seed=91)
    adv = randn(100, dtype=torch.float32, device=device, seed=92)
    old = rl_engine_ext.linear_logprob(hidden, weight, targets) - 0.01
    sampler_logp = rl_engine_ext.linear_logprob(hidden, weight, targets)
    coef = -(adv * torch.exp(sampler_logp - old)) / 100
    grads = []
    for kwargs in ({}, {"grad_logprob": coef}):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = rl_engine_ext.linear_logprob(h, w, targets, **kwargs)
        with rl_engine_ext.record_kernels() as ran:
            (logp * coef).sum().backward()
        grads.append((h.grad, w.grad, sum(ran.counts.values())))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][2] > 0 and grads[1][2] == 0
