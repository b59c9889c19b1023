// moe_router: the arithmetic every path computes (the CPU and GPU kernels call these functions,
// rl_engine_ext/ops/moe_router.py mirrors them op for op in PyTorch), the operand descriptor of the
// kernel entry points and the family's limits. Torch-free and GPU-runtime-free.
//
// A token's E logits, x_j = float(logit_j) (exact), j = 0 .. E-1:
//
// Selection (exact, no arithmetic): experts[0 .. k-1] are the k first indices of the strict total
// order moe_router_before: larger x first; NaN before every number (torch.topk treats NaN as the
// largest); equal values (-0 == +0 included) and NaNs among themselves by lower index first.
//
// Softmax, each step one IEEE fp32 operation (mul_rn / add_rn / div_rn: never contracted into an
// FMA, on any path), so the CPU, the GPU and the PyTorch mirror give the same bits:
//   m   = max_j x_j                       (NaN ignored; any NaN makes the row NaN below anyway)
//   e_j = moe_exp(x_j - m)                (the exp below: the same function on every path)
//   S   = the sum of e_j over kMoeRouterLanes = 32 lanes: lane l adds e_l, e_{l+32}, e_{l+64}, ...
//         in index order onto 0; then the 32 lane sums in the fixed tree v[l] += v[l + h] for
//         h = 16, 8, 4, 2, 1 (a warp butterfly on the GPU, whose lanes all end with the same bits).
//         The order depends on E alone.
//   p_j = e_j / S
//   weights[r] = p[experts[r]]; normalize: S2 = ((p_0 + p_1) + p_2) + ... (rank order), then
//                weights[r] = p_r / S2.
// A NaN or +inf logit, or a row of only -inf, makes every weight of that token NaN (as torch's
// softmax); -inf logits (masked experts) have p = 0. Probabilities below about 2^-125 (exp of
// x - m < -86.6) are 0.
//
// Backward, from g_r = grad_weights[r] (fp32), recomputing p as above:
//   normalize: w_r = p_r / S2; dot = ((g_0 w_0 + g_1 w_1) + ...) (rank order, mul then add);
//              dq_r = (g_r - dot) / S2.      Otherwise dq_r = g_r.
//   c    = ((p_{e_0} dq_0 + p_{e_1} dq_1) + ...)  (rank order, mul then add)
//   dp_j = the dq_r with experts[r] == j (several: added in rank order onto the first); 0 if none
//   grad_logits_j = p_j * (dp_j - c), rounded once to the logits dtype.
// Every sum is per token, in an order fixed by E and k; no atomics.
//
// Difference from transformers' Qwen3MoeTopKRouter (softmax in fp32, topk over the probabilities,
// divide by their sum): we select over the logits. exp is monotone, so the choice is the same
// except where two different logits give probabilities that round to the same fp32 value (torch
// then breaks the tie by its own rule, we by the logits), and our probabilities come from moe_exp
// (within about 2 ulp of expf), so weights may differ from transformers' in the last bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace rl_align {

// Limits (rl_engine_ext/ops/moe_router.py: MOE_ROUTER_MAX_EXPERTS, MOE_ROUTER_MAX_TOP_K): a GPU
// lane holds at most 32 logits of its token in registers, and the chosen experts of a token fit
// one lane each.
constexpr int64_t kMoeRouterMaxExperts = 1024;
constexpr int64_t kMoeRouterMaxTopK = 32;
// The lanes of the fixed E-sum (not the warp size: HIP's 64-wide wavefronts run two tokens).
constexpr int kMoeRouterLanes = 32;

// The kernels' operands. logits rows are `logits_stride` elements apart (dense last dim); every
// other array is contiguous.
struct MoeRouterOperands {
  int64_t tokens = 0, experts = 0, top_k = 0;
  bool normalize = true;
  const void* logits = nullptr;
  int64_t logits_stride = 0;
  // forward outputs [tokens, top_k]
  float* weights = nullptr;
  int64_t* experts_out = nullptr;
  // backward inputs [tokens, top_k] and output [tokens, experts] (logits dtype)
  const float* grad_weights = nullptr;
  const int64_t* experts_in = nullptr;
  void* grad_logits = nullptr;
};

