// Host side of rms_norm, shared by the CPU and GPU bindings: argument checks, output allocation,
// the empty cases and the row views. A Backend supplies only the kernel calls:
//   static void check_input(const char* op, const at::Tensor& x);   // the backend's own limits
//   static void fwd(const char* op, const at::Tensor& x_rows, const at::Tensor& weight,
//                   const at::Tensor& y_rows, float eps);
//   static void bwd(const char* op, const at::Tensor& grad_out_rows, const at::Tensor& x_rows,
//                   const at::Tensor& weight, const at::Tensor& grad_x_rows,
//                   const float* dweight_accum, const at::Tensor& dweight, float eps);
// Row views are [rows, hidden] with a dense last dimension (as_rows); weight is contiguous;
// dweight_accum is null or a contiguous fp32 [hidden].
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <tuple>

#include "../common/rms_norm_partition.h"
#include "common.h"

namespace rl_align {

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

template <typename Backend>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_rms_norm_args(op, x, weight, eps);
  Backend::check_input(op, x);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return y;
  const at::Tensor xr = as_rows(x);
  const at::Tensor w = weight.contiguous();
  const at::Tensor yr = y.view({xr.size(0), xr.size(1)});
  Backend::fwd(op, xr, w, yr, static_cast<float>(eps));
  return y;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& dweight_accum) {
  constexpr const char* op = "rms_norm_backward";
  check_rms_norm_backward_args(grad_out, x, weight, eps, dweight_accum);
  Backend::check_input(op, x);
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t hidden = x.size(-1);
  at::Tensor dweight = at::empty({hidden}, x.options().dtype(at::kFloat));
  if (hidden == 0) return {dx, dweight};
  const at::Tensor acc = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  const at::Tensor xr = as_rows(x);
  const at::Tensor gr = as_rows(grad_out);
  const at::Tensor dxr = dx.view({xr.size(0), hidden});
  const at::Tensor w = weight.contiguous();
  Backend::bwd(op, gr, xr, w, dxr, acc.defined() ? acc.const_data_ptr<float>() : nullptr, dweight,
               static_cast<float>(eps));
  return {dx, dweight};
}

}  // namespace rl_align
