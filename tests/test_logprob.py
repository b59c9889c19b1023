"""logprob: invariance (Axis-A) of log-probs, entropy and gradients, the vector and element paths,
accuracy (Axis-B) against torch.log_softmax in fp32, ignore_index, temperature, non-finite
locality, odd / empty / strided shapes, out-of-range targets. Registration, opcheck, compile and
bad input: tests/test_registry.py."""

from __future__ import annotations

import math

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import logprob as lp_mod

from conftest import assert_device_assert, randn

IGNORE = -100
# 1, 7, 1001: element path (V not a multiple of any 16-byte group); 4096, 32000: vector path;
# 8192 + 5: more than one GPU step (kFwdLoads * kFwdThreads * VEC elements) plus a tail.
VOCABS = [1, 7, 1001, 4096, 8197, 32000]


def _targets(rows: int, vocab: int, device: str, seed: int, ignored_every: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (rows,), generator=g)
    if ignored_every:
        t[::ignored_every] = IGNORE
    return t.to(device)


def _row_counts(device: str, vocab: int) -> list[int]:
    if device == "cuda":
        return [1, 3, 257, 2049] if vocab <= 32000 else [1, 65]
    return [1, 3, 67] if vocab <= 8197 else [1, 9]


def _with_grad(logits, targets, temperature=1.0, entropy=True, g=None, gh=None, ignore_index=IGNORE):
    """(logprob, entropy, grad_logits) through autograd (logits read in place: strides and
    alignment kept)."""
    x = logits.detach().requires_grad_()
    lp, ent = rl_engine_ext.logprob(x, targets, temperature, return_entropy=True, ignore_index=ignore_index)
    g = torch.ones_like(lp) if g is None else g
    outs, cots = ([lp, ent], [g, torch.ones_like(ent) if gh is None else gh]) if entropy else ([lp], [g])
    torch.autograd.backward(outs, cots)
    return lp.detach(), ent.detach(), x.grad


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", VOCABS)
def test_invariance_forward_and_gradients(device, dtype, vocab):
    """Each token's log-prob, entropy and d logits are bitwise independent of the batch."""
    for rows in _row_counts(device, vocab):
        logits = randn(rows, vocab, dtype=dtype, device=device, seed=rows + vocab, scale=4.0)
        targets = _targets(rows, vocab, device, seed=rows, ignored_every=5)
        report = testing.check_invariance(
            lambda x, t: rl_engine_ext.logprob(x, t, 0.7, return_entropy=True), [logits, targets], seed=rows)
        testing.assert_invariant(report)


@pytest.mark.cuda
def test_invariance_qwen_vocab_cuda(dtype):
    vocab, rows = 151936, 129
    logits = randn(rows, vocab, dtype=dtype, device="cuda", seed=1, scale=3.0)
    targets = _targets(rows, vocab, "cuda", seed=2, ignored_every=11)
    report = testing.check_invariance(lambda x, t: rl_engine_ext.logprob(x, t, return_entropy=True),
                                      [logits, targets], seed=3, chunk_sizes=(1, 64))
    testing.assert_invariant(report)


@pytest.mark.parametrize("vocab", [4096, 4099, 32000])
def test_vector_and_element_paths_agree(device, dtype, vocab):
    """A misaligned tensor (the GPU's element path) and a row-strided view (read in place) give
    the bits of the dense tensor (its 16-byte path where V allows), forward and backward."""
    rows = 33
    dense = randn(rows, vocab, dtype=dtype, device=device, seed=vocab, scale=3.0)
    targets = _targets(rows, vocab, device, seed=4, ignored_every=7)
    want = _with_grad(dense, targets, 0.9)
    misaligned = torch.empty(rows * vocab + 1, dtype=dtype, device=device)[1:].view(rows, vocab)
    misaligned.copy_(dense)
    strided = torch.empty(rows, vocab + 8, dtype=dtype, device=device)[:, :vocab]
    strided.copy_(dense)
    for view in (misaligned, strided):
        for a, b in zip(_with_grad(view, targets, 0.9), want):
            assert torch.equal(a, b)


def test_batched_shapes_and_int32_targets(device, dtype):
    logits = randn(2, 3, 50, dtype=dtype, device=device, seed=5, scale=2.0)
    t64 = _targets(6, 50, device, seed=6).view(2, 3)
    lp, ent = rl_engine_ext.logprob(logits, t64, return_entropy=True)
    assert lp.shape == (2, 3) and ent.shape == (2, 3) and lp.dtype == torch.float32
    flat = rl_engine_ext.logprob(logits.view(6, 50), t64.view(6))
    assert torch.equal(lp.view(6), flat)
    assert torch.equal(rl_engine_ext.logprob(logits, t64.int()), lp)


