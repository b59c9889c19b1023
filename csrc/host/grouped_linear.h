// Host side of the grouped (mixture-of-experts) linear ops, shared by the CPU and GPU bindings:
// argument checks and the flow. The arithmetic is linear's (common/gemm_problem.h): each row of an
// expert's range is linear's row with that expert's weight (forward, grad input), each expert's
// weight gradient linear_grad_weight's chain over its own rows.
//
// A Backend supplies the linear Backend's members (host/linear.h) and
//   static bool grouped(const char* op, at::ScalarType dtype, const at::Tensor& t, int64_t groups);
// true: one GemmProblem with group_mode runs every expert (offsets read on the device); false:
// one ungrouped GEMM per expert, with the offsets read on the host. Both give the same bits.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../common/gemm_problem.h"
#include "common.h"
#include "linear.h"

namespace rl_align {

inline void check_group_offsets(const char* op, const at::Tensor& offsets, int64_t groups, int64_t rows,
                                const char* ref_name, const at::Tensor& ref, bool validate) {
  TORCH_CHECK(offsets.device() == ref.device(), "rl_align::", op, ": group_offsets is on ", offsets.device(),
              " but ", ref_name, " is on ", ref.device());
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong, "rl_align::", op,
                    ": group_offsets must be int32 or int64, got ", dtype_name(offsets.scalar_type()));
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) == groups + 1, "rl_align::", op,
                    ": group_offsets must have shape [", groups + 1, "] (experts + 1), got ", offsets.sizes());
  if (!validate) return;
  const at::Tensor o = offsets.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = o.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(v[0] == 0 && v[groups] == rows, "rl_align::", op,
                    ": group_offsets must start at 0 and end at the number of rows (", rows, "), got ", v[0],
                    " .. ", v[groups]);
  for (int64_t e = 0; e < groups; ++e)
    TORCH_CHECK_VALUE(v[e + 1] >= v[e], "rl_align::", op, ": group_offsets must be non-decreasing");
}

inline void check_grouped_rows(const char* op, const char* name, const at::Tensor& t) {
  check_dtype(op, name, t);
  TORCH_CHECK_VALUE(t.dim() == 2, "rl_align::", op, ": ", name, " must be 2-D [rows, features], got shape ",
                    t.sizes());
}

inline void check_grouped_weight(const char* op, const at::Tensor& weight) {
  check_dtype(op, "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 3, "rl_align::", op, ": weight must be 3-D [experts, out, in], got shape ",
                    weight.sizes());
}

inline void check_grouped_linear_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& offsets,
                                      bool validate) {
  constexpr const char* op = "grouped_linear";
  check_grouped_rows(op, "x", x);
  check_grouped_weight(op, weight);
  TORCH_CHECK_VALUE(weight.size(2) == x.size(1), "rl_align::", op, ": weight is ", weight.sizes(),
                    " ([experts, out, in]) but x's last dimension is ", x.size(1));
  check_same(op, "weight", weight, "x", x);
  check_group_offsets(op, offsets, weight.size(0), x.size(0), "x", x, validate);
}

inline void check_grouped_grad_input_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                          const at::Tensor& offsets, bool validate) {
  constexpr const char* op = "grouped_linear_grad_input";
  check_grouped_rows(op, "grad_out", grad_out);
  check_grouped_weight(op, weight);
  TORCH_CHECK_VALUE(grad_out.size(1) == weight.size(1), "rl_align::", op,
                    ": grad_out's last dimension must be weight.size(1) = ", weight.size(1), ", got shape ",
                    grad_out.sizes());
  check_same(op, "weight", weight, "grad_out", grad_out);
  check_group_offsets(op, offsets, weight.size(0), grad_out.size(0), "grad_out", grad_out, validate);
}

