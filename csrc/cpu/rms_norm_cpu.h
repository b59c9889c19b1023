// The CPU Backend (host/rms_norm.h) of the rms_norm and add_rms_norm bindings (rms_norm_cpu.cpp,
// add_rms_norm_cpu.cpp): one kernel pair (rms_norm_cpu_kernels.cpp) serves both families, the
// residual views undefined for rms_norm.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "../host/provenance.h"
#include "../host/rms_norm.h"
#include "rms_norm_cpu_kernels.h"

namespace rl_align {

struct RmsNormCpuBackend {
  static void check_input(const char* op, const at::Tensor& x) {
    TORCH_CHECK(x.device().is_cpu(), "rl_align::", op, " (CPU kernel): x must be a CPU tensor");
  }
  // Undefined residual views (rms_norm) pass null pointers.
  static const void* data_or_null(const at::Tensor& t) {
    return t.defined() ? t.const_data_ptr() : nullptr;
  }
  static int64_t stride_or_zero(const at::Tensor& t) { return t.defined() ? row_stride(t) : 0; }

  static void fwd(const char*, const at::Tensor& xr, const at::Tensor& rr, const at::Tensor& w,
                  const at::Tensor& yr, const at::Tensor& nrr, float eps, RmsNormMode mode) {
    note_cpu_kernel("rms_norm_fwd");
    rms_norm_fwd_cpu(xr.scalar_type(), mode, xr.const_data_ptr(), row_stride(xr),
                     data_or_null(rr), stride_or_zero(rr), w.const_data_ptr(),
                     yr.mutable_data_ptr(), row_stride(yr),
                     nrr.defined() ? nrr.mutable_data_ptr() : nullptr, stride_or_zero(nrr),
                     xr.size(0), xr.size(1), eps);
  }
  static void bwd(const char*, const at::Tensor& gr, const at::Tensor& grr, const at::Tensor& xr,
                  const at::Tensor& w, const at::Tensor& dxr, const float* accum,
                  const at::Tensor& dweight, float eps, RmsNormMode mode) {
    note_cpu_kernel("rms_norm_bwd");
    rms_norm_bwd_cpu(xr.scalar_type(), mode, gr.const_data_ptr(), row_stride(gr),
                     data_or_null(grr), stride_or_zero(grr), xr.const_data_ptr(), row_stride(xr),
                     w.const_data_ptr(), dxr.mutable_data_ptr(), row_stride(dxr), accum,
                     dweight.mutable_data_ptr<float>(), xr.size(0), xr.size(1), eps);
  }
};

}  // namespace rl_align
