"""attention: public functions, argument checks, references, fake outputs and the op's spec.

    out = softmax(scale * q @ k^T + causal mask) @ v        per sequence and query head

Three layouts, one kernel family per (dtype, head_dim, device):

* ``attention(q, k, v, padding_mask=None)``: padded batch, q ``[B, Hq, S, D]``, k/v
  ``[B, Hkv, S, D]`` (what Hugging Face models hand to an attention function); the optional
  ``padding_mask [B, S]`` marks real tokens, one run per row (left or right padding).
* ``attention_varlen(q, k, v, cu_seqlens)``: packed sequences, q ``[T, Hq, D]``, k/v
  ``[T, Hkv, D]``, sequence i = tokens ``cu_seqlens[i] .. cu_seqlens[i+1]-1``.
* ``attention_kvcache(q, k_cache, v_cache, cache_seqlens)``: the last ``n`` positions of each
  sequence (decode: n = 1; chunked prefill: n > 1) against a cache ``[B, Hkv, S_max, D]``
  holding positions ``0 .. cache_seqlens[b]-1`` (the new keys already written). Inference only.

GQA: Hq a multiple of Hkv; query head h reads key/value head ``h // (Hq // Hkv)``. ``scale``
defaults to ``1/sqrt(D)``. With ``return_lse=True`` the fp32 log-sum-exp per (query, head) comes
back too (``[B, Hq, S]``, ``[Hq, T]``, ``[B, Hq, n]``).

Invariance (native kernels): positions are the sequence's own (0 = its first token, whatever
padding or packing surrounds it); keys are taken in blocks of ``ATTENTION_KV_BLOCK`` (64)
positions in increasing order with an fp32 running max and sum. The keys are also cut into
fixed splits of ``ATTENTION_KV_SPLIT`` (2048) positions, counted the same way: a row whose
allowed keys reach several splits runs the recurrence over each split from a fresh state and
merges the partials in split order with one formula (csrc/common/attention_problem.h), in a
prefill as in a decode step, so rows below position 2048 see no split at all. A token's out and
lse are therefore the same bits in a batch of 1 or N, padded left or right, packed next to
anything, in a chunked prefill at any chunk size and in a KV-cache decode step. Masked keys
(after the row's causal position, or outside its sequence) are selected out, never multiplied by
a zero probability: a NaN or Inf in a key a row may not see changes none of its bits, forward or
backward (the references below too). The backward recomputes the softmax and sums dQ over key
blocks and dK/dV over the group's heads and query blocks in fixed order, without atomics: a
sequence's gradients do not depend on the batch. Padding rows get out 0, lse -inf and zero
gradients.
"""

from __future__ import annotations

import math

import torch

from .. import contract, testing
from . import _checks
from ._spec import Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "attention"

# Shared with kAttentionKvBlock / kAttentionKvSplit in csrc/common/attention_problem.h (exported by
# the native library).
ATTENTION_KV_BLOCK = 64
ATTENTION_KV_SPLIT = 2048


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/attention.h). Values that only the data
# reveal (a mask that is not one run, cu_seqlens that are not monotone, cache lengths out of
# range) are checked where the data is read: in the references and the native ops, not here.
# ---------------------------------------------------------------------------------------------


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, layout: str, kn: str = "k",
               vn: str = "v") -> None:
    """kn / vn: what k and v are called in op's schema (k, v; k_cache, v_cache)."""
    for name, t in (("q", q), (kn, k), (vn, v)):
        _checks.check_dtype(op, name, t)
        if t.dim() != dims:
            raise _checks.fail(op, f"{name} must be {dims}-D {layout}, got shape {list(t.shape)}")
        if t.dtype != q.dtype:
            raise _checks.fail(op, f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        _checks.check_device(op, name, t, "q", q)
    if k.shape != v.shape:
        raise _checks.fail(op, f"{kn} {list(k.shape)} and {vn} {list(v.shape)} must have the same shape")
    if k.shape[-1] != q.shape[-1]:
        raise _checks.fail(op, f"q head_dim {q.shape[-1]} differs from {kn} head_dim {k.shape[-1]}")
    if q.shape[-1] < 1:
        raise _checks.fail(op, "head_dim must be >= 1")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise _checks.fail(op, f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv})")


def _check_padded(op: str, q, k, v) -> None:
    _check_qkv(op, q, k, v, 4, "[batch, heads, seq, head_dim]")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise _checks.fail(op, f"q {list(q.shape)} and k {list(k.shape)} must agree in batch and seq")


def _check_varlen(op: str, q, k, v) -> None:
    _check_qkv(op, q, k, v, 3, "[tokens, heads, head_dim]")
    if k.shape[0] != q.shape[0]:
        raise _checks.fail(op, f"q {list(q.shape)} and k {list(k.shape)} must have the same token count")


def _check_mask(op: str, padding_mask: torch.Tensor | None, q: torch.Tensor) -> None:
    if padding_mask is None:
        return
    b, s = q.shape[0], q.shape[2]
    if padding_mask.dim() != 2 or tuple(padding_mask.shape) != (b, s):
        raise _checks.fail(op, f"padding_mask must have shape [{b}, {s}] ([batch, seq]), got {list(padding_mask.shape)}")
    _checks.check_index_tensor(op, "padding_mask", padding_mask, q)


