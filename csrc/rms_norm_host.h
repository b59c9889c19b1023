// Host-side argument checks and row views shared by the CPU and GPU bindings of rms_norm.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#include "common/rms_norm_partition.h"

namespace rl_align {

// The Python spelling (torch.bfloat16), so messages read the same as the reference path's.
inline std::string dtype_name(at::ScalarType t) {
  return std::string("torch.") + std::string(c10::getDtypeNames(t).first);
}

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Dtype policy (rl_engine_ext/contract.py): bf16, fp16 and fp32 only; anything else is a
// ValueError that names the op and the dtype.
inline void check_dtype(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(is_supported_dtype(t.scalar_type()), "rl_align::", op, ": unsupported dtype ",
                    dtype_name(t.scalar_type()), " for ", arg,
                    " (supported: torch.bfloat16, torch.float16, torch.float32)");
}

inline void check_rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                double eps) {
  check_dtype(op, "x", x);
  check_dtype(op, "weight", weight);
  TORCH_CHECK_VALUE(x.dim() >= 1, "rl_align::", op, ": x must have at least one dimension");
  TORCH_CHECK_VALUE(weight.dim() == 1, "rl_align::", op, ": weight must be 1-D, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.size(0) == x.size(-1), "rl_align::", op, ": weight has ",
                    weight.size(0), " elements but x's last dimension is ", x.size(-1));
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "rl_align::", op,
                    ": weight dtype ", dtype_name(weight.scalar_type()),
                    " differs from x dtype ", dtype_name(x.scalar_type()));
  TORCH_CHECK(weight.device() == x.device(), "rl_align::", op, ": x is on ", x.device(),
              " but weight is on ", weight.device());
  TORCH_CHECK_VALUE(eps >= 0.0, "rl_align::", op, ": eps must be >= 0, got ", eps);
}

inline void check_rms_norm_backward_args(const at::Tensor& grad_out, const at::Tensor& x,
                                         const at::Tensor& weight, double eps,
                                         const std::optional<at::Tensor>& dweight_accum) {
  constexpr const char* op = "rms_norm_backward";
  check_rms_norm_args(op, x, weight, eps);
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes(), "rl_align::", op, ": grad_out shape ",
                    grad_out.sizes(), " differs from x shape ", x.sizes());
  TORCH_CHECK_VALUE(grad_out.scalar_type() == x.scalar_type(), "rl_align::", op,
                    ": grad_out dtype ", dtype_name(grad_out.scalar_type()),
                    " differs from x dtype ", dtype_name(x.scalar_type()));
  TORCH_CHECK(grad_out.device() == x.device(), "rl_align::", op, ": grad_out is on ",
              grad_out.device(), " but x is on ", x.device());
  if (dweight_accum.has_value()) {
    const at::Tensor& acc = *dweight_accum;
    TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat, "rl_align::", op,
                      ": dweight_accum must be torch.float32, got ",
                      dtype_name(acc.scalar_type()));
    TORCH_CHECK_VALUE(acc.dim() == 1 && acc.size(0) == weight.size(0), "rl_align::", op,
                      ": dweight_accum must have shape [", weight.size(0), "], got ",
                      acc.sizes());
    TORCH_CHECK(acc.device() == x.device(), "rl_align::", op, ": dweight_accum is on ",
                acc.device(), " but x is on ", x.device());
  }
}

// Calls f(scalar_t{}) for the three supported dtypes (callers have checked the dtype).
template <typename F>
void dispatch_supported_dtype(const char* op, at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); return;
    case at::kHalf: f(at::Half{}); return;
    case at::kBFloat16: f(at::BFloat16{}); return;
    default: TORCH_CHECK_VALUE(false, "rl_align::", op, ": unsupported dtype ", dtype_name(t));
  }
}

// [..., H] -> [rows, H] with a dense last dimension: a view when the strides allow, a copy
// otherwise. Kernels take the row stride, so row-strided views (e.g. slices) are not copied.
inline at::Tensor as_rows(const at::Tensor& t) {
  const int64_t hidden = t.size(-1);
  at::Tensor rows = t.reshape({hidden == 0 ? 0 : t.numel() / hidden, hidden});
  if (hidden > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

// The row stride of an [rows, H] view; any value works for a single row or an empty tensor.
inline int64_t row_stride(const at::Tensor& rows) {
  return rows.size(0) > 1 ? rows.stride(0) : rows.size(1);
}

}  // namespace rl_align
