// CPU kernels of moe_combine, forward and backward (common/moe_combine.h: the operands and the
// arithmetic, the same functions the GPU kernels call, in the same order).
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/moe_combine.h"

namespace rl_align {

// The first index (row-major) of a position outside [0, rows) among n, or -1.
int64_t moe_combine_first_bad_position_cpu(const int64_t* positions, int64_t n, int64_t rows);

// owner[p] = the last i (row-major) with positions[i] == p, -1 for rows no position names. The
// positions have been range-checked.
void moe_combine_owners_cpu(const int64_t* positions, int64_t n, int64_t* owner, int64_t rows);

// out = the weighted sum of each token's rows (dtype: expert_out's).
void moe_combine_fwd_cpu(at::ScalarType dtype, const MoeCombineOperands& a);

// grad_expert_out from grad_out, the weights and the owners.
void moe_combine_bwd_rows_cpu(at::ScalarType dtype, const MoeCombineOperands& a);

// grad_weights (fp32) = the fixed-order dot products of grad_out rows and the named expert_out rows.
void moe_combine_bwd_weights_cpu(at::ScalarType dtype, const MoeCombineOperands& a);

}  // namespace rl_align
