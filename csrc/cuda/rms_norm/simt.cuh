// RMSNorm forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// Invariance: the partition of a row (threads per row, vectors per thread, reduction tree) comes
// from rms_norm_gpu_partition(hidden, element size) alone, and every row runs the same
// instructions on the same elements in the same order, whatever the number of rows and whether
// its loads are 16-byte vectors or single elements. dweight sums rows in fixed tiles
// (rms_norm_dweight_tile_rows), then adds the tile sums in row order: no atomics anywhere.
//
// Build time: in one translation unit these kernels took nvcc ~275 s (sm_80 + sm_90a), so their
// instantiations are spread over files compiled in parallel (the list at the end).
#pragma once

#include "../rms_norm_kernels.h"
#include "../../common/host_device.h"
#include "../../primitives/pack.h"

#include <atomic>

namespace rl_align {
namespace {

constexpr int kMaxWarpsPerBlock = 1024 / kWarpSize;

// Loads the 16-byte vector `vec_index` of a row. VECTOR_IO (rows 16-byte aligned, hidden a
// multiple of VEC) reads it in one instruction; otherwise it is read element by element into the
// same slots. Either way a thread holds the same elements in the same slots, so the arithmetic
// is identical. Slots past the row end hold zeros, the identity of every sum below.
template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* row, int64_t vec_index, int64_t hidden) {
  const int64_t base = vec_index * VEC;
  Pack<T, VEC> p;
  if constexpr (VECTOR_IO) {
    if (base < hidden) return *reinterpret_cast<const Pack<T, VEC>*>(row + base);
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = Convert<T>::from_float(0.f);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      p.v[j] = base + j < hidden ? row[base + j] : Convert<T>::from_float(0.f);
    }
  }
  return p;
}

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void store_pack(T* row, int64_t vec_index, int64_t hidden,
                                           const Pack<T, VEC>& p) {
  const int64_t base = vec_index * VEC;
  if constexpr (VECTOR_IO) {
    if (base < hidden) *reinterpret_cast<Pack<T, VEC>*>(row + base) = p;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (base + j < hidden) row[base + j] = p.v[j];
    }
  }
}

// Sums each of the N values over the `threads_per_row` threads of a row; every thread of the row
// ends with the same bits. Inside a warp: a butterfly (addition is commutative, so both partners
// of an exchange compute the same sum). Across warps (threads_per_row > warp):
// warp sums go through shared memory and every thread adds its row's warp sums in warp order.
// `scratch` must not be reused before the next __syncthreads (callers alternate two buffers).
template <int N>
__device__ __forceinline__ void row_allreduce(float (&v)[N], int threads_per_row,
                                              float (*scratch)[kMaxWarpsPerBlock]) {
  const int width = threads_per_row < kWarpSize ? threads_per_row : kWarpSize;
  for (int offset = width / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += shfl_xor(v[n], offset, kWarpSize);
  }
  if (threads_per_row <= kWarpSize) return;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = threads_per_row / kWarpSize;
  const int first_warp_of_row = threadIdx.x / threads_per_row * num_warps;
  if (threadIdx.x % kWarpSize == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n][warp] = v[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float s = scratch[n][first_warp_of_row];
    for (int w = 1; w < num_warps; ++w) s += scratch[n][first_warp_of_row + w];
    v[n] = s;
  }
}

// 1 / sqrt(mean(x^2) + eps), the same expression in the forward and the backward.
__device__ __forceinline__ float inv_rms_of(float sum_sq, int64_t hidden, float eps) {
  return rsqrtf(sum_sq / static_cast<float>(hidden) + eps);
}

// Launch bounds. Large rows (8 vectors per thread) may use up to 1024 threads per row; the
// others use 256-thread forward blocks, which leaves the compiler room for the register-resident
// row. Backward blocks of rows with <= 2 vectors per thread hold two row groups (512 threads).
template <int VPT>
struct LaunchBound {
  static constexpr int fwd = VPT == kRmsNormMaxVecsPerThread ? kRmsNormMaxThreadsPerRow : 256;
  static constexpr int bwd = VPT == kRmsNormMaxVecsPerThread ? kRmsNormMaxThreadsPerRow
                             : VPT <= 2                      ? 512
                                                             : 256;
};

