// Batch-invariant attention kernels on CPU, forward and backward (arithmetic: the header and
// common/attention_problem.h).
//
// Work units. The forward and dQ take tiles of kRowTile queries of one (sequence, head); dK/dV
// take tiles of kRowTile keys of one (sequence, kv head); at::parallel_for hands out whole tiles,
// so no two threads write the same element and the thread count changes no chain. Tiles start
// at query (key) 0 of their sequence, but nothing below depends on them either: a tile only
// decides which rows share the loads of a key (query) block.
//
// Products. Every score, dP and accumulation is a small GEMM done by one micro-kernel
// (kMicroRows x kMicroCols fp32 accumulators in registers; the innermost loop runs across
// columns, so each SIMD lane is one element's own sequential chain). Operands are fp32 copies:
// the tile's rows transposed ([d][row]) and the block's keys (queries) transposed ([d][col]) for
// the chains over d; the block's rows as [row][d] for the chains over keys (queries). Padding
// rows, keys and columns of d are zero or stale and computed like the others, then dropped, so
// every element takes the same instruction sequence whatever the lengths; a chain over d has
// exactly head_dim steps.
//
// Masked keys inside a block. A row's chains over the keys (queries) of a block run over its
// allowed ones only (ranged_tile_product): a masked term is never formed, so a NaN or Inf in a
// key (query) the row may not see changes none of its bits (a p = 0 term would give 0 * inf =
// NaN). For finite inputs this gives the bits a chain over every key with p = dS = 0 terms
// would: such a term is a*b = +-0, and acc + (+-0) = acc for every acc except -0, which an
// accumulator started at +0 never becomes in round-to-nearest. Scores and dP of masked pairs
// are computed with the block's others and never read. Whole blocks: a row with no allowed key
// in a block skips the block's softmax update. So a causal row's result is the same when the
// keys after it are real data (full prefill), absent (a chunk or decode step ends at the row),
// or another row's (the tile's), whatever they hold.
//
// KV splits (forward). The running (m, l, acc) of a row is its current split's partial; at each
// split boundary a row that reaches the new split folds the finished partial into its merged
// state (split 0's partial is copied, later ones merged by merge_split) and starts the next from
// a fresh state. A tile straddling a boundary folds only the rows that reach it.
#include "attention_cpu_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../primitives/micro_kernel_cpu.h"
#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

constexpr int64_t kBlock = kAttentionKvBlock;
// Query rows per forward / dQ task and key rows per dK/dV task: a key (query) block, converted
// once, serves this many rows, which keeps the conversions small next to the multiply-adds.
constexpr int64_t kRowTile = 4 * kMicroRows;
static_assert(kBlock % kMicroCols == 0, "a block is whole column groups");

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Where a query row's chains over a key block start: at the block's first key.
constexpr int64_t kFromFirstKey[kRowTile] = {};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// acc[r][c] += the micro-kernel's chain for r < rows, c < cols (multiples of the micro-tile), with
// row group g's A panel at a + g * a_panel and column group g's B panel at b + g * b_panel.
// Column groups outermost: one B panel stays in L1 while the tile's row groups pass over it.
void tile_product(int64_t depth, const float* a, int64_t a_panel, int64_t rows, const float* b,
                  int64_t b_panel, int64_t cols, float* acc, int64_t ld_acc) {
  for (int64_t c0 = 0; c0 < cols; c0 += kMicroCols) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMicroRows) {
      micro_kernel(depth, a + (r0 / kMicroRows) * a_panel, b + (c0 / kMicroCols) * b_panel,
                   acc + r0 * ld_acc + c0, ld_acc);
    }
  }
}

