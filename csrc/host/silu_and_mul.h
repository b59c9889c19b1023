// Host side of silu_and_mul, shared by the CPU and GPU bindings: argument checks, output
// allocation, the empty cases and the operand descriptors of both layouts (one gate_up tensor,
// or HF's separate gate / up tensors). A Backend supplies only the kernel calls:
//   static void fwd(const char* op, const at::Tensor& ref, const SiluMulOperands& a);
//   static void bwd(const char* op, const at::Tensor& ref, const SiluMulOperands& a);
// `ref` is an input (for the dtype and the device); every operand matrix has a dense last
// dimension (as_rows), row-strided views are read in place.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <tuple>
#include <vector>

#include "../common/silu_and_mul.h"
#include "common.h"

namespace rl_align {

inline void check_gate_up_arg(const char* op, const at::Tensor& gate_up) {
  check_dtype(op, "gate_up", gate_up);
  TORCH_CHECK_VALUE(gate_up.dim() >= 1, "rl_align::", op, ": gate_up must have at least one dimension");
  TORCH_CHECK_VALUE(gate_up.size(-1) % 2 == 0, "rl_align::", op,
                    ": gate_up's last dimension must be even (gate then up), got ", gate_up.size(-1));
}

inline void check_gate_and_up_args(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_dtype(op, "gate", gate);
  check_dtype(op, "up", up);
  TORCH_CHECK_VALUE(gate.dim() >= 1, "rl_align::", op, ": gate must have at least one dimension");
  TORCH_CHECK_VALUE(up.sizes() == gate.sizes(), "rl_align::", op, ": up shape ", up.sizes(),
                    " differs from gate shape ", gate.sizes());
  check_same(op, "up", up, "gate", gate);
}

// grad_out must have `shape` and ref's dtype and device.
inline void check_grad_out_arg(const char* op, const at::Tensor& grad_out, at::IntArrayRef shape,
                               const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(grad_out.sizes() == shape, "rl_align::", op, ": grad_out shape ",
                    grad_out.sizes(), " differs from the output shape ", shape);
  check_same(op, "grad_out", grad_out, ref_name, ref);
}

// gate_up's shape with the last dimension halved: the output (and grad_out) shape.
inline std::vector<int64_t> halved_shape(const at::Tensor& gate_up) {
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() /= 2;
  return shape;
}

inline at::Tensor empty_dense(at::IntArrayRef shape, const at::Tensor& like) {
  return at::empty(shape, like.options().memory_format(at::MemoryFormat::Contiguous));
}

// Address of column `col` of row 0 of a [rows, n] view (which the caller holds while the address
// is used).
inline const void* column_ptr(Lvalue<at::Tensor> rows, int64_t col) {
  return static_cast<const char*>(rows->const_data_ptr()) + col * rows->element_size();
}

inline void* column_ptr_mut(Lvalue<at::Tensor> rows, int64_t col) {
  return static_cast<char*>(rows->mutable_data_ptr()) + col * rows->element_size();
}

// Operands with gate and up read from [rows, cols] views (the two may be the halves of one
// gate_up view: column offsets 0 and cols), held by the caller until the kernel ran.
inline SiluMulOperands silu_mul_inputs(Lvalue<at::Tensor> gate_rows, int64_t gate_col,
                                       Lvalue<at::Tensor> up_rows, int64_t up_col, int64_t cols) {
  SiluMulOperands a;
  a.rows = gate_rows->size(0);
  a.cols = cols;
  a.gate = column_ptr(*gate_rows, gate_col);
  a.gate_stride = row_stride(*gate_rows);
  a.up = column_ptr(*up_rows, up_col);
  a.up_stride = row_stride(*up_rows);
  return a;
}

template <typename Backend>
at::Tensor silu_and_mul_impl(const at::Tensor& gate_up) {
  constexpr const char* op = "silu_and_mul";
  check_gate_up_arg(op, gate_up);
  at::Tensor y = empty_dense(halved_shape(gate_up), gate_up);
  if (y.numel() == 0) return y;
  const int64_t cols = y.size(-1);
  const at::Tensor gu = as_rows(gate_up);
  SiluMulOperands a = silu_mul_inputs(gu, 0, gu, cols, cols);
  a.out = y.mutable_data_ptr();
  a.out_stride = cols;
  Backend::fwd(op, gate_up, a);
  return y;
}

template <typename Backend>
at::Tensor silu_and_mul_backward_impl(const at::Tensor& grad_out, const at::Tensor& gate_up) {
  constexpr const char* op = "silu_and_mul_backward";
  check_gate_up_arg(op, gate_up);
  check_grad_out_arg(op, grad_out, halved_shape(gate_up), "gate_up", gate_up);
  at::Tensor d_gate_up = empty_dense(gate_up.sizes(), gate_up);
  if (grad_out.numel() == 0) return d_gate_up;
  const int64_t cols = grad_out.size(-1);
  const at::Tensor gu = as_rows(gate_up);
  const at::Tensor dy = as_rows(grad_out);
  const at::Tensor dgu = d_gate_up.view({gu.size(0), 2 * cols});
  SiluMulOperands a = silu_mul_inputs(gu, 0, gu, cols, cols);
  a.grad_out = dy.const_data_ptr();
  a.grad_out_stride = row_stride(dy);
  a.out = column_ptr_mut(dgu, 0);
  a.dup = column_ptr_mut(dgu, cols);
  a.out_stride = a.dup_stride = 2 * cols;
  Backend::bwd(op, gate_up, a);
  return d_gate_up;
}

template <typename Backend>
at::Tensor silu_mul_impl(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "silu_mul";
  check_gate_and_up_args(op, gate, up);
  at::Tensor y = empty_dense(gate.sizes(), gate);
  if (y.numel() == 0) return y;
  const int64_t cols = gate.size(-1);
  const at::Tensor gate_rows = as_rows(gate), up_rows = as_rows(up);
  SiluMulOperands a = silu_mul_inputs(gate_rows, 0, up_rows, 0, cols);
  a.out = y.mutable_data_ptr();
  a.out_stride = cols;
  Backend::fwd(op, gate, a);
  return y;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> silu_mul_backward_impl(const at::Tensor& grad_out,
                                                          const at::Tensor& gate,
                                                          const at::Tensor& up) {
  constexpr const char* op = "silu_mul_backward";
  check_gate_and_up_args(op, gate, up);
  check_grad_out_arg(op, grad_out, gate.sizes(), "gate", gate);
  at::Tensor d_gate = empty_dense(gate.sizes(), gate);
  at::Tensor d_up = empty_dense(gate.sizes(), gate);
  if (gate.numel() == 0) return {d_gate, d_up};
  const int64_t cols = gate.size(-1);
  const at::Tensor dy = as_rows(grad_out);
  const at::Tensor gate_rows = as_rows(gate), up_rows = as_rows(up);
  SiluMulOperands a = silu_mul_inputs(gate_rows, 0, up_rows, 0, cols);
  a.grad_out = dy.const_data_ptr();
  a.grad_out_stride = row_stride(dy);
  a.out = d_gate.mutable_data_ptr();
  a.dup = d_up.mutable_data_ptr();
  a.out_stride = a.dup_stride = cols;
  Backend::bwd(op, gate, a);
  return {d_gate, d_up};
}

}  // namespace rl_align