def _check_lengths(op: str, name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    """A per-sequence count or offset (cu_seqlens, cache_seqlens, cache_starts): int32 or int64 (a
    bool would read as lengths 0 and 1), on q's device."""
    if t.dtype not in (torch.int32, torch.int64):
        raise _checks.fail(op, f"{name} must be torch.int32 or torch.int64, got {t.dtype}")
    _checks.check_device(op, name, t, "q", q)


def _check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, max_seqlen: int | None, q: torch.Tensor) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise _checks.fail(op, f"cu_seqlens must be 1-D [num_seqs + 1], got shape {list(cu_seqlens.shape)}")
    _check_lengths(op, "cu_seqlens", cu_seqlens, q)
    if max_seqlen is not None and max_seqlen < 0:
        raise _checks.fail(op, f"max_seqlen must be >= 0, got {max_seqlen}")


def _check_backward_extras(op: str, grad_out, out, lse, q, lse_shape: tuple[int, ...]) -> None:
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape:
            raise _checks.fail(op, f"{name} shape {list(t.shape)} differs from q shape {list(q.shape)}")
        if t.dtype != q.dtype:
            raise _checks.fail(op, f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        _checks.check_device(op, name, t, "q", q)
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(lse_shape):
        raise _checks.fail(op, f"lse must be torch.float32 of shape {list(lse_shape)}, got {lse.dtype} {list(lse.shape)}")
    _checks.check_device(op, "lse", lse, "q", q)


def _scale(op: str, scale: float | None, head_dim: int) -> float:
    """The softmax scale the op uses: ``scale`` or 1/sqrt(head_dim); must be finite."""
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(s):
        raise _checks.fail(op, f"scale must be finite, got {s}")
    return s


def check_attention(q, k, v, padding_mask=None, scale=None, causal=True) -> None:
    _check_padded(OP, q, k, v)
    _scale(OP, scale, q.shape[-1])
    _check_mask(OP, padding_mask, q)


def check_attention_backward(grad_out, q, k, v, out, lse, padding_mask, scale, causal) -> None:
    op = "attention_backward"
    _check_padded(op, q, k, v)
    _check_backward_extras(op, grad_out, out, lse, q, (q.shape[0], q.shape[1], q.shape[2]))
    _check_mask(op, padding_mask, q)
    _scale(op, scale, q.shape[-1])


def _check_unvalidated_varlen(op: str, cu_seqlens, max_seqlen, q, validate: bool) -> None:
    """validate=False reads no length on the host: the grid comes from max_seqlen."""
    if validate:
        return
    if max_seqlen is None:
        raise _checks.fail(op, "validate=False needs max_seqlen (the grid is sized from it; no length is read on the host)")
    if cu_seqlens.shape[0] == 1 and q.shape[0] > 0:
        raise _checks.fail(op, f"cu_seqlens of shape [1] holds no sequence for {q.shape[0]} tokens")


def check_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, scale=None, causal=True, validate=True) -> None:
    op = "attention_varlen"
    _check_varlen(op, q, k, v)
    _scale(op, scale, q.shape[-1])
    _check_cu_seqlens(op, cu_seqlens, max_seqlen, q)
    _check_unvalidated_varlen(op, cu_seqlens, max_seqlen, q, validate)


def check_attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal,
                                    validate=True) -> None:
    op = "attention_varlen_backward"
    _check_varlen(op, q, k, v)
    _check_backward_extras(op, grad_out, out, lse, q, (q.shape[1], q.shape[0]))
    _scale(op, scale, q.shape[-1])
    _check_cu_seqlens(op, cu_seqlens, max_seqlen, q)
    _check_unvalidated_varlen(op, cu_seqlens, max_seqlen, q, validate)


def check_attention_kvcache(q, k_cache, v_cache, cache_seqlens, scale=None, validate=True, cache_starts=None) -> None:
    op = "attention_kvcache"
    _check_qkv(op, q, k_cache, v_cache, 4, "[batch, heads, seq, head_dim]", "k_cache", "v_cache")
    if k_cache.shape[0] != q.shape[0]:
        raise _checks.fail(op, f"q {list(q.shape)} and k_cache {list(k_cache.shape)} must have the same batch size")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != q.shape[0]:
        raise _checks.fail(op, f"cache_seqlens must have shape [{q.shape[0]}], got {list(cache_seqlens.shape)}")
    _scale(op, scale, q.shape[-1])
    if q.shape[2] > k_cache.shape[2]:
        raise _checks.fail(op, f"q's {q.shape[2]} new tokens do not fit the cache ({k_cache.shape[2]} positions)")
    _check_lengths(op, "cache_seqlens", cache_seqlens, q)
    if cache_starts is not None:
        if cache_starts.dim() != 1 or cache_starts.shape[0] != q.shape[0]:
            raise _checks.fail(op, f"cache_starts must have shape [{q.shape[0]}], got {list(cache_starts.shape)}")
        _check_lengths(op, "cache_starts", cache_starts, q)


# ---------------------------------------------------------------------------------------------
# Sequences: every layout as a list of (q rows, k rows, v rows, first query position)
# ---------------------------------------------------------------------------------------------


