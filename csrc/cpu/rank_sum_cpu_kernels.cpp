// rank_sum CPU kernel: elements split over threads by at::parallel_for, each element folded over
// the parts with RankSumTree (common/rank_sum.h), so neither the thread count nor the split
// changes any bit.
#include "rank_sum_cpu_kernels.h"

#include <ATen/Parallel.h>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

constexpr int64_t kGrainElements = 16384;

template <typename T>
void kernel(const RankSumOperands& a) {
  T* out = static_cast<T*>(a.out);
  at::parallel_for(0, a.numel, kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      RankSumTree tree;
      for (int r = 0; r < a.parts; ++r) tree.add(r, static_cast<float>(static_cast<const T*>(a.part[r])[i]));
      out[i] = static_cast<T>(tree.result(a.parts, a.divisor));
    }
  });
}

}  // namespace

void rank_sum_cpu(at::ScalarType dtype, const RankSumOperands& a) {
  dispatch_cpu_dtype("rank_sum", dtype, [&](auto tag) { kernel<decltype(tag)>(a); });
}

}  // namespace rl_align
