// Host side of rope, shared by the CPU and GPU bindings: argument checks, output allocation, the
// reduction of every layout to one RopeProblem (common/rope.h) and the empty cases. A Backend
// supplies only the kernel calls (q: the first operand, for the device):
//   static void fwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q);
//   static void bwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string_view>
#include <tuple>

#include "../common/rope.h"
#include "common.h"

namespace rl_align {

enum class RopeLayout { kBhsd, kBshd, kThd };

inline RopeStyle rope_style(const char* op, std::string_view style) {
  if (style == "neox") return RopeStyle::kNeox;
  if (style == "gptj") return RopeStyle::kGptj;
  TORCH_CHECK_VALUE(false, "rl_align::", op, ": style must be 'neox' or 'gptj', got '", style, "'");
}

inline RopeLayout rope_layout(const char* op, std::string_view layout) {
  if (layout == "bhsd") return RopeLayout::kBhsd;
  if (layout == "bshd") return RopeLayout::kBshd;
  if (layout == "thd") return RopeLayout::kThd;
  TORCH_CHECK_VALUE(false, "rl_align::", op, ": layout must be 'bhsd', 'bshd' or 'thd', got '",
                    layout, "'");
}

// q (or k) as [batch, seq, heads, head_dim]: a view.
inline at::Tensor rope_bshd_view(const at::Tensor& t, RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kBhsd: return t.permute({0, 2, 1, 3});
    case RopeLayout::kThd: return t.unsqueeze(0);
    default: return t;
  }
}

// Checks (the one C++ copy; Python: rl_engine_ext/ops/rope.py) and the layout. qn / kn name q and
// k in messages (grad_q / grad_k for the backward).
inline RopeLayout check_rope_args(const char* op, const char* qn, const at::Tensor& q,
                                  const char* kn, const at::Tensor& k, const at::Tensor& positions,
                                  const at::Tensor& inv_freq, std::string_view style,
                                  std::string_view layout_name, double scaling) {
  rope_style(op, style);
  const RopeLayout layout = rope_layout(op, layout_name);
  const int64_t dims = layout == RopeLayout::kThd ? 3 : 4;
  const char* shape_name = layout == RopeLayout::kBhsd   ? "[batch, heads, seq, head_dim]"
                           : layout == RopeLayout::kBshd ? "[batch, seq, heads, head_dim]"
                                                         : "[tokens, heads, head_dim]";
  check_dtype(op, qn, q);
  check_dtype(op, kn, k);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{qn, q}, {kn, k}}) {
    TORCH_CHECK_VALUE(t.dim() == dims, "rl_align::", op, ": ", name, " must be ", dims, "-D ",
                      shape_name, " for layout '", layout_name, "', got shape ", t.sizes());
  }
  check_same(op, kn, k, qn, q);
  TORCH_CHECK_VALUE(q.size(-1) == k.size(-1), "rl_align::", op, ": ", qn, " head_dim ", q.size(-1),
                    " differs from ", kn, " head_dim ", k.size(-1));
  const at::Tensor qv = rope_bshd_view(q, layout), kv = rope_bshd_view(k, layout);
  TORCH_CHECK_VALUE(qv.size(0) == kv.size(0) && qv.size(1) == kv.size(1), "rl_align::", op, ": ",
                    qn, " ", q.sizes(), " and ", kn, " ", k.sizes(),
                    " must have the same tokens (batch and seq)");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong,
                    "rl_align::", op, ": positions must be torch.int32 or torch.int64, got ",
                    dtype_name(positions.scalar_type()));
  if (layout == RopeLayout::kThd) {
    TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == q.size(0), "rl_align::", op,
                      ": positions must have shape [", q.size(0), "] ([tokens]), got ",
                      positions.sizes());
  } else {
    TORCH_CHECK_VALUE(positions.dim() == 2 && positions.size(0) == qv.size(0) &&
                          positions.size(1) == qv.size(1),
                      "rl_align::", op, ": positions must have shape [", qv.size(0), ", ",
                      qv.size(1), "] ([batch, seq]), got ", positions.sizes());
  }
  TORCH_CHECK(positions.device() == q.device(), "rl_align::", op, ": positions is on ",
              positions.device(), " but ", qn, " is on ", q.device());
  TORCH_CHECK_VALUE(inv_freq.scalar_type() == at::kFloat, "rl_align::", op,
                    ": inv_freq must be torch.float32, got ", dtype_name(inv_freq.scalar_type()));
  TORCH_CHECK_VALUE(inv_freq.dim() == 1, "rl_align::", op,
                    ": inv_freq must be 1-D [rotary_dim / 2], got shape ", inv_freq.sizes());
  TORCH_CHECK_VALUE(2 * inv_freq.size(0) <= q.size(-1), "rl_align::", op, ": inv_freq has ",
                    inv_freq.size(0), " frequencies but head_dim is ", q.size(-1),
                    " (rotary_dim = 2 * frequencies must be <= head_dim)");
  TORCH_CHECK(inv_freq.device() == q.device(), "rl_align::", op, ": inv_freq is on ",
              inv_freq.device(), " but ", qn, " is on ", q.device());
  TORCH_CHECK_VALUE(std::isfinite(scaling), "rl_align::", op,
                    ": attention_scaling must be finite, got ", scaling);
  return layout;
}

