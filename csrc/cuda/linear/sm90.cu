// Hopper (sm_90a) GEMM for the linear ops: TMA bulk copies into a shared-memory ring, wgmma
// from shared memory, fp32 accumulators in registers, a persistent grid.
//
// Roles: warpgroup 0 is the producer (one thread issues TMA copies STAGES k-blocks ahead);
// warpgroups 1..CONSUMERS each own 64 rows of the BM x BN tile and run wgmma m64nBNk16.
//
// Invariance: every configuration below runs the same per-element arithmetic. The accumulator of
// C[i, j] starts at zero (or the saved fp32 accumulator) and takes the k16 chunks k = 0, 16, 32, ...
// in increasing order, one wgmma per chunk, whatever BM, BN, STAGES or the tile order are; rows
// beyond m are TMA zero fill, and the k tail is zero fill (exact zeros). The configuration is
// picked from the tile count for speed only; the GPU tests prove that every configuration gives
// the same bits (wgmma's per-element result does not depend on the instruction's n).
//
// Tree mode (TREE, linear_tree; common/gemm_problem.h): the k-blocks are `leaves` (2, 4 or 8) equal
// runs; each run accumulates from zero (scale-d = 0 on its first chunk) into one of two register
// sets (even leaves, odd leaves), and after each odd leaf the sets are folded as rank_sum's binary
// counter (common/rank_sum.h): slot 0 = the even leaf, slot 1 a third register set, slot 2 (only
// with 8 leaves: written once, read once per tile) shared memory. The adds are the tree's, in its
// order, so a tile gives the leaf GEMMs + rank_sum bits of the unfused flow (host/linear_tree.h).
#include "../linear_kernels.h"

#if !RL_ALIGN_HIP

#include <cstring>
#include <mutex>
#include <type_traits>

#include "../../primitives/sm90_async.h"
#ifdef RL_ALIGN_SM90A_DEVICE
#include "../../primitives/wgmma_instructions.h"
#endif

