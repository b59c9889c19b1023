// Embedding forward and backward GPU kernels (CUDA; HIP compiles the same source).
//
// Forward: each token's row is copied (16-byte units where the rows allow, else element by
// element): the output is the weight row itself, whatever the batch.
// Backward: from a stable sort of the ids (the launcher's), a small kernel finds every row's
// segment of sorted tokens (a binary search per row, no host sync); the main kernel then writes
// every row of dweight once, one thread per 8 columns: the accumulator starts at dweight_accum (or
// 0) and adds the row's tokens' gradients one by one in token order. The partition never touches
// the chain (each element is one thread's sequential sum), so nothing in the batch, the split into
// micro-batches or the vector/element path changes any bit; no atomics.
#include "embedding_kernels.h"

#include <cstdint>
#include <type_traits>

#include "../primitives/pack.h"
#include "device_assert.cuh"

namespace rl_align {
namespace {

// An int32 or int64 id array read as int64 (a uniform branch per load).
struct Ids {
  const void* p;
  bool is64;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(p)[i]
                : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
  }
};

__device__ __forceinline__ void fail_bad_id(const char* op, int64_t id, int64_t num_embeddings) {
  fail_index_out_of_range(op, "id", id, "", num_embeddings, " embeddings");
}

// ---- forward ---------------------------------------------------------------------------------

constexpr int kFwdThreads = 128;
constexpr int kFwdUnitsPerThread = 4;

// blockIdx.x: the token; blockIdx.y: a chunk of kFwdThreads * kFwdUnitsPerThread copy units of its
// row, all loads issued before the stores. Unit: uint4 (16 bytes) or one element.
template <typename Unit>
__global__ void __launch_bounds__(kFwdThreads)
    embedding_fwd_kernel(Ids ids, const Unit* __restrict__ weight, int64_t weight_row_units,
                         int64_t num_embeddings, Unit* __restrict__ out, int64_t row_units) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  if (id < 0 || id >= num_embeddings) {
    if (blockIdx.y == 0 && threadIdx.x == 0) fail_bad_id("embedding", id, num_embeddings);
    return;
  }
  const Unit* src = weight + id * weight_row_units;
  Unit* dst = out + t * row_units;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kFwdThreads * kFwdUnitsPerThread + threadIdx.x;
  Unit buf[kFwdUnitsPerThread];
#pragma unroll
  for (int k = 0; k < kFwdUnitsPerThread; ++k) {
    const int64_t i = first + k * kFwdThreads;
    if (i < row_units) buf[k] = src[i];
  }
#pragma unroll
  for (int k = 0; k < kFwdUnitsPerThread; ++k) {
    const int64_t i = first + k * kFwdThreads;
    if (i < row_units) dst[i] = buf[k];
  }
}

// ---- backward --------------------------------------------------------------------------------

constexpr int kBwdThreads = 256;
constexpr int kBwdCols = 8;          // columns per thread: one 16-byte bf16/fp16 load
constexpr int kBwdRowIters = 4;      // rows per row group and block
constexpr int kBwdTokenUnroll = 4;   // tokens whose loads are in flight together
constexpr int kBwdMinBlocks = 4;     // per SM (<= 64 registers): 32 warps keep stores and loads flowing

template <typename T>
using Cols = Pack<T, kBwdCols>;

// Columns col .. col + kBwdCols - 1 of a row: one vector access with VECTOR_IO (row 16-byte
// aligned, hidden a multiple of kBwdCols), else element by element (missing columns read as 0 and
// never stored). Same values in the same slots either way.
template <typename T, bool VECTOR_IO>
__device__ __forceinline__ Cols<T> load_cols(const T* row, int64_t col, int64_t hidden) {
  if constexpr (VECTOR_IO) {
    return *reinterpret_cast<const Cols<T>*>(row + col);
  } else {
    Cols<T> c;
#pragma unroll
    for (int j = 0; j < kBwdCols; ++j) c.v[j] = col + j < hidden ? row[col + j] : Convert<T>::from_float(0.f);
    return c;
  }
}

template <bool VECTOR_IO>
__device__ __forceinline__ void store_cols(float* row, int64_t col, int64_t hidden, const Cols<float>& c) {
  if constexpr (VECTOR_IO) {
    *reinterpret_cast<Cols<float>*>(row + col) = c;
  } else {
#pragma unroll
    for (int j = 0; j < kBwdCols; ++j) {
      if (col + j < hidden) row[col + j] = c.v[j];
    }
  }
}

// starts[v] = the first sorted position with id >= v, for v = 0 .. num_embeddings: row v's tokens
// are order[starts[v] .. starts[v + 1]). Out-of-range ids sort before starts[0] or from
// starts[num_embeddings] on, so no row ever reaches them; thread 0 reports them.
__global__ void embedding_segment_starts_kernel(Ids sorted, int64_t tokens, int64_t num_embeddings,
                                                int64_t* __restrict__ starts) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v > num_embeddings) return;
  if (v == 0 && tokens > 0) {
    const int64_t smallest = sorted[0], largest = sorted[tokens - 1];
    if (smallest < 0) fail_bad_id("embedding_grad_weight", smallest, num_embeddings);
    if (largest >= num_embeddings) fail_bad_id("embedding_grad_weight", largest, num_embeddings);
  }
  int64_t lo = 0, hi = tokens;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  starts[v] = lo;
}