inline void check_grouped_grad_weight_args(const at::Tensor& grad_out, const at::Tensor& x,
                                           const at::Tensor& offsets, const std::optional<at::Tensor>& accum,
                                           bool validate, bool fp32_param_grad) {
  constexpr const char* op = "grouped_linear_grad_weight";
  check_grouped_rows(op, "grad_out", grad_out);
  check_grouped_rows(op, "x", x);
  TORCH_CHECK_VALUE(grad_out.size(0) == x.size(0), "rl_align::", op, ": grad_out ", grad_out.sizes(), " and x ",
                    x.sizes(), " must have the same rows");
  check_same(op, "x", x, "grad_out", grad_out);
  TORCH_CHECK_VALUE(offsets.dim() == 1, "rl_align::", op,
                    ": group_offsets must be 1-D [experts + 1], got shape ", offsets.sizes());
  const int64_t groups = offsets.size(0) - 1;
  check_group_offsets(op, offsets, groups, x.size(0), "x", x, validate);
  check_fp32_accum(op, "dweight_accum", accum, {groups, grad_out.size(1), x.size(1)}, x);
  TORCH_CHECK_VALUE(!(accum.has_value() && !fp32_param_grad), "rl_align::", op,
                    ": dweight_accum needs fp32_param_grad=True (the chain continues in fp32)");
}

// The offsets as every path reads them (common/gemm_problem.h, "Grouped"): 0, each clamped into
// [previous, rows], rows. The per-expert flow's host copy (a synchronisation on the GPU).
inline std::vector<int64_t> host_group_offsets(const at::Tensor& offsets, int64_t rows) {
  const at::Tensor o = offsets.to(at::kCPU, at::kLong).contiguous();
  const int64_t groups = o.numel() - 1;
  const int64_t* v = o.const_data_ptr<int64_t>();
  std::vector<int64_t> out(groups + 1, 0);
  for (int64_t e = 1; e < groups; ++e) out[e] = std::min(std::max(v[e], out[e - 1]), rows);
  out[groups] = rows;
  return out;
}

// The device-read fields of a grouped problem.
inline void set_groups(GemmProblem& p, GroupMode mode, Lvalue<at::Tensor> offsets) {
  p.group_mode = mode;
  p.groups = offsets->size(0) - 1;
  p.group_offsets = offsets->const_data_ptr();
  p.group_offsets_int64 = offsets->scalar_type() == at::kLong;
}

// out [rows, n] (allocated) = per expert: rows of `a` ([rows, k]) times expert e's slice of
// `weight` ([E, N, K]; K-major: forward; MN-major: grad input), one grouped launch or one GEMM per
// expert.
template <typename Backend>
void grouped_rows_gemm(const char* op, const at::Tensor& a_in, const at::Tensor& weight, const at::Tensor& offsets,
                       bool b_mn_major, const at::Tensor& out) {
  const at::ScalarType dtype = a_in.scalar_type();
  const int64_t rows = a_in.size(0), groups = weight.size(0);
  const int64_t n = out.size(1), k = a_in.size(1);
  const bool aligned = Backend::needs_aligned_operands(op, dtype, a_in);
  if (Backend::grouped(op, dtype, a_in, groups)) {
    const Operand a = gemm_operand(a_in, aligned);
    // The experts' [N, K] matrices one after another, rows of ld elements (padded to 16 bytes as
    // gemm_operand pads: same values, other addresses).
    const Operand w = gemm_operand(weight.reshape({-1, weight.size(2)}), aligned);
    const at::Tensor offs = offsets.contiguous();
    GemmProblem p;
    p.m = rows; p.n = n; p.k = k;
    p.a = a.rows.const_data_ptr(); p.lda = a.ld;
    p.b = w.rows.const_data_ptr(); p.ldb = w.ld; p.b_mn_major = b_mn_major;
    p.b_group_stride = weight.size(1) * w.ld;
    p.c = out.mutable_data_ptr(); p.ldc = n;
    set_groups(p, GroupMode::kRows, offs);
    Backend::run(op, dtype, p, a_in);
    return;
  }
  const std::vector<int64_t> o = host_group_offsets(offsets, rows);
  for (int64_t e = 0; e < groups; ++e) {
    if (o[e + 1] == o[e]) continue;
    const at::Tensor a_rows = a_in.narrow(0, o[e], o[e + 1] - o[e]);
    const at::Tensor w_e = weight[e];
    const Operand a = gemm_operand(a_rows, aligned);
    const Operand b = gemm_operand(w_e, aligned);
    GemmProblem p;
    p.m = a_rows.size(0); p.n = n; p.k = k;
    p.a = a.rows.const_data_ptr(); p.lda = a.ld;
    p.b = b.rows.const_data_ptr(); p.ldb = b.ld; p.b_mn_major = b_mn_major;
    p.c = out.narrow(0, o[e], o[e + 1] - o[e]).mutable_data_ptr(); p.ldc = n;
    Backend::run(op, dtype, p, a_in);
  }
}

