// Host side of the attention ops, shared by the CPU and GPU bindings: argument checks, the
// reduction of each layout (padded batch, packed varlen, KV cache) to one AttentionProblem, and
// the empty-shape cases.
//
// A Backend supplies:
//   static bool needs_aligned_operands(at::ScalarType dtype, int64_t head_dim, const at::Tensor& like);
//   static void fwd(const char* op, at::ScalarType dtype, const AttentionProblem& p, const at::Tensor& like);
//   static void bwd(const char* op, at::ScalarType dtype, const AttentionGradProblem& p, const at::Tensor& like);
// p.seqs points into a tensor on the inputs' device.
//
// Sequence lengths (padding mask, cu_seqlens, cache lengths) are read on the host: they are
// validated there, because a mask whose tokens are not one run, or a cu_seqlens that is not
// monotone, would otherwise give a silently wrong answer. That is one device-to-host copy per call.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../common/attention_problem.h"
#include "../common/attention_scale.h"
#include "common.h"

namespace rl_align {

// ------------------------------------------------------------------------------------------------
// Checks
// ------------------------------------------------------------------------------------------------

// kn / vn: what k and v are called in op's schema (k, v; k_cache, v_cache).
inline void check_attention_qkv(const char* op, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, int64_t dims, const char* layout, const char* kn = "k",
                                const char* vn = "v") {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {kn, k}, {vn, v}}) {
    check_dtype(op, name, t);
    TORCH_CHECK_VALUE(t.dim() == dims, "rl_align::", op, ": ", name, " must be ", dims, "-D ",
                      layout, ", got shape ", t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), "rl_align::", op, ": ", name, " dtype ",
                      dtype_name(t.scalar_type()), " differs from q dtype ", dtype_name(q.scalar_type()));
    TORCH_CHECK(t.device() == q.device(), "rl_align::", op, ": ", name, " is on ", t.device(),
                " but q is on ", q.device());
  }
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "rl_align::", op, ": ", kn, " ", k.sizes(), " and ", vn, " ",
                    v.sizes(), " must have the same shape");
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(k.size(-1) == d, "rl_align::", op, ": q head_dim ", d, " differs from ", kn, " head_dim ",
                    k.size(-1));
  TORCH_CHECK_VALUE(d >= 1, "rl_align::", op, ": head_dim must be >= 1");
  const int64_t hq = q.size(1), hkv = k.size(1);  // heads are dimension 1 in every layout
  TORCH_CHECK_VALUE(hkv >= 1 && hq % hkv == 0, "rl_align::", op, ": query heads (", hq,
                    ") must be a positive multiple of key/value heads (", hkv, ")");
}

// attention_scale (common/attention_scale.h), which must be finite.
inline double checked_attention_scale(const char* op, const std::optional<double>& scale, int64_t head_dim) {
  const double s = attention_scale(scale, head_dim);
  TORCH_CHECK_VALUE(std::isfinite(s), "rl_align::", op, ": scale must be finite, got ", s);
  return s;
}

// A tensor read as sequence lengths (padding mask, cu_seqlens, cache lengths): on q's device, bool
// or integer.
inline void check_index_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), "rl_align::", op, ": ", name, " is on ", t.device(),
              " but q is on ", like.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBool || at::isIntegralType(t.scalar_type(), false),
                    "rl_align::", op, ": ", name, " must be a bool or integer tensor, got ",
                    dtype_name(t.scalar_type()));
}

// A per-sequence count or offset (cu_seqlens, cache_seqlens, cache_starts): int32 or int64 (a bool
// would read as lengths 0 and 1), on q's device.
inline void check_lengths_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "rl_align::", op, ": ", name,
                    " must be torch.int32 or torch.int64, got ", dtype_name(t.scalar_type()));
  check_index_tensor(op, name, t, q);
}

inline void check_max_seqlen(const char* op, std::optional<int64_t> max_seqlen) {
  TORCH_CHECK_VALUE(!max_seqlen.has_value() || *max_seqlen >= 0, "rl_align::", op, ": max_seqlen must be >= 0, got ",
                    *max_seqlen);
}

