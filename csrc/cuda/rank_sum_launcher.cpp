// Torch binding of the rank_sum GPU kernel (rank_sum_simt.cu): the host flow is in
// host/rank_sum.h; this backend supplies the device guard, the current stream and the kernel call.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/rank_sum.h"
#include "launcher_util.h"
#include "rank_sum_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  static void run(const at::Tensor& ref, const RankSumOperands& a) {
    const c10::cuda::CUDAGuard guard(ref.device());
    note_gpu_kernel("rank_sum", "simt");
    check_launch("rank_sum", rank_sum_simt(kernel_dtype(ref.scalar_type()), a, at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) { m.impl("rank_sum", &rank_sum_impl<CudaBackend>); }

}  // namespace rl_align