// The micro-kernel's per-element operation (an fp32 multiply, then an fp32 add) for one row,
// kk = from .. to-1 in order: acc[c] = acc[c] + a[kk] * b[kk][c], with a the row's lane of its A
// panel and the column groups' B panels b_panel apart.
void row_chain(int64_t from, int64_t to, const float* a, const float* b, int64_t b_panel, int64_t cols,
               float* acc) {
  for (int64_t kk = from; kk < to; ++kk) {
    const float av = a[kk * kMicroRows];
    for (int64_t c0 = 0; c0 < cols; c0 += kMicroCols) {
      const float* bk = b + (c0 / kMicroCols) * b_panel + kk * kMicroCols;
      for (int64_t e = 0; e < kMicroCols; ++e) acc[c0 + e] = acc[c0 + e] + av * bk[e];
    }
  }
}

// tile_product with row r's chain over kk = begin[r] .. end[r]-1 (its allowed keys or queries)
// for the real rows r < rows; rows_pad rows as in tile_product. A row group runs the
// micro-kernel over the range all its real rows share and each real row's own head and tail
// through row_chain (before and after it, so every element's chain stays in kk order); a group
// whose real rows share no range runs them through row_chain alone. The padding rows ride along
// in the micro-kernel (their results are dropped).
void ranged_tile_product(const int64_t* begin, const int64_t* end, int64_t rows, const float* a,
                         int64_t a_panel, int64_t rows_pad, const float* b, int64_t b_panel, int64_t cols,
                         float* acc, int64_t ld_acc) {
  constexpr int64_t kGroups = kRowTile / kMicroRows;
  int64_t lo[kGroups], hi[kGroups];
  for (int64_t r0 = 0; r0 < rows_pad; r0 += kMicroRows) {
    int64_t& l = lo[r0 / kMicroRows];
    int64_t& h = hi[r0 / kMicroRows];
    l = 0;
    h = std::numeric_limits<int64_t>::max();
    for (int64_t r = r0; r < std::min(rows, r0 + kMicroRows); ++r) {
      l = std::max(l, begin[r]);
      h = std::min(h, end[r]);
    }
    if (l >= h) l = h = 0;  // no shared range: row_chain below takes each whole range
    const float* ag = a + (r0 / kMicroRows) * a_panel;
    for (int64_t r = r0; r < std::min(rows, r0 + kMicroRows); ++r) {
      row_chain(begin[r], h > l ? l : end[r], ag + r % kMicroRows, b, b_panel, cols, acc + r * ld_acc);
    }
  }
  for (int64_t c0 = 0; c0 < cols; c0 += kMicroCols) {
    for (int64_t r0 = 0; r0 < rows_pad; r0 += kMicroRows) {
      const int64_t g = r0 / kMicroRows;
      if (hi[g] <= lo[g]) continue;
      micro_kernel(hi[g] - lo[g], a + g * a_panel + lo[g] * kMicroRows,
                   b + (c0 / kMicroCols) * b_panel + lo[g] * kMicroCols, acc + r0 * ld_acc + c0, ld_acc);
    }
  }
  for (int64_t r0 = 0; r0 < rows_pad; r0 += kMicroRows) {
    const int64_t g = r0 / kMicroRows;
    if (hi[g] <= lo[g]) continue;
    for (int64_t r = r0; r < std::min(rows, r0 + kMicroRows); ++r) {
      row_chain(hi[g], end[r], a + g * a_panel + r % kMicroRows, b, b_panel, cols, acc + r * ld_acc);
    }
  }
}

// Rows of src as panels over d, for the chains over d: row c (c < n), element d (d < dim) goes
// to dst[((c / G) * dim + d) * G + c % G]; rows n .. n_pad-1 (n_pad a multiple of G) are zero.
template <int64_t G, typename T>
void load_row_panels(const T* src, int64_t stride, int64_t n, int64_t n_pad, int64_t dim, float* dst) {
  for (int64_t c = 0; c < n_pad; ++c) {
    float* out = dst + (c / G) * dim * G + c % G;
    if (c < n) {
      const T* row = src + c * stride;
      for (int64_t d = 0; d < dim; ++d) out[d * G] = static_cast<float>(row[d]);
    } else {
      for (int64_t d = 0; d < dim; ++d) out[d * G] = 0.f;
    }
  }
}