// A sequence-lengths tensor copied to the host as int64.
inline std::vector<int64_t> host_int64(const char* op, const char* name, const at::Tensor& t,
                                       const at::Tensor& like) {
  check_index_tensor(op, name, t, like);
  const at::Tensor h = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(h.const_data_ptr<int64_t>(), h.const_data_ptr<int64_t>() + h.numel());
}

// ------------------------------------------------------------------------------------------------
// Operands
// ------------------------------------------------------------------------------------------------

// Kernels read every operand as dense rows of head_dim elements with int64 token/head strides.
// An operand that is not (last dim strided, overlapping, or — for the tensor-core paths — not
// 16-byte aligned) is copied into a fresh tensor: same values, same arithmetic.
inline at::Tensor attention_operand(const at::Tensor& t, bool aligned) {
  bool ok = t.stride(-1) == 1 && t.is_non_overlapping_and_dense();
  if (ok && aligned) {
    const int64_t elem = t.element_size();
    ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
    for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) * elem) % 16 == 0;
  }
  if (ok) return t;
  // A dense tensor keeps its strides (a fresh allocation is aligned), others become contiguous:
  // the output then has the layout the fake kernels promise (empty_like(q)).
  const bool dense = t.stride(-1) == 1 && t.is_non_overlapping_and_dense();
  return (dense ? at::empty_like(t) : at::empty(t.sizes(), t.options())).copy_(t);
}

// `t` in exactly the strides of `like` (gradients and saved outputs must share q's offsets).
inline at::Tensor same_layout(const at::Tensor& t, const at::Tensor& like) {
  if (t.strides() == like.strides() && t.storage_offset() == like.storage_offset()) return t;
  return at::empty_like(like).copy_(t);
}

// Descriptors built on the host, followed by the zero status words (kAttentionSeqStatusWords), on
// like's device through Backend::to_device (no stream synchronisation on CUDA).
template <typename Backend>
at::Tensor seqs_tensor(std::vector<int64_t> seqs, const at::Tensor& like) {
  seqs.insert(seqs.end(), kAttentionSeqStatusWords, 0);
  return Backend::to_device(at::tensor(seqs, at::TensorOptions().dtype(at::kLong)), like);
}

struct SeqDesc {
  int64_t q_base, kv_base, lse_base, q_len, kv_len;
};

inline std::vector<int64_t> flatten(const std::vector<SeqDesc>& d) {
  std::vector<int64_t> out;
  out.reserve(d.size() * kAttentionSeqFields);
  for (const SeqDesc& s : d) out.insert(out.end(), {s.q_base, s.kv_base, s.lse_base, s.q_len, s.kv_len});
  return out;
}

// The sequence count and upper bounds of the lengths: what the grids are sized from.
struct SeqBounds {
  int64_t num_seqs, max_q_len, max_kv_len;
};

inline SeqBounds seq_bounds(const std::vector<SeqDesc>& seqs) {
  SeqBounds b{static_cast<int64_t>(seqs.size()), 0, 0};
  for (const SeqDesc& s : seqs) {
    b.max_q_len = std::max(b.max_q_len, s.q_len);
    b.max_kv_len = std::max(b.max_kv_len, s.kv_len);
  }
  return b;
}

// What the kernels get: the descriptors ([num_seqs][kAttentionSeqFields] int64 and the zero
// status words, on q's device; undefined when no query exists) within their bounds.
struct DeviceSeqs {
  SeqBounds bounds;
  at::Tensor seqs;
};

// From descriptors built on the host.
template <typename Backend>
DeviceSeqs host_seqs(const std::vector<SeqDesc>& seqs, const at::Tensor& q) {
  const SeqBounds b = seq_bounds(seqs);
  return {b, q.numel() == 0 || b.max_q_len == 0 ? at::Tensor() : seqs_tensor<Backend>(flatten(seqs), q)};
}

