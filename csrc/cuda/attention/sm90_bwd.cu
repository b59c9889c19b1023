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
//   dQ     CTA = (sequence, kv head g, tile of 128 rows, row = query i of head g G + r, GQA packed
//          as in the forward): consumer c owns rows 64 c ..; the producer streams 64-key K/V blocks.
//          Per block: S = Q K^T, P, dP = dO V^T, dS = P (dP - delta), dQ += dS K (RS, 4 k16 key
//          chunks); dQ *= scale at the end.
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
  static constexpr int BARRIERS = 2 * STAGES + 3;  // full, empty per stage; resident ready, tail, resident free
  static constexpr int SMEM_BYTES = 1024 + RESIDENT_BYTES + STAGES * STAGE_BYTES + BARRIERS * 8;
  // EXACT: a cut scratch per consumer (sm90_cuts.h), 1024 bytes past the ring (after the barriers).
  static constexpr int EXACT_SMEM_BYTES = 1024 + RESIDENT_BYTES + STAGES * STAGE_BYTES + 1024 +
                                          CONSUMERS * D_BOXES * kCutBoxBytes;
  static_assert(BARRIERS * 8 <= 1024, "barriers before the cut scratch");
};

#ifdef RL_ALIGN_SM90A_DEVICE
constexpr int kConsumerBar = 1;

template <int D>
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t base, int ks) {
  return smem_desc(base + (ks / 4) * kBoxBytes + (ks % 4) * 32, kBoxBytes, kSwizzleAtomBytes);
}
__device__ __forceinline__ uint64_t mn_desc(uint32_t base, int kc) {
  return smem_desc(base + kc * 16 * 128, kBoxBytes, kSwizzleAtomBytes);
}

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
// of two-tile stages (Q and dO, or K and V), the barriers (full, empty per stage; resident ready,
// tail, resident free), then (EXACT) a cut scratch per consumer 1024 bytes past the ring.
template <typename Cfg>
struct BwdSmem {
  uint8_t *resident_a, *resident_b, *ring;
  uint64_t *full, *empty, *resident_ready, *tail, *resident_free;
  uint8_t* cut_scratch;
  __device__ __forceinline__ explicit BwdSmem(uint8_t* smem_raw) {
    uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    resident_a = smem;
    resident_b = smem + Cfg::CONSUMERS * Cfg::TILE_BYTES;
    ring = smem + Cfg::RESIDENT_BYTES;
    full = reinterpret_cast<uint64_t*>(ring + Cfg::STAGES * Cfg::STAGE_BYTES);
    empty = full + Cfg::STAGES;
    resident_ready = empty + Cfg::STAGES;
    tail = resident_ready + 1;
    resident_free = tail + 1;
    cut_scratch = ring + Cfg::STAGES * Cfg::STAGE_BYTES + 1024;
  }
  __device__ __forceinline__ uint8_t* stage_a(int s) const { return ring + s * Cfg::STAGE_BYTES; }
  __device__ __forceinline__ uint8_t* stage_b(int s) const { return ring + s * Cfg::STAGE_BYTES + Cfg::TILE_BYTES; }
  // By thread 0, then the CTA syncs; the resident barriers only where the producer loads the
  // resident tiles (dK/dV: the consumers of dQ store theirs).
  template <bool EXACT, bool RESIDENT_LOADED>
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < Cfg::STAGES; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], Cfg::CONSUMERS * kStageReleaseArrivals<EXACT>);
      }
      if (RESIDENT_LOADED) mbar_init(resident_ready, 1);
      mbar_init(tail, 1);
      if (RESIDENT_LOADED) mbar_init(resident_free, Cfg::CONSUMERS);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
};

// acc += A B over the 4 k16 chunks of a 64-row block in increasing k (A in registers, B the
// MN-major tile at b_addr), issued and waited for.
template <typename T, int D>
__device__ __forceinline__ void rs_block_product(float (&acc)[D / 2], const uint32_t (&a)[4][4], uint32_t b_addr) {
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) WgmmaRs<D, T>::template mma<1>(acc, a[kc], mn_desc(b_addr, kc), 1);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulators(acc);
}

