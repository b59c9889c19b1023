// Hopper (sm_90a) attention backward: the sm80 backward's arithmetic (sm80_bwd.cu
// header: delta, then dK/dV from the keys' side, then dQ from the queries' side, no atomics) on
// wgmma + TMA.
//
//   dK/dV  CTA = (sequence, kv head g, tile of 128 keys): consumer warpgroup c owns keys
//          64 c .. 64 c + 63 of the tile (K, V resident in shared memory); the producer streams
//          (head, query block of 64) pairs, head-major, blocks increasing, through a TMA ring of
//          Q and dO. Per block: S^T = K Q^T (SS), P^T = ex2(fma(S^T, scale log2(e), -lse log2(e)))
//          masked -> +0, dV += P^T dO (RS, 4 k16 query chunks increasing), dP^T = V dO^T (SS),
//          dS^T = P^T (dP^T - delta) masked -> +0, dK += dS^T Q (RS); dK *= scale at the end.
//          dP^T is issued right after S^T, so that it runs on the tensor cores while P^T is
//          computed (likewise dP after S in the dQ kernel), and a block's last product (dK, dQ)
//          is waited for at the next block's first wait (ConsumerRing).
//   dQ     CTA = (sequence, kv head g, tile of 128 rows, row = query i of head g G + r, GQA packed
//          as in the forward): consumer c owns rows 64 c ..; the producer streams 64-key K/V blocks.
//          Per block: S = Q K^T, P, dP = dO V^T, dS = P (dP - delta), dQ += dS K (RS, 4 k16 key
//          chunks); dQ *= scale at the end.
//   dQ, ordered (the default where no sequence has more than kOrderedDqMaxKvLen keys): no dQ
//          kernel; inside dK/dV each block's dS goes to shared memory and the block's dQ rows take
//          dQ += dS K from the key tiles in increasing order, by turns (ORDERED_DQ below).
// Every per-element step is the sm80 kernels' (same rounding intrinsics, same k16 chunk orders,
// same skipped / masked pairs), and wgmma rounds as mma.sync does: the bits are the sm80
// backward's (delta is the sm80 path's own kernel).
//
// Rows past a sequence in a TMA box (the next sequence's tokens): Q and dO rows past q_len (dK/dV)
// and K rows past kv_len (dQ) are zeroed in shared memory before use, as the sm80 kernels' zero
// fill. Masked pairs of the causal diagonal whose partner row is non-finite: any non-finite
// gradient sets the status word, and the EXACT instantiations then recompute, running the
// diagonal's products by cuts.
#include <atomic>
#include <type_traits>

#include "sm90_common.h"

