// silu_and_mul forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// Elementwise: a thread takes one 16-byte group of VEC elements of a row (columns
// VEC*k .. VEC*k + VEC-1) and runs the per-element functions of common/silu_and_mul.h on each, so
// an element's bits depend on nothing but its own inputs. VECTOR_IO (every base pointer and row
// stride 16-byte aligned, cols a multiple of VEC) moves a group with one 16-byte load or store per
// operand; otherwise the same group is moved element by element, bounds-checked: the arithmetic
// is the same either way (tested: aligned vs misaligned inputs give the same bits).
//
// Grid: a block of kBlockThreads threads holds `rows_per_block` rows of `threads_per_row` threads
// (a power of two covering the row's groups, at most the block), blockIdx.x picks the row's group
// range and blockIdx.y the rows, grid-striding over rows past the y-limit. Plenty of independent
// 16-byte accesses per SM keep the loads in flight; no shared memory, no synchronisation.
#include "silu_and_mul_kernels.h"

#include "../primitives/pack.h"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;
constexpr int64_t kMaxGridY = 65535;

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ Pack<T, VEC> load_group(const T* __restrict__ row, int64_t col, int64_t cols) {
  Pack<T, VEC> p;
  if constexpr (VECTOR_IO) {
    *reinterpret_cast<uint4*>(&p) = __ldg(reinterpret_cast<const uint4*>(row + col));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = col + j < cols ? row[col + j] : Convert<T>::from_float(0.f);
  }
  return p;
}

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void store_group(T* __restrict__ row, int64_t col, int64_t cols,
                                            const Pack<T, VEC>& p) {
  if constexpr (VECTOR_IO) {
    uint4 raw;
    *reinterpret_cast<Pack<T, VEC>*>(&raw) = p;
#if RL_ALIGN_HIP
    *reinterpret_cast<uint4*>(row + col) = raw;
#else
    // nvcc splits a plain 16-byte store of the group into 2- and 4-byte stores here (seen in the
    // PTX); the instruction itself keeps it one 16-byte store.
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(row + col), "r"(raw.x),
                 "r"(raw.y), "r"(raw.z), "r"(raw.w)
                 : "memory");
#endif
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (col + j < cols) row[col + j] = p.v[j];
    }
  }
}

// How a launch covers [rows, groups]: the same for both directions.
struct Coverage {
  int threads_per_row;
  int rows_per_block;
  dim3 grid;
};

Coverage coverage_of(int64_t rows, int64_t groups_per_row) {
  int tpr = 1;
  while (tpr < groups_per_row && tpr < kBlockThreads) tpr *= 2;
  const int rpb = kBlockThreads / tpr;
  const int64_t grid_x = ceil_div(groups_per_row, tpr);
  const int64_t grid_y = ceil_div(rows, rpb);
  return {tpr, rpb, dim3(static_cast<unsigned>(grid_x),
                         static_cast<unsigned>(grid_y < kMaxGridY ? grid_y : kMaxGridY))};
}

// Calls body(row, col) for every (row, first column of a group) this thread owns.
template <int VEC, typename Body>
__device__ __forceinline__ void for_each_group(int64_t rows, int64_t cols, int threads_per_row,
                                               Body&& body) {
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * threads_per_row +
                       threadIdx.x % threads_per_row) * VEC;
  if (col >= cols) return;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * rows_per_block;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * rows_per_block + threadIdx.x / threads_per_row;
       row < rows; row += row_step) {
    body(row, col);
  }
}

// One kernel for both directions: forward y = out; backward d gate = out, d up = dup.
template <typename T, bool BACKWARD, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads)
    silu_and_mul_kernel(SiluMulOperands a, int threads_per_row) {
  constexpr int VEC = 16 / sizeof(T);
  const auto load = [&](const void* base, int64_t stride, int64_t row, int64_t col) {
    return load_group<T, VEC, VECTOR_IO>(static_cast<const T*>(base) + row * stride, col, a.cols);
  };
  const auto store = [&](void* base, int64_t stride, int64_t row, int64_t col,
                         const Pack<T, VEC>& p) {
    store_group<T, VEC, VECTOR_IO>(static_cast<T*>(base) + row * stride, col, a.cols, p);
  };
  for_each_group<VEC>(a.rows, a.cols, threads_per_row, [&](int64_t row, int64_t col) {
    const Pack<T, VEC> g = load(a.gate, a.gate_stride, row, col);
    const Pack<T, VEC> u = load(a.up, a.up_stride, row, col);
    if constexpr (BACKWARD) {
      const Pack<T, VEC> dy = load(a.grad_out, a.grad_out_stride, row, col);
      Pack<T, VEC> dg, du;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const SiluMulGrads d = silu_mul_backward(Convert<T>::to_float(dy.v[j]),
                                                 Convert<T>::to_float(g.v[j]),
                                                 Convert<T>::to_float(u.v[j]));
        dg.v[j] = Convert<T>::from_float(d.dgate);
        du.v[j] = Convert<T>::from_float(d.dup);
      }
      store(a.out, a.out_stride, row, col, dg);
      store(a.dup, a.dup_stride, row, col, du);
    } else {
      Pack<T, VEC> y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        y.v[j] = Convert<T>::from_float(
            silu_mul_forward(Convert<T>::to_float(g.v[j]), Convert<T>::to_float(u.v[j])));
      }
      store(a.out, a.out_stride, row, col, y);
    }
  });
}

template <typename T>
bool rows_aligned16(const void* p, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

// The 16-byte path needs every operand's rows aligned and whole groups per row.
template <typename T>
bool vector_io_ok(const SiluMulOperands& a, bool backward) {
  constexpr int VEC = 16 / sizeof(T);
  return a.cols % VEC == 0 && rows_aligned16<T>(a.gate, a.gate_stride) &&
         rows_aligned16<T>(a.up, a.up_stride) && rows_aligned16<T>(a.out, a.out_stride) &&
         (!backward || (rows_aligned16<T>(a.grad_out, a.grad_out_stride) &&
                        rows_aligned16<T>(a.dup, a.dup_stride)));
}

template <bool BACKWARD>
gpuError_t launch(DType dtype, const SiluMulOperands& a, gpuStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const Coverage c = coverage_of(a.rows, ceil_div(a.cols, 16 / sizeof(T)));
    const auto kernel = vector_io_ok<T>(a, BACKWARD) ? silu_and_mul_kernel<T, BACKWARD, true>
                                                     : silu_and_mul_kernel<T, BACKWARD, false>;
    kernel<<<c.grid, kBlockThreads, 0, stream>>>(a, c.threads_per_row);
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace

gpuError_t silu_and_mul_fwd_simt(DType dtype, const SiluMulOperands& a, gpuStream_t stream) {
  return launch<false>(dtype, a, stream);
}

gpuError_t silu_and_mul_bwd_simt(DType dtype, const SiluMulOperands& a, gpuStream_t stream) {
  return launch<true>(dtype, a, stream);
}

}  // namespace rl_align
