// The CUDA Backend (host/rms_norm.h) of the rms_norm and add_rms_norm launchers
// (rms_norm_launcher.cpp, add_rms_norm_launcher.cpp): one kernel pair (rms_norm/simt.cuh) serves
// both families, the residual views undefined for rms_norm. It supplies the GPU's hidden-size
// limit, the device guard, the current stream and the kernel calls.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "../host/provenance.h"
#include "../host/rms_norm.h"
#include "launcher_util.h"
#include "rms_norm_kernels.h"

namespace rl_align {

struct RmsNormCudaBackend {
  static void check_input(const char* op, const at::Tensor& x) {
    const int64_t max_hidden = rms_norm_gpu_max_hidden(static_cast<int>(x.element_size()));
    TORCH_CHECK_VALUE(x.size(-1) <= max_hidden, "rl_align::", op, ": hidden size ", x.size(-1),
                      " exceeds the GPU kernel's limit of ", max_hidden, " for ", x.scalar_type());
  }
  // Undefined residual views (rms_norm) pass null pointers.
  static const void* data_or_null(const at::Tensor& t) {
    return t.defined() ? t.const_data_ptr() : nullptr;
  }
  static int64_t stride_or_zero(const at::Tensor& t) { return t.defined() ? row_stride(t) : 0; }

  static void fwd(const char* op, const at::Tensor& xr, const at::Tensor& rr, const at::Tensor& w,
                  const at::Tensor& yr, const at::Tensor& nrr, float eps, RmsNormMode mode) {
    const c10::cuda::CUDAGuard guard(xr.device());
    note_gpu_kernel("rms_norm_fwd", "simt");
    check_launch(op, rms_norm_fwd_simt(kernel_dtype(xr.scalar_type()), mode, xr.const_data_ptr(),
                                       row_stride(xr), data_or_null(rr), stride_or_zero(rr),
                                       w.const_data_ptr(), yr.mutable_data_ptr(), row_stride(yr),
                                       nrr.defined() ? nrr.mutable_data_ptr() : nullptr,
                                       stride_or_zero(nrr), xr.size(0), xr.size(1), eps,
                                       at::cuda::getCurrentCUDAStream()));
  }
  static void bwd(const char* op, const at::Tensor& gr, const at::Tensor& grr,
                  const at::Tensor& xr, const at::Tensor& w, const at::Tensor& dxr,
                  const float* accum, const at::Tensor& dweight, float eps, RmsNormMode mode) {
    const c10::cuda::CUDAGuard guard(xr.device());
    const int64_t rows = xr.size(0), hidden = xr.size(1);
    const at::Tensor workspace =
        at::empty({rms_norm_bwd_workspace_elements(rows, hidden)}, xr.options().dtype(at::kFloat));
    note_gpu_kernel("rms_norm_bwd", "simt");
    check_launch(op, rms_norm_bwd_simt(kernel_dtype(xr.scalar_type()), mode, gr.const_data_ptr(),
                                       row_stride(gr), data_or_null(grr), stride_or_zero(grr),
                                       xr.const_data_ptr(), row_stride(xr), w.const_data_ptr(),
                                       dxr.mutable_data_ptr(), row_stride(dxr), accum,
                                       dweight.mutable_data_ptr<float>(),
                                       workspace.mutable_data_ptr<float>(), rows, hidden, eps,
                                       at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace rl_align
