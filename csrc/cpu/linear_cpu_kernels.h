// CPU kernels of the linear ops: the GemmProblem GEMM and the bias-gradient column sums.
// Torch types only at the interface; the arithmetic each promises is spelled out below.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/gemm_problem.h"

namespace rl_align {

// C = (c_accum or 0) + A @ B (+ bias), per GemmProblem, with an MMA depth of 1: each C[i, j] is
// one fp32 accumulator that takes acc = acc + A[i, kk] * B[kk, j] (fp32 multiply, then fp32 add)
// for kk = 0, 1, ..., k-1 in order, then adds bias[j] and rounds once (to nearest even).
// dtype is the dtype of A, B, bias and of C unless p.c_fp32. Supported: at::kFloat, at::kHalf,
// at::kBFloat16 (caller has checked).
void linear_gemm_cpu(at::ScalarType dtype, const GemmProblem& p);

// dbias[j] = (accum ? accum[j] : 0) + sum_i dy[i*ld + j] for i < m, j < n: rows taken in tiles of
// kLinearGradTileTokens (64); inside a tile rows summed sequentially in fp32 in row order into a
// per-tile partial; the partials added to the running fp32 total in tile order. accum may alias
// dbias.
void linear_bias_bwd_cpu(at::ScalarType dtype, const void* dy, int64_t ld, int64_t m, int64_t n,
                          const float* accum, float* dbias);

}  // namespace rl_align
