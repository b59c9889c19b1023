// Ampere-class (sm_80+) tensor-core attention forward: FlashAttention-2-style online softmax with
// mma.sync m16n8k16 (fp32 accumulators), ldmatrix fragments and a cp.async ring of K/V blocks.
// Runs on every CUDA GPU of compute capability >= 8.0 (the H100 too); bf16 and fp16, head_dim 64
// and 128. The arithmetic is the contract of csrc/common/attention_problem.h.
//
// Work split. A CTA owns one (sequence, kv head g, tile of BLOCK_M query ROWS). With
// G = heads_q / heads_kv, global row R of the (sequence, g) pair is query i = R / G of query head
// h = g G + R % G, so the G heads of a group sit in one tile and share every K/V block loaded for
// it (GQA packing). Each warp owns M_TILES m16 tiles of rows and computes them over a KV split
// (kAttentionKvSplit keys, attention_problem.h) from its first key block to its last (the decode
// kernel below shares a block's keys and columns among 4 warps instead, same per-element
// arithmetic); a prefill CTA merges a row's split partials itself, a decode step runs each split
// on its own CTA and a combine kernel (split_combine.cu) merges them (SplitMode below).
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
// the PREFILL config (128 rows, 4 warps of 32 rows), the SMALL-TILE config (16 rows, one warp)
// and the decode kernel (16 rows, 4 warps sharing each block's keys and columns) give the same
// bits; the kernel and config are chosen from (max_q_len * G, head_dim, max_kv_len) only. Blocks past a row's own causal limit: a CTA visits the blocks
// of its LAST row, so an earlier row may meet whole blocks of masked keys. Such a block
// contributes exact zeros: block 0 always holds an allowed key (key 0 <= every position), so m is
// finite after it; a block with no allowed key leaves m' = m, alpha = 1 (selected, not
// computed) and p_j = +0 for every key, so l = fma(l, 1, +0) = l, acc * 1 = acc and the P V mma
// adds products +0 * v = +-0 to acc (V finite), which leaves acc's bits unchanged (acc != 0:
// x + 0 = x; acc = +0: +0 + (+-0) = +0 in round-to-nearest; acc is never -0, since it starts at +0
// and only ever has zeros or finite values added). A warp whose rows all lie before a block skips
// it outright, which is the same thing. Keys past kv_len are cp.async zero fill and masked.
#include "../attention_kernels.h"
#include "recurrence.cuh"
#include "sm80_common.h"
#include "../../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

#include <atomic>
#include <type_traits>

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

// Few rows: 16 rows, one warp, a 3-block ring. The decode kernel below (4 warps sharing each
// block) runs such launches; this config runs them where it cannot: the exact kernel, and a
// launch with more splits than a grid dimension takes.
template <int D>
using SmallTileConfig = FwdConfig<D, 1, 1, 3, 2>;
// Prefill: 128 rows, 4 warps of two m16 tiles (each K/V fragment feeds two mma), a 2-block ring
// (102 KB at head_dim 128: two CTAs per SM).
template <int D>
using PrefillConfig = FwdConfig<D, 4, 2, 2, 2>;
// Rows (max_q_len * G) up to which the decode kernel runs (kAttentionPerSplitMaxRows, the launches
// that run each split on its own CTAs): at most two of its CTAs then read each (sequence, kv
// head)'s K/V; past it, a prefill CTA shares each K/V block among 128 rows.
constexpr int64_t kDecodeMaxRows = kAttentionPerSplitMaxRows;

// How a forward launch covers the KV splits (attention_problem.h); the bits are the same for all.
enum class SplitMode : int {
  kNone = 0,    // every row's keys lie in one split: the plain recurrence
  kMerge = 1,   // a CTA runs its rows over every split, keeping merged states in the workspace
  kPerSplit = 2,  // a CTA runs one split (grid y = kv head + heads_kv * split); partials of rows
                  // with several splits go to the workspace and the combine kernel merges them
};
constexpr int kBlocksPerSplit = static_cast<int>(kAttentionKvSplit / kAttentionKvBlock);

// ------------------------------------------------------------------------------------------------
// Kernel
// ------------------------------------------------------------------------------------------------

