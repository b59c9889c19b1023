// moe_router forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// One group of kMoeRouterLanes = 32 lanes per token (a warp on NVIDIA, half a wavefront on AMD),
// kGroups groups per block, grid-striding over tokens. Lane l holds the logits l, l + 32, ... of
// its token in registers (PER_LANE = the power of two >= ceil(E / 32), at most 32), computes their
// exps and its lane sum in index order, and the 32 lane sums meet in the butterfly h = 16 .. 1:
// the order of common/moe_router.h, set by E alone. The selection runs top_k rounds; in each, every
// lane proposes its first logit after the previous winner in the selection order, and a butterfly
// keeps the first proposal (the order is total, so every lane ends with the same winner). Lane 0
// writes the token's experts and weights. The backward recomputes the softmax the same way; every
// lane reads the token's k expert ids and gradients and runs the rank-order sums itself (the same
// instructions on every lane, so the same bits), then writes its own columns of grad_logits.
// No shared memory, no block-level synchronisation, no atomics; nothing depends on the number of
// tokens.
#include "moe_router_kernels.h"

#include <type_traits>

#include "device_assert.cuh"

namespace rl_align {
namespace {

constexpr int kThreads = 256;
constexpr int kGroups = kThreads / kMoeRouterLanes;
constexpr int64_t kMaxGrid = 65535;

// A token's logits in a lane's registers, their max over the token, exps and the softmax sum.
template <typename T, int PER_LANE>
struct LaneSoftmax {
  float x[PER_LANE];
  float e[PER_LANE];
  float m;
  float sum;

  __device__ __forceinline__ void compute(const T* __restrict__ row, int64_t experts, int lane) {
    m = -INFINITY;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int64_t j = static_cast<int64_t>(i) * kMoeRouterLanes + lane;
      x[i] = j < experts ? Convert<T>::to_float(row[j]) : -INFINITY;
      if (j < experts) m = fmaxf(m, x[i]);
    }
#pragma unroll
    for (int h = kMoeRouterLanes / 2; h > 0; h /= 2) m = fmaxf(m, shfl_xor(m, h, kMoeRouterLanes));
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int64_t j = static_cast<int64_t>(i) * kMoeRouterLanes + lane;
      e[i] = j < experts ? moe_exp(add_rn(x[i], -m)) : 0.f;
      if (j < experts) s = add_rn(s, e[i]);
    }
#pragma unroll
    for (int h = kMoeRouterLanes / 2; h > 0; h /= 2) s = add_rn(s, shfl_xor(s, h, kMoeRouterLanes));
    sum = s;
  }
};

template <typename T, int PER_LANE>
__global__ void __launch_bounds__(kThreads) moe_router_fwd_kernel(MoeRouterOperands a) {
  const int lane = threadIdx.x % kMoeRouterLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kMoeRouterLanes;
  for (int64_t t = first; t < a.tokens; t += static_cast<int64_t>(gridDim.x) * kGroups) {
    LaneSoftmax<T, PER_LANE> sm;
    sm.compute(static_cast<const T*>(a.logits) + t * a.logits_stride, a.experts, lane);
    float p_sel[kMoeRouterMaxTopK];
    float prev_v = 0.f, prev_j = -1.f;  // expert ids travel as floats (exact below 2^24)
    for (int64_t r = 0; r < a.top_k; ++r) {
      float best_v = 0.f, best_j = -1.f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        const int64_t j = static_cast<int64_t>(i) * kMoeRouterLanes + lane;
        if (j >= a.experts) continue;
        const bool after_prev = prev_j < 0.f || moe_router_before(prev_v, static_cast<int64_t>(prev_j), sm.x[i], j);
        if (after_prev && (best_j < 0.f || moe_router_before(sm.x[i], j, best_v, static_cast<int64_t>(best_j)))) {
          best_v = sm.x[i];
          best_j = static_cast<float>(j);
        }
      }
#pragma unroll
      for (int h = kMoeRouterLanes / 2; h > 0; h /= 2) {
        const float other_v = shfl_xor(best_v, h, kMoeRouterLanes);
        const float other_j = shfl_xor(best_j, h, kMoeRouterLanes);
        if (other_j >= 0.f && (best_j < 0.f || moe_router_before(other_v, static_cast<int64_t>(other_j), best_v,
                                                                 static_cast<int64_t>(best_j)))) {
          best_v = other_v;
          best_j = other_j;
        }
      }
      prev_v = best_v;
      prev_j = best_j;
      if (lane == 0) {
        a.experts_out[t * a.top_k + r] = static_cast<int64_t>(best_j);
        p_sel[r] = div_rn(moe_exp(add_rn(best_v, -sm.m)), sm.sum);  // e of the winner, as in the sum
      }
    }
    if (lane == 0) {
      float s2 = p_sel[0];
      if (a.normalize) {
        for (int64_t r = 1; r < a.top_k; ++r) s2 = add_rn(s2, p_sel[r]);
      }
      for (int64_t r = 0; r < a.top_k; ++r) a.weights[t * a.top_k + r] = a.normalize ? div_rn(p_sel[r], s2) : p_sel[r];
    }
  }
}

