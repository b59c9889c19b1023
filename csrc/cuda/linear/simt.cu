// FMA-tile GEMM (the linear ops' fp32 path, and every dtype's path on HIP and on GPUs without a
// tensor-core kernel) and the bias-gradient column sums.
//
// Invariance: each output element is one thread's fp32 accumulator that takes
// fmaf(A[i, kk], B[kk, j], acc) for kk = 0, 1, ..., k-1 in order, starting from the saved
// accumulator or zero. Tiling only decides which thread holds which element, never the order.
#include "../linear_kernels.h"

#include <type_traits>

namespace rl_align {
namespace {

constexpr int kSimtTileM = 64;
constexpr int kSimtTileN = 64;
constexpr int kSimtTileK = 16;
constexpr int kSimtThreads = 256;
constexpr int kSimtMicro = 4;  // each thread: 4 x 4 outputs, rows and columns 16 apart
static_assert(kSimtTileM == kSimtMicro * 16 && kSimtTileN == kSimtMicro * 16, "thread grid 16x16");

// Bias gradient: one thread per column.
constexpr int kColumnThreads = 256;

template <typename T, bool A_MN, bool B_MN, bool C_FP32>
__global__ void __launch_bounds__(kSimtThreads)
    linear_gemm_simt_kernel(const T* __restrict__ a, int64_t lda, const T* __restrict__ b,
                            int64_t ldb, void* c, int64_t ldc, const T* __restrict__ bias,
                            const float* c_accum, int64_t m, int64_t n, int64_t k) {
  __shared__ float a_tile[kSimtTileK][kSimtTileM];
  __shared__ float b_tile[kSimtTileK][kSimtTileN];
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kSimtTileM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kSimtTileN;
  const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;

  float acc[kSimtMicro][kSimtMicro];
#pragma unroll
  for (int r = 0; r < kSimtMicro; ++r) {
#pragma unroll
    for (int q = 0; q < kSimtMicro; ++q) {
      const int64_t i = m0 + tr + 16 * r, j = n0 + tc + 16 * q;
      acc[r][q] = (c_accum != nullptr && i < m && j < n) ? c_accum[i * ldc + j] : 0.f;
    }
  }

  for (int64_t k0 = 0; k0 < k; k0 += kSimtTileK) {
    // Stage a 16-deep slice of A and B in fp32; the index order follows each operand's
    // contiguous dimension so that neighbouring threads read neighbouring addresses.
    for (int idx = threadIdx.x; idx < kSimtTileK * kSimtTileM; idx += kSimtThreads) {
      const int kk = A_MN ? idx / kSimtTileM : idx % kSimtTileK;
      const int ii = A_MN ? idx % kSimtTileM : idx / kSimtTileK;
      const int64_t i = m0 + ii, kg = k0 + kk;
      float v = 0.f;
      if (i < m && kg < k) v = Convert<T>::to_float(A_MN ? a[kg * lda + i] : a[i * lda + kg]);
      a_tile[kk][ii] = v;
    }
    for (int idx = threadIdx.x; idx < kSimtTileK * kSimtTileN; idx += kSimtThreads) {
      const int kk = B_MN ? idx / kSimtTileN : idx % kSimtTileK;
      const int jj = B_MN ? idx % kSimtTileN : idx / kSimtTileK;
      const int64_t j = n0 + jj, kg = k0 + kk;
      float v = 0.f;
      if (j < n && kg < k) v = Convert<T>::to_float(B_MN ? b[kg * ldb + j] : b[j * ldb + kg]);
      b_tile[kk][jj] = v;
    }
    __syncthreads();
    // Zero-filled tail slots are skipped, not added: the chain has exactly k steps.
    const int depth = static_cast<int>(k - k0 < kSimtTileK ? k - k0 : kSimtTileK);
    for (int kk = 0; kk < depth; ++kk) {
#pragma unroll
      for (int r = 0; r < kSimtMicro; ++r) {
        const float av = a_tile[kk][tr + 16 * r];
#pragma unroll
        for (int q = 0; q < kSimtMicro; ++q) acc[r][q] = fmaf(av, b_tile[kk][tc + 16 * q], acc[r][q]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < kSimtMicro; ++r) {
#pragma unroll
    for (int q = 0; q < kSimtMicro; ++q) {
      const int64_t i = m0 + tr + 16 * r, j = n0 + tc + 16 * q;
      if (i >= m || j >= n) continue;
      float v = acc[r][q];
      if (bias != nullptr) v += Convert<T>::to_float(bias[j]);
      if constexpr (C_FP32) {
        static_cast<float*>(c)[i * ldc + j] = v;
      } else {
        static_cast<T*>(c)[i * ldc + j] = Convert<T>::from_float(v);
      }
    }
  }
}

template <typename T, bool A_MN, bool B_MN, bool C_FP32>
gpuError_t launch_simt(const GemmProblem& p, gpuStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, kSimtTileN)),
                  static_cast<unsigned>(ceil_div(p.m, kSimtTileM)));
  linear_gemm_simt_kernel<T, A_MN, B_MN, C_FP32><<<grid, kSimtThreads, 0, stream>>>(
      static_cast<const T*>(p.a), p.lda, static_cast<const T*>(p.b), p.ldb, p.c, p.ldc,
      static_cast<const T*>(p.bias), p.c_accum, p.m, p.n, p.k);
  return gpu_last_error();
}

// fp32 C and the input dtype's are one store for fp32 inputs: one instantiation.
template <typename T, bool A_MN, bool B_MN>
gpuError_t dispatch_output(const GemmProblem& p, gpuStream_t stream) {
  if (p.c_fp32 || std::is_same<T, float>::value) return launch_simt<T, A_MN, B_MN, true>(p, stream);
  return launch_simt<T, A_MN, B_MN, false>(p, stream);
}

// The layouts of the linear ops (forward, grad input, grad weight), any output (accum: fp32 C).
template <typename T>
gpuError_t dispatch_simt(const GemmProblem& p, gpuStream_t stream) {
  if (p.c_accum != nullptr && !p.c_fp32) return RL_GPU(ErrorNotSupported);
  if (!p.a_mn_major && !p.b_mn_major) return dispatch_output<T, false, false>(p, stream);
  if (!p.a_mn_major && p.b_mn_major) return dispatch_output<T, false, true>(p, stream);
  if (p.a_mn_major && p.b_mn_major) return dispatch_output<T, true, true>(p, stream);
  return RL_GPU(ErrorNotSupported);
}

// Sum of each column over one tile of kLinearGradTileTokens rows, rows in order.
template <typename T>
__global__ void __launch_bounds__(kColumnThreads)
    bias_grad_tile_sums_kernel(const T* __restrict__ dy, int64_t ld, int64_t m, int64_t n,
                               float* __restrict__ tile_sums) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumnThreads + threadIdx.x;
  if (j >= n) return;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kLinearGradTileTokens;
  const int64_t last = first + kLinearGradTileTokens < m ? first + kLinearGradTileTokens : m;
  float sum = 0.f;
  for (int64_t i = first; i < last; ++i) sum += Convert<T>::to_float(dy[i * ld + j]);
  tile_sums[static_cast<int64_t>(blockIdx.y) * n + j] = sum;
}

// dbias = accum (or 0) + the tile sums, tiles in row order.
__global__ void __launch_bounds__(kColumnThreads)
    bias_grad_total_kernel(const float* __restrict__ tile_sums, int64_t tiles, int64_t n,
                           const float* accum, float* dbias) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumnThreads + threadIdx.x;
  if (j >= n) return;
  float total = accum != nullptr ? accum[j] : 0.f;
  for (int64_t t = 0; t < tiles; ++t) total += tile_sums[t * n + j];
  dbias[j] = total;
}

