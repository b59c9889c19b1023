// logprob CPU kernels: rows split over threads by at::parallel_for; a row is folded by one
// thread in a fixed partition that depends only on V: kCpuSegments contiguous segments (each a
// whole number of kCpuGroup-element groups), each folded group by group in index order
// (logprob_push), then the segment states merged in a fixed pairwise tree. Neither the batch nor
// the thread count changes any bit; the segments keep each sequential sum short (accuracy).
#include "logprob_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "../common/host_device.h"
#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

constexpr int kCpuGroup = 32;
constexpr int kCpuSegments = 64;

int64_t grain_rows(int64_t vocab) { return vocab >= 32768 ? 1 : 32768 / (vocab > 0 ? vocab : 1); }

// The merged state of x[0, vocab) scaled by inv_t.
template <typename T>
LogprobState fold_row(const T* x, int64_t vocab, float inv_t) {
  const int64_t segment = round_up((vocab + kCpuSegments - 1) / kCpuSegments, kCpuGroup);
  LogprobState states[kCpuSegments];
  float z[kCpuGroup];
  for (int k = 0; k < kCpuSegments; ++k) {
    LogprobState st = logprob_empty_state();
    const int64_t end = std::min(vocab, (k + 1) * segment);
    for (int64_t v0 = k * segment; v0 < end; v0 += kCpuGroup) {
      const int n = static_cast<int>(std::min<int64_t>(end - v0, kCpuGroup));
      for (int j = 0; j < n; ++j) z[j] = mul_rn(static_cast<float>(x[v0 + j]), inv_t);
      st = logprob_push(st, z, n);
    }
    states[k] = st;
  }
  for (int stride = 1; stride < kCpuSegments; stride *= 2) {
    for (int k = 0; k + stride < kCpuSegments; k += 2 * stride) states[k] = logprob_merge(states[k], states[k + stride]);
  }
  return states[0];
}

template <typename T>
void forward(const LogprobOperands& a) {
  at::parallel_for(0, a.rows, grain_rows(a.vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.logits) + r * a.logits_stride;
      const LogprobState st = fold_row(x, a.vocab, a.inv_temperature);
      const int64_t t = logprob_target(a, r);
      const bool ignored = t == a.ignore_index;
      const LogprobRow out =
          logprob_finish(st, ignored ? 0.f : mul_rn(static_cast<float>(x[t]), a.inv_temperature));
      a.lse[r] = out.lse;
      a.logprob[r] = ignored ? 0.f : out.logprob;
      a.entropy[r] = ignored ? 0.f : out.entropy;
    }
  });
}

template <typename T>
void backward(const LogprobOperands& a) {
  at::parallel_for(0, a.rows, grain_rows(a.vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = static_cast<const T*>(a.logits) + r * a.logits_stride;
      T* dx = static_cast<T*>(a.grad_logits) + r * a.vocab;
      const int64_t t = logprob_target(a, r);
      if (t == a.ignore_index) {
        for (int64_t v = 0; v < a.vocab; ++v) dx[v] = static_cast<T>(0.f);
        continue;
      }
      const int64_t t_column = t - a.column_offset;  // the target's column in this slice of the row
      const bool has_gh = a.grad_entropy != nullptr;
      const float gh = has_gh ? a.grad_entropy[r] : 0.f;
      const float ez = add_rn(a.saved_lse[r], -a.saved_entropy[r]);
      for (int64_t v = 0; v < a.vocab; ++v) {
        dx[v] = static_cast<T>(logprob_grad(static_cast<float>(x[v]), v == t_column, a.inv_temperature,
                                            a.saved_lse[r], a.grad_logprob[r], has_gh, gh, ez));
      }
    }
  });
}

}  // namespace

void logprob_fwd_cpu(at::ScalarType dtype, const LogprobOperands& a) {
  dispatch_cpu_dtype("logprob", dtype, [&](auto tag) { forward<decltype(tag)>(a); });
}

void logprob_bwd_cpu(at::ScalarType dtype, const LogprobOperands& a) {
  dispatch_cpu_dtype("logprob_backward", dtype, [&](auto tag) { backward<decltype(tag)>(a); });
}

}  // namespace rl_align
