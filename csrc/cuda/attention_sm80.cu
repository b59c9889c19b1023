// Ampere-class (sm_80+) tensor-core attention forward: FlashAttention-2-style online softmax with
// mma.sync m16n8k16 (fp32 accumulators), ldmatrix fragments and a cp.async ring of K/V blocks.
// Runs on every CUDA GPU of compute capability >= 8.0 (the H100 too); bf16 and fp16, head_dim 64
// and 128. The arithmetic is the contract of csrc/common/attention_problem.h.
//
// Work split. A CTA owns one (sequence, kv head g, tile of BLOCK_M query ROWS). With
// G = heads_q / heads_kv, global row R of the (sequence, g) pair is query i = R / G of query head
// h = g G + R % G, so the G heads of a group sit in one tile and share every K/V block loaded for
// it (GQA packing). Each warp owns M_TILES m16 tiles of rows; a row is computed by one warp from
// its first key block to its last, never split across warps or CTAs (no split-KV).
//
// Per row and per 64-key block b = [64 b, 64 b + 64), in increasing b (the contract's blocks),
// with c = scale * log2(e) rounded once on the host and only the row's allowed keys j (below
// kv_len, and up to the row's position when causal):
//   s_j   = Q_row . K_j          mma.sync over the k16 chunks d = 0, 16, 32, ... in increasing
//                                order, from a zero accumulator (D / 16 chained mma per element)
//   m'    = max(m, c * max_j s_j)   (min_j for c < 0): = max_j fl(c s_j), rounding being monotonic;
//                                   max/min are exact, so their tree order is free
//   alpha = m == m' ? 1 : ex2(m - m');   p_j = ex2(fma(s_j, c, -m'))   (ex2.approx.ftz)
//   l     = fma(l, alpha, sum_j p_j)     sum_j: a fixed pairwise tree over the lane's 16 keys,
//                                        then a butterfly over the row's 4 lanes (commutative)
//   acc   = acc * alpha (skipped when alpha = 1 for every row of the warp: exact), then += P V
//           over the 4 k16 key chunks in increasing order (mma.sync), P = p_j rounded to the
//           input dtype (the mma A operand); masked keys have p_j = 0
// and at the end out = acc * (1 / l) (Newton-refined reciprocal), rounded once to the input
// dtype, lse = m ln 2 + log(l). Every operation is written with an explicit rounding intrinsic,
// so the compiler cannot contract it differently in different instantiations.
//
// Invariance. Nothing above depends on the tile a row lands in: the fragments a thread holds for
// its row are the row's own Q and the sequence's K/V, an mma result for element (row, key) depends
// only on that row of A, that column of B and its own accumulator, and the key-block loop starts
// at the sequence's own position 0 (kv_base) whatever surrounds the sequence. The tile
// configuration (rows per CTA, warps, ring depth) only changes which thread computes a row, so
// the DECODE config (16 rows, one warp, deep ring: few rows stream K/V at full bandwidth) and the
// PREFILL config (128 rows, 4 warps of 32 rows) give the same bits; the config is chosen from
// (max_q_len * G, head_dim) only. Blocks past a row's own causal limit: a CTA visits the blocks
// of its LAST row, so an earlier row may meet whole blocks of masked keys. Such a block
// contributes exact zeros: block 0 always holds an allowed key (key 0 <= every position), so m is
// finite after it; a block with no allowed key leaves m' = m, alpha = 1 (selected, not
// computed) and p_j = +0 for every key, so l = fma(l, 1, +0) = l, acc * 1 = acc and the P V mma
// adds products +0 * v = +-0 to acc (V finite), which leaves acc's bits unchanged (acc != 0:
// x + 0 = x; acc = +0: +0 + (+-0) = +0 in round-to-nearest; acc is never -0, since it starts at +0
// and only ever has zeros or finite values added). A warp whose rows all lie before a block skips
// it outright, which is the same thing. Keys past kv_len are cp.async zero fill and masked.
#include "attention_kernels.h"
#include "attention_sm80_common.h"
#include "../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