def _mask_runs(op: str, padding_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(first, length) of each row's real tokens; they must be one run."""
    runs = []
    for i, row in enumerate(padding_mask.to("cpu", torch.bool).tolist()):
        s = len(row)
        first = next((j for j, m in enumerate(row) if m), s)
        last = next((j for j in range(first, s) if not row[j]), s)
        inside = next((j for j in range(last, s) if row[j]), None)
        if inside is not None:
            raise _checks.fail(op, f"padding_mask row {i} has padding inside the sequence (position {inside}); real "
                                   "tokens must be one run (left or right padding)")
        runs.append((first, last - first))
    return runs


def _cu_runs(op: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise _checks.fail(op, f"cu_seqlens must start at 0 and end at the token count {total}, got {cu[0]} ... {cu[-1]}")
    runs = []
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n < 0:
            raise _checks.fail(op, f"cu_seqlens must be non-decreasing, got {cu[i]} then {cu[i + 1]}")
        if max_seqlen is not None and n > max_seqlen:
            raise _checks.fail(op, f"sequence {i} has {n} tokens, more than max_seqlen = {max_seqlen}")
        runs.append((cu[i], n))
    return runs


def _allowed(n: int, length: int, q_pos0: int, causal: bool, device) -> torch.Tensor:
    """[n, length] bool: query i (at position q_pos0 + i) may see key j."""
    kpos = torch.arange(length, device=device)
    qpos = torch.arange(n, device=device) + q_pos0
    return kpos[None, :] <= qpos[:, None] if causal else torch.ones(n, length, dtype=torch.bool, device=device)


def _masked_matmul(w: torch.Tensor, allowed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_j w[h, i, j] x[h, j] over the allowed pairs (i, j) only; w [H, n, L] is 0 on the others,
    x [H, L, D]. A plain matmul would form 0 * x_j for them, NaN where x_j holds a NaN or Inf: so
    the keys (rows of x) holding one are left out of it and added term by term, masked pairs
    selected out. Finite x (the usual case) takes the plain matmul."""
    bad = (~torch.isfinite(x)).any(-1).any(0)
    if not bool(bad.any()):
        return w @ x
    out = w[..., ~bad] @ x[:, ~bad]
    idx = bad.nonzero().squeeze(1)
    step = max(1, 2**24 // max(1, w.shape[0] * w.shape[1] * x.shape[-1]))  # bounds the [H, n, step, D] terms
    for c in range(0, idx.numel(), step):
        j = idx[c : c + step]
        terms = w[..., j, None] * x[:, None, j]  # [H, n, step, D]
        out = out + torch.where(allowed[:, j, None], terms, 0).sum(-2)
    return out


def _sequence_attention(q, k, v, q_pos0: int, scale: float, causal: bool, fp32_out: bool):
    """One sequence: q [Hq, n, D] at positions q_pos0.., k/v [Hkv, L, D] at 0..L-1. fp32 math;
    masked keys selected out (a non-finite k or v there changes nothing)."""
    group = q.shape[0] // k.shape[0]
    with contract.fp32_reference_mode():
        kf = k.float().repeat_interleave(group, 0)
        vf = v.float().repeat_interleave(group, 0)
        allowed = _allowed(q.shape[1], k.shape[1], q_pos0, causal, q.device)
        scores = ((q.float() @ kf.transpose(1, 2)) * scale).masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = _masked_matmul(torch.softmax(scores, dim=-1), allowed, vf)
    return (out if fp32_out else out.to(q.dtype)), lse


def _padded(op, q, k, v, padding_mask, scale, causal, fp32_out):
    b, hq, s, _ = q.shape
    runs = _mask_runs(op, padding_mask) if padding_mask is not None else [(0, s)] * b
    out_dtype = torch.float32 if fp32_out else q.dtype
    outs, lses = [], []
    for i, (first, n) in enumerate(runs):
        rows = slice(first, first + n)
        o, l = _sequence_attention(q[i, :, rows], k[i, :, rows], v[i, :, rows], 0, scale, causal, fp32_out)
        pad = (0, 0, first, s - first - n)
        outs.append(torch.nn.functional.pad(o, pad))
        lses.append(torch.nn.functional.pad(l, pad[2:], value=float("-inf")))
    if b == 0:
        return q.new_zeros(q.shape, dtype=out_dtype), q.new_zeros((b, hq, s), dtype=torch.float32)
    return torch.stack(outs).to(out_dtype), torch.stack(lses)


def _varlen(op, q, k, v, cu_seqlens, max_seqlen, scale, causal, fp32_out):
    runs = _cu_runs(op, cu_seqlens, q.shape[0], max_seqlen)
    out_dtype = torch.float32 if fp32_out else q.dtype
    outs, lses = [q.new_zeros((0, q.shape[1], q.shape[2]), dtype=out_dtype)], [q.new_zeros((q.shape[1], 0), dtype=torch.float32)]
    for start, n in runs:
        rows = slice(start, start + n)
        o, l = _sequence_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0, scale, causal, fp32_out
        )
        outs.append(o.transpose(0, 1).to(out_dtype))
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _kvcache(q, k_cache, v_cache, cache_seqlens, cache_starts, scale, fp32_out):
    b, hq, n, _ = q.shape
    lens = cache_seqlens.tolist()
    starts = [0] * b if cache_starts is None else cache_starts.tolist()
    outs, lses = [], []
    min_len = 0 if n > 1 else n  # decode needs its new token; a chunk may start before its sequence
    for i, (length, first) in enumerate(zip(lens, starts)):
        if not min_len <= length <= k_cache.shape[2]:
            raise _checks.fail("attention_kvcache", f"cache_seqlens[{i}] = {length} must be within [{min_len}, "
                                                    f"{k_cache.shape[2]}] ({n} new tokens, a cache of "
                                                    f"{k_cache.shape[2]} positions)")
        if not 0 <= first <= k_cache.shape[2] - length:
            raise _checks.fail("attention_kvcache", f"cache_starts[{i}] = {first} with cache_seqlens[{i}] = {length} "
                                                    f"does not fit the cache ({k_cache.shape[2]} positions)")
        keys, own = slice(first, first + length), min(n, length)  # queries before position 0: padding
        o, l = _sequence_attention(q[i, :, n - own :], k_cache[i, :, keys], v_cache[i, :, keys], length - own, scale,
                                   True, fp32_out)
        outs.append(torch.cat([o.new_zeros(hq, n - own, o.shape[-1]), o], dim=1))
        lses.append(torch.cat([l.new_full((hq, n - own), -math.inf), l], dim=1))
    if b == 0:
        return q.new_zeros(q.shape, dtype=torch.float32 if fp32_out else q.dtype), q.new_zeros((0, hq, n), dtype=torch.float32)
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels; fp32 math in PyTorch's order, within the contract of the
# kernels, not bit for bit) and fake outputs
# ---------------------------------------------------------------------------------------------


def reference_forward(q, k, v, padding_mask=None, scale=None, causal=True):
    """The dtype path of ``attention``: fp32 math, out rounded to q.dtype. Returns (out, lse)."""
    check_attention(q, k, v, padding_mask, scale, causal)
    return _padded(OP, q, k, v, padding_mask, _scale(OP, scale, q.shape[-1]), causal, False)


def reference_forward_fp32(q, k, v, padding_mask=None, scale=None, causal=True):
    """Ground truth of ``attention``: fp32 inputs and math, fp32 out; TF32 and autocast off."""
    check_attention(q, k, v, padding_mask, scale, causal)
    return _padded(OP, q, k, v, padding_mask, _scale(OP, scale, q.shape[-1]), causal, True)


def reference_varlen(q, k, v, cu_seqlens, max_seqlen=None, scale=None, causal=True, validate=True, fp32_out=False):
    """The reference reads cu_seqlens on the host whatever ``validate`` says."""
    op = "attention_varlen"
    check_attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, validate)
    return _varlen(op, q, k, v, cu_seqlens, max_seqlen, _scale(op, scale, q.shape[-1]), causal, fp32_out)


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, scale=None, validate=True, cache_starts=None,
                      fp32_out=False):
    """The reference reads the lengths on the host whatever ``validate`` says."""
    check_attention_kvcache(q, k_cache, v_cache, cache_seqlens, scale, validate, cache_starts)
    return _kvcache(q, k_cache, v_cache, cache_seqlens, cache_starts, _scale("attention_kvcache", scale, q.shape[-1]),
                    fp32_out)


def _sequence_grads(q, k, v, dout, scale: float, causal: bool):
    """One sequence's (dq, dk, dv) in fp32 math, rounded to the input dtype: P = softmax(scale q k^T),
    dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = scale dS K, dK = scale dS^T Q, the
    group's query heads summed into their key/value head. Masked pairs are selected out of every
    sum (P = dS = 0 there, and their k, v, q, dO enter no product)."""
    hkv, group = k.shape[0], q.shape[0] // k.shape[0]
    with contract.fp32_reference_mode():
        qf, do = q.float(), dout.float()
        kf = k.float().repeat_interleave(group, 0)
        vf = v.float().repeat_interleave(group, 0)
        allowed = _allowed(q.shape[1], k.shape[1], 0, causal, q.device)
        scores = ((qf @ kf.transpose(1, 2)) * scale).masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        dp = do @ vf.transpose(1, 2)  # masked pairs' dP is never read
        pdp = torch.where(allowed, p * dp, 0)
        ds = torch.where(allowed, p * (dp - pdp.sum(-1, keepdim=True)), 0)
        dq = _masked_matmul(ds, allowed, kf) * scale
        dk = (_masked_matmul(ds.transpose(1, 2), allowed.T, qf) * scale).view(hkv, group, *k.shape[1:]).sum(1)
        dv = _masked_matmul(p.transpose(1, 2), allowed.T, do).view(hkv, group, *v.shape[1:]).sum(1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_backward(grad_out, q, k, v, out, lse, padding_mask, scale, causal):
    """(dq, dk, dv) of ``attention`` (out and lse are recomputed); padding rows get zeros."""
    op = "attention_backward"
    check_attention_backward(grad_out, q, k, v, out, lse, padding_mask, scale, causal)
    runs = _mask_runs(op, padding_mask) if padding_mask is not None else [(0, q.shape[2])] * q.shape[0]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, (first, n) in enumerate(runs):
        rows = slice(first, first + n)
        dq[i, :, rows], dk[i, :, rows], dv[i, :, rows] = _sequence_grads(
            q[i, :, rows], k[i, :, rows], v[i, :, rows], grad_out[i, :, rows], scale, causal)
    return dq, dk, dv


def reference_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal, validate=True):
    """(dq, dk, dv) of ``attention_varlen`` (out and lse are recomputed)."""
    op = "attention_varlen_backward"
    check_attention_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal, validate)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, n in _cu_runs(op, cu_seqlens, q.shape[0], max_seqlen):
        rows = slice(start, start + n)
        grads = _sequence_grads(*(t[rows].transpose(0, 1) for t in (q, k, v, grad_out)), scale, causal)
        for g, dst in zip(grads, (dq, dk, dv)):
            dst[rows] = g.transpose(0, 1)
    return dq, dk, dv


def _lse_like(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return q.new_empty(shape, dtype=torch.float32)


def _empty_padded(q, k, v, *rest):
    return torch.empty_like(q), _lse_like(q, (q.shape[0], q.shape[1], q.shape[2]))


def _empty_varlen(q, k, v, *rest):
    return torch.empty_like(q), _lse_like(q, (q.shape[1], q.shape[0]))


def _empty_grads(grad_out, q, k, v, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


def _setup_padded(ctx, inputs, output):
    q, k, v, padding_mask, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.extras = (padding_mask, _scale(OP, scale, q.shape[-1]), causal)
    ctx.mark_non_differentiable(lse)


def _backward_padded(ctx, grad_out, grad_lse):
    # lse is an output for samplers and tests, not a differentiable one: its gradient is ignored.
    dq, dk, dv = OPS.attention_backward(grad_out, *ctx.saved_tensors, *ctx.extras)
    return dq, dk, dv, None, None, None


def _setup_varlen(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, causal, validate = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.extras = (max_seqlen, _scale("attention_varlen", scale, q.shape[-1]), causal, validate)
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, grad_out, grad_lse):
    dq, dk, dv = OPS.attention_varlen_backward(grad_out, *ctx.saved_tensors, *ctx.extras)
    return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
):
    """Batch-invariant attention over a padded batch (differentiable in q, k, v)."""
    out, lse = OPS.attention(q, k, v, padding_mask, scale, causal)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    validate: bool = True,
):
    """Batch-invariant attention over packed sequences (differentiable in q, k, v).

    ``validate=True`` reads ``cu_seqlens`` on the host and raises a ValueError unless it starts at
    0, ends at the token count, never decreases and (if given) no sequence exceeds
    ``max_seqlen`` (one device-to-host copy per call, forward and backward). ``validate=False``
    never reads it on the host: no synchronisation, capturable in a CUDA graph; ``max_seqlen``
    is then required (it sizes the grid) and the same conditions are checked where cu_seqlens
    lives (a device-side assert on CUDA, an error on the CPU)."""
    out, lse = OPS.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, validate)
    return (out, lse) if return_lse else out


def attention_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
    cache_starts: torch.Tensor | None = None,
):
    """KV-cache attention (decode / chunked prefill): the same bits as the full prefill.

    Sequence ``b``'s keys and values are at cache positions ``cache_starts[b] ..
    cache_starts[b] + cache_seqlens[b] - 1`` (``cache_starts=None``: from 0). A left-padded cache
    (Hugging Face's batch generation keeps the prompts' left padding in it) is read in place with
    ``cache_starts`` = each row's padding count: the result is the unpadded sequence's, bit for bit.

    ``cache_seqlens`` and ``cache_starts`` are int32 or int64. A length must lie in ``[1, S_max]`` for
    a decode step (n = 1) and in ``[0, S_max]`` for a chunk of n > 1 queries: a chunk may start
    before its sequence does, and then the first ``n - cache_seqlens[b]`` queries of row b are
    padding (out 0, lse -inf). ``cache_starts[b] + cache_seqlens[b]`` must not exceed S_max.
    ``validate=True`` reads the lengths on the host and raises a ValueError for any other value
    (one device-to-host copy per call). ``validate=False`` never reads them
    on the host: no synchronisation, so a decode step can be captured in a CUDA graph and
    replayed with new lengths; a bad length is then a device-side assert on CUDA (the context is
    unusable afterwards, as after F.embedding's), still an error on the CPU, never an
    out-of-bounds read."""
    out, lse = OPS.attention_kvcache(q, k_cache, v_cache, cache_seqlens, scale, validate, cache_starts)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _qkv(device, dtype, b=2, hq=4, hkv=2, s=20, d=64):
    return tuple(seeded_randn(b, h, s, d, dtype=dtype, device=device, seed=i) for i, h in enumerate((hq, hkv, hkv)))


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    q, k, v = _qkv(device, dtype)
    mask = torch.ones(2, 20, dtype=torch.bool, device=device)
    mask[0, :5] = False
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    out, lse = OPS.attention(q, k, v, mask, 0.2, False)
    outp, lsep = OPS.attention_varlen(qp, kp, vp, cu, None, None, True)
    dout = seeded_randn(*q.shape, dtype=dtype, device=device, seed=9)
    return [
        Sample("attention", (ql, kl, vl, None, None, True)),
        Sample("attention", (ql, kl, vl, mask, 0.2, False)),
        Sample("attention", (q[:0], k[:0], v[:0], None, None, True)),
        Sample("attention_backward", (dout, q, k, v, out, lse, mask, 0.2, False)),
        Sample("attention_varlen", (qp.clone().requires_grad_(), kp.clone().requires_grad_(), vp.clone().requires_grad_(),
                                    cu, None, None, True)),
        Sample("attention_varlen_backward", (dout[0].transpose(0, 1).contiguous(), qp, kp, vp, outp, lsep, cu, 20,
                                             0.125, True)),
        Sample("attention_varlen", (qp.clone().requires_grad_(), kp.clone().requires_grad_(), vp.clone().requires_grad_(),
                                    cu, 13, None, True, False)),
        Sample("attention_varlen_backward", (dout[0].transpose(0, 1).contiguous(), qp, kp, vp, outp, lsep, cu, 13,
                                             0.125, True, False)),
        Sample("attention_kvcache", (q[:, :, :3], k, v, torch.tensor([10, 20], device=device), None)),
        Sample("attention_kvcache", (q[:, :, :3], k, v, torch.tensor([10, 20], device=device), None, False)),
        Sample("attention_kvcache", (q[:, :, :3], k, v, torch.tensor([10, 12], device=device), None, True,
                                     torch.tensor([7, 0], device=device))),
        Sample("attention_kvcache", (q[:, :, :3], k, v, torch.tensor([10, 12], device=device, dtype=torch.int32), None,
                                     False, torch.tensor([10, 8], device=device))),
    ]


def _bad_inputs(device: str) -> list[BadInput]:
    q, _, _ = _qkv(device, torch.bfloat16, hq=4, s=8)
    kv = seeded_randn(2, 2, 8, 64, dtype=torch.bfloat16, device=device, seed=3)
    qp, kvp = q[0].transpose(0, 1).contiguous(), kv[0].transpose(0, 1).contiguous()  # [8, H, D]
    out, lse = OPS.attention(q, kv, kv, None, None, True)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)

    def varlen(cu_values, max_seqlen=None, dtype=torch.int32, validate=True):
        return (qp, kvp, kvp, torch.tensor(cu_values, dtype=dtype, device=device), max_seqlen, None, True, validate)

    bad = [
        BadInput("attention", (q.double(), kv.double(), kv.double(), None, None, True), ValueError, "unsupported dtype"),
        BadInput("attention", (q, kv.float(), kv.float(), None, None, True), ValueError, "differs from q dtype"),
        BadInput("attention", (q, q[:, :3], q[:, :3], None, None, True), ValueError, "multiple of key/value heads"),
        BadInput("attention", (q, kv[..., :32], kv[..., :32], None, None, True), ValueError, "head_dim"),
        BadInput("attention", (q[0], kv[0], kv[0], None, None, True), ValueError, "4-D"),
        BadInput("attention", (q, kv, kv[:, :, :4], None, None, True), ValueError, "must have the same shape"),
        BadInput("attention", (q, kv[:, :, :4], kv[:, :, :4], None, None, True), ValueError, "agree in batch and seq"),
        BadInput("attention", (q, kv, kv, torch.ones(2, 7, dtype=torch.bool, device=device), None, True), ValueError,
                 "padding_mask must have shape"),
        BadInput("attention", (q, kv, kv, torch.ones(2, 8, device=device), None, True), ValueError,
                 "padding_mask must be a bool or integer tensor"),
        BadInput("attention", (q, kv, kv, None, float("nan"), True), ValueError, "scale must be finite"),
        BadInput("attention", (q, kv, kv, torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]] * 2, device=device), None, True),
                 ValueError, r"padding inside the sequence \(position 2\)", value_dependent=True),
        BadInput("attention_backward", (out[:, :, :4], q, kv, kv, out, lse, None, 0.125, True), ValueError,
                 "grad_out shape"),
        BadInput("attention_backward", (out, q, kv, kv, out, lse.bfloat16(), None, 0.125, True), ValueError,
                 "lse must be torch.float32"),
        BadInput("attention_backward", (out, q, kv, kv, out.float(), lse, None, 0.125, True), ValueError, "out dtype"),
        BadInput("attention_backward", (out, q, kv, kv, out, lse, None, float("inf"), True), ValueError,
                 "scale must be finite"),
        BadInput("attention_varlen", varlen([0, 3, 2, 8]), ValueError, "non-decreasing", value_dependent=True),
        BadInput("attention_varlen", varlen([0, 3, 7]), ValueError, "end at the token count", value_dependent=True),
        BadInput("attention_varlen", varlen([1, 8]), ValueError, "start at 0", value_dependent=True),
        BadInput("attention_varlen", varlen([0, 8], max_seqlen=4), ValueError, "max_seqlen", value_dependent=True),
        BadInput("attention_varlen", varlen([0.0, 8.0], dtype=torch.float32), ValueError,
                 "cu_seqlens must be torch.int32 or torch.int64, got torch.float32"),
        BadInput("attention_varlen", varlen([False, True], dtype=torch.bool), ValueError,
                 "cu_seqlens must be torch.int32 or torch.int64, got torch.bool"),
        BadInput("attention_varlen", varlen([0, 8], max_seqlen=-1), ValueError, "max_seqlen must be >= 0, got -1"),
        BadInput("attention_varlen", varlen([[0, 8]]), ValueError, "cu_seqlens must be 1-D"),
        BadInput("attention_varlen", (qp, kvp[:4], kvp[:4], cu, None, None, True), ValueError, "same token count"),
        BadInput("attention_varlen", varlen([0, 8], validate=False), ValueError, "validate=False needs max_seqlen"),
        BadInput("attention_varlen", varlen([0, 8], max_seqlen=-1, validate=False), ValueError, "max_seqlen must be >= 0"),
        BadInput("attention_varlen", varlen([0], max_seqlen=8, validate=False), ValueError, "holds no sequence for 8"),
        BadInput("attention_varlen_backward", (qp, qp, kvp, kvp, qp, lse[0, :, :8].contiguous(), cu, None, 0.125, True,
                                               False), ValueError, "validate=False needs max_seqlen"),
        BadInput("attention_varlen_backward", (qp, qp, kvp, kvp, qp, lse[0, :, :4], cu, None, 0.125, True), ValueError,
                 "lse must be torch.float32 of shape"),
        BadInput("attention_varlen_backward", (qp, qp, kvp, kvp, qp, lse[0, :, :8].contiguous(), cu, -3, 0.125, True),
                 ValueError, "max_seqlen must be >= 0, got -3"),
        BadInput("attention_varlen_backward", (qp, qp, kvp, kvp, qp, lse[0, :, :8].contiguous(), cu.bool(), None,
                                               0.125, True), ValueError,
                 "cu_seqlens must be torch.int32 or torch.int64, got torch.bool"),
        BadInput("attention_kvcache", (q[:, :, :1], kv, kv, torch.tensor([0, 8], device=device), None), ValueError,
                 r"cache_seqlens\[0\] = 0 must be within \[1, 8\]", value_dependent=True),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([9, 8], device=device), None), ValueError,
                 r"cache_seqlens\[0\] = 9 must be within \[0, 8\]", value_dependent=True),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([-1, 8], device=device), None), ValueError,
                 r"cache_seqlens\[0\] = -1 must be within \[0, 8\]", value_dependent=True),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4.0, 8.0], device=device), None), ValueError,
                 "cache_seqlens must be torch.int32 or torch.int64, got torch.float32"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([True, True], device=device), None), ValueError,
                 "cache_seqlens must be torch.int32 or torch.int64, got torch.bool"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([True, True], device=device), None, False),
                 ValueError, "cache_seqlens must be torch.int32 or torch.int64, got torch.bool"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4], device=device), None), ValueError,
                 r"cache_seqlens must have shape \[2\]"),
        BadInput("attention_kvcache", (q[:, :, :2], kv[:1], kv[:1], torch.tensor([4, 4], device=device), None), ValueError,
                 "same batch size"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv[:, :, :4], torch.tensor([4, 4], device=device), None),
                 ValueError, r"k_cache \[2, 2, 8, 64\] and v_cache \[2, 2, 4, 64\] must have the same shape"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv.float(), torch.tensor([4, 4], device=device), None),
                 ValueError, "v_cache dtype torch.float32 differs from q dtype"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8], device=device), None, True,
                 torch.tensor([5, 0], device=device)), ValueError, r"cache_starts\[0\] = 5", value_dependent=True),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8], device=device), None, True,
                 torch.tensor([0, -1], device=device)), ValueError, r"cache_starts\[1\] = -1", value_dependent=True),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8], device=device), None, True,
                 torch.tensor([0], device=device)), ValueError, r"cache_starts must have shape \[2\]"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8], device=device), None, True,
                 torch.tensor([0.0, 1.0], device=device)), ValueError,
                 "cache_starts must be torch.int32 or torch.int64, got torch.float32"),
        BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8], device=device), None, False,
                 torch.tensor([False, True], device=device)), ValueError,
                 "cache_starts must be torch.int32 or torch.int64, got torch.bool"),
    ]
    if device == "cpu":  # validate=False checks the values where they are: here, on the host
        bad += [
            BadInput("attention_varlen", varlen([0, 3, 2, 8], max_seqlen=8, validate=False), ValueError,
                     "non-decreasing", value_dependent=True),
            BadInput("attention_varlen", varlen([0, 8], max_seqlen=4, validate=False), ValueError, "max_seqlen = 4",
                     value_dependent=True),
            BadInput("attention_varlen", varlen([1, 8], max_seqlen=8, validate=False), ValueError, "start at 0",
                     value_dependent=True),
        ]
    if device != "cpu":
        bad += [
            BadInput("attention", (q, kv.cpu(), kv.cpu(), None, None, True), RuntimeError, "k is on cpu"),
            BadInput("attention", (q, kv, kv, torch.ones(2, 8, dtype=torch.bool), None, True), RuntimeError,
                     "padding_mask is on cpu"),
            BadInput("attention_varlen", (qp, kvp, kvp, cu.cpu(), None, None, True), RuntimeError, "cu_seqlens is on cpu"),
            BadInput("attention_kvcache", (q[:, :, :2], kv, kv, torch.tensor([4, 8]), None), RuntimeError,
                     "cache_seqlens is on cpu"),
            BadInput("attention_kvcache", (q[:, :, :2], kv.cpu(), kv.cpu(), torch.tensor([4, 8], device=device), None),
                     RuntimeError, "k_cache is on cpu but q is on cuda"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, batch: int, heads_q: int, heads_kv: int, seq: int,
                     head_dim: int) -> InvarianceCase:
    """The harness over the batch of sequences (batch of 1, sub-batches, padding with other
    sequences, chunks, repeats, per-sequence gradients), plus KV-cache decode of every sequence's
    last position against its prefill row."""
    q = seeded_randn(batch, heads_q, seq, head_dim, dtype=dtype, device=device, seed=seq)
    k = seeded_randn(batch, heads_kv, seq, head_dim, dtype=dtype, device=device, seed=seq + 1)
    v = seeded_randn(batch, heads_kv, seq, head_dim, dtype=dtype, device=device, seed=seq + 2)

    def decode_vs_prefill():
        lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
        decode = attention_kvcache(q[:, :, -1:], k, v, lens)
        drift = testing.compare("out", "kvcache_decode[last position]", decode, attention(q, k, v)[:, :, -1:])
        return [] if drift is None else [drift]

    return InvarianceCase(
        fn=lambda q, k, v: attention(q, k, v),
        rows=[q, k, v],
        accuracy=lambda: (attention(q, k, v), reference_forward_fp32(q, k, v)[0]),
        extra_forward=decode_vs_prefill,
    )


def _sdpa_causal(q, k, v):
    """The torch counterpart: SDPA, causal, GQA."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _autocast_args(device, act):
    # q from a projection in the activation dtype, k and v in fp32: autocast casts all three.
    return (seeded_randn(2, 4, 16, 64, dtype=act, device=device, seed=8).requires_grad_(),
            seeded_randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=9).requires_grad_(),
            seeded_randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=10).requires_grad_())


def _autocast_varlen_args(device, act):
    return (seeded_randn(12, 4, 64, dtype=act, device=device, seed=11).requires_grad_(),
            seeded_randn(12, 2, 64, dtype=torch.float32, device=device, seed=12).requires_grad_(),
            seeded_randn(12, 2, 64, dtype=torch.float32, device=device, seed=13).requires_grad_(),
            torch.tensor([0, 5, 12], dtype=torch.int32, device=device))


def _autocast_kvcache_args(device, act):
    return (seeded_randn(2, 4, 1, 64, dtype=act, device=device, seed=14),
            seeded_randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=15),
            seeded_randn(2, 2, 16, 64, dtype=torch.float32, device=device, seed=16),
            torch.tensor([5, 16], dtype=torch.int32, device=device))


def _host_cost_args(device, dims, tokens):
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    q, k, v = (seeded_randn(tokens, heads, d, dtype=torch.bfloat16, device=device, seed=seed).requires_grad_()
               for heads, seed in ((hq, 1), (hkv, 2), (hkv, 3)))
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    return {"attention_varlen": (q, k, v, cu_seqlens, tokens, None, True, False)}


SPEC = OpSpec(
    name=OP,
    op_class="attention",
    ops=(
        OpDef("attention", check_attention, reference_forward, _empty_padded, Autograd(_setup_padded, _backward_padded),
              Autocast.LOWER_PRECISION),
        OpDef("attention_backward", check_attention_backward, reference_backward, _empty_grads),
        OpDef("attention_varlen", check_attention_varlen, reference_varlen, _empty_varlen,
              Autograd(_setup_varlen, _backward_varlen), Autocast.LOWER_PRECISION),
        OpDef("attention_varlen_backward", check_attention_varlen_backward, reference_varlen_backward, _empty_grads),
        OpDef("attention_kvcache", check_attention_kvcache, reference_kvcache, _empty_padded,
              autocast=Autocast.LOWER_PRECISION),
    ),
    exports={
        "attention": attention,
        "attention_varlen": attention_varlen,
        "attention_kvcache": attention_kvcache,
        "ATTENTION_KV_BLOCK": ATTENTION_KV_BLOCK,
        "ATTENTION_KV_SPLIT": ATTENTION_KV_SPLIT,
    },
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"batch": 5, "heads_q": 4, "heads_kv": 2, "seq": 130, "head_dim": 64},
                  {"batch": 3, "heads_q": 8, "heads_kv": 8, "seq": 77, "head_dim": 128}),
    invariance_case=_invariance_case,
    constants={"ATTENTION_KV_BLOCK": ATTENTION_KV_BLOCK, "ATTENTION_KV_SPLIT": ATTENTION_KV_SPLIT},
    autocast_cases=(
        AutocastCase("attention", _autocast_args, attention, _sdpa_causal),
        AutocastCase("attention_varlen", _autocast_varlen_args, attention_varlen,  # its dtypes: SDPA on [H, T, D]
                     lambda q, k, v, cu: _sdpa_causal(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)),
        AutocastCase("attention_kvcache", _autocast_kvcache_args, attention_kvcache,
                     lambda q, k, v, lens: _sdpa_causal(q, k, v)),
    ),
    host_cost_args=_host_cost_args,
)
