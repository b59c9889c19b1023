"""attention: invariance (Axis-A) across batch, padding, packing, chunked prefill and KV-cache
decode, forward and gradients; accuracy (Axis-B); every GPU path; odd and empty shapes.
Registration, opcheck, compile, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import attention as attn

from conftest import DEVICES, assert_device_assert, capture_cuda_graph, device_with_forced_paths, make_generator, randn

PATH_ENV = "RL_ENGINE_EXT_ATTENTION_PATH"
# The default path on an H100 (bf16/fp16, head_dim 64/128) is sm90; every test that crosses the
# decode/prefill configuration switch also runs with sm80 forced (on an A100 both are sm80).
FORCED_PATHS = ("sm80",)
device = device_with_forced_paths(PATH_ENV, FORCED_PATHS)


@pytest.fixture(params=("default",) + FORCED_PATHS)
def gpu_path(request, monkeypatch) -> None:
    """The attention path of a CUDA-only test: the default one, then each forced one."""
    if request.param != "default":
        monkeypatch.setenv(PATH_ENV, request.param)


def _config(device: str, dtype: torch.dtype):
    """(Hq, Hkv, D, sequence lengths) per device: lengths on both sides of the 64-key block and
    of the kernels' query tiles; the GPU runs Qwen3-8B's 32/8 heads and head_dim 128."""
    if device == "cuda":
        return 32, 8, 128, [1, 2, 17, 63, 64, 65, 127, 129, 200, 300]
    return 4, 2, 64, [1, 2, 17, 63, 64, 65, 100]


def _sequences(lengths, hq, hkv, d, dtype, device, seed=0):
    """Per sequence (q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, D], dout [L, Hq, D])."""
    out = []
    for i, n in enumerate(lengths):
        s = seed + 10 * i
        out.append(tuple(randn(n, h, d, dtype=dtype, device=device, seed=s + j) for j, h in enumerate((hq, hkv, hkv, hq))))
    return out


def _packed(seqs, device):
    cu = [0]
    for q, *_ in seqs:
        cu.append(cu[-1] + q.shape[0])
    cat = [torch.cat([s[j] for s in seqs]) for j in range(4)]
    return cat, torch.tensor(cu, dtype=torch.int32, device=device)


def _padded(seqs, s_max, firsts):
    """[B, H, S, D] tensors holding sequence i at rows firsts[i] .. (padding rows random, never
    zeros) and the [B, S] mask."""
    b = len(seqs)
    gen = make_generator(123)
    tensors, mask = [], torch.zeros(b, s_max, dtype=torch.bool)
    for j in range(4):
        ref = seqs[0][j]
        t = torch.randn(b, s_max, ref.shape[1], ref.shape[2], generator=gen).to(ref.dtype)
        if j == 3:
            t.zero_()  # padding rows get a zero cotangent
        t = t.to(ref.device)
        for i, s in enumerate(seqs):
            n, first = s[0].shape[0], firsts[i]
            t[i, first : first + n] = s[j]
            mask[i, first : first + n] = True
        tensors.append(t.transpose(1, 2))  # [B, H, S, D]: a strided view, as HF hands it over
    return tensors, mask.to(seqs[0][0].device)


def _run_varlen(q, k, v, dout, cu, causal=True, grad=True):
    q, k, v = (t.detach().requires_grad_(grad) for t in (q, k, v))
    out, lse = rl_engine_ext.attention_varlen(q, k, v, cu, causal=causal, return_lse=True)
    if not grad:
        return out, lse, None
    out.backward(dout)
    return out, lse, (q.grad, k.grad, v.grad)


def _alone(seqs, causal=True, grad=True):
    """Each sequence in a batch of its own: the expected bits."""
    res = []
    for q, k, v, dout in seqs:
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        res.append(_run_varlen(q, k, v, dout, cu, causal, grad))
    return res


def _assert_equal(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{what}: not bitwise equal (max diff {diff.max().item():.3g}, {int((diff > 0).sum())} elements)")


# ------------------------------------------------------------------------------------------
# Axis-A: packing, padding, batch of 1 (forward and gradients)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_and_padded_equal_alone(device, dtype, causal):
    hq, hkv, d, lengths = _config(device, dtype)
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    alone = _alone(seqs, causal)

    (q, k, v, dout), cu = _packed(seqs, device)
    out, lse, grads = _run_varlen(q, k, v, dout, cu, causal)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        a_out, a_lse, a_grads = alone[i]
        _assert_equal(out[start:end], a_out, f"packed out, seq {i}")
        _assert_equal(lse[:, start:end], a_lse, f"packed lse, seq {i}")
        for name, g, a in zip("qkv", grads, a_grads):
            _assert_equal(g[start:end], a, f"packed d{name}, seq {i}")

    s_max = max(lengths) + 3
    _check_padded(seqs, alone, s_max, [s_max - q.shape[0] for q, *_ in seqs], causal, "left-padded")
    _check_padded(seqs, alone, s_max, [0] * len(seqs), causal, "right-padded")


def _check_padded(seqs, alone, s_max, firsts, causal, what):
    """The padded op on the sequences placed at rows firsts[i] of their batch rows: each one's
    out, lse and gradients equal its batch-of-one run; padding rows get 0 out, -inf lse, 0 grads."""
    (pq, pk, pv, pdout), mask = _padded(seqs, s_max, firsts)
    pq, pk, pv = (t.detach().requires_grad_() for t in (pq, pk, pv))
    pout, plse = rl_engine_ext.attention(pq, pk, pv, mask, causal=causal, return_lse=True)
    pout.backward(pdout)
    for i, (q_i, *_rest) in enumerate(seqs):
        rows = slice(firsts[i], firsts[i] + q_i.shape[0])
        a_out, a_lse, a_grads = alone[i]
        _assert_equal(pout[i, :, rows].transpose(0, 1), a_out, f"{what} out, seq {i}")
        _assert_equal(plse[i, :, rows], a_lse, f"{what} lse, seq {i}")
        for name, g, a in zip("qkv", (pq.grad, pk.grad, pv.grad), a_grads):
            _assert_equal(g[i, :, rows].transpose(0, 1), a, f"{what} d{name}, seq {i}")
        pad = torch.ones(s_max, dtype=torch.bool, device=pout.device)
        pad[rows] = False
        assert torch.all(pout[i, :, pad] == 0) and torch.all(plse[i, :, pad] == float("-inf"))
        for g in (pq.grad, pk.grad, pv.grad):
            assert torch.all(g[i, :, pad] == 0), "padding rows must get zero gradients"


@pytest.mark.parametrize("seed", range(3))
def test_random_packing_and_padding(device, dtype, seed):
    """Random lengths, packing order and padding (each sequence's run of real tokens anywhere in
    its row): every sequence's out, lse and gradients equal its batch-of-one run."""
    rng = random.Random(seed)
    hq, hkv, d, lengths = _config(device, dtype)
    lens = [rng.randint(1, max(lengths)) for _ in range(rng.randint(2, 6))]
    seqs = _sequences(lens, hq, hkv, d, dtype, device, seed=1000 * (seed + 1))
    alone = _alone(seqs)

    order = rng.sample(range(len(seqs)), len(seqs))
    (q, k, v, dout), cu = _packed([seqs[i] for i in order], device)
    out, lse, grads = _run_varlen(q, k, v, dout, cu)
    for slot, i in enumerate(order):
        start, end = cu[slot].item(), cu[slot + 1].item()
        _assert_equal(out[start:end], alone[i][0], f"packed out, seq {i} in slot {slot}")
        _assert_equal(lse[:, start:end], alone[i][1], f"packed lse, seq {i} in slot {slot}")
        for name, g, a in zip("qkv", grads, alone[i][2]):
            _assert_equal(g[start:end], a, f"packed d{name}, seq {i} in slot {slot}")

    s_max = max(lens) + rng.randint(0, 40)
    firsts = [rng.randint(0, s_max - n) for n in lens]
    _check_padded(seqs, alone, s_max, firsts, True, f"padded at {firsts}")


