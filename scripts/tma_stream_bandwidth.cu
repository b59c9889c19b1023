// Read rate of the sm90 linear kernel's weight stream with no arithmetic: CTAs load boxes of a
// [151936, 4096] bf16 matrix (the lm_head weight, 1.24 GB) through a ring of STAGES shared-memory
// stages by TMA, and a consumer thread frees each stage as soon as it has landed. It separates the
// memory side of the decode-size grad input (which reads an MN-major weight in 64-row x 128-byte
// boxes, one column tile per CTA: 128 bytes of every row, 8 KB apart) from its MMA chain.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/tma_stream scripts/tma_stream_bandwidth.cu && /tmp/tma_stream
//
// Patterns: "column_stripe" (the grad input's: CTA p takes column tile p and walks every row
// block), "row_range" (the same boxes, CTA p taking whole rows: each row block's column tiles one
// after another, so its reads cover 64 contiguous rows); the CTA count and the ring depth vary.
// The "gemm" cases add the rest of the kernel's k-block, one piece at a time: the A box of each
// stage (the grad input's dY: 16 rows of a 1-row tensor, the other 15 zero-filled), and a consumer
// warpgroup that runs the k-block's four m64n64k16 wgmma on the stage and frees it as the linear
// kernel does (after the next k-block's wgmma are issued, wait<1>).
// Output: one CSV row per case, GB/s and the fraction of a device-to-device copy's rate (bytes read
// plus written, as benchmarks/common.py counts it).
#include <cstdio>
#include <cstdint>

#include "../csrc/primitives/sm90_async.h"
#include "../csrc/primitives/wgmma_instructions.h"

