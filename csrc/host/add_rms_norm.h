// Host side of add_rms_norm: rms_norm's flow (host/rms_norm.h) with the residual, on rms_norm's
// Backend and kernels. They stay shared on purpose: add_rms_norm promises rms_norm(round(x +
// residual)) bit for bit, forward and backward, which holds by construction when one row kernel
// (the residual add one more step of its row pass) computes both.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "rms_norm.h"

namespace rl_align {

// (y, new_residual = round(x + residual)).
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x,
                                                     const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps,
                                                     c10::string_view mode) {
  return rms_norm_forward_common<Backend>("add_rms_norm", x, residual, weight, eps, mode);
}

// (grad_input, dweight fp32): grad_residual, when given, is added to the rounded grad_input.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_backward_impl(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_residual,
    const at::Tensor& new_residual, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& dweight_accum, c10::string_view mode) {
  return rms_norm_backward_common<Backend>("add_rms_norm_backward", "grad_y", "new_residual",
                                           grad_y, grad_residual, new_residual, weight, eps,
                                           dweight_accum, mode);
}

}  // namespace rl_align
