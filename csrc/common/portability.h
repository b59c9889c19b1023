// Torch-free portability layer shared by the CUDA and HIP builds of every kernel.
//
// Kernel sources include only this header (plus the C++ standard library), so CI can compile
// them with plain nvcc and hipcc without a CUDA/ROCm PyTorch. The torch binding lives in the
// *_launcher.cpp files.
#pragma once

#include <cstdint>

#include "dtype_dispatch.h"

#if defined(__HIPCC__) || defined(USE_ROCM)
#define RL_ALIGN_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
#include <hip/hip_bfloat16.h>
#else
#define RL_ALIGN_HIP 0
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace rl_align {

// The runtime APIs differ only in their prefix; RL_GPU(Name) picks hipName or cudaName.
#if RL_ALIGN_HIP
#define RL_GPU(name) hip##name
constexpr hipDeviceAttribute_t kMultiprocessorCountAttr = hipDeviceAttributeMultiprocessorCount;
using bfloat16_t = hip_bfloat16;
#else
#define RL_GPU(name) cuda##name
constexpr cudaDeviceAttr kMultiprocessorCountAttr = cudaDevAttrMultiProcessorCount;
using bfloat16_t = __nv_bfloat16;
#endif

using gpuStream_t = RL_GPU(Stream_t);
using gpuError_t = RL_GPU(Error_t);
using half_t = __half;
constexpr gpuError_t kGpuSuccess = RL_GPU(Success);
inline gpuError_t gpu_last_error() { return RL_GPU(GetLastError)(); }
// The `unsupported` of dispatch_dtype<KernelTypes> for entry points returning gpuError_t.
inline gpuError_t gpu_not_supported() { return RL_GPU(ErrorNotSupported); }
inline const char* gpu_error_string(gpuError_t e) { return RL_GPU(GetErrorString)(e); }
inline int current_device() {
  int d = 0;
  (void)RL_GPU(GetDevice)(&d);
  return d;
}
inline int multiprocessor_count(int device) {
  int n = 1;
  (void)RL_GPU(DeviceGetAttribute)(&n, kMultiprocessorCountAttr, device);
  return n;
}
template <typename Kernel>
int max_active_blocks_per_multiprocessor(Kernel kernel, int block_threads) {
  int n = 1;
  (void)RL_GPU(OccupancyMaxActiveBlocksPerMultiprocessor)(&n, kernel, block_threads, 0);
  return n > 0 ? n : 1;
}

// Warp (wavefront) width as a compile-time constant: 64 on AMD CDNA, 32 on NVIDIA. Reduction
// trees are built from it, so never hard-code 32.
#if RL_ALIGN_HIP && defined(__AMDGCN_WAVEFRONT_SIZE)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE;
#elif RL_ALIGN_HIP
constexpr int kWarpSize = 64;
#else
constexpr int kWarpSize = 32;
#endif

// The GPU kernels' storage types per DType (DType itself: common/dtype_dispatch.h), for
// dispatch_dtype<KernelTypes>.
struct KernelTypes {
  using Key = DType;
  static constexpr DType kFloat32 = DType::kFloat32;
  static constexpr DType kFloat16 = DType::kFloat16;
  static constexpr DType kBFloat16 = DType::kBFloat16;
  using Float32 = float;
  using Float16 = half_t;
  using BFloat16 = bfloat16_t;
};

// Device-only helpers below: host translation units (the torch launchers) include this header
// for the types above and must not see them.
#if defined(__CUDACC__) || defined(__HIPCC__)

// Exact conversions between storage types and the fp32 compute type (round-to-nearest-even on
// the way back). One rounding per output element.
template <typename T>
struct Convert;

template <>
struct Convert<float> {
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
};

template <>
struct Convert<half_t> {
  __device__ __forceinline__ static float to_float(half_t v) { return __half2float(v); }
  __device__ __forceinline__ static half_t from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Convert<bfloat16_t> {
#if RL_ALIGN_HIP
  __device__ __forceinline__ static float to_float(bfloat16_t v) { return static_cast<float>(v); }
  __device__ __forceinline__ static bfloat16_t from_float(float v) {
    return bfloat16_t::round_to_bfloat16(v);
  }
#else
  __device__ __forceinline__ static float to_float(bfloat16_t v) { return __bfloat162float(v); }
  __device__ __forceinline__ static bfloat16_t from_float(float v) {
    return __float2bfloat16_rn(v);
  }
#endif
};

// Butterfly exchange inside groups of `width` lanes. IEEE addition is commutative, so every lane
// of a butterfly ends with the same bits.
__device__ __forceinline__ float shfl_xor(float v, int lane_mask, int width) {
#if RL_ALIGN_HIP
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
#endif
}

#endif  // __CUDACC__ || __HIPCC__

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace rl_align