#include <atomic>

namespace rl_align {
namespace {

// ------------------------------------------------------------------------------------------------
// Tile configurations (the partition: chosen from max_q_len * G and head_dim, never from results)
// ------------------------------------------------------------------------------------------------

constexpr int kKvBlock = static_cast<int>(kAttentionKvBlock);  // keys per online-softmax block

// WARPS warps of M_TILES m16 row tiles each (BLOCK_M rows per CTA); STAGES K/V blocks in the
// cp.async ring; MIN_BLOCKS CTAs per SM for __launch_bounds__.
template <int HEAD_DIM_, int WARPS_, int M_TILES_, int STAGES_, int MIN_BLOCKS_>
struct FwdConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int WARPS = WARPS_;
  static constexpr int M_TILES = M_TILES_;
  static constexpr int STAGES = STAGES_;
  static constexpr int MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr int THREADS = WARPS * kWarpSize;
  static constexpr int WARP_ROWS = M_TILES * kMmaM;
  static constexpr int BLOCK_M = WARPS * WARP_ROWS;
  static constexpr int D_STEPS = HEAD_DIM / kMmaK;     // k16 chunks of a q.k dot product
  static constexpr int D_TILES = HEAD_DIM / kMmaN;     // n8 tiles of an output row
  static constexpr int KEY_TILES = kKvBlock / kMmaN;   // n8 tiles of a block's scores
  static constexpr int KEY_STEPS = kKvBlock / kMmaK;   // k16 key chunks of P V
  // Q fragments stay in registers when they take at most 32 of them; otherwise (two m16 tiles of
  // head_dim 128) they are re-read from shared memory at every k16 chunk, which leaves the
  // registers to the 128 fp32 output accumulators. Same values either way.
  static constexpr bool Q_IN_REGS = M_TILES * HEAD_DIM <= 128;
  static constexpr int PITCH_BYTES = (HEAD_DIM + kPadElems) * kElemBytes;
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / kChunkElems;
  static constexpr int Q_BYTES = BLOCK_M * PITCH_BYTES;
  static constexpr int KV_TILE_BYTES = kKvBlock * PITCH_BYTES;  // K (then V) of one block
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES;
  static constexpr int KEYS_PER_COPY = THREADS / CHUNKS_PER_ROW;  // rows one copy sweep covers
  static constexpr int KV_COPIES = kKvBlock / KEYS_PER_COPY;      // sweeps per K (or V) tile
  static constexpr int Q_COPIES = BLOCK_M * CHUNKS_PER_ROW / THREADS;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim");
  static_assert(PITCH_BYTES % 32 == 16, "odd pitch in 16-byte units: conflict-free ldmatrix");
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && kKvBlock % KEYS_PER_COPY == 0, "K/V copy sweeps");
  static_assert(BLOCK_M * CHUNKS_PER_ROW % THREADS == 0, "Q copy sweeps");
  static_assert(STAGES >= 2, "pipeline");
};

// Decode: 16 rows (one warp: up to 4 queries of a 4-head group), a 3-block ring (two blocks in
// flight while one is consumed; 106 KB at head_dim 128: two CTAs per SM), so that batch x kv heads
// CTAs each stream their sequence's K/V at full bandwidth.
template <int D>
using DecodeConfig = FwdConfig<D, 1, 1, 3, 2>;
// Prefill: 128 rows, 4 warps of two m16 tiles (each K/V fragment feeds two mma), a 2-block ring
// (102 KB at head_dim 128: two CTAs per SM).
template <int D>
using PrefillConfig = FwdConfig<D, 4, 2, 2, 2>;
// Rows (max_q_len * G) up to which the decode config runs: at most two decode CTAs then read each
// (sequence, kv head)'s K/V; past it, a prefill CTA shares each K/V block among 128 rows.
constexpr int64_t kDecodeMaxRows = 32;

