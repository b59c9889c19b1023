// What the tensor-core attention paths (sm80: sm80_fwd.cu, sm80_bwd.cu; sm90: sm90_fwd.cu,
// sm90_bwd.cu) share on the host: the problem check, the KV split count, scale * log2(e), and the
// path-neutral kernels both launch (split_combine.cu, bwd_delta.cu). Torch-free.
#pragma once

#include <cstdint>

#include "../../common/attention_problem.h"
#include "../../common/portability.h"
#include "../../primitives/mma_sm80.h"
#include "../attention_kernels.h"

#if !RL_ALIGN_HIP
namespace rl_align {

// Positions and rows (query x head in group) are int in the kernels, with room for a tile.
constexpr int64_t kTensorCoreAttentionMaxLen = INT32_MAX - 1024;
constexpr int64_t kTensorCoreAttentionMaxRows = INT32_MAX - 1024;

// The problem's part the kernels read: bf16/fp16, head_dim 64 or 128; q, k, v, out non-null and
// 16-byte aligned, every token/head stride (and, from the launcher, each sequence's q_base,
// kv_base) a multiple of 8 elements, as attention_operand in the launcher guarantees; lengths up
// to kTensorCoreAttentionMaxLen, max_q_len * G up to kTensorCoreAttentionMaxRows; `grid_heads`
// (the head count the caller puts on a 65535-wide grid dimension) at most 65535. Returns
// cudaErrorNotSupported (dtype, head_dim), cudaErrorInvalidValue (anything else), or cudaSuccess,
// also for a problem without query rows, which the caller then skips.
inline gpuError_t tensor_core_attention_problem_error(DType dtype, const AttentionProblem& p, int64_t grid_heads) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorNotSupported;
  if (p.num_seqs < 0 || p.max_q_len < 0 || p.max_kv_len < 0) return cudaErrorInvalidValue;
  if (p.num_seqs == 0 || p.max_q_len == 0) return cudaSuccess;
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return cudaErrorInvalidValue;
  if (grid_heads > 65535 || p.max_kv_len < p.max_q_len || p.max_kv_len > kTensorCoreAttentionMaxLen ||
      p.max_q_len * (p.heads_q / p.heads_kv) > kTensorCoreAttentionMaxRows) {
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

// The forward's workspace as attention_fwd_split_slots(p) sizes it: `w.slots` slots per row with
// their buffers, and the status word wherever keys are masked inside a sequence.
inline bool tensor_core_workspace_ok(const AttentionProblem& p, const AttentionFwdWorkspace& w) {
  return w.slots == attention_fwd_split_slots(p) && (w.slots == 0 || (w.acc != nullptr && w.ml != nullptr)) &&
         (p.max_q_len <= 1 || w.masked_nonfinite != nullptr);
}

// KV splits of the longest sequence (attention_problem.h).
inline int64_t attention_split_count(const AttentionProblem& p) { return ceil_div(p.max_kv_len, kAttentionKvSplit); }

// Rows (max_q_len * G) up to which a forward runs each KV split on CTAs of its own (few rows: a
// decode step or a short chunk, whose splits keep the GPU busy that way); the sm80 decode kernel
// takes the same launches.
constexpr int64_t kAttentionPerSplitMaxRows = 32;

// scale * log2(e), rounded once: the kernels take exp(scale s - m) as 2^(s scale log2(e) - m log2(e)).
inline float scale_log2e(const AttentionProblem& p) {
  return static_cast<float>(static_cast<double>(p.scale) * 1.4426950408889634);
}

// Kernels whose arithmetic involves no mma, which both tensor-core paths launch: the merge of
// per-split partials in increasing split order (split_combine.cu; for w.slots > 1) and
// delta_i = dot(dO_i, O_i) (bwd_delta.cu). Problems as the paths' entry points take them.
gpuError_t attention_split_combine(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                                   gpuStream_t stream);
gpuError_t attention_bwd_delta(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream);

}  // namespace rl_align
#endif  // !RL_ALIGN_HIP