namespace rl_align {
namespace {

// k-block: 64 bf16/fp16 = 128 bytes, the span of the 128-byte swizzle that TMA writes and wgmma
// reads. Every operand tile is a stack of such 128-byte rows.
constexpr int kBlockK = 64;

// CLUSTER CTAs (consecutive row tiles of one column tile) share the B tile: each loads
// BN / CLUSTER of its columns and the copy engine multicasts them into every CTA of the cluster,
// which halves the L2 traffic of B for CLUSTER = 2.
template <int BM_, int BN_, int STAGES_, int CLUSTER_ = 1>
struct Sm90Config {
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr int STAGES = STAGES_;
  static constexpr int CLUSTER = CLUSTER_;
  static constexpr int CONSUMERS = BM / 64;
  static constexpr int THREADS = (CONSUMERS + 1) * kWarpgroupThreads;
  static constexpr int A_STAGE_BYTES = BM * kBlockK * 2;
  static constexpr int B_STAGE_BYTES = BN * kBlockK * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  // Ring + two mbarriers per stage + slack to align the ring to the swizzle atom.
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + kSwizzleAtomBytes;
  // Tree mode's slot 2: one fp32 accumulator tile, after the ring and the barriers.
  static constexpr int TREE_SLOT_BYTES = BM * BN * 4;
  static_assert(BM % 64 == 0 && BN % 16 == 0 && BN <= 256, "wgmma tile (the epilogue stores 16-column pairs)");
  static_assert((BN / CLUSTER) % 8 == 0, "multicast slices are whole swizzle atoms (8 rows of 128 bytes)");
};

// An MN-major B is loaded in whole 64-column rows of the 128-byte swizzle, per multicast slice
// too. (A 32-column tile in the 64-byte swizzle, twice the CTAs streaming a decode-size grad
// input's weight, ran slower than the 14-deep 64-column tile on every Qwen3-8B shape at M = 1 and
// 64: benchmarks/results/linear_tiles_decode_h200.csv, decode32 against decode64_deep.)
template <typename Cfg, bool B_MN>
__host__ __device__ constexpr bool config_takes_layout() {
  return !B_MN || (Cfg::BN / Cfg::CLUSTER) % 64 == 0;
}

// Decode (m <= 64): narrow column tiles so that enough CTAs stream the weight, and a deep ring so
// that enough of it is in flight; the K-major weight allows 32 or 48 columns, an MN-major one 64
// (a whole row of the 128-byte swizzle). The 64-column tile takes the
// ring's 14 stages that fit in shared memory (8 KB of the weight each, 112 KB in flight per CTA):
// with 8 stages a decode-size grad input took 3-21% longer (H200, issue-36 run 55).
using DecodeConfig = Sm90Config<64, 32, 16>;
using Decode48Config = Sm90Config<64, 48, 16>;
using DecodeMnConfig = Sm90Config<64, 64, 14>;
// Tree mode at decode size: slot 2's tile (16 KB) leaves room for 8 stages.
using TreeDecodeMnConfig = Sm90Config<64, 64, 8>;
using MediumConfig = Sm90Config<128, 128, 6>;
using MediumPairConfig = Sm90Config<128, 128, 6, 2>;
using WidePairConfig = Sm90Config<128, 192, 5, 2>;
using LargeConfig = Sm90Config<128, 256, 4, 2>;
// Tree mode above decode size: three 64-column-pair register sets per thread (acc, even leaf,
// slot 1) fit at BN = 128, not 256; five stages leave room for the slot-2 tile; pairs of row tiles
// share B (multicast), as LargeConfig's.
using TreeConfig = Sm90Config<128, 128, 5, 2>;
// The most leaves the kernel folds (slots 0, 1 in registers, 2 in shared memory).
constexpr int kTreeMaxLeaves = 8;
// A grouped problem's table in shared memory: the clamped offsets and the row tiles before each group.
constexpr int kGroupTableBytes = 2 * (kGroupedMaxGroups + 1) * 4;

// Rows of A that a decode-size K-major A tile loads when m <= 16: the other rows of the 64-row
// wgmma tile keep whatever shared memory held and only feed output rows >= m, which are never
// stored (an MMA row depends on its own A row alone).
constexpr int kDecodeSmallRows = 16;

struct Sm90Epilogue {
  void* c;
  int64_t ldc;
  const void* bias;
  const float* c_accum;
};

// A grouped problem's offsets (GemmProblem's group fields) and kReduction's C stride per group.
struct Sm90Groups {
  const void* offsets;
  int64_t c_stride;
  int count;
  bool int64;
};

#ifdef RL_ALIGN_SM90A_DEVICE

constexpr int kMmaK = 16;       // k depth of one wgmma
constexpr int kTileGroupM = 8;  // tile order: 8 row-tiles share each column sweep (L2 reuse)

// Byte offset of k16 chunk `s` in a k-block tile: 16 elements = 32 bytes along a K-major row; 16
// rows of 128 bytes down an MN-major tile.
template <bool MN_MAJOR>
__device__ __forceinline__ uint32_t chunk_offset(int s) {
  return MN_MAJOR ? s * kMmaK * kSwizzleRowBytes : s * kMmaK * 2;
}

__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int& mt, int& nt) {
  const int group = kTileGroupM * tiles_n;
  const int first_m = (tile / group) * kTileGroupM;
  const int rows = min(tiles_m - first_m, kTileGroupM);
  const int r = tile % group;
  mt = first_m + r % rows;
  nt = r / rows;
}

// fp32 output (weight gradients): each lane writes its column pair, 8 bytes.
__device__ __forceinline__ void store_pair_fp32(const Sm90Epilogue& ep, int64_t m, int64_t n,
                                                int64_t row, int64_t col, float v0, float v1) {
  if (row >= m || col >= n) return;
  const int64_t off = row * ep.ldc + col;
  float* c = static_cast<float*>(ep.c) + off;
  if (col + 1 < n && (off & 1) == 0) {
    *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
  } else {
    c[0] = v0;
    if (col + 1 < n) c[1] = v1;
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  struct alignas(4) Pair { T x, y; } pair{Convert<T>::from_float(v0), Convert<T>::from_float(v1)};
  uint32_t bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}

// 16-bit output: one row's two adjacent 8-column blocks (block j at col_j, block j+1 at col_j + 8)
// of a lane quad. The bias is added in fp32 and each value rounded once; then shuffles hand each
// lane 4 consecutive columns, so a quad writes 32 contiguous bytes (whole sectors) in one store.
template <typename T>
__device__ __forceinline__ void store_two_blocks(const Sm90Epilogue& ep, int64_t m, int64_t n,
                                                 int64_t row, int64_t col_j, int lane, float a0,
                                                 float a1, float b0, float b1) {
  const int q = lane % 4;
  if (ep.bias != nullptr) {
    const T* bias = static_cast<const T*>(ep.bias);
    const int64_t ca = col_j + 2 * q, cb = ca + 8;
    if (ca < n) a0 += Convert<T>::to_float(bias[ca]);
    if (ca + 1 < n) a1 += Convert<T>::to_float(bias[ca + 1]);
    if (cb < n) b0 += Convert<T>::to_float(bias[cb]);
    if (cb + 1 < n) b1 += Convert<T>::to_float(bias[cb + 1]);
  }
  const uint32_t pa = pack_pair<T>(a0, a1), pb = pack_pair<T>(b0, b1);
  const int src = (lane & ~3) + (q & 1) * 2;
  const uint32_t a_lo = __shfl_sync(0xffffffffu, pa, src), a_hi = __shfl_sync(0xffffffffu, pa, src + 1);
  const uint32_t b_lo = __shfl_sync(0xffffffffu, pb, src), b_hi = __shfl_sync(0xffffffffu, pb, src + 1);
  const uint32_t lo = q < 2 ? a_lo : b_lo, hi = q < 2 ? a_hi : b_hi;
  const int64_t col = col_j + (q >= 2 ? 8 : 0) + (q & 1) * 4;
  if (row >= m || col >= n) return;
  const int64_t off = row * ep.ldc + col;
  T* c = static_cast<T*>(ep.c) + off;
  if (col + 3 < n && (off & 3) == 0) {
    *reinterpret_cast<uint2*>(c) = make_uint2(lo, hi);
  } else {
    T vals[4];
    memcpy(vals, &lo, 4);
    memcpy(vals + 2, &hi, 4);
    for (int e = 0; e < 4 && col + e < n; ++e) c[e] = vals[e];
  }
}

// The group table of a grouped problem (common/gemm_problem.h, "Grouped"), built by one warp in
// shared memory: start[0 .. groups] the clamped offsets (o'_e = min(running max of o_1 .. o_e, rows),
// o'_0 = 0, o'_groups = rows), and for kRows tiles[0 .. groups] the row tiles of the groups before e
// (tiles[groups]: all of them). Each lane takes a run of entries; the running max and the tile
// counts are carried across lanes by warp scans.
__device__ __forceinline__ void load_group_table(const Sm90Groups& g, int rows, int bm, int* start, int* tiles) {
  const int lane = threadIdx.x % 32;
  const int entries = g.count + 1;
  const int per_lane = (entries + 31) / 32;
  const int first = lane * per_lane, last = min(first + per_lane, entries);
  int run = 0;
  for (int i = first; i < last; ++i) {
    int64_t v = i == g.count ? rows
                : i == 0     ? 0
                : g.int64    ? static_cast<const int64_t*>(g.offsets)[i]
                             : static_cast<const int32_t*>(g.offsets)[i];
    v = v < 0 ? 0 : (v > rows ? rows : v);
    run = max(run, static_cast<int>(v));
    start[i] = run;
  }
  int carried = run;  // inclusive max scan over lanes, then shifted: the max of the lanes before
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, carried, d);
    if (lane >= d) carried = max(carried, other);
  }
  int before = __shfl_up_sync(0xffffffffu, carried, 1);
  if (lane == 0) before = 0;
  for (int i = first; i < last; ++i) start[i] = max(start[i], before);
  __syncwarp();
  if (tiles == nullptr) return;
  int sum = 0;
  for (int i = first; i < last; ++i) {
    tiles[i] = sum;
    if (i < g.count) sum += (start[i + 1] - start[i] + bm - 1) / bm;
  }
  int total = sum;  // inclusive sum scan over lanes
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, total, d);
    if (lane >= d) total += other;
  }
  for (int i = first; i < last; ++i) tiles[i] += total - sum;
  __syncwarp();
}

