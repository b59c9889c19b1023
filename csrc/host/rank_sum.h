// Host side of rank_sum, shared by the CPU and GPU bindings: argument checks, output allocation,
// the empty case and the operand descriptor. A Backend supplies only the kernel call:
//   static void run(const at::Tensor& ref, const RankSumOperands& a);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "../common/rank_sum.h"
#include "common.h"

namespace rl_align {

inline void check_rank_sum_args(const char* op, at::TensorList parts, std::optional<double> divisor) {
  TORCH_CHECK_VALUE(!parts.empty(), "rl_align::", op, ": parts must hold at least one tensor");
  TORCH_CHECK_VALUE(static_cast<int64_t>(parts.size()) <= kRankSumMaxParts, "rl_align::", op,
                    ": at most ", kRankSumMaxParts, " parts (ranks), got ", parts.size());
  check_dtype(op, "parts[0]", parts[0]);
  for (size_t r = 1; r < parts.size(); ++r) {
    const std::string name = "parts[" + std::to_string(r) + "]";
    TORCH_CHECK_VALUE(parts[r].sizes() == parts[0].sizes(), "rl_align::", op, ": ", name, " shape ",
                      parts[r].sizes(), " differs from parts[0] shape ", parts[0].sizes());
    check_same(op, name.c_str(), parts[r], "parts[0]", parts[0]);
  }
  if (divisor.has_value()) {
    TORCH_CHECK_VALUE(*divisor > 0, "rl_align::", op, ": divisor must be positive, got ", *divisor);
  }
}

template <typename Backend>
at::Tensor rank_sum_impl(at::TensorList parts, std::optional<double> divisor) {
  constexpr const char* op = "rank_sum";
  check_rank_sum_args(op, parts, divisor);
  at::Tensor out = at::empty(parts[0].sizes(), parts[0].options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  // Dense operands: a view's elements are read through a contiguous copy (held until the kernel ran).
  std::vector<at::Tensor> dense;
  dense.reserve(parts.size());
  RankSumOperands a;
  a.parts = static_cast<int>(parts.size());
  a.numel = out.numel();
  for (size_t r = 0; r < parts.size(); ++r) {
    dense.push_back(parts[r].contiguous());
    a.part[r] = dense.back().const_data_ptr();
  }
  a.out = out.mutable_data_ptr();
  a.divisor = divisor.has_value() ? static_cast<float>(*divisor) : 0.f;
  Backend::run(parts[0], a);
  return out;
}

}  // namespace rl_align
