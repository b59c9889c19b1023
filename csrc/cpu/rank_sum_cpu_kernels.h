// CPU kernel of rank_sum (common/rank_sum.h: the operands and the tree, which the GPU kernel folds
// with the same RankSumTree).
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/rank_sum.h"

namespace rl_align {

// out = the tree over a.part[0 .. a.parts-1] per element, rounded once to dtype (at::kFloat,
// at::kHalf, at::kBFloat16; the caller has checked).
void rank_sum_cpu(at::ScalarType dtype, const RankSumOperands& a);

}  // namespace rl_align