// The group of global row tile `mt`: the last e with tiles[e] <= mt (groups without tiles skipped).
__device__ __forceinline__ int group_of_tile(const int* tiles, int groups, int mt) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tiles[mid] <= mt) lo = mid; else hi = mid - 1;
  }
  return lo;
}

#endif  // RL_ALIGN_SM90A_DEVICE

template <typename T, typename Cfg, bool A_MN, bool B_MN, bool C_FP32, bool HAS_ACCUM, bool TREE, GroupMode GROUP>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    linear_gemm_sm90_kernel(const __grid_constant__ CUtensorMap tma_a,
                            const __grid_constant__ CUtensorMap tma_b, Sm90Epilogue ep, int m,
                            int n, int k, uint32_t stage_tx_bytes, int leaves, Sm90Groups groups) {
#ifdef RL_ALIGN_SM90A_DEVICE
  constexpr int BM = Cfg::BM, BN = Cfg::BN, STAGES = Cfg::STAGES, CLUSTER = Cfg::CLUSTER;
  static_assert(GROUP == GroupMode::kNone || (CLUSTER == 1 && !TREE), "grouped tiles: no multicast, no tree");
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  uint8_t* ring = smem_raw + ((raw + kSwizzleAtomBytes - 1) / kSwizzleAtomBytes * kSwizzleAtomBytes - raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + STAGES * Cfg::STAGE_BYTES);
  uint64_t* empty = full + STAGES;
  // After the barriers: tree mode's slot 2, or a grouped problem's table.
  float* tree_slot = reinterpret_cast<float*>(empty + STAGES);
  int* group_start = reinterpret_cast<int*>(empty + STAGES);
  int* group_tiles = group_start + kGroupedMaxGroups + 1;
  auto a_stage = [&](int s) { return ring + s * Cfg::STAGE_BYTES; };
  auto b_stage = [&](int s) { return ring + s * Cfg::STAGE_BYTES + Cfg::A_STAGE_BYTES; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      // A stage is free once the consumers of every CTA it was multicast into are done with it.
      mbar_init(&empty[s], Cfg::CONSUMERS * CLUSTER);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (GROUP != GroupMode::kNone) {
    if (threadIdx.x < 32)
      load_group_table(groups, GROUP == GroupMode::kRows ? m : k, BM, group_start,
                       GROUP == GroupMode::kRows ? group_tiles : nullptr);
  }
  if constexpr (CLUSTER > 1) cluster_sync(); else __syncthreads();

  // The cluster walks units of CLUSTER row tiles x one column tile; CTA `rank` takes row tile
  // CLUSTER * unit_row + rank (past the last row tile: all zero fill, nothing stored). Grouped:
  // kRows walks every group's row tiles (the groups' tiles one after another) x column tiles;
  // kReduction walks each group's whole C (its units one after another).
  const uint32_t rank = CLUSTER > 1 ? cluster_rank() : 0;
  const int tiles_m = GROUP == GroupMode::kRows ? group_tiles[groups.count] : (m + BM - 1) / BM;
  const int units_m = (tiles_m + CLUSTER - 1) / CLUSTER;
  const int tiles_n = (n + BN - 1) / BN;
  const int group_units = units_m * tiles_n;
  const int num_units = GROUP == GroupMode::kReduction ? groups.count * group_units : group_units;
  const int first_unit = blockIdx.x / CLUSTER, unit_stride = gridDim.x / CLUSTER;
  const int k_blocks_all = (k + kBlockK - 1) / kBlockK;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;

  // A unit's tile: its first row (of A and C), its column tile, its group; kRows: the end of its
  // group's rows; kReduction: its group's tokens [k_begin, k_begin + k_len). The fields a mode
  // does not use are never read (row_end(), k_blocks_of(), k_first() below give the plain values).
  struct Tile {
    int row, row_end, nt, group, k_begin, k_len;
  };
  auto row_end_of = [&](const Tile& t) { return GROUP == GroupMode::kRows ? t.row_end : m; };
  auto k_blocks_of = [&](const Tile& t) {
    return GROUP == GroupMode::kReduction ? (t.k_len + kBlockK - 1) / kBlockK : k_blocks_all;
  };
  auto k_first = [&](const Tile& t) { return GROUP == GroupMode::kReduction ? t.k_begin : 0; };
  auto locate = [&](int unit) {
    Tile t{0, 0, 0, 0, 0, 0};
    int mu;
    if constexpr (GROUP == GroupMode::kRows) {
      tile_coords(unit, units_m, tiles_n, mu, t.nt);
      t.group = group_of_tile(group_tiles, groups.count, mu);
      t.row = group_start[t.group] + (mu - group_tiles[t.group]) * BM;
      t.row_end = group_start[t.group + 1];
    } else {
      if constexpr (GROUP == GroupMode::kReduction) {
        t.group = unit / group_units;
        unit -= t.group * group_units;
        t.k_begin = group_start[t.group];
        t.k_len = group_start[t.group + 1] - t.k_begin;
      }
      tile_coords(unit, units_m, tiles_n, mu, t.nt);
      t.row = (mu * CLUSTER + rank) * BM;
    }
    return t;
  };

  if (warpgroup == 0) {
    if constexpr (Cfg::CONSUMERS > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int unit = first_unit; unit < num_units; unit += unit_stride) {
        const Tile t = locate(unit);
        const int k_blocks = k_blocks_of(t);
        for (int kb = 0; kb < k_blocks; ++kb) {
          mbar_wait(&empty[stage], phase ^ 1);
          mbar_arrive_expect_tx(&full[stage], stage_tx_bytes);
          const int k0 = k_first(t) + kb * kBlockK;
          if constexpr (A_MN) {
            for (int c = 0; c < BM / 64; ++c)
              tma_load_2d(a_stage(stage) + c * kBlockK * kSwizzleRowBytes, &tma_a, &full[stage],
                          t.row + c * 64, k0);
          } else {
            tma_load_2d(a_stage(stage), &tma_a, &full[stage], k0, t.row);
          }
          // This CTA's slice of the B tile: columns [rank, rank + 1) * BN / CLUSTER. kRows: the
          // group's own B, the third coordinate of a 3-D map (its rows zero-filled past its end).
          constexpr int kSlice = BN / CLUSTER;
          auto load_b = [&](int offset, int inner, int outer) {
            if constexpr (CLUSTER > 1) {
              tma_load_2d_multicast(b_stage(stage) + offset, &tma_b, &full[stage], inner, outer,
                                    static_cast<uint16_t>((1u << CLUSTER) - 1));
            } else if constexpr (GROUP == GroupMode::kRows) {
              tma_load_3d(b_stage(stage) + offset, &tma_b, &full[stage], inner, outer, t.group);
            } else {
              tma_load_2d(b_stage(stage) + offset, &tma_b, &full[stage], inner, outer);
            }
          };
          if constexpr (B_MN) {
            for (int c = rank * kSlice / 64; c < (rank + 1) * kSlice / 64; ++c)
              load_b(c * kBlockK * kSwizzleRowBytes, t.nt * BN + c * 64, k0);
          } else {
            load_b(rank * kSlice * kSwizzleRowBytes, k0, t.nt * BN + rank * kSlice);
          }
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    __syncwarp();
  } else {
    if constexpr (Cfg::CONSUMERS > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    const int tid = threadIdx.x % kWarpgroupThreads;
    const int warp = tid / 32, lane = tid % 32;
    // A MN-major tiles hold 64-row chunks of A one after another; K-major tiles hold 128-byte rows.
    const uint32_t a_offset = A_MN ? consumer * kBlockK * kSwizzleRowBytes : consumer * 64 * kSwizzleRowBytes;
    constexpr uint32_t kMnChunkBytes = kBlockK * kSwizzleRowBytes;
    auto release = [&](int s) {
      if constexpr (CLUSTER > 1) {
        for (uint32_t r = 0; r < CLUSTER; ++r) mbar_arrive_cluster(&empty[s], r);
      } else {
        mbar_arrive(&empty[s]);
      }
    };
    float acc[BN / 2];
    int stage = 0;
    uint32_t phase = 0;
    for (int unit = first_unit; unit < num_units; unit += unit_stride) {
      const Tile t = locate(unit);
      const int k_blocks = k_blocks_of(t);
      // A kReduction group's C and accumulator (the others read the kernel parameter itself).
      Sm90Epilogue group_ep = ep;
      if constexpr (GROUP == GroupMode::kReduction) {
        group_ep.c = static_cast<uint8_t*>(ep.c) + t.group * groups.c_stride * (C_FP32 ? 4 : sizeof(T));
        if (ep.c_accum != nullptr) group_ep.c_accum = ep.c_accum + t.group * groups.c_stride;
      }
      const Sm90Epilogue& tile_ep = GROUP == GroupMode::kReduction ? group_ep : ep;
      const int row_end = row_end_of(t);
      // Accumulator fragment of m64nBN: thread row = 16 * warp + lane / 4 (+ 8), column pair
      // 8 * j + 2 * (lane % 4); registers 4j, 4j+1 on the first row, 4j+2, 4j+3 eight rows down.
      const int64_t row0 = static_cast<int64_t>(t.row) + consumer * 64 + warp * 16 + lane / 4;
      const int64_t col0 = static_cast<int64_t>(t.nt) * BN + 2 * (lane % 4);
      // A saved accumulator (chained weight gradients) is loaded into the registers; otherwise the
      // first chunk runs with scale-d = 0. Registers written by ordinary code serialize the wgmma
      // pipeline (ptxas C7515), so only the chained variant pays for it.
      if constexpr (HAS_ACCUM) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = row0 + 8 * h, col = col0 + 8 * j;
            const float* src = tile_ep.c_accum + row * ep.ldc + col;
            acc[4 * j + 2 * h] = row < row_end && col < n ? src[0] : 0.f;
            acc[4 * j + 2 * h + 1] = row < row_end && col + 1 < n ? src[1] : 0.f;
          }
        }
        fence_accumulators(acc);
      }
      // Issues k-blocks [kb_begin, kb_end) into d (from zero: scale-d = 0 on the first chunk, if
      // `fresh`), keeping one k-block's MMAs in flight; drain() waits for all of them. Two leaves
      // (two register sets) go back to back without a drain between them.
      int held_stage = -1;
      auto issue = [&](float (&d)[BN / 2], int kb_begin, int kb_end, bool fresh) {
        for (int kb = kb_begin; kb < kb_end; ++kb) {
          mbar_wait(&full[stage], phase);
          // The stage's descriptors; each k16 chunk's is an offset from them (smem_desc_at).
          const uint64_t a_desc = smem_desc(smem_addr(a_stage(stage)) + a_offset, kMnChunkBytes, kSwizzleAtomBytes);
          const uint64_t b_desc = smem_desc(smem_addr(b_stage(stage)), kMnChunkBytes, kSwizzleAtomBytes);
          wgmma_fence();
          // The k16 chunks go in increasing k: this order is the invariance contract.
#pragma unroll
          for (int s = 0; s < kBlockK / kMmaK; ++s) {
            Wgmma<BN, T>::template mma<A_MN ? 1 : 0, B_MN ? 1 : 0>(
                d, smem_desc_at(a_desc, chunk_offset<A_MN>(s)),
                smem_desc_at(b_desc, chunk_offset<B_MN>(s)),
                !fresh || kb > kb_begin || s > 0);
          }
          wgmma_commit();
          // Keep this k-block's MMAs in flight; the previous block's are done, free its stage.
          wgmma_wait<1>();
          if (held_stage >= 0 && tid == 0) release(held_stage);
          held_stage = stage;
          if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
          }
        }
      };
      auto drain = [&] {
        wgmma_wait<0>();
        if (held_stage >= 0 && tid == 0) release(held_stage);
        held_stage = -1;
      };
      auto store_tile = [&](const float (&d)[BN / 2]) {
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = row0 + 8 * h;
            const int a = 4 * j + 2 * h, b = a + 4;  // block j's pair, block j + 1's pair
            if constexpr (C_FP32) {
              store_pair_fp32(tile_ep, row_end, n, row, col0 + 8 * j, d[a], d[a + 1]);
              store_pair_fp32(tile_ep, row_end, n, row, col0 + 8 * j + 8, d[b], d[b + 1]);
            } else {
              store_two_blocks<T>(tile_ep, row_end, n, row, col0 - 2 * (lane % 4) + 8 * j, lane, d[a],
                                  d[a + 1], d[b], d[b + 1]);
            }
          }
        }
      };
      if constexpr (GROUP == GroupMode::kReduction) {
        // A group's chain over its own tokens: whole k-blocks, then a partial block whose rows
        // past the group's end (the next group's tokens, or zero fill) are zeroed in shared memory
        // first, so the group's sums take exact zeros there as an ungrouped GEMM of its tokens.
        if (k_blocks == 0) {  // no tokens: the accumulator as it is, or zero
          if constexpr (HAS_ACCUM) {
            store_tile(acc);
          } else {
            float zero[BN / 2];  // not acc: ordinary writes to wgmma registers serialize it (C7515)
#pragma unroll
            for (int e = 0; e < BN / 2; ++e) zero[e] = 0.f;
            store_tile(zero);
          }
          continue;
        }
        const int whole = t.k_len / kBlockK, tail = t.k_len % kBlockK;
        issue(acc, 0, whole, !HAS_ACCUM);
        if (tail != 0) {
          drain();
          mbar_wait(&full[stage], phase);
          auto zero_rows = [&](uint8_t* chunk) {
            uint4* p = reinterpret_cast<uint4*>(chunk + tail * kSwizzleRowBytes);
            for (int i = tid; i < (kBlockK - tail) * kSwizzleRowBytes / 16; i += kWarpgroupThreads)
              p[i] = make_uint4(0u, 0u, 0u, 0u);
          };
          zero_rows(a_stage(stage) + consumer * kMnChunkBytes);
          for (int c = consumer; c < BN / 64; c += Cfg::CONSUMERS) zero_rows(b_stage(stage) + c * kMnChunkBytes);
          fence_proxy_async();  // the zeros before the wgmma's (async proxy) reads
          named_bar_sync(1, Cfg::CONSUMERS * kWarpgroupThreads);
          issue(acc, whole, whole + 1, !HAS_ACCUM && whole == 0);
        }
        drain();
        fence_accumulators(acc);
        store_tile(acc);
      } else if constexpr (!TREE) {
        issue(acc, 0, k_blocks, !HAS_ACCUM);
        drain();
        fence_accumulators(acc);
        store_tile(acc);
      } else {
        // Slot 0 (the even leaf) and slot 1 in registers; slot 2 in this thread's column of
        // shared memory (consecutive threads, consecutive words).
        float even[BN / 2], slot1[BN / 2];
        float* slot2 = tree_slot + consumer * kWarpgroupThreads * (BN / 2) + tid;
        const int leaf_blocks = k_blocks / leaves;
        // Leaves in pairs (even into `even`, odd into `acc`, back to back); a pair's end is the
        // only place the loop may stop, with no MMA in flight (a branch while MMAs are in flight
        // makes ptxas serialize them).
#pragma unroll
        for (int pair = 0; pair < kTreeMaxLeaves / 2; ++pair) {
          if (2 * pair >= leaves) break;
          const int leaf = 2 * pair + 1;
          issue(even, (leaf - 1) * leaf_blocks, leaf * leaf_blocks, true);
          issue(acc, leaf * leaf_blocks, (leaf + 1) * leaf_blocks, true);
          drain();
          fence_accumulators(even);
          fence_accumulators(acc);
          // rank_sum's counter after part `leaf` (odd): carry = slot0 + part, then up through
          // the set bits of `leaf`, each time slot + carry.
#pragma unroll
          for (int e = 0; e < BN / 2; ++e) {
            const float sum = __fadd_rn(even[e], acc[e]);
            if (pair % 2 == 0) {  // leaf 1 or 5
              slot1[e] = sum;
            } else if (pair == 1) {  // leaf 3
              slot1[e] = __fadd_rn(slot1[e], sum);
              if (leaves > 4) slot2[e * kWarpgroupThreads] = slot1[e];
            } else {  // leaf 7
              slot1[e] = __fadd_rn(slot2[e * kWarpgroupThreads], __fadd_rn(slot1[e], sum));
            }
          }
        }
        // The last leaf's carry went all the way up: slot 1 holds the root.
        store_tile(slot1);
      }
    }
  }
  // No CTA may leave while a partner can still multicast into it or arrive on its barriers.
  if constexpr (CLUSTER > 1) cluster_sync();
