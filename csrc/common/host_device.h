// RL_ALIGN_HOST_DEVICE: a function the CPU kernels (plain C++) and the GPU kernels (nvcc, hipcc)
// both call, so that one definition states the arithmetic for every path.
#pragma once

#ifndef RL_ALIGN_HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define RL_ALIGN_HOST_DEVICE __host__ __device__ inline
#else
#define RL_ALIGN_HOST_DEVICE inline
#endif
#endif
