// Host entry points of the moe_combine GPU kernels. Torch-free: the operand descriptor and the
// arithmetic are in common/moe_combine.h (shared with the CPU kernels); the torch binding is
// moe_combine_launcher.cpp.
//
// A position outside [0, rows) never causes an out-of-bounds access: the kernel that meets it
// prints "rl_align::<op>: position P out of range for R rows of expert_out" and fails a device-side
// assert (the stream's next synchronisation raises), as torch's embedding does.
#pragma once

#include <cstdint>

#include "../common/moe_combine.h"
#include "../common/portability.h"

namespace rl_align {

// out [tokens, hidden] = the weighted sum of each token's rows.
gpuError_t moe_combine_fwd_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream);

// owner[sorted[i]] = order[i] for the last i of each run of equal sorted positions (n entries),
// where (sorted, order) is a STABLE sort of the flat positions: each named row's owner is its last
// (t, r) in row-major order. owner [rows] must hold -1 beforehand. Range-checks every position.
gpuError_t moe_combine_owners_simt(const int64_t* sorted, const int64_t* order, int64_t n, int64_t* owner,
                                   int64_t rows, gpuStream_t stream);

// grad_expert_out from grad_out, the weights and the owners.
gpuError_t moe_combine_bwd_rows_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream);

// grad_weights (fp32) = the fixed-order dot products of grad_out rows and the named expert_out rows.
gpuError_t moe_combine_bwd_weights_simt(DType dtype, const MoeCombineOperands& a, gpuStream_t stream);

}  // namespace rl_align
