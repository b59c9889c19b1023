// Ampere-class (sm_80+) tensor-core GEMM for the linear ops: cp.async global->shared copies into a
// multi-stage ring, ldmatrix shared->register fragments, mma.sync m16n8k16 with fp32 accumulators.
// Runs on any CUDA GPU of compute capability >= 8.0 (the H100 too, where sm90 is not built).
//
// Invariance: one tile configuration (Sm80Config below) serves every m, n and k, so every output
// element runs the same arithmetic whatever the batch. The accumulator of C[i, j] starts at the
// saved fp32 accumulator (or zero) and takes the k16 chunks k = 0, 16, 32, ... in increasing order,
// one mma.sync per chunk (the chain is a data dependency through the accumulator registers), and
// exactly ceil(k / 16) of them: wholly zero-filled chunks of the last k-block are skipped, so the
// chain does not depend on BK either. Rows and columns past m and n, and the k tail, are cp.async
// zero fill: a zero-filled A element is only ever multiplied with a zero-filled B element (k tail)
// or feeds an output that is never stored (m, n tails), so it adds exact zeros. An MMA's result
// for element (i, j) depends only on row i of A, column j of B and its own accumulator, never on
// the other rows of the tile. Then the optional bias is added in fp32 and the value rounded once
// (or stored as fp32). No split-K, no atomics: each output element is owned by exactly one thread,
// which reads c_accum (which may alias c) before it writes c.
#include "../linear_kernels.h"
#include "../../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

#include <atomic>
#include <cstring>

