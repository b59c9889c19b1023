// The kernel dtype enum and the one dtype dispatch every kernel entry point goes through, CPU and
// GPU alike. Torch-free and GPU-runtime-free: a type map names each path's storage types.
//
//   GPU kernels:  dispatch_dtype<KernelTypes>(DType, f, unsupported)      (common/portability.h)
//   CPU kernels:  dispatch_dtype<CpuKernelTypes>(at::ScalarType, f, ...)  (cpu/cpu_dtype_dispatch.h)
//
// f is called as f(T{}) with T the storage type of the dtype; a dtype the map (or the path) does
// not take calls unsupported() instead. Tensor-core paths (bf16/fp16 only) pass
// DTypeSet::kHalfOnly: fp32 then goes to unsupported() and no fp32 code is instantiated.
#pragma once

namespace rl_align {

// Element types the kernels are instantiated for. The launchers map torch dtypes onto these
// (kernel_dtype, host/common.h), so GPU kernels never see a torch type.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Which dtypes a path instantiates.
enum class DTypeSet { kAll, kHalfOnly };

// A type map: Key is the dtype tag type (DType, at::ScalarType), kFloat32/kFloat16/kBFloat16 its
// three values, Float32/Float16/BFloat16 the storage types the kernels are instantiated with.
template <typename Map, DTypeSet kSet = DTypeSet::kAll, typename F, typename Unsupported>
decltype(auto) dispatch_dtype(typename Map::Key dtype, F&& f, Unsupported&& unsupported) {
  if constexpr (kSet == DTypeSet::kAll) {
    if (dtype == Map::kFloat32) return f(typename Map::Float32{});
  }
  if (dtype == Map::kFloat16) return f(typename Map::Float16{});
  if (dtype == Map::kBFloat16) return f(typename Map::BFloat16{});
  return unsupported();
}

}  // namespace rl_align