def test_harness_over_the_batch_dimension(device, dtype):
    """The shared harness over dim 0 of the padded op: batch of 1, sub-batches, padding with
    other sequences, chunks, repeats, and per-sequence input gradients."""
    hq, hkv, d, _ = _config(device, dtype)
    b, s = 6, 70
    q, k, v = (randn(b, h, s, d, dtype=dtype, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv)))
    report = testing.check_invariance(lambda q, k, v: rl_engine_ext.attention(q, k, v), [q, k, v], chunk_sizes=(1, 4))
    testing.assert_invariant(report)


# ------------------------------------------------------------------------------------------
# Axis-A: chunked prefill and KV-cache decode vs prefill
# ------------------------------------------------------------------------------------------


def _cache(seqs, s_max):
    b, (q0, k0, _v0, _d0) = len(seqs), seqs[0]
    k_cache = torch.zeros(b, k0.shape[1], s_max, k0.shape[2], dtype=k0.dtype, device=k0.device)
    v_cache = torch.zeros_like(k_cache)
    for i, (_q, k, v, _d) in enumerate(seqs):
        k_cache[i, :, : k.shape[0]] = k.transpose(0, 1)
        v_cache[i, :, : v.shape[0]] = v.transpose(0, 1)
    return k_cache, v_cache


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_and_decode_equal_prefill(device, dtype, chunk):
    """Every position of every sequence, computed chunk by chunk from a KV cache (chunk 1 is
    decode), equals its row of the full prefill, bit for bit."""
    hq, hkv, d, lengths = _config(device, dtype)
    if device == "cpu" and chunk == 1:
        lengths = lengths[:5]
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    alone = _alone(seqs, grad=False)
    k_cache, v_cache = _cache(seqs, max(lengths) + 5)
    for i, (q, *_rest) in enumerate(seqs):
        n_total = q.shape[0]
        for start in range(0, n_total, chunk):
            n = min(chunk, n_total - start)
            qc = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            lens = torch.tensor([start + n], dtype=torch.int32, device=device)
            out, lse = rl_engine_ext.attention_kvcache(qc, k_cache[i : i + 1], v_cache[i : i + 1], lens, return_lse=True)
            _assert_equal(out[0].transpose(0, 1), alone[i][0][start : start + n], f"seq {i} chunk at {start} out")
            _assert_equal(lse[0], alone[i][1][:, start : start + n], f"seq {i} chunk at {start} lse")


def test_batched_decode_equals_prefill(device, dtype):
    """One decode step for a batch of sequences at different positions: each row equals that
    sequence's prefill row (other sequences in the batch change nothing)."""
    hq, hkv, d, lengths = _config(device, dtype)
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    alone = _alone(seqs, grad=False)
    k_cache, v_cache = _cache(seqs, max(lengths))
    q = torch.stack([s[0][-1:].transpose(0, 1) for s in seqs])  # the last position: [B, Hq, 1, D]
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    out, lse = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True)
    for i, n in enumerate(lengths):
        _assert_equal(out[i, :, 0], alone[i][0][n - 1], f"decode seq {i} out")
        _assert_equal(lse[i, :, 0], alone[i][1][:, n - 1], f"decode seq {i} lse")


def test_decode_without_host_validation(device, dtype):
    """validate=False (no host read of cache_seqlens): the same bits as validate=True, for decode
    and chunked prefill, int32 and int64 lengths; a bad length is still an error on the CPU."""
    hq, hkv, d, lengths = _config(device, dtype)
    lengths = [length for length in lengths if length >= 2]
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    k_cache, v_cache = _cache(seqs, max(lengths) + 3)
    for n in (1, 2):
        q = torch.stack([s[0][-n:].transpose(0, 1) for s in seqs])  # [B, Hq, n, D]
        for len_dtype in (torch.int32, torch.int64):
            lens = torch.tensor(lengths, dtype=len_dtype, device=device)
            want = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True)
            got = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True, validate=False)
            _assert_equal(got[0], want[0], f"n={n} {len_dtype} out")
            _assert_equal(got[1], want[1], f"n={n} {len_dtype} lse")
    if device == "cpu":
        bad = torch.tensor([lengths[0]] * (len(lengths) - 1) + [max(lengths) + 4], device=device)
        with pytest.raises(ValueError, match=r"cache_seqlens\[\d+\] = \d+ must be within \[0, \d+\] \(2 new tokens"):
            rl_engine_ext.attention_kvcache(q, k_cache, v_cache, bad, validate=False)