// Rows of src as B panels over the block, for the chains over keys (queries): row j (j < n),
// element d (d < dim) goes to dst[((d / kMicroCols) * kBlock + j) * kMicroCols + d % kMicroCols].
// Columns dim .. dim_pad-1 are never written (zero since the scratch was allocated); rows from n
// on are not read (the chains stop at n).
template <typename T>
void load_block_panels(const T* src, int64_t stride, int64_t n, int64_t dim, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const T* row = src + j * stride;
    for (int64_t d0 = 0; d0 < dim; d0 += kMicroCols) {
      float* out = dst + (d0 / kMicroCols) * kBlock * kMicroCols + j * kMicroCols;
      const int64_t cols = std::min(kMicroCols, dim - d0);
      for (int64_t e = 0; e < cols; ++e) out[e] = static_cast<float>(row[d0 + e]);
    }
  }
}

// Where (row r, block position j) of an A panel over the block goes (P, dS).
int64_t block_a_at(int64_t r, int64_t j) {
  return ((r / kMicroRows) * kBlock + j) * kMicroRows + r % kMicroRows;
}

// body(scratch, seq, head, first_row) for every tile of kRowTile rows (queries, or keys if
// over_keys) of every (sequence, head < heads), the tiles spread over threads; one scratch per
// thread's range.
template <typename Scratch, typename Body>
void parallel_over_tiles(const AttentionProblem& p, int64_t heads, bool over_keys, Body body) {
  std::vector<int64_t> first_task(p.num_seqs + 1, 0);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const AttentionSeq sq = attention_seq(p, s);
    first_task[s + 1] = first_task[s] + heads * ceil_div(over_keys ? sq.kv_len : sq.q_len, kRowTile);
  }
  at::parallel_for(0, first_task.back(), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(p.head_dim);
    for (int64_t t = begin; t < end; ++t) {
      // The last sequence starting at or before t (sequences without tiles share its start).
      const int64_t s = std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1;
      const AttentionSeq sq = attention_seq(p, s);
      const int64_t tiles = ceil_div(over_keys ? sq.kv_len : sq.q_len, kRowTile);
      const int64_t local = t - first_task[s];
      body(scratch, sq, local / tiles, (local % tiles) * kRowTile);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Forward
// ------------------------------------------------------------------------------------------------

struct FwdScratch {
  explicit FwdScratch(int64_t dim)
      : dim_pad(ceil_div(dim, kMicroCols) * kMicroCols),
        q(kRowTile * dim),
        k(kBlock * dim),
        v(kBlock * dim_pad),
        s(kRowTile * kBlock),
        p(kRowTile * kBlock),
        pv(kRowTile * dim_pad),
        acc(kRowTile * dim_pad),
        merged_acc(kRowTile * dim_pad) {}
  int64_t dim_pad;         // head_dim up to whole column groups
  std::vector<float> q;    // the tile's queries, row panels over d (A of S = Q K^T)
  std::vector<float> k;    // the block's keys, row panels over d (B of S)
  std::vector<float> v;    // the block's values, block panels (B of P V)
  std::vector<float> s;    // [kRowTile][kBlock] scores, then scale * scores
  std::vector<float> p;    // probabilities, A panels over the block (A of P V)
  std::vector<float> pv;   // [kRowTile][dim_pad] the block's sum_j p_j v_j
  std::vector<float> acc;  // [kRowTile][dim_pad] running acc of the current split
  std::vector<float> merged_acc;  // [kRowTile][dim_pad] the splits before it, merged
  float m[kRowTile], l[kRowTile], alpha[kRowTile], merged_m[kRowTile], merged_l[kRowTile];
  int64_t allowed[kRowTile];   // allowed keys of the row in the block: the block's first ones
  int64_t last_key[kRowTile];  // the row's last allowed key
};

// The contract's merge of split partial (m_c, l_c, acc_c) into the merged state (m, l, acc):
// each product and the sum rounded separately (-ffp-contract=off: no fma).
void merge_split(float& m, float& l, float* acc, float m_c, float l_c, const float* acc_c, int64_t dim) {
  const float m_new = std::max(m, m_c);
  const float a = m == m_new ? 1.f : std::exp(m - m_new);
  const float b = m_c == m_new ? 1.f : std::exp(m_c - m_new);
  l = l * a + l_c * b;
  for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * a + acc_c[d] * b;
  m = m_new;
}

// Split boundary split_start (> 0): each row reaching it folds its finished partial into its
// merged state and starts the new split from a fresh one.
void start_split(FwdScratch& w, int64_t rows, int64_t split_start, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    if (w.last_key[r] < split_start) continue;
    float* acc = w.acc.data() + r * w.dim_pad;
    float* merged = w.merged_acc.data() + r * w.dim_pad;
    if (split_start == kAttentionKvSplit) {  // split 0's partial starts the merged state
      w.merged_m[r] = w.m[r];
      w.merged_l[r] = w.l[r];
      std::copy(acc, acc + dim, merged);
    } else {
      merge_split(w.merged_m[r], w.merged_l[r], merged, w.m[r], w.l[r], acc, dim);
    }
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
    std::fill(acc, acc + w.dim_pad, 0.f);
  }
}

// Query tile [i0, i0 + rows) of head h: its rows (up to kRowTile), rows padded to the
// micro-kernel, and the element offsets of its first query and of its kv head's key 0.
struct QueryTile {
  int64_t rows, rows_pad, q_offset, kv_offset;
};

QueryTile query_tile(const AttentionProblem& p, const AttentionSeq& sq, int64_t h, int64_t i0) {
  const int64_t rows = std::min(kRowTile, sq.q_len - i0);
  const int64_t kv_head = h / (p.heads_q / p.heads_kv);
  return {rows, ceil_div(rows, kMicroRows) * kMicroRows, sq.q_base + h * p.q_stride_head + i0 * p.q_stride_token,
          sq.kv_base + kv_head * p.kv_stride_head};
}

template <typename T>
void fwd_tile(const AttentionProblem& p, FwdScratch& w, const AttentionSeq& sq, int64_t h, int64_t i0) {
  const int64_t dim = p.head_dim, dim_pad = w.dim_pad;
  const auto [rows, rows_pad, q_offset, kv_offset] = query_tile(p, sq, h, i0);
  const T* k = static_cast<const T*>(p.k) + kv_offset;
  const T* v = static_cast<const T*>(p.v) + kv_offset;
  load_row_panels<kMicroRows>(static_cast<const T*>(p.q) + q_offset, p.q_stride_token, rows, rows_pad, dim,
                              w.q.data());
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t r = 0; r < kRowTile; ++r) {
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
  }
  const int64_t pos0 = sq.first_pos() + i0;  // position of the tile's row 0
  for (int64_t r = 0; r < rows; ++r) w.last_key[r] = p.causal ? pos0 + r : sq.kv_len - 1;
  const int64_t key_end = p.causal ? pos0 + rows : sq.kv_len;
  for (int64_t kb0 = 0; kb0 < key_end; kb0 += kBlock) {
    if (kb0 > 0 && kb0 % kAttentionKvSplit == 0) start_split(w, rows, kb0, dim);
    const int64_t keys = std::min(kBlock, sq.kv_len - kb0);
    load_row_panels<kMicroCols>(k + kb0 * p.kv_stride_token, p.kv_stride_token, keys, kBlock, dim, w.k.data());
    load_block_panels(v + kb0 * p.kv_stride_token, p.kv_stride_token, keys, dim, w.v.data());
    std::fill(w.s.begin(), w.s.end(), 0.f);
    tile_product(dim, w.q.data(), kMicroRows * dim, rows_pad, w.k.data(), kMicroCols * dim, kBlock, w.s.data(),
                 kBlock);
    for (int64_t r = 0; r < rows; ++r) {
      // Allowed keys of the row in this block: kb0 .. kb0 + allowed - 1.
      const int64_t allowed = std::max<int64_t>(0, std::min(keys, w.last_key[r] + 1 - kb0));
      w.allowed[r] = allowed;
      if (allowed == 0) continue;
      float* x = w.s.data() + r * kBlock;
      float block_max = kNegInf;
      for (int64_t j = 0; j < allowed; ++j) {
        x[j] = p.scale * x[j];
        block_max = std::max(block_max, x[j]);
      }
      float sum = 0.f;
      const float m_new = std::max(w.m[r], block_max);
      w.alpha[r] = std::exp(w.m[r] - m_new);
      for (int64_t j = 0; j < allowed; ++j) {
        const float prob = std::exp(x[j] - m_new);
        w.p[block_a_at(r, j)] = prob;
        sum = sum + prob;
      }
      w.m[r] = m_new;
      w.l[r] = w.l[r] * w.alpha[r] + sum;
    }
    std::fill(w.pv.begin(), w.pv.end(), 0.f);
    ranged_tile_product(kFromFirstKey, w.allowed, rows, w.p.data(), kMicroRows * kBlock, rows_pad, w.v.data(),
                        kMicroCols * kBlock, dim_pad, w.pv.data(), dim_pad);
    for (int64_t r = 0; r < rows; ++r) {
      if (w.allowed[r] == 0) continue;
      float* acc = w.acc.data() + r * dim_pad;
      const float* pv = w.pv.data() + r * dim_pad;
      const float alpha = w.alpha[r];
      for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * alpha + pv[d];
    }
  }
  T* out = static_cast<T*>(p.out) + q_offset;
  float* lse = p.lse + sq.lse_base + h * p.lse_stride_head + i0;
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = w.acc.data() + r * dim_pad;
    float m = w.m[r], l = w.l[r];
    if (w.last_key[r] >= kAttentionKvSplit) {  // the last split's partial merges into the others'
      float* merged = w.merged_acc.data() + r * dim_pad;
      merge_split(w.merged_m[r], w.merged_l[r], merged, m, l, acc, dim);
      acc = merged;
      m = w.merged_m[r];
      l = w.merged_l[r];
    }
    T* row = out + r * p.q_stride_token;
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<T>(acc[d] / l);
    lse[r] = m + std::log(l);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// Operands of both gradient passes. dQ: the tile's rows are queries (a = q, b = dout), the block
// is keys (a = k, b = v). dK/dV: the tile's rows are keys (a = k, b = v), the block is queries
// (a = q, b = dout).
struct GradScratch {
  explicit GradScratch(int64_t dim)
      : dim_pad(ceil_div(dim, kMicroCols) * kMicroCols),
        row_a(kRowTile * dim),
        row_b(kRowTile * dim),
        blk_a(kBlock * dim),
        blk_b(kBlock * dim),
        blk_a_cols(kBlock * dim_pad),
        blk_b_cols(kBlock * dim_pad),
        s(kRowTile * kBlock),
        dp(kRowTile * kBlock),
        p(kRowTile * kBlock),
        ds(kRowTile * kBlock),
        acc_a(kRowTile * dim_pad),
        acc_b(kRowTile * dim_pad) {}
  int64_t dim_pad;
  std::vector<float> row_a, row_b;            // the tile's rows, row panels over d (A of S, dP)
  std::vector<float> blk_a, blk_b;            // the block's rows, row panels over d (B of S, dP)
  std::vector<float> blk_a_cols, blk_b_cols;  // the block's rows, block panels (B of the chains over the block)
  std::vector<float> s, dp;                   // [kRowTile][kBlock] dot(row a, block a), dot(row b, block b)
  std::vector<float> p, ds;                   // P and dS, A panels over the block
  std::vector<float> acc_a, acc_b;            // [kRowTile][dim_pad] dq; or dk and dv
  float lse[kBlock], delta[kBlock];
  int64_t begin[kRowTile], end[kRowTile];     // each row's allowed columns of the block
};

// delta_i = sum_d dout_i[d] * out_i[d], d in order.
template <typename T>
void delta_rows(const AttentionGradProblem& g, const AttentionSeq& sq, int64_t h, int64_t i0) {
  const AttentionProblem& p = g.fwd;
  const int64_t rows = std::min(kRowTile, sq.q_len - i0);
  const int64_t offset = sq.q_base + h * p.q_stride_head + i0 * p.q_stride_token;
  const T* out = static_cast<const T*>(p.out) + offset;
  const T* dout = static_cast<const T*>(g.dout) + offset;
  float* delta = g.delta + sq.lse_base + h * p.lse_stride_head + i0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* o = out + r * p.q_stride_token;
    const T* d_o = dout + r * p.q_stride_token;
    float sum = 0.f;
    for (int64_t d = 0; d < p.head_dim; ++d) sum = sum + static_cast<float>(d_o[d]) * static_cast<float>(o[d]);
    delta[r] = sum;
  }
}

