// Torch binding of the moe_router GPU kernels (moe_router_simt.cu): the host flow is in
// host/moe_router.h; this backend supplies the device guard, the current stream and the kernel
// calls. The backward's expert ids are range-checked on the device (no host sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/moe_router.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "moe_router_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  static void fwd(const at::Tensor& logits, const MoeRouterOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    note_gpu_kernel("moe_router_fwd", "simt");
    check_launch("moe_router", moe_router_fwd_simt(kernel_dtype(logits.scalar_type()), a,
                                                   at::cuda::getCurrentCUDAStream()));
  }
  static void bwd(const at::Tensor& logits, const MoeRouterOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    note_gpu_kernel("moe_router_bwd", "simt");
    check_launch("moe_router_backward", moe_router_bwd_simt(kernel_dtype(logits.scalar_type()), a,
                                                            at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("moe_router", &moe_router_impl<CudaBackend>);
  m.impl("moe_router_backward", &moe_router_backward_impl<CudaBackend>);
}

}  // namespace rl_align