// Whether (a, ia) comes before (b, ib) in the selection order (a strict total order).
RL_ALIGN_HOST_DEVICE bool moe_router_before(float a, int64_t ia, float b, int64_t ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  if (a != b) return a > b;
  return ia < ib;
}

// exp(d) for d <= 0 (or NaN), Cephes' expf in plain fp32 operations: d = n ln2 + r with
// n = rint(d log2 e) and r = (d - n C1) - n C2 (C1 + C2 = ln 2, n C1 exact), exp(r) by a degree-7
// polynomial (Horner, mul then add), times 2^n. Within about 2 ulp of exp; 0 for n < -125 (a
// result below 2^-125: no subnormal is ever formed), NaN for NaN.
constexpr float kMoeLog2e = 1.44269504088896341f;
constexpr float kMoeLn2Hi = 0.693359375f;
constexpr float kMoeLn2Lo = -2.12194440e-4f;

RL_ALIGN_HOST_DEVICE float moe_exp(float d) {
  if (d != d) return d;
  const float n = rintf(mul_rn(d, kMoeLog2e));
  if (!(n >= -125.f)) return 0.f;
  const float r = add_rn(add_rn(d, -mul_rn(n, kMoeLn2Hi)), -mul_rn(n, kMoeLn2Lo));
  const float z = mul_rn(r, r);
  float p = 1.9875691500e-4f;
  p = add_rn(mul_rn(p, r), 1.3981999507e-3f);
  p = add_rn(mul_rn(p, r), 8.3334519073e-3f);
  p = add_rn(mul_rn(p, r), 4.1665795894e-2f);
  p = add_rn(mul_rn(p, r), 1.6666665459e-1f);
  p = add_rn(mul_rn(p, r), 5.0000001201e-1f);
  const float y = add_rn(add_rn(mul_rn(p, z), r), 1.f);
  return mul_rn(y, ldexpf(1.f, static_cast<int>(n)));  // 2^n exactly, n in [-125, 0]
}

// The fixed tree over kMoeRouterLanes lane sums (v is overwritten): v[l] += v[l + h], h = 16 .. 1.
RL_ALIGN_HOST_DEVICE float moe_router_lane_tree(float* v) {
  for (int h = kMoeRouterLanes / 2; h > 0; h /= 2) {
    for (int l = 0; l < h; ++l) v[l] = add_rn(v[l], v[l + h]);
  }
  return v[0];
}

// The backward's rank-order part for one token: from the probabilities p[r] of its chosen experts
// and g[r] = grad_weights[r], r < k, writes dq[r] (normalize: (g_r - dot) / S2; otherwise g_r) and
// returns c = ((p_0 dq_0 + p_1 dq_1) + ...), each step one fp32 operation in rank order, as above.
// Every lane of a GPU token group runs it whole (the same instructions, so the same bits).
RL_ALIGN_HOST_DEVICE float moe_router_backward_ranks(const float* p, const float* g, int64_t k, bool normalize,
                                                     float* dq) {
  if (normalize) {
    float s2 = p[0];
    for (int64_t r = 1; r < k; ++r) s2 = add_rn(s2, p[r]);
    float dot = 0.f;
    for (int64_t r = 0; r < k; ++r) {
      const float term = mul_rn(g[r], div_rn(p[r], s2));
      dot = r == 0 ? term : add_rn(dot, term);
    }
    for (int64_t r = 0; r < k; ++r) dq[r] = div_rn(add_rn(g[r], -dot), s2);
  } else {
    for (int64_t r = 0; r < k; ++r) dq[r] = g[r];
  }
  float c = 0.f;
  for (int64_t r = 0; r < k; ++r) {
    const float term = mul_rn(p[r], dq[r]);
    c = r == 0 ? term : add_rn(c, term);
  }
  return c;
}

}  // namespace rl_align
