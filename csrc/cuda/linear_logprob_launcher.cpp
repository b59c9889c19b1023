// Torch binding of linear_logprob on the GPU: the host flow is in host/linear_logprob.h; it runs
// on linear's GEMMs (linear_launcher.h, the same path choice) and logprob's backward kernel
// (logprob_simt.cu).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/linear_logprob.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "linear_launcher.h"
#include "logprob_kernels.h"

namespace rl_align {
namespace {

struct LinearLogprobCudaBackend : LinearCudaBackend {
  static void logprob_grad(const at::Tensor& logits, const LogprobOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    note_gpu_kernel("logprob_bwd", "simt");
    check_launch("linear_logprob_backward", logprob_bwd_simt(kernel_dtype(logits.scalar_type()), a,
                                                             at::cuda::getCurrentCUDAStream()));
  }
  // out (contiguous, bf16/fp16) = sum (contiguous fp32) rounded as the GEMMs' epilogue rounds:
  // torch's CUDA conversion is the same round-to-nearest instruction (__float2bfloat16 /
  // __float2half, a NaN to the canonical NaN) as Convert<T>::from_float.
  static void round_like_gemm(const at::Tensor& sum, const at::Tensor& out) { out.copy_(sum); }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("linear_logprob", &linear_logprob_impl<LinearLogprobCudaBackend>);
  m.impl("linear_logprob_backward", &linear_logprob_backward_impl<LinearLogprobCudaBackend>);
  m.impl("linear_logprob_fused_grad", &linear_logprob_fused_grad_impl<LinearLogprobCudaBackend>);
}

}  // namespace rl_align
