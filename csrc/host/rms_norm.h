// Host side of rms_norm, shared by the CPU and GPU bindings: argument checks, output allocation,
// the empty cases and the row views, in a flow that add_rms_norm (host/add_rms_norm.h) shares: one
// kernel normalises a row with or without the residual add. A Backend supplies only the kernel
// calls (one Backend serves both families):
//   static void check_input(const char* op, const at::Tensor& x);   // the backend's own limits
//   static void fwd(const char* op, const at::Tensor& x_rows, const at::Tensor& residual_rows,
//                   const at::Tensor& weight, const at::Tensor& y_rows,
//                   const at::Tensor& new_residual_rows, float eps, RmsNormMode mode);
//   static void bwd(const char* op, const at::Tensor& grad_out_rows,
//                   const at::Tensor& grad_residual_rows, const at::Tensor& x_rows,
//                   const at::Tensor& weight, const at::Tensor& grad_x_rows,
//                   const float* dweight_accum, const at::Tensor& dweight, float eps,
//                   RmsNormMode mode);
// Row views are [rows, hidden] with a dense last dimension (as_rows); the residual views are
// undefined tensors for rms_norm (and for add_rms_norm_backward without grad_residual); weight is
// contiguous; dweight_accum is null or a contiguous fp32 [hidden].
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>

#include "../common/rms_norm_mode.h"
#include "../common/rms_norm_partition.h"
#include "common.h"

namespace rl_align {

inline RmsNormMode parse_rms_norm_mode(const char* op, c10::string_view mode) {
  for (int m = 0; m < kRmsNormModes; ++m) {
    if (mode == kRmsNormModeNames[m]) return static_cast<RmsNormMode>(m);
  }
  TORCH_CHECK_VALUE(false, "rl_align::", op, ": mode must be 'fp32', 'llama' or 'gemma', got '",
                    std::string(mode), "'");
}

// `x_name`: what the normalised input is called in op's schema (x, new_residual).
inline void check_rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                double eps, const char* x_name = "x") {
  check_dtype(op, x_name, x);
  check_dtype(op, "weight", weight);
  TORCH_CHECK_VALUE(x.dim() >= 1, "rl_align::", op, ": ", x_name,
                    " must have at least one dimension");
  TORCH_CHECK_VALUE(weight.dim() == 1, "rl_align::", op, ": weight must be 1-D, got shape ",
                    weight.sizes());
  TORCH_CHECK_VALUE(weight.size(0) == x.size(-1), "rl_align::", op, ": weight has ",
                    weight.size(0), " elements but ", x_name, "'s last dimension is ", x.size(-1));
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "rl_align::", op,
                    ": weight dtype ", dtype_name(weight.scalar_type()), " differs from ", x_name,
                    " dtype ", dtype_name(x.scalar_type()));
  TORCH_CHECK(weight.device() == x.device(), "rl_align::", op, ": ", x_name, " is on ",
              x.device(), " but weight is on ", weight.device());
  TORCH_CHECK_VALUE(eps >= 0.0, "rl_align::", op, ": eps must be >= 0, got ", eps);
}

// A tensor of x's shape, dtype and device (grad_out, residual, grad_residual).
inline void check_like_x(const char* op, const char* name, const at::Tensor& t,
                         const char* x_name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.sizes() == x.sizes(), "rl_align::", op, ": ", name, " shape ", t.sizes(),
                    " differs from ", x_name, " shape ", x.sizes());
  check_same(op, name, t, x_name, x);
}

inline void check_rms_norm_backward_args(const char* op, const at::Tensor& grad_out,
                                         const char* grad_name, const at::Tensor& x,
                                         const char* x_name, const at::Tensor& weight, double eps,
                                         const std::optional<at::Tensor>& dweight_accum) {
  check_rms_norm_args(op, x, weight, eps, x_name);
  check_like_x(op, grad_name, grad_out, x_name, x);
  if (dweight_accum.has_value()) {
    const at::Tensor& acc = *dweight_accum;
    TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat, "rl_align::", op,
                      ": dweight_accum must be torch.float32, got ",
                      dtype_name(acc.scalar_type()));
    TORCH_CHECK_VALUE(acc.dim() == 1 && acc.size(0) == weight.size(0), "rl_align::", op,
                      ": dweight_accum must have shape [", weight.size(0), "], got ",
                      acc.sizes());
    TORCH_CHECK(acc.device() == x.device(), "rl_align::", op, ": dweight_accum is on ",
                acc.device(), " but ", x_name, " is on ", x.device());
  }
}

// y (and, with a residual, new_residual = round(x + residual)), both contiguous in x's shape.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_common(const char* op, const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           c10::string_view mode) {
  check_rms_norm_args(op, x, weight, eps);
  if (residual.defined()) check_like_x(op, "residual", residual, "x", x);
  const RmsNormMode m = parse_rms_norm_mode(op, mode);
  Backend::check_input(op, x);
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor y = at::empty(x.sizes(), options);
  at::Tensor new_residual = residual.defined() ? at::empty(x.sizes(), options) : at::Tensor();
  if (x.numel() == 0) return {y, new_residual};
  const at::Tensor xr = as_rows(x);
  const auto rows_of = [&](const at::Tensor& t) {
    return t.defined() ? t.view({xr.size(0), xr.size(1)}) : at::Tensor();
  };
  Backend::fwd(op, xr, residual.defined() ? as_rows(residual) : at::Tensor(), weight.contiguous(),
               rows_of(y), rows_of(new_residual), static_cast<float>(eps), m);
  return {y, new_residual};
}

template <typename Backend>
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                         c10::string_view mode) {
  return std::get<0>(rms_norm_forward_common<Backend>("rms_norm", x, at::Tensor(), weight, eps, mode));
}

// (grad_x, dweight fp32); grad_residual (add_rms_norm_backward) is added to the rounded grad_x.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_common(
    const char* op, const char* grad_name, const char* x_name, const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_residual, const at::Tensor& x, const at::Tensor& weight,
    double eps, const std::optional<at::Tensor>& dweight_accum, c10::string_view mode) {
  check_rms_norm_backward_args(op, grad_out, grad_name, x, x_name, weight, eps, dweight_accum);
  if (grad_residual.has_value()) check_like_x(op, "grad_residual", *grad_residual, x_name, x);
  const RmsNormMode m = parse_rms_norm_mode(op, mode);
  Backend::check_input(op, x);
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t hidden = x.size(-1);
  at::Tensor dweight = at::empty({hidden}, x.options().dtype(at::kFloat));
  if (hidden == 0) return {dx, dweight};
  const at::Tensor acc = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  const at::Tensor xr = as_rows(x);
  Backend::bwd(op, as_rows(grad_out), grad_residual.has_value() ? as_rows(*grad_residual) : at::Tensor(),
               xr, weight.contiguous(), dx.view({xr.size(0), hidden}),
               acc.defined() ? acc.const_data_ptr<float>() : nullptr, dweight,
               static_cast<float>(eps), m);
  return {dx, dweight};
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& dweight_accum, c10::string_view mode) {
  return rms_norm_backward_common<Backend>("rms_norm_backward", "grad_out", "x", grad_out,
                                           std::nullopt, x, weight, eps, dweight_accum, mode);
}

}  // namespace rl_align
