// The fp32 register micro-kernel every CPU GEMM-like loop goes through (linear_cpu_kernels.cpp,
// attention_cpu_kernels.cpp): the one place a CPU kernel takes a dot-product chain.
#pragma once

#include <cstdint>

namespace rl_align {

// Micro-tile held in registers: kMicroRows x kMicroCols fp32 accumulators (8 SSE registers on
// the x86-64 baseline, with room left for the B row and the broadcast A values).
constexpr int64_t kMicroRows = 4;
constexpr int64_t kMicroCols = 8;

// acc[r][c] = acc[r][c] + a[kk][r] * b[kk][c] for kk = 0, 1, ..., depth-1 in order. a and b are
// micro-panels ([depth][kMicroRows], [depth][kMicroCols]) read as two contiguous streams. The r
// and c loops are unrolled completely so that the accumulators stay in registers and the c loop
// becomes SIMD over columns (each lane one element's own chain); the kk loop is kept rolled, since
// unrolling it lets GCC's SLP vectoriser shuffle accumulators across iterations and spill them.
inline void micro_kernel(int64_t depth, const float* __restrict__ a, const float* __restrict__ b,
                         float* __restrict__ acc, int64_t ld_acc) {
  float t[kMicroRows][kMicroCols];
  for (int64_t r = 0; r < kMicroRows; ++r) {
    for (int64_t c = 0; c < kMicroCols; ++c) t[r][c] = acc[r * ld_acc + c];
  }
#pragma GCC unroll 1
  for (int64_t kk = 0; kk < depth; ++kk) {
    const float* bk = b + kk * kMicroCols;
    const float* ak = a + kk * kMicroRows;
#pragma GCC unroll 16
    for (int64_t r = 0; r < kMicroRows; ++r) {
      const float av = ak[r];
#pragma GCC unroll 16
      for (int64_t c = 0; c < kMicroCols; ++c) t[r][c] = t[r][c] + av * bk[c];
    }
  }
  for (int64_t r = 0; r < kMicroRows; ++r) {
    for (int64_t c = 0; c < kMicroCols; ++c) acc[r * ld_acc + c] = t[r][c];
  }
}

}  // namespace rl_align
