// Host entry points of the logprob GPU kernels. Torch-free: the operand descriptor and the
// arithmetic are in common/logprob.h (shared with the CPU kernels); the torch binding is
// logprob_launcher.cpp.
#pragma once

#include "../common/logprob.h"
#include "../common/portability.h"

namespace rl_align {

// logprob, entropy and lse of every row. A target neither ignore_index nor in [0, vocab) stops
// the kernel with a device-side assert naming `op` and the target.
gpuError_t logprob_fwd_simt(DType dtype, const LogprobOperands& a, gpuStream_t stream);

// grad_logits of every row, rounded once to dtype (the same target check).
gpuError_t logprob_bwd_simt(DType dtype, const LogprobOperands& a, gpuStream_t stream);

}  // namespace rl_align
