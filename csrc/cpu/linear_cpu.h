// The CPU Backend (host/linear.h) of the linear binding (linear_cpu.cpp), and the GEMMs
// linear_logprob's CPU backend runs on (linear_logprob_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include "../host/linear.h"
#include "../host/provenance.h"
#include "linear_cpu_kernels.h"

namespace rl_align {

struct LinearCpuBackend {
  static bool needs_aligned_operands(const char*, at::ScalarType, const at::Tensor&) { return false; }
  static void run(const char*, at::ScalarType dtype, const GemmProblem& p, const at::Tensor&) {
    note_cpu_kernel("linear_gemm");
    linear_gemm_cpu(dtype, p);
  }
  static void bias_grad(at::ScalarType dtype, const at::Tensor& dy, const float* accum, float* dbias) {
    note_cpu_kernel("linear_bias_bwd");
    linear_bias_bwd_cpu(dtype, dy.const_data_ptr(), row_stride(dy), dy.size(0), dy.size(1), accum,
                         dbias);
  }
};

}  // namespace rl_align