#ifdef RL_ALIGN_SM80_DEVICE

// 1 / l for l >= 1 (the row sum holds p = 1 for the row's max): hardware approximation plus one
// Newton step, within an ulp of the correctly rounded value. Written out (rather than IEEE
// division) so that the epilogue has no slow-path call, which would spill the accumulators.
__device__ __forceinline__ float reciprocal(float l) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(l));
  return __fmaf_rn(r, __fmaf_rn(-l, r, 1.f), r);
}

// max(a, b) for a scale >= 0, min(a, b) for a negative one.
template <bool SCALE_NONNEG>
__device__ __forceinline__ float extreme(float a, float b) {
  return SCALE_NONNEG ? fmaxf(a, b) : fminf(a, b);
}



#endif  // RL_ALIGN_SM80_DEVICE

// ------------------------------------------------------------------------------------------------
// Kernel
// ------------------------------------------------------------------------------------------------

// Grid: x = row tiles (grid-stride up to the sequence's own q_len * G, heaviest tile first),
// y = kv head, z = sequences (grid-stride). x is the fastest launch order, so the tiles of one
// (sequence, kv head) run together and share its K/V in L2.
template <typename T, typename Cfg, bool SCALE_NONNEG>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_BLOCKS)
    attention_fwd_sm80_kernel(const AttentionProblem p, int group, float scale_log2) {
#ifdef RL_ALIGN_SM80_DEVICE
  constexpr int PITCH = Cfg::PITCH_BYTES, MT = Cfg::M_TILES, STAGES = Cfg::STAGES;
  constexpr int BLOCK_M = Cfg::BLOCK_M, CPR = Cfg::CHUNKS_PER_ROW;

  extern __shared__ __align__(16) uint8_t attn_smem[];
  const uint32_t q_smem = smem_u32(attn_smem);
  const uint32_t kv_ring = q_smem + Cfg::Q_BYTES;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int kv_head = static_cast<int>(blockIdx.y);
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  T* __restrict__ out = static_cast<T*>(p.out);

  // Scores are scaled inside the exponent (one fma per key): the block's max of s_j scale_log2
  // is scale_log2 times the max of s_j (min for a negative scale), and masked keys hold the
  // identity of that extreme.
  const float ext_identity = SCALE_NONNEG ? -INFINITY : INFINITY;
  // ldmatrix addresses: Q is the A operand of S = Q K^T, K its B operand with rows = keys (n), V
  // the B operand of P V with rows = keys (k, loaded transposed).
  const uint32_t q_lane = q_smem + a_lane_offset<PITCH>(lane, warp * Cfg::WARP_ROWS);
  const uint32_t k_lane = kv_ring + bn_lane_offset<PITCH>(lane);
  const uint32_t v_lane = kv_ring + Cfg::KV_TILE_BYTES + bk_lane_offset<PITCH>(lane);
  // This thread's copy slot: rows (keys of a K/V tile, rows of the Q tile) copy_key +
  // KEYS_PER_COPY c, 16-byte chunk copy_chunk.
  const int copy_key = tid / CPR, copy_chunk = tid % CPR;
  // The Q copy covers KEYS_PER_COPY rows per sweep, i.e. this many queries and heads.
  const int q_step_queries = Cfg::KEYS_PER_COPY / group, q_step_heads = Cfg::KEYS_PER_COPY % group;

  for (int64_t s = blockIdx.z; s < p.num_seqs; s += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = static_cast<int>(sq.q_len);
    const int kv_len = static_cast<int>(sq.kv_len);
    if (q_len <= 0) continue;
    const int rows = q_len * group;  // < 2^31 (entry point)
    const int tiles = (rows + BLOCK_M - 1) / BLOCK_M;
    const int first_pos = kv_len - q_len;  // position of query 0
    // Element offset of this thread's copy slot in key 0 of the sequence's kv head (K and V).
    const int64_t copy_off = sq.kv_base + static_cast<int64_t>(kv_head) * p.kv_stride_head +
                             static_cast<int64_t>(copy_key) * p.kv_stride_token + copy_chunk * kChunkElems;

    for (int visit = static_cast<int>(blockIdx.x); visit < tiles; visit += static_cast<int>(gridDim.x)) {
      // Later rows attend to more keys (causal): the CTA that starts first takes the last tile.
      const int row0 = (tiles - 1 - visit) * BLOCK_M;
      const int cta_last_row = (row0 + BLOCK_M < rows ? row0 + BLOCK_M : rows) - 1;
      const int cta_last_pos = first_pos + cta_last_row / group;
      const int num_blocks = p.causal ? cta_last_pos / kKvBlock + 1
                                      : static_cast<int>(ceil_div(kv_len, kKvBlock));

      // Copies. Q rows past the tile's valid rows and keys past kv_len are zero fill (read
      // nothing). Every thread copies whole 16-byte chunks of one column.
      auto load_q = [&]() {
        // Rows copy_key + KEYS_PER_COPY c; (query, head in group) advance without a division.
        int row = row0 + copy_key;
        int query = row / group, head = row % group;
#pragma unroll
        for (int c = 0; c < Cfg::Q_COPIES; ++c) {
          const T* src = q;
          if (row < rows) {
            src = q + sq.q_base + static_cast<int64_t>(query) * p.q_stride_token +
                  static_cast<int64_t>(kv_head * group + head) * p.q_stride_head +
                  copy_chunk * kChunkElems;
          }
          cp_async_16_zfill(q_smem + (row - row0) * PITCH + copy_chunk * 16, src,
                            row < rows ? 16 : 0);
          row += Cfg::KEYS_PER_COPY;
          query += q_step_queries;
          head += q_step_heads;
          if (head >= group) {
            head -= group;
            ++query;
          }
        }
      };
      auto load_kv = [&](int stage, int block) {
        copy_row_pair_async<T, Cfg::KV_COPIES, Cfg::KEYS_PER_COPY, PITCH, 4>(
            kv_ring + stage * Cfg::STAGE_BYTES + copy_key * PITCH + copy_chunk * 16, Cfg::KV_TILE_BYTES, k, v,
            copy_off + static_cast<int64_t>(block) * kKvBlock * p.kv_stride_token, p.kv_stride_token,
            block * kKvBlock + copy_key, kv_len);
      };

      // Prologue: Q with block 0 (group 0), then blocks 1 .. STAGES-2 (one group each, empty
      // past the end, so that group b always holds block b).
      load_q();
      load_kv(0, 0);
      cp_async_commit();
#pragma unroll
      for (int b = 1; b < STAGES - 1; ++b) {
        if (b < num_blocks) load_kv(b, b);
        cp_async_commit();
      }

      // This thread's rows: (m16 tile mt, half hh) is warp row 16 mt + 8 hh + g.
      const int warp_row0 = row0 + warp * Cfg::WARP_ROWS;
      const bool warp_active = warp_row0 < rows;
      const int warp_last_row =
          (warp_row0 + Cfg::WARP_ROWS < rows ? warp_row0 + Cfg::WARP_ROWS : rows) - 1;
      const int warp_first_pos = first_pos + warp_row0 / group;
      const int warp_last_pos = first_pos + warp_last_row / group;
      int row_pos[MT][2];  // query position (rows past q_len: >= kv_len, never stored)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          row_pos[mt][hh] = first_pos + (warp_row0 + 16 * mt + 8 * hh + g) / group;
        }
      }

      // Online-softmax state (log2 domain) and output accumulators.
      float row_max[MT][2], row_sum[MT][2];
      float acc[MT][Cfg::D_TILES][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          row_max[mt][hh] = -INFINITY;
          row_sum[mt][hh] = 0.f;
        }
#pragma unroll
        for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][dn][e] = 0.f;
        }
      }
      uint32_t q_frag[Cfg::Q_IN_REGS ? MT : 1][Cfg::Q_IN_REGS ? Cfg::D_STEPS : 1][4];

      int stage = 0;
      for (int b = 0; b < num_blocks; ++b) {
        // Groups committed: STAGES - 1 + b; block b is group b, complete once at most STAGES - 2
        // are pending. The barrier publishes every thread's copies of block b and tells that all
        // warps finished block b - 1, whose stage the next copy overwrites.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
          const int next = b + STAGES - 1;
          if (next < num_blocks) load_kv(next % STAGES, next);
          cp_async_commit();
        }
        if constexpr (Cfg::Q_IN_REGS) {
          if (b == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
              for (int ks = 0; ks < Cfg::D_STEPS; ++ks) {
                ldmatrix_x4<false>(q_frag[mt][ks], q_lane + mt * kMmaM * PITCH + ks * kMmaK * kElemBytes);
              }
            }
          }
        }
        const int key0 = b * kKvBlock;
        // A warp whose rows all precede the block would only add exact zeros: skip it.
        if (warp_active && !(p.causal && key0 > warp_last_pos)) {
          const uint32_t k_stage = k_lane + stage * Cfg::STAGE_BYTES;
          const uint32_t v_stage = v_lane + stage * Cfg::STAGE_BYTES;

          // S = Q K^T: each element's chain takes the k16 chunks of d in increasing order.
          float score[MT][Cfg::KEY_TILES][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) score[mt][nt][e] = 0.f;
            }
          }
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks) {
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              if constexpr (Cfg::Q_IN_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) qa[mt][e] = q_frag[mt][ks][e];
              } else {
                ldmatrix_x4<false>(qa[mt], q_lane + mt * kMmaM * PITCH + ks * kMmaK * kElemBytes);
              }
            }
