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

#include "../primitives/row_groups.h"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;

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
    const RowGroupCoverage c = row_group_coverage<kBlockThreads>(a.rows, ceil_div(a.cols, 16 / sizeof(T)));
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
