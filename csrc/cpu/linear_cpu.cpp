// Torch binding of the linear ops' CPU kernels (linear_cpu_kernels.cpp), and of linear_logprob, which
// runs on these GEMMs and logprob's kernels (host/linear_logprob.h).
#include <torch/library.h>

#include "../host/linear.h"
#include "../host/linear_logprob.h"
#include "../host/native_constants.h"
#include "linear_cpu_kernels.h"
#include "logprob_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static bool needs_aligned_operands(const char*, at::ScalarType, const at::Tensor&) { return false; }
  static void run(const char*, at::ScalarType dtype, const GemmProblem& p, const at::Tensor&) {
    linear_gemm_cpu(dtype, p);
  }
  static void bias_grad(at::ScalarType dtype, const at::Tensor& dy, const float* accum, float* dbias) {
    linear_bias_bwd_cpu(dtype, dy.const_data_ptr(), row_stride(dy), dy.size(0), dy.size(1), accum,
                         dbias);
  }
  static void logprob_grad(const at::Tensor& logits, const LogprobOperands& a) {
    logprob_bwd_cpu(logits.scalar_type(), a);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(LINEAR_GRAD_TILE_TOKENS, kLinearGradTileTokens);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("linear", &linear_impl<CpuBackend>);
  m.impl("linear_grad_input", &linear_grad_input_impl<CpuBackend>);
  m.impl("linear_grad_weight", &linear_grad_weight_impl<CpuBackend>);
  m.impl("linear_grad_bias", &linear_grad_bias_impl<CpuBackend>);
  m.impl("linear_logprob", &linear_logprob_impl<CpuBackend>);
  m.impl("linear_logprob_backward", &linear_logprob_backward_impl<CpuBackend>);
}

}  // namespace rl_align
