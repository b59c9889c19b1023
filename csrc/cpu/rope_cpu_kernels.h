// CPU kernels of rope. Torch types only at the interface (the dtype); the arithmetic is
// common/rope.h's.
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/rope.h"

namespace rl_align {

// Rotates every token of p.operand[0] (q) and p.operand[1] (k) by its own position's angles and
// copies elements rotary_dim..head_dim-1. dtype: at::kFloat, at::kHalf, at::kBFloat16 (checked).
void rope_fwd_cpu(at::ScalarType dtype, const RopeProblem& p);

// The same with the transposed rotation (sin negated): the gradients of rope_fwd_cpu.
void rope_bwd_cpu(at::ScalarType dtype, const RopeProblem& p);

}  // namespace rl_align