// The problem for operands q (and out) [.., Hq, .., D] and k/v [.., Hkv, .., D] with the given
// token and head strides (in elements) and lse head stride. It points into d.seqs, q, k and v: the
// caller holds them until the kernel ran.
inline AttentionProblem make_problem(Lvalue<DeviceSeqs> seqs, Lvalue<at::Tensor> q_operand,
                                     Lvalue<at::Tensor> k_operand, Lvalue<at::Tensor> v_operand,
                                     int64_t q_token_dim, int64_t q_head_dim, int64_t lse_stride_head,
                                     double scale, bool causal) {
  const DeviceSeqs& d = *seqs;
  const at::Tensor &q = *q_operand, &k = *k_operand, &v = *v_operand;
  AttentionProblem p;
  p.num_seqs = d.bounds.num_seqs;
  p.heads_q = q.size(q_head_dim);
  p.heads_kv = k.size(q_head_dim);
  p.head_dim = q.size(-1);
  p.max_q_len = d.bounds.max_q_len;
  p.max_kv_len = d.bounds.max_kv_len;
  p.seqs = d.seqs.const_data_ptr<int64_t>();
  p.status = d.seqs.mutable_data_ptr<int64_t>() + p.num_seqs * kAttentionSeqFields;
  p.q = q.const_data_ptr();
  p.q_stride_token = q.stride(q_token_dim);
  p.q_stride_head = q.stride(q_head_dim);
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.kv_stride_token = k.stride(q_token_dim);
  p.kv_stride_head = k.stride(q_head_dim);
  p.q_elements = q.numel();
  p.kv_elements = k.numel();
  p.q_stride_outer = q.size(0) > 1 ? q.stride(0) : 0;
  p.kv_stride_outer = k.size(0) > 1 ? k.stride(0) : 0;
  p.lse_stride_head = lse_stride_head;
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  return p;
}

// ------------------------------------------------------------------------------------------------
// Layouts -> sequences
// ------------------------------------------------------------------------------------------------

// Padded batch q [B, Hq, S, D], k/v [B, Hkv, S, D]; the mask [B, S] marks real tokens, which must
// form one run per row (left or right padding). Sequence b is that run; its positions start at 0.
inline std::vector<SeqDesc> padded_seqs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                        const std::optional<at::Tensor>& mask, bool* any_padding) {
  const int64_t b = q.size(0), hq = q.size(1), s = q.size(2);
  std::vector<int64_t> m;
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->dim() == 2 && mask->size(0) == b && mask->size(1) == s, "rl_align::", op,
                      ": padding_mask must have shape [", b, ", ", s, "] ([batch, seq]), got ",
                      mask->sizes());
    m = host_int64(op, "padding_mask", *mask, q);
  }
  std::vector<SeqDesc> seqs;
  seqs.reserve(b);
  *any_padding = false;
  for (int64_t i = 0; i < b; ++i) {
    int64_t first = 0, len = s;
    if (!m.empty()) {
      const int64_t* row = m.data() + i * s;
      first = 0;
      while (first < s && row[first] == 0) ++first;
      int64_t last = first;
      while (last < s && row[last] != 0) ++last;
      len = last - first;
      for (int64_t j = last; j < s; ++j) {
        TORCH_CHECK_VALUE(row[j] == 0, "rl_align::", op, ": padding_mask row ", i,
                          " has padding inside the sequence (position ", j,
                          "); real tokens must be one run (left or right padding)");
      }
      *any_padding = *any_padding || len != s;
    }
    seqs.push_back({i * q.stride(0) + first * q.stride(2), i * k.stride(0) + first * k.stride(2),
                    i * hq * s + first, len, len});
  }
  return seqs;
}