// s = dot(row a, block a) and dp = dot(row b, block b) for the tile's rows_pad rows and the
// block's kBlock columns: chains over d from 0.
void scores(int64_t dim, int64_t rows_pad, GradScratch& w) {
  std::fill(w.s.begin(), w.s.end(), 0.f);
  std::fill(w.dp.begin(), w.dp.end(), 0.f);
  tile_product(dim, w.row_a.data(), kMicroRows * dim, rows_pad, w.blk_a.data(), kMicroCols * dim, kBlock,
               w.s.data(), kBlock);
  tile_product(dim, w.row_b.data(), kMicroRows * dim, rows_pad, w.blk_b.data(), kMicroCols * dim, kBlock,
               w.dp.data(), kBlock);
}

template <typename T>
void dq_tile(const AttentionGradProblem& g, GradScratch& w, const AttentionSeq& sq, int64_t h, int64_t i0) {
  const AttentionProblem& p = g.fwd;
  const int64_t dim = p.head_dim, dim_pad = w.dim_pad;
  const auto [rows, rows_pad, q_offset, kv_offset] = query_tile(p, sq, h, i0);
  const int64_t lse_offset = sq.lse_base + h * p.lse_stride_head + i0;
  const T* k = static_cast<const T*>(p.k) + kv_offset;
  const T* v = static_cast<const T*>(p.v) + kv_offset;
  load_row_panels<kMicroRows>(static_cast<const T*>(p.q) + q_offset, p.q_stride_token, rows, rows_pad, dim,
                              w.row_a.data());
  load_row_panels<kMicroRows>(static_cast<const T*>(g.dout) + q_offset, p.q_stride_token, rows, rows_pad, dim,
                              w.row_b.data());
  for (int64_t r = 0; r < rows; ++r) {
    w.lse[r] = p.lse[lse_offset + r];
    w.delta[r] = g.delta[lse_offset + r];
  }
  std::fill(w.acc_a.begin(), w.acc_a.end(), 0.f);
  const int64_t pos0 = sq.first_pos() + i0;
  const int64_t key_end = p.causal ? pos0 + rows : sq.kv_len;
  for (int64_t kb0 = 0; kb0 < key_end; kb0 += kBlock) {
    const int64_t keys = std::min(kBlock, sq.kv_len - kb0);
    const int64_t at = kb0 * p.kv_stride_token;
    load_row_panels<kMicroCols>(k + at, p.kv_stride_token, keys, kBlock, dim, w.blk_a.data());
    load_row_panels<kMicroCols>(v + at, p.kv_stride_token, keys, kBlock, dim, w.blk_b.data());
    load_block_panels(k + at, p.kv_stride_token, keys, dim, w.blk_a_cols.data());
    scores(dim, rows_pad, w);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t allowed = p.causal ? std::max<int64_t>(0, std::min(keys, pos0 + r + 1 - kb0)) : keys;
      w.end[r] = allowed;
      const float* s = w.s.data() + r * kBlock;
      const float* dp = w.dp.data() + r * kBlock;
      for (int64_t j = 0; j < allowed; ++j) {
        const float prob = std::exp(p.scale * s[j] - w.lse[r]);
        w.ds[block_a_at(r, j)] = prob * (dp[j] - w.delta[r]);
      }
    }
    ranged_tile_product(kFromFirstKey, w.end, rows, w.ds.data(), kMicroRows * kBlock, rows_pad,
                        w.blk_a_cols.data(), kMicroCols * kBlock, dim_pad, w.acc_a.data(), dim_pad);
  }
  T* dq = static_cast<T*>(g.dq) + q_offset;
  for (int64_t r = 0; r < rows; ++r) {
    const float* acc = w.acc_a.data() + r * dim_pad;
    T* row = dq + r * p.q_stride_token;
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<T>(p.scale * acc[d]);
  }
}

