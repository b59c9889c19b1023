// Host side of the linear ops, shared by the CPU and GPU bindings: argument checks, the
// reduction of each op to one GemmProblem, operand views, and the empty-shape cases.
//
// A Backend supplies:
//   static bool needs_aligned_operands(const char* op, at::ScalarType dtype, const at::Tensor& t);
//   static void run(const char* op, at::ScalarType dtype, const GemmProblem& p, const at::Tensor& t);
//   static void bias_grad(at::ScalarType dtype, const at::Tensor& dy_rows, const float* accum,
//                         float* dbias);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../common/gemm_problem.h"
#include "../common/host_device.h"
#include "common.h"

namespace rl_align {

inline void check_weight(const char* op, const at::Tensor& weight) {
  check_dtype(op, "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 2, "rl_align::", op, ": weight must be 2-D [out, in], got shape ",
                    weight.sizes());
}

inline void check_linear_args(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, const char* op = "linear") {
  check_dtype(op, "x", x);
  check_weight(op, weight);
  TORCH_CHECK_VALUE(x.dim() >= 1, "rl_align::", op, ": x must have at least one dimension");
  TORCH_CHECK_VALUE(weight.size(1) == x.size(-1), "rl_align::", op, ": weight is ", weight.sizes(),
                    " ([out, in]) but x's last dimension is ", x.size(-1));
  check_same(op, "weight", weight, "x", x);
  if (bias.has_value()) {
    check_dtype(op, "bias", *bias);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "rl_align::", op,
                      ": bias must have shape [", weight.size(0), "], got ", bias->sizes());
    check_same(op, "bias", *bias, "x", x);
  }
}

inline void check_grad_input_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                  const char* op = "linear_grad_input") {
  check_dtype(op, "grad_out", grad_out);
  check_weight(op, weight);
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && grad_out.size(-1) == weight.size(0), "rl_align::", op,
                    ": grad_out's last dimension must be weight.size(0) = ", weight.size(0),
                    ", got shape ", grad_out.sizes());
  check_same(op, "weight", weight, "grad_out", grad_out);
}

inline void check_grad_weight_args(const at::Tensor& grad_out, const at::Tensor& x,
                                   const std::optional<at::Tensor>& accum) {
  constexpr const char* op = "linear_grad_weight";
  check_dtype(op, "grad_out", grad_out);
  check_dtype(op, "x", x);
  TORCH_CHECK_VALUE(grad_out.dim() >= 1 && x.dim() == grad_out.dim() &&
                        grad_out.sizes().slice(0, grad_out.dim() - 1) ==
                            x.sizes().slice(0, x.dim() - 1),
                    "rl_align::", op, ": grad_out ", grad_out.sizes(), " and x ", x.sizes(),
                    " must agree in every dimension but the last");
  check_same(op, "x", x, "grad_out", grad_out);
  check_fp32_accum(op, "dweight_accum", accum, {grad_out.size(-1), x.size(-1)}, x);
}

inline void check_grad_bias_args(const at::Tensor& grad_out,
                                 const std::optional<at::Tensor>& accum) {
  constexpr const char* op = "linear_grad_bias";
  check_dtype(op, "grad_out", grad_out);
  TORCH_CHECK_VALUE(grad_out.dim() >= 1, "rl_align::", op,
                    ": grad_out must have at least one dimension");
  check_fp32_accum(op, "dbias_accum", accum, {grad_out.size(-1)}, grad_out);
}

// A 2-D operand as the kernels read it: `rows` with a dense last dimension and row stride `ld`.
// With `aligned`, the base is 16-byte aligned and ld * element size a multiple of 16 bytes (the
// tensor-core paths' bulk copies); an operand that is not gets copied into a buffer whose rows
// are padded to 16 bytes. The copy holds the same values, so the arithmetic is the same either
// way; only the location differs.
struct Operand {
  at::Tensor rows;
  int64_t ld;
};

inline Operand gemm_operand(const at::Tensor& t, bool aligned) {
  at::Tensor rows = as_rows(t);
  const int64_t cols = rows.size(1);
  if (rows.size(0) > 1 && rows.stride(0) < cols) rows = rows.contiguous();  // overlapping rows
  const int64_t elem = rows.element_size();
  const int64_t align_elems = 16 / elem;
  // One row never steps to the next: any ld works, so report the padded one.
  int64_t ld = rows.size(0) > 1 ? rows.stride(0) : round_up(cols, align_elems);
  if (!aligned) return {rows, rows.size(0) > 1 ? rows.stride(0) : cols};
  const bool ok = reinterpret_cast<uintptr_t>(rows.const_data_ptr()) % 16 == 0 && (ld * elem) % 16 == 0;
  if (ok) return {rows, ld};
  ld = round_up(cols, align_elems);
  at::Tensor padded = at::empty({rows.size(0), ld}, rows.options());
  padded.narrow(1, 0, cols).copy_(rows);
  return {padded.narrow(1, 0, cols), ld};
}

