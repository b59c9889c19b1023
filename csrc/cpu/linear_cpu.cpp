// Torch binding of the linear ops' CPU kernels (linear_cpu_kernels.cpp): the host flow is in
// host/linear.h; the backend (linear_cpu.h) supplies the kernel calls.
#include <torch/library.h>

#include "../host/linear.h"
#include "../host/native_constants.h"
#include "linear_cpu.h"

namespace rl_align {

RL_ALIGN_NATIVE_CONSTANT(LINEAR_GRAD_TILE_TOKENS, kLinearGradTileTokens);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("linear", &linear_impl<LinearCpuBackend>);
  m.impl("linear_grad_input", &linear_grad_input_impl<LinearCpuBackend>);
  m.impl("linear_grad_weight", &linear_grad_weight_impl<LinearCpuBackend>);
  m.impl("linear_grad_bias", &linear_grad_bias_impl<LinearCpuBackend>);
}

}  // namespace rl_align