def test_empty_rows(device, dtype):
    logits = torch.empty(0, 10, dtype=dtype, device=device, requires_grad=True)
    targets = torch.empty(0, dtype=torch.long, device=device)
    lp, ent = rl_engine_ext.logprob(logits, targets, return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.shape == (0, 10)


# ------------------------------------------------------------------------------------------
# Semantics: ignore_index, temperature, entropy, gradients
# ------------------------------------------------------------------------------------------


def test_ignore_index(device, dtype):
    logits = randn(6, 40, dtype=dtype, device=device, seed=7, scale=3.0)
    targets = torch.tensor([3, IGNORE, 5, IGNORE, 0, 39], device=device)
    lp, ent, dx = _with_grad(logits, targets)
    ignored = targets == IGNORE
    assert not lp[ignored].any() and not ent[ignored].any() and not dx[ignored].any()
    assert (lp[~ignored] < 0).all() and (ent[~ignored] > 0).all()
    # a custom ignore_index; -100 is then an ordinary (out-of-range) target only where it appears
    t7 = torch.where(ignored, torch.full_like(targets, 7), targets)
    lp7 = rl_engine_ext.logprob(logits, t7, ignore_index=7)
    assert torch.equal(lp7[~ignored], lp[~ignored]) and not lp7[ignored].any()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_accuracy_against_fp32_log_softmax(device, dtype, temperature):
    """Axis-B: log-prob and entropy within the contract's logprob tolerance of fp32
    torch.log_softmax on the same (upcast) logits."""
    rows, vocab = 37, 32000
    logits = randn(rows, vocab, dtype=dtype, device=device, seed=8, scale=4.0)
    targets = _targets(rows, vocab, device, seed=9, ignored_every=6)
    lp, ent = rl_engine_ext.logprob(logits, targets, temperature, return_entropy=True)
    want_lp, want_ent = lp_mod.reference_forward_fp32(logits, targets, temperature)
    tol = contract.tolerance("logprob", dtype)
    torch.testing.assert_close(lp, want_lp, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ent, want_ent, atol=max(tol.atol, 1e-5), rtol=1e-5)
    # the kernels' own formulas in PyTorch (the fallback) agree closely too
    ref = lp_mod.reference_logprob(logits, targets, temperature)
    torch.testing.assert_close(lp, ref[0], atol=1e-5, rtol=0)


def test_accuracy_where_exp_rounding_adds_up(device):
    """Axis-B at V = 151936 on rows that make logprob_exp's argument rounding (relative |d| 2^-24
    per term) add up instead of averaging out: every logit but a few equal, at d = z - m where
    exp(d) still carries weight (so all V terms share one rounding error), large logits, a low
    temperature. fp32 log-prob and entropy stay within the contract's atol of float64."""
    vocab = 151936
    rows = []
    for gap in (0.0, 2.0, math.log(vocab) - 1.0, math.log(vocab), math.log(vocab) + 2.0, 20.0):
        row = torch.full((vocab,), 30.0 - gap)
        row[::9973] = 30.0  # a few maxima
        rows.append(row)
    rows.append(torch.linspace(-40.0, 40.0, vocab))
    logits = torch.stack(rows).to(device)
    targets = torch.tensor([0, 1, 7, 9973, 2, 5, vocab - 1], device=device)
    tol = contract.tolerance("logprob", torch.float32)
    for temperature in (1.0, 0.37):
        lp, ent = rl_engine_ext.logprob(logits, targets, temperature, return_entropy=True)
        want_lp, want_ent = lp_mod.reference_forward_fp32(logits, targets, temperature)
        torch.testing.assert_close(lp, want_lp, atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(ent, want_ent, atol=tol.atol, rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gradient_against_fp32_autograd(device, dtype, temperature):
    """d logits of g * logprob + gh * entropy vs autograd through fp32 log_softmax."""
    rows, vocab = 19, 1001
    logits = randn(rows, vocab, dtype=dtype, device=device, seed=10, scale=3.0)
    targets = _targets(rows, vocab, device, seed=11, ignored_every=4)
    g = randn(rows, dtype=torch.float32, device=device, seed=12)
    gh = randn(rows, dtype=torch.float32, device=device, seed=13)
    _, _, got = _with_grad(logits, targets, temperature, g=g, gh=gh)
    x = logits.detach().float().requires_grad_()
    want_lp, want_ent = lp_mod.reference_forward_fp32(x, targets, temperature)
    torch.autograd.backward([want_lp, want_ent], [g, gh])
    tol = contract.tolerance("logprob", dtype, "gradient")
    torch.testing.assert_close(got.float(), x.grad, atol=tol.atol, rtol=tol.rtol)
    # without the entropy term: d logits = g * (onehot - p) / T only
    _, _, got_lp_only = _with_grad(logits, targets, temperature, entropy=False, g=g)
    x.grad = None
    torch.autograd.backward([lp_mod.reference_forward_fp32(x, targets, temperature)[0]], [g])
    torch.testing.assert_close(got_lp_only.float(), x.grad, atol=tol.atol, rtol=tol.rtol)


def test_backward_op_matches_autograd(device, dtype):
    logits = randn(9, 300, dtype=dtype, device=device, seed=14, scale=3.0)
    targets = _targets(9, 300, device, seed=15, ignored_every=4)
    g = randn(9, dtype=torch.float32, device=device, seed=16)
    gh = randn(9, dtype=torch.float32, device=device, seed=17)
    _, _, dx = _with_grad(logits, targets, 0.8, g=g, gh=gh)
    _, ent, lse = torch.ops.rl_align.logprob(logits, targets, 0.8, IGNORE)
    assert torch.equal(rl_engine_ext.logprob_backward(g, gh, logits, targets, ent, lse, 0.8), dx)
    # lse is the row's log-sum-exp of the tempered logits (ignored rows too)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float() / 0.8, -1), atol=1e-5, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# Non-finite values stay in their row
# ------------------------------------------------------------------------------------------


def test_non_finite_logits_stay_in_their_row(device, dtype):
    rows, vocab = 8, 515
    logits = randn(rows, vocab, dtype=dtype, device=device, seed=18, scale=3.0)
    targets = _targets(rows, vocab, device, seed=19)
    clean = _with_grad(logits, targets)
    dirty = logits.clone()
    dirty[1, 17] = math.nan
    dirty[3, 200] = math.inf
    dirty[5] = -math.inf
    got = _with_grad(dirty, targets)
    others = [0, 2, 4, 6, 7]
    for a, b in zip(got, clean):
        assert torch.equal(a[others], b[others])
    for r in (1, 3, 5):
        assert torch.isnan(got[0][r]) and torch.isnan(got[1][r])


def test_masked_logits_are_excluded(device, dtype):
    """-inf logits (top-k / top-p masks) contribute nothing: the same results as the unmasked
    entries alone, finite log-prob, entropy and gradient (0 at the masked entries)."""
    vocab = 600
    logits = randn(4, vocab, dtype=dtype, device=device, seed=20, scale=3.0)
    keep = torch.zeros(vocab, dtype=torch.bool, device=device)
    keep[::3] = True
    masked = logits.masked_fill(~keep, -math.inf)
    targets = torch.tensor([0, 3, 297, 597], device=device)
    lp, ent, dx = _with_grad(masked, targets)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(dx).all()
    assert not dx[:, ~keep].any()
    sub_lp, sub_ent, _ = _with_grad(logits[:, keep], targets // 3)
    torch.testing.assert_close(lp, sub_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, sub_ent, atol=1e-5, rtol=1e-5)


def test_temperature_range(device, dtype):
    """Temperatures where float32(1 / T) is a normal number work up to both ends of the range (the
    T -> 0 and T -> inf limits: all mass on the row's max, or the uniform distribution over the
    unmasked entries); just outside, a ValueError where 1e-39 used to give NaN everywhere
    (issue 31). The refusals of every op are in the specs' bad inputs (tests/test_registry.py)."""
    vocab = 300
    logits = randn(4, vocab, dtype=dtype, device=device, seed=22, scale=0.1)  # |logit| < 1: z stays finite at T_min
    logits[:, ::3] = -math.inf
    top = logits.argmax(-1)
    lp, ent = rl_engine_ext.logprob(logits, top, lp_mod.MIN_TEMPERATURE, return_entropy=True)
    assert not lp.any() and not ent.any()
    lp, ent = rl_engine_ext.logprob(logits, top, lp_mod.MAX_TEMPERATURE, return_entropy=True)
    kept = vocab - len(range(0, vocab, 3))
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(kept)), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.full_like(ent, math.log(kept)), atol=1e-6, rtol=0)
    for temperature in (1e-39, math.nextafter(lp_mod.MIN_TEMPERATURE, 0.0), math.nextafter(lp_mod.MAX_TEMPERATURE, math.inf)):
        with pytest.raises(ValueError, match=r"rl_align::logprob: temperature must be in \[2.93874e-39, 8.50706e\+37\]"):
            rl_engine_ext.logprob(logits, top, temperature)


# ------------------------------------------------------------------------------------------
# Out-of-range targets
# ------------------------------------------------------------------------------------------


def test_out_of_range_targets_raise_on_cpu():
    logits = randn(5, 16, dtype=torch.float32, device="cpu", seed=21)
    for targets, first in ((torch.tensor([1, 2, 16, -1, 3]), 16), (torch.tensor([1, -3, 99, 0, 0], dtype=torch.int32), -3)):
        for fn in (rl_engine_ext.logprob, lp_mod.reference_logprob):
            with pytest.raises(IndexError, match=rf"rl_align::logprob: target {first} out of range for a vocabulary of 16"):
                fn(logits, targets)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["logprob", "logprob_backward"])
def test_out_of_range_targets_assert_on_cuda(op):
    """A device-side assert that names the op and prints the target (the context is lost
    afterwards, so it runs in a subprocess)."""
    call = ("rl_engine_ext.logprob(x, t)" if op == "logprob"
            else "rl_engine_ext.logprob_backward(z, None, x, t, z, z)")
    setup = ("x = torch.randn(3, 16, device='cuda', dtype=torch.bfloat16)\n"
             "t = torch.tensor([1, 99, 2], device='cuda')\n"
             "z = torch.zeros(3, device='cuda')\n")
    assert_device_assert(setup, call, f"rl_align::{op}: target 99 out of range for a vocabulary of 16")
