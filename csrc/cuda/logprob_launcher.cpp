// Torch binding of the logprob GPU kernels (logprob_simt.cu): the host flow is in
// host/logprob.h; this backend supplies the device guard, the current stream and the kernel
// calls. Targets are range-checked in the kernels (a device-side assert, no host sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/logprob.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "logprob_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  static void check_targets(const char*, const at::Tensor&, int64_t, int64_t) {}
  static void fwd(const at::Tensor& logits, const LogprobOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    note_gpu_kernel("logprob_fwd", "simt");
    check_launch("logprob", logprob_fwd_simt(kernel_dtype(logits.scalar_type()), a,
                                             at::cuda::getCurrentCUDAStream()));
  }
  static void bwd(const at::Tensor& logits, const LogprobOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    note_gpu_kernel("logprob_bwd", "simt");
    check_launch("logprob_backward", logprob_bwd_simt(kernel_dtype(logits.scalar_type()), a,
                                                      at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("logprob", &logprob_impl<CudaBackend>);
  m.impl("logprob_backward", &logprob_backward_impl<CudaBackend>);
}

}  // namespace rl_align