// Loads a thread's VPT vectors of one row (zeros for a missing row: valid_hidden = 0).
template <typename T, int VEC, int VPT, bool VECTOR_IO>
__device__ __forceinline__ void load_row(Pack<T, VEC> (&packs)[VPT], const T* row, int lane,
                                         int threads_per_row, int64_t valid_hidden) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    packs[k] = load_pack<T, VEC, VECTOR_IO>(row, static_cast<int64_t>(k) * threads_per_row + lane,
                                            valid_hidden);
  }
}

// fp32 -> T -> fp32: the roundings of the llama mode and of add_rms_norm.
template <typename T>
struct RoundTo {
  __device__ __forceinline__ float operator()(float v) const {
    return Convert<T>::to_float(Convert<T>::from_float(v));
  }
};

// A row's second input: add_rms_norm's residual (forward) or grad_residual (backward), loaded
// beside x and added in the row's store step. RESIDUAL = false keeps no registers for it.
template <typename T, int VEC, int VPT, bool RESIDUAL>
struct ResidualPacks {
  Pack<T, VEC> v[RESIDUAL ? VPT : 1];
};

// Persistent grid: block b takes row groups b, b + gridDim.x, ... and loads the next group's
// rows before reducing the current one, so loads stay in flight across the row's reduction.
// Which block handles a row never changes the row's arithmetic. RESIDUAL (add_rms_norm): the row
// is round(x + residual), written to new_residual and then normalised like x.
template <typename T, int VPT, bool VECTOR_IO, RmsNormMode MODE, bool RESIDUAL>
__global__ void __launch_bounds__(LaunchBound<VPT>::fwd)
    rms_norm_fwd_kernel(const T* __restrict__ x, int64_t x_row_stride,
                        const T* __restrict__ residual, int64_t residual_row_stride,
                        const T* __restrict__ weight, T* __restrict__ y, int64_t y_row_stride,
                        T* __restrict__ new_residual, int64_t new_residual_row_stride,
                        int64_t rows, int64_t hidden, float eps, int threads_per_row) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float scratch[2][1][kMaxWarpsPerBlock];
  const int lane = threadIdx.x % threads_per_row;
  const int rows_per_block = blockDim.x / threads_per_row;
  const int group = threadIdx.x / threads_per_row;
  const int64_t row_groups = ceil_div(rows, rows_per_block);

  int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + group;
  // A thread owns the same columns in every row it visits: its weight slice stays in registers.
  Pack<T, VEC> wv[VPT], cur[VPT], next[VPT];
  ResidualPacks<T, VEC, VPT, RESIDUAL> cur_res, next_res;
  // Threads of a missing row still take part in the shuffles and barriers, on zeros.
  const auto load_inputs = [&](Pack<T, VEC>(&xp)[VPT], ResidualPacks<T, VEC, VPT, RESIDUAL>& rp,
                               int64_t r) {
    const int64_t safe = r < rows ? r : 0;
    const int64_t valid_hidden = r < rows ? hidden : 0;
    load_row<T, VEC, VPT, VECTOR_IO>(xp, x + safe * x_row_stride, lane, threads_per_row,
                                     valid_hidden);
    if constexpr (RESIDUAL) {
      load_row<T, VEC, VPT, VECTOR_IO>(rp.v, residual + safe * residual_row_stride, lane,
                                       threads_per_row, valid_hidden);
    }
  };
  load_row<T, VEC, VPT, VECTOR_IO>(wv, weight, lane, threads_per_row, hidden);
  load_inputs(cur, cur_res, row);
  int parity = 0;
  for (int64_t rg = blockIdx.x; rg < row_groups; rg += gridDim.x, parity ^= 1) {
    const int64_t next_row = row + static_cast<int64_t>(gridDim.x) * rows_per_block;
    load_inputs(next, next_res, next_row);
    if constexpr (RESIDUAL) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          cur[k].v[j] = Convert<T>::from_float(Convert<T>::to_float(cur[k].v[j]) +
                                               Convert<T>::to_float(cur_res.v[k].v[j]));
        }
        const int64_t vi = static_cast<int64_t>(k) * threads_per_row + lane;
        if (row < rows && vi * VEC < hidden) {
          store_pack<T, VEC, VECTOR_IO>(new_residual + row * new_residual_row_stride, vi, hidden,
                                        cur[k]);
        }
      }
    }
    float sum_sq[1] = {0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float f = Convert<T>::to_float(cur[k].v[j]);
        sum_sq[0] = fmaf(f, f, sum_sq[0]);
      }
    }
    row_allreduce<1>(sum_sq, threads_per_row, scratch[parity]);
    if (row < rows) {
      const float inv_rms = inv_rms_of(sum_sq[0], hidden, eps);
      T* y_row = y + row * y_row_stride;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t vi = static_cast<int64_t>(k) * threads_per_row + lane;
        if (vi * VEC >= hidden) break;
        Pack<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          // Normalise first, then the mode's weight step (common/rms_norm_mode.h).
          const float xhat = Convert<T>::to_float(cur[k].v[j]) * inv_rms;
          out.v[j] = Convert<T>::from_float(
              rms_norm_output<MODE>(xhat, Convert<T>::to_float(wv[k].v[j]), RoundTo<T>{}));
        }
        store_pack<T, VEC, VECTOR_IO>(y_row, vi, hidden, out);
      }
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) cur[k] = next[k];
    if constexpr (RESIDUAL) cur_res = next_res;
    row = next_row;
  }
}

