// moe_router CPU kernels: tokens split over threads by at::parallel_for, each token computed alone
// by the functions of common/moe_router.h in the order stated there (the 32-lane E-sum emulated
// lane by lane, then the same tree), so neither the batch nor the thread count changes a bit, and
// the GPU kernels give the same bits.
#include "moe_router_cpu_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

// Enough logits per task to amortise a thread hand-off.
int64_t grain_tokens(int64_t experts) { return experts >= 4096 ? 1 : 4096 / (experts > 0 ? experts : 1); }

// A token's softmax pieces: x (fp32 logits), e = moe_exp(x - m), and the sum S in the fixed order.
struct TokenSoftmax {
  std::vector<float> x, e;
  float sum = 0.f;

  template <typename T>
  void compute(const T* row, int64_t experts) {
    x.resize(experts);
    e.resize(experts);
    float m = -INFINITY;
    for (int64_t j = 0; j < experts; ++j) {
      x[j] = static_cast<float>(row[j]);
      m = fmaxf(m, x[j]);
    }
    float lanes[kMoeRouterLanes];
    for (int l = 0; l < kMoeRouterLanes; ++l) lanes[l] = 0.f;
    for (int64_t j = 0; j < experts; ++j) {
      e[j] = moe_exp(add_rn(x[j], -m));
      lanes[j % kMoeRouterLanes] = add_rn(lanes[j % kMoeRouterLanes], e[j]);
    }
    sum = moe_router_lane_tree(lanes);
  }

  float p(int64_t j) const { return div_rn(e[j], sum); }
};

template <typename T>
void forward(const MoeRouterOperands& a) {
  const int64_t k = a.top_k;
  at::parallel_for(0, a.tokens, grain_tokens(a.experts), [&](int64_t begin, int64_t end) {
    TokenSoftmax sm;
    std::vector<int64_t> chosen(k);
    for (int64_t t = begin; t < end; ++t) {
      sm.compute(static_cast<const T*>(a.logits) + t * a.logits_stride, a.experts);
      // Insertion into the sorted list of the k first so far (moe_router_before is a strict total
      // order, so any selection algorithm picks the same experts in the same order).
      int64_t n = 0;
      for (int64_t j = 0; j < a.experts; ++j) {
        if (n == k && !moe_router_before(sm.x[j], j, sm.x[chosen[k - 1]], chosen[k - 1])) continue;
        int64_t i = n < k ? n++ : k - 1;
        while (i > 0 && moe_router_before(sm.x[j], j, sm.x[chosen[i - 1]], chosen[i - 1])) {
          chosen[i] = chosen[i - 1];
          --i;
        }
        chosen[i] = j;
      }
      float* w = a.weights + t * k;
      int64_t* ids = a.experts_out + t * k;
      for (int64_t r = 0; r < k; ++r) {
        ids[r] = chosen[r];
        w[r] = sm.p(chosen[r]);
      }
      if (a.normalize) {
        float s2 = w[0];
        for (int64_t r = 1; r < k; ++r) s2 = add_rn(s2, w[r]);
        for (int64_t r = 0; r < k; ++r) w[r] = div_rn(w[r], s2);
      }
    }
  });
}

template <typename T>
void backward(const MoeRouterOperands& a) {
  const int64_t k = a.top_k;
  at::parallel_for(0, a.tokens, grain_tokens(a.experts), [&](int64_t begin, int64_t end) {
    TokenSoftmax sm;
    std::vector<float> p(k), dq(k), dp(a.experts);
    std::vector<char> seen(a.experts);
    for (int64_t t = begin; t < end; ++t) {
      sm.compute(static_cast<const T*>(a.logits) + t * a.logits_stride, a.experts);
      const float* g = a.grad_weights + t * k;
      const int64_t* ids = a.experts_in + t * k;
      for (int64_t r = 0; r < k; ++r) p[r] = sm.p(ids[r]);
      const float c = moe_router_backward_ranks(p.data(), g, k, a.normalize, dq.data());
      std::fill(dp.begin(), dp.end(), 0.f);
      std::fill(seen.begin(), seen.end(), 0);
      for (int64_t r = 0; r < k; ++r) {
        const int64_t j = ids[r];
        dp[j] = seen[j] ? add_rn(dp[j], dq[r]) : dq[r];
        seen[j] = 1;
      }
      T* out = static_cast<T*>(a.grad_logits) + t * a.experts;
      for (int64_t j = 0; j < a.experts; ++j) out[j] = static_cast<T>(mul_rn(sm.p(j), add_rn(dp[j], -c)));
    }
  });
}

}  // namespace

void moe_router_fwd_cpu(at::ScalarType dtype, const MoeRouterOperands& a) {
  dispatch_cpu_dtype("moe_router", dtype, [&](auto tag) { forward<decltype(tag)>(a); });
}

void moe_router_bwd_cpu(at::ScalarType dtype, const MoeRouterOperands& a) {
  const int64_t n = a.tokens * a.top_k;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = a.experts_in[i];
    TORCH_CHECK_INDEX(j >= 0 && j < a.experts, "rl_align::moe_router_backward: expert ", j,
                      " out of range for ", a.experts, " experts");
  }
  dispatch_cpu_dtype("moe_router_backward", dtype, [&](auto tag) { backward<decltype(tag)>(a); });
}

}  // namespace rl_align
