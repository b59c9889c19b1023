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

// One 16-byte group (elements first .. first + VEC - 1, those below `end`) of src. BYPASS_L1:
// memory other GPUs wrote (symmetric memory), read through L2 only, never a stale L1 line.
template <typename T, int VEC, bool VECTOR_IO, bool BYPASS_L1 = false>
__device__ __forceinline__ Pack<T, VEC> load_group(const T* src, int64_t first, int64_t end) {
  Pack<T, VEC> p;
  if (VECTOR_IO && first + VEC <= end) {
#if !RL_ALIGN_HIP
    if constexpr (BYPASS_L1) {
      *reinterpret_cast<uint4*>(&p) = __ldcg(reinterpret_cast<const uint4*>(src));
      return p;
    }
#endif
    *reinterpret_cast<uint4*>(&p) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
#if !RL_ALIGN_HIP
      if constexpr (BYPASS_L1) {
        p.v[j] = first + j < end ? __ldcg(src + j) : Convert<T>::from_float(0.f);
        continue;
      }
#endif
      p.v[j] = first + j < end ? src[j] : Convert<T>::from_float(0.f);
    }
  }
  return p;
}

// The fold of one group over the parts: part(r) is part r's group start. All loads of a batch of
// parts are issued before they are folded.
template <typename T, int VEC, bool VECTOR_IO, bool BYPASS_L1 = false, typename PartPtr>
__device__ __forceinline__ Pack<T, VEC> fold_group(int parts, PartPtr part, int64_t first, int64_t end,
                                                   float divisor) {
  RankSumTree tree[VEC];
  for (int r0 = 0; r0 < parts; r0 += kLoadBatch) {
    Pack<T, VEC> p[kLoadBatch];
#pragma unroll
    for (int b = 0; b < kLoadBatch; ++b) {
      if (r0 + b < parts) p[b] = load_group<T, VEC, VECTOR_IO, BYPASS_L1>(part(r0 + b), first, end);
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

// Block b's barrier with block b of every rank at `epoch`: this block's earlier stores (into other
// ranks' memory too) are made visible to the system, then each of the first `parts` threads tells
// one rank that this block has arrived and waits until that rank's block b has arrived too.
__device__ __forceinline__ void block_barrier(const PeerSumOperands& a, unsigned int epoch) {
  __threadfence_system();
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < a.parts) {
    store_release_sys(a.flags[peer] + blockIdx.x * kRankSumMaxParts + a.rank, epoch);
    const unsigned int* mine = a.flags[a.rank] + blockIdx.x * kRankSumMaxParts + peer;
    const long long start = clock64();
    while (static_cast<int>(load_acquire_sys(mine) - epoch) < 0) {
      if (clock64() - start > kSpinTimeoutCycles) {
        printf("rl_align::peer_reduce: rank %d block %d waited too long for rank %d (epoch %u)\n", a.rank,
               static_cast<int>(blockIdx.x), peer, epoch);
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
// the message below end (the block range's end, clipped to the message).
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

template <typename T, bool VECTOR_IO, PeerMode MODE>
__global__ void __launch_bounds__(kBlockThreads)
    peer_reduce_kernel(const RL_ALIGN_GRID_CONSTANT PeerSumOperands a, int64_t chunk) {
  constexpr int VEC = 16 / sizeof(T);
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.out);
  // 1. Push: this block's range of the message into the receivers' slots.
  if constexpr (MODE == PeerMode::kOneShot) {
    for_block_groups<VEC>(a, chunk, 0, [&](int64_t first, int64_t end) {
      const Pack<T, VEC> y = load_group<T, VEC, VECTOR_IO>(in + first, first, end);
      for (int p = 0; p < a.parts; ++p) {
        store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.slots[p]) + a.rank * a.segment + first, y, first, end);
      }
    });
  } else {
    for (int s = 0; s < a.segments; ++s) {
      const int64_t base = static_cast<int64_t>(s) * a.segment;
      T* slot = static_cast<T*>(a.slots[s]) + a.rank * a.segment - base;
      const T* src = in + static_cast<int64_t>(s) * a.input_stride - base;
      for_block_groups<VEC>(a, chunk, s, [&](int64_t first, int64_t end) {
        store_group<T, VEC, VECTOR_IO>(slot + first, load_group<T, VEC, VECTOR_IO>(src + first, first, end), first, end);
      });
    }
  }
  block_barrier(a, a.epoch);
  // 2. Fold this rank's segment over its slots (local memory the other ranks wrote).
  const int own = MODE == PeerMode::kOneShot ? 0 : a.rank;
  if (own < a.segments) {  // a rank past the last segment (a short message) folds nothing
    const int64_t base = static_cast<int64_t>(own) * a.segment;
    const T* slots = static_cast<const T*>(a.slots[a.rank]) - base;
    for_block_groups<VEC>(a, chunk, own, [&](int64_t first, int64_t end) {
      const Pack<T, VEC> y = fold_group<T, VEC, VECTOR_IO, true>(
          a.parts, [&](int q) { return slots + q * a.segment + first; }, first, end, a.divisor);
      if constexpr (MODE == PeerMode::kTwoShot) {
        for (int p = 0; p < a.parts; ++p) store_group<T, VEC, VECTOR_IO>(static_cast<T*>(a.gather[p]) + first, y, first, end);
      } else if constexpr (MODE == PeerMode::kOneShot) {
        store_group<T, VEC, VECTOR_IO>(out + first, y, first, end);
      } else {
        store_group<T, VEC, VECTOR_IO>(out + (first - base), y, first, end);
      }
    });
  }
  // 3. kTwoShot: every rank's folded segments, from this rank's gather region.
  if constexpr (MODE == PeerMode::kTwoShot) {
    block_barrier(a, a.epoch + 1);
    const T* gathered = static_cast<const T*>(a.gather[a.rank]);
    for (int s = 0; s < a.segments; ++s) {
      for_block_groups<VEC>(a, chunk, s, [&](int64_t first, int64_t end) {
        store_group<T, VEC, VECTOR_IO>(out + first, load_group<T, VEC, VECTOR_IO, true>(gathered + first, first, end),
                                       first, end);
      });
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

bool peer_vector_io_ok(const PeerSumOperands& a, int elem) {
  if (!aligned16(a.input) || !aligned16(a.out) || (a.segment * elem) % 16 != 0 || (a.input_stride * elem) % 16 != 0) {
    return false;
  }
  for (int r = 0; r < a.parts; ++r) {
    if (!aligned16(a.slots[r]) || (a.mode == PeerMode::kTwoShot && !aligned16(a.gather[r]))) return false;
  }
  return true;
}

template <typename T, bool VECTOR_IO>
void launch_peer(const PeerSumOperands& a, PeerBlocks pb, gpuStream_t stream) {
  switch (a.mode) {
    case PeerMode::kOneShot:
      peer_reduce_kernel<T, VECTOR_IO, PeerMode::kOneShot><<<pb.blocks, kBlockThreads, 0, stream>>>(a, pb.chunk);
      break;
    case PeerMode::kReduceScatter:
      peer_reduce_kernel<T, VECTOR_IO, PeerMode::kReduceScatter><<<pb.blocks, kBlockThreads, 0, stream>>>(a, pb.chunk);
      break;
    case PeerMode::kTwoShot:
      peer_reduce_kernel<T, VECTOR_IO, PeerMode::kTwoShot><<<pb.blocks, kBlockThreads, 0, stream>>>(a, pb.chunk);
      break;
  }
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

gpuError_t peer_reduce_simt(DType dtype, const PeerSumOperands& a, gpuStream_t stream) {
  if (a.numel == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const PeerBlocks pb = peer_blocks(a.segment, static_cast<int>(sizeof(T)));
    if (peer_vector_io_ok(a, static_cast<int>(sizeof(T)))) {
      launch_peer<T, true>(a, pb, stream);
    } else {
      launch_peer<T, false>(a, pb, stream);
    }
    return gpu_last_error();
  }, gpu_not_supported);
}

gpuError_t rank_sum_simt(DType dtype, const RankSumOperands& a, gpuStream_t stream) {
  if (a.numel == 0) return kGpuSuccess;
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t groups = ceil_div(a.numel, static_cast<int64_t>(16 / sizeof(T)));
    const int64_t cap = static_cast<int64_t>(multiprocessor_count(current_device())) * kBlocksPerMultiprocessor;
    const int64_t blocks = ceil_div(groups, static_cast<int64_t>(kBlockThreads));
    const unsigned grid = static_cast<unsigned>(std::min(blocks, cap));
    const auto kernel = vector_io_ok(a) ? rank_sum_kernel<T, true> : rank_sum_kernel<T, false>;
    kernel<<<grid, kBlockThreads, 0, stream>>>(a);
    return gpu_last_error();
  }, gpu_not_supported);
}

}  // namespace rl_align