@pytest.mark.parametrize("n", [1, 7])
def test_left_padded_cache_read_in_place(device, dtype, n):
    """cache_starts: each sequence's keys start at its own cache position (Hugging Face keeps a
    batch's left padding inside the cache). Decode and chunked prefill from such a cache equal the
    unpadded cache's rows bit for bit, validate=True and False, int32 and int64; the padding
    positions (random values here, never read) and a start that does not fit are errors."""
    hq, hkv, d, lengths = _config(device, dtype)
    lengths = [length for length in lengths if length >= n]
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    s_max = max(lengths) + 9
    k_plain, v_plain = _cache(seqs, s_max)
    starts = [s_max - length - (i % 3) for i, length in enumerate(lengths)]  # left padding, some slack at the end
    gen = make_generator(5)
    k_left = torch.randn(k_plain.shape, generator=gen).to(dtype=dtype, device=device)
    v_left = torch.randn(v_plain.shape, generator=gen).to(dtype=dtype, device=device)
    for i, (first, length) in enumerate(zip(starts, lengths)):
        k_left[i, :, first : first + length] = k_plain[i, :, :length]
        v_left[i, :, first : first + length] = v_plain[i, :, :length]
    q = torch.stack([s[0][-n:].transpose(0, 1) for s in seqs])  # [B, Hq, n, D]
    lens = torch.tensor(lengths, device=device)
    want = rl_engine_ext.attention_kvcache(q, k_plain, v_plain, lens, return_lse=True)
    for index_dtype in (torch.int32, torch.int64):
        for validate in (True, False):
            got = rl_engine_ext.attention_kvcache(q, k_left, v_left, lens.to(index_dtype), return_lse=True,
                                                  validate=validate, cache_starts=torch.tensor(starts, device=device))
            _assert_equal(got[0], want[0], f"n={n} {index_dtype} validate={validate} out")
            _assert_equal(got[1], want[1], f"n={n} {index_dtype} validate={validate} lse")
    bad = torch.tensor([s_max - lengths[0] + 1] + starts[1:], device=device)
    with pytest.raises(ValueError, match=r"cache_starts\[0\] = \d+ with cache_seqlens\[0\] = \d+ does not fit"):
        rl_engine_ext.attention_kvcache(q, k_left, v_left, lens, cache_starts=bad)
    if device == "cuda":
        assert_device_assert(
            f"q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16, device='cuda'); kv = torch.zeros(1, 2, 8, 64, "
            f"dtype=torch.bfloat16, device='cuda')\n",
            "rl_engine_ext.attention_kvcache(q, kv, kv, torch.tensor([4], device='cuda'), validate=False, "
            "cache_starts=torch.tensor([5], device='cuda'))",
            "cache_starts 5 out of range")


def test_chunk_starting_before_its_sequence(device, dtype):
    """A chunk of n > 1 queries with cache_seqlens[b] < n (chunked prefill of a left-padded batch:
    the sequence starts inside the chunk, or later): the sequence's own queries are its prefill
    rows bit for bit, the ones before its position 0 are padding (out 0, lse -inf); validate=True
    and False agree; decode (n = 1) still needs its token."""
    hq, hkv, d, lengths = _config(device, dtype)
    lengths = [length for length in lengths if length <= 64]
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    alone = _alone(seqs, grad=False)
    n = 64
    k_cache, v_cache = _cache(seqs, n + 3)
    q = torch.stack([torch.cat([torch.full((n - s[0].shape[0], hq, d), float("nan"), dtype=dtype, device=device),
                                s[0]]).transpose(0, 1) for s in seqs] + [seqs[0][0][:1].expand(n, hq, d).transpose(0, 1)])
    k_cache = torch.cat([k_cache, k_cache[:1]])
    v_cache = torch.cat([v_cache, v_cache[:1]])
    lens = torch.tensor(lengths + [0], device=device)  # the last row holds none of its sequence yet
    for validate in (True, False):
        out, lse = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True, validate=validate)
        for i, length in enumerate(lengths + [0]):
            if length:
                _assert_equal(out[i, :, n - length :].transpose(0, 1), alone[i][0], f"seq {i} out")
                _assert_equal(lse[i, :, n - length :], alone[i][1], f"seq {i} lse")
            assert torch.equal(out[i, :, : n - length], torch.zeros_like(out[i, :, : n - length])), f"seq {i} padding"
            assert bool(torch.all(lse[i, :, : n - length] == -math.inf)), f"seq {i} padding lse"
    with pytest.raises(ValueError, match=r"cache_seqlens\[\d+\] = 0 must be within \[1, "):
        rl_engine_ext.attention_kvcache(q[:, :, -1:], k_cache, v_cache, lens)


def test_packed_without_host_validation(device, dtype):
    """attention_varlen(validate=False) (cu_seqlens never read on the host): the same bits as
    validate=True, forward and backward, int32 and int64 cu_seqlens, max_seqlen exact or larger
    (a larger grid only idles); the CPU still checks the values."""
    hq, hkv, d, lengths = _config(device, dtype)
    seqs = _sequences(lengths, hq, hkv, d, dtype, device)
    (q, k, v, dout), cu = _packed(seqs, device)
    want_out, want_lse, want_grads = _run_varlen(q, k, v, dout, cu)
    for cu_dtype in (torch.int32, torch.int64):
        for max_seqlen in (max(lengths), max(lengths) + 70):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out, lse = rl_engine_ext.attention_varlen(qq, kk, vv, cu.to(cu_dtype), max_seqlen, return_lse=True,
                                                      validate=False)
            out.backward(dout)
            what = f"{cu_dtype} max_seqlen={max_seqlen}"
            _assert_equal(out, want_out, f"{what} out")
            _assert_equal(lse, want_lse, f"{what} lse")
            for name, g, w in zip("qkv", (qq.grad, kk.grad, vv.grad), want_grads):
                _assert_equal(g, w, f"{what} d{name}")
    if device == "cpu":
        with pytest.raises(ValueError, match=rf"has {max(lengths)} tokens, more than max_seqlen = {max(lengths) - 1}"):
            rl_engine_ext.attention_varlen(q, k, v, cu, max(lengths) - 1, validate=False)