// Row groups of threads_per_row threads, each thread kBwdCols columns (blockIdx.y picks the column
// chunk); a group takes kBwdRowIters rows, one after the other. Each thread writes its columns of
// each row exactly once: accum (or 0), plus the row's tokens in token order.
template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBwdThreads, kBwdMinBlocks)
    embedding_bwd_kernel(const T* __restrict__ grad_out, int64_t grad_out_row_stride,
                         const int64_t* __restrict__ order, const int64_t* __restrict__ starts,
                         int64_t padding_idx, const float* __restrict__ accum,
                         float* __restrict__ dweight, int64_t num_embeddings, int64_t hidden,
                         int threads_per_row) {
  const int rows_per_pass = kBwdThreads / threads_per_row;
  const int64_t col =
      (static_cast<int64_t>(blockIdx.y) * threads_per_row + threadIdx.x % threads_per_row) * kBwdCols;
  if (col >= hidden) return;
  const int64_t first_row =
      static_cast<int64_t>(blockIdx.x) * rows_per_pass * kBwdRowIters + threadIdx.x / threads_per_row;
  for (int r = 0; r < kBwdRowIters; ++r) {
    const int64_t v = first_row + static_cast<int64_t>(r) * rows_per_pass;
    if (v >= num_embeddings) return;
    Cols<float> acc;
    if (accum != nullptr) {
      acc = load_cols<float, VECTOR_IO>(accum + v * hidden, col, hidden);
    } else {
#pragma unroll
      for (int j = 0; j < kBwdCols; ++j) acc.v[j] = 0.f;
    }
    int64_t t = starts[v];
    const int64_t end = v == padding_idx ? t : starts[v + 1];
    for (; t < end; t += kBwdTokenUnroll) {
      Cols<T> g[kBwdTokenUnroll];
#pragma unroll
      for (int u = 0; u < kBwdTokenUnroll; ++u) {
        if (t + u < end) g[u] = load_cols<T, VECTOR_IO>(grad_out + order[t + u] * grad_out_row_stride, col, hidden);
      }
#pragma unroll
      for (int u = 0; u < kBwdTokenUnroll; ++u) {
        if (t + u < end) {
#pragma unroll
          for (int j = 0; j < kBwdCols; ++j) acc.v[j] += Convert<T>::to_float(g[u].v[j]);
        }
      }
    }
    store_cols<VECTOR_IO>(dweight + v * hidden, col, hidden, acc);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

gpuError_t embedding_fwd_simt(DType dtype, const void* ids, bool ids_int64, int64_t tokens,
                              const void* weight, int64_t weight_row_stride,
                              int64_t num_embeddings, void* out, int64_t hidden,
                              gpuStream_t stream) {
  if (tokens > INT32_MAX) return RL_GPU(ErrorInvalidValue);  // one block per token (grid.x)
  const int64_t element = dtype == DType::kFloat32 ? 4 : 2;
  const bool vector_io = aligned16(weight) && aligned16(out) && hidden * element % 16 == 0 &&
                         weight_row_stride * element % 16 == 0;
  auto launch = [&](auto unit) {
    using Unit = decltype(unit);
    constexpr int64_t per_unit = sizeof(Unit);
    const int64_t row_units = hidden * element / per_unit;
    const dim3 grid(static_cast<unsigned>(tokens),
                    static_cast<unsigned>(ceil_div(row_units, kFwdThreads * kFwdUnitsPerThread)));
    embedding_fwd_kernel<Unit><<<grid, kFwdThreads, 0, stream>>>(
        Ids{ids, ids_int64}, static_cast<const Unit*>(weight), weight_row_stride * element / per_unit,
        num_embeddings, static_cast<Unit*>(out), row_units);
    return gpu_last_error();
  };
  if (vector_io) return launch(uint4{});
  return element == 4 ? launch(uint32_t{}) : launch(uint16_t{});
}

gpuError_t embedding_bwd_simt(DType dtype, const void* grad_out, int64_t grad_out_row_stride,
                              const void* sorted_ids, bool ids_int64, const int64_t* order,
                              int64_t tokens, int64_t padding_idx, const float* dweight_accum,
                              float* dweight, int64_t* workspace, int64_t num_embeddings,
                              int64_t hidden, gpuStream_t stream) {
  constexpr int kStartsThreads = 256;
  embedding_segment_starts_kernel<<<static_cast<unsigned>(ceil_div(num_embeddings + 1, kStartsThreads)),
                                    kStartsThreads, 0, stream>>>(Ids{sorted_ids, ids_int64}, tokens,
                                                                 num_embeddings, workspace);
  const gpuError_t err = gpu_last_error();
  if (err != kGpuSuccess) return err;
  const int64_t col_vectors = ceil_div(hidden, kBwdCols);
  int threads_per_row = 1;
  while (threads_per_row < col_vectors && threads_per_row < kWarpSize) threads_per_row *= 2;
  const int64_t rows_per_block = kBwdThreads / threads_per_row * kBwdRowIters;
  const dim3 grid(static_cast<unsigned>(ceil_div(num_embeddings, rows_per_block)),
                  static_cast<unsigned>(ceil_div(col_vectors, threads_per_row)));
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) -> gpuError_t {
    using T = decltype(tag);
    const bool vector_io = hidden % kBwdCols == 0 && aligned16(grad_out) &&
                           grad_out_row_stride * static_cast<int64_t>(sizeof(T)) % 16 == 0 &&
                           (dweight_accum == nullptr || aligned16(dweight_accum)) && aligned16(dweight);
    auto launch = [&](auto vector_tag) {
      embedding_bwd_kernel<T, decltype(vector_tag)::value><<<grid, kBwdThreads, 0, stream>>>(
          static_cast<const T*>(grad_out), grad_out_row_stride, order, workspace, padding_idx,
          dweight_accum, dweight, num_embeddings, hidden, threads_per_row);
      return gpu_last_error();
    };
    return vector_io ? launch(std::true_type{}) : launch(std::false_type{});
  }, gpu_not_supported);
}

}  // namespace rl_align
