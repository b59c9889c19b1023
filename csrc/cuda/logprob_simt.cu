// logprob forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// Forward: one block of kFwdThreads threads per row (grid-striding over rows). The row's
// partition depends only on V and the dtype: in step i, thread `tid` takes the kFwdLoads groups
// of VEC = 16 / sizeof(T) elements starting at ((i * kFwdLoads + l) * kFwdThreads + tid) * VEC
// (l = 0 .. kFwdLoads - 1), and folds them into its LogprobState as one logprob_push, in that
// order. The states are merged by a fixed butterfly within each warp, then warp 0 .. W-1 in order
// by thread 0. VECTOR_IO (16-byte aligned rows, V a multiple of VEC) loads a group as one 16-byte
// load; otherwise element by element, bounds-checked, missing elements as -inf (no contribution):
// the arithmetic is the same either way. Nothing depends on the number of rows.
//
// Backward: elementwise given the row's lse, entropy and incoming gradients; blockIdx.x picks a
// range of groups of the row, blockIdx.y the rows (grid-striding). No reductions, no atomics.
#include "logprob_kernels.h"

#include "../primitives/pack.h"
#include "device_assert.cuh"

namespace rl_align {
namespace {

constexpr int kFwdThreads = 256;
constexpr int kFwdLoads = 4;
constexpr int kBwdThreads = 256;
constexpr int kBwdGroupsPerThread = 4;
constexpr int64_t kMaxGrid = 65535;

// Elements of group `col` (its first column) as fp32 scaled logits; outside [0, vocab): -inf.
template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void load_scaled(const T* __restrict__ row, int64_t col, int64_t vocab,
                                            float inv_t, float* z) {
  if constexpr (VECTOR_IO) {
    Pack<T, VEC> g;
    if (col < vocab) {
      *reinterpret_cast<uint4*>(&g) = __ldg(reinterpret_cast<const uint4*>(row + col));
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      z[j] = col < vocab ? mul_rn(Convert<T>::to_float(g.v[j]), inv_t) : -INFINITY;
    }
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      z[j] = col + j < vocab ? mul_rn(Convert<T>::to_float(row[col + j]), inv_t) : -INFINITY;
    }
  }
}

// A target outside [0, vocab) that is not ignore_index (device_assert.cuh).
__device__ __forceinline__ void fail_bad_target(const char* op, int64_t target, int64_t vocab) {
  fail_index_out_of_range(op, "target", target, "a vocabulary of ", vocab, "");
}

__device__ __forceinline__ LogprobState shfl_xor_state(LogprobState st, int mask) {
  return {shfl_xor(st.m, mask, kWarpSize), shfl_xor(st.s, mask, kWarpSize),
          shfl_xor(st.u, mask, kWarpSize)};
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kFwdThreads) logprob_fwd_kernel(LogprobOperands a) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kWarps = kFwdThreads / kWarpSize;
  __shared__ LogprobState warp_states[kWarps];
  const int tid = threadIdx.x;
  const int64_t step = static_cast<int64_t>(kFwdLoads) * kFwdThreads * VEC;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(a.logits) + row * a.logits_stride;
    LogprobState st = logprob_empty_state();
    for (int64_t base = 0; base < a.vocab; base += step) {
      float z[kFwdLoads * VEC];
#pragma unroll
      for (int l = 0; l < kFwdLoads; ++l) {
        const int64_t col = base + (static_cast<int64_t>(l) * kFwdThreads + tid) * VEC;
        load_scaled<T, VEC, VECTOR_IO>(x, col, a.vocab, a.inv_temperature, z + l * VEC);
      }
      st = logprob_push(st, z, kFwdLoads * VEC);
    }
#pragma unroll
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) st = logprob_merge(st, shfl_xor_state(st, mask));
    if (tid % kWarpSize == 0) warp_states[tid / kWarpSize] = st;
    __syncthreads();
    if (tid == 0) {
      LogprobState total = warp_states[0];
      for (int w = 1; w < kWarps; ++w) total = logprob_merge(total, warp_states[w]);
      const int64_t t = logprob_target(a, row);
      const bool ignored = t == a.ignore_index;
      if (!ignored && (t < 0 || t >= a.vocab)) fail_bad_target("logprob", t, a.vocab);
      const float z_target = ignored ? 0.f : mul_rn(Convert<T>::to_float(x[t]), a.inv_temperature);
      const LogprobRow out = logprob_finish(total, z_target);
      a.lse[row] = out.lse;
      a.logprob[row] = ignored ? 0.f : out.logprob;
      a.entropy[row] = ignored ? 0.f : out.entropy;
    }
    __syncthreads();  // warp_states is reused by the next row
  }
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBwdThreads) logprob_bwd_kernel(LogprobOperands a) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t first_group = static_cast<int64_t>(blockIdx.x) * kBwdThreads * kBwdGroupsPerThread;
  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const T* x = static_cast<const T*>(a.logits) + row * a.logits_stride;
    T* dx = static_cast<T*>(a.grad_logits) + row * a.vocab;
    const int64_t t = logprob_target(a, row);
    const bool ignored = t == a.ignore_index;
    if (!ignored && (t < 0 || t >= a.target_vocab)) {
      if (blockIdx.x == 0 && threadIdx.x == 0) fail_bad_target("logprob_backward", t, a.target_vocab);
      return;
    }
    const int64_t t_column = t - a.column_offset;  // the target's column in this slice of the row
    const float lse = a.saved_lse[row];
    const float g = a.grad_logprob[row];
    const bool has_gh = a.grad_entropy != nullptr;
    const float gh = has_gh ? a.grad_entropy[row] : 0.f;
    const float ez = add_rn(lse, -a.saved_entropy[row]);