// One block per tile of `tile_rows` rows. Each row is reduced like the forward; the block's row
// groups take rows g, g + groups, ... of the tile in order, each group accumulating its rows'
// dy * xhat into fp32 registers, then the groups' sums are added in group order. The tile sum
// goes to workspace[tile, :]. RESIDUAL (add_rms_norm_backward with grad_residual): the rounded dx
// plus grad_residual, rounded again (autograd's accumulation of the unfused pair).
template <typename T, int VPT, bool VECTOR_IO, RmsNormMode MODE, bool RESIDUAL>
__global__ void __launch_bounds__(LaunchBound<VPT>::bwd)
    rms_norm_bwd_kernel(const T* __restrict__ grad_out, int64_t grad_out_row_stride,
                        const T* __restrict__ grad_residual, int64_t grad_residual_row_stride,
                        const T* __restrict__ x, int64_t x_row_stride,
                        const T* __restrict__ weight, T* __restrict__ grad_x,
                        int64_t grad_x_row_stride, float* __restrict__ tile_sums, int64_t rows,
                        int64_t hidden, float eps, int threads_per_row, int64_t tile_rows) {
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float scratch[2][2][kMaxWarpsPerBlock];
  extern __shared__ float group_sums[];  // [groups, hidden] when a block holds several groups
  const int lane = threadIdx.x % threads_per_row;
  const int group = threadIdx.x / threads_per_row;
  const int groups = blockDim.x / threads_per_row;
  const int64_t tile_start = static_cast<int64_t>(blockIdx.x) * tile_rows;

  // The weight stays packed in registers (half the registers of fp32) for the whole tile.
  Pack<T, VEC> wv[VPT];
  float dweight[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    wv[k] = load_pack<T, VEC, VECTOR_IO>(weight, static_cast<int64_t>(k) * threads_per_row + lane,
                                         hidden);
#pragma unroll
    for (int j = 0; j < VEC; ++j) dweight[k][j] = 0.f;
  }

  // Rows of the tile are visited in steps of `groups` rows; the next step's x and dy are
  // loaded before the current step's reductions so that the loads overlap them.
  const int64_t tile_end = tile_start + tile_rows < rows ? tile_start + tile_rows : rows;
  Pack<T, VEC> xv[VPT], gv[VPT], x_next[VPT], g_next[VPT];
  ResidualPacks<T, VEC, VPT, RESIDUAL> rv, r_next;
  const auto load_inputs = [&](Pack<T, VEC>(&xp)[VPT], Pack<T, VEC>(&gp)[VPT],
                               ResidualPacks<T, VEC, VPT, RESIDUAL>& rp, int64_t r) {
    const int64_t safe = r < tile_end ? r : 0;
    const int64_t valid_hidden = r < tile_end ? hidden : 0;
    load_row<T, VEC, VPT, VECTOR_IO>(xp, x + safe * x_row_stride, lane, threads_per_row,
                                     valid_hidden);
    load_row<T, VEC, VPT, VECTOR_IO>(gp, grad_out + safe * grad_out_row_stride, lane,
                                     threads_per_row, valid_hidden);
    if constexpr (RESIDUAL) {
      load_row<T, VEC, VPT, VECTOR_IO>(rp.v, grad_residual + safe * grad_residual_row_stride,
                                       lane, threads_per_row, valid_hidden);
    }
  };
  int64_t row = tile_start + group;
  load_inputs(xv, gv, rv, row);
  int parity = 0;
  // The loop bound is the same for every thread of the block (barriers inside).
  for (int64_t first = tile_start; first < tile_end; first += groups, parity ^= 1) {
    const int64_t next_row = row + groups;
    load_inputs(x_next, g_next, r_next, next_row);
    // sums[0] = sum x^2, sums[1] = sum gw * x, gw = dy * weight_factor(w)
    float sums[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xf = Convert<T>::to_float(xv[k].v[j]);
        const float gf = Convert<T>::to_float(gv[k].v[j]) *
                         rms_norm_weight_factor<MODE>(Convert<T>::to_float(wv[k].v[j]));
        sums[0] = fmaf(xf, xf, sums[0]);
        sums[1] = fmaf(gf, xf, sums[1]);
      }
    }
    row_allreduce<2>(sums, threads_per_row, scratch[parity]);
    if (row < tile_end) {
      const float inv_rms = inv_rms_of(sums[0], hidden, eps);
      // dx = inv_rms * (gw - xhat * mean(gw * xhat)), mean(gw * xhat) = c below.
      const float c = sums[1] * inv_rms / static_cast<float>(hidden);
      T* dx_row = grad_x + row * grad_x_row_stride;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t vi = static_cast<int64_t>(k) * threads_per_row + lane;
        Pack<T, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xhat = Convert<T>::to_float(xv[k].v[j]) * inv_rms;
          const float dy = Convert<T>::to_float(gv[k].v[j]);
          out.v[j] = Convert<T>::from_float(inv_rms * fmaf(-xhat, c,
                                                           dy * rms_norm_weight_factor<MODE>(
                                                                    Convert<T>::to_float(wv[k].v[j]))));
          // add_rn: for fp32 the product above must not contract with this add into one fma.
          if constexpr (RESIDUAL) {
            out.v[j] = Convert<T>::from_float(add_rn(Convert<T>::to_float(out.v[j]),
                                                     Convert<T>::to_float(rv.v[k].v[j])));
          }
          dweight[k][j] =
              fmaf(dy, rms_norm_dweight_factor<MODE>(xhat, RoundTo<T>{}), dweight[k][j]);
        }
        if (vi * VEC < hidden) store_pack<T, VEC, VECTOR_IO>(dx_row, vi, hidden, out);
      }
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      xv[k] = x_next[k];
      gv[k] = g_next[k];
    }
    if constexpr (RESIDUAL) rv = r_next;
    row = next_row;
  }

  float* tile_out = tile_sums + static_cast<int64_t>(blockIdx.x) * hidden;
  if (groups == 1) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t base = (static_cast<int64_t>(k) * threads_per_row + lane) * VEC;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (base + j < hidden) tile_out[base + j] = dweight[k][j];
      }
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t base = (static_cast<int64_t>(k) * threads_per_row + lane) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (base + j < hidden) group_sums[group * hidden + base + j] = dweight[k][j];
    }
  }
  __syncthreads();
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float s = group_sums[h];
    for (int g = 1; g < groups; ++g) s += group_sums[g * hidden + h];
    tile_out[h] = s;
  }
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
bool rows_aligned16(const void* p, int64_t row_stride) {
  return is_aligned16(p) && (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

template <int VPT, bool VECTOR_IO, RmsNormMode MODE, bool RESIDUAL>
struct KernelShape {
  static constexpr int vecs_per_thread = VPT;
  static constexpr bool vector_io = VECTOR_IO;
  static constexpr RmsNormMode mode = MODE;
  static constexpr bool residual = RESIDUAL;
};

template <RmsNormMode MODE, bool RESIDUAL, typename F>
gpuError_t dispatch_vpt_io(int vecs_per_thread, bool vector_io, F&& f) {
  switch (vecs_per_thread * 2 + (vector_io ? 1 : 0)) {
    case 2: return f(KernelShape<1, false, MODE, RESIDUAL>{});
    case 3: return f(KernelShape<1, true, MODE, RESIDUAL>{});
    case 4: return f(KernelShape<2, false, MODE, RESIDUAL>{});
    case 5: return f(KernelShape<2, true, MODE, RESIDUAL>{});
    case 8: return f(KernelShape<4, false, MODE, RESIDUAL>{});
    case 9: return f(KernelShape<4, true, MODE, RESIDUAL>{});
    case 17: return f(KernelShape<8, true, MODE, RESIDUAL>{});
    default: return f(KernelShape<8, false, MODE, RESIDUAL>{});  // the partition gives 1, 2, 4, 8
  }
}

// Calls f(KernelShape<...>{}) for casting mode MODE and the runtime partition, I/O mode and
// residual.
template <RmsNormMode MODE, typename F>
gpuError_t dispatch_shape(int vecs_per_thread, bool vector_io, bool residual, F&& f) {
  return residual ? dispatch_vpt_io<MODE, true>(vecs_per_thread, vector_io, f)
                  : dispatch_vpt_io<MODE, false>(vecs_per_thread, vector_io, f);
}

// How many blocks of forward kernel KERNEL the current device runs at once (the persistent grid
// size). Cached per kernel instantiation (each has its own register count, hence occupancy; a
// grid sized for another instantiation leaves blocks waiting behind the persistent ones), per
// block size and per device.
template <auto KERNEL>
int64_t fwd_resident_blocks(int block_threads) {
  constexpr int kMaxDevices = 64;
  constexpr int kBlockSizes = 11;  // block_threads is a power of two <= 1024
  static std::atomic<int64_t> cached[kMaxDevices][kBlockSizes];
  const int device = current_device();
  int size_index = 0;
  while ((1 << size_index) < block_threads) ++size_index;
  const bool cacheable = device < kMaxDevices && size_index < kBlockSizes;
  if (cacheable) {
    const int64_t hit = cached[device][size_index].load(std::memory_order_relaxed);
    if (hit > 0) return hit;
  }
  const int64_t blocks = static_cast<int64_t>(multiprocessor_count(device)) *
                         max_active_blocks_per_multiprocessor(KERNEL, block_threads);
  if (cacheable) cached[device][size_index].store(blocks, std::memory_order_relaxed);
  return blocks;
}

// The optional second input of a row (residual, grad_residual) allows vector I/O when absent.
template <typename T>
bool optional_rows_aligned16(const void* p, int64_t row_stride) {
  return p == nullptr || rows_aligned16<T>(p, row_stride);
}

}  // namespace

// rms_norm_fwd_simt for storage type T, rows > 0 and hidden > 0.
template <typename T>
struct RmsNormFwdSimt {
  static gpuError_t launch(RmsNormMode mode, const void* x, int64_t x_row_stride,
                           const void* residual, int64_t residual_row_stride, const void* weight,
                           void* y, int64_t y_row_stride, void* new_residual,
                           int64_t new_residual_row_stride, int64_t rows, int64_t hidden,
                           float eps, gpuStream_t stream);
};

// rms_norm_bwd_simt's per-row kernel for storage type T and casting mode MODE, rows > 0 and
// hidden > 0: dx, and the dweight sum of each of the `tiles` tiles of `tile_rows` rows into
// workspace[tile, :].
template <typename T, RmsNormMode MODE>
struct RmsNormBwdSimt {
  static gpuError_t launch(const void* grad_out, int64_t grad_out_row_stride,
                           const void* grad_residual, int64_t grad_residual_row_stride,
                           const void* x, int64_t x_row_stride, const void* weight, void* grad_x,
                           int64_t grad_x_row_stride, float* workspace, int64_t rows,
                           int64_t hidden, float eps, int64_t tile_rows, int64_t tiles,
                           gpuStream_t stream);
};

template <typename T>
gpuError_t RmsNormFwdSimt<T>::launch(RmsNormMode mode, const void* x, int64_t x_row_stride,
                                     const void* residual, int64_t residual_row_stride,
                                     const void* weight, void* y, int64_t y_row_stride,
                                     void* new_residual, int64_t new_residual_row_stride,
                                     int64_t rows, int64_t hidden, float eps,
                                     gpuStream_t stream) {
  const RmsNormGpuPartition part = rms_norm_gpu_partition(hidden, static_cast<int>(sizeof(T)));
  const bool vector_io = hidden % part.vec == 0 && rows_aligned16<T>(x, x_row_stride) &&
                         rows_aligned16<T>(y, y_row_stride) && is_aligned16(weight) &&
                         optional_rows_aligned16<T>(residual, residual_row_stride) &&
                         optional_rows_aligned16<T>(new_residual, new_residual_row_stride);
  const int64_t row_groups = ceil_div(rows, part.rows_per_block());
  return dispatch_rms_norm_mode(mode, [&](auto mode_tag) {
    return dispatch_shape<decltype(mode_tag)::value>(part.vecs_per_thread, vector_io,
                                                     residual != nullptr, [&](auto shape) {
      using S = decltype(shape);
      constexpr auto kernel =
          rms_norm_fwd_kernel<T, S::vecs_per_thread, S::vector_io, S::mode, S::residual>;
      const int64_t resident = fwd_resident_blocks<kernel>(part.block_threads);
      const int64_t blocks = row_groups < resident ? row_groups : resident;
      kernel<<<static_cast<unsigned>(blocks), part.block_threads, 0, stream>>>(
          static_cast<const T*>(x), x_row_stride, static_cast<const T*>(residual),
          residual_row_stride, static_cast<const T*>(weight), static_cast<T*>(y), y_row_stride,
          static_cast<T*>(new_residual), new_residual_row_stride, rows, hidden, eps,
          part.threads_per_row);
      return gpu_last_error();
    });
  });
}

template <typename T, RmsNormMode MODE>
gpuError_t RmsNormBwdSimt<T, MODE>::launch(const void* grad_out, int64_t grad_out_row_stride,
                                           const void* grad_residual,
                                           int64_t grad_residual_row_stride, const void* x,
                                           int64_t x_row_stride, const void* weight,
                                           void* grad_x, int64_t grad_x_row_stride,
                                           float* workspace, int64_t rows, int64_t hidden,
                                           float eps, int64_t tile_rows, int64_t tiles,
                                           gpuStream_t stream) {
  const RmsNormGpuPartition part = rms_norm_gpu_partition(hidden, static_cast<int>(sizeof(T)));
  const bool vector_io = hidden % part.vec == 0 &&
                         rows_aligned16<T>(grad_out, grad_out_row_stride) &&
                         rows_aligned16<T>(x, x_row_stride) &&
                         rows_aligned16<T>(grad_x, grad_x_row_stride) && is_aligned16(weight) &&
                         optional_rows_aligned16<T>(grad_residual, grad_residual_row_stride);
  const int groups = part.bwd_row_groups();
  const size_t smem = groups > 1 ? static_cast<size_t>(groups) * hidden * sizeof(float) : 0;
  return dispatch_shape<MODE>(part.vecs_per_thread, vector_io, grad_residual != nullptr,
                             [&](auto shape) {
    using S = decltype(shape);
    rms_norm_bwd_kernel<T, S::vecs_per_thread, S::vector_io, S::mode, S::residual>
        <<<static_cast<unsigned>(tiles), part.bwd_block_threads, smem, stream>>>(
            static_cast<const T*>(grad_out), grad_out_row_stride,
            static_cast<const T*>(grad_residual), grad_residual_row_stride,
            static_cast<const T*>(x), x_row_stride, static_cast<const T*>(weight),
            static_cast<T*>(grad_x), grad_x_row_stride, workspace, rows, hidden, eps,
            part.threads_per_row, tile_rows);
    return gpu_last_error();
  });
}

// Instantiated in their own files: simt_fwd_<dtype>.cu, and, the backward kernels
// taking about twice as long, simt_bwd_<dtype>_mode_<mode>.cu.
extern template struct RmsNormFwdSimt<bfloat16_t>;
extern template struct RmsNormFwdSimt<half_t>;
extern template struct RmsNormFwdSimt<float>;
extern template struct RmsNormBwdSimt<bfloat16_t, RmsNormMode::kFp32>;
extern template struct RmsNormBwdSimt<bfloat16_t, RmsNormMode::kLlama>;
extern template struct RmsNormBwdSimt<bfloat16_t, RmsNormMode::kGemma>;
extern template struct RmsNormBwdSimt<half_t, RmsNormMode::kFp32>;
extern template struct RmsNormBwdSimt<half_t, RmsNormMode::kLlama>;
extern template struct RmsNormBwdSimt<half_t, RmsNormMode::kGemma>;
extern template struct RmsNormBwdSimt<float, RmsNormMode::kFp32>;
extern template struct RmsNormBwdSimt<float, RmsNormMode::kLlama>;
extern template struct RmsNormBwdSimt<float, RmsNormMode::kGemma>;

}  // namespace rl_align
