// Cycles per step of a chain of dependent wgmma.m64nNk16 (bf16, fp32 accumulators) on one SM:
// the bound of a GEMM whose every output element takes its k16 chunks in order, one chain per
// element (the numerical contract), when the chain is long and the tile count small (the grad
// input of a decode-size linear). Independent chains interleaved on one warpgroup, and chains on
// two warpgroups of one CTA, show how much of a step is latency and how much issue/throughput.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/wgmma_chain scripts/wgmma_chain_latency.cu && /tmp/wgmma_chain
//
// Operands are read from shared memory (SS) through 128-byte-swizzle descriptors, as the sm90
// linear kernel reads them; their values are fixed small bf16 numbers (the timing does not depend
// on them). Output: one CSV row per case, cycles and ns per step (clock64 and %globaltimer).
#include <cstdio>
#include <cstdint>

#include "../csrc/primitives/sm90_async.h"
#include "../csrc/primitives/wgmma_instructions.h"

namespace rl_align {

constexpr int kTileBytes = 64 * kSwizzleRowBytes;  // one 64-deep k-block of 64 rows / columns
constexpr int kSmemBytes = 6 * kTileBytes + kSwizzleAtomBytes;

#ifdef RL_ALIGN_SM90A_DEVICE

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

#endif

// CHAINS accumulators per warpgroup, each taking its k16 chunks in order; PER_COMMIT steps per
// commit group, the kernel's wait<1> after each (one group in flight, as the linear kernel does).
template <int N, int TA, int TB, int CHAINS, int PER_COMMIT>
__global__ void __launch_bounds__(256) chain_kernel(int steps, long long* cycles, unsigned long long* ns, float* sink) {
#ifdef RL_ALIGN_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + kSwizzleAtomBytes - 1) &
                                             ~uintptr_t(kSwizzleAtomBytes - 1));
  for (int i = threadIdx.x; i < 6 * kTileBytes / 4; i += blockDim.x) {
    const uint32_t lo = 0x3c00u + (i * 37u) % 64u;  // bf16 around 0.008
    reinterpret_cast<uint32_t*>(smem)[i] = lo | (lo << 16);
  }
  fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x / kWarpgroupThreads;
  // A at tile 0 (64 rows), B at tiles 1.. (N rows / columns, up to 256 = 4 tiles); warpgroup 1
  // reads the same tiles (shared-memory reads are what a second consumer would add).
  const uint64_t a_desc = smem_desc(smem_addr(smem), kTileBytes, kSwizzleAtomBytes);
  const uint64_t b_desc = smem_desc(smem_addr(smem + kTileBytes), kTileBytes, kSwizzleAtomBytes);
  float acc[CHAINS][N / 2];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[c][i] = 0.f;
  long long t0 = 0;
  uint64_t g0 = 0;
  for (int pass = 0; pass < 2; ++pass) {  // pass 0 warms up
    __syncthreads();
    t0 = clock64();
    g0 = global_ns();
    for (int step = 0; step < steps; step += PER_COMMIT) {
      wgmma_fence();  // per commit group, as the linear kernel's k-block loop
#pragma unroll
      for (int s = 0; s < PER_COMMIT; ++s) {
        const int chunk = s % 4;  // the four k16 chunks of a k-block
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
          Wgmma<N, bfloat16_t>::template mma<TA, TB>(acc[c],
                                                     smem_desc_at(a_desc, TA ? chunk * 16 * kSwizzleRowBytes : chunk * 32),
                                                     smem_desc_at(b_desc, TB ? chunk * 16 * kSwizzleRowBytes : chunk * 32), 1);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
  }
  const long long t1 = clock64();
  const uint64_t g1 = global_ns();
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) sum += acc[c][i];
  sink[threadIdx.x] = sum;
  if (threadIdx.x % kWarpgroupThreads == 0) {
    cycles[wg] = t1 - t0;
    ns[wg] = g1 - g0;
  }
#endif
}

template <int N, int TA, int TB, int CHAINS, int PER_COMMIT>
void run_case(const char* name, int warpgroups, long long* cycles, unsigned long long* ns, float* sink) {
  auto kernel = chain_kernel<N, TA, TB, CHAINS, PER_COMMIT>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const int steps = 8192;
  kernel<<<1, warpgroups * kWarpgroupThreads, kSmemBytes>>>(steps, cycles, ns, sink);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("%s,error,%s\n", name, cudaGetErrorString(e));
    return;
  }
  long long c[2];
  unsigned long long t[2];
  cudaMemcpy(c, cycles, sizeof(c), cudaMemcpyDeviceToHost);
  cudaMemcpy(t, ns, sizeof(t), cudaMemcpyDeviceToHost);
  // One step = one chunk of every chain; per-chain step time is the latency a chain sees.
  std::printf("%s,%d,%d,%d,%d,%d,%.1f,%.2f\n", name, N, TA, TB, CHAINS, warpgroups, double(c[0]) / steps,
              double(t[0]) / steps);
}

}  // namespace rl_align

int main() {
  using namespace rl_align;
  long long* cycles;
  unsigned long long* ns;
  float* sink;
  cudaMalloc(&cycles, 2 * sizeof(long long));
  cudaMalloc(&ns, 2 * sizeof(unsigned long long));
  cudaMalloc(&sink, 256 * sizeof(float));
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# %s, sm_%d%d, one CTA, 8192 steps, 4 steps per commit group, wait<1>\n", prop.name, prop.major,
              prop.minor);
  std::printf("case,n,trans_a,trans_b,chains,warpgroups,cycles_per_step,ns_per_step\n");
  // One chain: K-major A and B (forward), MN-major B (the grad input's weight), MN-major A.
  run_case<8, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<16, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<32, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<64, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<128, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<256, 0, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<8, 0, 1, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<32, 0, 1, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<64, 0, 1, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<8, 1, 0, 1, 4>("chain", 1, cycles, ns, sink);
  run_case<64, 1, 0, 1, 4>("chain", 1, cycles, ns, sink);
  // Independent chains interleaved on one warpgroup: the step time they share.
  run_case<8, 0, 0, 2, 4>("interleaved", 1, cycles, ns, sink);
  run_case<8, 0, 0, 4, 4>("interleaved", 1, cycles, ns, sink);
  run_case<8, 0, 0, 8, 4>("interleaved", 1, cycles, ns, sink);
  run_case<32, 0, 0, 2, 4>("interleaved", 1, cycles, ns, sink);
  run_case<64, 0, 0, 2, 4>("interleaved", 1, cycles, ns, sink);
  run_case<64, 0, 1, 2, 4>("interleaved", 1, cycles, ns, sink);
  // Two warpgroups, one chain each (the linear kernel's two consumers).
  run_case<8, 0, 0, 1, 4>("two_warpgroups", 2, cycles, ns, sink);
  run_case<64, 0, 0, 1, 4>("two_warpgroups", 2, cycles, ns, sink);
  run_case<64, 0, 1, 1, 4>("two_warpgroups", 2, cycles, ns, sink);
  // Longer commit groups (16 steps): does the wait<1> cadence cost anything?
  run_case<64, 0, 1, 1, 16>("chain_commit16", 1, cycles, ns, sink);
  run_case<8, 0, 0, 1, 16>("chain_commit16", 1, cycles, ns, sink);
  return 0;
}
