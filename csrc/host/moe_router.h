// Host side of moe_router, shared by the CPU and GPU bindings: argument checks (the messages of
// rl_engine_ext/ops/moe_router.py), output allocation, the empty cases and the operand descriptor.
// A Backend supplies the kernel calls:
//   static void fwd(const at::Tensor& logits, const MoeRouterOperands& a);
//   static void bwd(const at::Tensor& logits, const MoeRouterOperands& a);
// logits rows have a dense last dimension (any row stride); every other operand is contiguous.
// The backward's expert ids are range-checked by the kernels (CPU: IndexError; GPU: a
// device-side assert).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>

#include "../common/moe_router.h"
#include "common.h"

namespace rl_align {

inline void check_moe_router_logits(const char* op, const at::Tensor& logits) {
  check_dtype(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() == 2, "rl_align::", op,
                    ": logits must be 2-D [tokens, experts], got shape ", logits.sizes());
  TORCH_CHECK_VALUE(logits.size(1) <= kMoeRouterMaxExperts, "rl_align::", op, ": ", logits.size(1),
                    " experts, more than MOE_ROUTER_MAX_EXPERTS = ", kMoeRouterMaxExperts);
}

inline void check_moe_router_top_k(const char* op, int64_t top_k, int64_t experts) {
  const int64_t most = std::min(experts, kMoeRouterMaxTopK);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= most, "rl_align::", op, ": top_k must be in [1, ", most,
                    "] (at most the ", experts, " experts and MOE_ROUTER_MAX_TOP_K = ",
                    kMoeRouterMaxTopK, "), got ", top_k);
}

inline void check_moe_router_args(const at::Tensor& logits, int64_t top_k) {
  constexpr const char* op = "moe_router";
  check_moe_router_logits(op, logits);
  check_moe_router_top_k(op, top_k, logits.size(1));
}

inline void check_moe_router_backward_args(const at::Tensor& grad_weights, const at::Tensor& logits,
                                           const at::Tensor& experts) {
  constexpr const char* op = "moe_router_backward";
  check_moe_router_logits(op, logits);
  TORCH_CHECK_VALUE(grad_weights.scalar_type() == at::kFloat, "rl_align::", op,
                    ": grad_weights must be torch.float32, got ", dtype_name(grad_weights.scalar_type()));
  TORCH_CHECK_VALUE(experts.scalar_type() == at::kLong, "rl_align::", op,
                    ": experts must be torch.int64, got ", dtype_name(experts.scalar_type()));
  TORCH_CHECK_VALUE(experts.dim() == 2 && experts.size(0) == logits.size(0), "rl_align::", op,
                    ": experts must be [tokens, top_k] with the ", logits.size(0),
                    " tokens of logits, got shape ", experts.sizes());
  TORCH_CHECK_VALUE(grad_weights.sizes() == experts.sizes(), "rl_align::", op, ": grad_weights shape ",
                    grad_weights.sizes(), " differs from experts shape ", experts.sizes());
  TORCH_CHECK(experts.device() == logits.device(), "rl_align::", op, ": experts is on ",
              experts.device(), " but logits is on ", logits.device());
  TORCH_CHECK(grad_weights.device() == logits.device(), "rl_align::", op, ": grad_weights is on ",
              grad_weights.device(), " but logits is on ", logits.device());
  check_moe_router_top_k(op, experts.size(1), logits.size(1));
}

// logits with a dense last dimension (a view when the strides allow).
inline at::Tensor moe_router_rows(const at::Tensor& logits) {
  return logits.size(1) > 1 && logits.stride(1) != 1 ? logits.contiguous() : logits;
}

// The operands both directions share: the shapes and the logits rows x (dense last dimension).
inline MoeRouterOperands moe_router_operands(Lvalue<at::Tensor> x, int64_t top_k, bool normalize) {
  MoeRouterOperands a;
  a.tokens = x->size(0);
  a.experts = x->size(1);
  a.top_k = top_k;
  a.normalize = normalize;
  a.logits = x->const_data_ptr();
  a.logits_stride = row_stride(*x);
  return a;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> moe_router_impl(const at::Tensor& logits, int64_t top_k, bool normalize) {
  check_moe_router_args(logits, top_k);
  const int64_t tokens = logits.size(0);
  at::Tensor weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor experts = at::empty({tokens, top_k}, logits.options().dtype(at::kLong));
  if (tokens == 0) return {weights, experts};
  const at::Tensor x = moe_router_rows(logits);
  MoeRouterOperands a = moe_router_operands(x, top_k, normalize);
  a.weights = weights.mutable_data_ptr<float>();
  a.experts_out = experts.mutable_data_ptr<int64_t>();
  Backend::fwd(logits, a);
  return {weights, experts};
}

template <typename Backend>
at::Tensor moe_router_backward_impl(const at::Tensor& grad_weights, const at::Tensor& logits,
                                    const at::Tensor& experts, bool normalize) {
  check_moe_router_backward_args(grad_weights, logits, experts);
  at::Tensor grad_logits = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (grad_logits.numel() == 0) return grad_logits;
  const at::Tensor x = moe_router_rows(logits);
  const at::Tensor g = grad_weights.contiguous();
  const at::Tensor ids = experts.contiguous();
  MoeRouterOperands a = moe_router_operands(x, experts.size(1), normalize);
  a.grad_weights = g.const_data_ptr<float>();
  a.experts_in = ids.const_data_ptr<int64_t>();
  a.grad_logits = grad_logits.mutable_data_ptr();
  Backend::bwd(logits, a);
  return grad_logits;
}

}  // namespace rl_align
