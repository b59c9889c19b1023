// rank_sum GPU kernel (CUDA; HIP compiles the same source).
//
// Elementwise over the parts: a thread takes one 16-byte group of VEC elements, loads the group
// of every part (all W loads in flight before the fold) and folds each element over the parts in
// rank order with RankSumTree (common/rank_sum.h), so an element's bits depend only on its own
// W inputs and W. VECTOR_IO (every part and out 16-byte aligned) moves a group with one 16-byte
// access per operand; otherwise, and for the last partial group, element by element: the fold is
// the same either way (tests: misaligned parts give the aligned bits). Grid-stride over groups.
#include "rank_sum_kernels.h"

#include <algorithm>
#include <cstdio>

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

// The fold of one 16-byte group (elements first .. first + VEC - 1, those below `end`) over the
// parts: part(r) is part r's group start. All W loads of a batch are issued before they are folded.
template <typename T, int VEC, bool VECTOR_IO, typename PartPtr>
__device__ __forceinline__ Pack<T, VEC> fold_group(int parts, PartPtr part, int64_t first, int64_t end,
                                                   float divisor) {
  const bool whole = VECTOR_IO && first + VEC <= end;
  RankSumTree tree[VEC];
  for (int r0 = 0; r0 < parts; r0 += kLoadBatch) {
    Pack<T, VEC> p[kLoadBatch];
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      if (r0 + b < parts) {
        const T* src = part(r0 + b);
        if (whole) {
          *reinterpret_cast<uint4*>(&p[b]) = *reinterpret_cast<const uint4*>(src);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) p[b].v[j] = first + j < end ? src[j] : Convert<T>::from_float(0.f);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      if (r0 + b < parts) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) tree[j].add(r0 + b, Convert<T>::to_float(p[b].v[j]));
      }
    }
  }
  Pack<T, VEC> y;
#pragma unroll
  for (int j = 0; j < VEC; ++j) y.v[j] = Convert<T>::from_float(tree[j].result(parts, divisor));
  return y;
}

// Stores (or copies) one group, those of its elements below `end`.
template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void store_group(T* dst, const Pack<T, VEC>& y, int64_t first, int64_t end) {
  if (VECTOR_IO && first + VEC <= end) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&y);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (first + j < end) dst[j] = y.v[j];
    }
  }
}

template <typename T, int VEC, bool VECTOR_IO>
__device__ __forceinline__ void copy_group(T* dst, const T* src, int64_t first, int64_t end) {
  Pack<T, VEC> y;
  if (VECTOR_IO && first + VEC <= end) {
    *reinterpret_cast<uint4*>(&y) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) y.v[j] = first + j < end ? src[j] : Convert<T>::from_float(0.f);
  }
  store_group<T, VEC, VECTOR_IO>(dst, y, first, end);
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads)
    rank_sum_kernel(const RL_ALIGN_GRID_CONSTANT RankSumOperands a) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t groups = (a.numel + VEC - 1) / VEC;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += step) {
    const int64_t first = g * VEC;
    const Pack<T, VEC> y = fold_group<T, VEC, VECTOR_IO>(
        a.parts, [&](int r) { return static_cast<const T*>(a.part[r]) + first; }, first, a.numel, a.divisor);
    store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.out) + first, y, first, a.numel);
  }
}

// ---- the symmetric-memory kernels (common/rank_sum.h, PeerSumOperands) -------------------------

// About 30 s at the H100's clock: a rank that never arrives (its process died) ends the kernel
// with a message and a trap instead of a hang.
constexpr long long kSpinTimeoutCycles = 1LL << 36;

__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
#if RL_ALIGN_HIP
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
#if RL_ALIGN_HIP
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

// Block b's barrier with block b of every rank: this block's earlier writes (its copy into its
// own buffer) are made visible to the system, then each of the first `parts` threads tells one
// rank this block has arrived at `epoch` and waits until that rank's block b has arrived too.
__device__ __forceinline__ void block_barrier(const PeerSumOperands& a) {
  __threadfence_system();
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < a.parts) {
    store_release_sys(a.flags[peer] + blockIdx.x * kRankSumMaxParts + a.rank, a.epoch);
    const unsigned int* mine = a.flags[a.rank] + blockIdx.x * kRankSumMaxParts + peer;
    const long long start = clock64();
    while (static_cast<int>(load_acquire_sys(mine) - a.epoch) < 0) {
      if (clock64() - start > kSpinTimeoutCycles) {
        printf("rl_align::peer collective: rank %d block %d waited too long for rank %d (epoch %u)\n", a.rank,
               static_cast<int>(blockIdx.x), peer, a.epoch);
#if RL_ALIGN_HIP
        abort();
#else
        __trap();
#endif
      }
    }
  }
  __syncthreads();
}

