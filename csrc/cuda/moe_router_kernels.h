// Host entry points of the moe_router GPU kernels. Torch-free: the operand descriptor and the
// arithmetic are in common/moe_router.h (shared with the CPU kernels); the torch binding is
// moe_router_launcher.cpp.
//
// An expert id outside [0, experts) given to the backward never causes an out-of-bounds access:
// the kernel prints "rl_align::moe_router_backward: expert X out of range for E experts" and fails
// a device-side assert (the stream's next synchronisation raises).
#pragma once

#include "../common/moe_router.h"
#include "../common/portability.h"

namespace rl_align {

// weights and experts_out from the logits (a.experts <= kMoeRouterMaxExperts,
// 1 <= a.top_k <= min(a.experts, kMoeRouterMaxTopK): the caller has checked).
gpuError_t moe_router_fwd_simt(DType dtype, const MoeRouterOperands& a, gpuStream_t stream);

// grad_logits (the logits' dtype) from grad_weights, the logits and experts_in.
gpuError_t moe_router_bwd_simt(DType dtype, const MoeRouterOperands& a, gpuStream_t stream);

}  // namespace rl_align
