// Torch binding of the silu_and_mul CPU kernels (silu_and_mul_cpu_kernels.cpp): the host flow of
// both layouts is in host/silu_and_mul.h; this backend supplies the kernel calls.
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/silu_and_mul.h"
#include "silu_and_mul_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void fwd(const char*, const at::Tensor& ref, const SiluMulOperands& a) {
    note_cpu_kernel("silu_and_mul_fwd");
    silu_and_mul_fwd_cpu(ref.scalar_type(), a);
  }
  static void bwd(const char*, const at::Tensor& ref, const SiluMulOperands& a) {
    note_cpu_kernel("silu_and_mul_bwd");
    silu_and_mul_bwd_cpu(ref.scalar_type(), a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul_impl<CpuBackend>);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward_impl<CpuBackend>);
  m.impl("silu_mul", &silu_mul_impl<CpuBackend>);
  m.impl("silu_mul_backward", &silu_mul_backward_impl<CpuBackend>);
}

}  // namespace rl_align
