// Torch binding of the logprob CPU kernels (logprob_cpu_kernels.cpp): the host flow is in
// host/logprob.h; this backend supplies the target range check and the kernel calls.
#include <torch/library.h>

#include "../host/logprob.h"
#include "../host/provenance.h"
#include "logprob_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void check_targets(const char* op, const at::Tensor& targets, int64_t vocab,
                            int64_t ignore_index) {
    check_targets_in_range_cpu(op, targets, vocab, ignore_index);
  }
  static void fwd(const at::Tensor& logits, const LogprobOperands& a) {
    note_cpu_kernel("logprob_fwd");
    logprob_fwd_cpu(logits.scalar_type(), a);
  }
  static void bwd(const at::Tensor& logits, const LogprobOperands& a) {
    note_cpu_kernel("logprob_bwd");
    logprob_bwd_cpu(logits.scalar_type(), a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("logprob", &logprob_impl<CpuBackend>);
  m.impl("logprob_backward", &logprob_backward_impl<CpuBackend>);
}

}  // namespace rl_align