#if !RL_ALIGN_HIP
#if defined(__CUDA_ARCH__) && !defined(RL_ALIGN_SM90A_DEVICE)
// Device passes for other archs compile no kernel body: the constants only a body reads are unused.
#pragma nv_diag_suppress 177
#endif
namespace rl_align {
namespace {

constexpr int kTileRows = kBoxRows;  // rows of a wgmma m64 tile: one box
constexpr float kLog2e = 1.4426950408889634f;

template <int HEAD_DIM_, int STAGES_>
struct BwdConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int STAGES = STAGES_;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = (CONSUMERS + 1) * 128;
  static constexpr int ROWS = CONSUMERS * kTileRows;    // keys (dK/dV) or rows (dQ) per CTA
  static constexpr int D_BOXES = HEAD_DIM / kBoxElems;
  static constexpr int D_STEPS = HEAD_DIM / 16;
  static constexpr int TILE_BYTES = D_BOXES * kBoxBytes;  // 64 rows x head_dim
  // Resident: two tiles per consumer (K and V, or Q and dO); ring: two tiles per stage (Q and dO,
  // or K and V).
  static constexpr int RESIDENT_BYTES = 2 * CONSUMERS * TILE_BYTES;
  static constexpr int STAGE_BYTES = 2 * TILE_BYTES;
  // Per stage, after the ring: dK/dV's fp32 lse log2(e) and delta of the stage's 64 queries.
  // The row values are padded to 1024 bytes: the scratch past the ring holds 128-byte-swizzle tiles.
  static constexpr int ROW_VALUES = 2 * kTileRows;
  static constexpr int RING_BYTES = STAGES * STAGE_BYTES + (STAGES * ROW_VALUES * 4 + 1023) / 1024 * 1024;
  // full, empty per stage; resident ready, tail, resident free; the ordered dQ's sums loaded, read,
  // stored; dK/dV's row values free per stage; the ordered dQ's turn passed on
  static constexpr int BARRIERS = 3 * STAGES + 7;
  static constexpr int SMEM_BYTES = 1024 + RESIDENT_BYTES + RING_BYTES + BARRIERS * 8;
  // 1024 bytes past the ring (after the barriers), the EXACT kernels keep a cut scratch per consumer
  // (rs_product_by_cuts) and the ordered dQ its dS tiles, [2 buffers][consumer] 64 keys x 64
  // queries, then a query block's fp32 dQ sums as TMA boxes of 64 rows x 32 columns.
  static constexpr int SCRATCH_OFFSET = RESIDENT_BYTES + RING_BYTES + 1024;
  static_assert(SCRATCH_OFFSET % 1024 == 0, "the scratch's swizzled tiles need 1024-byte alignment");
  static constexpr int EXACT_SMEM_BYTES = 1024 + SCRATCH_OFFSET + CONSUMERS * D_BOXES * kCutBoxBytes;
  static constexpr int DS_BYTES = 2 * CONSUMERS * kBoxBytes;
  static constexpr int ACC_BOX_COLUMNS = kSwizzleRowBytes / 4;  // fp32 columns per 128-byte box row
  static constexpr int ACC_BYTES = kTileRows * HEAD_DIM * 4;
  static constexpr int ORDERED_SMEM_BYTES = 1024 + SCRATCH_OFFSET + DS_BYTES + ACC_BYTES;
  static_assert(BARRIERS * 8 <= 1024, "barriers before the scratch");
  // The ordered dQ: consumer c < DQ_WORKERS owns dQ's columns 64 c .. 64 c + 63 (one box).
  static constexpr int DQ_WORKERS = D_BOXES;
  static_assert(DQ_WORKERS <= CONSUMERS, "a dQ box per consumer at most");
};

#ifdef RL_ALIGN_SM90A_DEVICE
constexpr int kConsumerBar = 1;  // + consumer: one warpgroup's named barrier
constexpr int kDsReadyBar = 3;   // the ordered dQ: both consumers' dS tiles are stored

// Zeroes rows [first, 64) of `boxes` 128-byte-swizzle boxes (whole rows: the swizzle permutes
// within a row), by one warp; then makes the writes visible to the async proxy.
__device__ __forceinline__ void zero_rows(uint8_t* tile, int boxes, int first, int lane) {
  const int per_box = (kTileRows - first) * 8;
  for (int i = lane; i < boxes * per_box; i += 32) {
    const int box = i / per_box, r = i % per_box;
    *reinterpret_cast<uint4*>(tile + box * kBoxBytes + (first + r / 8) * 128 + (r % 8) * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  __syncwarp();
}

// The producer's side of a TMA ring whose stage holds two tiles (Q and dO, or K and V) of 64 rows x
// D_BOXES boxes, the second tile_bytes after the first. load(): once the consumers released the
// next stage, rows (c1, c2) of both maps land in it and publish it on `full`; where the rows run
// past the sequence's end at row `valid` < 64, they land on `tail`, rows valid.. become zeros (the
// sm80 kernels' zero fill: the next sequence's tokens), and then the stage is published.
template <int STAGES, int D_BOXES>
struct PairRingProducer {
  uint8_t* ring;
  int stage_bytes, tile_bytes;
  uint64_t *full, *empty, *tail;
  int stage = 0;
  uint32_t phase = 0, tail_phase = 0;
  __device__ __forceinline__ void load(const CUtensorMap* a_map, const CUtensorMap* b_map, int c1, int c2, int valid,
                                       int lane) {
    mbar_wait(&empty[stage], phase ^ 1);
    const bool is_tail = valid < kTileRows;
    uint64_t* bar = is_tail ? tail : &full[stage];
    uint8_t* a = ring + stage * stage_bytes;
    uint8_t* b = a + tile_bytes;
    if (lane == 0) {
      mbar_arrive_expect_tx(bar, 2 * tile_bytes);
      for (int box = 0; box < D_BOXES; ++box) {
        tma_load_3d(a + box * kBoxBytes, a_map, bar, box * kBoxElems, c1, c2);
        tma_load_3d(b + box * kBoxBytes, b_map, bar, box * kBoxElems, c1, c2);
      }
    }
    if (is_tail) {
      mbar_wait(tail, tail_phase);
      tail_phase ^= 1;
      zero_rows(a, D_BOXES, valid, lane);
      zero_rows(b, D_BOXES, valid, lane);
      if (lane == 0) mbar_arrive(&full[stage]);
    }
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Both kernels' shared memory, from the dynamic allocation aligned up to 1024 bytes: two resident
// tiles per consumer ([consumer][64 rows][D] each: K and V for dK/dV, Q and dO for dQ), the ring
// of two-tile stages (Q and dO, or K and V), its row values ([stage][ROW_VALUES] fp32, dK/dV's),
// the barriers (BwdConfig::BARRIERS, in its order), then the scratch 1024 bytes past the ring
// (BwdConfig::SCRATCH_OFFSET).
template <typename Cfg>
struct BwdSmem {
  uint8_t *resident_a, *resident_b, *ring;
  float* row_values;
  uint64_t *full, *empty, *resident_ready, *tail, *resident_free;
  uint64_t *acc_full, *acc_empty, *acc_stored, *rows_free, *acc_released;
  uint8_t* scratch;
  __device__ __forceinline__ explicit BwdSmem(uint8_t* smem_raw) {
    uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    resident_a = smem;
    resident_b = smem + Cfg::CONSUMERS * Cfg::TILE_BYTES;
    ring = smem + Cfg::RESIDENT_BYTES;
    row_values = reinterpret_cast<float*>(ring + Cfg::STAGES * Cfg::STAGE_BYTES);
    full = reinterpret_cast<uint64_t*>(row_values + Cfg::STAGES * Cfg::ROW_VALUES);
    empty = full + Cfg::STAGES;
    resident_ready = empty + Cfg::STAGES;
    tail = resident_ready + 1;
    resident_free = tail + 1;
    acc_full = resident_free + 1;
    acc_empty = acc_full + 1;
    acc_stored = acc_empty + 1;
    rows_free = acc_stored + 1;
    acc_released = rows_free + Cfg::STAGES;
    scratch = smem + Cfg::SCRATCH_OFFSET;
  }
  __device__ __forceinline__ uint8_t* stage_a(int s) const { return ring + s * Cfg::STAGE_BYTES; }
  __device__ __forceinline__ uint8_t* stage_b(int s) const { return ring + s * Cfg::STAGE_BYTES + Cfg::TILE_BYTES; }
  __device__ __forceinline__ float* stage_rows(int s) const { return row_values + s * Cfg::ROW_VALUES; }
  // By thread 0, then the CTA syncs; the resident barriers only where the producer loads the
  // resident tiles (dK/dV: the consumers of dQ store theirs; its row loader's 32 lanes also arrive
  // on `full`, and every consumer thread on `rows_free`), the accumulators' for the ordered dQ.
  template <bool EXACT, bool RESIDENT_LOADED, bool ORDERED_DQ = false>
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < Cfg::STAGES; ++s) {
        mbar_init(&full[s], RESIDENT_LOADED ? 1 + 32 : 1);
        mbar_init(&empty[s], Cfg::CONSUMERS * kStageReleaseArrivals<EXACT>);
      }
      if (RESIDENT_LOADED) mbar_init(resident_ready, 1);
      mbar_init(tail, 1);
      if (RESIDENT_LOADED) mbar_init(resident_free, Cfg::CONSUMERS);
      for (int s = 0; RESIDENT_LOADED && s < Cfg::STAGES; ++s) mbar_init(&rows_free[s], Cfg::CONSUMERS * kWarpgroupThreads);
      if (ORDERED_DQ) {
        mbar_init(acc_full, 1);
        mbar_init(acc_empty, Cfg::DQ_WORKERS * kWarpgroupThreads);
        mbar_init(acc_stored, Cfg::DQ_WORKERS * kWarpgroupThreads);
        mbar_init(acc_released, 1);
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
};

// acc += A B over the 4 k16 chunks of a 64-row block in increasing k (A in registers, B the
// MN-major tile of descriptor b_tile), issued; waited for here, or, HOLD, at the ring's next wait
// (ConsumerRing).
template <typename T, int D, bool HOLD = false>
__device__ __forceinline__ void rs_block_product(float (&acc)[D / 2], const uint32_t (&a)[4][4], uint64_t b_tile) {
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) WgmmaRs<D, T>::template mma<1>(acc, a[kc], mn_chunk(b_tile, kc), 1);
  wgmma_commit();
  if constexpr (!HOLD) {
    wgmma_wait<0>();
    fence_accumulators(acc);
  }
}

// The ordered dQ's turn counters: read with acquire, advanced with release (gpu scope), so the
// sums stored before an advance are seen by the tile that reads the new value.
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Key tile `tile`'s turn on dQ box `box` (columns 64 box ..) of a query block, by consumer `box`,
// once the dQ loader has put the sums of tiles 0 .. tile-1 in acc_tile (TMA boxes of 64 rows x 32
// fp32 columns, 128-byte swizzle; first: tile 0, the sums start at +0): acc += dS K over both
// consumers' 64-key blocks in increasing k16 chunks (ds_tiles: the dS tiles, MN-major; k_tiles: the
// resident K); then the sums go to dq_accum for the next tile (the dQ releaser passes the turn on)
// or, on the block's last tile, rounded into dq (scale applied). acc_empty: arrived on once
// acc_tile is read. block_row: the block's first lse element (its row in dq_accum); dq_offset: its
// first dq element; rows: its queries (those past are not touched). Returns whether a dq element it
// wrote is not finite.
template <typename T, typename Cfg>
__device__ __forceinline__ bool ordered_dq_turn(const AttentionGradProblem& gp, const AttentionBwdWorkspace& w,
                                                const uint8_t* ds_tiles, const uint8_t* k_tiles, const uint8_t* acc_tile,
                                                uint64_t* acc_empty, int64_t block_row, int64_t dq_offset, int rows,
                                                bool first, bool last, int box, int tid) {
  constexpr int D = Cfg::HEAD_DIM;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  float acc[32];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = warp * 16 + g + 8 * hh;
#pragma unroll
    for (int dn = 0; dn < 8; ++dn) {
      // Column 64 box + 8 dn + 2 t: TMA box 2 box + dn / 4, its 16-byte chunk 2 (dn % 4) + t / 2.
      const int offset = swizzled_chunk_offset(row, 2 * box + dn / 4, 2 * (dn % 4) + t / 2) + 8 * (t % 2);
      const float2 v = first ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(acc_tile + offset);
      acc[dn * 4 + 2 * hh] = v.x;
      acc[dn * 4 + 2 * hh + 1] = v.y;
    }
  }
  mbar_arrive(acc_empty);
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < Cfg::CONSUMERS; ++c) {
    const uint64_t ds_tile = box_desc(smem_addr(ds_tiles + c * kBoxBytes));
    const uint64_t k_tile = box_desc(smem_addr(k_tiles + c * Cfg::TILE_BYTES + box * kBoxBytes));
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) Wgmma<64, T>::template mma<1, 1>(acc, mn_chunk(ds_tile, kc), mn_chunk(k_tile, kc), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(acc);
  const AttentionProblem& p = gp.fwd;
  float* accum = w.dq_accum + block_row * D + box * kBoxElems + 2 * t;  // + row * D + 8 dn
  T* dq = static_cast<T*>(gp.dq) + dq_offset + box * kBoxElems + 2 * t;  // + row * q_stride_token + 8 dn
  bool nonfinite = false;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = warp * 16 + g + 8 * hh;
    if (row >= rows) continue;
#pragma unroll
    for (int dn = 0; dn < 8; ++dn) {
      const float a0 = acc[dn * 4 + 2 * hh], a1 = acc[dn * 4 + 2 * hh + 1];
      if (!last) {
        __stcg(reinterpret_cast<float2*>(accum + row * D + dn * 8), make_float2(a0, a1));
      } else {
        const float s0 = __fmul_rn(a0, p.scale), s1 = __fmul_rn(a1, p.scale);
        nonfinite |= either_nonfinite(s0, s1);
        *reinterpret_cast<uint32_t*>(dq + row * p.q_stride_token + dn * 8) = pack_rounded<T>(s0, s1);
      }
    }
  }
  return nonfinite;
}

// A consumer's place in its ring: the stage and phase it waits on, and a held stage: one whose
// block's last product (dK += dS^T Q, or dQ += dS K, reading the stage's tile) was issued and not
// waited for, so that the next block's S and dP queue on the tensor cores behind it. A held stage
// is released once a later wait has seen that product finish (release_held); the consumer does so
// before it skips a block or ends a tile, so that no stage stays held while the producer needs it.
template <int STAGES, bool EXACT>
struct ConsumerRing {
  int stage = 0, held = -1;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Releases the current stage (kStageReleaseArrivals), then takes the next.
  __device__ __forceinline__ void release_and_advance(uint64_t* empty, int tid) {
    if (arrives_on_stage_release<EXACT>(tid)) mbar_arrive(&empty[stage]);
    advance();
  }
  // Holds the current stage (its product still runs), then takes the next.
  __device__ __forceinline__ void hold_and_advance() {
    held = stage;
    advance();
  }
  // Releases the held stage, if any: the caller has waited for its product.
  __device__ __forceinline__ void release_held(uint64_t* empty, int tid) {
    if (held >= 0 && arrives_on_stage_release<EXACT>(tid)) mbar_arrive(&empty[held]);
    held = -1;
  }
  // Waits for every product issued and releases the held stage (before a skipped block, at a
  // tile's end).
  __device__ __forceinline__ void drain(uint64_t* empty, int tid) {
    wgmma_wait<0>();
    release_held(empty, tid);
  }
  // The end of a block: HOLD and its product issued (`worked`): the stage held; else any held
  // stage drained and this one released.
  template <bool HOLD>
  __device__ __forceinline__ void end_block(bool worked, uint64_t* empty, int tid) {
    if (HOLD && worked) {
      hold_and_advance();
      return;
    }
    if constexpr (HOLD) drain(empty, tid);
    release_and_advance(empty, tid);
  }
};

// Q and dO of the kTileRows GQA-packed rows row0.. of a (sequence, kv head) (row = query row / G,
// head kv_head G + row % G; rows at or past `rows` zeros) into the 128-byte-swizzle layout of a
// TMA box stack (q_dst, do_dst), by one warpgroup. Every load of a thread is issued before its
// stores, and its rows' offsets are stepped, not divided per row.
template <typename T, int D>
__device__ __forceinline__ void load_q_do_swizzled(uint8_t* q_dst, uint8_t* do_dst, const T* q, const T* dout,
                                                   const AttentionProblem& p, int64_t q_base, int kv_head, int row0,
                                                   int rows, int group, int tid) {
  constexpr int CHUNKS = D / 8, ROW_STEP = kWarpgroupThreads / CHUNKS, PASSES = kTileRows / ROW_STEP;
  const int c = tid % CHUNKS, r0 = tid / CHUNKS;
  PackedRowWalker row(q_base + c * 8, row0 + r0, kv_head, group, p.q_stride_token, p.q_stride_head);
  uint4 q_val[PASSES], do_val[PASSES];
#pragma unroll
  for (int j = 0; j < PASSES; ++j) {
    const bool in_range = row0 + r0 + j * ROW_STEP < rows;
    q_val[j] = in_range ? *reinterpret_cast<const uint4*>(q + row.at) : make_uint4(0, 0, 0, 0);
    do_val[j] = in_range ? *reinterpret_cast<const uint4*>(dout + row.at) : make_uint4(0, 0, 0, 0);
    row.step(ROW_STEP);
  }
#pragma unroll
  for (int j = 0; j < PASSES; ++j) {
    const int off = swizzled_chunk_offset(r0 + j * ROW_STEP, c / 8, c % 8);
    *reinterpret_cast<uint4*>(q_dst + off) = q_val[j];
    *reinterpret_cast<uint4*>(do_dst + off) = do_val[j];
  }
}
#endif

// The backward kernels' work items: TileOrder's tiles (tile_in_sections), y the kv head, the visits
// a sequence's key tiles (dK/dV) or row tiles (dQ). A CTA takes items blockIdx.x, + gridDim.x, ...
// (the ordered dQ's: the one its ticket names). The recompute's kernels take sections of
// kBwdPairsPerSection pairs: tile-major over every pair (one section) had each pair's Q / dO
// (dK/dV) or K / V (dQ) stream read by about two of the running CTAs at 8 x 4096 (H200: fwd+bwd
// 0.81 -> 0.86 of cuDNN with 16), and sections of 4 or 8 pairs lose the heaviest-first order at
// 8 x 1024 (the forward's rule, sections of K / V taking 20 MB of L2, would give 2 pairs for
// dK/dV's Q / dO at 4096). The ordered dQ takes one section: its tile t waits for the same pair's
// tile t - 1 (which comes first in any section, as its tickets need), and 16 pairs put the two so
// close in launch order that they run in lockstep (8 x 1024: 0.95 -> 0.68 of the recompute's
// speed).
constexpr int64_t kBwdPairsPerSection = 16;

// ------------------------------------------------------------------------------------------------
// dK / dV
// ------------------------------------------------------------------------------------------------

// EXACT (both kernels): the recompute launch after a fast one flagged a non-finite gradient; on
// the causal diagonal the dV, dK (dQ) products run by cuts (rs_product_by_cuts), so that a masked
// pair's non-finite partner row (dO_i, q_i; k_j) reaches no gradient row that may not see it.
//
// ORDERED_DQ (fast kernel only): dQ too, without the dQ kernel's recompute of S, P and dP. The dS
// tile of each (head, query block) goes to shared memory, and its dQ rows take dQ += dS K from the
// key tiles in increasing order by turns: key tile t continues the chain on the fp32 sums tiles
// 0 .. t-1 left in w.dq_accum and stores them back (the last tile rounds them into dq). The chain
// is the dQ kernel's (the same k16 chunks in the same order on the same fp32 accumulators), so the
// bits are too. Two producer warps keep the turns off the consumers' path: the loader waits for the
// block's turn (w.turns reaching t) and TMA-loads the sums; the releaser advances the turn once the
// consumers have stored theirs. A CTA takes its item from a ticket drawn when it starts, in
// tile_in_sections' order (a pair's tile t - 1 before its tile t), so every tile it waits for
// belongs to a CTA that started before it: no wait on a CTA that cannot be scheduled.
template <typename T, typename Cfg, bool EXACT, bool ORDERED_DQ>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    attention_bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
                                   const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                   const __grid_constant__ CUtensorMap acc_map, const OperandMap q_at,
                                   const OperandMap kv_at, const AttentionGradProblem gp, const AttentionBwdWorkspace w,
                                   int group, float scale_log2) {
#ifdef RL_ALIGN_SM90A_DEVICE
  static_assert(!(EXACT && ORDERED_DQ), "the EXACT recompute runs the dQ kernel");
  constexpr int D = Cfg::HEAD_DIM, STAGES = Cfg::STAGES, KEYS = Cfg::ROWS;
  const AttentionProblem& p = gp.fwd;
  extern __shared__ uint8_t smem_raw[];
  if (EXACT && *gp.fwd.status == 0) return;  // the fast kernels' gradients stand
  const BwdSmem<Cfg> sm(smem_raw);  // resident K, V; stages of Q, dO
  uint8_t *k_tile = sm.resident_a, *v_tile = sm.resident_b;
  uint64_t *kv_ready = sm.resident_ready, *kv_free = sm.resident_free;
  auto q_stage = [&](int s) { return sm.stage_a(s); };
  auto do_stage = [&](int s) { return sm.stage_b(s); };
  // The only atomics here count integers: this CTA's ticket (which item it takes, so that it waits
  // only on CTAs already running) and the turns' red.release. No value is summed by an atomic; each
  // item's arithmetic is the same whichever CTA draws it.
  __shared__ int ticket;
  if (ORDERED_DQ && threadIdx.x == 0) ticket = atomicAdd(w.turns, 1);
  sm.template init_barriers<EXACT, true, ORDERED_DQ>();
  uint8_t* acc_tile = sm.scratch + Cfg::DS_BYTES;  // the ordered dQ's sums of the earlier key tiles
  auto uniform = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
  const int warpgroup = uniform(static_cast<int>(threadIdx.x) / kWarpgroupThreads);
  // This CTA's items (tile_in_sections): the one its ticket names (ORDERED_DQ), else grid-stride.
  const int64_t tiles = ceil_div(p.max_kv_len, KEYS), items = p.heads_kv * p.num_seqs * tiles;
  const int64_t section = ORDERED_DQ ? p.heads_kv * p.num_seqs : kBwdPairsPerSection;
  const int64_t item0 = ORDERED_DQ ? ticket : blockIdx.x, item_step = ORDERED_DQ ? items : gridDim.x;
  // Key tile `tile` of a sequence, the same for both roles: keys key0 .. key0 + KEYS - 1, seen by
  // the query blocks first_qb .. first_qb + q_blocks - 1 of each head (causal: none before).
  struct KeyTile {
    int key0, first_qb, q_blocks;
  };
  auto key_tile = [&](int tile, int q_len, int first_pos) {
    const int key0 = tile * KEYS;
    const int first_qb = p.causal && key0 > first_pos ? (key0 - first_pos) / kTileRows : 0;
    return KeyTile{key0, first_qb, (q_len + kTileRows - 1) / kTileRows - first_qb};
  };
  // Item `item` (tile_in_sections), the same for every role: its kv head, key tile and sequence,
  // the sequence's lengths (through `lens`: the consumers make them warp-uniform) and key tiles.
  struct KeyItem {
    int kv_head, tile;
    AttentionSeq sq;
    int q_len, kv_len, first_pos, key_tiles;
  };
  auto key_item = [&](int64_t item, auto lens) {
    const TileRef ref = tile_in_sections(item, p.heads_kv * p.num_seqs, p.heads_kv, tiles, section);
    const AttentionSeq sq = attention_seq(p, ref.seq);
    const int q_len = lens(static_cast<int>(sq.q_len)), kv_len = lens(static_cast<int>(sq.kv_len));
    return KeyItem{ref.y, ref.visit, sq, q_len, kv_len, kv_len - q_len, (kv_len + KEYS - 1) / KEYS};
  };
  // The last key tile a query block's dQ takes from (its last query's last key).
  auto last_key_tile = [&](int qstart, int key_tiles, int first_pos) {
    return p.causal ? min(key_tiles - 1, (first_pos + qstart + kTileRows - 1) / KEYS) : key_tiles - 1;
  };

  // Every block of this CTA's items, in the consumers' order: on_item(item, tile) for each item
  // with work, then on_block(item, head, qstart) for its (head, query block) pairs, blocks fastest.
  auto for_each_block = [&](auto&& on_item, auto&& on_block) {
    for (int64_t item = item0; item < items; item += item_step) {
      const KeyItem it = key_item(item, [](int x) { return x; });
      if (it.q_len <= 0 || it.tile >= it.key_tiles) continue;
      const KeyTile kt = key_tile(it.tile, it.q_len, it.first_pos);
      on_item(it, kt);
      for (int b = 0; b < group * kt.q_blocks; ++b) {
        on_block(it, it.kv_head * group + b / kt.q_blocks, (kt.first_qb + b % kt.q_blocks) * kTileRows);
      }
    }
  };

  if (warpgroup == 0) {
    // 24 + 2 x 240 registers per thread slot: the 168 x 384 the launch holds.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    const int warp = uniform(static_cast<int>(threadIdx.x) / 32), lane = static_cast<int>(threadIdx.x) % 32;
    auto no_item = [](const KeyItem&, const KeyTile&) {};
    if (ORDERED_DQ && (warp == 1 || warp == 2)) {
      // The ordered dQ's loader (warp 1: once the block's turn has come, TMA-loads the earlier
      // tiles' sums) and releaser (warp 2: passes the turn on once the consumers stored theirs),
      // off the consumers' path. Lane 0 alone: a lane left behind by one that spins on the turn
      // could miss a phase of acc_empty. The loader waits for the releaser to have passed on the
      // previous block's turn (acc_released) before it lets the consumers at this block's sums:
      // nothing else held the consumers back, and a releaser slow in its gpu-scope fence saw
      // acc_stored two phases on, waited for a phase that never came and kept the next key tile's
      // CTA waiting for good (H200: forced ordered at 8 x 1024, 32/8 heads, not causal).
      if (lane != 0) return;
      uint32_t phase = 0;
      for_each_block(no_item, [&](const KeyItem& it, int head, int qstart) {
        const int64_t block_row = it.sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head + qstart;
        int32_t* turn = w.turns + 1 + block_row;
        if (warp == 1) {
          mbar_wait(sm.acc_empty, phase ^ 1);     // the consumers have read the previous sums
          mbar_wait(sm.acc_released, phase ^ 1);  // and the releaser has seen them stored
          if (it.tile > 0) {
            while (ld_acquire_gpu(turn) != it.tile) {
            }
            asm volatile("fence.proxy.async.global;" ::: "memory");  // the sums, to the TMA's reads
            mbar_arrive_expect_tx(sm.acc_full, Cfg::ACC_BYTES);
            for (int b = 0; b < D / Cfg::ACC_BOX_COLUMNS; ++b) {
              tma_load_2d(acc_tile + b * kBoxBytes, &acc_map, sm.acc_full, b * Cfg::ACC_BOX_COLUMNS,
                          static_cast<int>(block_row));
            }
          } else {
            mbar_arrive(sm.acc_full);  // tile 0: the sums start at +0
          }
        } else {
          mbar_wait(sm.acc_stored, phase);
          if (it.tile < last_key_tile(qstart, it.key_tiles, it.first_pos)) {
            __threadfence();
            red_release_gpu_add(turn, 1);
          }
          mbar_arrive(sm.acc_released);
        }
        phase ^= 1;
      });
      return;
    }
    if (warp == 3) {
      // The row loader: each block's lse log2(e) and delta (queries past q_len: +0) into its
      // stage's row values once every consumer thread has read the previous ones (`rows_free`:
      // every lane reads them, and `empty` has one arrive per warp); every lane arrives on the
      // stage's `full` after its stores. Loaded by the consumers from L2 right after S^T's wait,
      // they held 17 % of dK/dV's samples at 1 x 16384 (ncu); from shared memory they are there
      // before the stage is.
      int stage = 0;
      uint32_t phase = 0;
      for_each_block(no_item, [&](const KeyItem& it, int head, int qstart) {
        const int64_t row = it.sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head + qstart;
        float lse[2], delta[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = lane + 32 * h;
          const bool in_range = qstart + i < it.q_len;
          lse[h] = in_range ? __fmul_rn(p.lse[row + i], kLog2e) : 0.f;
          delta[h] = in_range ? gp.delta[row + i] : 0.f;
        }
        mbar_wait(&sm.rows_free[stage], phase ^ 1);
        float* rows = sm.stage_rows(stage);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          rows[lane + 32 * h] = lse[h];
          rows[kTileRows + lane + 32 * h] = delta[h];
        }
        mbar_arrive(&sm.full[stage]);
        if (++stage == STAGES) {
          stage = 0;
          phase ^= 1;
        }
      });
      return;
    }
    if (warp != 0) return;
    PairRingProducer<STAGES, Cfg::D_BOXES> qdo_ring{sm.ring, Cfg::STAGE_BYTES, Cfg::TILE_BYTES,
                                                    sm.full, sm.empty, sm.tail};
    uint32_t kv_phase = 0;
    int q_c1, q_c2;  // map coordinates of the item's sequence's token 0, head 0
    for_each_block(
        [&](const KeyItem& it, const KeyTile& kt) {
          int kv_c1, kv_c2;
          q_at.coords(it.sq.q_base, 0, 0, q_c1, q_c2);
          kv_at.coords(it.sq.kv_base, 0, 0, kv_c1, kv_c2);
          // K, V of the tile, once both consumers are done with the previous tile's (kv_free).
          mbar_wait(kv_free, kv_phase ^ 1);
          kv_phase ^= 1;
          if (lane == 0) {
            mbar_arrive_expect_tx(kv_ready, Cfg::RESIDENT_BYTES);
            for (int c = 0; c < Cfg::CONSUMERS; ++c) {
              int c1, c2;
              kv_at.step(kv_c1, kv_c2, it.kv_head, kt.key0 + c * kTileRows, c1, c2);
              for (int b = 0; b < Cfg::D_BOXES; ++b) {
                tma_load_3d(k_tile + c * Cfg::TILE_BYTES + b * kBoxBytes, &k_map, kv_ready, b * kBoxElems, c1, c2);
                tma_load_3d(v_tile + c * Cfg::TILE_BYTES + b * kBoxBytes, &v_map, kv_ready, b * kBoxElems, c1, c2);
              }
            }
          }
        },
        [&](const KeyItem& it, int head, int qstart) {
          int c1, c2;
          q_at.step(q_c1, q_c2, head, qstart, c1, c2);
          qdo_ring.load(&q_map, &do_map, c1, c2, it.q_len - qstart, lane);  // Q, dO rows past q_len: zeros
        });
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const int consumer = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  T* __restrict__ dk = static_cast<T*>(gp.dk);
  T* __restrict__ dv = static_cast<T*>(gp.dv);
  const uint64_t my_k = box_desc(smem_addr(k_tile + consumer * Cfg::TILE_BYTES));
  const uint64_t my_v = box_desc(smem_addr(v_tile + consumer * Cfg::TILE_BYTES));
  // HOLD_DK: a block's dK product is waited for at the next block's first wait (ConsumerRing).
  constexpr bool HOLD_DK = !EXACT && !ORDERED_DQ;
  ConsumerRing<STAGES, EXACT> ring;
  int ds_buffer = 0;
  uint32_t kv_phase = 0, acc_phase = 0;

  for (int64_t item = item0; item < items; item += item_step) {
    const KeyItem it = key_item(item, uniform);  // named, not bound: the masks' lambdas capture them
    const int kv_head = it.kv_head, tile = it.tile, q_len = it.q_len, kv_len = it.kv_len, first_pos = it.first_pos;
    const int key_tiles = it.key_tiles;
    const AttentionSeq sq = it.sq;
    if (q_len <= 0 || tile >= key_tiles) continue;
    const auto [key0, first_qb, q_blocks] = key_tile(tile, q_len, first_pos);
    const int my_key0 = key0 + consumer * kTileRows;
    const int warp_key0 = my_key0 + warp * 16;
    bool nonfinite = false;
    float dk_acc[1][D / 8][4], dv_acc[1][D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dk_acc[0][dn][e] = dv_acc[0][dn][e] = 0.f;
    }
    float(&dk_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dk_acc[0][0][0]);
    float(&dv_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dv_acc[0][0][0]);
    mbar_wait(kv_ready, kv_phase);
    kv_phase ^= 1;
    if (ORDERED_DQ && my_key0 + kTileRows > kv_len) {
      // The ordered dQ multiplies the whole K tile by dS: its rows past kv_len (another
      // sequence's keys) become zeros, as the dQ kernel's zero fill (their dS is +0).
      if (warp == 0) zero_rows(k_tile + consumer * Cfg::TILE_BYTES, Cfg::D_BOXES, my_key0 < kv_len ? kv_len - my_key0 : 0, lane);
      named_bar_sync(kConsumerBar + consumer, kWarpgroupThreads);
    }

    // The blocks (head kv_head * group + hg, query block first_qb + qb), qb fastest.
    for (int hg = 0, qb = 0; q_blocks > 0 && hg < group; qb == q_blocks - 1 ? (qb = 0, ++hg) : ++qb) {
      const int head = kv_head * group + hg;
      const int qstart = (first_qb + qb) * kTileRows;
      const int64_t lse_row = sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head;
      uint8_t* my_ds = sm.scratch + (ds_buffer * Cfg::CONSUMERS + consumer) * kBoxBytes;
      const int stage = ring.stage;
      mbar_wait(&sm.full[stage], ring.phase);
      // A warpgroup whose keys all come after the block's last query (causal), or lie past
      // kv_len, would only add exact zeros / unused values: skipped (released only; its dS tile
      // for the ordered dQ is +0).
      const bool skip = my_key0 >= kv_len || (p.causal && my_key0 > first_pos + qstart + kTileRows - 1);
      if (!skip) {
        const uint64_t q_desc = box_desc(smem_addr(q_stage(stage))), do_desc = box_desc(smem_addr(do_stage(stage)));
        // lse log2(e) and delta of the block's queries (the row loader's).
        const float* rows = sm.stage_rows(stage);
        float pt[1][8][4];
        float(&pt_flat)[32] = *reinterpret_cast<float(*)[32]>(&pt[0][0][0]);
        float dpt[1][8][4];
        float(&dpt_flat)[32] = *reinterpret_cast<float(*)[32]>(&dpt[0][0][0]);
        auto issue_dpt = [&]() {
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
            Wgmma<64, T>::template mma<0, 0>(dpt_flat, kmajor_chunk(my_v, ks), kmajor_chunk(do_desc, ks), ks > 0);
          wgmma_commit();
        };
        // S^T = K Q^T, then dP^T = V dO^T on the tensor cores while P^T is computed (the EXACT
        // kernel issues dP^T after its dV by cuts: it has no registers to spare).
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
          Wgmma<64, T>::template mma<0, 0>(pt_flat, kmajor_chunk(my_k, ks), kmajor_chunk(q_desc, ks), ks > 0);
        wgmma_commit();
        if constexpr (!EXACT) issue_dpt();
        wgmma_wait<EXACT ? 0 : 1>();  // S^T done (and the held stage's dK product before it)
        fence_accumulators(pt_flat);
        if constexpr (HOLD_DK) ring.release_held(sm.empty, tid);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 l = *reinterpret_cast<const float2*>(rows + nt * 8 + 2 * t);  // query qstart + 8 nt + 2 t
#pragma unroll
          for (int e = 0; e < 4; ++e) pt[0][nt][e] = ex2(__fmaf_rn(pt[0][nt][e], scale_log2, -(e % 2 ? l.y : l.x)));
        }
        // Masking as the sm80 kernel: query column c = 8 nt + e % 2 (relative to qstart + 2t)
        // is allowed for key row hh iff lo[hh] <= c <= hi.
        const bool causal_diag = p.causal && warp_key0 + 15 > first_pos + qstart;
        const bool sub_masked = qstart + kTileRows > q_len || causal_diag;
        auto mask_sub = [&](float (&x)[1][8][4]) {
          const int hi = q_len - 1 - qstart - 2 * t;
          int lo[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) lo[hh] = p.causal ? warp_key0 + g + 8 * hh - first_pos - qstart - 2 * t : -kTileRows;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = nt * 8 + e % 2;
              if (c > hi || c < lo[e / 2]) x[0][nt][e] = 0.f;
            }
          }
        };
        if (sub_masked) mask_sub(pt);
        uint32_t pa[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) c_to_a<T>(pa[kc], pt[0][2 * kc], pt[0][2 * kc + 1]);
        // dV += P^T dO (queries as k).
        // EXACT on the diagonal: key row r may use the chunk's queries from its own position on.
        const bool cuts = EXACT && p.causal && my_key0 + kTileRows - 1 > first_pos + qstart;
        auto by_cuts = [&](float (&acc)[D / 2], const uint32_t (&a)[4][4], const uint8_t* b_tile) {
          uint8_t* scratch = sm.scratch + consumer * Cfg::D_BOXES * kCutBoxBytes;
#pragma unroll 1
          for (int kc = 0; kc < 4; ++kc) {
            int count[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int lo = warp_key0 + g + 8 * hh - first_pos - (qstart + 16 * kc);
              count[hh] = 16 - (lo < 0 ? 0 : lo > 16 ? 16 : lo);
            }
            uint32_t ak[4] = {a[0][0], a[0][1], a[0][2], a[0][3]};
#pragma unroll
            for (int c = 1; c < 4; ++c) {
#pragma unroll
              for (int r = 0; r < 4; ++r) ak[r] = c == kc ? a[c][r] : ak[r];
            }
            rs_product_by_cuts<T, D, false>(acc, ak, b_tile + 16 * kc * 128, kBoxBytes, scratch, count, tid,
                                            kConsumerBar + consumer);
          }
        };
        if (cuts) {
          by_cuts(dv_flat, pa, do_stage(stage));
        } else {
          wgmma_fence();
#pragma unroll
          for (int kc = 0; kc < 4; ++kc) WgmmaRs<D, T>::template mma<1>(dv_flat, pa[kc], mn_chunk(do_desc, kc), 1);
          wgmma_commit();
        }
        if constexpr (EXACT) {
          wgmma_fence();
          issue_dpt();
        }
        wgmma_wait<0>();
        fence_accumulators(dpt_flat);
        fence_accumulators(dv_flat);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float2 d = *reinterpret_cast<const float2*>(rows + kTileRows + nt * 8 + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) dpt[0][nt][e] = __fmul_rn(pt[0][nt][e], __fsub_rn(dpt[0][nt][e], e % 2 ? d.y : d.x));
        }
        if (sub_masked) mask_sub(dpt);
        if (ORDERED_DQ && my_key0 + kTileRows > kv_len) {
          // Keys past kv_len: dS = +0 for dQ (their own dK rows are not written).
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (warp_key0 + g + 8 * (e / 2) >= kv_len) dpt[0][nt][e] = 0.f;
            }
          }
        }
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) c_to_a<T>(pa[kc], dpt[0][2 * kc], dpt[0][2 * kc + 1]);
        if (cuts) {
          by_cuts(dk_flat, pa, q_stage(stage));
        } else {
          rs_block_product<T, D, HOLD_DK>(dk_flat, pa, q_desc);
        }
        if constexpr (ORDERED_DQ) {
          // dS^T as dQ's A operand (queries x keys) stored MN-major: row = key, the 64 queries
          // along it. Fragment register r of chunk kc: key 16 warp + g + 8 (r % 2), queries
          // 16 kc + 8 (r / 2) + 2 t, + 1.
#pragma unroll
          for (int kc = 0; kc < 4; ++kc) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int key = warp * 16 + g + 8 * (r % 2);
              *reinterpret_cast<uint32_t*>(my_ds + swizzled_chunk_offset(key, 0, 2 * kc + r / 2) + 4 * t) = pa[kc][r];
            }
          }
        }
      } else if (ORDERED_DQ) {
        for (int i = tid; i < kBoxBytes / 16; i += kWarpgroupThreads) reinterpret_cast<uint4*>(my_ds)[i] = make_uint4(0, 0, 0, 0);
      }
      mbar_arrive(&sm.rows_free[stage]);  // after this thread's reads of the row values (or a skip)
      ring.template end_block<HOLD_DK>(!skip, sm.empty, tid);
      if constexpr (ORDERED_DQ) {
        fence_proxy_async();  // the dS tile's stores, to the wgmma's reads
        named_bar_sync(kDsReadyBar, Cfg::CONSUMERS * kWarpgroupThreads);  // both dS tiles are stored
        if (consumer < Cfg::DQ_WORKERS) {
          mbar_wait(sm.acc_full, acc_phase);
          const int64_t dq_offset = sq.q_base + static_cast<int64_t>(qstart) * p.q_stride_token +
                                    static_cast<int64_t>(head) * p.q_stride_head;
          nonfinite |= ordered_dq_turn<T, Cfg>(gp, w, sm.scratch + ds_buffer * Cfg::CONSUMERS * kBoxBytes, k_tile,
                                               acc_tile, sm.acc_empty, lse_row + qstart, dq_offset, q_len - qstart,
                                               tile == 0, tile == last_key_tile(qstart, key_tiles, first_pos),
                                               consumer, tid);
          mbar_arrive(sm.acc_stored);  // after this thread's stores: the releaser may pass the turn on
        }
        acc_phase ^= 1;
        ds_buffer ^= 1;
      }
    }

    if constexpr (HOLD_DK) {
      ring.drain(sm.empty, tid);
      fence_accumulators(dk_flat);
    }
    // Epilogue: keys below kv_len; dK = scale * acc and dV rounded once.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int key = warp_key0 + g + 8 * hh;
      if (key >= kv_len) continue;
      const int64_t off = sq.kv_base + static_cast<int64_t>(kv_head) * p.kv_stride_head +
                          static_cast<int64_t>(key) * p.kv_stride_token + 2 * t;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const float k0 = __fmul_rn(dk_acc[0][dn][2 * hh], p.scale), k1 = __fmul_rn(dk_acc[0][dn][2 * hh + 1], p.scale);
        const float v0 = dv_acc[0][dn][2 * hh], v1 = dv_acc[0][dn][2 * hh + 1];
        nonfinite |= either_nonfinite(k0, k1) | either_nonfinite(v0, v1);
        *reinterpret_cast<uint32_t*>(dk + off + dn * 8) = pack_rounded<T>(k0, k1);
        *reinterpret_cast<uint32_t*>(dv + off + dn * 8) = pack_rounded<T>(v0, v1);
      }
    }
    if (!EXACT && p.status != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) *p.status = 1;
    if (tid == 0) mbar_arrive(kv_free);  // this consumer's products of the tile are all done
  }
