"""attention: the fixed KV splits of ATTENTION_KV_SPLIT keys (decode == chunked prefill == prefill
bit for bit around the split boundaries, batch invariance and accuracy past them, the boundary
counted from the sequence's own position 0) and masked keys selected out (a NaN or Inf in a key
a row may not see changes none of its bits, forward and backward; the references too).
The rules: csrc/common/attention_problem.h."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract
from rl_engine_ext.ops import attention as attn

from conftest import DEVICES, device_with_forced_paths, randn
from test_attention import (
    FORCED_PATHS, PATH_ENV, _alone, _assert_equal, _cache, _check_padded, _packed, _padded, _run_varlen, _sequences,
)

SPLIT = rl_engine_ext.ATTENTION_KV_SPLIT
BLOCK = rl_engine_ext.ATTENTION_KV_BLOCK
# Below, at and above the first two split boundaries (4097 reaches split 2).
LENGTHS = [SPLIT - 1, SPLIT, SPLIT + 1, SPLIT + 52, 2 * SPLIT + 1]

device = device_with_forced_paths(PATH_ENV, FORCED_PATHS)


def _heads(device: str):
    """(Hq, Hkv, D): two kv heads and D 64 keep the long CPU runs cheap; the GPU runs Qwen3-8B's
    32/8 heads and head_dim 128."""
    return (32, 8, 128) if device == "cuda" else (4, 2, 64)


def _long_case(device: str, dtype: torch.dtype):
    """The LENGTHS sequences, each one's prefill alone (out, lse) on the attention path in force,
    and the KV cache holding them."""
    return _long_case_on_path(device, dtype, os.environ.get(PATH_ENV))


@functools.lru_cache(maxsize=1)
def _long_case_on_path(device: str, dtype: torch.dtype, path: str | None):
    seqs = _sequences(LENGTHS, *_heads(device), dtype, device, seed=77)
    return seqs, _alone(seqs, grad=False), _cache(seqs, max(LENGTHS))


def _kvcache_rows(q, k_cache, v_cache, i, start, n):
    """Positions start .. start+n-1 of sequence i from the cache (its length start+n): out [n, Hq, D],
    lse [Hq, n]."""
    qc = q[start : start + n].transpose(0, 1).unsqueeze(0)
    lens = torch.tensor([start + n], dtype=torch.int32, device=q.device)
    out, lse = rl_engine_ext.attention_kvcache(qc, k_cache[i : i + 1], v_cache[i : i + 1], lens, return_lse=True)
    return out[0].transpose(0, 1), lse[0]


# ------------------------------------------------------------------------------------------
# Axis-A around the split boundaries: decode, chunked prefill, packing, padding
# ------------------------------------------------------------------------------------------


def test_constants():
    assert SPLIT == 2048 and SPLIT % BLOCK == 0


def test_decode_around_split_boundaries_equals_prefill(device, dtype):
    """Decode of every position within 20 of a split boundary (a query tile straddles it), and one
    batched decode of every sequence's last position: the prefill rows, bit for bit."""
    seqs, alone, (k_cache, v_cache) = _long_case(device, dtype)
    for i, (q, *_rest) in enumerate(seqs):
        n = q.shape[0]
        for boundary in range(SPLIT, n + 20, SPLIT):
            for pos in range(max(0, boundary - 20), min(n, boundary + 20)):
                out, lse = _kvcache_rows(q, k_cache, v_cache, i, pos, 1)
                _assert_equal(out, alone[i][0][pos : pos + 1], f"seq {i} decode at {pos} out")
                _assert_equal(lse, alone[i][1][:, pos : pos + 1], f"seq {i} decode at {pos} lse")
    q = torch.stack([s[0][-1:].transpose(0, 1) for s in seqs])  # [B, Hq, 1, D]
    lens = torch.tensor(LENGTHS, device=device)
    out, lse = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True)
    for i, n in enumerate(LENGTHS):
        _assert_equal(out[i, :, 0], alone[i][0][n - 1], f"batched decode seq {i} out")
        _assert_equal(lse[i, :, 0], alone[i][1][:, n - 1], f"batched decode seq {i} lse")


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_across_split_boundaries(device, dtype, chunk):
    """Chunks ending before, at and after a split boundary, one straddling it, one starting at it:
    each row equals its prefill row, bit for bit."""
    seqs, alone, (k_cache, v_cache) = _long_case(device, dtype)
    for i, (q, *_rest) in enumerate(seqs):
        n = q.shape[0]
        for boundary in range(SPLIT, n + chunk, SPLIT):
            starts = {boundary - 2 * chunk, boundary - chunk, boundary - chunk // 2 - 1, boundary, boundary + chunk // 2}
            for start in sorted(s for s in starts if 0 <= s < n):
                m = min(chunk, n - start)
                out, lse = _kvcache_rows(q, k_cache, v_cache, i, start, m)
                _assert_equal(out, alone[i][0][start : start + m], f"seq {i} chunk at {start} out")
                _assert_equal(lse, alone[i][1][:, start : start + m], f"seq {i} chunk at {start} lse")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_and_padded_across_a_split_equal_alone(device, dtype, causal):
    """Sequences crossing a split boundary next to a short one, packed and padded (left, right and
    in the middle): out, lse and gradients equal each one's batch-of-one run."""
    hq, hkv, d = _heads(device)
    lengths = [SPLIT + 1, 70, SPLIT + 52] if causal else [SPLIT + 52, 70]
    seqs = _sequences(lengths, hq, hkv, d, dtype, device, seed=5)
    alone = _alone(seqs, causal)
    (q, k, v, dout), cu = _packed(seqs, device)
    out, lse, grads = _run_varlen(q, k, v, dout, cu, causal)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        _assert_equal(out[start:end], alone[i][0], f"packed out, seq {i}")
        _assert_equal(lse[:, start:end], alone[i][1], f"packed lse, seq {i}")
        for name, g, a in zip("qkv", grads, alone[i][2]):
            _assert_equal(g[start:end], a, f"packed d{name}, seq {i}")
    s_max = max(lengths) + 3
    firsts = [s_max - lengths[0], 0, 1][: len(lengths)]
    _check_padded(seqs, alone, s_max, firsts, causal, f"padded at {firsts}")


# ------------------------------------------------------------------------------------------
# The splits' arithmetic: where the boundary is, and accuracy past it (Axis-B)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)  # float32: not on a forced path
def test_split_boundary_is_counted_from_the_sequence_start(device):
    """One leading block of keys that no real query weighs (their probabilities underflow to exact
    zeros) changes no bit of a single recurrence, only where the split boundary falls in the
    content. Rows whose keys lie in one split either way are therefore bitwise equal with and
    without that block; rows from SPLIT - BLOCK on merge different partials, and some of their
    bits differ (fp32: lower dtypes round the merge's last-bit differences away)."""
    hq, hkv, d = _heads(device)
    n = SPLIT + 256
    q, k, v = (randn(n, h, d, dtype=torch.float32, device=device, seed=40 + j) for j, h in enumerate((hq, hkv, hkv)))
    q[..., -1] = 1.0
    k[..., -1] = 0.0
    dead_k = torch.zeros(BLOCK, hkv, d, device=device)
    dead_k[..., -1] = -10000.0  # score -10000 * scale: exp underflows to 0 against any real key
    dead_q, dead_v = (randn(BLOCK, h, d, dtype=torch.float32, device=device, seed=50 + j) for j, h in enumerate((hq, hkv)))
    one = torch.tensor([0, n], dtype=torch.int32, device=device)
    shifted = torch.tensor([0, n + BLOCK], dtype=torch.int32, device=device)
    out, lse = rl_engine_ext.attention_varlen(q, k, v, one, return_lse=True)
    s_out, s_lse = rl_engine_ext.attention_varlen(torch.cat([dead_q, q]), torch.cat([dead_k, k]), torch.cat([dead_v, v]),
                                                  shifted, return_lse=True)
    s_out, s_lse = s_out[BLOCK:], s_lse[:, BLOCK:]
    one_split = SPLIT - BLOCK
    _assert_equal(s_out[:one_split], out[:one_split], "rows in one split either way: out")
    _assert_equal(s_lse[:, :one_split], lse[:, :one_split], "rows in one split either way: lse")
    assert not torch.equal(s_out[one_split:], out[one_split:]), "the split boundary did not move with the content"


@pytest.mark.gpu_memory_heavy  # the fp32 truth holds [Hq, 4100, 4100] scores
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_accuracy_across_splits_vs_fp32(device, dtype, causal):
    """Rows merging two and three splits are within the Axis-B tolerance of the fp32 truth, out
    and lse; gradients (which recompute P from the merged lse) across one boundary too."""
    hq, hkv, d = _heads(device)
    s = 2 * SPLIT + 4
    q, k, v = (randn(1, h, s, d, dtype=dtype, device=device, seed=60 + j) for j, h in enumerate((hq, hkv, hkv)))
    out, lse = rl_engine_ext.attention(q, k, v, causal=causal, return_lse=True)
    truth, truth_lse = attn.reference_forward_fp32(q, k, v, causal=causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.float(), truth, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(lse, truth_lse, atol=1e-4 if dtype == torch.float32 else 2e-3, rtol=1e-4)

    s = SPLIT + 100
    q, k, v = (t[:, :, :s] for t in (q, k, v))
    dout = randn(1, hq, s, d, dtype=dtype, device=device, seed=69)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rl_engine_ext.attention(*leaves, causal=causal).backward(dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    attn.reference_forward_fp32(*ref_leaves, causal=causal)[0].backward(dout.float())
    gtol = contract.tolerance("attention", dtype, "gradient")
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(got.grad.float(), ref.grad, atol=gtol.atol, rtol=gtol.rtol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


# ------------------------------------------------------------------------------------------
# Non-finite values in masked keys
# ------------------------------------------------------------------------------------------

NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _poisoned(seq, positions, value, where):
    """seq (q, k, v, dout) with `value` in every fifth element of the keys at `positions`, in k
    and/or v."""
    q, k, v, dout = seq
    k, v = k.clone(), v.clone()
    for name, t in (("k", k), ("v", v)):
        if name in where:
            for pos in positions:
                t[pos, :, ::5] = value
    return q, k, v, dout


def _check_earlier_rows(seqs, poisoned, cut, what, decode_positions=()):
    """Sequence 0 of `poisoned` holds non-finite keys from position `cut` on, the others are those
    of `seqs`. Packed: sequence 0's rows before `cut` (out, lse, dq) equal those of the finite run,
    the other sequences (out, lse, dq, dk, dv) their batch-of-one runs; decode of sequence 0 at
    `decode_positions` (< cut, its cache holding the non-finite keys) equals its prefill rows."""
    alone = _alone(seqs)
    (q, k, v, dout), cu = _packed(poisoned, seqs[0][0].device)
    out, lse, grads = _run_varlen(q, k, v, dout, cu)
    _assert_equal(out[:cut], alone[0][0][:cut], f"{what}: out of the rows before the non-finite keys")
    _assert_equal(lse[:, :cut], alone[0][1][:, :cut], f"{what}: lse of the rows before the non-finite keys")
    _assert_equal(grads[0][:cut], alone[0][2][0][:cut], f"{what}: dq of the rows before the non-finite keys")
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if i == 0:
            continue
        _assert_equal(out[start:end], alone[i][0], f"{what}: out of seq {i} next to them")
        _assert_equal(lse[:, start:end], alone[i][1], f"{what}: lse of seq {i} next to them")
        for name, g, a in zip("qkv", grads, alone[i][2]):
            _assert_equal(g[start:end], a, f"{what}: d{name} of seq {i} next to them")
    k_cache, v_cache = _cache(poisoned[:1], poisoned[0][0].shape[0])
    for pos in decode_positions:
        d_out, d_lse = _kvcache_rows(poisoned[0][0], k_cache, v_cache, 0, pos, 1)
        _assert_equal(d_out, out[pos : pos + 1], f"{what}: decode at {pos} out")
        _assert_equal(d_lse, lse[:, pos : pos + 1], f"{what}: decode at {pos} lse")
    return alone


@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("value", list(NON_FINITE), ids=list(NON_FINITE))
def test_non_finite_future_keys_change_no_earlier_row(device, dtype, value, where):
    """NaN / +Inf / -Inf in keys after row 69 (in row 69's 64-key block and in later blocks): rows
    0..69 get the bits of a run where those keys are finite (out, lse, dq), also as a chunk whose
    cache holds the keys (causally masked) and in decode; a sequence packed or padded next to them
    is untouched (out, lse, dq, dk, dv); the references give the earlier rows finite too."""
    hq, hkv, d = _heads(device)
    cut = BLOCK + 6
    positions = [cut, cut + 1, cut + 20, 2 * BLOCK - 1, 2 * BLOCK + 2, 3 * BLOCK - 1]
    seqs = _sequences([3 * BLOCK, 37, 100], hq, hkv, d, dtype, device, seed=11)
    poisoned = [_poisoned(seqs[0], positions, NON_FINITE[value], where)] + seqs[1:]
    alone = _check_earlier_rows(seqs, poisoned, cut, f"{value} in {where}", decode_positions=range(BLOCK - 8, cut))
    # A chunk of 16 queries from the block's start, its cache holding the keys up to its end.
    k_cache, v_cache = _cache(poisoned[:1], 3 * BLOCK)
    out, lse = _kvcache_rows(poisoned[0][0], k_cache, v_cache, 0, BLOCK, 16)
    _assert_equal(out[: cut - BLOCK], alone[0][0][BLOCK:cut], f"{value} in {where}: chunk out")
    _assert_equal(lse[:, : cut - BLOCK], alone[0][1][:, BLOCK:cut], f"{value} in {where}: chunk lse")

    # Padded: the non-finite sequence and finite ones, padding rows holding the value too.
    s_max = 3 * BLOCK + 5
    firsts = [2, s_max - 37, 0]
    (pq, pk, pv, pdout), mask = _padded(poisoned, s_max, firsts)
    for t in (pq, pk, pv):
        t.masked_fill_(~mask[:, None, :, None], NON_FINITE[value])
    pq, pk, pv = (t.detach().requires_grad_() for t in (pq, pk, pv))
    pout, plse = rl_engine_ext.attention(pq, pk, pv, mask, return_lse=True)
    pout.backward(pdout)
    rows0 = slice(firsts[0], firsts[0] + cut)
    _assert_equal(pout[0, :, rows0].transpose(0, 1), alone[0][0][:cut], f"{value} in {where}: padded out")
    _assert_equal(plse[0, :, rows0], alone[0][1][:, :cut], f"{value} in {where}: padded lse")
    _assert_equal(pq.grad[0, :, rows0].transpose(0, 1), alone[0][2][0][:cut], f"{value} in {where}: padded dq")
    for i in (1, 2):
        rows = slice(firsts[i], firsts[i] + seqs[i][0].shape[0])
        _assert_equal(pout[i, :, rows].transpose(0, 1), alone[i][0], f"{value} in {where}: padded out, seq {i}")
        _assert_equal(plse[i, :, rows], alone[i][1], f"{value} in {where}: padded lse, seq {i}")
        for name, g, a in zip("qkv", (pq.grad, pk.grad, pv.grad), alone[i][2]):
            _assert_equal(g[i, :, rows].transpose(0, 1), a, f"{value} in {where}: padded d{name}, seq {i}")

    # The references (the fallback kernels): finite earlier rows, within the contract of the
    # finite run's native results.
    (q, k, v, dout), cu = _packed(poisoned, device)
    ref_out, ref_lse = attn.reference_varlen(q, k, v, cu)
    ref_dq = attn.reference_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu, None, d**-0.5, True)[0]
    tol = contract.tolerance("attention", dtype)
    gtol = contract.tolerance("attention", dtype, "gradient")
    torch.testing.assert_close(ref_out[:cut].float(), alone[0][0][:cut].float(), atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ref_lse[:, :cut], alone[0][1][:, :cut], atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ref_dq[:cut].float(), alone[0][2][0][:cut].float(), atol=gtol.atol, rtol=gtol.rtol)


def test_non_finite_keys_inside_a_later_split(device, dtype):
    """NaN in k and v of keys inside split 1, after rows that merge splits 0 and 1 (in the same
    block and query tile): those rows keep their bits, in prefill and in decode."""
    hq, hkv, d = _heads(device)
    cut = SPLIT + 12
    seqs = _sequences([SPLIT + 52, 70], hq, hkv, d, dtype, device, seed=21)
    poisoned = [_poisoned(seqs[0], [cut, cut + 1, SPLIT + 40, SPLIT + 51], float("nan"), "kv")] + seqs[1:]
    _check_earlier_rows(seqs, poisoned, cut, "nan past a split", decode_positions=range(SPLIT - 4, cut))
