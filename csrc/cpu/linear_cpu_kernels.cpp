// Batch-invariant GEMM and bias-gradient kernels behind the linear ops on CPU.
//
// Arithmetic (common/gemm_problem.h with an MMA depth of 1): every C[i, j] is one fp32
// accumulator, started from c_accum[i, j] or 0, that takes acc = acc + A[i, kk] * B[kk, j] (an
// fp32 multiply, then an fp32 add) for kk = 0, 1, ..., k-1 in that order; then bias[j] is added
// and the sum rounded once. The order is fixed because fp32 addition is not associative: any
// reordering or splitting of the sum over k (split-K, pairwise trees, a library GEMM choosing
// kernels by shape) would let row i depend on m or on the thread count.
//
// Blocking only decides where an element's accumulator lives, never its chain. C is cut into
// kTileRows x kTileCols tiles (constants, never derived from m); at::parallel_for hands out whole
// tiles, so threads never share an element. Inside a tile k is walked in kDepth chunks in
// increasing order, the fp32 accumulators carried from one chunk to the next. Operands are
// converted to fp32 (exact) and packed so that the micro-kernel's innermost loop runs over
// contiguous columns and vectorises across j: each SIMD lane is still one element's sequential
// chain. Rows and columns past the edge of C are zero in the packs and computed like the others,
// then dropped, so every element takes the same instruction sequence whatever m and n are. k is
// never padded: the chain has exactly k steps.
#include "linear_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../primitives/micro_kernel_cpu.h"
#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

// A tile of C: its accumulators stay in a thread-local buffer across k chunks. A is packed once
// per column tile and B once per row tile, so wide tiles keep the (fp16: software) conversions
// small next to the kTileRows x kTileCols x k multiply-adds.
constexpr int64_t kTileRows = 16 * kMicroRows;
constexpr int64_t kTileCols = 32 * kMicroCols;
// k chunk: one packed B panel (kDepth x kMicroCols fp32, 8 KB) stays in L1 while the tile's row
// groups pass over it.
constexpr int64_t kDepth = 256;

// One tile per task: each is already kTileRows x kTileCols x k multiply-adds.
constexpr int64_t kTileGrain = 1;

// Bias gradient: columns per task, summed as one vectorisable row of partials.
constexpr int64_t kBiasCols = 256;

// A[i0 + r, k0 + kk] for r < rows, kk < kc, as fp32, one [kc][kMicroRows] block per row group;
// rows from `rows` up to the group boundary are zero.
template <typename T>
void pack_a(const T* a, int64_t lda, bool mn_major, int64_t i0, int64_t rows, int64_t k0,
            int64_t kc, float* out) {
  for (int64_t g = 0; g * kMicroRows < rows; ++g) {
    float* blk = out + g * kc * kMicroRows;
    const int64_t r0 = g * kMicroRows;
    const int64_t valid = std::min(kMicroRows, rows - r0);
    for (int64_t r = 0; r < kMicroRows; ++r) {
      if (r >= valid) {
        for (int64_t kk = 0; kk < kc; ++kk) blk[kk * kMicroRows + r] = 0.f;
      } else if (mn_major) {
        const T* src = a + k0 * lda + i0 + r0 + r;
        for (int64_t kk = 0; kk < kc; ++kk) blk[kk * kMicroRows + r] = static_cast<float>(src[kk * lda]);
      } else {
        const T* src = a + (i0 + r0 + r) * lda + k0;
        for (int64_t kk = 0; kk < kc; ++kk) blk[kk * kMicroRows + r] = static_cast<float>(src[kk]);
      }
    }
  }
}

// B[k0 + kk, j0 + c] for kk < kc, c < cols, as fp32, one [kc][kMicroCols] panel per column group;
// columns from `cols` up to the group boundary are zero.
template <typename T>
void pack_b(const T* b, int64_t ldb, bool mn_major, int64_t j0, int64_t cols, int64_t k0,
            int64_t kc, float* out) {
  for (int64_t g = 0; g * kMicroCols < cols; ++g) {
    float* panel = out + g * kc * kMicroCols;
    const int64_t c0 = g * kMicroCols;
    const int64_t valid = std::min(kMicroCols, cols - c0);
    if (mn_major) {
      for (int64_t kk = 0; kk < kc; ++kk) {
        const T* src = b + (k0 + kk) * ldb + j0 + c0;
        float* dst = panel + kk * kMicroCols;
        for (int64_t c = 0; c < valid; ++c) dst[c] = static_cast<float>(src[c]);
        for (int64_t c = valid; c < kMicroCols; ++c) dst[c] = 0.f;
      }
    } else {
      for (int64_t c = 0; c < kMicroCols; ++c) {
        if (c >= valid) {
          for (int64_t kk = 0; kk < kc; ++kk) panel[kk * kMicroCols + c] = 0.f;
        } else {
          const T* src = b + (j0 + c0 + c) * ldb + k0;
          for (int64_t kk = 0; kk < kc; ++kk) panel[kk * kMicroCols + c] = static_cast<float>(src[kk]);
        }
      }
    }
  }
}

// Per-thread scratch: packed A and B chunks and the tile's accumulators.
struct TileScratch {
  std::vector<float> a = std::vector<float>(kTileRows * kDepth);
  std::vector<float> b = std::vector<float>(kTileCols * kDepth);
  std::vector<float> acc = std::vector<float>(kTileRows * kTileCols);
};