// The descriptors of sequences given by their lengths (SeqsFromLengths), each length checked
// on the host: a ValueError naming the bad one. The device builds the same (attention_kernels.h).
inline std::vector<SeqDesc> seqs_from_lengths(const char* op, const std::vector<int64_t>& lengths,
                                              const std::vector<int64_t>& cache_starts, const SeqsFromLengths& sp) {
  std::vector<SeqDesc> seqs;
  seqs.reserve(sp.num_seqs);
  if (sp.packed) {
    TORCH_CHECK_VALUE(lengths.front() == 0 && lengths.back() == sp.total_tokens, "rl_align::", op,
                      ": cu_seqlens must start at 0 and end at the token count ", sp.total_tokens, ", got ",
                      lengths.front(), " ... ", lengths.back());
  }
  for (int64_t i = 0; i < sp.num_seqs; ++i) {
    const int64_t start = sp.packed ? lengths[i] : i;
    const int64_t kv_len = sp.packed ? lengths[i + 1] - start : lengths[i];
    const int64_t q_len = sp.packed ? kv_len : std::min(sp.new_tokens, kv_len);
    if (sp.packed) {
      TORCH_CHECK_VALUE(kv_len >= 0, "rl_align::", op, ": cu_seqlens must be non-decreasing, got ", start,
                        " then ", lengths[i + 1]);
      TORCH_CHECK_VALUE(kv_len <= sp.max_len, "rl_align::", op, ": sequence ", i, " has ", kv_len,
                        " tokens, more than max_seqlen = ", sp.max_len);
    } else {
      const int64_t min_len = kvcache_min_length(sp.new_tokens);
      TORCH_CHECK_VALUE(kv_len >= min_len && kv_len <= sp.max_len, "rl_align::", op, ": cache_seqlens[", i, "] = ",
                        kv_len, " must be within [", min_len, ", ", sp.max_len, "] (", sp.new_tokens,
                        " new tokens, a cache of ", sp.max_len, " positions)");
    }
    const int64_t kv_first = cache_starts.empty() ? 0 : cache_starts[i];
    TORCH_CHECK_VALUE(kv_first >= 0 && kv_first <= sp.max_len - kv_len, "rl_align::", op, ": cache_starts[", i,
                      "] = ", kv_first, " with cache_seqlens[", i, "] = ", kv_len, " does not fit the cache (",
                      sp.max_len, " positions)");
    const int64_t padding_queries = sp.packed ? 0 : sp.new_tokens - q_len;
    seqs.push_back({start * sp.q_stride + padding_queries * sp.q_token_stride,
                    start * sp.kv_stride + kv_first * sp.kv_position_stride,
                    start * sp.lse_stride + padding_queries, q_len, kv_len});
  }
  return seqs;
}

// Packed q [T, Hq, D], k/v [T, Hkv, D]; cu_seqlens [B + 1]: sequence i is tokens
// cu[i] .. cu[i+1]-1, at most max_seqlen of them (if given). lse is [Hq, T].
inline SeqsFromLengths varlen_lengths(const char* op, const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& cu_seqlens, std::optional<int64_t> max_seqlen) {
  TORCH_CHECK_VALUE(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "rl_align::", op,
                    ": cu_seqlens must be 1-D [num_seqs + 1], got shape ", cu_seqlens.sizes());
  check_lengths_tensor(op, "cu_seqlens", cu_seqlens, q);
  check_max_seqlen(op, max_seqlen);
  SeqsFromLengths sp;
  sp.packed = true;
  sp.num_seqs = cu_seqlens.size(0) - 1;
  sp.q_stride = q.stride(0);
  sp.kv_stride = k.stride(0);
  sp.lse_stride = 1;
  sp.max_len = max_seqlen.value_or(std::numeric_limits<int64_t>::max());
  sp.total_tokens = q.size(0);
  return sp;
}

// ------------------------------------------------------------------------------------------------
// Ops
// ------------------------------------------------------------------------------------------------

inline void check_padded(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_attention_qkv(op, q, k, v, 4, "[batch, heads, seq, head_dim]");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2), "rl_align::", op, ": q ",
                    q.sizes(), " and k ", k.sizes(), " must agree in batch and seq");
}

inline void check_varlen(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_attention_qkv(op, q, k, v, 3, "[tokens, heads, head_dim]");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0), "rl_align::", op, ": q ", q.sizes(), " and k ",
                    k.sizes(), " must have the same token count");
}

// q, k, v as the kernels read them (see attention_operand); v shares k's strides.
struct AttentionOperands {
  at::Tensor q, k, v;
};

template <typename Backend>
AttentionOperands attention_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const bool aligned = Backend::needs_aligned_operands(q.scalar_type(), q.size(-1), q);
  const at::Tensor kn = attention_operand(k, aligned);
  return {attention_operand(q, aligned), kn, same_layout(attention_operand(v, aligned), kn)};
}

