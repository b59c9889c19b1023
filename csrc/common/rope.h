// rope (rotary position embedding): the problem descriptor and the arithmetic, stated once for the
// CPU kernel (csrc/cpu/rope_cpu_kernels.cpp) and the GPU kernel (csrc/cuda/rope_simt.cu). Pure
// C++ on the host (no CUDA, no torch); the GPU compiles the same functions for the device.
//
// For a token at integer position `pos` and frequency i (0 <= i < R/2, R = rotary_dim):
//   angle = float(pos) * inv_freq[i]               int -> fp32 (round to nearest), one fp32 multiply
//   c = cos(angle) * scaling, s = sin(angle) * scaling    full-accuracy sinf/cosf (never __sinf:
//                                                   angles reach 10^5..10^6 rad), fp32 multiplies
//   out_a = a * c - b * s, out_b = b * c + a * s    two rounded fp32 products, one rounded add each
//                                                   (no FMA on either side), one rounding to dtype
// Pairs (a, b): NeoX rotate-half (i, i + R/2); GPT-J interleaved (2i, 2i + 1). Elements R..D-1
// are copied unchanged. The backward is the transposed rotation: the same with s negated.
//
// This is Hugging Face's formula (position_ids.float() @ inv_freq in fp32, cos/sin in fp32) without
// its rounding of cos/sin and of each product to bf16. float(pos) is exact up to 2^24 = 16777216;
// beyond, the position rounds to the nearest fp32 (as in HF). The fp32 angle itself carries a
// rounding error of up to half an ulp of |angle| (2^-8 rad at 10^5 rad), part of the definition.
//
// Invariance: every output element is a function of its own token's position and values (and
// inv_freq, scaling) alone; CPU and GPU run the same expressions (they may differ only where the
// host's libm and the GPU's sinf/cosf round differently).
#pragma once

#include "host_device.h"

#include <cmath>
#include <cstdint>


namespace rl_align {

enum class RopeStyle : int { kNeox = 0, kGptj = 1 };

// One of q and k as a [batch, seq, heads, head_dim] strided view (every layout is one: bhsd is a
// permutation, thd has batch 1); the last dimension is dense. Strides in elements.
struct RopeOperand {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;
  int64_t in_stride_b = 0, in_stride_s = 0, in_stride_h = 0;
  int64_t out_stride_b = 0, out_stride_s = 0, out_stride_h = 0;
};

struct RopeProblem {
  RopeOperand operand[2];  // q, k
  int64_t batch = 0, seq = 0;  // tokens = batch * seq; token n is (n / seq, n % seq)
  int64_t head_dim = 0, rotary_dim = 0;  // rotary_dim even, <= head_dim
  const void* positions = nullptr;  // int32 or int64, positions[b * pos_stride_b + s * pos_stride_s]
  bool positions_int64 = true;
  int64_t pos_stride_b = 0, pos_stride_s = 0;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  RopeStyle style = RopeStyle::kNeox;
  float scaling = 1.f;
};

// c and s of frequency `inv_freq` at `pos`; `inverse` (the backward: the transposed rotation)
// negates s.
RL_ALIGN_HOST_DEVICE void rope_cos_sin(int64_t pos, float inv_freq, float scaling, bool inverse,
                                       float& c, float& s) {
  const float angle = mul_rn(static_cast<float>(pos), inv_freq);
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  sincosf(angle, &s, &c);
#else
  s = std::sin(angle);
  c = std::cos(angle);
#endif
  c = mul_rn(c, scaling);
  s = mul_rn(s, scaling);
  if (inverse) s = -s;
}

// (a, b) -> (a c - b s, b c + a s).
RL_ALIGN_HOST_DEVICE void rope_rotate(float a, float b, float c, float s, float& out_a, float& out_b) {
  out_a = add_rn(mul_rn(a, c), -mul_rn(b, s));
  out_b = add_rn(mul_rn(b, c), mul_rn(a, s));
}

// The position of token (b, s).
RL_ALIGN_HOST_DEVICE int64_t rope_position(const RopeProblem& p, int64_t b, int64_t s) {
  const int64_t i = b * p.pos_stride_b + s * p.pos_stride_s;
  return p.positions_int64 ? static_cast<const int64_t*>(p.positions)[i]
                           : static_cast<const int32_t*>(p.positions)[i];
}

}  // namespace rl_align