@pytest.mark.cuda
@pytest.mark.usefixtures("gpu_path")
def test_packed_step_captured_in_a_cuda_graph():
    """attention_varlen(validate=False) forward and backward capture in a CUDA graph and, replayed
    with other sequence boundaries copied into the same cu_seqlens, give the eager bits."""
    dtype, device = torch.bfloat16, "cuda"
    hq, hkv, d, total, max_seqlen = 8, 2, 128, 2200, 2100
    q, k, v, dout = (randn(total, h, d, dtype=dtype, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv, hq)))
    cu = torch.tensor([0, 100, 2100, 2200], dtype=torch.int32, device=device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        out, lse = rl_engine_ext.attention_varlen(*leaves, cu, max_seqlen, return_lse=True, validate=False)
        grads = torch.autograd.grad(out, leaves, dout)
        return out, lse, grads

    graph, (out, lse, grads) = capture_cuda_graph(step)
    for bounds in ([0, 100, 2100, 2200], [0, 1, 2049, 2200], [0, 2100, 2101, 2200], [0, 0, 2100, 2200]):
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        graph.replay()
        want_out, want_lse, want_grads = _run_varlen(q, k, v, dout, cu)
        _assert_equal(out, want_out, f"replay {bounds} out")
        _assert_equal(lse, want_lse, f"replay {bounds} lse")
        for name, g, w in zip("qkv", grads, want_grads):
            _assert_equal(g, w, f"replay {bounds} d{name}")


@pytest.mark.cuda
@pytest.mark.parametrize("bounds, max_seqlen, message", [
    ([0, 5, 3, 8], 8, "the sequence length cu_seqlens[i+1] - cu_seqlens[i] = -2 out of range for 0 .. max_seqlen = 8"),
    ([0, 3, 8], 4, "the sequence length cu_seqlens[i+1] - cu_seqlens[i] = 5 out of range for 0 .. max_seqlen = 4"),
    ([1, 3, 8], 8, "cu_seqlens[0] = 1 out of range for packed sequences from 0"),
    ([0, 3, 7], 8, "cu_seqlens[-1] = 7 out of range for packed sequences ending at the token count 8"),
])
def test_bad_cu_seqlens_without_validation_is_a_device_assert(bounds, max_seqlen, message):
    setup = (f"q = torch.randn(8, 4, 64, device='cuda', dtype=torch.bfloat16)\n"
             f"cu = torch.tensor({bounds}, device='cuda', dtype=torch.int32)\n")
    assert_device_assert(setup, f"rl_engine_ext.attention_varlen(q, q, q, cu, {max_seqlen}, validate=False)",
                         f"rl_align::attention_varlen: {message}")


@pytest.mark.cuda
@pytest.mark.parametrize("n, s_max, replays", [
    (1, 300, ([5, 64, 65], [1, 300, 129], [200, 2, 63])),
    # lengths across the KV split boundaries (2048, 4096): splits on separate CTAs, then the combine
    (1, 4500, ([2048, 2049, 4500], [4097, 1, 2047], [4096, 300, 4099])),
    # a chunk of new tokens: the exact-recompute relaunch reads the status word the kernel resets
    (2, 4500, ([2, 2049, 4500], [4097, 3, 2048], [64, 4096, 2050])),
])
@pytest.mark.usefixtures("gpu_path")
def test_decode_step_captured_in_a_cuda_graph(n, s_max, replays):
    """A decode step with validate=False captures in a CUDA graph (no host synchronisation) and,
    replayed with other lengths copied into the same cache_seqlens tensor, gives the eager bits."""
    dtype, device = torch.bfloat16, "cuda"
    batch, hq, hkv, d = 3, 8, 2, 128
    q = randn(batch, hq, n, d, dtype=dtype, device=device, seed=1)
    k_cache = randn(batch, hkv, s_max, d, dtype=dtype, device=device, seed=2)
    v_cache = randn(batch, hkv, s_max, d, dtype=dtype, device=device, seed=3)
    lens = torch.tensor(replays[0], dtype=torch.int32, device=device)
    graph, (out, lse) = capture_cuda_graph(
        lambda: rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True, validate=False))
    for new in replays:
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        want = rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True)
        _assert_equal(out, want[0], f"replay {new} out")
        _assert_equal(lse, want[1], f"replay {new} lse")


