// Torch binding of the silu_and_mul GPU kernels (silu_and_mul_simt.cu): the host flow of both
// layouts is in host/silu_and_mul.h; this backend supplies the device guard, the current stream
// and the kernel calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/silu_and_mul.h"
#include "launcher_util.h"
#include "silu_and_mul_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  static void fwd(const char* op, const at::Tensor& ref, const SiluMulOperands& a) {
    const c10::cuda::CUDAGuard guard(ref.device());
    note_gpu_kernel("silu_and_mul_fwd", "simt");
    check_launch(op, silu_and_mul_fwd_simt(kernel_dtype(ref.scalar_type()), a,
                                           at::cuda::getCurrentCUDAStream()));
  }
  static void bwd(const char* op, const at::Tensor& ref, const SiluMulOperands& a) {
    const c10::cuda::CUDAGuard guard(ref.device());
    note_gpu_kernel("silu_and_mul_bwd", "simt");
    check_launch(op, silu_and_mul_bwd_simt(kernel_dtype(ref.scalar_type()), a,
                                           at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("silu_and_mul", &silu_and_mul_impl<CudaBackend>);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward_impl<CudaBackend>);
  m.impl("silu_mul", &silu_mul_impl<CudaBackend>);
  m.impl("silu_mul_backward", &silu_mul_backward_impl<CudaBackend>);
}

}  // namespace rl_align