// Grid: x = row tiles (grid-stride up to the sequence's own q_len * G, heaviest tile first),
// y = kv head, z = sequences (grid-stride). x is the fastest launch order, so the tiles of one
// (sequence, kv head) run together and share its K/V in L2.
template <typename T, typename Cfg, bool SCALE_NONNEG, SplitMode MODE, bool EXACT>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_BLOCKS)
    attention_fwd_sm80_kernel(const AttentionProblem p, const AttentionFwdWorkspace w, int group,
                              float scale_log2) {
#ifdef RL_ALIGN_SM80_DEVICE
  constexpr int PITCH = Cfg::PITCH_BYTES, MT = Cfg::M_TILES, STAGES = Cfg::STAGES;
  constexpr int BLOCK_M = Cfg::BLOCK_M, CPR = Cfg::CHUNKS_PER_ROW;

  extern __shared__ __align__(16) uint8_t attn_smem[];
  const uint32_t q_smem = smem_u32(attn_smem);
  const uint32_t kv_ring = q_smem + Cfg::Q_BYTES;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  constexpr bool PER_SPLIT = MODE == SplitMode::kPerSplit;
  if (EXACT && *w.masked_nonfinite == 0) return;  // the fast kernel's results stand
  const int kv_head = static_cast<int>(PER_SPLIT ? blockIdx.y % p.heads_kv : blockIdx.y);
  const int split = static_cast<int>(PER_SPLIT ? blockIdx.y / p.heads_kv : 0);  // kPerSplit only
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  T* __restrict__ out = static_cast<T*>(p.out);

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
      // Blocks this CTA runs: all, or one split's.
      const int b_begin = split * kBlocksPerSplit;
      const int b_end = PER_SPLIT && b_begin + kBlocksPerSplit < num_blocks ? b_begin + kBlocksPerSplit : num_blocks;
      if (b_begin >= b_end) continue;  // no row of the tile reaches this split

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

      // Prologue: Q with block b_begin (group 0), then the next STAGES-2 blocks (one group each,
      // empty past the end, so that group b - b_begin always holds block b).
      load_q();
      load_kv(0, b_begin);
      cp_async_commit();
#pragma unroll
      for (int b = 1; b < STAGES - 1; ++b) {
        if (b_begin + b < b_end) load_kv(b, b_begin + b);
        cp_async_commit();
      }

      // This thread's rows: (m16 tile mt, half hh) is warp row 16 mt + 8 hh + g.
      const int warp_row0 = row0 + warp * Cfg::WARP_ROWS;
      const bool warp_active = warp_row0 < rows;
      const int warp_last_row =
          (warp_row0 + Cfg::WARP_ROWS < rows ? warp_row0 + Cfg::WARP_ROWS : rows) - 1;
      const int warp_first_pos = first_pos + warp_row0 / group;
      const int warp_last_pos = first_pos + warp_last_row / group;
      // Last key each row may see (rows past q_len, never stored: kv_len - 1).
      int row_last_key[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int pos = first_pos + (warp_row0 + 16 * mt + 8 * hh + g) / group;
          row_last_key[mt][hh] = p.causal && pos < kv_len ? pos : kv_len - 1;
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
      for (int b = b_begin; b < b_end; ++b) {
        ring_advance<STAGES>(b, b_begin, b_end, load_kv);
        if constexpr (Cfg::Q_IN_REGS) {
          if (b == b_begin) {
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
          if constexpr (MODE == SplitMode::kMerge) {
            if (b > 0 && b % kBlocksPerSplit == 0) {
              // Rows that reach this split finished the previous one: its partial folds into the
              // row's merged state in the workspace (the first one is stored as it is), and the
              // row starts the new split from a fresh state. Rows that end earlier keep theirs.
              const bool first = b == kBlocksPerSplit;
              const AttentionSeq ws_seq = attention_seq(p, s);
              bool reach[MT][2];
              int64_t ws_row[MT][2];
              float ws_m[MT][2], ws_l[MT][2];
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                  const int row = warp_row0 + 16 * mt + 8 * hh + g;
                  reach[mt][hh] = row < rows && row_last_key[mt][hh] >= key0;
                  ws_row[mt][hh] = ws_seq.lse_base + (kv_head * group + row % group) * p.lse_stride_head + row / group;
                  ws_m[mt][hh] = reach[mt][hh] && !first ? w.ml[2 * ws_row[mt][hh]] : 0.f;
                  ws_l[mt][hh] = reach[mt][hh] && !first ? w.ml[2 * ws_row[mt][hh] + 1] : 0.f;
                }
              }
              __syncwarp();  // the row's 4 lanes read its state before lane t = 0 rewrites it
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                  if (!reach[mt][hh]) continue;
                  float m = row_max[mt][hh], l = row_sum[mt][hh];
                  SplitMergeWeights wt{1.f, 1.f};
                  if (!first) {
                    m = ws_m[mt][hh];
                    l = ws_l[mt][hh];
                    wt = merge_split(m, l, row_max[mt][hh], row_sum[mt][hh]);
                  }
                  if (t == 0) {
                    w.ml[2 * ws_row[mt][hh]] = m;
                    w.ml[2 * ws_row[mt][hh] + 1] = l;
                  }
                  float* wa = w.acc + ws_row[mt][hh] * Cfg::HEAD_DIM + 2 * t;
                  // The earlier partial is read whole before any of it is rewritten: load by load
                  // (each waiting on the store before it), a fold cost D_TILES L2 round trips.
                  float2 prev[Cfg::D_TILES];
#pragma unroll
                  for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
                    prev[dn] = first ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(wa + dn * kMmaN);
                  }
#pragma unroll
                  for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
                    float2 cur = make_float2(acc[mt][dn][2 * hh], acc[mt][dn][2 * hh + 1]);
                    if (!first) cur = make_float2(merge_elem(prev[dn].x, cur.x, wt), merge_elem(prev[dn].y, cur.y, wt));
                    *reinterpret_cast<float2*>(wa + dn * kMmaN) = cur;
                    acc[mt][dn][2 * hh] = 0.f;
                    acc[mt][dn][2 * hh + 1] = 0.f;
                  }
                  row_max[mt][hh] = -INFINITY;
                  row_sum[mt][hh] = 0.f;
                }
              }
            }
          }
          // Online softmax per row. Masking is needed only where some key of the block is past
          // kv_len or past the warp's first position; elsewhere it would change nothing.
          const bool need_mask =
              key0 + kKvBlock > kv_len || (p.causal && key0 + kKvBlock - 1 > warp_first_pos);
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

          float row_alpha[MT][2];
          const bool rescale = softmax_block<SCALE_NONNEG>(score, row_max, row_sum, row_alpha, row_last_key,
                                                           key0 + 2 * t, need_mask, scale_log2);
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
          // A masked key's p is +0, but +0 * Inf or NaN is NaN: the fast kernel multiplies
          // anyway and reports a non-finite result in its epilogue; the launch then runs the
          // EXACT kernel, which takes the exact path in every block holding masked keys.
          if (!EXACT || !need_mask) {
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
          } else {
            // The exact path: for each k16 chunk, once per cut u (a row sees keys < u of the
            // chunk), the mma with the values of keys >= u replaced by +0; each row keeps the
            // result of its own cut (rows with cut 0 keep their acc). An mma element depends only
            // on its own A row, B column and accumulator, so a row gets exactly the bits of a run
            // without its masked keys (zero fill). B fragment rows (keys of the chunk): vb[0],
            // vb[2] hold 2t, 2t + 1; vb[1], vb[3] hold 2t + 8, 2t + 9 (low half first).
#pragma unroll
            for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) {
              int cut[MT][2];
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                  const int c = row_last_key[mt][hh] - (key0 + kc * kMmaK) + 1;
                  cut[mt][hh] = c < 0 ? 0 : c > kMmaK ? kMmaK : c;
                }
              }
