// Torch binding of linear_logprob on the CPU: the host flow is in host/linear_logprob.h; it runs
// on linear's GEMMs (linear_cpu.h) and logprob's backward kernel (logprob_cpu_kernels.cpp).
#include <torch/library.h>

#include "../host/linear_logprob.h"
#include "../host/native_constants.h"
#include "../host/provenance.h"
#include "linear_cpu.h"
#include "logprob_cpu_kernels.h"

namespace rl_align {
namespace {

struct LinearLogprobCpuBackend : LinearCpuBackend {
  static void logprob_grad(const at::Tensor& logits, const LogprobOperands& a) {
    note_cpu_kernel("logprob_bwd");
    logprob_bwd_cpu(logits.scalar_type(), a);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_CHUNK_ELEMENTS, kLinearLogprobChunkElements);
RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_SLICE_COLUMNS, kLinearLogprobSliceColumns);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("linear_logprob", &linear_logprob_impl<LinearLogprobCpuBackend>);
  m.impl("linear_logprob_backward", &linear_logprob_backward_impl<LinearLogprobCpuBackend>);
}

}  // namespace rl_align
