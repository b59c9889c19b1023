// Torch binding of linear_logprob on the CPU: the host flow is in host/linear_logprob.h; it runs
// on linear's GEMMs (linear_cpu.h) and logprob's backward kernel (logprob_cpu_kernels.cpp).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
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
  // out (contiguous, bf16/fp16) = sum (contiguous fp32) rounded as the GEMM's epilogue rounds
  // (static_cast: round to nearest even, a NaN to the canonical NaN; torch's vectorised copy keeps
  // a NaN's sign and payload).
  static void round_like_gemm(const at::Tensor& sum, const at::Tensor& out) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(out.scalar_type(), "linear_logprob_fused_grad", [&] {
      const float* src = sum.const_data_ptr<float>();
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, sum.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<scalar_t>(src[i]);
      });
    });
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_CHUNK_ELEMENTS, kLinearLogprobChunkElements);
RL_ALIGN_NATIVE_CONSTANT(LINEAR_LOGPROB_SLICE_COLUMNS, kLinearLogprobSliceColumns);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("linear_logprob", &linear_logprob_impl<LinearLogprobCpuBackend>);
  m.impl("linear_logprob_backward", &linear_logprob_backward_impl<LinearLogprobCpuBackend>);
  m.impl("linear_logprob_fused_grad", &linear_logprob_fused_grad_impl<LinearLogprobCpuBackend>);
}

}  // namespace rl_align