#pragma unroll
              for (int dp = 0; dp < Cfg::D_TILES / 2; ++dp) {
                uint32_t vb[4];
                ldmatrix_x4<true>(vb, v_stage + kc * kMmaK * PITCH + dp * 2 * kMmaN * kElemBytes);
#pragma unroll 1
                for (int u = 1; u <= kMmaK; ++u) {
                  const bool k0 = 2 * t < u, k1 = 2 * t + 1 < u, k8 = 2 * t + 8 < u, k9 = 2 * t + 9 < u;
                  const uint32_t c0[2] = {keep_halves(vb[0], k0, k1), keep_halves(vb[1], k8, k9)};
                  const uint32_t c1[2] = {keep_halves(vb[2], k0, k1), keep_halves(vb[3], k8, k9)};
#pragma unroll
                  for (int mt = 0; mt < MT; ++mt) {
                    float d0[4], d1[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                      d0[e] = acc[mt][2 * dp][e];
                      d1[e] = acc[mt][2 * dp + 1][e];
                    }
                    Mma<T>::run(d0, pa[mt][kc], c0);
                    Mma<T>::run(d1, pa[mt][kc], c1);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                      if (cut[mt][e / 2] == u) {
                        acc[mt][2 * dp][e] = d0[e];
                        acc[mt][2 * dp + 1][e] = d1[e];
                      }
                    }
                  }
                }
              }
            }
          }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
      }
      cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

      // kMerge: the merged state of the earlier splits (rows that crossed a split boundary) is
      // staged into the idle K/V ring with one batch of copies, rather than a chain of dependent
      // global loads per row under the accumulators' register pressure.
      constexpr int STAGED_PITCH = Cfg::HEAD_DIM * 4 + 16;  // fp32 row + 16 bytes: fewer bank conflicts
      static_assert(BLOCK_M * STAGED_PITCH <= STAGES * Cfg::STAGE_BYTES, "staged state fits the ring");
      const bool crossed = MODE == SplitMode::kMerge &&
                           (p.causal ? cta_last_pos : kv_len - 1) >= static_cast<int>(kAttentionKvSplit);
      if (crossed) {
        __syncthreads();  // every warp is done with the ring; its own state writes are visible
        constexpr int CHUNKS = Cfg::HEAD_DIM * 4 / 16, ROWS_PER_SWEEP = Cfg::THREADS / CHUNKS;
        const AttentionSeq ws_seq = attention_seq(p, s);
        for (int r = tid / CHUNKS; r < BLOCK_M; r += ROWS_PER_SWEEP) {
          const int row = row0 + r;
          if (row >= rows) break;
          const int64_t lse_at = ws_seq.lse_base + (kv_head * group + row % group) * p.lse_stride_head + row / group;
          cp_async_16_zfill(kv_ring + r * STAGED_PITCH + (tid % CHUNKS) * 16, w.acc + lse_at * Cfg::HEAD_DIM + (tid % CHUNKS) * 4, 16);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      }
      const float* staged = reinterpret_cast<const float*>(attn_smem + Cfg::Q_BYTES);

      // Epilogue: rows i < q_len only (row < rows). out = acc * (1 / l) rounded once; lse by
      // lane t = 0.
      if (warp_active) {
        // Read again here: offsets held in registers through the key loop would cost spills.
        const AttentionSeq out_seq = attention_seq(p, s);
        bool nonfinite = false;  // a result (partial or final) holds Inf or NaN
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = warp_row0 + 16 * mt + 8 * hh + g;
            if (row >= rows) continue;
            const int64_t i = row / group, h = kv_head * group + row % group;
            const int64_t lse_at = out_seq.lse_base + h * p.lse_stride_head + i;
            const int last_key = row_last_key[mt][hh];
            float m = row_max[mt][hh], l = row_sum[mt][hh];
            if constexpr (PER_SPLIT) {
              // A row with several splits leaves this split's partial for the combine kernel.
              const int row_splits = last_key / static_cast<int>(kAttentionKvSplit) + 1;
              if (split >= row_splits) continue;
              if (row_splits > 1) {
                const int64_t slot = lse_at * w.slots + split;
                if (t == 0) *reinterpret_cast<float2*>(w.ml + 2 * slot) = make_float2(m, l);
                float* wa = w.acc + slot * Cfg::HEAD_DIM + 2 * t;
#pragma unroll
                for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
                  const float2 a = make_float2(acc[mt][dn][2 * hh], acc[mt][dn][2 * hh + 1]);
                  nonfinite |= either_nonfinite(a.x, a.y);
                  *reinterpret_cast<float2*>(wa + dn * kMmaN) = a;
                }
                continue;
              }
            }
            // kMerge: a row that crossed a split boundary merges its last partial into the state
            // of the earlier ones.
            const bool merged = MODE == SplitMode::kMerge && last_key >= static_cast<int>(kAttentionKvSplit);
            SplitMergeWeights wt{1.f, 1.f};
            const float* wa = staged + (row - row0) * (STAGED_PITCH / 4) + 2 * t;
            if (merged) {
              m = w.ml[2 * lse_at];
              l = w.ml[2 * lse_at + 1];
              wt = merge_split(m, l, row_max[mt][hh], row_sum[mt][hh]);
            }
            const float inv_l = reciprocal(l);
            T* out_row = out + out_seq.q_base + i * p.q_stride_token + h * p.q_stride_head + 2 * t;
#pragma unroll
            for (int dn = 0; dn < Cfg::D_TILES; ++dn) {
              float a0 = acc[mt][dn][2 * hh], a1 = acc[mt][dn][2 * hh + 1];
              if (merged) {
                const float2 prev = *reinterpret_cast<const float2*>(wa + dn * kMmaN);
                a0 = merge_elem(prev.x, a0, wt);
                a1 = merge_elem(prev.y, a1, wt);
              }
              nonfinite |= either_nonfinite(a0, a1);
              *reinterpret_cast<uint32_t*>(out_row + dn * kMmaN) =
                  pack_rounded<T>(__fmul_rn(a0, inv_l), __fmul_rn(a1, inv_l));
            }
            if (t == 0) p.lse[lse_at] = final_lse(m, l);
          }
        }
        // Also a legitimate Inf/NaN (one in a key the row sees) lands here: the exact kernel
        // then recomputes the same bits, slower.
        if (!EXACT && w.masked_nonfinite != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) {
          *w.masked_nonfinite = 1;
        }
      }
      __syncthreads();  // every warp is done with Q and the ring before the next tile's copies
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Decode kernel: one m16 tile of rows (up to 16 = queries x heads of a group: a decode step or a
// short chunk) and 4 warps that share each key block, so that a few rows still stream their K/V
// at full bandwidth. Per element it runs the instructions of attention_fwd_sm80_kernel in the
// same order, only spread over warps:
//   S = Q K^T   warp w computes key tiles 2w, 2w + 1 (keys 16w .. 16w + 15 of the block), each
//               element by the same chain of mma over d;
//   softmax     the block's scores go through shared memory and every warp runs softmax_block on
//               all of them (same inputs, same function: the same m, l and p bits in each warp);
//   acc += P V  warp w owns the output columns of d tiles [w D_TILES / 4, (w + 1) D_TILES / 4).
// So each row gets exactly the bits of the other configs. Grid: x = tile + tiles * split (the
// CTA runs one split's blocks, PER_SPLIT; otherwise every block, split 0 only), y = kv head,
// z = sequences (grid-stride).
template <int D>
struct DecodeConfig {
  static constexpr int WARPS = 4;
  static constexpr int THREADS = WARPS * kWarpSize;
  static constexpr int ROWS = kMmaM;
  static constexpr int STAGES = 3;  // two K/V blocks in flight while one is consumed
  static constexpr int D_STEPS = D / kMmaK;
  static constexpr int WARP_D_TILES = D / kMmaN / WARPS;          // output n8 tiles per warp
  static constexpr int KEY_TILES = kKvBlock / kMmaN;              // n8 key tiles of a block
  static constexpr int WARP_KEY_TILES = KEY_TILES / WARPS;        // computed by each warp
  static constexpr int KEY_STEPS = kKvBlock / kMmaK;
  static constexpr int PITCH_BYTES = (D + kPadElems) * kElemBytes;
  static constexpr int CHUNKS_PER_ROW = D / kChunkElems;
  static constexpr int Q_BYTES = ROWS * PITCH_BYTES;
  static constexpr int KV_TILE_BYTES = kKvBlock * PITCH_BYTES;
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;
  static constexpr int SCORE_BYTES = KEY_TILES * kWarpSize * 4 * 4;  // the block's score C fragments
  static constexpr int SMEM_BYTES = Q_BYTES + STAGES * STAGE_BYTES + SCORE_BYTES;
  static constexpr int KEYS_PER_COPY = THREADS / CHUNKS_PER_ROW;
  static constexpr int KV_COPIES = kKvBlock / KEYS_PER_COPY;
  static constexpr int Q_COPIES = ROWS * CHUNKS_PER_ROW / THREADS;
  static_assert(WARP_KEY_TILES == 2 && WARP_D_TILES % 2 == 0, "one key-tile pair, d-tile pairs per warp");
  static_assert(Q_COPIES >= 1 && ROWS * CHUNKS_PER_ROW % THREADS == 0, "Q copy sweeps");
  static_assert(PITCH_BYTES % 32 == 16, "odd pitch in 16-byte units: conflict-free ldmatrix");
};

template <typename T, int D, bool SCALE_NONNEG, bool PER_SPLIT>
__global__ void __launch_bounds__(DecodeConfig<D>::THREADS)
    attention_decode_sm80_kernel(const AttentionProblem p, const AttentionFwdWorkspace w, int group,
                                 float scale_log2) {
#ifdef RL_ALIGN_SM80_DEVICE
  using Cfg = DecodeConfig<D>;
  constexpr int PITCH = Cfg::PITCH_BYTES, STAGES = Cfg::STAGES, CPR = Cfg::CHUNKS_PER_ROW;
  extern __shared__ __align__(16) uint8_t attn_smem[];
  const uint32_t q_smem = smem_u32(attn_smem);
  const uint32_t kv_ring = q_smem + Cfg::Q_BYTES;
  float4* const score_smem = reinterpret_cast<float4*>(attn_smem + Cfg::Q_BYTES + STAGES * Cfg::STAGE_BYTES);

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int kv_head = static_cast<int>(blockIdx.y);
  const int max_tiles = static_cast<int>(ceil_div(p.max_q_len * group, Cfg::ROWS));
  const int tile = static_cast<int>(blockIdx.x) % max_tiles;
  const int split = static_cast<int>(blockIdx.x) / max_tiles;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  T* __restrict__ out = static_cast<T*>(p.out);
  const uint32_t q_lane = q_smem + a_lane_offset<PITCH>(lane, 0);
  const uint32_t k_lane = kv_ring + bn_lane_offset<PITCH>(lane) + warp * Cfg::WARP_KEY_TILES * kMmaN * PITCH;
  const uint32_t v_lane = kv_ring + Cfg::KV_TILE_BYTES + bk_lane_offset<PITCH>(lane) +
                          warp * Cfg::WARP_D_TILES * kMmaN * kElemBytes;
  const int copy_key = tid / CPR, copy_chunk = tid % CPR;

  for (int64_t s = blockIdx.z; s < p.num_seqs; s += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = static_cast<int>(sq.q_len);
    const int kv_len = static_cast<int>(sq.kv_len);
    const int rows = q_len * group;
    const int row0 = tile * Cfg::ROWS;
    if (row0 >= rows) continue;
    const int first_pos = kv_len - q_len;
    const int last_row = (row0 + Cfg::ROWS < rows ? row0 + Cfg::ROWS : rows) - 1;
    const int num_blocks = p.causal ? (first_pos + last_row / group) / kKvBlock + 1
                                    : static_cast<int>(ceil_div(kv_len, kKvBlock));
    const int b_begin = split * kBlocksPerSplit;
    const int b_end = PER_SPLIT && b_begin + kBlocksPerSplit < num_blocks ? b_begin + kBlocksPerSplit : num_blocks;
    if (b_begin >= b_end) continue;  // no row of the tile reaches this split
    const int64_t copy_off = sq.kv_base + static_cast<int64_t>(kv_head) * p.kv_stride_head +
                             static_cast<int64_t>(copy_key) * p.kv_stride_token + copy_chunk * kChunkElems;

#pragma unroll
    for (int c = 0; c < Cfg::Q_COPIES; ++c) {
      const int r = copy_key + c * Cfg::KEYS_PER_COPY, row = row0 + r;
      const T* src = q;
      if (row < rows) {
        src = q + sq.q_base + static_cast<int64_t>(row / group) * p.q_stride_token +
              static_cast<int64_t>(kv_head * group + row % group) * p.q_stride_head + copy_chunk * kChunkElems;
      }
      cp_async_16_zfill(q_smem + r * PITCH + copy_chunk * 16, src, row < rows ? 16 : 0);
    }
    auto load_kv = [&](int stage, int block) {
      copy_row_pair_async<T, Cfg::KV_COPIES, Cfg::KEYS_PER_COPY, PITCH>(
          kv_ring + stage * Cfg::STAGE_BYTES + copy_key * PITCH + copy_chunk * 16, Cfg::KV_TILE_BYTES, k, v,
          copy_off + static_cast<int64_t>(block) * kKvBlock * p.kv_stride_token, p.kv_stride_token,
          block * kKvBlock + copy_key, kv_len);
    };
    // Prologue: Q with block b_begin (group 0), then the next STAGES-2 blocks.
    load_kv(0, b_begin);
    cp_async_commit();
#pragma unroll
    for (int b = 1; b < STAGES - 1; ++b) {
      if (b_begin + b < b_end) load_kv(b, b_begin + b);
      cp_async_commit();
    }

    const int tile_first_pos = first_pos + row0 / group;
    int row_last_key[1][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int pos = first_pos + (row0 + 8 * hh + g) / group;
      row_last_key[0][hh] = p.causal && pos < kv_len ? pos : kv_len - 1;
    }
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
    float acc[Cfg::WARP_D_TILES][4];
#pragma unroll
    for (int dn = 0; dn < Cfg::WARP_D_TILES; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[dn][e] = 0.f;
    }
    uint32_t q_frag[Cfg::D_STEPS][4];

    int stage = 0;
    for (int b = b_begin; b < b_end; ++b) {
      // Block b is complete, and every warp is done with block b - 1 (its stage and the score
      // buffer may be overwritten).
      ring_advance<STAGES>(b, b_begin, b_end, load_kv);
      if (b == b_begin) {
#pragma unroll
        for (int ks = 0; ks < Cfg::D_STEPS; ++ks) ldmatrix_x4<false>(q_frag[ks], q_lane + ks * kMmaK * kElemBytes);
      }
      const int key0 = b * kKvBlock;
      const bool need_mask = key0 + kKvBlock > kv_len || (p.causal && key0 + kKvBlock - 1 > tile_first_pos);
      const uint32_t k_stage = k_lane + stage * Cfg::STAGE_BYTES;
      const uint32_t v_stage = v_lane + stage * Cfg::STAGE_BYTES;

      // This warp's two key tiles of S, then all eight from the score buffer.
      float mine[Cfg::WARP_KEY_TILES][4] = {};
#pragma unroll
      for (int ks = 0; ks < Cfg::D_STEPS; ++ks) {
        uint32_t kb[4];
        ldmatrix_x4<false>(kb, k_stage + ks * kMmaK * kElemBytes);
        const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
        Mma<T>::run(mine[0], q_frag[ks], b0);
        Mma<T>::run(mine[1], q_frag[ks], b1);
      }
#pragma unroll
      for (int j = 0; j < Cfg::WARP_KEY_TILES; ++j) {
        score_smem[(warp * Cfg::WARP_KEY_TILES + j) * kWarpSize + lane] = make_float4(mine[j][0], mine[j][1], mine[j][2], mine[j][3]);
      }
      __syncthreads();
      float score[1][Cfg::KEY_TILES][4];
#pragma unroll
      for (int nt = 0; nt < Cfg::KEY_TILES; ++nt) {
        const float4 x = score_smem[nt * kWarpSize + lane];
        score[0][nt][0] = x.x;
        score[0][nt][1] = x.y;
        score[0][nt][2] = x.z;
        score[0][nt][3] = x.w;
      }
      float row_alpha[1][2];
      const bool rescale = softmax_block<SCALE_NONNEG>(score, row_max, row_sum, row_alpha, row_last_key,
                                                       key0 + 2 * t, need_mask, scale_log2);
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int dn = 0; dn < Cfg::WARP_D_TILES; ++dn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[dn][e] = __fmul_rn(acc[dn][e], row_alpha[0][e / 2]);
        }
      }
      uint32_t pa[Cfg::KEY_STEPS][4];
#pragma unroll
      for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) c_to_a<T>(pa[kc], score[0][2 * kc], score[0][2 * kc + 1]);
      // acc += P V over the k16 key chunks in increasing order (masked keys: see the EXACT
      // kernel in the launch).
#pragma unroll
      for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) {
#pragma unroll
        for (int dp = 0; dp < Cfg::WARP_D_TILES / 2; ++dp) {
          uint32_t vb[4];
          ldmatrix_x4<true>(vb, v_stage + kc * kMmaK * PITCH + dp * 2 * kMmaN * kElemBytes);
          const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
          Mma<T>::run(acc[2 * dp], pa[kc], b0);
          Mma<T>::run(acc[2 * dp + 1], pa[kc], b1);
        }
      }
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    cp_async_wait<0>();

    // Epilogue: this warp's columns of each row; m, l and lse by warp 0.
    bool nonfinite = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row0 + 8 * hh + g;
      if (row >= rows) continue;
      const int64_t i = row / group, h = kv_head * group + row % group;
      const int64_t lse_at = sq.lse_base + h * p.lse_stride_head + i;
      const int last_key = row_last_key[0][hh];
      const float m = row_max[0][hh], l = row_sum[0][hh];
      const int col = warp * Cfg::WARP_D_TILES * kMmaN + 2 * t;
      if constexpr (PER_SPLIT) {
        const int row_splits = last_key / static_cast<int>(kAttentionKvSplit) + 1;
        if (split >= row_splits) continue;
        if (row_splits > 1) {  // a partial for the combine kernel
          const int64_t slot = lse_at * w.slots + split;
          if (warp == 0 && t == 0) *reinterpret_cast<float2*>(w.ml + 2 * slot) = make_float2(m, l);
#pragma unroll
          for (int dn = 0; dn < Cfg::WARP_D_TILES; ++dn) {
            const float2 a = make_float2(acc[dn][2 * hh], acc[dn][2 * hh + 1]);
            nonfinite |= either_nonfinite(a.x, a.y);
            *reinterpret_cast<float2*>(w.acc + slot * D + col + dn * kMmaN) = a;
          }
          continue;
        }
      }
      const float inv_l = reciprocal(l);
      T* out_row = out + sq.q_base + i * p.q_stride_token + h * p.q_stride_head + col;
