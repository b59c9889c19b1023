// sm_90a plumbing shared by the Hopper kernels: mbarriers, TMA bulk tensor copies (cluster
// multicast included), shared-memory matrix descriptors for the 128-byte swizzle, and the driver's
// tensor-map encoder (host). Device code is defined only where the target is sm_90a
// (RL_ALIGN_SM90A_DEVICE); include from CUDA sources.
#pragma once

#include <cstdint>

#include "../common/portability.h"

#if !RL_ALIGN_HIP
#include <cuda.h>
#include <cudaTypedefs.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RL_ALIGN_SM90A_DEVICE 1
#endif

namespace rl_align {

// The 128-byte swizzle that TMA writes and wgmma reads: 128-byte rows, repeating every 8 rows.
constexpr int kSwizzleRowBytes = 128;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;  // 8 rows: the swizzle's repeat
constexpr int kWarpgroupThreads = 128;

#ifdef RL_ALIGN_SM90A_DEVICE

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// mbar_arrive by the threads with `arrive` set, as a predicated instruction rather than a branch:
// inside a wgmma loop a branch on a per-thread condition (one arrive per warp) makes ptxas keep
// the loop's stage index, and every wgmma descriptor built from it, in vector registers, which
// then cost two R2UR per wgmma.
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool arrive) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}" ::"r"(
          smem_addr(bar)),
      "r"(static_cast<uint32_t>(arrive))
      : "memory");
}

// Arrives on the barrier at the same shared-memory offset in CTA `rank` of the cluster. (Plain
// arrive semantics: a cluster-scope release here would wait for the wgmmas still in flight.)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int inner, int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// A box of a 3-D tensor map at coordinates (c0 innermost), completing on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The same box written at the same offset into every CTA of `cta_mask`, each CTA's barrier at
// `bar`'s offset taking the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map,
                                                      uint64_t* bar, int inner, int outer,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(inner), "r"(outer),
      "h"(cta_mask)
      : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle. K-major tiles: rows of 128 bytes, 8-row
// groups `stride` apart (LBO unused). MN-major tiles: 64-element chunks of the M/N dimension
// `leading` bytes apart, 8-row groups of k `stride` apart. Bits 62-63 are the layout (1: the
// 128-byte swizzle).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((leading & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// smem_desc(addr + offset, ..) from smem_desc(addr, ..), for an offset (a multiple of 16) that
// keeps the address below 256 KB: only the low word's address field moves, and never carries into
// the high word. Loops take one descriptor per operand and step it by such offsets; ptxas then
// adds a constant per wgmma instead of redoing smem_desc's masks and shifts on its path.
__device__ __forceinline__ uint64_t smem_desc_at(uint64_t desc, uint32_t offset) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(desc) + (offset >> 4));
}

// Generic-proxy shared-memory writes (st.shared) made visible to the async proxy (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` arrivals complete a phase.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// A warpgroup's wgmma issue: fence before the first (its registers are ready), commit the issued
// ones as a group, wait until at most N groups are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across a wgmma wait.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#endif  // RL_ALIGN_SM90A_DEVICE

// The driver's cuTensorMapEncodeTiled (null where the driver lacks it).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace rl_align

#endif  // !RL_ALIGN_HIP
