// Torch binding of add_rms_norm on the CPU: the host flow is in host/add_rms_norm.h; the kernels
// and their backend are rms_norm's (rms_norm_cpu.h), which take the residual.
#include <torch/library.h>

#include "../host/add_rms_norm.h"
#include "rms_norm_cpu.h"

namespace rl_align {

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_impl<RmsNormCpuBackend>);
  m.impl("add_rms_norm_backward", &add_rms_norm_backward_impl<RmsNormCpuBackend>);
}

}  // namespace rl_align