@pytest.mark.cuda
def test_host_descriptor_ops_refuse_graph_capture():
    """Ops that read lengths or build descriptors on the host raise a clear error under capture
    (rather than a capture-invalidating host read or a replay of a stale host buffer)."""
    q = randn(1, 4, 8, 64, dtype=torch.bfloat16, device="cuda", seed=1)
    qp = q[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    lens = torch.tensor([8], device="cuda")
    calls = {
        "attention": lambda: rl_engine_ext.attention(q, q, q),
        "attention_varlen": lambda: rl_engine_ext.attention_varlen(qp, qp, qp, cu),
        "attention_kvcache": lambda: rl_engine_ext.attention_kvcache(q, q, q, lens),
    }
    for op, call in calls.items():
        call()  # eager: fine
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=rf"rl_align::{op} builds its sequence descriptors on the host "
                                               r"and cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph):
                call()
        torch.cuda.synchronize()


@pytest.mark.cuda
def test_bad_cache_length_without_validation_is_a_device_assert():
    setup = ("q = torch.randn(2, 4, 1, 64, device='cuda', dtype=torch.bfloat16)\n"
             "kc = torch.randn(2, 2, 16, 64, device='cuda', dtype=torch.bfloat16)\n"
             "lens = torch.tensor([3, 17], device='cuda')\n")
    assert_device_assert(setup, "rl_engine_ext.attention_kvcache(q, kc, kc, lens, validate=False)",
                         "rl_align::attention_kvcache: cache_seqlens 17 out of range for a cache of 16 positions")


def test_gradients_run_to_run_identical(device, dtype):
    hq, hkv, d, lengths = _config(device, dtype)
    seqs = _sequences(lengths[-3:], hq, hkv, d, dtype, device)
    (q, k, v, dout), cu = _packed(seqs, device)
    first = _run_varlen(q, k, v, dout, cu)[2]
    second = _run_varlen(q, k, v, dout, cu)[2]
    for name, a, b in zip("qkv", first, second):
        _assert_equal(a, b, f"d{name} run to run")


def test_cpu_result_independent_of_thread_count():
    """The CPU kernels hand whole row tiles to threads: 1 thread and several give the same bits."""
    seqs = _sequences([3, 65, 130], 4, 2, 64, torch.bfloat16, "cpu")
    (q, k, v, dout), cu = _packed(seqs, "cpu")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run_varlen(q, k, v, dout, cu)
        torch.set_num_threads(max(2, saved))
        many = _run_varlen(q, k, v, dout, cu)
    finally:
        torch.set_num_threads(saved)
    for name, a, b in zip(("out", "lse"), one[:2], many[:2]):
        _assert_equal(a, b, f"{name}, 1 thread vs {max(2, saved)}")
    for name, a, b in zip("qkv", one[2], many[2]):
        _assert_equal(a, b, f"d{name}, 1 thread vs {max(2, saved)}")


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the fp32 ground truth
# ------------------------------------------------------------------------------------------


def _gqa_cases(device):
    if device == "cuda":
        return [(32, 8, 128, 300), (8, 8, 64, 129), (4, 1, 80, 70)]  # head_dim 80: the simt path
    return [(4, 2, 64, 70), (2, 2, 1, 9), (3, 1, 33, 40)]


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("device", DEVICES)  # not on a forced path: case 2 (head_dim 80) runs on the FMA kernels only
def test_accuracy_vs_fp32(device, dtype, case, causal):
    hq, hkv, d, s = _gqa_cases(device)[case]
    b = 2
    q, k, v = (randn(b, h, s, d, dtype=dtype, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv)))
    mask = torch.ones(b, s, dtype=torch.bool, device=device)
    mask[1, : s // 3] = False  # left padding on the second sequence
    out, lse = rl_engine_ext.attention(q, k, v, mask, causal=causal, return_lse=True)
    truth, truth_lse = attn.reference_forward_fp32(q, k, v, mask, causal=causal)
    tol = contract.tolerance("attention", dtype)
    torch.testing.assert_close(out.float(), truth, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(lse, truth_lse, atol=1e-4 if dtype == torch.float32 else 2e-3, rtol=1e-4)

    dout = randn(b, hq, s, d, dtype=dtype, device=device, seed=9)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rl_engine_ext.attention(*leaves, mask, causal=causal).backward(dout)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = attn.reference_forward_fp32(*ref_leaves, mask, causal=causal)[0]
    ref_out.backward(dout.float())
    gtol = contract.tolerance("attention", dtype, "gradient")
    for name, got, ref in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(got.grad.float(), ref.grad, atol=gtol.atol, rtol=gtol.rtol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)  # float32: not on a forced path
def test_scale_argument(device):
    hq, hkv, d, _ = _config(device, torch.float32)
    q, k, v = (randn(1, h, 20, d, dtype=torch.float32, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv)))
    out = rl_engine_ext.attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out, attn.reference_forward_fp32(q, k, v, scale=0.3)[0], atol=1e-5, rtol=1e-5)
    assert not torch.equal(out, rl_engine_ext.attention(q, k, v))


# ------------------------------------------------------------------------------------------
# GPU paths
# ------------------------------------------------------------------------------------------


tensor_core_dtypes = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
# Packed lengths on both sides of the 64-key blocks, the query tiles and the KV splits (2048, 4096).
PATH_LENGTHS = [1, 63, 64, 65, 127, 129, 300, 2047, 2049, 4100]


def _on_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _default_and_sm80(monkeypatch, run):
    """run()'s results on the default path, then with sm80 forced."""
    monkeypatch.delenv(PATH_ENV, raising=False)
    default = run()
    monkeypatch.setenv(PATH_ENV, "sm80")
    return default, run()


def _assert_packed_default_is_sm80(monkeypatch, seqs, causal):
    """The sequences packed: out, lse, dq, dk and dv of the default path equal forced sm80's bit
    for bit."""
    (q, k, v, dout), cu = _packed(seqs, "cuda")
    default, sm80 = _default_and_sm80(monkeypatch, lambda: _run_varlen(q, k, v, dout, cu, causal))
    for name, got, want in zip(("out", "lse"), default[:2], sm80[:2]):
        _assert_equal(got, want, f"default path vs sm80: {name}")
    for name, got, want in zip("qkv", default[2], sm80[2]):
        _assert_equal(got, want, f"default path vs sm80: d{name}")