template <typename T>
void gemm_tile(const GemmProblem& p, int64_t i0, int64_t j0, TileScratch& s) {
  const int64_t rows = std::min(kTileRows, p.m - i0);
  const int64_t cols = std::min(kTileCols, p.n - j0);
  const int64_t row_groups = (rows + kMicroRows - 1) / kMicroRows;
  const int64_t col_groups = (cols + kMicroCols - 1) / kMicroCols;
  float* acc = s.acc.data();
  // The chain starts from the saved accumulator (read before any write, so c_accum may alias c).
  for (int64_t r = 0; r < row_groups * kMicroRows; ++r) {
    float* row = acc + r * kTileCols;
    int64_t valid = 0;
    if (r < rows && p.c_accum != nullptr) {
      const float* src = p.c_accum + (i0 + r) * p.ldc + j0;
      for (; valid < cols; ++valid) row[valid] = src[valid];
    }
    for (int64_t c = valid; c < col_groups * kMicroCols; ++c) row[c] = 0.f;
  }
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  for (int64_t k0 = 0; k0 < p.k; k0 += kDepth) {
    const int64_t kc = std::min(kDepth, p.k - k0);
    pack_a(a, p.lda, p.a_mn_major, i0, rows, k0, kc, s.a.data());
    pack_b(b, p.ldb, p.b_mn_major, j0, cols, k0, kc, s.b.data());
    for (int64_t gc = 0; gc < col_groups; ++gc) {
      for (int64_t gr = 0; gr < row_groups; ++gr) {
        micro_kernel(kc, s.a.data() + gr * kc * kMicroRows, s.b.data() + gc * kc * kMicroCols,
                     acc + gr * kMicroRows * kTileCols + gc * kMicroCols, kTileCols);
      }
    }
  }
  // Bias after the whole reduction, then one rounding.
  const T* bias = static_cast<const T*>(p.bias);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = acc + r * kTileCols;
    const int64_t ci = (i0 + r) * p.ldc + j0;
    for (int64_t c = 0; c < cols; ++c) {
      float v = row[c];
      if (bias != nullptr) v = v + static_cast<float>(bias[j0 + c]);
      if (p.c_fp32) {
        static_cast<float*>(p.c)[ci + c] = v;
      } else {
        static_cast<T*>(p.c)[ci + c] = static_cast<T>(v);
      }
    }
  }
}

template <typename T>
void gemm(const GemmProblem& p) {
  const int64_t row_tiles = (p.m + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (p.n + kTileCols - 1) / kTileCols;
  // Column tiles outermost: each thread's contiguous range then covers whole columns of tiles,
  // so a short last row tile does not leave one thread with less work.
  at::parallel_for(0, row_tiles * col_tiles, kTileGrain, [&](int64_t begin, int64_t end) {
    TileScratch scratch;
    for (int64_t t = begin; t < end; ++t) {
      gemm_tile<T>(p, (t % row_tiles) * kTileRows, (t / row_tiles) * kTileCols, scratch);
    }
  });
}

template <typename T>
void bias_grad(const T* dy, int64_t ld, int64_t m, int64_t n, const float* accum, float* dbias) {
  at::parallel_for(0, (n + kBiasCols - 1) / kBiasCols, 1, [&](int64_t begin, int64_t end) {
    float total[kBiasCols];
    float partial[kBiasCols];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t j0 = blk * kBiasCols;
      const int64_t cols = std::min(kBiasCols, n - j0);
      // Read before any write of dbias, so accum may alias it.
      for (int64_t c = 0; c < cols; ++c) total[c] = accum != nullptr ? accum[j0 + c] : 0.f;
      for (int64_t first = 0; first < m; first += kLinearGradTileTokens) {
        const int64_t last = std::min(m, first + kLinearGradTileTokens);
        for (int64_t c = 0; c < cols; ++c) partial[c] = 0.f;
        for (int64_t i = first; i < last; ++i) {
          const T* row = dy + i * ld + j0;
          for (int64_t c = 0; c < cols; ++c) partial[c] = partial[c] + static_cast<float>(row[c]);
        }
        for (int64_t c = 0; c < cols; ++c) total[c] = total[c] + partial[c];
      }
      for (int64_t c = 0; c < cols; ++c) dbias[j0 + c] = total[c];
    }
  });
}

}  // namespace

void linear_gemm_cpu(at::ScalarType dtype, const GemmProblem& p) {
  TORCH_CHECK(p.tree_leaves <= 1, "rl_align: the CPU GEMM runs a tree leaf by leaf (host/linear_tree.h)");
  if (p.m <= 0 || p.n <= 0) return;
  dispatch_cpu_dtype("linear", dtype, [&](auto tag) { gemm<decltype(tag)>(p); });
}

void linear_bias_bwd_cpu(at::ScalarType dtype, const void* dy, int64_t ld, int64_t m, int64_t n,
                          const float* accum, float* dbias) {
  if (n <= 0) return;
  dispatch_cpu_dtype("linear_grad_bias", dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    bias_grad(static_cast<const scalar_t*>(dy), ld, m, n, accum, dbias);
  });
}

}  // namespace rl_align
