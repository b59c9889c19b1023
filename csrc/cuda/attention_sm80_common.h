// What the sm80 attention kernels (attention_sm80.cu forward, attention_sm80_bwd.cu backward) ask
// of a problem, checked in one place. Host code, torch-free.
#pragma once

#include <cstdint>

#include "../common/attention_problem.h"
#include "../common/portability.h"
#include "mma_sm80.h"

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

}  // namespace rl_align
#endif  // !RL_ALIGN_HIP
