// Host entry points of the rope GPU kernel. Torch-free: the problem descriptor (common/rope.h,
// raw pointers and strides), the portability layer's dtype enum and stream type. The torch
// binding is rope_launcher.cpp.
#pragma once

#include "../common/portability.h"
#include "../common/rope.h"

namespace rl_align {

// Rotates every token of p.operand[0] (q) and p.operand[1] (k) by its own position's angles
// (common/rope.h) and copies elements rotary_dim..head_dim-1 into the outputs.
gpuError_t rope_fwd_simt(DType dtype, const RopeProblem& p, gpuStream_t stream);

// The same with the transposed rotation (sin negated): the gradients of rope_fwd_simt.
gpuError_t rope_bwd_simt(DType dtype, const RopeProblem& p, gpuStream_t stream);

}  // namespace rl_align