// Where a layout keeps its token and head dimensions, and its lse.
struct AttentionLayout {
  int64_t token_dim, head_dim;
  std::vector<int64_t> lse_shape;
  int64_t lse_stride_head;
};

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_fwd_common(const char* op, const AttentionOperands& x,
                                                        const DeviceSeqs& d, const AttentionLayout& layout,
                                                        double scale,
                                                        bool causal, bool any_padding) {
  const at::Tensor& q = x.q;
  // Rows no sequence owns (padding) are never written by the kernels: zero output, lse = -inf
  // (the log-sum-exp of no keys).
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor out = any_padding ? at::zeros_like(q) : at::empty_like(q);
  at::Tensor lse = any_padding ? at::full(layout.lse_shape, -std::numeric_limits<float>::infinity(), f32)
                               : at::empty(layout.lse_shape, f32);
  if (q.numel() == 0 || d.bounds.max_q_len == 0) return {out, lse};
  AttentionProblem p = make_problem(d, q, x.k, x.v, layout.token_dim, layout.head_dim,
                                    layout.lse_stride_head, scale, causal);
  p.out = out.mutable_data_ptr();
  p.lse = lse.mutable_data_ptr<float>();
  Backend::fwd(op, q.scalar_type(), p, q);
  return {out, lse};
}

