// Torch binding of the logprob CPU kernels (logprob_cpu_kernels.cpp): the host flow is in
// host/logprob.h; this backend supplies the target range check and the kernel calls. (linear_logprob is registered by the linear
// binding, which owns the GEMM backend: host/linear_logprob.h.)
#include <torch/library.h>

#include "../host/logprob.h"
#include "../host/native_constants.h"
#include "logprob_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void check_targets(const char* op, const at::Tensor& targets, int64_t vocab,
                            int64_t ignore_index) {
    check_targets_in_range_cpu(op, targets, vocab, ignore_index);
  }
  static void fwd(const at::Tensor& logits, const LogprobOperands& a) {
    logprob_fwd_cpu(logits.scalar_type(), a);
  }
  static void bwd(const at::Tensor& logits, const LogprobOperands& a) {
    logprob_bwd_cpu(logits.scalar_type(), a);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_CHUNK_ELEMENTS, kLinearLogprobChunkElements);
RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_SLICE_COLUMNS, kLinearLogprobSliceColumns);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("logprob", &logprob_impl<CpuBackend>);
  m.impl("logprob_backward", &logprob_backward_impl<CpuBackend>);
}

}  // namespace rl_align