#pragma unroll
      for (int dn = 0; dn < Cfg::WARP_D_TILES; ++dn) {
        const float a0 = acc[dn][2 * hh], a1 = acc[dn][2 * hh + 1];
        nonfinite |= either_nonfinite(a0, a1);
        *reinterpret_cast<uint32_t*>(out_row + dn * kMmaN) = pack_rounded<T>(__fmul_rn(a0, inv_l), __fmul_rn(a1, inv_l));
      }
      if (warp == 0 && t == 0) p.lse[lse_at] = final_lse(m, l);
    }
    if (w.masked_nonfinite != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) *w.masked_nonfinite = 1;
    __syncthreads();  // every warp is done with Q, the ring and the score buffer
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

// CTAs of an exact-kernel launch (about one per SM).
constexpr int64_t kExactCtas = 128;

template <typename T, typename Cfg, bool SCALE_NONNEG, SplitMode MODE, bool EXACT>
gpuError_t launch_kernel(const AttentionProblem& p, const AttentionFwdWorkspace& w, float scale_log2,
                         gpuStream_t stream) {
  auto kernel = attention_fwd_sm80_kernel<T, Cfg, SCALE_NONNEG, MODE, EXACT>;
  static std::atomic<uint64_t> raised{0};
  const gpuError_t err = allow_dynamic_smem(kernel, Cfg::SMEM_BYTES, raised);
  if (err != cudaSuccess) return err;
  const int64_t group = p.heads_q / p.heads_kv;  // G query heads per kv head
  const int64_t tiles = ceil_div(p.max_q_len * group, Cfg::BLOCK_M);
  const int64_t grid_y = MODE == SplitMode::kPerSplit ? p.heads_kv * attention_split_count(p) : p.heads_kv;
  // The exact kernel mostly finds nothing to do: a small grid (grid-stride over tiles and
  // sequences) keeps its launch to a few microseconds.
  const int64_t max_x = EXACT ? 1 : INT32_MAX, max_z = EXACT ? ceil_div(kExactCtas, grid_y) : 65535;
  const dim3 grid(static_cast<unsigned>(tiles < max_x ? tiles : max_x), static_cast<unsigned>(grid_y),
                  static_cast<unsigned>(p.num_seqs < max_z ? p.num_seqs : max_z));
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(p, w, static_cast<int>(group), scale_log2);
  return cudaGetLastError();
}

