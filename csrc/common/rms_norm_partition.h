// How rms_norm splits its work. Pure C++ (no CUDA, no torch): the CPU kernels, the GPU launchers
// and the documentation all read the same numbers.
//
// Invariance rule (docs/design.md, "Kernel rules"): every value here is a function of the hidden
// size and the element size only, never of the number of rows.
#pragma once

#include <cstdint>

namespace rl_align {

// dweight is a sum over rows. Rows are cut into tiles of this many rows, counted from the first
// row of the call; each tile is summed in a fixed order and the tile sums are added to one fp32
// accumulator in row order. Micro-batches whose row counts are multiples of this tile therefore
// chain bit for bit (docs/design.md, "rms_norm"). Small rows get larger tiles so that the
// sequential cross-tile pass stays short; the value depends on the hidden size alone.
constexpr int64_t kRmsNormTileElements = 131072;
constexpr int64_t kRmsNormMinTileRows = 32;

inline int64_t rms_norm_dweight_tile_rows(int64_t hidden) {
  int64_t rows = kRmsNormMinTileRows;
  while (hidden > 0 && rows * 2 * hidden <= kRmsNormTileElements) rows *= 2;
  return rows;
}

// GPU partition of one row: each row is owned by `threads_per_row` threads; thread t owns the
// 16-byte vectors t, t + threads_per_row, ... (`vecs_per_thread` of them), so its fp32 partial
// sums run over a fixed set of elements in a fixed order whatever the row count.
struct RmsNormGpuPartition {
  int vec;               // elements per 16-byte vector
  int vecs_per_thread;   // 1, 2, 4 or 8 (a template parameter of the kernels)
  int threads_per_row;   // power of two, 1..1024
  int block_threads;     // forward: threads per block (several rows when threads_per_row is small)
  int bwd_block_threads;  // backward: at least two row groups per block where registers allow
  int rows_per_block() const { return block_threads / threads_per_row; }
  int bwd_row_groups() const { return bwd_block_threads / threads_per_row; }
};

constexpr int kRmsNormMaxThreadsPerRow = 1024;
constexpr int kRmsNormMaxVecsPerThread = 8;
constexpr int kRmsNormMinBlockThreads = 256;

inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

// Largest hidden size the register-resident GPU kernels cover for an element size.
inline int64_t rms_norm_gpu_max_hidden(int elem_size) {
  return int64_t{kRmsNormMaxThreadsPerRow} * kRmsNormMaxVecsPerThread * (16 / elem_size);
}

inline RmsNormGpuPartition rms_norm_gpu_partition(int64_t hidden, int elem_size) {
  RmsNormGpuPartition p{};
  p.vec = 16 / elem_size;
  const int64_t vecs = (hidden + p.vec - 1) / p.vec;
  // Up to 256 threads with one vector each; past that, more vectors per thread before more
  // threads (fewer block-wide reductions per row).
  if (vecs <= 256) {
    p.vecs_per_thread = 1;
  } else if (vecs <= 512) {
    p.vecs_per_thread = 2;
  } else if (vecs <= 1024) {
    p.vecs_per_thread = 4;
  } else {
    p.vecs_per_thread = 8;
  }
  p.threads_per_row = next_pow2((vecs + p.vecs_per_thread - 1) / p.vecs_per_thread);
  p.block_threads =
      p.threads_per_row < kRmsNormMinBlockThreads ? kRmsNormMinBlockThreads : p.threads_per_row;
  // The backward walks each row tile sequentially; two row groups per block halve that chain.
  // Rows of up to two vectors per thread fit twice in the register file (<= 128 registers).
  p.bwd_block_threads = p.block_threads == p.threads_per_row && p.vecs_per_thread <= 2
                            ? 2 * p.threads_per_row
                            : p.block_threads;
  return p;
}

}  // namespace rl_align
