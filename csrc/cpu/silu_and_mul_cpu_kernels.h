// CPU kernels of silu_and_mul, forward and backward, for both layouts (common/silu_and_mul.h:
// the operands and the arithmetic, the same functions the GPU kernels call).
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/silu_and_mul.h"

namespace rl_align {

// out = silu(gate) * up, rounded once to dtype. dtype: at::kFloat, at::kHalf, at::kBFloat16
// (caller has checked); every operand of `a` in that dtype.
void silu_and_mul_fwd_cpu(at::ScalarType dtype, const SiluMulOperands& a);

// out = d gate, dup = d up from grad_out, gate and up, each rounded once to dtype.
void silu_and_mul_bwd_cpu(at::ScalarType dtype, const SiluMulOperands& a);

}  // namespace rl_align