template <typename T, typename Cfg, SplitMode MODE, bool EXACT>
gpuError_t launch_sign(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  const float scale_log2 = scale_log2e(p);
  if (scale_log2 < 0.f) return launch_kernel<T, Cfg, false, MODE, EXACT>(p, w, scale_log2, stream);
  return launch_kernel<T, Cfg, true, MODE, EXACT>(p, w, scale_log2, stream);
}

// The fast kernel, then (where some keys are masked inside the sequence: more than one query) the
// exact one, which recomputes everything only if the fast one met a non-finite masked value.
template <typename T, typename Cfg, SplitMode MODE>
gpuError_t launch_fwd(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  const gpuError_t err = launch_sign<T, Cfg, MODE, false>(p, w, stream);
  if (err != cudaSuccess || w.masked_nonfinite == nullptr) return err;
  return launch_sign<T, Cfg, MODE, true>(p, w, stream);
}

template <typename T, int D, bool PER_SPLIT>
gpuError_t launch_decode(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  using Cfg = DecodeConfig<D>;
  const float scale_log2 = scale_log2e(p);
  auto kernel = scale_log2 < 0.f ? attention_decode_sm80_kernel<T, D, false, PER_SPLIT>
                                 : attention_decode_sm80_kernel<T, D, true, PER_SPLIT>;
  static std::atomic<uint64_t> raised{0};
  const gpuError_t err = allow_dynamic_smem(kernel, Cfg::SMEM_BYTES, raised);
  if (err != cudaSuccess) return err;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t x = ceil_div(p.max_q_len * group, Cfg::ROWS) * (PER_SPLIT ? attention_split_count(p) : 1);
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(p.heads_kv),
                  static_cast<unsigned>(p.num_seqs < 65535 ? p.num_seqs : 65535));
  kernel<<<grid, Cfg::THREADS, Cfg::SMEM_BYTES, stream>>>(p, w, static_cast<int>(group), scale_log2);
  return cudaGetLastError();
}