#pragma unroll
    for (int k = 0; k < kBwdGroupsPerThread; ++k) {
      const int64_t col = (first_group + static_cast<int64_t>(k) * kBwdThreads + threadIdx.x) * VEC;
      if (col >= a.vocab) break;
      Pack<T, VEC> in, out;
      if constexpr (VECTOR_IO) {
        *reinterpret_cast<uint4*>(&in) = __ldg(reinterpret_cast<const uint4*>(x + col));
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) in.v[j] = col + j < a.vocab ? x[col + j] : Convert<T>::from_float(0.f);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out.v[j] = Convert<T>::from_float(
            ignored ? 0.f
                    : logprob_grad(Convert<T>::to_float(in.v[j]), col + j == t_column, a.inv_temperature,
                                   lse, g, has_gh, gh, ez));
      }
      if constexpr (VECTOR_IO) {
        *reinterpret_cast<uint4*>(dx + col) = *reinterpret_cast<const uint4*>(&out);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (col + j < a.vocab) dx[col + j] = out.v[j];
        }
      }
    }
  }
}

template <typename T>
bool vector_io_ok(const LogprobOperands& a, const void* out) {
  constexpr int VEC = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return a.vocab % VEC == 0 && aligned(a.logits) && (a.logits_stride * sizeof(T)) % 16 == 0 &&
         (out == nullptr || aligned(out));
}

unsigned grid_rows(int64_t rows) { return static_cast<unsigned>(rows < kMaxGrid ? rows : kMaxGrid); }

}  // namespace

gpuError_t logprob_fwd_simt(DType dtype, const LogprobOperands& a, gpuStream_t stream) {
  if (a.rows == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto kernel = vector_io_ok<T>(a, nullptr) ? logprob_fwd_kernel<T, true> : logprob_fwd_kernel<T, false>;
    kernel<<<grid_rows(a.rows), kFwdThreads, 0, stream>>>(a);
    return gpu_last_error();
  }, gpu_not_supported);
}

gpuError_t logprob_bwd_simt(DType dtype, const LogprobOperands& a, gpuStream_t stream) {
  if (a.rows == 0 || a.vocab == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = 16 / sizeof(T);
    const auto kernel = vector_io_ok<T>(a, a.grad_logits) ? logprob_bwd_kernel<T, true> : logprob_bwd_kernel<T, false>;
    const int64_t blocks_x = ceil_div(ceil_div(a.vocab, VEC), kBwdThreads * kBwdGroupsPerThread);
    kernel<<<dim3(static_cast<unsigned>(blocks_x), grid_rows(a.rows)), kBwdThreads, 0, stream>>>(a);
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace rl_align
