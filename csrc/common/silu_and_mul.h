// silu_and_mul: the arithmetic every path computes (CPU and GPU call these functions) and the
// operand descriptor of the kernel entry points. Torch-free and GPU-runtime-free.
//
// Per element, g = gate and u = up converted to fp32 (exact), then, in this order, each step one
// IEEE fp32 operation rounded to nearest (no fused multiply-add on any path: the GPU code uses
// the _rn intrinsics, which the compiler may not contract; the CPU build has -ffp-contract=off):
//
//   e     = exp(-g)                  full-accuracy expf (never the __expf approximation)
//   s     = 1 / (1 + e)              sigmoid(g)
//   silu  = g * s                    -0 where s == 0 (see below)
//   y     = silu * u                 rounded once to the output dtype
// backward, with dy = grad_out in fp32:
//   dsilu = s * (1 + g * (1 - s))    d silu / d g; g * (1 - s) is taken as 0 where 1 - s == 0,
//                                    and dsilu as -0 where s == 0
//   dgate = (dy * u) * dsilu         rounded once
//   dup   = dy * silu                rounded once
//
// Large |g| and infinities: exp(-g) overflows to inf for g < about -88.72, so s == 0 there and
// g * s would be NaN at g = -inf; silu and dsilu take -0 there (the true values are negative and
// below 2.7e-37 in magnitude). For g > about 16.6, s == 1 exactly and g * (1 - s) would be NaN
// at g = +inf; its limit is 0, so dsilu = 1. A NaN in g, u or dy makes that element's outputs
// NaN (a NaN compares unequal to 0, so the limit selections never hide it) and touches no other
// element. The CPU's expf (glibc) and the GPU's (CUDA: at most 2 ulp) may differ in the last
// bit, so CPU and GPU results may differ by an ulp; every path is bitwise identical to itself
// whatever the batch.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace rl_align {

// The kernels' operands: [rows, cols] matrices with a dense last dimension, rows `*_stride`
// elements apart. The two layouts differ only here: HF's separate gate / up tensors, or one
// [rows, 2 * cols] gate_up tensor with up = gate_up + cols (and likewise d(gate_up)).
struct SiluMulOperands {
  int64_t rows = 0, cols = 0;
  const void* gate = nullptr;
  int64_t gate_stride = 0;
  const void* up = nullptr;
  int64_t up_stride = 0;
  const void* grad_out = nullptr;  // backward only
  int64_t grad_out_stride = 0;
  void* out = nullptr;  // forward: y; backward: d gate
  int64_t out_stride = 0;
  void* dup = nullptr;  // backward only: d up
  int64_t dup_stride = 0;
};

RL_ALIGN_HOST_DEVICE float silu_sigmoid(float g) { return div_rn(1.f, add_rn(1.f, expf(-g))); }

RL_ALIGN_HOST_DEVICE float silu_of(float g, float s) { return s == 0.f ? -0.f : mul_rn(g, s); }

// y = silu(g) * u (fp32; the caller rounds once).
RL_ALIGN_HOST_DEVICE float silu_mul_forward(float g, float u) {
  return mul_rn(silu_of(g, silu_sigmoid(g)), u);
}

struct SiluMulGrads {
  float dgate, dup;
};

RL_ALIGN_HOST_DEVICE SiluMulGrads silu_mul_backward(float dy, float g, float u) {
  const float s = silu_sigmoid(g);
  const float one_minus_s = add_rn(1.f, -s);
  const float g_term = one_minus_s == 0.f ? 0.f : mul_rn(g, one_minus_s);
  const float dsilu = s == 0.f ? -0.f : mul_rn(s, add_rn(1.f, g_term));
  return {mul_rn(mul_rn(dy, u), dsilu), mul_rn(dy, silu_of(g, s))};
}

}  // namespace rl_align