#pragma unroll
            for (int np = 0; np < Cfg::KEY_TILES / 2; ++np) {
              uint32_t kb[4];
              ldmatrix_x4<false>(kb, k_stage + np * 2 * kMmaN * PITCH + ks * kMmaK * kElemBytes);
              const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                Mma<T>::run(score[mt][2 * np], qa[mt], b0);
                Mma<T>::run(score[mt][2 * np + 1], qa[mt], b1);
              }
            }
          }

          // Online softmax per row. Masking is needed only where some key of the block is past
          // kv_len or past the warp's first position; elsewhere it would change nothing.
          const bool need_mask =
              key0 + kKvBlock > kv_len || (p.causal && key0 + kKvBlock - 1 > warp_first_pos);
          // Sets the scores of keys a row may not see to `masked` (masked blocks only). Allowed
          // keys of row (mt, hh): key0 + 2t + (8 nt + e) <= last key, i.e. 8 nt + e <= limit
          // (one register per row against immediates).
          auto mask_scores = [&](float masked) {
            if (!need_mask) return;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const int last_key = p.causal && row_pos[mt][hh] < kv_len ? row_pos[mt][hh] : kv_len - 1;
                const int limit = last_key - key0 - 2 * t;
#pragma unroll
                for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    if (nt * kMmaN + e > limit) score[mt][nt][2 * hh + e] = masked;
                  }
                }
              }
            }
          };
          // Masked keys hold the identity of the extreme below.
          mask_scores(ext_identity);
          float row_alpha[MT][2];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              // Extreme score of the allowed keys (max for scale >= 0, min for scale < 0): a
              // tree over the lane's 16 keys, then over the row's quad. max and min are exact,
              // so any order gives the same bits.
              float ext[Cfg::KEY_TILES];
