// Host entry points of the silu_and_mul GPU kernels. Torch-free: the operand descriptor and the
// arithmetic are in common/silu_and_mul.h (shared with the CPU kernels); the torch binding is
// silu_and_mul_launcher.cpp. One entry point per direction serves both layouts (gate_up halves
// or separate gate / up tensors): they differ only in the operands' pointers and strides.
#pragma once

#include "../common/portability.h"
#include "../common/silu_and_mul.h"

namespace rl_align {

// out = silu(gate) * up, rounded once to dtype.
gpuError_t silu_and_mul_fwd_simt(DType dtype, const SiluMulOperands& a, gpuStream_t stream);

// out = d gate, dup = d up from grad_out, gate and up, each rounded once to dtype.
gpuError_t silu_and_mul_bwd_simt(DType dtype, const SiluMulOperands& a, gpuStream_t stream);

}  // namespace rl_align