template <typename T, int PER_LANE>
__global__ void __launch_bounds__(kThreads) moe_router_bwd_kernel(MoeRouterOperands a) {
  const int lane = threadIdx.x % kMoeRouterLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / kMoeRouterLanes;
  const int64_t k = a.top_k;
  for (int64_t t = first; t < a.tokens; t += static_cast<int64_t>(gridDim.x) * kGroups) {
    const int64_t* ids = a.experts_in + t * k;
    for (int64_t r = 0; r < k; ++r) {
      if (ids[r] < 0 || ids[r] >= a.experts) {
        if (lane == 0) fail_index_out_of_range("moe_router_backward", "expert", ids[r], "", a.experts, " experts");
        return;
      }
    }
    const T* row = static_cast<const T*>(a.logits) + t * a.logits_stride;
    LaneSoftmax<T, PER_LANE> sm;
    sm.compute(row, a.experts, lane);
    const float* g = a.grad_weights + t * k;
    float p[kMoeRouterMaxTopK], dq[kMoeRouterMaxTopK];
    for (int64_t r = 0; r < k; ++r) {
      p[r] = div_rn(moe_exp(add_rn(Convert<T>::to_float(row[ids[r]]), -sm.m)), sm.sum);
    }
    const float c = moe_router_backward_ranks(p, g, k, a.normalize, dq);
    T* out = static_cast<T*>(a.grad_logits) + t * a.experts;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int64_t j = static_cast<int64_t>(i) * kMoeRouterLanes + lane;
      if (j >= a.experts) continue;
      float dp = 0.f;
      bool seen = false;
      for (int64_t r = 0; r < k; ++r) {
        if (ids[r] == j) {
          dp = seen ? add_rn(dp, dq[r]) : dq[r];
          seen = true;
        }
      }
      out[j] = Convert<T>::from_float(mul_rn(div_rn(sm.e[i], sm.sum), add_rn(dp, -c)));
    }
  }
}

// The registers per lane for E experts: the power of two >= ceil(E / 32).
template <typename F>
gpuError_t with_per_lane(int64_t experts, F&& f) {
  const int64_t need = ceil_div(experts, kMoeRouterLanes);
  if (need <= 1) return f(std::integral_constant<int, 1>{});
  if (need <= 2) return f(std::integral_constant<int, 2>{});
  if (need <= 4) return f(std::integral_constant<int, 4>{});
  if (need <= 8) return f(std::integral_constant<int, 8>{});
  if (need <= 16) return f(std::integral_constant<int, 16>{});
  if (need <= 32) return f(std::integral_constant<int, 32>{});
  return gpu_not_supported();
}

unsigned grid_of(int64_t tokens) {
  const int64_t blocks = ceil_div(tokens, kGroups);
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

template <bool BACKWARD>
gpuError_t launch(DType dtype, const MoeRouterOperands& a, gpuStream_t stream) {
  if (a.tokens == 0 || a.experts == 0) return kGpuSuccess;
  if (a.top_k < 1 || a.top_k > kMoeRouterMaxTopK || a.top_k > a.experts) return gpu_not_supported();
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_per_lane(a.experts, [&](auto per_lane) {
      constexpr int PER_LANE = decltype(per_lane)::value;
      if constexpr (BACKWARD) {
        moe_router_bwd_kernel<T, PER_LANE><<<grid_of(a.tokens), kThreads, 0, stream>>>(a);
      } else {
        moe_router_fwd_kernel<T, PER_LANE><<<grid_of(a.tokens), kThreads, 0, stream>>>(a);
      }
      return gpu_last_error();
    });
  }, gpu_not_supported);
}

}  // namespace

gpuError_t moe_router_fwd_simt(DType dtype, const MoeRouterOperands& a, gpuStream_t stream) {
  return launch<false>(dtype, a, stream);
}

gpuError_t moe_router_bwd_simt(DType dtype, const MoeRouterOperands& a, gpuStream_t stream) {
  return launch<true>(dtype, a, stream);
}

}  // namespace rl_align