#pragma unroll
              for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
                ext[nt] = extreme<SCALE_NONNEG>(score[mt][nt][2 * hh], score[mt][nt][2 * hh + 1]);
              }
#pragma unroll
              for (int w = Cfg::KEY_TILES / 2; w > 0; w /= 2) {
#pragma unroll
                for (int i = 0; i < w; ++i) ext[i] = extreme<SCALE_NONNEG>(ext[i], ext[i + w]);
              }
              ext[0] = extreme<SCALE_NONNEG>(ext[0], shfl_xor(ext[0], 1, 4));
              ext[0] = extreme<SCALE_NONNEG>(ext[0], shfl_xor(ext[0], 2, 4));
              // max_j (s_j scale_log2) = scale_log2 * ext (rounding is monotonic). A block with
              // no allowed key has ext = -+inf, and scale_log2 = 0 would give NaN: fmaxf drops it.
              const float old_max = row_max[mt][hh];
              const float new_max = fmaxf(old_max, __fmul_rn(ext[0], scale_log2));
              row_alpha[mt][hh] = old_max == new_max ? 1.f : ex2(__fsub_rn(old_max, new_max));
              row_max[mt][hh] = new_max;
              // p_j = 2^(s_j scale_log2 - m'): one fma per key.
#pragma unroll
              for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  score[mt][nt][2 * hh + e] =
                      ex2(__fmaf_rn(score[mt][nt][2 * hh + e], scale_log2, -new_max));
                }
              }
            }
          }
          // Masked keys: p_j = 0, selected (for scale_log2 != 0 the fma already gave -inf and
          // ex2(-inf) = +0; for scale_log2 = 0 it gave NaN).
          mask_scores(0.f);
          // Block sums: a fixed pairwise tree over the lane's 16 keys (key-tile pairs e = 0, 1,
          // then halving over the key tiles), then the quad butterfly (commutative: the 4 lanes
          // get the same bits); l = l alpha + sum.
          bool rescale = false;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              float part[Cfg::KEY_TILES];