def _cuda_kernels(run) -> set[str]:
    """The names of the CUDA kernels run() launches (run once before, unprofiled: one-time setup
    stays out)."""
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["sm90", "sm80", "simt"])
def test_each_gpu_path(monkeypatch, path):
    """Each family forced: packed out and gradients equal each sequence's batch-of-one run, decode
    equals prefill, out is within the contract of the fp32 truth. sm90 runs on compute capability
    9.0 only: anywhere else forcing it is an error."""
    major, _ = torch.cuda.get_device_capability()
    if path == "sm80" and major < 8:
        pytest.fail("the sm80 path needs compute capability >= 8.0")
    monkeypatch.setenv(PATH_ENV, path)
    hq, hkv, d, lengths = 8, 2, 128, [1, 65, 130]
    seqs = _sequences(lengths, hq, hkv, d, torch.bfloat16, "cuda")
    (q, k, v, dout), cu = _packed(seqs, "cuda")
    if path == "sm90" and not _on_hopper():
        with pytest.raises(RuntimeError, match=rf"{PATH_ENV}=sm90.*cannot run"):
            rl_engine_ext.attention_varlen(q, k, v, cu)
        return
    alone = _alone(seqs)
    out, lse, grads = _run_varlen(q, k, v, dout, cu)
    k_cache, v_cache = _cache(seqs, 140)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        _assert_equal(out[start:end], alone[i][0], f"{path} packed out {i}")
        for name, g, a in zip("qkv", grads, alone[i][2]):
            _assert_equal(g[start:end], a, f"{path} packed d{name} {i}")
        qd = seqs[i][0][-1:].transpose(0, 1).unsqueeze(0)
        dec = rl_engine_ext.attention_kvcache(qd, k_cache[i : i + 1], v_cache[i : i + 1],
                                              torch.tensor([end - start], device="cuda"))
        _assert_equal(dec[0, :, 0], alone[i][0][-1], f"{path} decode {i}")
    truth = attn.reference_varlen(q, k, v, cu, fp32_out=True)[0]
    tol = contract.tolerance("attention", torch.bfloat16)
    torch.testing.assert_close(out.float(), truth, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.cuda
def test_default_path_is_sm90_on_hopper_else_sm80(monkeypatch):
    """bf16 head_dim 128 by default launches kernels that forced sm80 does not on compute
    capability 9.0 (the sm90 ones), and the same kernels elsewhere: the comparisons of the default
    path with forced sm80 below do not compare sm80 with itself on an H100."""
    seqs = _sequences([70, 300], 8, 2, 128, torch.bfloat16, "cuda")
    (q, k, v, dout), cu = _packed(seqs, "cuda")
    default, sm80 = _default_and_sm80(monkeypatch, lambda: _cuda_kernels(lambda: _run_varlen(q, k, v, dout, cu)))
    if _on_hopper():
        assert default - sm80, f"the default path launched only sm80's kernels: {sorted(default)}"
    else:
        assert default == sm80, f"default {sorted(default)} != sm80 {sorted(sm80)}"


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
@tensor_core_dtypes
def test_default_path_gives_the_sm80_bits_packed(monkeypatch, dtype, head_dim, causal):
    """Packed PATH_LENGTHS: out, lse, dq, dk and dv of the default path (sm90 on an H100, sm80
    elsewhere) equal those of forced sm80 bit for bit. The lengths put blocks on both sides of the
    sm90 forward's two block loops (blocks without a masked key, then those with): one block only
    (1, 63, 64), and unmasked blocks before masked ones (causal: every length past 64; full: those
    ending inside a block, 65 .. 4100). A masked block taken by the first loop would lose its mask
    and change the bits."""
    _assert_packed_default_is_sm80(monkeypatch, _sequences(PATH_LENGTHS, 8, 2, head_dim, dtype, "cuda"), causal)


@pytest.mark.cuda
@pytest.mark.parametrize("hq, hkv", [(28, 4), (6, 2), (4, 4)], ids=["group7", "group3", "group1"])
def test_default_path_gives_the_sm80_bits_for_any_group(monkeypatch, hq, hkv):
    """Query heads per kv head that do not divide a 64-row tile (7, 3) and one (MHA): the sm90
    kernels gather and write the GQA-packed rows (row = query * G + head) stepping from row to row
    without a division. out, lse, dq, dk and dv equal forced sm80's bit for bit (packed, causal,
    bf16 d128; a sequence past ORDERED_DQ_MAX_KV_LEN keys, so the dQ kernel's own Q and dO loads
    run too)."""
    seqs = _sequences([1, 37, 65, 300, 1100], hq, hkv, 128, torch.bfloat16, "cuda")
    _assert_packed_default_is_sm80(monkeypatch, seqs, True)


DQ_ENV = "RL_ENGINE_EXT_ATTENTION_DQ"


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
@tensor_core_dtypes
def test_sm90_ordered_dq_gives_the_recompute_bits(monkeypatch, dtype, head_dim, causal):
    """The sm90 backward's dQ by ordered turns of the key tiles (forced) equals the dQ
    kernel's recompute bit for bit, dK and dV too: packed PATH_LENGTHS (up to 33 key tiles waiting
    on each other, tails of 1..63 keys whose K rows are another sequence's) and a padded batch
    (padding rows random: read by no product)."""
    if not _on_hopper():
        pytest.skip("the ordered dQ is the sm90 path's (compute capability 9.0)")
    monkeypatch.delenv(PATH_ENV, raising=False)
    seqs = _sequences(PATH_LENGTHS, 8, 2, head_dim, dtype, "cuda")
    (q, k, v, dout), cu = _packed(seqs, "cuda")
    (pq, pk, pv, pdout), mask = _padded(seqs[:4], 130, [0, 3, 60, 1])
    # More CTAs than one wave holds: tiles wait on CTAs that started in an earlier wave (4 kv heads
    # x 4 sequences x 16 key tiles; and Qwen3-8B's 32/8 heads x 8 sequences x 8 key tiles, where the
    # dQ releaser, before acc_released held the consumers back for it, fell two blocks behind and
    # hung every full-attention run). Run several times: a hang or a race shows in any of them.
    g = torch.Generator(device="cuda").manual_seed(7)
    waves = [[torch.randn(b, h, s, head_dim, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv, hq)]
             for b, s, hq, hkv in ((4, 2048, 16, 4), (8, 1024, 32, 8))]

    def run():
        _, _, packed = _run_varlen(q, k, v, dout, cu, causal)
        leaves = [t.detach().requires_grad_(True) for t in (pq, pk, pv)]
        rl_engine_ext.attention(*leaves, mask, causal=causal).backward(pdout)
        grads = list(packed) + [t.grad for t in leaves]
        for wave in waves:
            for _ in range(3):
                leaves = [t.detach().requires_grad_(True) for t in wave[:3]]
                rl_engine_ext.attention(*leaves, causal=causal).backward(wave[3])
                grads += [t.grad for t in leaves]
        return grads

    monkeypatch.setenv(DQ_ENV, "ordered")
    ordered = run()
    monkeypatch.setenv(DQ_ENV, "recompute")
    recompute = run()
    names = (["dq", "dk", "dv"] + [f"padded d{n}" for n in "qkv"]
             + [f"wave {w} run {i} d{n}" for w in range(len(waves)) for i in range(3) for n in "qkv"])
    for name, got, want in zip(names, ordered, recompute, strict=True):
        _assert_equal(got, want, f"ordered vs recompute: {name}")


@pytest.mark.cuda
@pytest.mark.parametrize("dq_mode", ["ordered", "recompute"])
@pytest.mark.parametrize("num_seqs", [16, 17, 33])
def test_sm90_backward_work_sections(monkeypatch, num_seqs, dq_mode):
    """The sm90 backward's recompute kernels take their items (kv head, sequence, tile) in sections
    of 16 (kv head, sequence) pairs (kBwdPairsPerSection, csrc/cuda/attention/sm90_bwd.cu): one
    whole section, one pair past it, two sections and one pair; the ordered dQ's kernel takes one
    section of every pair. Sequences of 1 to 300 keys leave the items past a sequence's last tile
    empty. dq, dk and dv equal forced sm80's bit for bit: an item taken twice, or by no CTA, would
    not (packed, causal, bf16 d128, one kv head)."""
    if not _on_hopper():
        pytest.skip("the work sections are the sm90 backward's (compute capability 9.0)")
    monkeypatch.setenv(DQ_ENV, dq_mode)
    lengths = [(1, 300, 65, 129, 200)[i % 5] for i in range(num_seqs)]
    _assert_packed_default_is_sm80(monkeypatch, _sequences(lengths, 2, 1, 128, torch.bfloat16, "cuda"), True)


ORDERED_DQ_MAX_KV_LEN = 512  # kOrderedDqMaxKvLen (csrc/cuda/attention_kernels.h)


@pytest.mark.cuda
@pytest.mark.parametrize("longest", [ORDERED_DQ_MAX_KV_LEN, ORDERED_DQ_MAX_KV_LEN + 1])
def test_sm90_default_dq_mode_either_side_of_its_length_threshold(monkeypatch, longest):
    """The default backward takes the ordered dQ up to the threshold's longest sequence and the
    recompute past it (the fast dQ kernel runs past it only; its EXACT instantiation is launched
    after every causal backward and returns at once): either way the recompute's bits (packed,
    causal, bf16 d128)."""
    if not _on_hopper():
        pytest.skip("the ordered dQ is the sm90 path's (compute capability 9.0)")
    monkeypatch.delenv(PATH_ENV, raising=False)
    seqs = _sequences([longest, 300, 65], 8, 2, 128, torch.bfloat16, "cuda")
    (q, k, v, dout), cu = _packed(seqs, "cuda")
    monkeypatch.delenv(DQ_ENV, raising=False)
    dq_kernels = {n for n in _cuda_kernels(lambda: _run_varlen(q, k, v, dout, cu, True)) if "attention_bwd_dq_sm90" in n}
    assert len(dq_kernels) == (2 if longest > ORDERED_DQ_MAX_KV_LEN else 1), dq_kernels
    default = _run_varlen(q, k, v, dout, cu, True)[2]
    monkeypatch.setenv(DQ_ENV, "recompute")
    recompute = _run_varlen(q, k, v, dout, cu, True)[2]
    for name, got, want in zip(["dq", "dk", "dv"], default, recompute, strict=True):
        _assert_equal(got, want, f"default vs recompute: {name}")


@pytest.mark.cuda
def test_unknown_dq_mode_is_an_error(monkeypatch):
    if not _on_hopper():
        pytest.skip("the dQ mode is read by the sm90 backward only")
    monkeypatch.setenv(DQ_ENV, "atomic")
    monkeypatch.delenv(PATH_ENV, raising=False)
    q = torch.randn(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = rl_engine_ext.attention(q, q, q)
    with pytest.raises(ValueError, match=DQ_ENV):
        out.backward(torch.ones_like(out))


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7], ids=["decode", "chunk7"])
@pytest.mark.parametrize("head_dim", [64, 128])
@tensor_core_dtypes
def test_default_path_gives_the_sm80_bits_from_a_kv_cache(monkeypatch, dtype, head_dim, n):
    """n new tokens of sequences whose caches hold PATH_LENGTHS keys (the length-1 one starts
    inside a chunk): out and lse of the default path equal those of forced sm80 bit for bit."""
    batch, hq, hkv = len(PATH_LENGTHS), 8, 2
    q = randn(batch, hq, n, head_dim, dtype=dtype, device="cuda", seed=1)
    k_cache, v_cache = (randn(batch, hkv, max(PATH_LENGTHS), head_dim, dtype=dtype, device="cuda", seed=s)
                        for s in (2, 3))
    lens = torch.tensor(PATH_LENGTHS, device="cuda")
    default, sm80 = _default_and_sm80(
        monkeypatch, lambda: rl_engine_ext.attention_kvcache(q, k_cache, v_cache, lens, return_lse=True))
    _assert_equal(default[0], sm80[0], "default path vs sm80: out")
    _assert_equal(default[1], sm80[1], "default path vs sm80: lse")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 128), (torch.bfloat16, 96)],
                         ids=["float32", "head_dim96"])
