// The elementwise row kernels' 16-byte groups (silu_and_mul, moe_combine): a thread takes one
// group of VEC = 16 / sizeof(T) columns of a row. VECTOR_IO (the row base 16-byte aligned, the
// row length a multiple of VEC) moves a group with one 16-byte load or store; otherwise element by
// element, bounds-checked, into the same Pack slots, so the arithmetic after a load never depends
// on the path.
//
// Coverage: a block of BLOCK_THREADS threads holds rows_per_block = BLOCK_THREADS /
// threads_per_row rows of threads_per_row threads (a power of two covering the row's groups, at
// most the block), blockIdx.x picks the row's group range and blockIdx.y the rows, grid-striding
// over rows past the y-limit. No shared memory, no synchronisation.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/portability.h"
#include "pack.h"

namespace rl_align {

// How a launch covers [rows, groups_per_row].
struct RowGroupCoverage {
  int threads_per_row;
  dim3 grid;
};

template <int BLOCK_THREADS>
RowGroupCoverage row_group_coverage(int64_t rows, int64_t groups_per_row) {
  constexpr int64_t kMaxGridY = 65535;
  int tpr = 1;
  while (tpr < groups_per_row && tpr < BLOCK_THREADS) tpr *= 2;
  const int rpb = BLOCK_THREADS / tpr;
  const int64_t grid_x = ceil_div(groups_per_row, tpr);
  const int64_t grid_y = ceil_div(rows, rpb);
  return {tpr, dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y < kMaxGridY ? grid_y : kMaxGridY))};
}

// VECTOR_IO's condition on one operand: its base and every row 16-byte aligned.
template <typename T>
bool rows_aligned16(const void* p, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

#if defined(__CUDACC__) || defined(__HIPCC__)

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ Pack<T, VEC> load_group(const T* __restrict__ row, int64_t col, int64_t cols) {
  Pack<T, VEC> p;
  if constexpr (VECTOR_IO) {
    *reinterpret_cast<uint4*>(&p) = __ldg(reinterpret_cast<const uint4*>(row + col));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) p.v[j] = col + j < cols ? row[col + j] : Convert<T>::from_float(0.f);
  }
  return p;
}

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void store_group(T* __restrict__ row, int64_t col, int64_t cols, const Pack<T, VEC>& p) {
  if constexpr (VECTOR_IO) {
    uint4 raw;
    *reinterpret_cast<Pack<T, VEC>*>(&raw) = p;
#if RL_ALIGN_HIP
    *reinterpret_cast<uint4*>(row + col) = raw;
#else
    // nvcc splits a plain 16-byte store of the group into 2- and 4-byte stores (seen in the PTX);
    // the instruction itself keeps it one 16-byte store.
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(row + col), "r"(raw.x), "r"(raw.y), "r"(raw.z),
                 "r"(raw.w)
                 : "memory");
#endif
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (col + j < cols) row[col + j] = p.v[j];
    }
  }
}

// Calls body(row, col) for every (row, first column of a group) this thread owns, in row order; a
// body returning bool stops the thread at the first false.
template <int VEC, typename Body>
__device__ __forceinline__ void for_each_group(int64_t rows, int64_t cols, int threads_per_row, Body&& body) {
  const int rows_per_block = blockDim.x / threads_per_row;
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * threads_per_row + threadIdx.x % threads_per_row) * VEC;
  if (col >= cols) return;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * rows_per_block;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * rows_per_block + threadIdx.x / threads_per_row; row < rows;
       row += row_step) {
    if constexpr (std::is_same_v<decltype(body(row, col)), bool>) {
      if (!body(row, col)) return;
    } else {
      body(row, col);
    }
  }
}

#endif  // __CUDACC__ || __HIPCC__

}  // namespace rl_align
