// Embedding CPU kernels.
//
// Invariance: the forward copies rows. The backward sorts token positions by id (stable: equal ids
// keep token order), then each row is summed by one thread, token by token, into its fp32 row of
// dweight: at::parallel_for splits only the rows, so neither the batch nor the thread count changes
// any row's chain, and the chain is the GPU's (one fp32 add per token, in token order).
#include "embedding_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

// Enough elements per parallel chunk to amortise a task.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t hidden) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, hidden)); }

template <typename T>
void embedding_bwd_kernel(const T* grad_out, int64_t grad_out_row_stride, const int64_t* ids,
                          int64_t tokens, int64_t padding_idx, const float* dweight_accum,
                          float* dweight, int64_t num_embeddings, int64_t hidden) {
  std::vector<int64_t> order(static_cast<size_t>(tokens));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  at::parallel_for(0, num_embeddings, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    auto pos = std::lower_bound(order.begin(), order.end(), begin,
                                [ids](int64_t token, int64_t v) { return ids[token] < v; });
    for (int64_t v = begin; v < end; ++v) {
      float* row = dweight + v * hidden;
      if (dweight_accum != nullptr) {
        std::memcpy(row, dweight_accum + v * hidden, static_cast<size_t>(hidden) * sizeof(float));
      } else {
        std::fill(row, row + hidden, 0.f);
      }
      for (; pos != order.end() && ids[*pos] == v; ++pos) {
        if (v == padding_idx) continue;
        const T* g = grad_out + *pos * grad_out_row_stride;
        for (int64_t h = 0; h < hidden; ++h) row[h] += static_cast<float>(g[h]);
      }
    }
  });
}

}  // namespace

int64_t embedding_first_bad_id_cpu(const int64_t* ids, int64_t tokens, int64_t num_embeddings) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= num_embeddings) return t;
  }
  return -1;
}

void embedding_fwd_cpu(const int64_t* ids, int64_t tokens, const void* weight,
                       int64_t weight_row_stride, void* out, int64_t hidden, int64_t element_size) {
  const auto* w = static_cast<const char*>(weight);
  auto* o = static_cast<char*>(out);
  const int64_t row_bytes = hidden * element_size;
  at::parallel_for(0, tokens, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(o + t * row_bytes, w + ids[t] * weight_row_stride * element_size,
                  static_cast<size_t>(row_bytes));
    }
  });
}

void embedding_bwd_cpu(at::ScalarType dtype, const void* grad_out, int64_t grad_out_row_stride,
                       const int64_t* ids, int64_t tokens, int64_t padding_idx,
                       const float* dweight_accum, float* dweight, int64_t num_embeddings,
                       int64_t hidden) {
  dispatch_cpu_dtype("embedding_grad_weight", dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    embedding_bwd_kernel<scalar_t>(static_cast<const scalar_t*>(grad_out), grad_out_row_stride, ids,
                                   tokens, padding_idx, dweight_accum, dweight, num_embeddings,
                                   hidden);
  });
}

}  // namespace rl_align
