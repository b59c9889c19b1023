// The device pieces the tensor-core attention kernels share: the row-pair tile copy and the
// cp.async ring step (sm80_fwd.cu, sm80_bwd.cu), the epilogues' non-finite test (sm80 and sm90).
// The problem check both tensor-core paths share is tensor_core.h. Torch-free.
#pragma once

#include <cstdint>

#include "../../common/attention_problem.h"
#include "../../common/portability.h"
#include "../../primitives/mma_sm80.h"
#include "../attention_kernels.h"
#include "tensor_core.h"

#if !RL_ALIGN_HIP
namespace rl_align {

#ifdef RL_ALIGN_SM80_DEVICE
// Whether a or b is infinite or NaN. Both are tested (no short circuit): an epilogue's running
// flag then stays predicate arithmetic, where `||` chains compile into a branch per value.
__device__ __forceinline__ bool either_nonfinite(float a, float b) { return !(isfinite(a) & isfinite(b)); }

// Copies one 16-byte chunk of COPIES rows, ROWS_PER_COPY apart, from each of two tensors with one
// layout (K and V, or Q and dO) into two shared tiles `second_tile` bytes apart: source rows
// row, row + ROWS_PER_COPY, ... at element offset `offset` + r * row_stride, destination rows
// PITCH bytes apart from `dst`. Rows at or past `limit` are zero fill and read nothing (the
// source address is then the tensor's base, a valid one). Pointers advance by one step per copy
// rather than being COPIES separate offsets, which keeps the copy's registers few.
template <typename T, int COPIES, int ROWS_PER_COPY, int PITCH, int UNROLL = COPIES>
__device__ __forceinline__ void copy_row_pair_async(uint32_t dst, uint32_t second_tile, const T* a, const T* b,
                                                    int64_t offset, int64_t row_stride, int row, int limit) {
  const int64_t step = ROWS_PER_COPY * row_stride;
  const T* a_src = a + offset;
  const T* b_src = b + offset;
#pragma unroll UNROLL
  for (int c = 0; c < COPIES; ++c) {
    const bool in_range = row < limit;
    cp_async_16_zfill(dst, in_range ? a_src : a, in_range ? 16 : 0);
    cp_async_16_zfill(dst + second_tile, in_range ? b_src : b, in_range ? 16 : 0);
    dst += ROWS_PER_COPY * PITCH;
    row += ROWS_PER_COPY;
    a_src += step;
    b_src += step;
  }
}

// One step of a STAGES-deep cp.async ring over blocks first .. end - 1, block b in stage
// (b - first) % STAGES and in commit group b - first (the prologue commits STAGES - 1 groups,
// empty past the end). Block b is complete once at most STAGES - 2 groups are pending; the
// barrier publishes every thread's copies of it and tells that all warps finished block b - 1,
// whose stage the copy of block b + STAGES - 1 then overwrites (an empty group past the end, so
// the group count stays fixed).
template <int STAGES, typename Load>
__device__ __forceinline__ void ring_advance(int b, int first, int end, Load&& load) {
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  const int next = b + STAGES - 1;
  if (next < end) load((next - first) % STAGES, next);
  cp_async_commit();
}
#endif  // RL_ALIGN_SM80_DEVICE

}  // namespace rl_align
#endif  // !RL_ALIGN_HIP