#endif  // RL_ALIGN_SM90A_DEVICE
}

// ------------------------------------------------------------------------------------------------
// dQ
// ------------------------------------------------------------------------------------------------

template <typename T, typename Cfg, bool EXACT>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    attention_bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                 const OperandMap kv_at, const AttentionGradProblem gp, int group, float scale_log2) {
#ifdef RL_ALIGN_SM90A_DEVICE
  constexpr int D = Cfg::HEAD_DIM, STAGES = Cfg::STAGES, ROWS = Cfg::ROWS;
  const AttentionProblem& p = gp.fwd;
  extern __shared__ uint8_t smem_raw[];
  if (EXACT && *gp.fwd.status == 0) return;  // the fast kernels' gradients stand
  const BwdSmem<Cfg> sm(smem_raw);  // resident Q, dO; stages of K, V
  uint8_t *q_tile = sm.resident_a, *do_tile = sm.resident_b;
  auto k_stage = [&](int s) { return sm.stage_a(s); };
  auto v_stage = [&](int s) { return sm.stage_b(s); };
  sm.template init_barriers<EXACT, false>();
  auto uniform = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
  const int warpgroup = uniform(static_cast<int>(threadIdx.x) / kWarpgroupThreads);
  const int64_t tiles_max = ceil_div(p.max_q_len * group, ROWS), items = p.heads_kv * p.num_seqs * tiles_max;
  // Visit `visit` of a sequence's row tiles (heaviest first), the same for both roles: rows
  // row0 .. row0 + ROWS - 1 of its q_len * G, and the key blocks [0, num_blocks) its last row sees.
  struct RowTile {
    int row0, num_blocks;
  };
  auto row_tile = [&](int visit, int tiles, int rows, int kv_len, int first_pos) {
    const int row0 = (tiles - 1 - visit) * ROWS;
    const int last_pos = first_pos + ((row0 + ROWS < rows ? row0 + ROWS : rows) - 1) / group;
    return RowTile{row0, p.causal ? last_pos / kTileRows + 1 : (kv_len + kTileRows - 1) / kTileRows};
  };
  // Item `item` (tile_in_sections), the same for both roles: its kv head, visit and sequence, the
  // sequence's lengths (through `lens`: the consumers make them warp-uniform), rows and row tiles.
  struct RowItem {
    int kv_head, visit;
    AttentionSeq sq;
    int q_len, kv_len, rows, tiles, first_pos;
  };
  auto row_item = [&](int64_t item, auto lens) {
    const TileRef ref = tile_in_sections(item, p.heads_kv * p.num_seqs, p.heads_kv, tiles_max, kBwdPairsPerSection);
    const AttentionSeq sq = attention_seq(p, ref.seq);
    const int q_len = lens(static_cast<int>(sq.q_len)), kv_len = lens(static_cast<int>(sq.kv_len));
    const int rows = q_len * group;
    return RowItem{ref.y, ref.visit, sq, q_len, kv_len, rows, (rows + ROWS - 1) / ROWS, kv_len - q_len};
  };

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x >= 32) return;
    const int lane = static_cast<int>(threadIdx.x);
    PairRingProducer<STAGES, Cfg::D_BOXES> kv_ring{sm.ring, Cfg::STAGE_BYTES, Cfg::TILE_BYTES,
                                                   sm.full, sm.empty, sm.tail};
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
      const auto [kv_head, visit, sq, q_len, kv_len, rows, tiles, first_pos] = row_item(item, [](int x) { return x; });
      if (q_len <= 0 || visit >= tiles) continue;
      int kv_c1, kv_c2;
      kv_at.coords(sq.kv_base, kv_head, 0, kv_c1, kv_c2);
      const auto [row0, num_blocks] = row_tile(visit, tiles, rows, kv_len, first_pos);
      for (int b = 0; b < num_blocks; ++b) {
        const int key0 = b * kTileRows;
        int c1, c2;
        kv_at.step(kv_c1, kv_c2, 0, key0, c1, c2);
        kv_ring.load(&k_map, &v_map, c1, c2, kv_len - key0, lane);  // K rows past kv_len meet dS = +0: zeros
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const int consumer = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ dout = static_cast<const T*>(gp.dout);
  T* __restrict__ dq = static_cast<T*>(gp.dq);
  uint8_t* my_q = q_tile + consumer * Cfg::TILE_BYTES;
  uint8_t* my_do = do_tile + consumer * Cfg::TILE_BYTES;
  // HOLD_DQ: a block's dQ product is waited for at the next block's first wait (ConsumerRing).
  constexpr bool HOLD_DQ = !EXACT;
  ConsumerRing<STAGES, EXACT> ring;

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const auto [kv_head, visit, sq, q_len, kv_len, rows, tiles, first_pos] = row_item(item, uniform);
    if (q_len <= 0 || visit >= tiles) continue;
    const auto [row0, num_blocks] = row_tile(visit, tiles, rows, kv_len, first_pos);
    const int my_row0 = row0 + consumer * kTileRows;
    const bool active = my_row0 < rows;
    const int my_last_pos = first_pos + ((my_row0 + kTileRows < rows ? my_row0 + kTileRows : rows) - 1) / group;

    named_bar_sync(kConsumerBar + consumer, kWarpgroupThreads);  // the last tile's products are done
    if (active) {
      load_q_do_swizzled<T, D>(my_q, my_do, q, dout, p, sq.q_base, kv_head, my_row0, rows, group, tid);
      fence_proxy_async();
    }
    named_bar_sync(kConsumerBar + consumer, kWarpgroupThreads);

    const int warp_row0 = my_row0 + warp * 16;
    const int warp_first_pos = first_pos + warp_row0 / group;
    float lse_l2[2], delta_r[2];
    int last_key[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = warp_row0 + g + 8 * hh;
      const int64_t i = row / group, h = static_cast<int64_t>(kv_head) * group + row % group;
      const int64_t off = sq.lse_base + h * p.lse_stride_head + i;
      lse_l2[hh] = row < rows ? __fmul_rn(p.lse[off], kLog2e) : 0.f;
      delta_r[hh] = row < rows ? gp.delta[off] : 0.f;
      const int pos = first_pos + static_cast<int>(i);
      last_key[hh] = p.causal && pos < kv_len ? pos : kv_len - 1;
    }
    float dq_acc[1][D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dq_acc[0][dn][e] = 0.f;
    }
    float(&dq_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dq_acc[0][0][0]);
    const uint64_t q_desc = box_desc(smem_addr(my_q)), do_desc = box_desc(smem_addr(my_do));
    const int my_end = !active ? 0 : p.causal ? my_last_pos / kTileRows + 1 : num_blocks;
    const int my_first_pos = first_pos + my_row0 / group;

    const int mask_from = first_masked_block(kv_len, warp_first_pos, p.causal);
    auto block = [&](int b, bool masked) {
      const int stage = ring.stage;
      mbar_wait(&sm.full[stage], ring.phase);
      if (b < my_end) {
        const int key0 = b * kTileRows;
        const uint64_t k_desc = box_desc(smem_addr(k_stage(stage))), v_desc = box_desc(smem_addr(v_stage(stage)));
        float sp[1][8][4], ds[1][8][4];
        float(&sp_flat)[32] = *reinterpret_cast<float(*)[32]>(&sp[0][0][0]);
        float(&ds_flat)[32] = *reinterpret_cast<float(*)[32]>(&ds[0][0][0]);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
          Wgmma<64, T>::template mma<0, 0>(sp_flat, kmajor_chunk(q_desc, ks), kmajor_chunk(k_desc, ks), ks > 0);
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
          Wgmma<64, T>::template mma<0, 0>(ds_flat, kmajor_chunk(do_desc, ks), kmajor_chunk(v_desc, ks), ks > 0);
        wgmma_commit();
        wgmma_wait<1>();  // S done (and the held stage's dQ product before it); dP still runs
        fence_accumulators(sp_flat);
        if constexpr (HOLD_DQ) ring.release_held(sm.empty, tid);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) sp[0][nt][e] = ex2(__fmaf_rn(sp[0][nt][e], scale_log2, -lse_l2[e / 2]));
        }
        auto mask_block = [&](float (&x)[1][8][4]) {
          int limit[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) limit[hh] = last_key[hh] - key0 - 2 * t;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (nt * 8 + e % 2 > limit[e / 2]) x[0][nt][e] = 0.f;
            }
          }
        };
        if (masked) mask_block(sp);
        // dP's wait in both arms of a warp-uniform branch on the exponentials (the arms are the
        // same; the wait is .aligned, hence the vote): in straight-line code ptxas hoists it
        // above them, so that they never overlap dP's product (the forward's wait for P V had
        // the same fix).
        if (__any_sync(0xffffffffu, sp[0][7][3] > 1.f)) {
          wgmma_wait<0>();
          fence_accumulators(ds_flat);
        } else {
          wgmma_wait<0>();
          fence_accumulators(ds_flat);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[0][nt][e] = __fmul_rn(sp[0][nt][e], __fsub_rn(ds[0][nt][e], delta_r[e / 2]));
        }
        if (masked) mask_block(ds);
        uint32_t dsa[4][4];