template <typename Backend>
at::Tensor grouped_linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& offsets,
                               bool validate) {
  check_grouped_linear_args(x, weight, offsets, validate);
  const int64_t rows = x.size(0), n = weight.size(1), k = weight.size(2);
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  if (k == 0 || weight.size(0) == 0) return y.zero_();  // an empty sum (no expert: no row is routed)
  grouped_rows_gemm<Backend>("grouped_linear", x, weight, offsets, false, y);
  return y;
}

template <typename Backend>
at::Tensor grouped_linear_grad_input_impl(const at::Tensor& grad_out, const at::Tensor& weight,
                                          const at::Tensor& offsets, bool validate) {
  check_grouped_grad_input_args(grad_out, weight, offsets, validate);
  const int64_t rows = grad_out.size(0), n = weight.size(1), k = weight.size(2);
  at::Tensor dx = at::empty({rows, k}, grad_out.options());
  if (rows == 0 || k == 0) return dx;
  if (n == 0 || weight.size(0) == 0) return dx.zero_();
  grouped_rows_gemm<Backend>("grouped_linear_grad_input", grad_out, weight, offsets, true, dx);
  return dx;
}

template <typename Backend>
at::Tensor grouped_linear_grad_weight_impl(const at::Tensor& grad_out, const at::Tensor& x,
                                           const at::Tensor& offsets, const std::optional<at::Tensor>& accum,
                                           bool validate, bool fp32_param_grad) {
  constexpr const char* op = "grouped_linear_grad_weight";
  check_grouped_grad_weight_args(grad_out, x, offsets, accum, validate, fp32_param_grad);
  const int64_t groups = offsets.size(0) - 1, rows = x.size(0), n = grad_out.size(1), k = x.size(1);
  at::Tensor dw = at::empty({groups, n, k}, x.options().dtype(fp32_param_grad ? at::kFloat : x.scalar_type()));
  if (dw.numel() == 0) return dw;
  const at::Tensor acc = accum.has_value() ? accum->contiguous() : at::Tensor();
  if (rows == 0) return acc.defined() ? dw.copy_(acc) : dw.zero_();
  const at::ScalarType dtype = x.scalar_type();
  const bool aligned = Backend::needs_aligned_operands(op, dtype, x);
  if (Backend::grouped(op, dtype, x, groups)) {
    const Operand a = gemm_operand(grad_out, aligned);
    const Operand b = gemm_operand(x, aligned);
    const at::Tensor offs = offsets.contiguous();
    GemmProblem p;
    p.m = n; p.n = k; p.k = rows;
    p.a = a.rows.const_data_ptr(); p.lda = a.ld; p.a_mn_major = true;
    p.b = b.rows.const_data_ptr(); p.ldb = b.ld; p.b_mn_major = true;
    p.c = dw.mutable_data_ptr(); p.ldc = k; p.c_fp32 = fp32_param_grad;
    p.c_accum = acc.defined() ? acc.const_data_ptr<float>() : nullptr;
    p.c_group_stride = n * k;
    set_groups(p, GroupMode::kReduction, offs);
    Backend::run(op, dtype, p, x);
    return dw;
  }
  const std::vector<int64_t> o = host_group_offsets(offsets, rows);
  for (int64_t e = 0; e < groups; ++e) {
    const at::Tensor dw_e = dw[e];
    if (o[e + 1] == o[e]) {  // no tokens: the accumulator as it is, or zero
      if (acc.defined()) dw_e.copy_(acc[e]); else dw_e.zero_();
      continue;
    }
    const float* acc_e = acc.defined() ? acc[e].const_data_ptr<float>() : nullptr;
    linear_grad_weight_into<Backend>(grad_out.narrow(0, o[e], o[e + 1] - o[e]), x.narrow(0, o[e], o[e + 1] - o[e]),
                                     acc_e, dw_e);
  }
  return dw;
}

}  // namespace rl_align
