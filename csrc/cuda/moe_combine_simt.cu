// moe_combine forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// Forward and grad_expert_out are elementwise over [rows, columns]: a thread takes one 16-byte
// group of VEC = 16 / sizeof(T) columns of one output row (threads_per_row threads, a power of two
// covering the row's groups, at most the block, blockIdx.x the row's group range, blockIdx.y the
// rows, grid-striding), and computes each element by the functions of common/moe_combine.h: the
// forward's sum over the k ranks runs in rank order inside the thread. VECTOR_IO (every row base
// 16-byte aligned, the hidden size a multiple of VEC) moves a group with one 16-byte access per
// operand; otherwise element by element, bounds-checked; the arithmetic is the same.
//
// grad_weights: one group of kMoeCombineLanes = 32 lanes per (token, rank) pair (a warp on
// NVIDIA, half a wavefront on AMD), grid-striding over pairs; lane l takes the 8-column chunks
// l, l + 32, ... in order and the lanes meet in the butterfly h = 16 .. 1: the order of
// common/moe_combine.h, set by the hidden size alone.
//
// The owners kernel reads a stable sort of the positions (the launcher's at::sort) and writes each
// named row's owner once. No atomics, no shared memory; nothing depends on the number of tokens.
#include "moe_combine_kernels.h"

#include "../primitives/row_groups.h"
#include "device_assert.cuh"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kPairGroups = kBlockThreads / kMoeCombineLanes;
constexpr int64_t kMaxGrid = 65535;

__device__ __forceinline__ void fail_bad_position(const char* op, int64_t position, int64_t rows) {
  fail_index_out_of_range(op, "position", position, "", rows, " rows of expert_out");
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads) moe_combine_fwd_kernel(MoeCombineOperands a, int threads_per_row) {
  constexpr int VEC = 16 / sizeof(T);
  for_each_group<VEC>(a.tokens, a.hidden, threads_per_row, [&](int64_t t, int64_t col) {
    const int64_t* pos = a.positions + t * a.top_k;
    const float* w = a.weights != nullptr ? a.weights + t * a.top_k : nullptr;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    for (int64_t r = 0; r < a.top_k; ++r) {
      const int64_t p = pos[r];
      if (p < 0 || p >= a.rows) {
        if (col == 0) fail_bad_position("moe_combine", p, a.rows);
        return false;
      }
      const Pack<T, VEC> x = load_group<T, VEC, VECTOR_IO>(
          static_cast<const T*>(a.expert_out) + p * a.expert_out_stride, col, a.hidden);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] = moe_combine_step(acc[j], r, moe_combine_term(w, r, Convert<T>::to_float(x.v[j])));
    }
    Pack<T, VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = Convert<T>::from_float(acc[j]);
    store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.out) + t * a.hidden, col, a.hidden, y);
    return true;
  });
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads) moe_combine_bwd_rows_kernel(MoeCombineOperands a, int threads_per_row) {
  constexpr int VEC = 16 / sizeof(T);
  for_each_group<VEC>(a.rows, a.hidden, threads_per_row, [&](int64_t row, int64_t col) {
    const int64_t o = a.owner[row];
    Pack<T, VEC> dx;
    if (o < 0) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dx.v[j] = Convert<T>::from_float(0.f);
    } else {
      const Pack<T, VEC> g = load_group<T, VEC, VECTOR_IO>(
          static_cast<const T*>(a.grad_out) + (o / a.top_k) * a.grad_out_stride, col, a.hidden);
      if (a.weights == nullptr) {
        dx = g;
      } else {
        const float w = a.weights[o];
#pragma unroll
        for (int j = 0; j < VEC; ++j) dx.v[j] = Convert<T>::from_float(mul_rn(w, Convert<T>::to_float(g.v[j])));
      }
    }
    store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.grad_expert_out) + row * a.hidden, col, a.hidden, dx);
    return true;
  });
}

__global__ void __launch_bounds__(kBlockThreads)
    moe_combine_owners_kernel(const int64_t* sorted, const int64_t* order, int64_t n, int64_t* owner, int64_t rows) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlockThreads) {
    const int64_t p = sorted[i];
    if (p < 0 || p >= rows) {
      fail_bad_position("moe_combine_backward", p, rows);
      return;
    }
    if (i + 1 == n || sorted[i + 1] != p) owner[p] = order[i];
  }
}

