// CPU kernels of moe_router, forward and backward (common/moe_router.h: the operands and the
// arithmetic, the same functions the GPU kernels call, in the same order).
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/moe_router.h"

namespace rl_align {

// weights, experts_out from the logits (dtype: the logits' at::kFloat, at::kHalf or at::kBFloat16).
void moe_router_fwd_cpu(at::ScalarType dtype, const MoeRouterOperands& a);

// grad_logits (the logits' dtype) from grad_weights, the logits and experts_in. An expert id
// outside [0, experts) raises an IndexError naming the first in row-major order, before anything
// is written.
void moe_router_bwd_cpu(at::ScalarType dtype, const MoeRouterOperands& a);

}  // namespace rl_align