template <typename Backend>
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "linear";
  check_linear_args(x, weight, bias);
  const int64_t n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // an empty sum: the bias alone
    if (bias.has_value()) y.copy_(bias->expand_as(y)); else y.zero_();
    return y;
  }
  const bool aligned = Backend::needs_aligned_operands(op, x.scalar_type(), x);
  const Operand a = gemm_operand(x, aligned);
  const Operand b = gemm_operand(weight, aligned);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  GemmProblem p;
  p.m = m; p.n = n; p.k = k;
  p.a = a.rows.const_data_ptr(); p.lda = a.ld;
  p.b = b.rows.const_data_ptr(); p.ldb = b.ld;
  p.c = y.mutable_data_ptr(); p.ldc = n;
  p.bias = bias_c.defined() ? bias_c.const_data_ptr() : nullptr;
  Backend::run(op, x.scalar_type(), p, x);
  return y;
}

// dx (contiguous rows of `in`, allocated) = accum (or 0, null) + grad_out @ weight, over m > 0
// rows with out > 0 and in > 0; dx in the input dtype or fp32 (needed with accum, which may be
// dx's own storage). linear_logprob sums d hidden over its vocabulary slices this way.
template <typename Backend>
void linear_grad_input_into(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& dx,
                            const float* accum = nullptr) {
  constexpr const char* op = "linear_grad_input";
  const int64_t n = weight.size(0), k = weight.size(1);
  const bool aligned = Backend::needs_aligned_operands(op, grad_out.scalar_type(), grad_out);
  const Operand a = gemm_operand(grad_out, aligned);
  const Operand b = gemm_operand(weight, aligned);
  GemmProblem p;
  p.m = grad_out.numel() / n; p.n = k; p.k = n;
  p.a = a.rows.const_data_ptr(); p.lda = a.ld;
  p.b = b.rows.const_data_ptr(); p.ldb = b.ld; p.b_mn_major = true;
  p.c = dx.mutable_data_ptr(); p.ldc = k; p.c_fp32 = dx.scalar_type() == at::kFloat;
  p.c_accum = accum;
  Backend::run(op, grad_out.scalar_type(), p, grad_out);
}

template <typename Backend>
at::Tensor linear_grad_input_impl(const at::Tensor& grad_out, const at::Tensor& weight) {
  check_grad_input_args(grad_out, weight);
  const int64_t n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> out_shape(grad_out.sizes().begin(), grad_out.sizes().end());
  out_shape.back() = k;
  at::Tensor dx = at::empty(out_shape, grad_out.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t m = n == 0 ? dx.numel() / std::max<int64_t>(k, 1) : grad_out.numel() / n;
  if (m == 0 || k == 0) return dx;
  if (n == 0) return dx.zero_();
  linear_grad_input_into<Backend>(grad_out, weight, dx);
  return dx;
}

// dw ([out, in] rows with row stride in, allocated) = accum (or 0, null) + grad_out^T @ x over
// `tokens` > 0 rows; dw fp32, or the input dtype without accum (linear_logprob's weight gradient
// for autograd). accum may be dw's own storage: every path reads an element's accumulator before
// it writes it.
template <typename Backend>
void linear_grad_weight_into(const at::Tensor& grad_out, const at::Tensor& x, const float* accum,
                             const at::Tensor& dw) {
  constexpr const char* op = "linear_grad_weight";
  const int64_t n = grad_out.size(-1), k = x.size(-1);
  const bool aligned = Backend::needs_aligned_operands(op, x.scalar_type(), x);
  const Operand a = gemm_operand(grad_out, aligned);
  const Operand b = gemm_operand(x, aligned);
  GemmProblem p;
  p.m = n; p.n = k; p.k = x.numel() / k;
  p.a = a.rows.const_data_ptr(); p.lda = a.ld; p.a_mn_major = true;
  p.b = b.rows.const_data_ptr(); p.ldb = b.ld; p.b_mn_major = true;
  p.c = dw.mutable_data_ptr(); p.ldc = k; p.c_fp32 = dw.scalar_type() == at::kFloat;
  p.c_accum = accum;
  Backend::run(op, x.scalar_type(), p, x);
}

template <typename Backend>
at::Tensor linear_grad_weight_impl(const at::Tensor& grad_out, const at::Tensor& x,
                                   const std::optional<at::Tensor>& accum) {
  check_grad_weight_args(grad_out, x, accum);
  const int64_t n = grad_out.size(-1), k = x.size(-1);
  at::Tensor dw = at::empty({n, k}, x.options().dtype(at::kFloat));
  if (n == 0 || k == 0) return dw;
  if (x.numel() == 0) return accum.has_value() ? dw.copy_(*accum) : dw.zero_();
  const at::Tensor acc = accum.has_value() ? accum->contiguous() : at::Tensor();
  linear_grad_weight_into<Backend>(grad_out, x, acc.defined() ? acc.const_data_ptr<float>() : nullptr, dw);
  return dw;
}

template <typename Backend>
at::Tensor linear_grad_bias_impl(const at::Tensor& grad_out, const std::optional<at::Tensor>& accum) {
  check_grad_bias_args(grad_out, accum);
  const int64_t n = grad_out.size(-1);
  at::Tensor db = at::empty({n}, grad_out.options().dtype(at::kFloat));
  if (n == 0) return db;
  const at::Tensor acc = accum.has_value() ? accum->contiguous() : at::Tensor();
  Backend::bias_grad(grad_out.scalar_type(), as_rows(grad_out),
                     acc.defined() ? acc.const_data_ptr<float>() : nullptr,
                     db.mutable_data_ptr<float>());
  return db;
}

}  // namespace rl_align
