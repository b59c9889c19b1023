// moe_combine: the arithmetic every path computes (the CPU and GPU kernels call these functions,
// rl_engine_ext/ops/moe_combine.py mirrors them op for op in PyTorch) and the operand descriptor of
// the kernel entry points. Torch-free and GPU-runtime-free.
//
// Forward, per token t and column h, x_r = float(expert_out[positions[t, r], h]), w_r =
// float(weights[t, r]) (exact conversions), every step one IEEE fp32 operation, NO fused
// multiply-add on any path (mul_rn then add_rn; the CPU build has -ffp-contract=off):
//   acc = w_0 x_0;  acc = acc + w_r x_r  for r = 1 .. k-1 (increasing rank);  out = round(acc)
// weights None: the same with w_r x_r replaced by x_r (bit for bit the result of weights = 1, as
// 1 * x == x). k = 0: out = 0.
//
// Backward:
//   grad_expert_out[p] = round(w_r * grad_out[t]) (weights None: grad_out[t] copied) for the (t, r)
//     with positions[t, r] == p; rows that no position names are 0. Positions are expected not to
//     repeat (a dispatch permutation); where one does, the LAST (t, r) in row-major order (the
//     largest t * k + r) owns the row, on every path (the CPU scans in order; the GPU stably sorts
//     the positions and takes each run's last entry).
//   grad_weights[t, r] = sum over h of grad_out[t, h] * x_r[h] in fp32, rounded once to weights'
//     dtype, in a fixed order set by H alone: the columns in chunks of kMoeCombineChunk = 8, chunk
//     c to lane c mod 32 of kMoeCombineLanes = 32; each lane adds its products (mul then add) onto
//     0 in increasing column order; then the 32 lane sums in the fixed tree v[l] += v[l + h],
//     h = 16, 8, 4, 2, 1 (a butterfly on the GPU). H = 0: 0.
// Out-of-range positions (outside [0, R)): IndexError on the CPU, a device-side assert on the GPU;
// never an out-of-bounds access. No atomics anywhere.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace rl_align {

constexpr int kMoeCombineLanes = 32;
constexpr int kMoeCombineChunk = 8;

// The kernels' operands. expert_out rows are `expert_out_stride` elements apart and grad_out rows
// `grad_out_stride` (dense last dims); every other array is contiguous.
struct MoeCombineOperands {
  int64_t tokens = 0, top_k = 0, rows = 0, hidden = 0;
  const void* expert_out = nullptr;  // [rows, hidden]
  int64_t expert_out_stride = 0;
  const int64_t* positions = nullptr;  // [tokens, top_k]
  const float* weights = nullptr;      // [tokens, top_k] fp32, or null: every weight 1
  void* out = nullptr;                 // forward: [tokens, hidden], expert_out's dtype
  // backward
  const void* grad_out = nullptr;  // [tokens, hidden], expert_out's dtype
  int64_t grad_out_stride = 0;
  const int64_t* owner = nullptr;  // [rows]: the t * k + r owning each row, -1 for none
  void* grad_expert_out = nullptr;  // [rows, hidden], expert_out's dtype
  float* grad_weights = nullptr;    // [tokens, top_k] fp32 (before the rounding to weights' dtype)
};

// Rank r's term of the forward sum: w_r x_r, or x_r without weights (w: the token's k weights).
RL_ALIGN_HOST_DEVICE float moe_combine_term(const float* w, int64_t r, float x) {
  return w != nullptr ? mul_rn(w[r], x) : x;
}

// The running sum after rank r's term.
RL_ALIGN_HOST_DEVICE float moe_combine_step(float acc, int64_t r, float term) {
  return r == 0 ? term : add_rn(acc, term);
}

// The fixed tree over kMoeCombineLanes lane sums (v is overwritten).
RL_ALIGN_HOST_DEVICE float moe_combine_lane_tree(float* v) {
  for (int h = kMoeCombineLanes / 2; h > 0; h /= 2) {
    for (int l = 0; l < h; ++l) v[l] = add_rn(v[l], v[l + h]);
  }
  return v[0];
}

}  // namespace rl_align
