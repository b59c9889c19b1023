// rank_sum GPU kernel (CUDA; HIP compiles the same source).
//
// Elementwise over the parts: a thread takes one 16-byte group of VEC elements, loads the group
// of every part (all W loads in flight before the fold) and folds each element over the parts in
// rank order with RankSumTree (common/rank_sum.h), so an element's bits depend only on its own
// W inputs and W. VECTOR_IO (every part and out 16-byte aligned) moves a group with one 16-byte
// access per operand; otherwise, and for the last partial group, element by element: the fold is
// the same either way (tests: misaligned parts give the aligned bits). Grid-stride over groups.
#include "rank_sum_kernels.h"

#include "../primitives/pack.h"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kBlocksPerMultiprocessor = 8;
// Parts loaded before folding: a thread keeps kLoadBatch 16-byte groups in registers at a time.
constexpr int kLoadBatch = 8;

#if RL_ALIGN_HIP
#define RL_ALIGN_GRID_CONSTANT
#else
// The operands (64 part pointers) stay in the parameter space, indexed by the part number, with
// no per-thread copy.
#define RL_ALIGN_GRID_CONSTANT __grid_constant__
#endif

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads)
    rank_sum_kernel(const RL_ALIGN_GRID_CONSTANT RankSumOperands a) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t groups = (a.numel + VEC - 1) / VEC;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    const int64_t first = g * VEC;
    const bool whole = VECTOR_IO && first + VEC <= a.numel;
    RankSumTree tree[VEC];
    for (int r0 = 0; r0 < a.parts; r0 += kLoadBatch) {
      Pack<T, VEC> p[kLoadBatch];
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        if (r0 + b < a.parts) {
          const T* part = static_cast<const T*>(a.part[r0 + b]) + first;
          if (whole) {
            *reinterpret_cast<uint4*>(&p[b]) = *reinterpret_cast<const uint4*>(part);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) p[b].v[j] = first + j < a.numel ? part[j] : Convert<T>::from_float(0.f);
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        if (r0 + b < a.parts) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) tree[j].add(r0 + b, Convert<T>::to_float(p[b].v[j]));
        }
      }
    }
    Pack<T, VEC> y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = Convert<T>::from_float(tree[j].result(a.parts, a.divisor));
    T* out = static_cast<T*>(a.out) + first;
    if (whole) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(&y);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (first + j < a.numel) out[j] = y.v[j];
      }
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool vector_io_ok(const RankSumOperands& a) {
  if (!aligned16(a.out)) return false;
  for (int r = 0; r < a.parts; ++r) {
    if (!aligned16(a.part[r])) return false;
  }
  return true;
}

}  // namespace

gpuError_t rank_sum_simt(DType dtype, const RankSumOperands& a, gpuStream_t stream) {
  if (a.numel == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t groups = ceil_div(a.numel, static_cast<int64_t>(16 / sizeof(T)));
    const int64_t cap = static_cast<int64_t>(multiprocessor_count(current_device())) * kBlocksPerMultiprocessor;
    const int64_t blocks = ceil_div(groups, static_cast<int64_t>(kBlockThreads));
    const auto kernel = vector_io_ok(a) ? rank_sum_kernel<T, true> : rank_sum_kernel<T, false>;
    kernel<<<static_cast<unsigned>(blocks < cap ? blocks : cap), kBlockThreads, 0, stream>>>(a);
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace rl_align