namespace rl_align {
namespace {

// ------------------------------------------------------------------------------------------------
// Tile configuration (the partition: never chosen from m)
// ------------------------------------------------------------------------------------------------


// BM x BN output tile per CTA, BK-deep k-blocks, WARPS_M x WARPS_N warps each owning a
// (BM / WARPS_M) x (BN / WARPS_N) sub-tile, STAGES k-blocks in the cp.async ring.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct Sm80Config {
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr int BK = BK_;
  static constexpr int WARPS_M = WARPS_M_;
  static constexpr int WARPS_N = WARPS_N_;
  static constexpr int STAGES = STAGES_;
  static constexpr int THREADS = WARPS_M * WARPS_N * 32;
  static constexpr int WM = BM / WARPS_M;       // rows per warp
  static constexpr int WN = BN / WARPS_N;       // columns per warp
  static constexpr int MMA_TILES_M = WM / kMmaM;  // m16 tiles per warp
  static constexpr int MMA_TILES_N = WN / kMmaN;  // n8 tiles per warp
  static constexpr int K_STEPS = BK / kMmaK;      // k16 chunks per k-block
  static_assert(BM % WARPS_M == 0 && BN % WARPS_N == 0, "warp grid");
  static_assert(WM % kMmaM == 0, "warp rows: whole m16 tiles");
  static_assert(WN % (2 * kMmaN) == 0, "warp columns: pairs of n8 tiles (one ldmatrix.x4 each)");
  static_assert(BK % kMmaK == 0, "k-block: whole k16 chunks");
  static_assert(BM % kChunkElems == 0 && BN % kChunkElems == 0, "MN-major: whole 16-byte chunks");
  static_assert(STAGES >= 2, "pipeline");
};

// 128 x 128 x 32, 4 warps of 64 x 64, 4 stages (80 KB of shared memory with K-major operands:
// two CTAs per SM on the A100 and the H100).
using Sm80DefaultConfig = Sm80Config<128, 128, 32, 2, 2, 4>;

// Shared-memory image of one operand k-block. ROWS = BM (A) or BN (B).
//   K-major:  [ROWS][BK + pad]  (line = an m/n index, contiguous along k)
//   MN-major: [BK][ROWS + pad]  (line = a k index, contiguous along m/n)
template <int ROWS, int BK, bool MN_MAJOR>
struct OperandTile {
  static constexpr int kLines = MN_MAJOR ? BK : ROWS;
  static constexpr int kLineElems = MN_MAJOR ? ROWS : BK;
  static constexpr int kPitch = kLineElems + kPadElems;  // elements
  static constexpr int kPitchBytes = kPitch * kElemBytes;
  static constexpr int kBytes = kLines * kPitchBytes;
  static constexpr int kChunksPerLine = kLineElems / kChunkElems;
  static constexpr int kChunks = kLines * kChunksPerLine;
  static_assert(kPitchBytes % 16 == 0 && (kPitchBytes / 16) % 2 == 1,
                "odd pitch in 16-byte units: conflict-free ldmatrix");
  static_assert(kLineElems % kChunkElems == 0, "whole 16-byte chunks per line");
};

template <typename Cfg, bool A_MN, bool B_MN>
struct Sm80Smem {
  using ATile = OperandTile<Cfg::BM, Cfg::BK, A_MN>;
  using BTile = OperandTile<Cfg::BN, Cfg::BK, B_MN>;
  static constexpr int kAStageBytes = ATile::kBytes;
  static constexpr int kBStageBytes = BTile::kBytes;
  static constexpr int kABytes = Cfg::STAGES * kAStageBytes;  // A ring, then the B ring
  static constexpr int kBytes = kABytes + Cfg::STAGES * kBStageBytes;
  static_assert(ATile::kChunks % Cfg::THREADS == 0 && BTile::kChunks % Cfg::THREADS == 0,
                "every thread copies the same number of chunks");
  static_assert(kAStageBytes % 16 == 0 && kBStageBytes % 16 == 0, "16-byte aligned stages");
};

// Row tiles visited per column sweep (consecutive CTAs share B column tiles and A row tiles in L2).
constexpr int kTileGroupM = 8;

// Largest m, n, k accepted: tile arithmetic in the kernel is 32-bit and may run one tile past.
constexpr int64_t kMaxDim = INT32_MAX - 1024;

#ifdef RL_ALIGN_SM80_DEVICE

// ------------------------------------------------------------------------------------------------
// Global -> shared (one operand k-block)
// ------------------------------------------------------------------------------------------------

// Copies k-block [k0, k0 + BK) x lines [line0, line0 + ROWS) of one operand into the stage at
// `dst` (shared address). `extent` is the operand's m (A) or n (B). Every 16-byte chunk of the
// stage is written: in range elements copied, the rest zero filled (partial chunks at the m/n
// edge of an MN-major operand and at the k edge of a K-major one copy only their valid bytes,
// which lie inside the caller's rows since every row starts 16-byte aligned).
//   K-major:  X[line, kk] = g[line * ld + kk]
//   MN-major: X[line, kk] = g[kk * ld + line]
template <typename T, int ROWS, int BK, bool MN_MAJOR, int THREADS>
__device__ __forceinline__ void load_operand_block(uint32_t dst, const T* g, int64_t ld,
                                                   int extent, int line0, int k, int k0, int tid) {
  using Tile = OperandTile<ROWS, BK, MN_MAJOR>;
#pragma unroll
  for (int it = 0; it < Tile::kChunks / THREADS; ++it) {
    const int idx = it * THREADS + tid;
    const int line = idx / Tile::kChunksPerLine;   // smem line
    const int chunk = idx % Tile::kChunksPerLine;  // 16-byte chunk in the line
    const uint32_t dst_addr = dst + line * Tile::kPitchBytes + chunk * 16;
    const T* src = g;  // any valid address when nothing is read
    int valid;         // elements to copy, 0..8
    if constexpr (MN_MAJOR) {
      const int kk = k0 + line;
      const int col = line0 + chunk * kChunkElems;
      const int left = extent - col;
      valid = kk < k ? (left < 0 ? 0 : (left > kChunkElems ? kChunkElems : left)) : 0;
      if (valid > 0) src = g + static_cast<int64_t>(kk) * ld + col;
    } else {
      const int row = line0 + line;
      const int kc = k0 + chunk * kChunkElems;
      const int left = k - kc;
      valid = row < extent ? (left < 0 ? 0 : (left > kChunkElems ? kChunkElems : left)) : 0;
      if (valid > 0) src = g + static_cast<int64_t>(row) * ld + kc;
    }
    cp_async_16_zfill(dst_addr, src, valid * kElemBytes);
  }
}

// ------------------------------------------------------------------------------------------------
// Shared -> registers (per-lane ldmatrix addresses)
// ------------------------------------------------------------------------------------------------
//
// Lane l feeds row r = l % 8 of matrix q = l / 8 of an ldmatrix.x4.
//
// A, m16 x k16 fragment at (row mb, chunk kb):
//   K-major tile [m][k], no trans: matrix q = m rows mb + 8 (q & 1) + r, k cols kb + 8 (q >> 1)
//     .. +7; lane holds m = g, k = 2t, 2t+1 of it: r[q] = A[mb + 8 (q & 1) + g][kb + 8 (q >> 1)
//     + 2t, +1] = a[q] (matrix 1 = rows + 8 -> a[1]; matrix 2 = k + 8 -> a[2]).
//   MN-major tile [k][m], trans: matrix q = stored k rows kb + 8 (q >> 1) + r, m cols
//     mb + 8 (q & 1) .. +7; .trans gives stored rows 2t, 2t+1 (k) of column g (m): the same r[q].
// B, k16 x n16 (two n8 fragments j0 = nb, j1 = nb + 8) at (chunk kb, column nb):
//   K-major tile [n][k], no trans: matrix q = n rows nb + 8 (q >> 1) + r, k cols kb + 8 (q & 1);
//     lane holds n = g, k = 2t, 2t+1: r[q] = B[kb + 8 (q & 1) + 2t, +1][nb + 8 (q >> 1) + g], so
//     r[0], r[1] = b[0], b[1] of n8 tile j0 and r[2], r[3] = b[0], b[1] of n8 tile j1.
//   MN-major tile [k][n], trans: matrix q = stored k rows kb + 8 (q & 1) + r, n cols
//     nb + 8 (q >> 1) .. +7; .trans gives k = 2t, 2t+1 of column n = g: the same r[q].

template <int PITCH_BYTES, bool MN_MAJOR>
__device__ __forceinline__ uint32_t a_lane_offset(int lane, int warp_row0) {
  const int r = lane % 8, q = lane / 8;
  if constexpr (MN_MAJOR) {
    return (r + 8 * (q >> 1)) * PITCH_BYTES + (warp_row0 + 8 * (q & 1)) * kElemBytes;
  } else {
    return (warp_row0 + r + 8 * (q & 1)) * PITCH_BYTES + 8 * (q >> 1) * kElemBytes;
  }
}

template <int PITCH_BYTES, bool MN_MAJOR>
__device__ __forceinline__ uint32_t b_lane_offset(int lane, int warp_col0) {
  const int r = lane % 8, q = lane / 8;
  if constexpr (MN_MAJOR) {
    return (r + 8 * (q & 1)) * PITCH_BYTES + (warp_col0 + 8 * (q >> 1)) * kElemBytes;
  } else {
    return (warp_col0 + r + 8 * (q >> 1)) * PITCH_BYTES + 8 * (q & 1) * kElemBytes;
  }
}

// Byte offset of (m16 tile mi, k16 step ks) from the lane's A base; (n16 pair nj, ks) for B.
template <int PITCH_BYTES, bool MN_MAJOR>
__device__ __forceinline__ constexpr uint32_t a_step_offset(int mi, int ks) {
  return MN_MAJOR ? ks * kMmaK * PITCH_BYTES + mi * kMmaM * kElemBytes
                  : mi * kMmaM * PITCH_BYTES + ks * kMmaK * kElemBytes;
}

template <int PITCH_BYTES, bool MN_MAJOR>
__device__ __forceinline__ constexpr uint32_t b_step_offset(int nj, int ks) {
  return MN_MAJOR ? ks * kMmaK * PITCH_BYTES + nj * 2 * kMmaN * kElemBytes
                  : nj * 2 * kMmaN * PITCH_BYTES + ks * kMmaK * kElemBytes;
}

// ------------------------------------------------------------------------------------------------
// Epilogue helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Saved accumulator of (row, col) and (row, col + 1); zeros outside C.
__device__ __forceinline__ void load_accum_pair(const float* c_accum, int64_t ldc, int m, int n,
                                                int row, int col, float& v0, float& v1) {
  v0 = 0.f;
  v1 = 0.f;
  if (row >= m || col >= n) return;
  const float* p = c_accum + static_cast<int64_t>(row) * ldc + col;
  if (col + 1 < n && aligned_to(p, 8)) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    v0 = v.x;
    v1 = v.y;
  } else {
    v0 = p[0];
    if (col + 1 < n) v1 = p[1];
  }
}

