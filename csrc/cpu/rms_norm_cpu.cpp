// Torch binding of the rms_norm and add_rms_norm CPU kernels (rms_norm_cpu_kernels.cpp): the
// host flow is in host/rms_norm.h; this backend supplies the kernel calls.
#include <torch/library.h>

#include "../host/native_constants.h"
#include "../host/rms_norm.h"
#include "rms_norm_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
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
    rms_norm_fwd_cpu(xr.scalar_type(), mode, xr.const_data_ptr(), row_stride(xr),
                     data_or_null(rr), stride_or_zero(rr), w.const_data_ptr(),
                     yr.mutable_data_ptr(), row_stride(yr),
                     nrr.defined() ? nrr.mutable_data_ptr() : nullptr, stride_or_zero(nrr),
                     xr.size(0), xr.size(1), eps);
  }
  static void bwd(const char*, const at::Tensor& gr, const at::Tensor& grr, const at::Tensor& xr,
                  const at::Tensor& w, const at::Tensor& dxr, const float* accum,
                  const at::Tensor& dweight, float eps, RmsNormMode mode) {
    rms_norm_bwd_cpu(xr.scalar_type(), mode, gr.const_data_ptr(), row_stride(gr),
                     data_or_null(grr), stride_or_zero(grr), xr.const_data_ptr(), row_stride(xr),
                     w.const_data_ptr(), dxr.mutable_data_ptr(), row_stride(dxr), accum,
                     dweight.mutable_data_ptr<float>(), xr.size(0), xr.size(1), eps);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_TILE_ELEMENTS, kRmsNormTileElements);
RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_MIN_TILE_ROWS, kRmsNormMinTileRows);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("rms_norm", &rms_norm_impl<CpuBackend>);
  m.impl("rms_norm_backward", &rms_norm_backward_impl<CpuBackend>);
  m.impl("add_rms_norm", &add_rms_norm_impl<CpuBackend>);
  m.impl("add_rms_norm_backward", &add_rms_norm_backward_impl<CpuBackend>);
}

}  // namespace rl_align
