// rope CPU kernel.
//
// Invariance: at::parallel_for hands out whole tokens; a token's cos/sin are computed once from
// its own position (common/rope.h) and applied to every head of q and k, so neither the number of
// tokens, their neighbours nor the thread count changes any bit.
#include "rope_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

template <typename T, RopeStyle STYLE>
void rope_cpu_kernel(const RopeProblem& p, bool inverse) {
  const int64_t half = p.rotary_dim / 2;
  // Element offsets of pair i: NeoX (i, i + R/2), GPT-J (2i, 2i + 1).
  const int64_t a_step = STYLE == RopeStyle::kNeox ? 1 : 2;
  const int64_t b_offset = STYLE == RopeStyle::kNeox ? half : 1;
  at::parallel_for(0, p.batch * p.seq, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * half);
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / p.seq, s = token % p.seq;
      const int64_t pos = rope_position(p, b, s);
      for (int64_t i = 0; i < half; ++i) {
        rope_cos_sin(pos, p.inv_freq[i], p.scaling, inverse, cs[2 * i], cs[2 * i + 1]);
      }
      for (const RopeOperand& o : p.operand) {
        const T* in = static_cast<const T*>(o.in) + b * o.in_stride_b + s * o.in_stride_s;
        T* out = static_cast<T*>(o.out) + b * o.out_stride_b + s * o.out_stride_s;
        for (int64_t h = 0; h < o.heads; ++h) {
          const T* x = in + h * o.in_stride_h;
          T* y = out + h * o.out_stride_h;
          for (int64_t i = 0; i < half; ++i) {
            const int64_t ia = i * a_step, ib = ia + b_offset;
            float ya, yb;
            rope_rotate(static_cast<float>(x[ia]), static_cast<float>(x[ib]), cs[2 * i],
                        cs[2 * i + 1], ya, yb);
            y[ia] = static_cast<T>(ya);
            y[ib] = static_cast<T>(yb);
          }
          for (int64_t e = p.rotary_dim; e < p.head_dim; ++e) y[e] = x[e];
        }
      }
    }
  });
}

void rope_cpu(const char* op, at::ScalarType dtype, const RopeProblem& p, bool inverse) {
  dispatch_cpu_dtype(op, dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.style == RopeStyle::kNeox) {
      rope_cpu_kernel<T, RopeStyle::kNeox>(p, inverse);
    } else {
      rope_cpu_kernel<T, RopeStyle::kGptj>(p, inverse);
    }
  });
}

}  // namespace

void rope_fwd_cpu(at::ScalarType dtype, const RopeProblem& p) { rope_cpu("rope", dtype, p, false); }

void rope_bwd_cpu(at::ScalarType dtype, const RopeProblem& p) {
  rope_cpu("rope_backward", dtype, p, true);
}

}  // namespace rl_align