#pragma unroll
              for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
                part[nt] = __fadd_rn(score[mt][nt][2 * hh], score[mt][nt][2 * hh + 1]);
              }
#pragma unroll
              for (int w = Cfg::KEY_TILES / 2; w > 0; w /= 2) {
#pragma unroll
                for (int i = 0; i < w; ++i) part[i] = __fadd_rn(part[i], part[i + w]);
              }
              float block_sum = part[0];
              block_sum = __fadd_rn(block_sum, shfl_xor(block_sum, 1, 4));
              block_sum = __fadd_rn(block_sum, shfl_xor(block_sum, 2, 4));
              row_sum[mt][hh] = __fmaf_rn(row_sum[mt][hh], row_alpha[mt][hh], block_sum);
              rescale = rescale || row_alpha[mt][hh] != 1.f;
            }
          }
          // acc * alpha. Once the running maxima settle, alpha is 1 for every row of the warp
          // and the multiply (acc * 1 = acc exactly) is skipped: same bits, fewer instructions.
          if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
              for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  acc[mt][dn][e] = __fmul_rn(acc[mt][dn][e], row_alpha[mt][e / 2]);
                }
              }
            }
          }

          // P in the input dtype, laid out as the A fragments of P V: the m16n8 accumulator of
          // keys 8 nt .. 8 nt + 7 is half of the m16k16 A fragment of key chunk nt / 2.
          uint32_t pa[MT][Cfg::KEY_STEPS][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) {
              c_to_a<T>(pa[mt][kc], score[mt][2 * kc], score[mt][2 * kc + 1]);
            }
          }
          // acc += P V: each element's chain takes the k16 key chunks in increasing order.
