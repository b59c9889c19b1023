"""attention: public functions, fake kernels and the pure-PyTorch references.

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
positions in increasing order with an fp32 running max and sum; no split over keys. A token's
out and lse are therefore the same bits in a batch of 1 or N, padded left or right, packed next
to anything, in a chunked prefill at any chunk size and in a KV-cache decode step. The backward
recomputes the softmax and sums dQ over key blocks and dK/dV over the group's heads and query
blocks in fixed order, without atomics: a sequence's gradients do not depend on the batch.
Padding rows get out 0, lse -inf and zero gradients.
"""

from __future__ import annotations

import math

import torch

from .. import contract
from .._native import NATIVE_AVAILABLE

OP = "attention"

# Mirrors kAttentionKvBlock in csrc/common/attention_problem.h.
ATTENTION_KV_BLOCK = 64


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        contract.check_dtype(op, t.dtype, name)
        if t.dim() != dims:
            raise ValueError(f"rl_align::{op}: {name} must be {dims}-D {layout}, got shape {list(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"rl_align::{op}: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise RuntimeError(f"rl_align::{op}: {name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"rl_align::{op}: k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"rl_align::{op}: q head_dim {q.shape[-1]} differs from k head_dim {k.shape[-1]}")
    if q.shape[-1] < 1:
        raise ValueError(f"rl_align::{op}: head_dim must be >= 1")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"rl_align::{op}: query heads ({hq}) must be a positive multiple of key/value heads ({hkv})")


def _check_padded(op: str, q, k, v) -> None:
    _check_qkv(op, q, k, v, 4, "[batch, heads, seq, head_dim]")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"rl_align::{op}: q {list(q.shape)} and k {list(k.shape)} must agree in batch and seq")


def _check_varlen(op: str, q, k, v) -> None:
    _check_qkv(op, q, k, v, 3, "[tokens, heads, head_dim]")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"rl_align::{op}: q {list(q.shape)} and k {list(k.shape)} must have the same token count")


def _check_kvcache(q, k_cache, v_cache, cache_seqlens) -> None:
    op = "attention_kvcache"
    _check_qkv(op, q, k_cache, v_cache, 4, "[batch, heads, seq, head_dim]")
    if k_cache.shape[0] != q.shape[0]:
        raise ValueError(f"rl_align::{op}: q {list(q.shape)} and k_cache {list(k_cache.shape)} must have the same batch size")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != q.shape[0]:
        raise ValueError(f"rl_align::{op}: cache_seqlens must have shape [{q.shape[0]}], got {list(cache_seqlens.shape)}")


def _scale(op: str, scale: float | None, head_dim: int) -> float:
    s = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(s):
        raise ValueError(f"rl_align::{op}: scale must be finite, got {s}")
    return s


# ---------------------------------------------------------------------------------------------
# Sequences: every layout as a list of (q rows, k rows, v rows, first query position)
# ---------------------------------------------------------------------------------------------


def _mask_runs(op: str, padding_mask: torch.Tensor, b: int, s: int) -> list[tuple[int, int]]:
    """(first, length) of each row's real tokens; they must be one run."""
    if padding_mask.dim() != 2 or tuple(padding_mask.shape) != (b, s):
        raise ValueError(f"rl_align::{op}: padding_mask must have shape [{b}, {s}] ([batch, seq]), got {list(padding_mask.shape)}")
    runs = []
    for i, row in enumerate(padding_mask.to("cpu", torch.bool).tolist()):
        first = next((j for j, m in enumerate(row) if m), s)
        last = next((j for j in range(first, s) if not row[j]), s)
        if any(row[last:]):
            raise ValueError(
                f"rl_align::{op}: padding_mask row {i} has padding inside the sequence; real tokens must be one run "
                "(left or right padding)"
            )
        runs.append((first, last - first))
    return runs


def _cu_runs(op: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None) -> list[tuple[int, int]]:
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"rl_align::{op}: cu_seqlens must be 1-D [num_seqs + 1], got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rl_align::{op}: cu_seqlens must be torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"rl_align::{op}: cu_seqlens must start at 0 and end at the token count {total}, got {cu[0]} ... {cu[-1]}")
    runs = []
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n < 0:
            raise ValueError(f"rl_align::{op}: cu_seqlens must be non-decreasing, got {cu[i]} then {cu[i + 1]}")
        if max_seqlen is not None and n > max_seqlen:
            raise ValueError(f"rl_align::{op}: sequence {i} has {n} tokens, more than max_seqlen = {max_seqlen}")
        runs.append((cu[i], n))
    return runs


def _sequence_attention(q, k, v, q_pos0: int, scale: float, causal: bool, fp32_out: bool):
    """One sequence: q [Hq, n, D] at positions q_pos0.., k/v [Hkv, L, D] at 0..L-1. fp32 math."""
    group = q.shape[0] // k.shape[0]
    with contract.fp32_reference_mode():
        kf = k.float().repeat_interleave(group, 0)
        vf = v.float().repeat_interleave(group, 0)
        scores = (q.float() @ kf.transpose(1, 2)) * scale
        if causal:
            qpos = torch.arange(q.shape[1], device=q.device) + q_pos0
            kpos = torch.arange(k.shape[1], device=q.device)
            scores = scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ vf
    return (out if fp32_out else out.to(q.dtype)), lse