template <typename T>
void dkv_tile(const AttentionGradProblem& g, GradScratch& w, const AttentionSeq& sq, int64_t kv_head, int64_t j0) {
  const AttentionProblem& p = g.fwd;
  const int64_t dim = p.head_dim, dim_pad = w.dim_pad;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t rows = std::min(kRowTile, sq.kv_len - j0);
  const int64_t rows_pad = ceil_div(rows, kMicroRows) * kMicroRows;
  const int64_t kv_offset = sq.kv_base + kv_head * p.kv_stride_head + j0 * p.kv_stride_token;
  load_row_panels<kMicroRows>(static_cast<const T*>(p.k) + kv_offset, p.kv_stride_token, rows, rows_pad, dim,
                              w.row_a.data());
  load_row_panels<kMicroRows>(static_cast<const T*>(p.v) + kv_offset, p.kv_stride_token, rows, rows_pad, dim,
                              w.row_b.data());
  std::fill(w.acc_a.begin(), w.acc_a.end(), 0.f);
  std::fill(w.acc_b.begin(), w.acc_b.end(), 0.f);
  const int64_t pos0 = sq.first_pos();  // position of query 0
  // The first query that may attend to the tile's key 0 (earlier ones see none of its keys).
  const int64_t i_begin = p.causal ? std::max<int64_t>(0, j0 - pos0) : 0;
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const T* q = static_cast<const T*>(p.q) + sq.q_base + h * p.q_stride_head;
    const T* dout = static_cast<const T*>(g.dout) + sq.q_base + h * p.q_stride_head;
    const int64_t lse_offset = sq.lse_base + h * p.lse_stride_head;
    for (int64_t ib0 = i_begin; ib0 < sq.q_len; ib0 += kBlock) {
      const int64_t queries = std::min(kBlock, sq.q_len - ib0);
      const int64_t at = ib0 * p.q_stride_token;
      load_row_panels<kMicroCols>(q + at, p.q_stride_token, queries, kBlock, dim, w.blk_a.data());
      load_row_panels<kMicroCols>(dout + at, p.q_stride_token, queries, kBlock, dim, w.blk_b.data());
      load_block_panels(q + at, p.q_stride_token, queries, dim, w.blk_a_cols.data());
      load_block_panels(dout + at, p.q_stride_token, queries, dim, w.blk_b_cols.data());
      for (int64_t c = 0; c < queries; ++c) {
        w.lse[c] = p.lse[lse_offset + ib0 + c];
        w.delta[c] = g.delta[lse_offset + ib0 + c];
      }
      // s[r][c] = sum_d k_r[d] * q_c[d]: the same products, in the same order, as dot(q_c, k_r).
      scores(dim, rows_pad, w);
      for (int64_t r = 0; r < rows; ++r) {
        // Allowed queries of key row r in this block: the last ones, from the one at its position.
        const int64_t first = p.causal ? std::clamp<int64_t>(j0 + r - pos0 - ib0, 0, queries) : 0;
        w.begin[r] = first;
        w.end[r] = queries;
        const float* s = w.s.data() + r * kBlock;
        const float* dp = w.dp.data() + r * kBlock;
        for (int64_t c = first; c < queries; ++c) {
          const float prob = std::exp(p.scale * s[c] - w.lse[c]);
          w.p[block_a_at(r, c)] = prob;
          w.ds[block_a_at(r, c)] = prob * (dp[c] - w.delta[c]);
        }
      }
      ranged_tile_product(w.begin, w.end, rows, w.ds.data(), kMicroRows * kBlock, rows_pad, w.blk_a_cols.data(),
                          kMicroCols * kBlock, dim_pad, w.acc_a.data(), dim_pad);
      ranged_tile_product(w.begin, w.end, rows, w.p.data(), kMicroRows * kBlock, rows_pad, w.blk_b_cols.data(),
                          kMicroCols * kBlock, dim_pad, w.acc_b.data(), dim_pad);
    }
  }
  T* dk = static_cast<T*>(g.dk) + kv_offset;
  T* dv = static_cast<T*>(g.dv) + kv_offset;
  for (int64_t r = 0; r < rows; ++r) {
    const float* acc_k = w.acc_a.data() + r * dim_pad;
    const float* acc_v = w.acc_b.data() + r * dim_pad;
    T* row_k = dk + r * p.kv_stride_token;
    T* row_v = dv + r * p.kv_stride_token;
    for (int64_t d = 0; d < dim; ++d) {
      row_k[d] = static_cast<T>(p.scale * acc_k[d]);
      row_v[d] = static_cast<T>(acc_v[d]);
    }
  }
}

