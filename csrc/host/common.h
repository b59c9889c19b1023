// Host-side pieces every op's torch binding shares (CPU and GPU alike): the dtype policy, the
// common argument checks, row views, and the torch dtype -> GPU kernel dtype map. (The CPU
// kernels' map is theirs: cpu/cpu_dtype_dispatch.h.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "../common/dtype_dispatch.h"

namespace rl_align {

// ------------------------------------------------------------------------------------------------
// Dtype policy
// ------------------------------------------------------------------------------------------------

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

// The GPU kernels' dtype (common/dtype_dispatch.h) of a checked torch dtype.
inline DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;  // the checks admit only these three
  }
}

// ------------------------------------------------------------------------------------------------
// Argument checks
// ------------------------------------------------------------------------------------------------

inline void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), "rl_align::", op, ": ", name, " dtype ",
                    dtype_name(t.scalar_type()), " differs from ", ref_name, " dtype ",
                    dtype_name(ref.scalar_type()));
  TORCH_CHECK(t.device() == ref.device(), "rl_align::", op, ": ", name, " is on ", t.device(),
              " but ", ref_name, " is on ", ref.device());
}

// An optional fp32 gradient accumulator (dweight_accum, dbias_accum) of the given shape.
inline void check_fp32_accum(const char* op, const char* name,
                             const std::optional<at::Tensor>& accum, at::IntArrayRef shape,
                             const at::Tensor& ref) {
  if (!accum.has_value()) return;
  TORCH_CHECK_VALUE(accum->scalar_type() == at::kFloat, "rl_align::", op, ": ", name,
                    " must be torch.float32, got ", dtype_name(accum->scalar_type()));
  TORCH_CHECK_VALUE(accum->sizes() == shape, "rl_align::", op, ": ", name, " must have shape ",
                    shape, ", got ", accum->sizes());
  TORCH_CHECK(accum->device() == ref.device(), "rl_align::", op, ": ", name, " is on ",
              accum->device(), " but the inputs are on ", ref.device());
}

// ------------------------------------------------------------------------------------------------
// Operand lifetimes
// ------------------------------------------------------------------------------------------------

// A const reference that binds only to an lvalue: what a helper takes when it stores a pointer into
// the object (a tensor's data pointer into an operand descriptor). The descriptor is read after the
// helper returns, by when a temporary argument (as_rows(x), x.contiguous()) has been freed, so
// passing one must not compile: name it first, in the scope that launches the kernel.
template <typename T>
class Lvalue {
 public:
  Lvalue(const T& value) : value_(value) {}  // implicit: call sites pass the object itself
  Lvalue(T&&) = delete;
  Lvalue(const T&&) = delete;
  const T& operator*() const { return value_; }
  const T* operator->() const { return &value_; }

 private:
  const T& value_;
};
static_assert(std::is_convertible_v<at::Tensor&, Lvalue<at::Tensor>> &&
                  std::is_convertible_v<const at::Tensor&, Lvalue<at::Tensor>> &&
                  !std::is_convertible_v<at::Tensor, Lvalue<at::Tensor>> &&
                  !std::is_convertible_v<const at::Tensor, Lvalue<at::Tensor>>,
              "Lvalue binds to named tensors only");

// ------------------------------------------------------------------------------------------------
// Row views
// ------------------------------------------------------------------------------------------------

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
