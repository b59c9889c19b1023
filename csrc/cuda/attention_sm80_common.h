// What the sm80 attention kernels (attention_sm80.cu forward, attention_sm80_bwd.cu backward) ask
// of a problem, checked in one place (host), and the tile copy they share (device). Torch-free.
#pragma once

#include <cstdint>

#include "../common/attention_problem.h"
#include "../common/portability.h"
#include "../primitives/mma_sm80.h"
#include "attention_kernels.h"

#if !RL_ALIGN_HIP
namespace rl_align {

// Positions and rows (query x head in group) are int in the kernels, with room for a tile.
constexpr int64_t kSm80AttentionMaxLen = INT32_MAX - 1024;
constexpr int64_t kSm80AttentionMaxRows = INT32_MAX - 1024;

// The problem's part the kernels read: bf16/fp16, head_dim 64 or 128; q, k, v, out non-null and
// 16-byte aligned, every token/head stride (and, from the launcher, each sequence's q_base,
// kv_base) a multiple of 8 elements, as attention_operand in the launcher guarantees; lengths up
// to kSm80AttentionMaxLen, max_q_len * G up to kSm80AttentionMaxRows; `grid_heads` (the head count
// the caller puts on a 65535-wide grid dimension) at most 65535. Returns cudaErrorNotSupported
// (dtype, head_dim), cudaErrorInvalidValue (anything else), or cudaSuccess, also for a problem
// without query rows, which the caller then skips.
inline gpuError_t sm80_attention_problem_error(DType dtype, const AttentionProblem& p, int64_t grid_heads) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorNotSupported;
  if (p.num_seqs < 0 || p.max_q_len < 0 || p.max_kv_len < 0) return cudaErrorInvalidValue;
  if (p.num_seqs == 0 || p.max_q_len == 0) return cudaSuccess;
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return cudaErrorInvalidValue;
  if (grid_heads > 65535 || p.max_kv_len < p.max_q_len || p.max_kv_len > kSm80AttentionMaxLen ||
      p.max_q_len * (p.heads_q / p.heads_kv) > kSm80AttentionMaxRows) {
    return cudaErrorInvalidValue;
  }
  if (p.seqs == nullptr || p.lse == nullptr) return cudaErrorInvalidValue;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.out)) return cudaErrorInvalidValue;
  if (p.q_stride_token % kChunkElems != 0 || p.q_stride_head % kChunkElems != 0 ||
      p.kv_stride_token % kChunkElems != 0 || p.kv_stride_head % kChunkElems != 0) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Kernels of this path whose arithmetic involves no mma, which the sm90 path launches as well:
// the merge of per-split partials (attention_sm80.cu) and delta_i = dot(dO_i, O_i)
// (attention_sm80_bwd.cu). Problems as attention_fwd_sm80 / attention_bwd_sm80 take them.
gpuError_t attention_split_combine_sm80(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                                        gpuStream_t stream);
gpuError_t attention_bwd_delta_sm80(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream);

// scale * log2(e), rounded once: the kernels take exp(scale s - m) as 2^(s scale log2(e) - m log2(e)).
inline float scale_log2e(const AttentionProblem& p) {
  return static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);
}

#ifdef RL_ALIGN_SM80_DEVICE
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
