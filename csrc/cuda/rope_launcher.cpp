// Torch binding of the rope GPU kernel (rope_simt.cu): the host flow is rope_run (host/rope.h);
// this backend supplies the device guard, the current stream and the kernel calls.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/rope.h"
#include "rope_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  using Entry = gpuError_t (*)(DType, const RopeProblem&, gpuStream_t);
  static void launch(Entry entry, const char* op, at::ScalarType dtype, const RopeProblem& p,
                     const at::Tensor& q) {
    const c10::cuda::CUDAGuard guard(q.device());
    const gpuError_t err = entry(kernel_dtype(dtype), p, at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": kernel launch failed: ",
                gpu_error_string(err));
  }
  static void fwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q) {
    note_gpu_kernel("rope_fwd", "simt");
    launch(rope_fwd_simt, op, dtype, p, q);
  }
  static void bwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q) {
    note_gpu_kernel("rope_bwd", "simt");
    launch(rope_bwd_simt, op, dtype, p, q);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("rope", &rope_impl<CudaBackend>);
  m.impl("rope_backward", &rope_backward_impl<CudaBackend>);
}

}  // namespace rl_align