inline void check_backward_extras(const char* op, const at::Tensor& grad_out, const at::Tensor& out,
                                  const at::Tensor& lse, const at::Tensor& q,
                                  at::IntArrayRef lse_shape) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"grad_out", grad_out}, {"out", out}}) {
    TORCH_CHECK_VALUE(t.sizes() == q.sizes(), "rl_align::", op, ": ", name, " shape ", t.sizes(),
                      " differs from q shape ", q.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), "rl_align::", op, ": ", name, " dtype ",
                      dtype_name(t.scalar_type()), " differs from q dtype ", dtype_name(q.scalar_type()));
    TORCH_CHECK(t.device() == q.device(), "rl_align::", op, ": ", name, " is on ", t.device(),
                " but q is on ", q.device());
  }
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.sizes() == lse_shape, "rl_align::", op,
                    ": lse must be torch.float32 of shape ", lse_shape, ", got ",
                    dtype_name(lse.scalar_type()), " ", lse.sizes());
  TORCH_CHECK(lse.device() == q.device(), "rl_align::", op, ": lse is on ", lse.device(),
              " but q is on ", q.device());
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_common(
    const char* op, const AttentionOperands& x, const at::Tensor& grad_out, const at::Tensor& out,
    const at::Tensor& lse, const DeviceSeqs& d, const AttentionLayout& layout, double scale, bool causal,
    bool any_padding) {
  const at::Tensor& q = x.q;
  // Padding rows and keys get zero gradients: the kernels write only the sequences' tokens, and
  // keys of no sequence are written by no one.
  at::Tensor dq = any_padding ? at::zeros_like(q) : at::empty_like(q);
  at::Tensor dk = any_padding ? at::zeros_like(x.k) : at::empty_like(x.k);
  at::Tensor dv = any_padding ? at::zeros_like(x.k) : at::empty_like(x.k);
  if (q.numel() == 0 || d.bounds.max_q_len == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const at::Tensor don = same_layout(grad_out, q);
  const at::Tensor on = same_layout(out, q);
  const at::Tensor lsen = lse.contiguous();
  at::Tensor delta = at::empty_like(lsen);
  AttentionGradProblem g;
  g.fwd = make_problem(d, q, x.k, x.v, layout.token_dim, layout.head_dim,
                       layout.lse_stride_head, scale, causal);
  // The kernels only read these two through the gradient problem.
  g.fwd.out = const_cast<void*>(on.const_data_ptr());
  g.fwd.lse = const_cast<float*>(lsen.const_data_ptr<float>());
  g.dout = don.const_data_ptr();
  g.dq = dq.mutable_data_ptr();
  g.dk = dk.mutable_data_ptr();
  g.dv = dv.mutable_data_ptr();
  g.delta = delta.mutable_data_ptr<float>();
  Backend::bwd(op, q.scalar_type(), g, q);
  return {dq, dk, dv};
}

// attention_varlen's descriptors. validate: cu_seqlens read and checked on the host. Without:
// built and checked on the device, the grids sized from max_seqlen (then required).
template <typename Backend>
DeviceSeqs varlen_seqs(const char* op, const AttentionOperands& x, const at::Tensor& cu_seqlens,
                       std::optional<int64_t> max_seqlen, bool validate) {
  if (validate) Backend::refuse_graph_capture(op);
  const SeqsFromLengths sp = varlen_lengths(op, x.q, x.k, cu_seqlens, max_seqlen);
  if (validate) return host_seqs<Backend>(seqs_from_lengths(op, host_int64(op, "cu_seqlens", cu_seqlens, x.q), {}, sp), x.q);
  TORCH_CHECK_VALUE(max_seqlen.has_value(), "rl_align::", op,
                    ": validate=False needs max_seqlen (the grid is sized from it; no length is read on the host)");
  TORCH_CHECK_VALUE(sp.num_seqs > 0 || sp.total_tokens == 0, "rl_align::", op, ": cu_seqlens of shape [1] holds no ",
                    "sequence for ", sp.total_tokens, " tokens");
  return {SeqBounds{sp.num_seqs, *max_seqlen, *max_seqlen}, Backend::device_seqs(op, cu_seqlens, std::nullopt, sp)};
}

inline AttentionLayout padded_layout(const at::Tensor& q) {
  return {2, 1, {q.size(0), q.size(1), q.size(2)}, q.size(2)};
}

inline AttentionLayout varlen_layout(const at::Tensor& q) {
  return {0, 1, {q.size(1), q.size(0)}, q.size(0)};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_impl(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v,
                                                  const std::optional<at::Tensor>& padding_mask,
                                                  std::optional<double> scale, bool causal) {
  constexpr const char* op = "attention";
  Backend::refuse_graph_capture(op);
  check_padded(op, q, k, v);
  const double s = checked_attention_scale(op, scale, q.size(3));
  const AttentionOperands x = attention_operands<Backend>(q, k, v);
  bool any_padding = false;
  const std::vector<SeqDesc> seqs = padded_seqs(op, x.q, x.k, padding_mask, &any_padding);
  return attention_fwd_common<Backend>(op, x, host_seqs<Backend>(seqs, x.q), padded_layout(q), s, causal,
                                       any_padding);
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& padding_mask,
    double scale, bool causal) {
  constexpr const char* op = "attention_backward";
  Backend::refuse_graph_capture(op);
  check_padded(op, q, k, v);
  const AttentionLayout layout = padded_layout(q);
  check_backward_extras(op, grad_out, out, lse, q, layout.lse_shape);
  const AttentionOperands x = attention_operands<Backend>(q, k, v);
  bool any_padding = false;
  const std::vector<SeqDesc> seqs = padded_seqs(op, x.q, x.k, padding_mask, &any_padding);
  return attention_bwd_common<Backend>(op, x, grad_out, out, lse, host_seqs<Backend>(seqs, x.q), layout,
                                       checked_attention_scale(op, scale, q.size(3)), causal, any_padding);
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_varlen_impl(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v,
                                                         const at::Tensor& cu_seqlens,
                                                         std::optional<int64_t> max_seqlen,
                                                         std::optional<double> scale, bool causal,
                                                         bool validate) {
  constexpr const char* op = "attention_varlen";
  check_varlen(op, q, k, v);
  const double s = checked_attention_scale(op, scale, q.size(2));
  const AttentionOperands x = attention_operands<Backend>(q, k, v);
  return attention_fwd_common<Backend>(op, x, varlen_seqs<Backend>(op, x, cu_seqlens, max_seqlen, validate),
                                       varlen_layout(q), s, causal, false);
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens,
    std::optional<int64_t> max_seqlen, double scale, bool causal, bool validate) {
  constexpr const char* op = "attention_varlen_backward";
  check_varlen(op, q, k, v);
  const AttentionLayout layout = varlen_layout(q);
  check_backward_extras(op, grad_out, out, lse, q, layout.lse_shape);
  const double s = checked_attention_scale(op, scale, q.size(2));
  const AttentionOperands x = attention_operands<Backend>(q, k, v);
  return attention_bwd_common<Backend>(op, x, grad_out, out, lse,
                                       varlen_seqs<Backend>(op, x, cu_seqlens, max_seqlen, validate), layout, s,
                                       causal, false);
}

// KV cache: q [B, Hq, n, D] holds positions kv_len[b]-n .. kv_len[b]-1 of sequence b (those before
// 0, when a chunk of n > 1 starts before the sequence does, are padding: out 0, lse -inf), whose keys
// and values 0 .. kv_len[b]-1 are in k_cache/v_cache [B, Hkv, S_max, D] (the new ones included),
// at cache positions start[b] .. start[b]+kv_len[b]-1 (start = cache_starts, or 0: a left-padded
// cache is read in place; positions, blocks and splits count from the sequence's own key 0).
// validate: the lengths are read and checked on the host (a ValueError), one device-to-host copy.
// Without: the descriptors are built on the device from cache_seqlens and the Backend checks the
// lengths where they are (CUDA: a device-side assert), so a decode step has no host
// synchronisation and can be captured in a CUDA graph; the kernels' grids come from the shapes
// (n queries per sequence, at most S_max keys), every sequence's loop stops at its own length.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> attention_kvcache_impl(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache,
                                                          const at::Tensor& cache_seqlens,
                                                          std::optional<double> scale, bool validate,
                                                          const std::optional<at::Tensor>& cache_starts) {
  constexpr const char* op = "attention_kvcache";
  check_attention_qkv(op, q, k_cache, v_cache, 4, "[batch, heads, seq, head_dim]", "k_cache", "v_cache");
  TORCH_CHECK_VALUE(k_cache.size(0) == q.size(0), "rl_align::", op, ": q ", q.sizes(), " and k_cache ",
                    k_cache.sizes(), " must have the same batch size");
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == q.size(0), "rl_align::", op,
                    ": cache_seqlens must have shape [", q.size(0), "], got ", cache_seqlens.sizes());
  const double s = checked_attention_scale(op, scale, q.size(3));
  const int64_t batch = q.size(0), n = q.size(2), s_max = k_cache.size(2);
  TORCH_CHECK_VALUE(n <= s_max, "rl_align::", op, ": q's ", n, " new tokens do not fit the cache (", s_max,
                    " positions)");
  check_lengths_tensor(op, "cache_seqlens", cache_seqlens, q);
  if (cache_starts) {
    TORCH_CHECK_VALUE(cache_starts->dim() == 1 && cache_starts->size(0) == q.size(0), "rl_align::", op,
                      ": cache_starts must have shape [", q.size(0), "], got ", cache_starts->sizes());
    check_lengths_tensor(op, "cache_starts", *cache_starts, q);
  }
  if (validate) Backend::refuse_graph_capture(op);
  const AttentionOperands x = attention_operands<Backend>(q, k_cache, v_cache);
  SeqsFromLengths sp;
  sp.num_seqs = batch;
  sp.q_stride = x.q.stride(0);
  sp.kv_stride = x.k.stride(0);
  sp.lse_stride = q.size(1) * n;
  sp.new_tokens = n;
  sp.q_token_stride = x.q.stride(2);
  sp.kv_position_stride = x.k.stride(2);
  sp.max_len = s_max;
  const DeviceSeqs d =
      validate ? host_seqs<Backend>(seqs_from_lengths(op, host_int64(op, "cache_seqlens", cache_seqlens, q),
                                                      cache_starts ? host_int64(op, "cache_starts", *cache_starts, q)
                                                                   : std::vector<int64_t>{},
                                                      sp),
                                    x.q)
               : DeviceSeqs{SeqBounds{batch, n, s_max}, Backend::device_seqs(op, cache_seqlens, cache_starts, sp)};
  // Chunks may start before a sequence does (padding queries): their rows keep out 0, lse -inf.
  return attention_fwd_common<Backend>(op, x, d, padded_layout(q), s, true, n > 1);
}

}  // namespace rl_align
