// logprob: the arithmetic every path computes (the CPU and GPU kernels call these functions), the
// operand descriptor of the kernel entry points, and linear_logprob's chunk rule. Torch-free and
// GPU-runtime-free.
//
// A row of V logits x, with t = 1 / temperature (fp32, rounded once on the host):
//   z_v = x_v * t                       fp32
//   (m, s, u): m = max z, s = sum exp(z_v - m), u = sum exp(z_v - m) * (z_v - m)
//   lse = m + log(s); logprob = (z_target - m) - log(s); entropy = log(s) - u / s
// (u is taken relative to the running max, so the entropy does not cancel when the logits are
// large). The sum over V is taken in a fixed order that depends only on V and the kernel's fixed
// partition: each worker (a GPU thread, the CPU's one loop) folds its elements into a
// LogprobState group by group in index order with logprob_push (a group summed on its own, then
// merged), and the states are merged with logprob_merge in a fixed tree. Every step below is one
// explicit IEEE fp32 operation (mul_rn, add_rn, fmaf), so no compiler contracts two of them
// differently on two paths; exp is logprob_exp (below) and log the full-accuracy logf (CPU and GPU
// may differ in their last bits; each is bitwise identical to itself whatever the batch).
//
// Non-finite logits: z = -inf (a masked token) contributes nothing (p = 0, and its p * z term is
// taken as 0, its limit); a row of only -inf gives s = 0, hence lse = -inf and logprob NaN (as
// torch's log_softmax); z = +inf or NaN makes the row's results NaN. A row never reads another.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace rl_align {

// linear_logprob runs its tokens in chunks of linear_logprob_chunk_tokens(V) rows: the logits of a
// chunk ([chunk, V] in the input dtype, and its gradient in backward) stay under about
// kLinearLogprobChunkElements elements, and a chunk is a multiple of the linear weight-gradient
// tile (kLinearGradTileTokens), so the chained weight gradient is the unfused one bit for bit.
constexpr int64_t kLinearLogprobChunkElements = int64_t{1} << 27;

inline int64_t linear_logprob_chunk_tokens(int64_t vocab, int64_t grad_tile_tokens) {
  const int64_t rows = kLinearLogprobChunkElements / (vocab > 0 ? vocab : 1);
  const int64_t tiles = rows / grad_tile_tokens;
  return (tiles > 0 ? tiles : 1) * grad_tile_tokens;
}

// linear_logprob's fused-gradient mode (linear_logprob_fused_grad) takes chunks of
// kLinearLogprobFusedChunkFactor times that many tokens: each chunk reads and writes the fp32
// [V, H] weight-gradient sum once, so fewer chunks move less (H100, V = 151936, T = 4096: the
// default chunk ran at 0.95x the naive path's speed, 4x the chunk at 1.06x). Any multiple of
// kLinearGradTileTokens gives the same bits.
constexpr int64_t kLinearLogprobFusedChunkFactor = 4;

// linear_logprob's backward runs the vocabulary in slices of linear_logprob_slice_columns(T)
// columns for all T tokens at once: a slice's logits and their gradient ([T, columns]) stay under
// about kLinearLogprobChunkElements elements, and a slice is a multiple of
// kLinearLogprobSliceColumns, a chunk boundary of every GEMM path's reduction (16 on the tensor
// cores, 64 the sm90 k-block), so d hidden's sum over the vocabulary continues through the slices
// in the unfused order.
constexpr int64_t kLinearLogprobSliceColumns = 64;

inline int64_t linear_logprob_slice_columns(int64_t tokens) {
  const int64_t columns = kLinearLogprobChunkElements / (tokens > 0 ? tokens : 1);
  const int64_t units = columns / kLinearLogprobSliceColumns;
  return (units > 0 ? units : 1) * kLinearLogprobSliceColumns;
}

// The kernels' operands. logits rows are `logits_stride` elements apart (dense last dim);
// targets are int32 or int64, one per row; the per-row outputs are dense fp32.
struct LogprobOperands {
  int64_t rows = 0, vocab = 0;
  const void* logits = nullptr;
  int64_t logits_stride = 0;
  const void* targets = nullptr;
  bool targets_int64 = true;
  int64_t ignore_index = -100;
  float inv_temperature = 1.f;
  // forward outputs (fp32 [rows])
  float* logprob = nullptr;
  float* entropy = nullptr;
  float* lse = nullptr;
  // backward inputs (fp32 [rows]): the forward's entropy and lse, the incoming gradients
  // (grad_entropy may be null: no entropy term)
  const float* saved_entropy = nullptr;
  const float* saved_lse = nullptr;
  const float* grad_logprob = nullptr;
  const float* grad_entropy = nullptr;
  void* grad_logits = nullptr;  // logits dtype, dense rows of `vocab`
  // The backward may see a slice of the vocabulary (linear_logprob): the logits are the columns
  // [column_offset, column_offset + vocab) of rows of target_vocab columns, where the targets lie.
  int64_t column_offset = 0;
  int64_t target_vocab = 0;
};