#pragma unroll
        for (int kc = 0; kc < 4; ++kc) c_to_a<T>(dsa[kc], ds[0][2 * kc], ds[0][2 * kc + 1]);
        if (EXACT && p.causal && key0 + kTileRows - 1 > my_first_pos) {
          // Query row r may use the chunk's keys up to its own position.
          uint8_t* scratch = sm.scratch + consumer * Cfg::D_BOXES * kCutBoxBytes;
#pragma unroll 1
          for (int kc = 0; kc < 4; ++kc) {
            int count[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int c = last_key[hh] - (key0 + 16 * kc) + 1;
              count[hh] = c < 0 ? 0 : c > 16 ? 16 : c;
            }
            uint32_t ak[4] = {dsa[0][0], dsa[0][1], dsa[0][2], dsa[0][3]};
#pragma unroll
            for (int c = 1; c < 4; ++c) {
#pragma unroll
              for (int r = 0; r < 4; ++r) ak[r] = c == kc ? dsa[c][r] : ak[r];
            }
            rs_product_by_cuts<T, D, true>(dq_flat, ak, k_stage(stage) + 16 * kc * 128, kBoxBytes, scratch, count,
                                           tid, kConsumerBar + consumer);
          }
        } else {
          rs_block_product<T, D, HOLD_DQ>(dq_flat, dsa, k_desc);
        }
      }
      ring.template end_block<HOLD_DQ>(b < my_end, sm.empty, tid);
    };
    // The blocks without a masked score, then those with: two loops, so that the first carries
    // no per-score mask selects (as the forward's); the bound warp-uniform to the compiler. The
    // EXACT kernel keeps one loop (no registers to spare for two copies).
    if constexpr (EXACT) {
      for (int b = 0; b < num_blocks; ++b) block(b, b >= mask_from);
    } else {
      const int unmasked_end = uniform(min(mask_from, num_blocks));
      int b = 0;
      for (; b < unmasked_end; ++b) block(b, false);
      for (; b < num_blocks; ++b) block(b, true);
    }
    if constexpr (HOLD_DQ) {
      ring.drain(sm.empty, tid);
      fence_accumulators(dq_flat);
    }
    if (!active) continue;

    bool nonfinite = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = warp_row0 + g + 8 * hh;
      if (row >= rows) continue;
      const int64_t i = row / group, h = static_cast<int64_t>(kv_head) * group + row % group;
      T* dq_row = dq + sq.q_base + i * p.q_stride_token + h * p.q_stride_head + 2 * t;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const float a0 = __fmul_rn(dq_acc[0][dn][2 * hh], p.scale), a1 = __fmul_rn(dq_acc[0][dn][2 * hh + 1], p.scale);
        nonfinite |= either_nonfinite(a0, a1);
        *reinterpret_cast<uint32_t*>(dq_row + dn * 8) = pack_rounded<T>(a0, a1);
      }
    }
    if (!EXACT && p.status != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) *p.status = 1;
  }
