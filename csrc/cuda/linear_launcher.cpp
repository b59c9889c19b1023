// Torch binding of the linear GPU kernels: the host flow is in host/linear.h; the backend
// (linear_launcher.h) supplies path choice and the kernel calls.
#include <torch/library.h>

#include "../host/linear.h"
#include "linear_launcher.h"

namespace rl_align {

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("linear", &linear_impl<LinearCudaBackend>);
  m.impl("linear_grad_input", &linear_grad_input_impl<LinearCudaBackend>);
  m.impl("linear_grad_weight", &linear_grad_weight_impl<LinearCudaBackend>);
  m.impl("linear_grad_bias", &linear_grad_bias_impl<LinearCudaBackend>);
}

}  // namespace rl_align
