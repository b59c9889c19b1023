// RL_ALIGN_HOST_DEVICE: a function the CPU kernels (plain C++) and the GPU kernels (nvcc, hipcc)
// both call, so that one definition states the arithmetic for every path.
#pragma once

#include <cstdint>

#ifndef RL_ALIGN_HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define RL_ALIGN_HOST_DEVICE __host__ __device__ inline
#else
#define RL_ALIGN_HOST_DEVICE inline
#endif
#endif

// One IEEE fp32 operation each, rounded to nearest and never contracted into an FMA: the GPU
// compiler may fuse a plain a * b + c (nvcc --fmad=true), the CPU build may not
// (-ffp-contract=off), so a formula written with these evaluates the same expression on both.
RL_ALIGN_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

RL_ALIGN_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

RL_ALIGN_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

namespace rl_align {

// v rounded up to a multiple of `multiple` (> 0): padded row lengths, partition segments.
RL_ALIGN_HOST_DEVICE constexpr int64_t round_up(int64_t v, int64_t multiple) {
  return (v + multiple - 1) / multiple * multiple;
}

}  // namespace rl_align