// Row r's target, read as int64.
RL_ALIGN_HOST_DEVICE int64_t logprob_target(const LogprobOperands& a, int64_t r) {
  return a.targets_int64 ? static_cast<const int64_t*>(a.targets)[r]
                         : static_cast<int64_t>(static_cast<const int32_t*>(a.targets)[r]);
}

// exp(d) for the d = z - m <= 0 of the fold and the d = z - lse of the gradient, as 2^(d log2 e):
// one rounded multiply, then the hardware's exp2 on the GPU (CUDA ex2.approx.ftz: relative error
// about 2^-22, results below 2^-126 flushed to 0) and exp2f on the CPU and on HIP. The multiply's
// rounding moves the result by a relative |d| * 2^-24 at most, so the error of a term grows with
// |d| while its weight exp(d) in every sum (s, u, p) shrinks; against float64 the sums stay within
// about 1e-6 relative (tests/test_logprob.py, Axis-B). The full-accuracy expf spends ~8
// instructions per element where this spends 2, and the forward reads 2 bytes per element:
// expf made it instruction-bound (0.60 of the read limit on the H100).
constexpr float kLog2e = 1.4426950408889634f;

RL_ALIGN_HOST_DEVICE float logprob_exp(float d) {
  const float x = mul_rn(d, kLog2e);
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

struct LogprobState {
  float m, s, u;
};

RL_ALIGN_HOST_DEVICE LogprobState logprob_empty_state() { return {-INFINITY, 0.f, 0.f}; }

// The state re-expressed relative to a max m_new >= st.m (an empty state stays empty).
RL_ALIGN_HOST_DEVICE LogprobState logprob_rebase(LogprobState st, float m_new) {
  if (st.m == -INFINITY || st.m == m_new) return {m_new, st.s, st.u};
  const float d = add_rn(st.m, -m_new);
  const float scale = logprob_exp(d);
  // u' = (u + s * d) * scale: the old terms' (z - m) grow by d.
  return {m_new, mul_rn(st.s, scale), mul_rn(fmaf(st.s, d, st.u), scale)};
}

// Merges two states (bitwise symmetric in a and b: each side is rebased, then one addition).
RL_ALIGN_HOST_DEVICE LogprobState logprob_merge(LogprobState a, LogprobState b) {
  const float m = fmaxf(a.m, b.m);
  a = logprob_rebase(a, m);
  b = logprob_rebase(b, m);
  return {m, add_rn(a.s, b.s), add_rn(a.u, b.u)};
}

// Folds a group of n elements (already scaled by 1 / temperature) into the state: the group is
// summed on its own, from zero relative to its own max, in index order, then merged. A running sum
// thus takes one addition per group, not per element: added one at a time, a long run of terms
// near the running sum's last bit would each be rounded the same way (an fp32 error of up to
// ~1e-4 on a row of 151936 logits, seen on the CPU), where a group partial is 16-32 terms.
RL_ALIGN_HOST_DEVICE LogprobState logprob_push(LogprobState st, const float* z, int n) {
  LogprobState group = logprob_empty_state();
  for (int j = 0; j < n; ++j) group.m = fmaxf(group.m, z[j]);
  for (int j = 0; j < n; ++j) {
    if (z[j] == -INFINITY) continue;  // p = 0, and p * (z - m) -> 0
    const float d = add_rn(z[j], -group.m);
    const float e = logprob_exp(d);
    group.s = add_rn(group.s, e);
    group.u = fmaf(e, d, group.u);
  }
  return logprob_merge(st, group);
}

struct LogprobRow {
  float lse, logprob, entropy;
};

// The row's results from its merged state and its target's scaled logit.
RL_ALIGN_HOST_DEVICE LogprobRow logprob_finish(LogprobState st, float z_target) {
  const float log_s = logf(st.s);
  return {add_rn(st.m, log_s), add_rn(add_rn(z_target, -st.m), -log_s),
          add_rn(log_s, -div_rn(st.u, st.s))};
}

// d logit of one element (before the rounding to the logits dtype): x the logit, onehot 1 at the
// target, g / gh the incoming gradients of logprob / entropy, ez = E_p[z] = lse - entropy.
// d z = g * (onehot - p) + gh * p * (ez - z); d x = d z * inv_t. The entropy term is skipped
// without gh and where p == 0 (its limit; z = -inf would give 0 * inf).
RL_ALIGN_HOST_DEVICE float logprob_grad(float x, bool onehot, float inv_t, float lse, float g,
                                        bool has_gh, float gh, float ez) {
  const float z = mul_rn(x, inv_t);
  const float p = logprob_exp(add_rn(z, -lse));
  float dz = mul_rn(g, add_rn(onehot ? 1.f : 0.f, -p));
  if (has_gh && p != 0.f) dz = fmaf(mul_rn(gh, p), add_rn(ez, -z), dz);
  return mul_rn(dz, inv_t);
}

}  // namespace rl_align
