// Torch binding of the rms_norm GPU kernels: argument checks, device guard, current stream,
// dtype mapping. All arithmetic lives in rms_norm_kernels.cu.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../rms_norm_host.h"
#include "launcher_util.h"
#include "rms_norm_kernels.h"

namespace rl_align {
namespace {

void check_gpu_hidden(const char* op, const at::Tensor& x) {
  const int64_t max_hidden = rms_norm_gpu_max_hidden(static_cast<int>(x.element_size()));
  TORCH_CHECK_VALUE(x.size(-1) <= max_hidden, "rl_align::", op, ": hidden size ", x.size(-1),
                    " exceeds the GPU kernel's limit of ", max_hidden, " for ", x.scalar_type());
}

void check_launch(const char* op, gpuError_t err) {
  TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": kernel launch failed: ",
              gpu_error_string(err));
}

at::Tensor rms_norm_gpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_rms_norm_args(op, x, weight, eps);
  check_gpu_hidden(op, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return y;
  const at::Tensor xr = as_rows(x);
  const at::Tensor w = weight.contiguous();
  const at::Tensor yr = y.view({xr.size(0), xr.size(1)});
  check_launch(op, rms_norm_fwd_cuda(kernel_dtype(x.scalar_type()), xr.const_data_ptr(),
                                     row_stride(xr), w.const_data_ptr(), yr.mutable_data_ptr(),
                                     row_stride(yr), xr.size(0), xr.size(1),
                                     static_cast<float>(eps), at::cuda::getCurrentCUDAStream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_gpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& dweight_accum) {
  constexpr const char* op = "rms_norm_backward";
  check_rms_norm_backward_args(grad_out, x, weight, eps, dweight_accum);
  check_gpu_hidden(op, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t hidden = x.size(-1);
  at::Tensor dweight = at::empty({hidden}, x.options().dtype(at::kFloat));
  if (hidden == 0) return {dx, dweight};
  const at::Tensor acc = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  const int64_t rows = x.numel() / hidden;
  const at::Tensor xr = as_rows(x);
  const at::Tensor gr = as_rows(grad_out);
  const at::Tensor dxr = dx.view({rows, hidden});
  const at::Tensor w = weight.contiguous();
  const at::Tensor workspace =
      at::empty({rms_norm_bwd_workspace_elements(rows, hidden)}, x.options().dtype(at::kFloat));
  check_launch(op, rms_norm_bwd_cuda(kernel_dtype(x.scalar_type()), gr.const_data_ptr(),
                                     row_stride(gr), xr.const_data_ptr(), row_stride(xr),
                                     w.const_data_ptr(), dxr.mutable_data_ptr(), row_stride(dxr),
                                     acc.defined() ? acc.const_data_ptr<float>() : nullptr,
                                     dweight.mutable_data_ptr<float>(),
                                     workspace.mutable_data_ptr<float>(), rows, hidden,
                                     static_cast<float>(eps), at::cuda::getCurrentCUDAStream()));
  return {dx, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("rms_norm", &rms_norm_gpu);
  m.impl("rms_norm_backward", &rms_norm_backward_gpu);
}

}  // namespace rl_align