template <typename T>
gpuError_t launch_bias_grad(const T* dy, int64_t ld, int64_t m, int64_t n, const float* accum,
                            float* dbias, float* workspace, gpuStream_t stream) {
  const int64_t tiles = ceil_div(m, kLinearGradTileTokens);
  const unsigned column_blocks = static_cast<unsigned>(ceil_div(n, kColumnThreads));
  if (tiles > 0) {
    bias_grad_tile_sums_kernel<T><<<dim3(column_blocks, static_cast<unsigned>(tiles)),
                                     kColumnThreads, 0, stream>>>(dy, ld, m, n, workspace);
  }
  bias_grad_total_kernel<<<column_blocks, kColumnThreads, 0, stream>>>(workspace, tiles, n, accum,
                                                                        dbias);
  return gpu_last_error();
}

}  // namespace

gpuError_t linear_gemm_simt(DType dtype, const GemmProblem& p, gpuStream_t stream) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return RL_GPU(ErrorInvalidValue);
  if (p.tree_leaves > 1) return RL_GPU(ErrorNotSupported);  // the tree runs leaf by leaf here
  return dispatch_dtype<KernelTypes>(
      dtype, [&](auto tag) { return dispatch_simt<decltype(tag)>(p, stream); }, gpu_not_supported);
}

int64_t linear_bias_bwd_workspace_elements(int64_t m, int64_t n) {
  return ceil_div(m, kLinearGradTileTokens) * n;
}

gpuError_t linear_bias_bwd_simt(DType dtype, const void* dy, int64_t ld, int64_t m, int64_t n,
                                 const float* accum, float* dbias, float* workspace,
                                 gpuStream_t stream) {
  if (n <= 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(
      dtype,
      [&](auto tag) {
        using T = decltype(tag);
        return launch_bias_grad(static_cast<const T*>(dy), ld, m, n, accum, dbias, workspace, stream);
      },
      gpu_not_supported);
}

}  // namespace rl_align