// A consumer's release of its ring stage (kStageReleaseArrivals), then the next stage.
template <int STAGES, bool EXACT>
__device__ __forceinline__ void release_and_advance(uint64_t* empty, int tid, int& stage, uint32_t& phase) {
  if (arrives_on_stage_release<EXACT>(tid)) mbar_arrive(&empty[stage]);
  if (++stage == STAGES) {
    stage = 0;
    phase ^= 1;
  }
}

// Rows of a [rows][head_dim] operand, row r from `src(r)` (nullptr: zeros), into the
// 128-byte-swizzle layout of a TMA box stack, by one warpgroup.
template <int D, typename Src>
__device__ __forceinline__ void store_rows_swizzled(uint8_t* dst, int tid, Src&& src) {
  constexpr int CHUNKS = D / 8;
  for (int i = tid; i < kTileRows * CHUNKS; i += kWarpgroupThreads) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const uint4* s = src(r);
    const uint4 val = s != nullptr ? s[c] : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(dst + swizzled_chunk_offset(r, c / 8, c % 8)) = val;
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// dK / dV
// ------------------------------------------------------------------------------------------------

// EXACT (both kernels): the recompute launch after a fast one flagged a non-finite gradient; on
// the causal diagonal the dV, dK (dQ) products run by cuts (rs_product_by_cuts), so that a masked
// pair's non-finite partner row (dO_i, q_i; k_j) reaches no gradient row that may not see it.
template <typename T, typename Cfg, bool EXACT>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    attention_bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap do_map,
                                   const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                                   const OperandMap q_at, const OperandMap kv_at, const AttentionGradProblem gp, int group, float scale_log2) {
#ifdef RL_ALIGN_SM90A_DEVICE
  constexpr int D = Cfg::HEAD_DIM, STAGES = Cfg::STAGES, KEYS = Cfg::ROWS;
  const AttentionProblem& p = gp.fwd;
  extern __shared__ uint8_t smem_raw[];
  if (EXACT && *gp.fwd.status == 0) return;  // the fast kernels' gradients stand
  const BwdSmem<Cfg> sm(smem_raw);  // resident K, V; stages of Q, dO
  uint8_t *k_tile = sm.resident_a, *v_tile = sm.resident_b;
  uint64_t *kv_ready = sm.resident_ready, *kv_free = sm.resident_free;
  auto q_stage = [&](int s) { return sm.stage_a(s); };
  auto do_stage = [&](int s) { return sm.stage_b(s); };
  sm.template init_barriers<EXACT, true>();
  auto uniform = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
  const int warpgroup = uniform(static_cast<int>(threadIdx.x) / kWarpgroupThreads);
  const int kv_head = static_cast<int>(blockIdx.x);
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

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x >= 32) return;
    const int lane = static_cast<int>(threadIdx.x);
    PairRingProducer<STAGES, Cfg::D_BOXES> qdo_ring{sm.ring, Cfg::STAGE_BYTES, Cfg::TILE_BYTES,
                                                    sm.full, sm.empty, sm.tail};
    uint32_t kv_phase = 0;
    for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
      const AttentionSeq sq = attention_seq(p, s);
      const int q_len = static_cast<int>(sq.q_len), kv_len = static_cast<int>(sq.kv_len);
      if (q_len <= 0) continue;
      const int first_pos = kv_len - q_len;
      const int key_tiles = (kv_len + KEYS - 1) / KEYS;
      int q_c1, q_c2, kv_c1, kv_c2;  // map coordinates of the sequence's token 0, head 0
      q_at.coords(sq.q_base, 0, 0, q_c1, q_c2);
      kv_at.coords(sq.kv_base, 0, 0, kv_c1, kv_c2);
      for (int tile = static_cast<int>(blockIdx.z); tile < key_tiles; tile += static_cast<int>(gridDim.z)) {
        const auto [key0, first_qb, q_blocks] = key_tile(tile, q_len, first_pos);
        // K, V of the tile, once both consumers are done with the previous tile's (kv_free).
        mbar_wait(kv_free, kv_phase ^ 1);
        kv_phase ^= 1;
        if (lane == 0) {
          mbar_arrive_expect_tx(kv_ready, Cfg::RESIDENT_BYTES);
          for (int c = 0; c < Cfg::CONSUMERS; ++c) {
            int c1, c2;
            kv_at.step(kv_c1, kv_c2, kv_head, key0 + c * kTileRows, c1, c2);
            for (int b = 0; b < Cfg::D_BOXES; ++b) {
              tma_load_3d(k_tile + c * Cfg::TILE_BYTES + b * kBoxBytes, &k_map, kv_ready, b * kBoxElems, c1, c2);
              tma_load_3d(v_tile + c * Cfg::TILE_BYTES + b * kBoxBytes, &v_map, kv_ready, b * kBoxElems, c1, c2);
            }
          }
        }
        for (int it = 0; it < group * q_blocks; ++it) {
          const int head = kv_head * group + it / q_blocks;
          const int qstart = (first_qb + it % q_blocks) * kTileRows;
          int c1, c2;
          q_at.step(q_c1, q_c2, head, qstart, c1, c2);
          qdo_ring.load(&q_map, &do_map, c1, c2, q_len - qstart, lane);  // Q, dO rows past q_len: zeros
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
  const int consumer = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  T* __restrict__ dk = static_cast<T*>(gp.dk);
  T* __restrict__ dv = static_cast<T*>(gp.dv);
  const uint32_t my_k = smem_addr(k_tile + consumer * Cfg::TILE_BYTES);
  const uint32_t my_v = smem_addr(v_tile + consumer * Cfg::TILE_BYTES);
  int stage = 0;
  uint32_t phase = 0, kv_phase = 0;

  for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = uniform(static_cast<int>(sq.q_len)), kv_len = uniform(static_cast<int>(sq.kv_len));
    if (q_len <= 0) continue;
    const int first_pos = kv_len - q_len;
    const int key_tiles = (kv_len + KEYS - 1) / KEYS;
    for (int tile = static_cast<int>(blockIdx.z); tile < key_tiles; tile += static_cast<int>(gridDim.z)) {
      const auto [key0, first_qb, q_blocks] = key_tile(tile, q_len, first_pos);
      const int my_key0 = key0 + consumer * kTileRows;
      const int warp_key0 = my_key0 + warp * 16;
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

      for (int it = 0; it < group * q_blocks; ++it) {
        const int head = kv_head * group + it / q_blocks;
        const int qstart = (first_qb + it % q_blocks) * kTileRows;
        mbar_wait(&sm.full[stage], phase);
        // A warpgroup whose keys all come after the block's last query (causal), or lie past
        // kv_len, would only add exact zeros / unused values: skipped (released only).
        const bool skip = my_key0 >= kv_len || (p.causal && my_key0 > first_pos + qstart + kTileRows - 1);
        if (!skip) {
          const uint32_t q_addr = smem_addr(q_stage(stage)), do_addr = smem_addr(do_stage(stage));
          // lse log2(e) and delta of this thread's query columns qstart + 8 nt + 2 t + e.
          const int64_t lse_row = sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head;
          float pt[1][8][4];
          float(&pt_flat)[32] = *reinterpret_cast<float(*)[32]>(&pt[0][0][0]);
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
            Wgmma<64, T>::template mma<0, 0>(pt_flat, kmajor_desc<D>(my_k, ks), kmajor_desc<D>(q_addr, ks), ks > 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(pt_flat);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const int i0 = qstart + nt * 8 + 2 * t;
            const float l0 = i0 < q_len ? __fmul_rn(p.lse[lse_row + i0], kLog2e) : 0.f;
            const float l1 = i0 + 1 < q_len ? __fmul_rn(p.lse[lse_row + i0 + 1], kLog2e) : 0.f;
#pragma unroll
            for (int e = 0; e < 4; ++e) pt[0][nt][e] = ex2(__fmaf_rn(pt[0][nt][e], scale_log2, -(e % 2 ? l1 : l0)));
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
          // dV += P^T dO (queries as k), then dP^T = V dO^T, on the tensor cores together.
          float dpt[1][8][4];
          float(&dpt_flat)[32] = *reinterpret_cast<float(*)[32]>(&dpt[0][0][0]);
          // EXACT on the diagonal: key row r may use the chunk's queries from its own position on.
          const bool cuts = EXACT && p.causal && my_key0 + kTileRows - 1 > first_pos + qstart;
          auto by_cuts = [&](float (&acc)[D / 2], const uint32_t (&a)[4][4], const uint8_t* b_tile) {
            uint8_t* scratch = sm.cut_scratch + consumer * Cfg::D_BOXES * kCutBoxBytes;
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
          if (cuts) by_cuts(dv_flat, pa, do_stage(stage));
          wgmma_fence();
          if (!cuts) {
#pragma unroll
            for (int kc = 0; kc < 4; ++kc) WgmmaRs<D, T>::template mma<1>(dv_flat, pa[kc], mn_desc(do_addr, kc), 1);
            wgmma_commit();
          }
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
            Wgmma<64, T>::template mma<0, 0>(dpt_flat, kmajor_desc<D>(my_v, ks), kmajor_desc<D>(do_addr, ks), ks > 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(dpt_flat);
          fence_accumulators(dv_flat);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const int i0 = qstart + nt * 8 + 2 * t;
            const float d0 = i0 < q_len ? gp.delta[lse_row + i0] : 0.f;
            const float d1 = i0 + 1 < q_len ? gp.delta[lse_row + i0 + 1] : 0.f;
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[0][nt][e] = __fmul_rn(pt[0][nt][e], __fsub_rn(dpt[0][nt][e], e % 2 ? d1 : d0));
          }
          if (sub_masked) mask_sub(dpt);
#pragma unroll
          for (int kc = 0; kc < 4; ++kc) c_to_a<T>(pa[kc], dpt[0][2 * kc], dpt[0][2 * kc + 1]);
          if (cuts) {
            by_cuts(dk_flat, pa, q_stage(stage));
          } else {
            rs_block_product<T, D>(dk_flat, pa, q_addr);
          }
        }
        release_and_advance<STAGES, EXACT>(sm.empty, tid, stage, phase);
      }

      // Epilogue: keys below kv_len; dK = scale * acc and dV rounded once.
      bool nonfinite = false;
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
          nonfinite = nonfinite || !isfinite(k0) || !isfinite(k1) || !isfinite(v0) || !isfinite(v1);
          *reinterpret_cast<uint32_t*>(dk + off + dn * 8) = pack_rounded<T>(k0, k1);
          *reinterpret_cast<uint32_t*>(dv + off + dn * 8) = pack_rounded<T>(v0, v1);
        }
      }
      if (!EXACT && p.status != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) *p.status = 1;
      if (tid == 0) mbar_arrive(kv_free);  // this consumer's products of the tile are all done
    }
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
  const int kv_head = static_cast<int>(blockIdx.x);
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

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x >= 32) return;
    const int lane = static_cast<int>(threadIdx.x);
    PairRingProducer<STAGES, Cfg::D_BOXES> kv_ring{sm.ring, Cfg::STAGE_BYTES, Cfg::TILE_BYTES,
                                                   sm.full, sm.empty, sm.tail};
    for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
      const AttentionSeq sq = attention_seq(p, s);
      const int q_len = static_cast<int>(sq.q_len), kv_len = static_cast<int>(sq.kv_len);
      if (q_len <= 0) continue;
      const int rows = q_len * group, tiles = (rows + ROWS - 1) / ROWS;
      const int first_pos = kv_len - q_len;
      int kv_c1, kv_c2;
      kv_at.coords(sq.kv_base, kv_head, 0, kv_c1, kv_c2);
      for (int visit = static_cast<int>(blockIdx.z); visit < tiles; visit += static_cast<int>(gridDim.z)) {
        const auto [row0, num_blocks] = row_tile(visit, tiles, rows, kv_len, first_pos);
        for (int b = 0; b < num_blocks; ++b) {
          const int key0 = b * kTileRows;
          int c1, c2;
          kv_at.step(kv_c1, kv_c2, 0, key0, c1, c2);
          kv_ring.load(&k_map, &v_map, c1, c2, kv_len - key0, lane);  // K rows past kv_len meet dS = +0: zeros
        }
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
  int stage = 0;
  uint32_t phase = 0;

  for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = uniform(static_cast<int>(sq.q_len)), kv_len = uniform(static_cast<int>(sq.kv_len));
    if (q_len <= 0) continue;
    const int rows = q_len * group, tiles = (rows + ROWS - 1) / ROWS;
    const int first_pos = kv_len - q_len;
    for (int visit = static_cast<int>(blockIdx.z); visit < tiles; visit += static_cast<int>(gridDim.z)) {
      const auto [row0, num_blocks] = row_tile(visit, tiles, rows, kv_len, first_pos);
      const int my_row0 = row0 + consumer * kTileRows;
      const bool active = my_row0 < rows;
      const int my_last_pos = first_pos + ((my_row0 + kTileRows < rows ? my_row0 + kTileRows : rows) - 1) / group;

      named_bar_sync(kConsumerBar + consumer, kWarpgroupThreads);  // the last tile's products are done
      if (active) {
        auto row_src = [&](const T* base) {
          return [&, base](int r) -> const uint4* {
            const int row = my_row0 + r;
            if (row >= rows) return nullptr;
            const int64_t i = row / group, h = static_cast<int64_t>(kv_head) * group + row % group;
            return reinterpret_cast<const uint4*>(base + sq.q_base + i * p.q_stride_token + h * p.q_stride_head);
          };
        };
        store_rows_swizzled<D>(my_q, tid, row_src(q));
        store_rows_swizzled<D>(my_do, tid, row_src(dout));
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
      const uint32_t q_addr = smem_addr(my_q), do_addr = smem_addr(my_do);
      const int my_end = !active ? 0 : p.causal ? my_last_pos / kTileRows + 1 : num_blocks;
      const int my_first_pos = first_pos + my_row0 / group;

      for (int b = 0; b < num_blocks; ++b) {
        mbar_wait(&sm.full[stage], phase);
        if (b < my_end) {
          const int key0 = b * kTileRows;
          const uint32_t k_addr = smem_addr(k_stage(stage)), v_addr = smem_addr(v_stage(stage));
          float sp[1][8][4], ds[1][8][4];
          float(&sp_flat)[32] = *reinterpret_cast<float(*)[32]>(&sp[0][0][0]);
          float(&ds_flat)[32] = *reinterpret_cast<float(*)[32]>(&ds[0][0][0]);
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
            Wgmma<64, T>::template mma<0, 0>(sp_flat, kmajor_desc<D>(q_addr, ks), kmajor_desc<D>(k_addr, ks), ks > 0);
          wgmma_commit();
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks)
            Wgmma<64, T>::template mma<0, 0>(ds_flat, kmajor_desc<D>(do_addr, ks), kmajor_desc<D>(v_addr, ks), ks > 0);
          wgmma_commit();
          wgmma_wait<0>();
          fence_accumulators(sp_flat);
          fence_accumulators(ds_flat);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sp[0][nt][e] = ex2(__fmaf_rn(sp[0][nt][e], scale_log2, -lse_l2[e / 2]));
          }
          const bool diag = p.causal && key0 + kTileRows - 1 > warp_first_pos;
          const bool masked = diag || key0 + kTileRows > kv_len;
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
            uint8_t* scratch = sm.cut_scratch + consumer * Cfg::D_BOXES * kCutBoxBytes;
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
            rs_block_product<T, D>(dq_flat, dsa, k_addr);
          }
        }
        release_and_advance<STAGES, EXACT>(sm.empty, tid, stage, phase);
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
          nonfinite = nonfinite || !isfinite(a0) || !isfinite(a1);
          *reinterpret_cast<uint32_t*>(dq_row + dn * 8) = pack_rounded<T>(a0, a1);
        }
      }
      if (!EXACT && p.status != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) *p.status = 1;
    }
  }
