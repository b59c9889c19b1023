// The online-softmax block recurrence and the KV-split merge of the tensor-core attention
// forwards (attention_problem.h states the contract; sm80_fwd.cu's header the formulas), for
// score fragments in the m16n8 accumulator layout of mma.sync m16n8k16: per m16 row tile, n8 key
// tile nt, register 2 hh + e holds row g + 8 hh, key 8 nt + 2 t + e (g = lane / 4, t = lane % 4).
// One copy of every rounding step, so that every kernel that takes its blocks through these
// functions gives the same bits for a row.
#pragma once

#include "../../common/attention_problem.h"
#include "../../common/portability.h"
#include "../../primitives/mma_sm80.h"

#ifdef RL_ALIGN_SM80_DEVICE
namespace rl_align {

// 1 / l for l >= 1 (the row sum holds p = 1 for the row's max): hardware approximation plus one
// Newton step, within an ulp of the correctly rounded value. Written out (rather than IEEE
// division) so that the epilogue has no slow-path call, which would spill the accumulators.
__device__ __forceinline__ float reciprocal(float l) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(l));
  return __fmaf_rn(r, __fmaf_rn(-l, r, 1.f), r);
}

// max(a, b) for a scale >= 0, min(a, b) for a negative one.
template <bool SCALE_NONNEG>
__device__ __forceinline__ float extreme(float a, float b) {
  return SCALE_NONNEG ? fmaxf(a, b) : fminf(a, b);
}

// The KV-split merge of attention_problem.h in the log2 domain of the block recurrence: state
// (m, l) absorbs a later split's partial (m_c, l_c); the caller then takes each acc element as
// merge_elem(A, acc_c). One function for the prefill CTA that merges as it goes and the combine
// kernel that merges decode partials, so both give the same bits.
struct SplitMergeWeights {
  float a, b;  // weights of the state so far and of the new partial
};
__device__ __forceinline__ SplitMergeWeights merge_split(float& m, float& l, float m_c, float l_c) {
  const float m_new = fmaxf(m, m_c);
  const SplitMergeWeights w{m == m_new ? 1.f : ex2(__fsub_rn(m, m_new)),
                            m_c == m_new ? 1.f : ex2(__fsub_rn(m_c, m_new))};
  m = m_new;
  l = __fadd_rn(__fmul_rn(l, w.a), __fmul_rn(l_c, w.b));
  return w;
}
__device__ __forceinline__ float merge_elem(float acc, float acc_c, SplitMergeWeights w) {
  return __fadd_rn(__fmul_rn(acc, w.a), __fmul_rn(acc_c, w.b));
}
// lse = m ln 2 + log(l) (m in the log2 domain).
__device__ __forceinline__ float final_lse(float m, float l) {
  return __fadd_rn(__fmul_rn(m, 0.69314718055994530942f), logf(l));
}

// bf16/fp16 pair (one 32-bit register) with element `lo_keep` / `hi_keep` kept, the other +0.
__device__ __forceinline__ uint32_t keep_halves(uint32_t x, bool lo_keep, bool hi_keep) {
  return (lo_keep ? x & 0xffffu : 0u) | (hi_keep ? x & 0xffff0000u : 0u);
}

// op over row hh's KEY_TILES x 2 values of `tile` (one m16 tile's n8 key tiles): the lane's pairs
// (e = 0, 1) first, then halving over the key tiles (x[i] with x[i + w], w = KEY_TILES / 2, .., 1),
// then the row's quad of lanes (butterfly 1, 2): a fixed tree, and with op commutative the 4 lanes
// end with the same bits.
template <int KEY_TILES, typename Op>
__device__ __forceinline__ float row_reduce(const float (&tile)[KEY_TILES][4], int hh, Op op) {
  float x[KEY_TILES];
#pragma unroll
  for (int nt = 0; nt < KEY_TILES; ++nt) x[nt] = op(tile[nt][2 * hh], tile[nt][2 * hh + 1]);
#pragma unroll
  for (int w = KEY_TILES / 2; w > 0; w /= 2) {
#pragma unroll
    for (int i = 0; i < w; ++i) x[i] = op(x[i], x[i + w]);
  }
  float r = op(x[0], shfl_xor(x[0], 1, 4));
  return op(r, shfl_xor(r, 2, 4));
}

// One key block of the recurrence (attention_problem.h; the steps are in this file's header) for
// MT m16 row tiles whose scores of the block's KEY_TILES n8 key tiles are this thread's C
// fragments: keys past row_last_key (per row (mt, hh); `lane_key0` = the block's first key + 2t)
// selected out when need_mask, m and l updated, scores turned into p, and each row's alpha
// returned. Returns whether some alpha != 1. Every forward kernel runs its blocks through this
// one function, so they give the same bits.
template <bool SCALE_NONNEG, int MT, int KEY_TILES>
__device__ __forceinline__ bool softmax_block(float (&score)[MT][KEY_TILES][4], float (&row_max)[MT][2],
                                              float (&row_sum)[MT][2], float (&row_alpha)[MT][2],
                                              const int (&row_last_key)[MT][2], int lane_key0, bool need_mask,
                                              float scale_log2) {
  // Sets the scores of keys a row may not see to `masked` (masked blocks only): allowed keys of
  // row (mt, hh) are lane_key0 + 8 nt + e <= last key (one register per row against immediates).
  auto mask_scores = [&](float masked) {
    if (!need_mask) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int limit = row_last_key[mt][hh] - lane_key0;
#pragma unroll
        for (int nt = 0; nt < KEY_TILES; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (nt * kMmaN + e > limit) score[mt][nt][2 * hh + e] = masked;
          }
        }
      }
    }
  };
  // Masked keys hold the identity of the extreme below.
  mask_scores(SCALE_NONNEG ? -INFINITY : INFINITY);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      // Extreme score of the allowed keys (max for scale >= 0, min for scale < 0). max and min
      // are exact, so any order gives the same bits.
      const float ext = row_reduce(score[mt], hh, [](float a, float b) { return extreme<SCALE_NONNEG>(a, b); });
      // max_j (s_j scale_log2) = scale_log2 * ext (rounding is monotonic). A block with no
      // allowed key has ext = -+inf, and scale_log2 = 0 would give NaN: fmaxf drops it.
      const float old_max = row_max[mt][hh];
      const float new_max = fmaxf(old_max, __fmul_rn(ext, scale_log2));
      row_alpha[mt][hh] = old_max == new_max ? 1.f : ex2(__fsub_rn(old_max, new_max));
      row_max[mt][hh] = new_max;
      // p_j = 2^(s_j scale_log2 - m'): one fma per key.
#pragma unroll
      for (int nt = 0; nt < KEY_TILES; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          score[mt][nt][2 * hh + e] = ex2(__fmaf_rn(score[mt][nt][2 * hh + e], scale_log2, -new_max));
        }
      }
    }
  }
  // Masked keys: p_j = 0, selected (for scale_log2 != 0 the fma already gave -inf and ex2(-inf)
  // = +0; for scale_log2 = 0 it gave NaN).
  mask_scores(0.f);
  // Block sums (row_reduce's fixed tree); l = l alpha + sum.
  bool rescale = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float block_sum = row_reduce(score[mt], hh, [](float a, float b) { return __fadd_rn(a, b); });
      row_sum[mt][hh] = __fmaf_rn(row_sum[mt][hh], row_alpha[mt][hh], block_sum);
      rescale = rescale || row_alpha[mt][hh] != 1.f;
    }
  }
  return rescale;
}

}  // namespace rl_align
#endif  // RL_ALIGN_SM80_DEVICE