#endif  // RL_ALIGN_SM90A_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

// A row-major [outer, inner] operand read in boxes of [box_outer, 64] (128-byte swizzle). Out of
// range rows and columns read as zeros. groups > 1: `groups` such matrices group_stride elements
// apart, a 3-D map read one group at a time (each group's rows zero-filled past its own end).
bool encode_operand(CUtensorMap* map, DType dtype, const void* ptr, int64_t inner, int64_t outer,
                    int64_t ld, int box_outer, int64_t groups = 1, int64_t group_stride = 0) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer),
                              static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld) * 2, static_cast<cuuint64_t>(group_stride) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBlockK), static_cast<cuuint32_t>(box_outer), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(
      map, dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      groups > 1 ? 3 : 2, const_cast<void*>(ptr), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

template <typename T, typename Cfg, bool A_MN, bool B_MN, bool C_FP32, bool HAS_ACCUM, bool TREE,
          GroupMode GROUP = GroupMode::kNone>
gpuError_t launch_sm90(DType dtype, const GemmProblem& p, gpuStream_t stream) {
  auto kernel = linear_gemm_sm90_kernel<T, Cfg, A_MN, B_MN, C_FP32, HAS_ACCUM, TREE, GROUP>;
  constexpr int kSmemBytes = Cfg::SMEM_BYTES + (TREE ? Cfg::TREE_SLOT_BYTES : 0) +
                             (GROUP != GroupMode::kNone ? kGroupTableBytes : 0);
  static std::once_flag once;
  static int blocks_per_sm = 0;
  static gpuError_t setup_error = cudaSuccess;
  std::call_once(once, [&] {
    setup_error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kSmemBytes);
    if (setup_error == cudaSuccess)
      setup_error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                                  Cfg::THREADS, kSmemBytes);
  });
  if (setup_error != cudaSuccess) return setup_error;
  CUtensorMap map_a, map_b;
  // A: K-major [m, k] boxes of [a_rows, 64]; MN-major [k, m] boxes of [64 k, 64 m].
  const int a_rows = !A_MN && Cfg::BM == 64 && p.m <= kDecodeSmallRows ? kDecodeSmallRows : Cfg::BM;
  const bool ok_a = A_MN ? encode_operand(&map_a, dtype, p.a, p.m, p.k, p.lda, kBlockK)
                         : encode_operand(&map_a, dtype, p.a, p.k, p.m, p.lda, a_rows);
  // kRows: B is the groups' matrices, a 3-D map.
  const int64_t b_groups = GROUP == GroupMode::kRows ? p.groups : 1;
  const bool ok_b = B_MN ? encode_operand(&map_b, dtype, p.b, p.n, p.k, p.ldb, kBlockK, b_groups, p.b_group_stride)
                         : encode_operand(&map_b, dtype, p.b, p.k, p.n, p.ldb, Cfg::BN / Cfg::CLUSTER, b_groups,
                                          p.b_group_stride);
  if (!ok_a || !ok_b) return cudaErrorInvalidValue;
  const uint32_t tx_bytes = (A_MN ? Cfg::A_STAGE_BYTES : a_rows * kSwizzleRowBytes) + Cfg::B_STAGE_BYTES;
  // Units of work: kRows has at most one partial row tile per group more than the ungrouped rows;
  // kReduction has each group's whole C.
  int64_t units = ceil_div(ceil_div(p.m, Cfg::BM), Cfg::CLUSTER) * ceil_div(p.n, Cfg::BN);
  if (GROUP == GroupMode::kRows) units = (ceil_div(p.m, Cfg::BM) + p.groups) * ceil_div(p.n, Cfg::BN);
  if (GROUP == GroupMode::kReduction) units *= p.groups;
  const int64_t slots = static_cast<int64_t>(multiprocessor_count(current_device())) *
                        (blocks_per_sm > 0 ? blocks_per_sm : 1) / Cfg::CLUSTER;
  const int grid = static_cast<int>((units < slots ? units : slots) * Cfg::CLUSTER);
  const Sm90Epilogue ep{p.c, p.ldc, p.bias, p.c_accum};
  const Sm90Groups groups{p.group_offsets, p.c_group_stride, static_cast<int>(p.groups), p.group_offsets_int64};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(Cfg::THREADS);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = Cfg::CLUSTER;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  const gpuError_t err = cudaLaunchKernelEx(&config, kernel, map_a, map_b, ep, static_cast<int>(p.m),
                                            static_cast<int>(p.n), static_cast<int>(p.k), tx_bytes,
                                            static_cast<int>(TREE ? p.tree_leaves : 1), groups);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <typename Cfg>
