// CPU kernels of logprob, forward and backward (common/logprob.h: the operands and the
// arithmetic, the same functions the GPU kernels call).
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/logprob.h"

namespace rl_align {

// logprob, entropy and lse of every row (targets checked). dtype: the logits' (at::kFloat,
// at::kHalf, at::kBFloat16; caller has checked).
void logprob_fwd_cpu(at::ScalarType dtype, const LogprobOperands& a);

// grad_logits of every row, rounded once to dtype.
void logprob_bwd_cpu(at::ScalarType dtype, const LogprobOperands& a);

}  // namespace rl_align