// No scratch (the delta pass reads and writes rows directly).
struct NoScratch {
  explicit NoScratch(int64_t) {}
};

void check_problem(const char* op, const AttentionProblem& p) {
  TORCH_CHECK_VALUE(p.head_dim >= 1 && p.heads_q >= 1 && p.heads_kv >= 1 && p.heads_q % p.heads_kv == 0,
                    "rl_align::", op, ": bad attention problem (heads_q ", p.heads_q, ", heads_kv ",
                    p.heads_kv, ", head_dim ", p.head_dim, ")");
  TORCH_CHECK_VALUE(p.seqs != nullptr && p.q != nullptr && p.k != nullptr && p.v != nullptr &&
                        p.out != nullptr && p.lse != nullptr,
                    "rl_align::", op, ": null operand");
}

}  // namespace

void attention_fwd_cpu(at::ScalarType dtype, const AttentionProblem& p) {
  if (p.num_seqs <= 0) return;
  check_problem("attention", p);
  dispatch_cpu_dtype("attention", dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_over_tiles<FwdScratch>(p, p.heads_q, false,
                                    [&](FwdScratch& w, const AttentionSeq& sq, int64_t h, int64_t i0) {
                                      fwd_tile<T>(p, w, sq, h, i0);
                                    });
  });
}