struct ConfigTag {
  using type = Cfg;
};

// Tiles of BN columns, taking whole waves of `slots` units of `rows` row tiles each.
inline int64_t waves(int64_t m, int64_t n, int bm, int bn, int rows, int64_t slots) {
  return ceil_div(ceil_div(ceil_div(m, bm), rows) * ceil_div(n, bn), slots);
}

// The configuration kAuto takes for a plain chain of shape (m, n), from the time it would take:
// whole waves of the persistent grid times the tile's width, over the tile's relative speed. The
// H100 measurements behind it (benchmarks/results/h100.md, "GEMM tiles"): the weight-streaming
// decode tiles go 48 wide where that saves a wave; above decode size a pair of row tiles sharing B
// (multicast) beats a lone tile by up to 1.45x (the rows of B are read from L2 half as often), and a
// 192- or 256-column tile does ~5% / ~8% more per column than a 128-column one.
template <bool B_MN>
Sm90GemmConfig choose_config(const GemmProblem& p) {
  const int64_t sms = multiprocessor_count(current_device());
  if (p.m <= 64) {
    // An MN-major weight (grad input): the 64-column tiles with their deep ring beat the 32-column
    // ones on every Qwen3-8B shape at M = 1 and 64 (H200, run 55: 0.78-1.00x cuBLAS against
    // 0.67-0.95x), with half as many tiles reading A from L2.
    if (B_MN) return Sm90GemmConfig::kDecode64;
    const int64_t narrow = waves(p.m, p.n, 64, 32, 1, sms) * 32;
    return waves(p.m, p.n, 64, 48, 1, sms) * 48 <= narrow ? Sm90GemmConfig::kDecode48 : Sm90GemmConfig::kDecode32;
  }
  if (p.m <= 128) {  // one row tile: nothing to share B with
    return ceil_div(p.n, LargeConfig::BN) < sms ? Sm90GemmConfig::kMedium : Sm90GemmConfig::kLarge;
  }
  const int64_t pairs = sms / 2;
  struct Candidate {
    Sm90GemmConfig config;
    int bn;
    double speed;
  };
  const Candidate candidates[] = {{Sm90GemmConfig::kMediumPair, 128, 1.0},
                                  {Sm90GemmConfig::kWidePair, 192, 1.05},
                                  {Sm90GemmConfig::kLarge, 256, 1.08}};
  Sm90GemmConfig best = Sm90GemmConfig::kLarge;
  double best_time = 0.0;
  for (const Candidate& c : candidates) {
    if (c.config == Sm90GemmConfig::kWidePair && !config_takes_layout<WidePairConfig, B_MN>()) continue;
    const double time = static_cast<double>(waves(p.m, p.n, 128, c.bn, 2, pairs) * c.bn) / c.speed;
    if (best_time == 0.0 || time < best_time) {
      best = c.config;
      best_time = time;
    }
  }
  return best;
}