def test_forcing_sm90_where_it_cannot_run_is_an_error(monkeypatch, dtype, head_dim):
    """sm90 runs bf16 and fp16 with head_dim 64 or 128 on compute capability 9.0: anything else
    forced onto it is an error naming what it cannot run, never a fallback."""
    monkeypatch.setenv(PATH_ENV, "sm90")
    q = torch.zeros(1, 4, 8, head_dim, dtype=dtype, device="cuda")
    cannot_run = rf"{PATH_ENV}=sm90 cannot run {re.escape(str(dtype))} with head_dim {head_dim}"
    with pytest.raises(RuntimeError, match=cannot_run):
        rl_engine_ext.attention(q, q, q)


@pytest.mark.cuda
def test_layout_sm90_cannot_address_is_decided_by_the_launcher(monkeypatch):
    """A padded batch stored "sbhd" (sequences start between tokens: no tensor map addresses it):
    on compute capability 9.0 forced sm90 is an error naming the layout, forward and backward
    (never the sm80 kernels run under sm90's name), and the default path gives forced sm80's bits,
    forward and gradients."""
    b, hq, hkv, s, d = 3, 8, 2, 70, 128
    q, k, v, dout = (_stored(randn(b, h, s, d, dtype=torch.bfloat16, device="cuda", seed=i), "sbhd")
                     for i, h in enumerate((hq, hkv, hkv, hq)))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def run():
        for x in leaves:
            x.grad = None
        out, lse = rl_engine_ext.attention(*leaves, return_lse=True)
        out.backward(dout)
        return [out, lse] + [x.grad for x in leaves]

    monkeypatch.setenv(PATH_ENV, "sm90")
    if not _on_hopper():
        with pytest.raises(RuntimeError, match=rf"{PATH_ENV}=sm90 cannot run"):
            rl_engine_ext.attention(q, k, v)
        return
    cannot_run = rf"{PATH_ENV}=sm90 cannot run this layout \("
    with pytest.raises(RuntimeError, match=cannot_run + "k's and v's layout: the batch dimension's stride"):
        rl_engine_ext.attention(q, k, v)
    monkeypatch.setenv(PATH_ENV, "sm80")
    out = rl_engine_ext.attention(*leaves)
    monkeypatch.setenv(PATH_ENV, "sm90")
    with pytest.raises(RuntimeError, match=cannot_run + "q's and dout's layout: the batch dimension's stride"):
        out.backward(dout)
    default, sm80 = _default_and_sm80(monkeypatch, run)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), default, sm80):
        _assert_equal(got, want, f"sbhd: default path vs sm80: {name}")