void attention_bwd_cpu(at::ScalarType dtype, const AttentionGradProblem& g) {
  const AttentionProblem& p = g.fwd;
  if (p.num_seqs <= 0) return;
  check_problem("attention_backward", p);
  TORCH_CHECK_VALUE(g.dout != nullptr && g.dq != nullptr && g.dk != nullptr && g.dv != nullptr &&
                        g.delta != nullptr,
                    "rl_align::attention_backward: null operand");
  dispatch_cpu_dtype("attention_backward", dtype, [&](auto tag) {
    using T = decltype(tag);
    // Three passes, each complete before the next: delta, then dQ, then dK/dV (which read delta).
    parallel_over_tiles<NoScratch>(p, p.heads_q, false,
                                   [&](NoScratch&, const AttentionSeq& sq, int64_t h, int64_t i0) {
                                     delta_rows<T>(g, sq, h, i0);
                                   });
    parallel_over_tiles<GradScratch>(p, p.heads_q, false,
                                     [&](GradScratch& w, const AttentionSeq& sq, int64_t h, int64_t i0) {
                                       dq_tile<T>(g, w, sq, h, i0);
                                     });
    parallel_over_tiles<GradScratch>(p, p.heads_kv, true,
                                     [&](GradScratch& w, const AttentionSeq& sq, int64_t g_head, int64_t j0) {
                                       dkv_tile<T>(g, w, sq, g_head, j0);
                                     });
  });
}

}  // namespace rl_align
