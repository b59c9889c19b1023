// Host entry points of the rms_norm GPU kernels (rms_norm_kernels.h): they dispatch the dtype
// (and the backward's casting mode) to the launches of simt.cuh, each compiled in a file
// of its own, and run the backward's dtype-independent dweight tile sum.
#include "simt.cuh"

namespace rl_align {
namespace {

// dweight[h] = accum[h] (or 0) + tile_sums[0, h] + tile_sums[1, h] + ..., strictly in tile
// order: the chaining contract. The adds form one dependent chain per column, so the work is
// latency-bound: a block owns kTileSumColumns columns; all its warps stage a chunk of tile rows
// in shared memory (many loads in flight), then the first warp adds them in tile order.
constexpr int kTileSumColumns = 32;
constexpr int kTileSumLoaders = 8;
constexpr int kTileSumChunk = 256;
constexpr int kTileSumLoadsPerThread = kTileSumChunk / kTileSumLoaders;

__global__ void __launch_bounds__(kTileSumColumns * kTileSumLoaders)
    rms_norm_dweight_tile_sum_kernel(const float* __restrict__ tile_sums, int64_t tiles,
                                     int64_t hidden, const float* accum, float* out) {
  __shared__ float stage[kTileSumChunk][kTileSumColumns];
  const int lane = threadIdx.x % kTileSumColumns;
  const int loader = threadIdx.x / kTileSumColumns;
  const int64_t h = static_cast<int64_t>(blockIdx.x) * kTileSumColumns + lane;
  const bool column = h < hidden;
  float acc = loader == 0 && column && accum != nullptr ? accum[h] : 0.f;
  for (int64_t t0 = 0; t0 < tiles; t0 += kTileSumChunk) {
    const int64_t n = tiles - t0 < kTileSumChunk ? tiles - t0 : kTileSumChunk;
    float loaded[kTileSumLoadsPerThread];
#pragma unroll
    for (int i = 0; i < kTileSumLoadsPerThread; ++i) {
      const int64_t r = loader + static_cast<int64_t>(i) * kTileSumLoaders;
      loaded[i] = r < n && column ? tile_sums[(t0 + r) * hidden + h] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kTileSumLoadsPerThread; ++i) {
      stage[loader + i * kTileSumLoaders][lane] = loaded[i];
    }
    __syncthreads();
    if (loader == 0) {
#pragma unroll 16
      for (int64_t r = 0; r < n; ++r) acc += stage[r][lane];
    }
    __syncthreads();
  }
  if (loader == 0 && column) out[h] = acc;
}

}  // namespace

gpuError_t rms_norm_fwd_simt(DType dtype, RmsNormMode mode, const void* x, int64_t x_row_stride,
                             const void* residual, int64_t residual_row_stride,
                             const void* weight, void* y, int64_t y_row_stride,
                             void* new_residual, int64_t new_residual_row_stride, int64_t rows,
                             int64_t hidden, float eps, gpuStream_t stream) {
  if (rows == 0 || hidden == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    return RmsNormFwdSimt<decltype(tag)>::launch(mode, x, x_row_stride, residual,
                                                 residual_row_stride, weight, y, y_row_stride,
                                                 new_residual, new_residual_row_stride, rows,
                                                 hidden, eps, stream);
  }, gpu_not_supported);
}

int64_t rms_norm_bwd_workspace_elements(int64_t rows, int64_t hidden) {
  return ceil_div(rows, rms_norm_dweight_tile_rows(hidden)) * hidden;
}

gpuError_t rms_norm_bwd_simt(DType dtype, RmsNormMode mode, const void* grad_out,
                             int64_t grad_out_row_stride, const void* grad_residual,
                             int64_t grad_residual_row_stride, const void* x,
                             int64_t x_row_stride, const void* weight, void* grad_x,
                             int64_t grad_x_row_stride, const float* dweight_accum,
                             float* dweight_out, float* workspace, int64_t rows, int64_t hidden,
                             float eps, gpuStream_t stream) {
  if (hidden == 0) return kGpuSuccess;
  const int64_t tile_rows = rms_norm_dweight_tile_rows(hidden);
  const int64_t tiles = ceil_div(rows, tile_rows);
  if (rows > 0) {
    const gpuError_t err = dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
      return dispatch_rms_norm_mode(mode, [&](auto mode_tag) {
        return RmsNormBwdSimt<decltype(tag), decltype(mode_tag)::value>::launch(
            grad_out, grad_out_row_stride, grad_residual, grad_residual_row_stride, x,
            x_row_stride, weight, grad_x, grad_x_row_stride, workspace, rows, hidden, eps,
            tile_rows, tiles, stream);
      });
    }, gpu_not_supported);
    if (err != kGpuSuccess) return err;
  }
  const int64_t blocks = ceil_div(hidden, kTileSumColumns);
  rms_norm_dweight_tile_sum_kernel<<<static_cast<unsigned>(blocks), kTileSumColumns * kTileSumLoaders,
                                     0, stream>>>(
      workspace, tiles, hidden, dweight_accum, dweight_out);
  return gpu_last_error();
}

}  // namespace rl_align
