// Host side of moe_combine, shared by the CPU and GPU bindings: argument checks (the messages of
// rl_engine_ext/ops/moe_combine.py), output allocation, the empty cases, the weights in fp32 and
// the one rounding of grad_weights to weights' dtype. A Backend supplies:
//   static void check_positions(const char* op, const at::Tensor& positions, int64_t rows);
//   static void fwd(const at::Tensor& expert_out, const MoeCombineOperands& a);
//   static void owners(const char* op, const at::Tensor& positions, const at::Tensor& owner);
//   static void bwd_rows(const at::Tensor& expert_out, const MoeCombineOperands& a);
//   static void bwd_weights(const at::Tensor& expert_out, const MoeCombineOperands& a);
// positions is contiguous int64 [T, k]; owner is int64 [R], filled by `owners` with the t * k + r
// owning each row (the last in row-major order) or -1; expert_out and grad_out rows have a dense
// last dimension (any row stride); the other operands are contiguous.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>

#include "../common/moe_combine.h"
#include "common.h"

namespace rl_align {

inline void check_moe_combine_inputs(const char* op, const at::Tensor& expert_out, const at::Tensor& positions,
                                     const std::optional<at::Tensor>& weights) {
  check_dtype(op, "expert_out", expert_out);
  TORCH_CHECK_VALUE(expert_out.dim() == 2, "rl_align::", op,
                    ": expert_out must be 2-D [rows, hidden], got shape ", expert_out.sizes());
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong, "rl_align::", op,
                    ": positions must be torch.int64, got ", dtype_name(positions.scalar_type()));
  TORCH_CHECK_VALUE(positions.dim() == 2, "rl_align::", op,
                    ": positions must be 2-D [tokens, top_k], got shape ", positions.sizes());
  TORCH_CHECK(positions.device() == expert_out.device(), "rl_align::", op, ": positions is on ",
              positions.device(), " but expert_out is on ", expert_out.device());
  if (weights.has_value()) {
    check_dtype(op, "weights", *weights);
    TORCH_CHECK_VALUE(weights->sizes() == positions.sizes(), "rl_align::", op, ": weights shape ",
                      weights->sizes(), " differs from positions shape ", positions.sizes());
    TORCH_CHECK(weights->device() == expert_out.device(), "rl_align::", op, ": weights is on ",
                weights->device(), " but expert_out is on ", expert_out.device());
  }
}

inline void check_moe_combine_backward_args(const at::Tensor& grad_out, const at::Tensor& expert_out,
                                            const at::Tensor& positions,
                                            const std::optional<at::Tensor>& weights) {
  constexpr const char* op = "moe_combine_backward";
  check_moe_combine_inputs(op, expert_out, positions, weights);
  TORCH_CHECK_VALUE(grad_out.dim() == 2 && grad_out.size(0) == positions.size(0) &&
                        grad_out.size(1) == expert_out.size(1),
                    "rl_align::", op, ": grad_out shape ", grad_out.sizes(), " must be [tokens, hidden] = [",
                    positions.size(0), ", ", expert_out.size(1), "]");
  check_same(op, "grad_out", grad_out, "expert_out", expert_out);
}

// A [rows, H] matrix with a dense last dimension (a view when the strides allow).
inline at::Tensor moe_dense_rows(const at::Tensor& t) {
  return t.size(1) > 1 && t.stride(1) != 1 ? t.contiguous() : t;
}

inline at::Tensor moe_weights_fp32(const std::optional<at::Tensor>& weights) {
  return weights.has_value() ? weights->to(at::kFloat).contiguous() : at::Tensor();
}

// The operands both directions share: the shapes, expert_out rows x (dense last dimension), the
// contiguous positions and the fp32 weights w (undefined without weights).
inline MoeCombineOperands moe_combine_operands(Lvalue<at::Tensor> x, Lvalue<at::Tensor> pos, Lvalue<at::Tensor> w) {
  MoeCombineOperands a;
  a.tokens = pos->size(0);
  a.top_k = pos->size(1);
  a.rows = x->size(0);
  a.hidden = x->size(1);
  a.expert_out = x->const_data_ptr();
  a.expert_out_stride = row_stride(*x);
  a.positions = pos->const_data_ptr<int64_t>();
  a.weights = w->defined() ? w->const_data_ptr<float>() : nullptr;
  return a;
}

template <typename Backend>
at::Tensor moe_combine_impl(const at::Tensor& expert_out, const at::Tensor& positions,
                            const std::optional<at::Tensor>& weights) {
  constexpr const char* op = "moe_combine";
  check_moe_combine_inputs(op, expert_out, positions, weights);
  const int64_t tokens = positions.size(0), hidden = expert_out.size(1);
  at::Tensor out = at::empty({tokens, hidden}, expert_out.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor pos = positions.contiguous();
  Backend::check_positions(op, pos, expert_out.size(0));
  if (out.numel() == 0) return out;
  const at::Tensor x = moe_dense_rows(expert_out);
  const at::Tensor w = moe_weights_fp32(weights);
  MoeCombineOperands a = moe_combine_operands(x, pos, w);
  a.out = out.mutable_data_ptr();
  Backend::fwd(expert_out, a);
  return out;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> moe_combine_backward_impl(const at::Tensor& grad_out, const at::Tensor& expert_out,
                                                             const at::Tensor& positions,
                                                             const std::optional<at::Tensor>& weights) {
  constexpr const char* op = "moe_combine_backward";
  check_moe_combine_backward_args(grad_out, expert_out, positions, weights);
  const int64_t tokens = positions.size(0), top_k = positions.size(1);
  const int64_t rows = expert_out.size(0), hidden = expert_out.size(1);
  const auto dense = at::MemoryFormat::Contiguous;
  at::Tensor grad_x = at::empty({rows, hidden}, expert_out.options().memory_format(dense));
  at::Tensor grad_w = weights.has_value() ? at::empty({tokens, top_k}, weights->options().memory_format(dense))
                                          : at::empty({0}, expert_out.options());
  const at::Tensor pos = positions.contiguous();
  const at::Tensor owner = at::empty({rows}, pos.options());
  Backend::owners(op, pos, owner);
  const at::Tensor x = moe_dense_rows(expert_out);
  const at::Tensor g = moe_dense_rows(grad_out);
  const at::Tensor w = moe_weights_fp32(weights);
  const bool fp32_weights = weights.has_value() && weights->scalar_type() == at::kFloat;
  const at::Tensor grad_w32 = weights.has_value() && !fp32_weights
                                  ? at::empty({tokens, top_k}, grad_w.options().dtype(at::kFloat))
                                  : grad_w;
  MoeCombineOperands a = moe_combine_operands(x, pos, w);
  a.grad_out = g.const_data_ptr();
  a.grad_out_stride = row_stride(g);
  a.owner = owner.const_data_ptr<int64_t>();
  a.grad_expert_out = grad_x.mutable_data_ptr();
  if (grad_x.numel() > 0) Backend::bwd_rows(expert_out, a);
  if (weights.has_value() && tokens * top_k > 0) {
    if (hidden == 0) {
      grad_w.zero_();
    } else {
      a.grad_weights = grad_w32.mutable_data_ptr<float>();
      Backend::bwd_weights(expert_out, a);
      if (!fp32_weights) grad_w.copy_(grad_w32);  // the one rounding to weights' dtype
    }
  }
  return {grad_x, grad_w};
}

}  // namespace rl_align