@pytest.mark.cuda
def test_unknown_gpu_path_is_an_error(monkeypatch):
    monkeypatch.setenv(PATH_ENV, "flash")
    q = torch.randn(1, 2, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=PATH_ENV):
        rl_engine_ext.attention(q, q, q)


# ------------------------------------------------------------------------------------------
# Odd and empty shapes, bad input
# ------------------------------------------------------------------------------------------


# Padded-batch storage orders, as permutations of a [B, H, S, D] view: "bhsd" contiguous, "bshd"
# (Hugging Face's q.transpose(1, 2)), "sbhd" (batch rows inside the token dimension: the sm90 path's
# tensor maps cannot address sequences there, and the launcher runs the sm80 kernels instead).
_STORAGE = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}


def _stored(t: torch.Tensor, order: str) -> torch.Tensor:
    """t [B, H, S, D] with the same values, held in `order`'s storage and viewed as [B, H, S, D]."""
    perm = _STORAGE[order]
    return t.permute(perm).contiguous().permute([perm.index(i) for i in range(4)])


@pytest.mark.parametrize("order", list(_STORAGE))
@pytest.mark.parametrize("shape", [(3, 8, 2, 70), (3, 8, 2, 1), (2, 4, 1, 130)], ids=["s70", "s1", "hkv1"])
def test_storage_order_changes_no_bit(device, order, shape):
    """Every storage order (and a length-1 sequence, one kv head: dimensions whose strides tie) gives
    the contiguous batch's bits, forward and gradients, padded and in a KV-cache decode."""
    b, hq, hkv, s = shape
    d, dt = 64 if device == "cpu" else 128, torch.bfloat16
    q, k, v, dout = (randn(b, h, s, d, dtype=dt, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv, hq)))
    mask = torch.ones(b, s, dtype=torch.bool, device=device)
    mask[0, : s // 2] = False  # left padding in the first row

    def run(layout: str):
        leaves = [_stored(x, layout).requires_grad_(True) for x in (q, k, v)]
        out, lse = rl_engine_ext.attention(*leaves, mask, return_lse=True)
        out.backward(_stored(dout, layout))
        dec = rl_engine_ext.attention_kvcache(_stored(q[:, :, -1:], layout), *leaves[1:],
                                              mask.sum(1), validate=False)
        return [out, lse, dec] + [x.grad for x in leaves]

    want = run("bhsd")
    for name, g, w in zip(("out", "lse", "decode", "dq", "dk", "dv"), run(order), want):
        _assert_equal(g, w, f"{order} {shape} {name}")


def test_empty_shapes(device):
    dt = torch.bfloat16
    q = torch.randn(0, 4, 8, 64, device=device, dtype=dt)
    out, lse = rl_engine_ext.attention(q, q[:, :2], q[:, :2], return_lse=True)
    assert out.shape == q.shape and lse.shape == (0, 4, 8)
    q = torch.randn(2, 4, 0, 64, device=device, dtype=dt)
    assert rl_engine_ext.attention(q, q, q).shape == q.shape
    # A fully padded row: out 0, lse -inf, zero gradients.
    q = torch.randn(2, 2, 5, 64, device=device, dtype=dt, requires_grad=True)
    mask = torch.tensor([[0] * 5, [1] * 5], device=device)
    out, lse = rl_engine_ext.attention(q, q, q, mask, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))
    out.sum().backward()
    assert torch.all(q.grad[0] == 0) and torch.isfinite(q.grad).all()
    # Varlen with empty sequences in the pack.
    q = torch.randn(7, 2, 64, device=device, dtype=dt)
    cu = torch.tensor([0, 0, 3, 3, 7], dtype=torch.int32, device=device)
    out = rl_engine_ext.attention_varlen(q, q, q, cu)
    alone = rl_engine_ext.attention_varlen(q[3:], q[3:], q[3:], torch.tensor([0, 4], dtype=torch.int32, device=device))
    _assert_equal(out[3:], alone, "varlen next to empty sequences")
    # KV cache with no new tokens.
    kc = torch.randn(1, 2, 10, 64, device=device, dtype=dt)
    out = rl_engine_ext.attention_kvcache(torch.randn(1, 2, 0, 64, device=device, dtype=dt), kc, kc,
                                          torch.tensor([4], device=device))
    assert out.shape == (1, 2, 0, 64)


@pytest.mark.parametrize("device", DEVICES)  # float32: not on a forced path
def test_references_match_native_within_contract(device):
    """The references (the kernels of the no-native fallback), forward and backward, padded with
    a mask and packed, agree with the native ops within the fp32 contract."""
    tol = contract.tolerance("attention", torch.float32, "gradient")
    q, k, v = (randn(2, h, 33, 64, dtype=torch.float32, device=device, seed=i) for i, h in enumerate((4, 2, 2)))
    dout = randn(2, 4, 33, 64, dtype=torch.float32, device=device, seed=5)
    mask = torch.ones(2, 33, dtype=torch.bool, device=device)
    mask[1, :9] = False
    out, lse = torch.ops.rl_align.attention(q, k, v, mask, None, True)
    ref_out, ref_lse = attn.reference_forward(q, k, v, mask)
    torch.testing.assert_close(ref_out, out, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(ref_lse, lse, atol=tol.atol, rtol=tol.rtol)
    args = (dout, q, k, v, out, lse, mask, 0.125, True)
    for got, want in zip(attn.reference_backward(*args), torch.ops.rl_align.attention_backward(*args)):
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)
    qp, kp, vp, dp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v, dout))
    cu = torch.tensor([0, 12, 12, 33], dtype=torch.int32, device=device)
    out, lse = torch.ops.rl_align.attention_varlen(qp, kp, vp, cu, None, None, True)
    args = (dp, qp, kp, vp, out, lse, cu, None, 0.125, True)
    for got, want in zip(attn.reference_varlen_backward(*args), torch.ops.rl_align.attention_varlen_backward(*args)):
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)