#endif  // RL_ALIGN_SM90A_DEVICE
}

// The ordered dQ's sums, fp32 [rows][head_dim], as a tensor map of boxes of 64 rows x `columns`
// (one 128-byte swizzle row); rows past the end read as zeros.
inline bool encode_dq_accum_map(CUtensorMap* map, float* dq_accum, int64_t rows, int head_dim, int columns) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(head_dim) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(columns), static_cast<cuuint32_t>(kTileRows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, dq_accum, dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename T, int D>
gpuError_t launch_bwd(DType dtype, const AttentionGradProblem& gp, const AttentionBwdWorkspace& w,
                      const OperandMap& q_at, const OperandMap& kv_at, gpuStream_t stream) {
  // Three stages where a held product (ConsumerRing) keeps one from the producer for a while
  // (faster than two at S >= 4096); the ordered dQ's kernel holds none and keeps two.
  using Cfg = BwdConfig<D, 3>;
  using OrderedCfg = BwdConfig<D, 2>;
  static_assert(Cfg::ROWS == OrderedCfg::ROWS, "the same key tiles");
  const AttentionProblem& p = gp.fwd;
  const int64_t group = p.heads_q / p.heads_kv;
  const float scale_log2 = scale_log2e(p);
  gpuError_t err = attention_bwd_delta(dtype, gp, stream);
  if (err != cudaSuccess) return err;
  CUtensorMap q_map, do_map, k_map, v_map;
  if (!encode_operand_map(&q_map, q_at, dtype, p.q, D, p.q_elements) ||
      !encode_operand_map(&do_map, q_at, dtype, gp.dout, D, p.q_elements) ||
      !encode_operand_map(&k_map, kv_at, dtype, p.k, D, p.kv_elements) ||
      !encode_operand_map(&v_map, kv_at, dtype, p.v, D, p.kv_elements)) {
    return cudaErrorInvalidValue;
  }
  auto capped = [](int64_t n, int64_t cap) { return static_cast<unsigned>(n < cap ? n : cap); };
  const int64_t key_tiles = ceil_div(p.max_kv_len, static_cast<int64_t>(Cfg::ROWS));
  // The ordered dQ where its workspace is given and a CTA per item and the sums' rows fit int
  // coordinates; else the dQ kernel (the same bits).
  CUtensorMap acc_map{};
  const bool ordered = w.dq_accum != nullptr && w.turns != nullptr && w.rows <= INT32_MAX &&
                       p.heads_kv * p.num_seqs * key_tiles <= INT32_MAX &&
                       encode_dq_accum_map(&acc_map, w.dq_accum, w.rows, D, OrderedCfg::ACC_BOX_COLUMNS);
  auto dkdv = [&](auto exact_tag, auto ordered_tag) -> gpuError_t {
    constexpr bool EXACT = decltype(exact_tag)::value, ORDERED_DQ = decltype(ordered_tag)::value;
    using KCfg = std::conditional_t<ORDERED_DQ, OrderedCfg, Cfg>;
    constexpr int kSmem = EXACT ? KCfg::EXACT_SMEM_BYTES : ORDERED_DQ ? KCfg::ORDERED_SMEM_BYTES : KCfg::SMEM_BYTES;
    // A CTA per item (tile_in_sections), grid-stride past INT32_MAX; the ordered kernel's items
    // fit (a CTA each). The EXACT launch mostly finds nothing to do (the status word is 0): a small
    // grid keeps it to a few microseconds.
    const dim3 grid(capped(p.heads_kv * p.num_seqs * key_tiles, EXACT ? 16 * p.heads_kv : INT32_MAX));
    auto kernel = attention_bwd_dkdv_sm90_kernel<T, KCfg, EXACT, ORDERED_DQ>;
    static std::atomic<uint64_t> raised{0};
    const gpuError_t e = allow_dynamic_smem(kernel, kSmem, raised);
    if (e != cudaSuccess) return e;
    kernel<<<grid, KCfg::THREADS, kSmem, stream>>>(q_map, do_map, k_map, v_map, acc_map, q_at, kv_at, gp, w,
                                                  static_cast<int>(group), scale_log2);
    return cudaGetLastError();
  };
  auto dq = [&](auto exact_tag) -> gpuError_t {
    constexpr bool EXACT = decltype(exact_tag)::value;
    constexpr int kSmem = EXACT ? Cfg::EXACT_SMEM_BYTES : Cfg::SMEM_BYTES;
    const dim3 grid(capped(p.heads_kv * p.num_seqs * ceil_div(p.max_q_len * group, Cfg::ROWS),
                           EXACT ? 16 * p.heads_kv : INT32_MAX));
    auto kernel = attention_bwd_dq_sm90_kernel<T, Cfg, EXACT>;
    static std::atomic<uint64_t> raised{0};
    const gpuError_t e = allow_dynamic_smem(kernel, kSmem, raised);
    if (e != cudaSuccess) return e;
    kernel<<<grid, Cfg::THREADS, kSmem, stream>>>(k_map, v_map, kv_at, gp, static_cast<int>(group), scale_log2);
    return cudaGetLastError();
  };
  // The fast kernels, then, where keys are masked inside a sequence (causal), the EXACT ones,
  // which recompute only if a fast one flagged a non-finite gradient.
  if (ordered) {
    err = dkdv(std::false_type{}, std::true_type{});
  } else {
    err = dkdv(std::false_type{}, std::false_type{});
    if (err == cudaSuccess) err = dq(std::false_type{});
  }
  if (err != cudaSuccess || !p.causal) return err;
  err = dkdv(std::true_type{}, std::false_type{});
  return err != cudaSuccess ? err : dq(std::true_type{});
}

}  // namespace