// Stores (row, col) and (row, col + 1): one 8-byte (fp32) or 4-byte (16-bit) store when both are
// inside C and the address is aligned, else element by element.
template <typename T, bool C_FP32>
__device__ __forceinline__ void store_pair(void* c, int64_t ldc, int m, int n, int row, int col,
                                           float v0, float v1) {
  if (row >= m || col >= n) return;
  const int64_t off = static_cast<int64_t>(row) * ldc + col;
  if constexpr (C_FP32) {
    float* p = static_cast<float*>(c) + off;
    if (col + 1 < n && aligned_to(p, 8)) {
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    } else {
      p[0] = v0;
      if (col + 1 < n) p[1] = v1;
    }
  } else {
    T* p = static_cast<T*>(c) + off;
    const T r0 = Convert<T>::from_float(v0), r1 = Convert<T>::from_float(v1);
    if (col + 1 < n && aligned_to(p, 4)) {
      *reinterpret_cast<uint32_t*>(p) = pack_pair<T>(r0, r1);
    } else {
      p[0] = r0;
      if (col + 1 < n) p[1] = r1;
    }
  }
}

__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& mt, int& nt) {
  const int group = kTileGroupM * tiles_n;
  const int first_m = (tile / group) * kTileGroupM;
  const int rows = tiles_m - first_m < kTileGroupM ? tiles_m - first_m : kTileGroupM;
  const int r = tile % group;
  mt = first_m + r % rows;
  nt = r / rows;
}