#endif  // RL_ALIGN_SM90A_DEVICE
}

template <typename T, int D>
gpuError_t launch_bwd(DType dtype, const AttentionGradProblem& gp, const OperandMap& q_at, const OperandMap& kv_at,
                      gpuStream_t stream) {
  using Cfg = BwdConfig<D, 2>;
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
  auto run = [&](auto exact_tag) -> gpuError_t {
    constexpr bool EXACT = decltype(exact_tag)::value;
    constexpr int kSmem = EXACT ? Cfg::EXACT_SMEM_BYTES : Cfg::SMEM_BYTES;
    // The kernels walk sequences and tiles grid-stride. The EXACT launch mostly finds nothing to do
    // (the status word is 0): a small grid keeps it to a few microseconds.
    const unsigned seqs = capped(p.num_seqs, EXACT ? 16 : 65535);
    const dim3 dkdv_grid(static_cast<unsigned>(p.heads_kv), seqs,
                         EXACT ? 1u : capped(ceil_div(p.max_kv_len, static_cast<int64_t>(Cfg::ROWS)), 65535));
    const dim3 dq_grid(static_cast<unsigned>(p.heads_kv), seqs,
                       EXACT ? 1u : capped(ceil_div(p.max_q_len * group, static_cast<int64_t>(Cfg::ROWS)), 65535));
    auto dkdv = attention_bwd_dkdv_sm90_kernel<T, Cfg, EXACT>;
    static std::atomic<uint64_t> dkdv_raised{0};
    gpuError_t e = allow_dynamic_smem(dkdv, kSmem, dkdv_raised);
    if (e != cudaSuccess) return e;
    dkdv<<<dkdv_grid, Cfg::THREADS, kSmem, stream>>>(q_map, do_map, k_map, v_map, q_at, kv_at, gp,
                                                     static_cast<int>(group), scale_log2);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    auto dq = attention_bwd_dq_sm90_kernel<T, Cfg, EXACT>;
    static std::atomic<uint64_t> dq_raised{0};
    e = allow_dynamic_smem(dq, kSmem, dq_raised);
    if (e != cudaSuccess) return e;
    dq<<<dq_grid, Cfg::THREADS, kSmem, stream>>>(k_map, v_map, kv_at, gp, static_cast<int>(group), scale_log2);
    return cudaGetLastError();
  };
  // The fast kernels, then (where keys are masked inside a sequence: causal) the EXACT ones, which
  // recompute only if a fast one flagged a non-finite gradient.
  err = run(std::false_type{});
  if (err != cudaSuccess || !p.causal) return err;
  return run(std::true_type{});
}

}  // namespace

// Problem requirements: the sm80 backward's (attention_bwd_sm80), a status word, and Q, dO, K and V
// addressable through tensor maps (q_map_problem, kv_map_problem: the launcher sends other layouts
// to the sm80 path, attention_sm90_layout_problem); cudaErrorInvalidValue otherwise.
gpuError_t attention_bwd_sm90(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream) {
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
        return p.head_dim == 64 ? launch_bwd<T, 64>(dtype, gp, q_at, kv_at, stream)
                                : launch_bwd<T, 128>(dtype, gp, q_at, kv_at, stream);
      },
      gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t attention_bwd_sm90(DType, const AttentionGradProblem&, gpuStream_t) { return RL_GPU(ErrorNotSupported); }
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