template <typename T, bool A_MN, bool B_MN, bool C_FP32, bool HAS_ACCUM, bool TREE = false>
gpuError_t dispatch_config(DType dtype, const GemmProblem& p, Sm90GemmConfig forced, gpuStream_t stream) {
  auto launch = [&](auto tag) -> gpuError_t {
    using Cfg = typename decltype(tag)::type;
    if constexpr (config_takes_layout<Cfg, B_MN>()) {
      return launch_sm90<T, Cfg, A_MN, B_MN, C_FP32, HAS_ACCUM, TREE>(dtype, p, stream);
    } else {
      return cudaErrorNotSupported;
    }
  };
  if constexpr (TREE) {  // its own tiles (three register sets), forced or not
    if (p.m <= 64) return launch(ConfigTag<typename std::conditional<B_MN, TreeDecodeMnConfig, DecodeConfig>::type>{});
    return launch(ConfigTag<TreeConfig>{});
  } else {
    switch (forced == Sm90GemmConfig::kAuto ? choose_config<B_MN>(p) : forced) {
      case Sm90GemmConfig::kDecode32: return launch(ConfigTag<DecodeConfig>{});
      case Sm90GemmConfig::kDecode48: return launch(ConfigTag<Decode48Config>{});
      case Sm90GemmConfig::kDecode64: return launch(ConfigTag<DecodeMnConfig>{});
      case Sm90GemmConfig::kMedium: return launch(ConfigTag<MediumConfig>{});
      case Sm90GemmConfig::kMediumPair: return launch(ConfigTag<MediumPairConfig>{});
      case Sm90GemmConfig::kWidePair: return launch(ConfigTag<WidePairConfig>{});
      case Sm90GemmConfig::kLarge: return launch(ConfigTag<LargeConfig>{});
      default: return cudaErrorInvalidValue;
    }
  }
}

