// Host entry points of the attention GPU kernels. Torch-free: the problem is an
// AttentionProblem / AttentionGradProblem (csrc/common/attention_problem.h); the torch binding is
// attention_launcher.cpp, which alone chooses the path (kernels: attention/).
#pragma once

#include <cstdint>
#include <string>

#include "../common/attention_problem.h"
#include "../common/portability.h"

namespace rl_align {

// Kernel families. Which one runs is chosen from (dtype, head_dim, device arch) only, never from
// the batch: each family fixes its own dot-product order, so one family serves every batch,
// decode and prefill alike.
// The sm90 path gives the sm80 path's bits: the same recurrence steps (attention/recurrence.cuh)
// on accumulators that wgmma rounds as mma.sync does (the tests compare the two bit for bit).
enum class AttentionPath : int {
  kSm90 = 0,  // wgmma + TMA (sm_90a build, compute capability 9.0), bf16/fp16, head_dim 64/128
  kSm80 = 1,  // mma.sync m16n8k16 + ldmatrix + cp.async (CUDA >= sm_80), bf16/fp16, head_dim 64/128
  kSimt = 2,  // FMA kernels: fp32 everywhere (no TF32), other head dims, every dtype on HIP
};

// The simt path's largest head_dim (the sm80 path takes 64 and 128 only).
constexpr int64_t kAttentionSimtMaxHeadDim = 256;

// Whether `path` was compiled into this build and runs `dtype` x `head_dim` on `device`.
bool attention_path_available(AttentionPath path, DType dtype, int64_t head_dim, int device);

// Why the sm90 kernels cannot address `p`'s operands through tensor maps (attention/sm90_common.h,
// operand_map_problem), naming the operand and the stride that prevents it; empty where they can.
// K and V for the forward; Q and dO too for the backward. The launcher decides on it: such a
// problem runs the sm80 path (same bits) in auto mode, and forcing sm90 on it is an error.
std::string attention_sm90_layout_problem(const AttentionProblem& p, bool backward);

// Whether this build holds the sm90 kernels (an sm_90a cubin) for `device` (compute capability 9.0)
// and the driver can encode tensor maps.
bool attention_sm90_compiled_for(int device);

// fp32 partial states of the KV splits (attention_problem.h) for the tensor-core forwards (sm80, sm90): `slots`
// states per row (row = one lse element, LSE index order), acc [rows][slots][head_dim] and
// ml [rows][slots][2] (running max in the log2 domain, sum). slots = 1: a prefill CTA keeps a
// row's merged state there while it runs the next split; slots = splits: a decode step runs each
// split on its own CTA and a combine kernel merges them. Which one runs changes no bit.
// masked_nonfinite: the problem's status word (0 before the launch), needed when max_q_len > 1
// (keys masked inside a sequence exist): the fast kernels set it on a non-finite result, and the
// launch then recomputes with the exact kernel (attention/sm80_fwd.cu, attention/sm90_fwd.cu).
// tile_counter (the sm90 forward): 0 before a launch, and again after it; the prefill kernel's
// CTAs claim their tiles from it (scheduling only).
struct AttentionFwdWorkspace {
  float* acc = nullptr;
  float* ml = nullptr;
  int64_t slots = 0;
  int64_t* masked_nonfinite = nullptr;
  unsigned long long* tile_counter = nullptr;
};

// The slots per row the tensor-core forwards need for `p` (0: no workspace, every row's keys
// lie in one split). Chosen from shapes only.
int64_t attention_fwd_split_slots(const AttentionProblem& p);

// Forward: writes out and lse for every query of every sequence (rows of sequences with
// q_len = 0 are not touched). `w`: attention_fwd_split_slots(p) slots per row. The sm90 entry
// points take only problems attention_sm90_layout_problem accepts (cudaErrorInvalidValue
// otherwise): they never run another path's kernels.
gpuError_t attention_fwd_sm90(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                              gpuStream_t stream);
gpuError_t attention_fwd_sm80(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                              gpuStream_t stream);
gpuError_t attention_fwd_simt(DType dtype, const AttentionProblem& p, gpuStream_t stream);

// The sm90 backward's ordered dQ (attention/sm90_bwd.cu): dq_accum, fp32 [rows][head_dim], the
// running dQ sums of query blocks between key tiles (row = one lse element, LSE index order; no
// initial value needed); turns, int32 [1 + rows], zeros before the launch: a CTA ticket counter,
// then a turn counter per row (a query block's first row holds its block's). Null: the dQ kernel
// recomputes instead (the same bits).
struct AttentionBwdWorkspace {
  float* dq_accum = nullptr;
  int32_t* turns = nullptr;
  int64_t rows = 0;
};
// The longest sequence (keys) whose backward takes the ordered dQ by default. A key tile waits for
// its predecessor's turn on every query block, so the tiles of a sequence advance at tile 0's pace,
// and the ordered form loses where a sequence has many tiles. On the H100 (fwd+bwd, 32/8 heads,
// d128, causal; the recompute's time / the ordered form's): 1.26 at 16 x 512, 1.09 at 8 x 1024,
// 0.98 at 4 x 2048, 0.90 at 2 x 4096, 0.93 at 1 x 16384 (docs/perf/gpu_issue36.txt, runs 22-23).
// Since the recompute overlaps its products (runs 39-41), on the H200 (run 43): 1.08 at 16 x 512,
// 0.99 at 10 x 768, 0.94 at 8 x 1024.
constexpr int64_t kOrderedDqMaxKvLen = 512;

// Backward (q_len == kv_len for every sequence): writes delta, then dq, dk, dv for every token of
// every sequence.
gpuError_t attention_bwd_sm90(DType dtype, const AttentionGradProblem& p, const AttentionBwdWorkspace& w,
                              gpuStream_t stream);
gpuError_t attention_bwd_sm80(DType dtype, const AttentionGradProblem& p, gpuStream_t stream);
gpuError_t attention_bwd_simt(DType dtype, const AttentionGradProblem& p, gpuStream_t stream);

// attention_kvcache / attention_varlen without host validation: the sequence descriptors
// (attention_problem.h) built on the device from `lengths` and the KV cache's optional
// `cache_starts` (null: 0; both int32 or both int64; what they hold: sp), then the zero status
// words (seqs: num_seqs * kAttentionSeqFields + kAttentionSeqStatusWords int64), and a device-side assert
// (device_assert.cuh) for values outside sp's bounds. One kernel, no host synchronisation.
gpuError_t attention_seqs_from_lengths(const void* lengths, const void* cache_starts, bool lengths_int64,
                                       const SeqsFromLengths& sp, int64_t* seqs, gpuStream_t stream);

}  // namespace rl_align