namespace rl_align {

constexpr int kRows = 151936, kCols = 4096;
constexpr int kBoxRows = 64;

enum Pattern { kColumnStripe, kRowRange };

constexpr int kARows = 16;  // the A box of a decode-size (m <= 16) grad input
constexpr int kAStageBytes = 64 * kSwizzleRowBytes;  // a 64-row wgmma tile's A, as the kernel lays it out

// A stage: the weight box, then (for the A box or the wgmma) a 64-row A tile.
__host__ __device__ constexpr int stage_bytes(int box_cols, bool with_a_tile) {
  return box_cols * 2 * kBoxRows + (with_a_tile ? kAStageBytes : 0);
}

// SWAPPED: the k-block's wgmma computes dX^T = W^T dY^T instead: m64n16k16 with the weight tile
// as A (MN-major) and the 16 dY rows as B (K-major), 2.5 KB of shared memory read per k16 chunk
// instead of m64n64k16's 4 KB.
// RELEASE (with WITH_MMA): how the consumer frees stages. kAfterNext: the kernel's; kBeforeMma:
// as soon as the stage has landed, before its wgmma read it (a race, for timing only: what the
// stream would do if holding stages cost nothing); kWait0: after the stage's own wgmma completed
// (wait<0>, one group in flight at a time); kHalfMma: the kernel's, wgmma on every other k-block;
// kNoMma: the whole warpgroup waits for each stage and frees it, no wgmma.
enum Release { kAfterNext, kBeforeMma, kWait0, kHalfMma, kNoMma };

template <int BOX_COLS, int STAGES, Pattern PATTERN, bool WITH_A, bool WITH_MMA, bool SWAPPED = false,
          Release RELEASE = kAfterNext>
__global__ void __launch_bounds__(256) stream_kernel(const __grid_constant__ CUtensorMap map,
                                                     const __grid_constant__ CUtensorMap map_a, float* sink) {
#ifdef RL_ALIGN_SM90A_DEVICE
  constexpr int kBBytes = BOX_COLS * 2 * kBoxRows;
  constexpr int kStageBytes = stage_bytes(BOX_COLS, WITH_A || WITH_MMA);
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + STAGES * kStageBytes);
  uint64_t* empty = full + STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  constexpr int kColTiles = kCols / BOX_COLS, kRowBlocks = kRows / kBoxRows;
  // This CTA's boxes, in order: [first, last) of the pattern's enumeration.
  const int64_t total = static_cast<int64_t>(kColTiles) * kRowBlocks;
  const int64_t per_cta = (total + gridDim.x - 1) / gridDim.x;
  const int64_t first = blockIdx.x * per_cta;
  const int64_t last = first + per_cta < total ? first + per_cta : total;
  auto coords = [&](int64_t i, int& col, int& row) {
    if (PATTERN == kColumnStripe) {  // column tile major: box i = (tile i / row blocks, row block i % row blocks)
      col = static_cast<int>(i / kRowBlocks) * BOX_COLS;
      row = static_cast<int>(i % kRowBlocks) * kBoxRows;
    } else {  // row block major
      row = static_cast<int>(i / kColTiles) * kBoxRows;
      col = static_cast<int>(i % kColTiles) * BOX_COLS;
    }
  };
  if (threadIdx.x == 0) {  // producer
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t i = first; i < last; ++i) {
      mbar_wait(&empty[stage], phase ^ 1);
      mbar_arrive_expect_tx(&full[stage], kBBytes + (WITH_A ? kARows * kSwizzleRowBytes : 0));
      int col, row;
      coords(i, col, row);
      if (WITH_A) tma_load_2d(ring + stage * kStageBytes + kBBytes, &map_a, &full[stage], row, 0);
      tma_load_2d(ring + stage * kStageBytes, &map, &full[stage], col, row);
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
  } else if (WITH_MMA && threadIdx.x >= kWarpgroupThreads) {  // the kernel's consumer warpgroup
    float acc[32], acc16[8];
#pragma unroll
    for (int j = 0; j < 32; ++j) acc[j] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc16[j] = 0.f;
    int stage = 0, held = -1;
    uint32_t phase = 0;
    const bool leader = threadIdx.x == kWarpgroupThreads;
    for (int64_t i = first; i < last; ++i) {
      mbar_wait(&full[stage], phase);
      if (RELEASE == kBeforeMma || RELEASE == kNoMma) {
        if (leader) mbar_arrive(&empty[stage]);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
        if (RELEASE == kNoMma) continue;
      }
      const uint64_t b_desc = smem_desc(smem_addr(ring + stage * kStageBytes), kBBytes, kSwizzleAtomBytes);
      const uint64_t a_desc = smem_desc(smem_addr(ring + stage * kStageBytes + kBBytes), kBBytes, kSwizzleAtomBytes);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        if (RELEASE == kHalfMma && (i & 1)) break;
        if constexpr (SWAPPED) {
          Wgmma<16, bfloat16_t>::template mma<1, 0>(acc16, smem_desc_at(b_desc, s * 16 * kSwizzleRowBytes),
                                                    smem_desc_at(a_desc, s * 32), 1);
        } else {
          Wgmma<64, bfloat16_t>::template mma<0, 1>(acc, smem_desc_at(a_desc, s * 32),
                                                    smem_desc_at(b_desc, s * 16 * kSwizzleRowBytes), 1);
        }
      }
      wgmma_commit();
      if (RELEASE == kBeforeMma) {
        wgmma_wait<1>();
        continue;
      }
      if (RELEASE == kWait0) {
        wgmma_wait<0>();
        if (leader) mbar_arrive(&empty[stage]);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
        continue;
      }
      wgmma_wait<1>();
      if (held >= 0 && leader) mbar_arrive(&empty[held]);
      held = stage;
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    fence_accumulators(acc16);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 32; ++j) sum += acc[j];
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += acc16[j];
    if (sum == 12345.f) sink[0] = sum;  // keeps the chain live
  } else if (!WITH_MMA && threadIdx.x == 32) {  // consumer: frees each stage once it has landed
    int stage = 0;
    uint32_t phase = 0;
    for (int64_t i = first; i < last; ++i) {
      mbar_wait(&full[stage], phase);
      mbar_arrive(&empty[stage]);
      if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
#endif
}

// A row-major [outer, inner] bf16 matrix read in boxes of [box_outer, box_inner].
CUresult encode_bf16_2d(CUtensorMap* map, const void* ptr, cuuint64_t inner, cuuint64_t outer, cuuint32_t box_inner,
                        cuuint32_t box_outer, CUtensorMapSwizzle swizzle) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

template <int BOX_COLS, int STAGES, Pattern PATTERN, bool WITH_A = false, bool WITH_MMA = false, bool SWAPPED = false,
          Release RELEASE = kAfterNext>
void run_case(const void* w, const void* dy, float* sink, int ctas, double copy_bps) {
  CUtensorMap map, map_a;
  const CUresult r = encode_bf16_2d(&map, w, kCols, kRows, BOX_COLS, kBoxRows,
                                    BOX_COLS == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
  // dY of a one-token grad input: [1, kRows], read in boxes of [16 rows, 64] (15 rows zero fill).
  const CUresult ra = encode_bf16_2d(&map_a, dy, kRows, 1, 64, kARows, CU_TENSOR_MAP_SWIZZLE_128B);
  if (r != CUDA_SUCCESS || ra != CUDA_SUCCESS) {
    std::printf("encode failed %d %d\n", static_cast<int>(r), static_cast<int>(ra));
    return;
  }
  auto kernel = stream_kernel<BOX_COLS, STAGES, PATTERN, WITH_A, WITH_MMA, SWAPPED, RELEASE>;
  constexpr int kStage = stage_bytes(BOX_COLS, WITH_A || WITH_MMA);
  const int smem = STAGES * kStage + 2 * STAGES * 8 + 1024;
  const int threads = WITH_MMA ? 2 * kWarpgroupThreads : 64;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  kernel<<<ctas, threads, smem>>>(map, map_a, sink);  // warm-up
  constexpr int kReps = 10;
  cudaEventRecord(start);
  for (int i = 0; i < kReps; ++i) kernel<<<ctas, threads, smem>>>(map, map_a, sink);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  const cudaError_t e = cudaGetLastError();
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  const double us = ms * 1e3 / kReps;
  const double bytes = static_cast<double>(kRows) * kCols * 2;
  static const char* const kReleaseNames[] = {"", "/release_before_mma", "/wait0", "/half_mma", "/no_mma"};
  std::printf("%s%s%s%s,%d,%d,%d,%d,%.1f,%.0f,%.3f%s%s\n", PATTERN == kColumnStripe ? "column_stripe" : "row_range",
              WITH_A ? "+a" : "", WITH_MMA ? (SWAPPED ? "+mma_swapped" : "+mma") : "", WITH_MMA ? kReleaseNames[RELEASE] : "", BOX_COLS * 2, STAGES, STAGES * kStage / 1024, ctas,
              us, bytes / us * 1e-3,
              bytes / (us * 1e-6) / copy_bps, e == cudaSuccess ? "" : ",", e == cudaSuccess ? "" : cudaGetErrorString(e));
}

}  // namespace rl_align

int main() {
  using namespace rl_align;
  void* w;
  const size_t bytes = static_cast<size_t>(kRows) * kCols * 2;
  cudaMalloc(&w, bytes);
  cudaMemset(w, 0x3c, bytes);
  void* dy;
  float* sink;
  cudaMalloc(&dy, kRows * 2);
  cudaMemset(dy, 0x3c, kRows * 2);
  cudaMalloc(&sink, sizeof(float));
  // Copy rate (read + write) of 1 GiB, as benchmarks/common.py measures it.
  void *src, *dst;
  cudaMalloc(&src, 1 << 30);
  cudaMalloc(&dst, 1 << 30);
  cudaMemcpy(dst, src, 1 << 30, cudaMemcpyDeviceToDevice);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  for (int i = 0; i < 10; ++i) cudaMemcpy(dst, src, 1 << 30, cudaMemcpyDeviceToDevice);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  const double copy_bps = 2.0 * (1 << 30) / (ms * 1e-3 / 10);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# %s, %d SMs, copy %.3f TB/s (read + write); matrix %d x %d bf16 (%.3f GB), boxes of 64 rows\n",
              prop.name, sms, copy_bps * 1e-12, kRows, kCols, bytes * 1e-9);
  std::printf("pattern,box_row_bytes,stages,ring_kb,ctas,us,GBps,of_copy\n");
  // The grad input's stream: 64 column tiles of 128 bytes (decode64), 128 of 64 bytes (decode32).
  run_case<64, 14, kColumnStripe>(w, dy, sink, 64, copy_bps);
  run_case<64, 8, kColumnStripe>(w, dy, sink, 64, copy_bps);
  run_case<64, 26, kColumnStripe>(w, dy, sink, 64, copy_bps);
  run_case<32, 16, kColumnStripe>(w, dy, sink, 128, copy_bps);
  run_case<32, 28, kColumnStripe>(w, dy, sink, 128, copy_bps);
  // The same boxes, whole rows per CTA: is it the pattern or the number of SMs?
  run_case<64, 14, kRowRange>(w, dy, sink, 64, copy_bps);
  run_case<64, 26, kRowRange>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kRowRange>(w, dy, sink, 128, copy_bps);
  run_case<64, 14, kRowRange>(w, dy, sink, sms, copy_bps);
  // Column stripes over more CTAs: two stripes' halves of the rows each (a split the contract
  // forbids for the GEMM; here only to see the rate 128 or all SMs reach with this pattern).
  run_case<64, 14, kColumnStripe>(w, dy, sink, 128, copy_bps);
  run_case<64, 14, kColumnStripe>(w, dy, sink, sms, copy_bps);
  // The decode64 grad input's k-block, piece by piece (14 stages of 8 KB of A and 8 KB of B).
  run_case<64, 14, kColumnStripe, true, false>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kColumnStripe, false, true>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kColumnStripe, true, true>(w, dy, sink, 64, copy_bps);
  run_case<64, 8, kColumnStripe, true, true>(w, dy, sink, 64, copy_bps);
  // Which part of the consumer slows the stream.
  run_case<64, 14, kColumnStripe, true, true, false, kNoMma>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kColumnStripe, true, true, false, kBeforeMma>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kColumnStripe, true, true, false, kWait0>(w, dy, sink, 64, copy_bps);
  run_case<64, 14, kColumnStripe, true, true, false, kHalfMma>(w, dy, sink, 64, copy_bps);
  run_case<64, 13, kColumnStripe, true, true, false, kAfterNext>(w, dy, sink, 64, copy_bps);
  // The swapped k-block (A: the weight tile, B: dY's 16 rows).
  run_case<64, 14, kColumnStripe, true, true, true>(w, dy, sink, 64, copy_bps);
  run_case<64, 8, kColumnStripe, true, true, true>(w, dy, sink, 64, copy_bps);
  return 0;
}