// Grouped rows (forward, grad input): groups of at most 64 rows on average take 64-row tiles (less
// of each tile past its group's end), wide enough that the rows are read few times per weight;
// larger ones, and the weight gradients (kReduction), linear's large tile without multicast (a pair
// of row tiles may straddle two groups); a chained weight gradient (its accumulator loaded into the
// registers) the medium tile, where the large one spills. Speed only: every configuration gives the
// same bits.
using GroupedSmallConfig = Sm90Config<64, 128, 8>;
using GroupedLargeConfig = Sm90Config<128, 256, 4>;

template <typename T, bool A_MN, bool B_MN, bool C_FP32, bool HAS_ACCUM, GroupMode GROUP>
gpuError_t dispatch_grouped(DType dtype, const GemmProblem& p, gpuStream_t stream) {
  if constexpr (GROUP == GroupMode::kRows) {
    if (p.m <= 64 * p.groups)
      return launch_sm90<T, GroupedSmallConfig, A_MN, B_MN, C_FP32, HAS_ACCUM, false, GROUP>(dtype, p, stream);
  }
  if constexpr (HAS_ACCUM) {
    return launch_sm90<T, MediumConfig, A_MN, B_MN, C_FP32, HAS_ACCUM, false, GROUP>(dtype, p, stream);
  } else {
    return launch_sm90<T, GroupedLargeConfig, A_MN, B_MN, C_FP32, HAS_ACCUM, false, GROUP>(dtype, p, stream);
  }
}

