// Torch binding of the moe_combine GPU kernels (moe_combine_simt.cu): the host flow is in
// host/moe_combine.h; this backend supplies the device guard, the current stream, the backward's
// stable sort of the positions (at::sort: row-major order within equal positions, deterministic)
// for the row owners, and the kernel calls. Positions are range-checked on the device (no host
// sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/moe_combine.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "moe_combine_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  // On the device (the kernels print the bad position and fail a device-side assert): a host check
  // would cost a synchronisation per call.
  static void check_positions(const char*, const at::Tensor&, int64_t) {}

  static void fwd(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    const c10::cuda::CUDAGuard guard(expert_out.device());
    note_gpu_kernel("moe_combine_fwd", "simt");
    check_launch("moe_combine", moe_combine_fwd_simt(kernel_dtype(expert_out.scalar_type()), a,
                                                     at::cuda::getCurrentCUDAStream()));
  }

  static void owners(const char* op, const at::Tensor& positions, const at::Tensor& owner) {
    const c10::cuda::CUDAGuard guard(positions.device());
    owner.fill_(-1);
    if (positions.numel() == 0) return;
    const auto [sorted, order] = at::sort(positions.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
    note_gpu_kernel("moe_combine_owners", "simt");
    check_launch(op, moe_combine_owners_simt(sorted.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
                                             sorted.numel(), owner.mutable_data_ptr<int64_t>(), owner.size(0),
                                             at::cuda::getCurrentCUDAStream()));
  }

  static void bwd_rows(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    const c10::cuda::CUDAGuard guard(expert_out.device());
    note_gpu_kernel("moe_combine_bwd_rows", "simt");
    check_launch("moe_combine_backward", moe_combine_bwd_rows_simt(kernel_dtype(expert_out.scalar_type()), a,
                                                                   at::cuda::getCurrentCUDAStream()));
  }

  static void bwd_weights(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    const c10::cuda::CUDAGuard guard(expert_out.device());
    note_gpu_kernel("moe_combine_bwd_weights", "simt");
    check_launch("moe_combine_backward", moe_combine_bwd_weights_simt(kernel_dtype(expert_out.scalar_type()), a,
                                                                      at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("moe_combine", &moe_combine_impl<CudaBackend>);
  m.impl("moe_combine_backward", &moe_combine_backward_impl<CudaBackend>);
}

}  // namespace rl_align