def _padded(q, k, v, padding_mask, scale, causal, fp32_out):
    b, hq, s, _ = q.shape
    runs = _mask_runs(OP, padding_mask, b, s) if padding_mask is not None else [(0, s)] * b
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


def _varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal, fp32_out):
    runs = _cu_runs("attention_varlen", cu_seqlens, q.shape[0], max_seqlen)
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


def _kvcache(q, k_cache, v_cache, cache_seqlens, scale, fp32_out):
    b, hq, n, _ = q.shape
    lens = cache_seqlens.tolist()
    outs, lses = [], []
    for i, length in enumerate(lens):
        if not n <= length <= k_cache.shape[2]:
            raise ValueError(
                f"rl_align::attention_kvcache: cache_seqlens[{i}] = {length} must hold the {n} new tokens and fit the "
                f"cache ({k_cache.shape[2]} positions)"
            )
        o, l = _sequence_attention(q[i], k_cache[i, :, :length], v_cache[i, :, :length], length - n, scale, True, fp32_out)
        outs.append(o)
        lses.append(l)
    if b == 0:
        return q.new_zeros(q.shape, dtype=torch.float32 if fp32_out else q.dtype), q.new_zeros((0, hq, n), dtype=torch.float32)
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------------
# References (also the fallback when the native library is absent; differentiable by autograd)
# ---------------------------------------------------------------------------------------------


def reference_forward(q, k, v, padding_mask=None, scale=None, causal=True):
    """The dtype path of ``attention``: fp32 math (PyTorch's order), out rounded to q.dtype.
    Returns (out, lse)."""
    _check_padded(OP, q, k, v)
    return _padded(q, k, v, padding_mask, _scale(OP, scale, q.shape[-1]), causal, False)


def reference_forward_fp32(q, k, v, padding_mask=None, scale=None, causal=True):
    """Ground truth of ``attention``: fp32 inputs and math, fp32 out; TF32 and autocast off."""
    _check_padded(OP, q, k, v)
    return _padded(q, k, v, padding_mask, _scale(OP, scale, q.shape[-1]), causal, True)


def reference_varlen(q, k, v, cu_seqlens, max_seqlen=None, scale=None, causal=True, fp32_out=False):
    _check_varlen("attention_varlen", q, k, v)
    return _varlen(q, k, v, cu_seqlens, max_seqlen, _scale("attention_varlen", scale, q.shape[-1]), causal, fp32_out)


def reference_kvcache(q, k_cache, v_cache, cache_seqlens, scale=None, fp32_out=False):
    _check_kvcache(q, k_cache, v_cache, cache_seqlens)
    return _kvcache(q, k_cache, v_cache, cache_seqlens, _scale("attention_kvcache", scale, q.shape[-1]), fp32_out)


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
    if NATIVE_AVAILABLE:
        out, lse = torch.ops.rl_align.attention(q, k, v, padding_mask, scale, causal)
    else:
        out, lse = reference_forward(q, k, v, padding_mask, scale, causal)
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
):
    """Batch-invariant attention over packed sequences (differentiable in q, k, v)."""
    if NATIVE_AVAILABLE:
        out, lse = torch.ops.rl_align.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    else:
        out, lse = reference_varlen(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    return (out, lse) if return_lse else out


def attention_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
):
    """KV-cache attention (decode / chunked prefill): the same bits as the full prefill."""
    if NATIVE_AVAILABLE:
        out, lse = torch.ops.rl_align.attention_kvcache(q, k_cache, v_cache, cache_seqlens, scale)
    else:
        out, lse = reference_kvcache(q, k_cache, v_cache, cache_seqlens, scale)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Fake kernels for the native ops (autograd is registered in C++: csrc/autograd.cpp)
# ---------------------------------------------------------------------------------------------

if NATIVE_AVAILABLE:

    def _lse_like(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return q.new_empty(shape, dtype=torch.float32)

    @torch.library.register_fake("rl_align::attention")
    def _attention_fake(q, k, v, padding_mask=None, scale=None, causal=True):
        _check_padded(OP, q, k, v)
        return torch.empty_like(q), _lse_like(q, (q.shape[0], q.shape[1], q.shape[2]))

    @torch.library.register_fake("rl_align::attention_backward")
    def _attention_backward_fake(grad_out, q, k, v, out, lse, padding_mask, scale, causal):
        _check_padded("attention_backward", q, k, v)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)

    @torch.library.register_fake("rl_align::attention_varlen")
    def _attention_varlen_fake(q, k, v, cu_seqlens, max_seqlen=None, scale=None, causal=True):
        _check_varlen("attention_varlen", q, k, v)
        return torch.empty_like(q), _lse_like(q, (q.shape[1], q.shape[0]))

    @torch.library.register_fake("rl_align::attention_varlen_backward")
    def _attention_varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal):
        _check_varlen("attention_varlen_backward", q, k, v)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)

    @torch.library.register_fake("rl_align::attention_kvcache")
    def _attention_kvcache_fake(q, k_cache, v_cache, cache_seqlens, scale=None):
        _check_kvcache(q, k_cache, v_cache, cache_seqlens)
        return torch.empty_like(q), _lse_like(q, (q.shape[0], q.shape[1], q.shape[2]))
