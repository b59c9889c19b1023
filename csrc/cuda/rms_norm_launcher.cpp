// Torch binding of the rms_norm GPU kernels (rms_norm/simt.cuh): the host flow is rms_norm_impl
// (host/rms_norm.h); the backend (rms_norm_launcher.h) supplies the kernel calls.
#include <torch/library.h>

#include "../host/rms_norm.h"
#include "rms_norm_launcher.h"

namespace rl_align {

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("rms_norm", &rms_norm_impl<RmsNormCudaBackend>);
  m.impl("rms_norm_backward", &rms_norm_backward_impl<RmsNormCudaBackend>);
}

}  // namespace rl_align
