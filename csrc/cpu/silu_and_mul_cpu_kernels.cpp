// silu_and_mul CPU kernels: rows split over threads by at::parallel_for, every element computed
// by the shared per-element functions of common/silu_and_mul.h, so neither the batch nor the
// thread count changes any bit.
#include "silu_and_mul_cpu_kernels.h"

#include <ATen/Parallel.h>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

// About 32K elements per task: enough work to amortise a thread hand-off.
int64_t grain_rows(int64_t cols) { return cols >= 32768 ? 1 : 32768 / (cols > 0 ? cols : 1); }

template <typename T>
const T* row_of(const void* base, int64_t stride, int64_t r) {
  return static_cast<const T*>(base) + r * stride;
}

template <typename T>
T* row_of(void* base, int64_t stride, int64_t r) {
  return static_cast<T*>(base) + r * stride;
}

// One kernel for both directions: forward y = out; backward d gate = out, d up = dup.
template <typename T, bool BACKWARD>
void kernel(const SiluMulOperands& a) {
  at::parallel_for(0, a.rows, grain_rows(a.cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = row_of<T>(a.gate, a.gate_stride, r);
      const T* u = row_of<T>(a.up, a.up_stride, r);
      T* out = row_of<T>(a.out, a.out_stride, r);
      if constexpr (BACKWARD) {
        const T* dy = row_of<T>(a.grad_out, a.grad_out_stride, r);
        T* du = row_of<T>(a.dup, a.dup_stride, r);
        for (int64_t c = 0; c < a.cols; ++c) {
          const SiluMulGrads d = silu_mul_backward(static_cast<float>(dy[c]), static_cast<float>(g[c]),
                                                   static_cast<float>(u[c]));
          out[c] = static_cast<T>(d.dgate);
          du[c] = static_cast<T>(d.dup);
        }
      } else {
        for (int64_t c = 0; c < a.cols; ++c) {
          out[c] = static_cast<T>(silu_mul_forward(static_cast<float>(g[c]), static_cast<float>(u[c])));
        }
      }
    }
  });
}

}  // namespace

void silu_and_mul_fwd_cpu(at::ScalarType dtype, const SiluMulOperands& a) {
  dispatch_cpu_dtype("silu_and_mul", dtype, [&](auto tag) { kernel<decltype(tag), false>(a); });
}

void silu_and_mul_bwd_cpu(at::ScalarType dtype, const SiluMulOperands& a) {
  dispatch_cpu_dtype("silu_and_mul_backward", dtype, [&](auto tag) { kernel<decltype(tag), true>(a); });
}

}  // namespace rl_align