// Calls body(first, end) for this block's groups of segment s: elements [first, first + VEC) of
// the message below end (the range's end, clipped to the message).
template <int VEC, typename Body>
__device__ __forceinline__ void for_block_groups(const PeerSumOperands& a, int64_t chunk, int s, Body&& body) {
  const int64_t base = static_cast<int64_t>(s) * a.segment;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  int64_t end = base + (lo + chunk < a.segment ? lo + chunk : a.segment);
  if (end > a.numel) end = a.numel;
  for (int64_t first = base + lo + static_cast<int64_t>(threadIdx.x) * VEC; first < end;
       first += static_cast<int64_t>(blockDim.x) * VEC) {
    body(first, end);
  }
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads)
    peer_rank_sum_kernel(const RL_ALIGN_GRID_CONSTANT PeerSumOperands a, int64_t chunk) {
  constexpr int VEC = 16 / sizeof(T);
  T* mine = static_cast<T*>(a.buffer[a.rank]);
  const T* in = static_cast<const T*>(a.input);
  for (int s = 0; s < a.segments; ++s) {
    for_block_groups<VEC>(a, chunk, s, [&](int64_t first, int64_t end) {
      copy_group<T, VEC, VECTOR_IO>(mine + first, in + first, first, end);
    });
  }
  block_barrier(a);
  const int64_t base = static_cast<int64_t>(a.segment_index) * a.segment;
  for_block_groups<VEC>(a, chunk, a.segment_index, [&](int64_t first, int64_t end) {
    const Pack<T, VEC> y = fold_group<T, VEC, VECTOR_IO>(
        a.parts, [&](int r) { return static_cast<const T*>(a.buffer[r]) + first; }, first, end, a.divisor);
    store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.out) + (first - base), y, first, end);
  });
}

template <typename T, bool VECTOR_IO>
__global__ void __launch_bounds__(kBlockThreads)
    peer_gather_kernel(const RL_ALIGN_GRID_CONSTANT PeerSumOperands a, int64_t chunk) {
  constexpr int VEC = 16 / sizeof(T);
  block_barrier(a);
  for (int s = 0; s < a.segments; ++s) {
    const T* src = static_cast<const T*>(a.buffer[s]);
    for_block_groups<VEC>(a, chunk, s, [&](int64_t first, int64_t end) {
      copy_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.out) + first, src + first, first, end);
    });
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

bool peer_vector_io_ok(const PeerSumOperands& a, int elem) {
  if (!aligned16(a.input) || !aligned16(a.out) || (a.segment * elem) % 16 != 0) return false;
  for (int r = 0; r < a.parts; ++r) {
    if (!aligned16(a.buffer[r])) return false;
  }
  return true;
}

template <bool GATHER>
gpuError_t peer_launch(DType dtype, const PeerSumOperands& a, gpuStream_t stream) {
  if (a.numel == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const PeerBlocks pb = peer_blocks(a.segment, static_cast<int>(sizeof(T)));
    const bool vec = peer_vector_io_ok(a, static_cast<int>(sizeof(T)));
    if constexpr (GATHER) {
      const auto kernel = vec ? peer_gather_kernel<T, true> : peer_gather_kernel<T, false>;
      kernel<<<pb.blocks, kBlockThreads, 0, stream>>>(a, pb.chunk);
    } else {
      const auto kernel = vec ? peer_rank_sum_kernel<T, true> : peer_rank_sum_kernel<T, false>;
      kernel<<<pb.blocks, kBlockThreads, 0, stream>>>(a, pb.chunk);
    }
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace

PeerBlocks peer_blocks(int64_t segment, int elem) {
  // One group per thread at least: blocks only where there is work for them. A function of the
  // segment and the dtype only, so every rank splits alike.
  const int64_t vec = 16 / elem;
  const int64_t blocks = std::min<int64_t>(kPeerMaxBlocks, std::max<int64_t>(1, ceil_div(segment, vec * kBlockThreads)));
  const int64_t chunk = std::max(vec, ceil_div(ceil_div(segment, blocks), vec) * vec);
  return {static_cast<int>(std::max<int64_t>(1, ceil_div(segment, chunk))), chunk};
}

gpuError_t peer_rank_sum_simt(DType dtype, const PeerSumOperands& a, gpuStream_t stream) {
  return peer_launch<false>(dtype, a, stream);
}

gpuError_t peer_gather_simt(DType dtype, const PeerSumOperands& a, gpuStream_t stream) {
  return peer_launch<true>(dtype, a, stream);
}

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