// Few rows (decode, short chunks): the decode kernel, whose results the exact kernel (a
// SmallTileConfig one: same bits) replaces where needed (split partials then merge:
// attention_fwd_sm80).
template <typename T, int D, SplitMode MODE>
gpuError_t launch_few_rows(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  const gpuError_t err = launch_decode<T, D, MODE == SplitMode::kPerSplit>(p, w, stream);
  if (err != cudaSuccess || w.masked_nonfinite == nullptr) return err;
  return launch_sign<T, SmallTileConfig<D>, MODE, true>(p, w, stream);
}

template <typename T, int D>
gpuError_t dispatch_config(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  // w.slots: attention_fwd_split_slots (per-split slots only for few rows).
  if (w.slots > 1) return launch_few_rows<T, D, SplitMode::kPerSplit>(p, w, stream);
  const bool few_rows = p.max_q_len * (p.heads_q / p.heads_kv) <= kDecodeMaxRows;
  if (w.slots == 1) {
    if (few_rows) return launch_fwd<T, SmallTileConfig<D>, SplitMode::kMerge>(p, w, stream);
    return launch_fwd<T, PrefillConfig<D>, SplitMode::kMerge>(p, w, stream);
  }
  if (few_rows) return launch_few_rows<T, D, SplitMode::kNone>(p, w, stream);
  return launch_fwd<T, PrefillConfig<D>, SplitMode::kNone>(p, w, stream);
}

template <typename T>
gpuError_t dispatch_head_dim(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  if (p.head_dim == 64) return dispatch_config<T, 64>(p, w, stream);
  return dispatch_config<T, 128>(p, w, stream);
}

}  // namespace

// Problem requirements: tensor_core_attention_problem_error and tensor_core_workspace_ok
// (tensor_core.h).
gpuError_t attention_fwd_sm80(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                              gpuStream_t stream) {
  gpuError_t err = tensor_core_attention_problem_error(dtype, p, p.heads_kv);  // grid y: kv heads
  if (err != cudaSuccess || p.num_seqs == 0 || p.max_q_len == 0) return err;
  if (!tensor_core_workspace_ok(p, w)) return cudaErrorInvalidValue;
  err = dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype, [&](auto tag) { return dispatch_head_dim<decltype(tag)>(p, w, stream); }, gpu_not_supported);
  if (err != cudaSuccess || w.slots <= 1) return err;
  return attention_split_combine(dtype, p, w, stream);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t attention_fwd_sm80(DType, const AttentionProblem&, const AttentionFwdWorkspace&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