// Problem requirements: the sm80 backward's (attention_bwd_sm80), a status word, and Q, dO, K and V
// addressable through tensor maps (q_map_problem, kv_map_problem: the launcher sends other layouts
// to the sm80 path, attention_sm90_layout_problem); cudaErrorInvalidValue otherwise.
gpuError_t attention_bwd_sm90(DType dtype, const AttentionGradProblem& gp, const AttentionBwdWorkspace& w,
                              gpuStream_t stream) {
  const AttentionProblem& p = gp.fwd;
  const gpuError_t err = tensor_core_attention_problem_error(dtype, p, p.heads_q);  // delta grid y: query heads
  if (err != cudaSuccess || p.num_seqs == 0 || p.max_q_len == 0) return err;
  OperandMap q_at, kv_at;
  if (gp.delta == nullptr || p.status == nullptr || !aligned16(gp.dout) || !aligned16(gp.dq) || !aligned16(gp.dk) ||
      !aligned16(gp.dv) ||
      q_map_problem(p, &q_at) != nullptr || kv_map_problem(p, &kv_at) != nullptr) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype,
      [&](auto tag) {
        using T = decltype(tag);
        return p.head_dim == 64 ? launch_bwd<T, 64>(dtype, gp, w, q_at, kv_at, stream)
                                : launch_bwd<T, 128>(dtype, gp, w, q_at, kv_at, stream);
      },
      gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t attention_bwd_sm90(DType, const AttentionGradProblem&, const AttentionBwdWorkspace&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