// The layouts and outputs the linear ops use: forward, also as fp32 leaf sums (linear_tree); grad input, also as fp32 partial sums
// continued from an accumulator (linear_logprob's vocabulary slices); grad weight as fp32
// (chained) or in the input dtype (linear_logprob's weight gradient for autograd).
template <typename T>
gpuError_t dispatch_layout(DType dtype, const GemmProblem& p, Sm90GemmConfig config, gpuStream_t stream) {
  const bool accum = p.c_accum != nullptr;
  if (accum && !p.c_fp32) return cudaErrorNotSupported;
  if (p.group_mode != GroupMode::kNone) {  // grouped_linear
    if (p.tree_leaves > 1 || p.bias != nullptr || p.groups < 1 || p.groups > kGroupedMaxGroups)
      return cudaErrorNotSupported;
    if (p.group_mode == GroupMode::kRows) {  // forward, grad input
      if (p.a_mn_major || p.c_fp32) return cudaErrorNotSupported;
      if (p.b_mn_major) return dispatch_grouped<T, false, true, false, false, GroupMode::kRows>(dtype, p, stream);
      return dispatch_grouped<T, false, false, false, false, GroupMode::kRows>(dtype, p, stream);
    }
    if (!p.a_mn_major || !p.b_mn_major) return cudaErrorNotSupported;  // grad weight
    if (!p.c_fp32) return dispatch_grouped<T, true, true, false, false, GroupMode::kReduction>(dtype, p, stream);
    if (accum) return dispatch_grouped<T, true, true, true, true, GroupMode::kReduction>(dtype, p, stream);
    return dispatch_grouped<T, true, true, true, false, GroupMode::kReduction>(dtype, p, stream);
  }
  if (p.tree_leaves > 1) {  // linear_tree: forward or grad input, fp32 partial or rounded
    if (accum || p.a_mn_major || !linear_gemm_sm90_tree_supported(p.k, p.tree_leaves))
      return cudaErrorNotSupported;
    if (p.b_mn_major) {
      if (p.bias != nullptr) return cudaErrorNotSupported;
      if (p.c_fp32) return dispatch_config<T, false, true, true, false, true>(dtype, p, config, stream);
      return dispatch_config<T, false, true, false, false, true>(dtype, p, config, stream);
    }
    if (p.c_fp32) {
      if (p.bias != nullptr) return cudaErrorNotSupported;
      return dispatch_config<T, false, false, true, false, true>(dtype, p, config, stream);
    }
    return dispatch_config<T, false, false, false, false, true>(dtype, p, config, stream);
  }
  if (!p.a_mn_major && !p.b_mn_major && !p.c_fp32)
    return dispatch_config<T, false, false, false, false>(dtype, p, config, stream);  // forward
  if (!p.a_mn_major && !p.b_mn_major && !accum && p.bias == nullptr)  // a tree-mode leaf (linear_tree)
    return dispatch_config<T, false, false, true, false>(dtype, p, config, stream);
  if (p.bias != nullptr) return cudaErrorNotSupported;
  if (!p.a_mn_major && p.b_mn_major) {  // grad input
    if (!p.c_fp32) return dispatch_config<T, false, true, false, false>(dtype, p, config, stream);
    if (accum) return dispatch_config<T, false, true, true, true>(dtype, p, config, stream);
    return dispatch_config<T, false, true, true, false>(dtype, p, config, stream);
  }
  if (p.a_mn_major && p.b_mn_major) {  // grad weight
    if (!p.c_fp32) return dispatch_config<T, true, true, false, false>(dtype, p, config, stream);
    if (accum) return dispatch_config<T, true, true, true, true>(dtype, p, config, stream);
    return dispatch_config<T, true, true, true, false>(dtype, p, config, stream);
  }
  return cudaErrorNotSupported;
}

}  // namespace

bool linear_gemm_sm90_tree_supported(int64_t k, int64_t leaves) {
  return (leaves == 2 || leaves == 4 || leaves == kTreeMaxLeaves) && k % (leaves * kBlockK) == 0;
}

bool gemm_sm90_compiled_for(int device) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, linear_gemm_sm90_kernel<bfloat16_t, LargeConfig, false, false,
                                                           false, false, false, GroupMode::kNone>) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  int major = 0, minor = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  // The sm_90a cubin (binaryVersion 90) runs only on compute capability 9.0.
  return major == 9 && minor == 0 && attr.binaryVersion == 90 && tensor_map_encoder() != nullptr;
}

gpuError_t linear_gemm_sm90(DType dtype, const GemmProblem& p, gpuStream_t stream, Sm90GemmConfig config) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return cudaErrorInvalidValue;
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX) return cudaErrorInvalidValue;
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype, [&](auto tag) { return dispatch_layout<decltype(tag)>(dtype, p, config, stream); },
      gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
bool gemm_sm90_compiled_for(int) { return false; }
bool linear_gemm_sm90_tree_supported(int64_t, int64_t) { return false; }
gpuError_t linear_gemm_sm90(DType, const GemmProblem&, gpuStream_t, Sm90GemmConfig) {
  return hipErrorNotSupported;
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
