// moe_combine CPU kernels: tokens (forward, grad_weights) or expert_out rows (grad_expert_out)
// split over threads by at::parallel_for, each computed alone by the functions of
// common/moe_combine.h in the order stated there (grad_weights' 32-lane H-sum emulated lane by
// lane, then the same tree), so neither the batch nor the thread count changes a bit, and the GPU
// kernels give the same bits.
#include "moe_combine_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <vector>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

int64_t grain(int64_t per_item) { return per_item >= 16384 ? 1 : 16384 / (per_item > 0 ? per_item : 1); }

template <typename T>
void forward(const MoeCombineOperands& a) {
  at::parallel_for(0, a.tokens, grain(a.top_k * a.hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(a.hidden);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* pos = a.positions + t * a.top_k;
      const float* w = a.weights != nullptr ? a.weights + t * a.top_k : nullptr;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t r = 0; r < a.top_k; ++r) {
        const T* x = static_cast<const T*>(a.expert_out) + pos[r] * a.expert_out_stride;
        for (int64_t h = 0; h < a.hidden; ++h) {
          acc[h] = moe_combine_step(acc[h], r, moe_combine_term(w, r, static_cast<float>(x[h])));
        }
      }
      T* out = static_cast<T*>(a.out) + t * a.hidden;
      for (int64_t h = 0; h < a.hidden; ++h) out[h] = static_cast<T>(acc[h]);
    }
  });
}

template <typename T>
void backward_rows(const MoeCombineOperands& a) {
  at::parallel_for(0, a.rows, grain(a.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      T* dx = static_cast<T*>(a.grad_expert_out) + row * a.hidden;
      const int64_t o = a.owner[row];
      if (o < 0) {
        for (int64_t h = 0; h < a.hidden; ++h) dx[h] = static_cast<T>(0.f);
        continue;
      }
      const T* g = static_cast<const T*>(a.grad_out) + (o / a.top_k) * a.grad_out_stride;
      if (a.weights == nullptr) {
        for (int64_t h = 0; h < a.hidden; ++h) dx[h] = g[h];
      } else {
        const float w = a.weights[o];
        for (int64_t h = 0; h < a.hidden; ++h) dx[h] = static_cast<T>(mul_rn(w, static_cast<float>(g[h])));
      }
    }
  });
}

template <typename T>
void backward_weights(const MoeCombineOperands& a) {
  at::parallel_for(0, a.tokens, grain(a.top_k * a.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = static_cast<const T*>(a.grad_out) + t * a.grad_out_stride;
      for (int64_t r = 0; r < a.top_k; ++r) {
        const T* x = static_cast<const T*>(a.expert_out) + a.positions[t * a.top_k + r] * a.expert_out_stride;
        float lanes[kMoeCombineLanes];
        for (int l = 0; l < kMoeCombineLanes; ++l) lanes[l] = 0.f;
        for (int64_t h = 0; h < a.hidden; ++h) {
          const int lane = static_cast<int>((h / kMoeCombineChunk) % kMoeCombineLanes);
          lanes[lane] = add_rn(lanes[lane], mul_rn(static_cast<float>(g[h]), static_cast<float>(x[h])));
        }
        a.grad_weights[t * a.top_k + r] = moe_combine_lane_tree(lanes);
      }
    }
  });
}

}  // namespace

int64_t moe_combine_first_bad_position_cpu(const int64_t* positions, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    if (positions[i] < 0 || positions[i] >= rows) return i;
  }
  return -1;
}

void moe_combine_owners_cpu(const int64_t* positions, int64_t n, int64_t* owner, int64_t rows) {
  for (int64_t p = 0; p < rows; ++p) owner[p] = -1;
  for (int64_t i = 0; i < n; ++i) owner[positions[i]] = i;  // in order: the last one stays
}

void moe_combine_fwd_cpu(at::ScalarType dtype, const MoeCombineOperands& a) {
  dispatch_cpu_dtype("moe_combine", dtype, [&](auto tag) { forward<decltype(tag)>(a); });
}

void moe_combine_bwd_rows_cpu(at::ScalarType dtype, const MoeCombineOperands& a) {
  dispatch_cpu_dtype("moe_combine_backward", dtype, [&](auto tag) { backward_rows<decltype(tag)>(a); });
}

void moe_combine_bwd_weights_cpu(at::ScalarType dtype, const MoeCombineOperands& a) {
  dispatch_cpu_dtype("moe_combine_backward", dtype, [&](auto tag) { backward_weights<decltype(tag)>(a); });
}

}  // namespace rl_align
