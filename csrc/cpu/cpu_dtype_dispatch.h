// The CPU kernels' dtype dispatch: the storage type of each supported torch dtype, through the one
// dispatch every kernel entry point goes through (common/dtype_dispatch.h). A CPU kernel takes the
// torch dtype at its interface and includes this header, nothing of the host layer above it
// (docs/adding_an_op.md, "Layers").
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <utility>

#include "../common/dtype_dispatch.h"

namespace rl_align {

// The type map for dispatch_dtype<CpuKernelTypes> (common/dtype_dispatch.h).
struct CpuKernelTypes {
  using Key = c10::ScalarType;
  static constexpr c10::ScalarType kFloat32 = c10::ScalarType::Float;
  static constexpr c10::ScalarType kFloat16 = c10::ScalarType::Half;
  static constexpr c10::ScalarType kBFloat16 = c10::ScalarType::BFloat16;
  using Float32 = float;
  using Float16 = c10::Half;
  using BFloat16 = c10::BFloat16;
};

// CPU kernel entry points: f(scalar_t{}) for the three supported dtypes (the bindings have checked
// the dtype: host/common.h, check_dtype); anything else is the dtype policy's ValueError.
template <typename F>
void dispatch_cpu_dtype(const char* op, c10::ScalarType t, F&& f) {
  dispatch_dtype<CpuKernelTypes>(t, std::forward<F>(f), [&] {
    TORCH_CHECK_VALUE(false, "rl_align::", op, ": unsupported dtype torch.", c10::getDtypeNames(t).first);
  });
}

}  // namespace rl_align