#endif  // RL_ALIGN_SM80_DEVICE

// ------------------------------------------------------------------------------------------------
// Kernel
// ------------------------------------------------------------------------------------------------

// One CTA per BM x BN tile of C (1-D grid, grouped tile order). c_accum may alias c: not restrict.
template <typename T, typename Cfg, bool A_MN, bool B_MN, bool C_FP32>
__global__ void __launch_bounds__(Cfg::THREADS, 2)
    linear_gemm_sm80_kernel(const T* __restrict__ a, int64_t lda, const T* __restrict__ b,
                            int64_t ldb, void* c, int64_t ldc, const T* __restrict__ bias,
                            const float* c_accum, int m, int n, int k, int tiles_m, int tiles_n) {
#ifdef RL_ALIGN_SM80_DEVICE
  using Smem = Sm80Smem<Cfg, A_MN, B_MN>;
  using ATile = typename Smem::ATile;
  using BTile = typename Smem::BTile;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, STAGES = Cfg::STAGES;
  constexpr int TM = Cfg::MMA_TILES_M, TN = Cfg::MMA_TILES_N;

  extern __shared__ __align__(16) uint8_t sm80_smem[];
  const uint32_t a_ring = smem_u32(sm80_smem);
  const uint32_t b_ring = a_ring + Smem::kABytes;

  int mt, nt;
  tile_coords(static_cast<int>(blockIdx.x), tiles_m, tiles_n, mt, nt);
  const int m0 = mt * BM, n0 = nt * BN;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp / Cfg::WARPS_N, warp_n = warp % Cfg::WARPS_N;
  const int g = lane / 4, t = lane % 4;

  // Accumulators: acc[mi][ni] is the m16n8 D fragment at rows m0 + warp_m WM + 16 mi + g (and
  // + 8), columns n0 + warp_n WN + 8 ni + 2t (+1).
  const int row_base = m0 + warp_m * Cfg::WM + g;
  const int col_base = n0 + warp_n * Cfg::WN + 2 * t;
  float acc[TM][TN][4];
#pragma unroll
  for (int mi = 0; mi < TM; ++mi) {
#pragma unroll
    for (int ni = 0; ni < TN; ++ni) {
      if (c_accum != nullptr) {
        load_accum_pair(c_accum, ldc, m, n, row_base + mi * kMmaM, col_base + ni * kMmaN,
                        acc[mi][ni][0], acc[mi][ni][1]);
        load_accum_pair(c_accum, ldc, m, n, row_base + mi * kMmaM + 8, col_base + ni * kMmaN,
                        acc[mi][ni][2], acc[mi][ni][3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
      }
    }
  }

  const int k_blocks = (k + BK - 1) / BK;
  auto load_stage = [&](int stage, int kb) {
    load_operand_block<T, BM, BK, A_MN, Cfg::THREADS>(a_ring + stage * Smem::kAStageBytes, a, lda,
                                                      m, m0, k, kb * BK, tid);
    load_operand_block<T, BN, BK, B_MN, Cfg::THREADS>(b_ring + stage * Smem::kBStageBytes, b, ldb,
                                                      n, n0, k, kb * BK, tid);
  };

  // Prologue: k-blocks 0 .. STAGES-2 in flight (one commit group each, empty past the end, so
  // that group s always holds k-block s).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_blocks) load_stage(s, s);
    cp_async_commit();
  }

  const uint32_t a_lane = a_ring + a_lane_offset<ATile::kPitchBytes, A_MN>(lane, warp_m * Cfg::WM);
  const uint32_t b_lane = b_ring + b_lane_offset<BTile::kPitchBytes, B_MN>(lane, warp_n * Cfg::WN);

  int stage = 0;
  for (int kb = 0; kb < k_blocks; ++kb) {
    // Groups committed so far: STAGES - 1 + kb; k-block kb is group kb, complete once at most
    // STAGES - 2 groups are pending. The barrier publishes every thread's copies of k-block kb and
    // tells that all warps finished k-block kb - 1, whose stage the next copy overwrites.
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int next = kb + STAGES - 1;
      if (next < k_blocks) load_stage(next % STAGES, next);
      cp_async_commit();
    }

    const uint32_t a_stage = a_lane + stage * Smem::kAStageBytes;
    const uint32_t b_stage = b_lane + stage * Smem::kBStageBytes;
    // k16 chunks of this k-block that hold any index below k: all of them except in the last block,
    // whose wholly zero-filled chunks are skipped, so that the chain has exactly ceil(k / 16)
    // steps (the fragments are still loaded: only the mma is predicated off).
    const int k_left = k - kb * BK;
    const int steps = k_left >= BK ? Cfg::K_STEPS : (k_left + kMmaK - 1) / kMmaK;
    // The k16 chunks of this k-block in increasing k: this order is the invariance contract.
#pragma unroll
    for (int ks = 0; ks < Cfg::K_STEPS; ++ks) {
      uint32_t af[TM][4];
      uint32_t bf[TN][2];
#pragma unroll
      for (int mi = 0; mi < TM; ++mi) {
        ldmatrix_x4<A_MN>(af[mi], a_stage + a_step_offset<ATile::kPitchBytes, A_MN>(mi, ks));
      }
#pragma unroll
      for (int nj = 0; nj < TN / 2; ++nj) {
        uint32_t r[4];
        ldmatrix_x4<B_MN>(r, b_stage + b_step_offset<BTile::kPitchBytes, B_MN>(nj, ks));
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
      if (ks == 0 || ks < steps) {
#pragma unroll
        for (int mi = 0; mi < TM; ++mi) {
#pragma unroll
          for (int ni = 0; ni < TN; ++ni) Mma<T>::run(acc[mi][ni], af[mi], bf[ni]);
        }
      }
    }
    stage = stage + 1 == STAGES ? 0 : stage + 1;
  }
  cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

  // Epilogue: + bias in fp32, one rounding (or fp32), bounds-checked pair stores.
#pragma unroll
  for (int ni = 0; ni < TN; ++ni) {
    const int col = col_base + ni * kMmaN;
    float bias0 = 0.f, bias1 = 0.f;
    const bool has_bias = bias != nullptr;
    if (has_bias) {
      if (col < n) bias0 = Convert<T>::to_float(bias[col]);
      if (col + 1 < n) bias1 = Convert<T>::to_float(bias[col + 1]);
    }
#pragma unroll
    for (int mi = 0; mi < TM; ++mi) {
      const int row = row_base + mi * kMmaM;
      float v0 = acc[mi][ni][0], v1 = acc[mi][ni][1], v2 = acc[mi][ni][2], v3 = acc[mi][ni][3];
      if (has_bias) {
        v0 += bias0;
        v1 += bias1;
        v2 += bias0;
        v3 += bias1;
      }
      store_pair<T, C_FP32>(c, ldc, m, n, row, col, v0, v1);
      store_pair<T, C_FP32>(c, ldc, m, n, row + 8, col, v2, v3);
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

template <typename T, bool A_MN, bool B_MN, bool C_FP32>
gpuError_t launch_sm80(const GemmProblem& p, gpuStream_t stream) {
  using Cfg = Sm80DefaultConfig;
  constexpr int kSmemBytes = Sm80Smem<Cfg, A_MN, B_MN>::kBytes;
  auto kernel = linear_gemm_sm80_kernel<T, Cfg, A_MN, B_MN, C_FP32>;
  static std::atomic<uint64_t> raised{0};
  const gpuError_t err = allow_dynamic_smem(kernel, kSmemBytes, raised);
  if (err != cudaSuccess) return err;
  const int64_t tiles_m = ceil_div(p.m, Cfg::BM), tiles_n = ceil_div(p.n, Cfg::BN);
  const int64_t tiles = tiles_m * tiles_n;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(tiles), Cfg::THREADS, kSmemBytes, stream>>>(
      static_cast<const T*>(p.a), p.lda, static_cast<const T*>(p.b), p.ldb, p.c, p.ldc,
      static_cast<const T*>(p.bias), p.c_accum, static_cast<int>(p.m), static_cast<int>(p.n),
      static_cast<int>(p.k), static_cast<int>(tiles_m), static_cast<int>(tiles_n));
  return cudaGetLastError();
}

template <typename T, bool C_FP32>
gpuError_t dispatch_layout(const GemmProblem& p, gpuStream_t stream) {
  if (!p.a_mn_major && !p.b_mn_major) return launch_sm80<T, false, false, C_FP32>(p, stream);
  if (!p.a_mn_major && p.b_mn_major) return launch_sm80<T, false, true, C_FP32>(p, stream);
  if (p.a_mn_major && !p.b_mn_major) return launch_sm80<T, true, false, C_FP32>(p, stream);
  return launch_sm80<T, true, true, C_FP32>(p, stream);
}

template <typename T>
gpuError_t dispatch_output(const GemmProblem& p, gpuStream_t stream) {
  if (p.c_fp32) return dispatch_layout<T, true>(p, stream);
  return dispatch_layout<T, false>(p, stream);
}

bool operand_ok(const void* ptr, int64_t ld) {
  return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % kGemmOperandAlignBytes == 0 &&
         ld > 0 && (ld * kElemBytes) % kGemmOperandAlignBytes == 0;
}

}  // namespace

gpuError_t linear_gemm_sm80(DType dtype, const GemmProblem& p, gpuStream_t stream) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return cudaErrorInvalidValue;
  if (p.m > kMaxDim || p.n > kMaxDim || p.k > kMaxDim) return cudaErrorInvalidValue;
  if (!operand_ok(p.a, p.lda) || !operand_ok(p.b, p.ldb)) return cudaErrorInvalidValue;
  if (p.c == nullptr || p.ldc <= 0) return cudaErrorInvalidValue;
  if (p.c_accum != nullptr && !p.c_fp32) return cudaErrorInvalidValue;
  if (p.tree_leaves > 1) return cudaErrorNotSupported;  // the tree runs leaf by leaf here
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype, [&](auto tag) { return dispatch_output<decltype(tag)>(p, stream); }, gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t linear_gemm_sm80(DType, const GemmProblem&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