// The kMoeCombineChunk elements of a chunk starting at column col, in fp32 (0 past the row's end).
template <typename T, bool VECTOR_IO>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int64_t col, int64_t cols, float* out) {
  if constexpr (VECTOR_IO) {
    constexpr int VEC = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < kMoeCombineChunk / VEC; ++v) {
      Pack<T, VEC> p;
      *reinterpret_cast<uint4*>(&p) = __ldg(reinterpret_cast<const uint4*>(row + col + v * VEC));
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[v * VEC + j] = Convert<T>::to_float(p.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kMoeCombineChunk; ++j) out[j] = col + j < cols ? Convert<T>::to_float(row[col + j]) : 0.f;
  }
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads) moe_combine_bwd_weights_kernel(MoeCombineOperands a) {
  const int lane = threadIdx.x % kMoeCombineLanes;
  const int64_t pairs = a.tokens * a.top_k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kPairGroups + threadIdx.x / kMoeCombineLanes; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * kPairGroups) {
    const int64_t p = a.positions[i];
    if (p < 0 || p >= a.rows) {
      if (lane == 0) fail_bad_position("moe_combine_backward", p, a.rows);
      return;
    }
    const T* g = static_cast<const T*>(a.grad_out) + (i / a.top_k) * a.grad_out_stride;
    const T* x = static_cast<const T*>(a.expert_out) + p * a.expert_out_stride;
    float s = 0.f;
    for (int64_t col = static_cast<int64_t>(lane) * kMoeCombineChunk; col < a.hidden;
         col += static_cast<int64_t>(kMoeCombineLanes) * kMoeCombineChunk) {
      float gv[kMoeCombineChunk], xv[kMoeCombineChunk];
      load_chunk<T, VECTOR_IO>(g, col, a.hidden, gv);
      load_chunk<T, VECTOR_IO>(x, col, a.hidden, xv);
#pragma unroll
      for (int j = 0; j < kMoeCombineChunk; ++j) {
        if (VECTOR_IO || col + j < a.hidden) s = add_rn(s, mul_rn(gv[j], xv[j]));
      }
    }
#pragma unroll
    for (int h = kMoeCombineLanes / 2; h > 0; h /= 2) s = add_rn(s, shfl_xor(s, h, kMoeCombineLanes));
    if (lane == 0) a.grad_weights[i] = s;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned grid_1d(int64_t items, int64_t per_block) {
  const int64_t blocks = ceil_div(items, per_block);
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

}  // namespace

gpuError_t moe_combine_fwd_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream) {
  if (a.tokens == 0 || a.hidden == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = 16 / sizeof(T);
    const RowGroupCoverage c = row_group_coverage<kBlockThreads>(a.tokens, ceil_div(a.hidden, VEC));
    const bool vector_io = a.hidden % VEC == 0 && rows_aligned16<T>(a.expert_out, a.expert_out_stride) &&
                           aligned16(a.out);
    const auto kernel = vector_io ? moe_combine_fwd_kernel<T, true> : moe_combine_fwd_kernel<T, false>;
    kernel<<<c.grid, kBlockThreads, 0, stream>>>(a, c.threads_per_row);
    return gpu_last_error();
  }, gpu_not_supported);
}

gpuError_t moe_combine_owners_simt(const int64_t* sorted, const int64_t* order, int64_t n, int64_t* owner,
                                   int64_t rows, gpuStream_t stream) {
  if (n == 0) return kGpuSuccess;
  moe_combine_owners_kernel<<<grid_1d(n, kBlockThreads), kBlockThreads, 0, stream>>>(sorted, order, n, owner, rows);
  return gpu_last_error();
}

gpuError_t moe_combine_bwd_rows_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream) {
  if (a.rows == 0 || a.hidden == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = 16 / sizeof(T);
    const RowGroupCoverage c = row_group_coverage<kBlockThreads>(a.rows, ceil_div(a.hidden, VEC));
    const bool vector_io = a.hidden % VEC == 0 && rows_aligned16<T>(a.grad_out, a.grad_out_stride) &&
                           aligned16(a.grad_expert_out);
    const auto kernel = vector_io ? moe_combine_bwd_rows_kernel<T, true> : moe_combine_bwd_rows_kernel<T, false>;
    kernel<<<c.grid, kBlockThreads, 0, stream>>>(a, c.threads_per_row);
    return gpu_last_error();
  }, gpu_not_supported);
}

gpuError_t moe_combine_bwd_weights_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream) {
  if (a.tokens == 0 || a.top_k == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vector_io = a.hidden % kMoeCombineChunk == 0 && rows_aligned16<T>(a.grad_out, a.grad_out_stride) &&
                           rows_aligned16<T>(a.expert_out, a.expert_out_stride);
    const auto kernel = vector_io ? moe_combine_bwd_weights_kernel<T, true> : moe_combine_bwd_weights_kernel<T, false>;
    kernel<<<grid_1d(a.tokens * a.top_k, kPairGroups), kBlockThreads, 0, stream>>>(a);
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace rl_align