#pragma unroll
          for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) {
#pragma unroll
            for (int dp = 0; dp < Cfg::D_TILES / 2; ++dp) {
              uint32_t vb[4];
              ldmatrix_x4<true>(vb, v_stage + kc * kMmaK * PITCH + dp * 2 * kMmaN * kElemBytes);
              const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                Mma<T>::run(acc[mt][2 * dp], pa[mt][kc], b0);
                Mma<T>::run(acc[mt][2 * dp + 1], pa[mt][kc], b1);
              }
            }
          }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
      }
      cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

      // Epilogue: rows i < q_len only (row < rows). out = acc * (1 / l) rounded once; lse by
      // lane t = 0.
      if (warp_active) {
        // Read again here: offsets held in registers through the key loop would cost spills.
        const AttentionSeq out_seq = attention_seq(p, s);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = warp_row0 + 16 * mt + 8 * hh + g;
            if (row >= rows) continue;
            const int64_t i = row / group, h = kv_head * group + row % group;
            const float l = row_sum[mt][hh];
            const float inv_l = reciprocal(l);
            T* out_row = out + out_seq.q_base + i * p.q_stride_token + h * p.q_stride_head + 2 * t;
#pragma unroll
            for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
              const float o0 = __fmul_rn(acc[mt][dn][2 * hh], inv_l);
              const float o1 = __fmul_rn(acc[mt][dn][2 * hh + 1], inv_l);
              *reinterpret_cast<uint32_t*>(out_row + dn * kMmaN) = pack_rounded<T>(o0, o1);
            }
            if (t == 0) {
              p.lse[out_seq.lse_base + h * p.lse_stride_head + i] =
                  __fadd_rn(__fmul_rn(row_max[mt][hh], 0.69314718055994530942f), logf(l));
            }
          }
        }
      }
      __syncthreads();  // every warp is done with Q and the ring before the next tile's copies
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

template <typename T, typename Cfg, bool SCALE_NONNEG>
gpuError_t launch_kernel(const AttentionProblem& p, float scale_log2, gpuStream_t stream) {
  auto kernel = attention_fwd_sm80_kernel<T, Cfg, SCALE_NONNEG>;
  static std::atomic<uint64_t> raised{0};
  const gpuError_t err = allow_dynamic_smem(kernel, Cfg::SMEM_BYTES, raised);
  if (err != cudaSuccess) return err;
  const int64_t group = p.heads_q / p.heads_kv;  // G query heads per kv head
  const int64_t tiles = ceil_div(p.max_q_len * group, Cfg::BLOCK_M);
  const dim3 grid(static_cast<unsigned>(tiles < INT32_MAX ? tiles : INT32_MAX),
                  static_cast<unsigned>(p.heads_kv),
                  static_cast<unsigned>(p.num_seqs < 65535 ? p.num_seqs : 65535));
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(p, static_cast<int>(group), scale_log2);
  return cudaGetLastError();
}

template <typename T, typename Cfg>
gpuError_t launch_fwd(const AttentionProblem& p, gpuStream_t stream) {
  const float scale_log2 = scale_log2e(p);
  if (scale_log2 < 0.f) return launch_kernel<T, Cfg, false>(p, scale_log2, stream);
  return launch_kernel<T, Cfg, true>(p, scale_log2, stream);
}

template <typename T, int D>
gpuError_t dispatch_config(const AttentionProblem& p, gpuStream_t stream) {
  if (p.max_q_len * (p.heads_q / p.heads_kv) <= kDecodeMaxRows) {
    return launch_fwd<T, DecodeConfig<D>>(p, stream);
  }
  return launch_fwd<T, PrefillConfig<D>>(p, stream);
}

template <typename T>
gpuError_t dispatch_head_dim(const AttentionProblem& p, gpuStream_t stream) {
  if (p.head_dim == 64) return dispatch_config<T, 64>(p, stream);
  return dispatch_config<T, 128>(p, stream);
}


}  // namespace

// Problem requirements: sm80_attention_problem_error (attention_sm80_common.h).
gpuError_t attention_fwd_sm80(DType dtype, const AttentionProblem& p, gpuStream_t stream) {
  const gpuError_t err = sm80_attention_problem_error(dtype, p, p.heads_kv);  // grid y: kv heads
  if (err != cudaSuccess || p.num_seqs == 0 || p.max_q_len == 0) return err;
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype, [&](auto tag) { return dispatch_head_dim<decltype(tag)>(p, stream); }, gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t attention_fwd_sm80(DType, const AttentionProblem&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
