// Torch binding of the grouped (mixture-of-experts) linear ops on CPU: the host flow is in
// host/grouped_linear.h; each expert's rows go through the linear CPU kernels, so every row is
// linear's row bit for bit.
#include <torch/library.h>

#include "../host/grouped_linear.h"
#include "linear_cpu.h"

namespace rl_align {
namespace {

struct GroupedLinearCpuBackend : LinearCpuBackend {
  static bool grouped(const char*, at::ScalarType, const at::Tensor&, int64_t) { return false; }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("grouped_linear", &grouped_linear_impl<GroupedLinearCpuBackend>);
  m.impl("grouped_linear_grad_input", &grouped_linear_grad_input_impl<GroupedLinearCpuBackend>);
  m.impl("grouped_linear_grad_weight", &grouped_linear_grad_weight_impl<GroupedLinearCpuBackend>);
}

}  // namespace rl_align