// A [batch, seq, heads, head_dim] view as kernel operand (the last dimension made dense); the
// caller holds both views until the kernel ran.
inline RopeOperand rope_operand(Lvalue<at::Tensor> in_bshd, Lvalue<at::Tensor> out_bshd) {
  RopeOperand o;
  o.in = in_bshd->const_data_ptr();
  o.out = out_bshd->mutable_data_ptr();
  o.heads = in_bshd->size(2);
  o.in_stride_b = in_bshd->stride(0);
  o.in_stride_s = in_bshd->stride(1);
  o.in_stride_h = in_bshd->stride(2);
  o.out_stride_b = out_bshd->stride(0);
  o.out_stride_s = out_bshd->stride(1);
  o.out_stride_h = out_bshd->stride(2);
  return o;
}

// An output is laid out as empty_like lays out its operand (its strides if dense, else dense in its
// dimension order), as torch's elementwise ops: HF's transposed projection view stays token-major,
// so neither this op nor the backward chain behind it transposes. Contiguous where that would not
// give a unit last stride (the kernels write rows of head_dim). Python: ops/rope.py.
inline at::Tensor rope_output_like(const at::Tensor& t) {
  at::Tensor out = at::empty_like(t);
  return out.dim() > 0 && out.size(-1) > 1 && out.stride(-1) != 1 ? at::empty(t.sizes(), t.options()) : out;
}

// Forward (inverse = false) and backward (inverse = true, the transposed rotation).
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rope_run(const char* op, const char* qn, const at::Tensor& q,
                                            const char* kn, const at::Tensor& k,
                                            const at::Tensor& positions, const at::Tensor& inv_freq,
                                            std::string_view style, std::string_view layout_name,
                                            double scaling, bool inverse) {
  const RopeLayout layout =
      check_rope_args(op, qn, q, kn, k, positions, inv_freq, style, layout_name, scaling);
  at::Tensor q_out = rope_output_like(q), k_out = rope_output_like(k);
  if (q.numel() == 0 && k.numel() == 0) return {q_out, k_out};
  // Strided views are read in place; only a strided last dimension is copied.
  const auto dense_last = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor qv = rope_bshd_view(dense_last(q), layout);
  const at::Tensor kv = rope_bshd_view(dense_last(k), layout);
  const at::Tensor q_out_v = rope_bshd_view(q_out, layout), k_out_v = rope_bshd_view(k_out, layout);
  const at::Tensor freqs = inv_freq.contiguous();
  RopeProblem p;
  p.operand[0] = rope_operand(qv, q_out_v);
  p.operand[1] = rope_operand(kv, k_out_v);
  p.batch = qv.size(0);
  p.seq = qv.size(1);
  p.head_dim = qv.size(3);
  p.rotary_dim = 2 * freqs.size(0);
  p.positions = positions.const_data_ptr();
  p.positions_int64 = positions.scalar_type() == at::kLong;
  p.pos_stride_b = layout == RopeLayout::kThd ? 0 : positions.stride(0);
  p.pos_stride_s = positions.stride(-1);
  p.inv_freq = freqs.const_data_ptr<float>();
  p.style = rope_style(op, style);
  p.scaling = static_cast<float>(scaling);
  if (inverse) {
    Backend::bwd(op, q.scalar_type(), p, q);
  } else {
    Backend::fwd(op, q.scalar_type(), p, q);
  }
  return {q_out, k_out};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rope_impl(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& positions, const at::Tensor& inv_freq,
                                             c10::string_view style, c10::string_view layout,
                                             double attention_scaling) {
  return rope_run<Backend>("rope", "q", q, "k", k, positions, inv_freq, style, layout,
                           attention_scaling, false);
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rope_backward_impl(const at::Tensor& grad_q,
                                                      const at::Tensor& grad_k,
                                                      const at::Tensor& positions,
                                                      const at::Tensor& inv_freq,
                                                      c10::string_view style,
                                                      c10::string_view layout,
                                                      double attention_scaling) {
  return rope_run<Backend>("rope_backward", "grad_q", grad_q, "grad_k", grad_k, positions,
                           inv_freq, style, layout, attention_scaling, true);
}

}  // namespace rl_align
