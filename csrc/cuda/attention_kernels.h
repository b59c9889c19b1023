// Host entry points of the attention GPU kernels. Torch-free: the problem is an
// AttentionProblem / AttentionGradProblem (csrc/common/attention_problem.h); the torch binding is
// attention_launcher.cpp.
#pragma once

#include <cstdint>

#include "../common/attention_problem.h"
#include "../common/portability.h"

namespace rl_align {

// Kernel families. Which one runs is chosen from (dtype, head_dim, device arch) only, never from
// the batch: each family fixes its own dot-product order, so one family serves every batch,
// decode and prefill alike.
enum class AttentionPath : int {
  kSm80 = 0,  // mma.sync m16n8k16 + ldmatrix + cp.async (CUDA >= sm_80), bf16/fp16, head_dim 64/128
  kSimt = 1,  // FMA kernels: fp32 everywhere (no TF32), other head dims, every dtype on HIP
};

// The simt path's largest head_dim (the sm80 path takes 64 and 128 only).
constexpr int64_t kAttentionSimtMaxHeadDim = 256;

// Whether `path` was compiled into this build and runs `dtype` x `head_dim` on `device`.
bool attention_path_available(AttentionPath path, DType dtype, int64_t head_dim, int device);

// Forward: writes out and lse for every query of every sequence (rows of sequences with
// q_len = 0 are not touched).
gpuError_t attention_fwd_sm80(DType dtype, const AttentionProblem& p, gpuStream_t stream);
gpuError_t attention_fwd_simt(DType dtype, const AttentionProblem& p, gpuStream_t stream);

// Backward (q_len == kv_len for every sequence): writes delta, then dq, dk, dv for every token of
// every sequence.
gpuError_t attention_bwd_sm80(DType dtype, const AttentionGradProblem& p, gpuStream_t stream);
gpuError_t attention_bwd_simt(DType dtype, const AttentionGradProblem& p, gpuStream_t stream);

// attention_kvcache without host validation: a device-side assert (device_assert.cuh) unless
// every lens[b] (int64, [batch]) lies in [new_tokens, capacity]. No host synchronisation.
gpuError_t attention_check_cache_seqlens(const int64_t* lens, int64_t batch, int64_t new_tokens,
                                         int64_t capacity, gpuStream_t stream);

}  // namespace rl_align
