// Torch binding of the rms_norm CPU kernels (rms_norm_cpu_kernels.cpp): the host flow is
// rms_norm_impl (host/rms_norm.h); this backend supplies the kernel calls.
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
  static void fwd(const char*, const at::Tensor& xr, const at::Tensor& w, const at::Tensor& yr,
                  float eps) {
    rms_norm_fwd_cpu(xr.scalar_type(), xr.const_data_ptr(), row_stride(xr), w.const_data_ptr(),
                     yr.mutable_data_ptr(), row_stride(yr), xr.size(0), xr.size(1), eps);
  }
  static void bwd(const char*, const at::Tensor& gr, const at::Tensor& xr, const at::Tensor& w,
                  const at::Tensor& dxr, const float* accum, const at::Tensor& dweight, float eps) {
    rms_norm_bwd_cpu(xr.scalar_type(), gr.const_data_ptr(), row_stride(gr), xr.const_data_ptr(),
                     row_stride(xr), w.const_data_ptr(), dxr.mutable_data_ptr(), row_stride(dxr),
                     accum, dweight.mutable_data_ptr<float>(), xr.size(0), xr.size(1), eps);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_TILE_ELEMENTS, kRmsNormTileElements);
RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_MIN_TILE_ROWS, kRmsNormMinTileRows);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("rms_norm", &rms_norm_impl<CpuBackend>);
  m.impl("rms_norm_backward", &rms_norm_backward_impl<CpuBackend>);
}

}  // namespace rl_align
