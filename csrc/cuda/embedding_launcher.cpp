// Torch binding of the embedding GPU kernels (embedding_simt.cu): the host flow is embedding_impl /
// embedding_grad_weight_impl (host/embedding.h); this backend supplies the device guard, the
// current stream, the backward's stable sort of the ids (at::sort: token order within equal ids,
// deterministic) and the kernel calls. Ids are range-checked on the device (no host sync).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/embedding.h"
#include "../host/provenance.h"
#include "embedding_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  // On the device (the kernels print the bad id and fail a device-side assert): a host check
  // would cost a synchronisation per call.
  static void check_ids(const char*, const at::Tensor&, int64_t) {}

  static void fwd(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(ids.device());
    note_gpu_kernel("embedding_fwd", "simt");
    const gpuError_t err = embedding_fwd_simt(
        kernel_dtype(weight.scalar_type()), ids.const_data_ptr(), ids.scalar_type() == at::kLong,
        ids.numel(), weight.const_data_ptr(), row_stride(weight), weight.size(0),
        out.mutable_data_ptr(), weight.size(1), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == kGpuSuccess, "rl_align::embedding: kernel launch failed: ",
                gpu_error_string(err));
  }

  static void bwd(const at::Tensor& grad_rows, const at::Tensor& ids, int64_t padding_idx,
                  const float* accum, const at::Tensor& dweight) {
    const c10::cuda::CUDAGuard guard(ids.device());
    const auto [sorted_ids, order] = at::sort(ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const int64_t num_embeddings = dweight.size(0);
    const at::Tensor workspace = at::empty({embedding_bwd_workspace_elements(num_embeddings)},
                                           ids.options().dtype(at::kLong));
    note_gpu_kernel("embedding_bwd", "simt");
    const gpuError_t err = embedding_bwd_simt(
        kernel_dtype(grad_rows.scalar_type()), grad_rows.const_data_ptr(), row_stride(grad_rows),
        sorted_ids.const_data_ptr(), sorted_ids.scalar_type() == at::kLong,
        order.const_data_ptr<int64_t>(), ids.numel(), padding_idx, accum,
        dweight.mutable_data_ptr<float>(), workspace.mutable_data_ptr<int64_t>(), num_embeddings,
        dweight.size(1), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == kGpuSuccess, "rl_align::embedding_grad_weight: kernel launch failed: ",
                gpu_error_string(err));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("embedding", &embedding_impl<CudaBackend>);
  m.impl("embedding_grad_weight", &embedding_grad_weight_impl<CudaBackend>);
}

}  // namespace rl_align
