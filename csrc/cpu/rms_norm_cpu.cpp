// Torch binding of the rms_norm CPU kernels (rms_norm_cpu_kernels.cpp): the host flow is in
// host/rms_norm.h; the backend (rms_norm_cpu.h) supplies the kernel calls.
#include <torch/library.h>

#include "../host/native_constants.h"
#include "../host/rms_norm.h"
#include "rms_norm_cpu.h"

namespace rl_align {

RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_TILE_ELEMENTS, kRmsNormTileElements);
RL_ALIGN_NATIVE_CONSTANT(RMS_NORM_MIN_TILE_ROWS, kRmsNormMinTileRows);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("rms_norm", &rms_norm_impl<RmsNormCpuBackend>);
  m.impl("rms_norm_backward", &rms_norm_backward_impl<RmsNormCpuBackend>);
}

}  // namespace rl_align
