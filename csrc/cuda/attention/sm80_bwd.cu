// Ampere-class (sm_80+) tensor-core attention backward: mma.sync m16n8k16 (fp32 accumulators),
// ldmatrix fragments, cp.async rings. Runs on every CUDA GPU of compute capability >= 8.0 (the
// H100 too); bf16 and fp16, head_dim 64 and 128. The arithmetic is the backward contract of
// csrc/common/attention_problem.h; three kernels, launched in this order on one stream:
//
//   delta   delta_i = dot(dO_i, O_i) per (query, head): D / 8 lanes per row, each an fma chain
//           over its 8 consecutive elements of d (increasing), then a butterfly over the lanes
//           (lane distances 1, 2, 4, ...: a fixed tree, and every lane ends with the same bits);
//           bwd_delta.cu, shared with the sm90 backward.
//   dK/dV   CTA = (sequence, kv head g, tile of BLOCK_N keys); warp w owns keys 16 w .. 16 w + 15
//           of the tile and accumulates their dK and dV rows in registers. Outer loop: the group's
//           query heads h = g G .. g G + G - 1, increasing; inner loop: blocks of BLOCK_M queries
//           from the first that can see the tile (causal) to the last, increasing, each taken
//           as sub-blocks of SUB_M queries. Per sub-block:
//             S^T  = K Q^T                        (keys x queries, the warp's 16 keys)
//             P^T  = ex2(S^T scale log2(e) - lse log2(e))     masked -> +0 (selected)
//             dV  += P^T dO                       (P rounded to the input dtype, mma A operand)
//             dP^T = V dO^T
//             dS^T = P^T (dP^T - delta)               masked -> +0 (selected)
//             dK  += dS^T Q                       (dS rounded to the input dtype)
//           and at the end dK *= scale; dK, dV rounded once to the input dtype.
//   dQ      CTA = (sequence, query head h, tile of BLOCK_M queries); warp w owns queries
//           16 w .. 16 w + 15. Key blocks of 64 keys 0, 1, 2, ... up to the tile's causal limit:
//           S = Q K^T, P, dP = dO V^T, dS as above, dQ += dS K; at the end dQ *= scale, rounded
//           once.
// Working from the keys' side (dK/dV) and from the queries' side (dQ) recomputes S, P, dP and dS
// twice, where FlashAttention-2 computes them once and accumulates dQ with atomicAdd: atomics
// would make dQ's summation order depend on scheduling, which the contract forbids.
//
// Orders. Every gradient element is one fp32 accumulator register of one thread, for the whole
// reduction: mma.sync adds a k16 chunk (16 queries for dK/dV, 16 keys for dQ) to it, chunks in
// increasing order; dot products over d (S, dP) take the k16 chunks of d in increasing order from
// a zero accumulator. P = ex2(fma(s, scale log2(e), -(lse log2(e)))) with ex2.approx.ftz; every
// fp32 operation has an explicit rounding intrinsic, so the compiler cannot contract it
// differently in different instantiations.
//
// Invariance. Query blocks (dK/dV) start at multiples of BLOCK_M and key tiles at multiples of
// BLOCK_N in the sequence's own positions, key blocks (dQ) at multiples of 64: constants of the
// kernels. An mma result for element (row, col) depends only on that row of A, that column of B
// and its own accumulator, so the thread computing a gradient row, and everything else in the
// batch, never changes its bits. Rows and keys past the sequence's q_len / kv_len are cp.async
// zero fill (nothing is read from memory there) and masked; they are never written. Blocks that
// hold no allowed (query, key) pair for a whole warp are skipped; one that holds some adds
// P = 0 (selected, not computed) for the masked pairs, i.e. products +-0, which leave an fp32
// accumulator's bits unchanged (x + 0 = x; +0 + -0 = +0; accumulators start at +0).
//
// Non-finite masked inputs. A masked pair's k_j, v_j (dQ) or q_i, dO_i, lse_i, delta_i (dK/dV)
// may hold Inf/NaN that the row must not see. S, P, dP, dS of the pair may then be Inf/NaN, so
// P and dS are selected to +0 (dS = P (dP - delta) would be 0 * NaN). In dQ += dS K,
// dV += P^T dO, dK += dS^T Q a masked A entry (+0) still meets the partner's B row (k_j, dO_i,
// q_i), and 0 * Inf = NaN. Off the causal diagonal the only masked partners lie past q_len /
// kv_len, zero fill, so only diagonal blocks (DIAG below) need more: there the B chunks holding a
// masked pair are tested for Inf/NaN (masked_b_nonfinite: one ldmatrix pass, one vote), and where
// one is found the product runs as gemm_acc_k_rows_masked, which zeroes B outside each row's
// allowed k. Each row then gets the same mma sequence with the same allowed products; only its
// masked products change, from +0 * finite (+-0) to +0 * +0. That keeps the bits if the tensor
// core's sum ignores exact-zero products (the premise of the paragraph above too: a masked
// partner's finite values must not change the row either); the sign of zero cannot matter, as a
// sum holding a +0 (accumulators start at +0 and are never -0) is +0 when exact zero.
#include "../attention_kernels.h"
#include "sm80_common.h"
#include "../../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

#include <atomic>
#include <type_traits>

namespace rl_align {
namespace {

// ------------------------------------------------------------------------------------------------
// Tile configurations (the partition: chosen from head_dim only)
// ------------------------------------------------------------------------------------------------

constexpr int kKeyBlock = 64;  // keys per dQ pipeline stage
constexpr float kLog2e = 1.4426950408889634f;

template <int HEAD_DIM>
constexpr int pitch_bytes() {
  return (HEAD_DIM + kPadElems) * kElemBytes;
}

// dK/dV: WARPS warps of 16 keys (BLOCK_N = 16 WARPS keys per CTA, K and V resident in shared
// memory), BLOCK_M queries per step, STAGES query blocks (Q, dO, lse, delta) in the cp.async ring.
template <int HEAD_DIM_, int WARPS_, int BLOCK_M_, int SUB_M_, int STAGES_>
struct DkvConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int WARPS = WARPS_;
  static constexpr int BLOCK_M = BLOCK_M_;
  // A block's queries are processed SUB_M at a time (S^T .. dK for the first SUB_M queries, then
  // the next): the k16 query chunks still reach dV and dK in increasing order, so the arithmetic is
  // that of one BLOCK_M step, with fewer S^T / dP^T registers live and one barrier per block.
  static constexpr int SUB_M = SUB_M_;
  static constexpr int STAGES = STAGES_;
  static constexpr int THREADS = WARPS * kWarpSize;
  static constexpr int BLOCK_N = WARPS * kMmaM;
  static constexpr int D_STEPS = HEAD_DIM / kMmaK;  // k16 chunks of a dot product over d
  static constexpr int D_TILES = HEAD_DIM / kMmaN;  // n8 tiles of a gradient row
  static constexpr int SUBS = BLOCK_M / SUB_M;
  static constexpr int Q_TILES = SUB_M / kMmaN;     // n8 tiles of a sub-block's S^T (queries)
  static constexpr int Q_STEPS = SUB_M / kMmaK;     // k16 query chunks of P^T dO, dS^T Q
  static constexpr int PITCH_BYTES = pitch_bytes<HEAD_DIM>();
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / kChunkElems;
  static constexpr int ROWS_PER_COPY = THREADS / CHUNKS_PER_ROW;
  static constexpr int KV_TILE_BYTES = BLOCK_N * PITCH_BYTES;
  static constexpr int Q_TILE_BYTES = BLOCK_M * PITCH_BYTES;
  // A stage: Q tile, dO tile, lse[BLOCK_M], delta[BLOCK_M] (fp32).
  static constexpr int STAGE_BYTES = 2 * Q_TILE_BYTES + 2 * BLOCK_M * 4;
  static constexpr int SMEM_BYTES = 2 * KV_TILE_BYTES + STAGES * STAGE_BYTES;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim");
  static_assert(PITCH_BYTES % 32 == 16, "odd pitch in 16-byte units: conflict-free ldmatrix");
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && BLOCK_N % ROWS_PER_COPY == 0 &&
                    BLOCK_M % ROWS_PER_COPY == 0,
                "copy sweeps");
  static_assert(BLOCK_M % SUB_M == 0 && SUB_M % kMmaK == 0 && 2 * BLOCK_M <= THREADS,
                "query block: sub-blocks of k16 chunks, lse copy");
  static_assert(STAGES >= 2, "pipeline");
};

// dQ: WARPS warps of 16 queries (BLOCK_M = 16 WARPS queries per CTA, Q and dO resident in shared
// memory), 64-key K/V blocks in a STAGES-deep cp.async ring.
template <int HEAD_DIM_, int WARPS_, int STAGES_>
struct DqConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int WARPS = WARPS_;
  static constexpr int STAGES = STAGES_;
  static constexpr int THREADS = WARPS * kWarpSize;
  static constexpr int BLOCK_M = WARPS * kMmaM;
  static constexpr int D_STEPS = HEAD_DIM / kMmaK;
  static constexpr int D_TILES = HEAD_DIM / kMmaN;
  static constexpr int KEY_TILES = kKeyBlock / kMmaN;  // n8 tiles of S (keys)
  static constexpr int KEY_STEPS = kKeyBlock / kMmaK;  // k16 key chunks of dS K
  static constexpr int PITCH_BYTES = pitch_bytes<HEAD_DIM>();
  static constexpr int CHUNKS_PER_ROW = HEAD_DIM / kChunkElems;
  static constexpr int ROWS_PER_COPY = THREADS / CHUNKS_PER_ROW;
  static constexpr int Q_TILE_BYTES = BLOCK_M * PITCH_BYTES;
  static constexpr int KV_TILE_BYTES = kKeyBlock * PITCH_BYTES;
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;  // K, V
  static constexpr int SMEM_BYTES = 2 * Q_TILE_BYTES + STAGES * STAGE_BYTES;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim");
  static_assert(PITCH_BYTES % 32 == 16, "odd pitch in 16-byte units: conflict-free ldmatrix");
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && kKeyBlock % ROWS_PER_COPY == 0 &&
                    BLOCK_M % ROWS_PER_COPY == 0,
                "copy sweeps");
  static_assert(STAGES >= 2, "pipeline");
};

// 8 warps per CTA for both: 128 keys (dK/dV) or 128 queries (dQ) share every Q/dO (K/V) block
// loaded, which halves the L2 traffic of 64-row tiles. The kernels are register-bound: at
// head_dim 128, 128 fp32 dK + dV accumulators plus the S^T, dP^T fragments (dK/dV), or 64 dQ
// accumulators plus S, dP and the hoisted Q, dO fragments (dQ), take 215-250 registers; so one
// 8-warp CTA per SM (__launch_bounds__(THREADS, 1)), 137 KB of shared memory each, two ring
// stages (the next block loads during a whole block of compute). Measured on the H100: 32-query
// sub-blocks are the largest without spills on sm_80 (64 spills there); a third stage, 4-warp dQ
// CTAs and 128-query dK/dV stages gain nothing.
template <int D>
using DkvCfg = DkvConfig<D, 8, 64, 32, 2>;
template <int D>
using DqCfg = DqConfig<D, 8, 2>;

#ifdef RL_ALIGN_SM80_DEVICE

// 4-byte global->shared copy (lse, delta rows are 4-byte aligned only) reading `src_bytes` (0 or
// 4) bytes, zero fill otherwise.
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}




// C (MMA_M x NT*8, fp32, zeroed first) = A B over D_STEPS k16 chunks of d, in increasing order: A
// = the warp's 16 rows of a [row][d] tile, B^T = NT * 8 rows of a [row][d] tile (bn pattern).
template <typename T, int D_STEPS, int NT, int PITCH_BYTES>
__device__ __forceinline__ void gemm_rows_d(float (&c)[NT][4], uint32_t a_lane, uint32_t b_lane) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) c[nt][e] = 0.f;
  }
#pragma unroll
  for (int ks = 0; ks < D_STEPS; ++ks) {
    uint32_t a[4];
    ldmatrix_x4<false>(a, a_lane + ks * kMmaK * kElemBytes);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4<false>(b, b_lane + np * 2 * kMmaN * PITCH_BYTES + ks * kMmaK * kElemBytes);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      Mma<T>::run(c[2 * np], a, b0);
      Mma<T>::run(c[2 * np + 1], a, b1);
    }
  }
}

// acc (16 x D_TILES*8) += A B: A = K_STEPS k16 chunks held in registers (increasing order), B =
// K_STEPS * 16 rows of a [k][d] tile (bk pattern).
template <typename T, int K_STEPS, int D_TILES, int PITCH_BYTES>
__device__ __forceinline__ void gemm_acc_k(float (&acc)[D_TILES][4], const uint32_t (&a)[K_STEPS][4],
                                           uint32_t b_lane) {
#pragma unroll
  for (int kc = 0; kc < K_STEPS; ++kc) {
#pragma unroll
    for (int dp = 0; dp < D_TILES / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, b_lane + kc * kMmaK * PITCH_BYTES + dp * 2 * kMmaN * kElemBytes);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      Mma<T>::run(acc[2 * dp], a[kc], b0);
      Mma<T>::run(acc[2 * dp + 1], a[kc], b1);
    }
  }
}

// Bits 15 / 31 of the result set iff that 16-bit half of x is Inf or NaN (exponent all ones:
// bf16 0x7F80, fp16 0x7C00): ~x & E is then 0 in that half and subtracting 1 borrows into its top
// bit. A finite half leaves a nonzero multiple of 0x80 (bf16) / 0x400 (fp16) below 0x8000 there,
// which stays below 0x8000 after subtracting 1 (or 2, with the borrow of a non-finite low half).
template <typename T>
__device__ __forceinline__ uint32_t nonfinite_bits(const uint32_t (&b)[4]) {
  constexpr uint32_t kExp = std::is_same<T, half_t>::value ? 0x7C007C00u : 0x7F807F80u;
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) bits |= (~b[i] & kExp) - 0x00010001u;
  return bits & 0x80008000u;
}

// Rows of one mma with different masks inside a k16 chunk (the causal diagonal). Row r (0 .. 15)
// of the warp may see, of k = 0 .. 16 K_STEPS - 1, those below edge = base + r (KEEP_LOW: dQ, k =
// keys up to the row's last key) or from edge = base + r on (!KEEP_LOW: dK/dV, k = queries from the
// key's position on). Chunk kc's count of allowed positions for the row (0 .. 16):
template <bool KEEP_LOW>
__device__ __forceinline__ int allowed_in_chunk(int edge, int kc) {
  const int n = KEEP_LOW ? edge - kc * kMmaK : (kc + 1) * kMmaK - edge;
  return n < 0 ? 0 : (n > kMmaK ? kMmaK : n);
}

// acc += A B as gemm_acc_k, each row summing its allowed k positions only, whatever B holds at
// the others. Per chunk (increasing) and per count n = 0 .. 16 that some row of the warp has
// there: B is zeroed outside that count's positions, the mma runs from the current accumulators
// and only the rows with count n keep its result. So every row passes through exactly one mma per
// chunk, as in gemm_acc_k (count 0 too: whatever the mma does to an accumulator with no nonzero
// product, e.g. an fp32 subnormal, it does on both paths), with the same allowed products; its
// masked A entries (+0, selected) meet +0 here where they met finite B (+-0 products) there.
// B fragment (bk pattern): b[0], b[2] hold k = 2t (low half), 2t + 1 of the chunk; b[1], b[3]
// k = 2t + 8, 2t + 9. Loops not unrolled but over the n8 tiles (runtime indices of a, acc would
// put them in local memory): the slow path, taken only where masked_b_nonfinite says so.
template <typename T, int K_STEPS, int D_TILES, int PITCH_BYTES, bool KEEP_LOW>
__device__ __forceinline__ void gemm_acc_k_rows_masked(float (&acc)[D_TILES][4], const uint32_t (&a)[K_STEPS][4],
                                                       uint32_t b_lane, int base, int g, int t) {
#pragma unroll 1
  for (int kc = 0; kc < K_STEPS; ++kc) {
    // a[kc], selected (indexing a at a runtime kc would put it in local memory).
    uint32_t ak[4] = {a[0][0], a[0][1], a[0][2], a[0][3]};
#pragma unroll
    for (int c = 1; c < K_STEPS; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) ak[r] = c == kc ? a[c][r] : ak[r];
    }
    const int allowed0 = allowed_in_chunk<KEEP_LOW>(base + g, kc);      // row g
    const int allowed1 = allowed_in_chunk<KEEP_LOW>(base + g + 8, kc);  // row g + 8
#pragma unroll 1
    for (int n = 0; n <= kMmaK; ++n) {
      const bool take0 = allowed0 == n, take1 = allowed1 == n;
      if (!__any_sync(0xffffffffu, take0 || take1)) continue;  // warp-uniform
      const int begin = KEEP_LOW ? 0 : kMmaK - n;  // the count's k positions: begin .. begin + n - 1
      auto keep = [&](int k) -> uint32_t {
        return static_cast<unsigned>(k - begin) < static_cast<unsigned>(n) ? 0xFFFFu : 0u;
      };
      const uint32_t m_lo = keep(2 * t) | keep(2 * t + 1) << 16;
      const uint32_t m_hi = keep(2 * t + 8) | keep(2 * t + 9) << 16;
#pragma unroll
      for (int dp = 0; dp < D_TILES / 2; ++dp) {
        uint32_t b[4];
        __syncwarp();  // keeps ptxas from hoisting all the loads of the pass (spills at head_dim 128)
        ldmatrix_x4<true>(b, b_lane + kc * kMmaK * PITCH_BYTES + dp * 2 * kMmaN * kElemBytes);
        // n8 tiles 2 dp (b[0], b[1]) and 2 dp + 1 (b[2], b[3]), one at a time.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float (&c)[4] = acc[2 * dp + h];
          const uint32_t bm[2] = {b[2 * h] & m_lo, b[2 * h + 1] & m_hi};
          float d[4] = {c[0], c[1], c[2], c[3]};
          Mma<T>::run(d, ak, bm);
          // Selects, not branches: every lane runs every mma.
          c[0] = take0 ? d[0] : c[0];
          c[1] = take0 ? d[1] : c[1];
          c[2] = take1 ? d[2] : c[2];
          c[3] = take1 ? d[3] : c[3];
        }
      }
    }
  }
}

// Whether a chunk of the gemm_acc_k B operand (K_STEPS chunks of 16 k rows from b_lane) that holds
// a masked (row, k) pair has an Inf or NaN anywhere in its fragments (warp-uniform: one ldmatrix
// pass over those chunks, one vote). base as above, warp-uniform: chunk kc holds a masked pair iff
// the warp's most masked row (row 0 for KEEP_LOW, else row 15) is masked there. Where none is
// found the plain gemm_acc_k adds only +-0 products for masked pairs; where one is,
// gemm_acc_k_rows_masked keeps the B entries of masked pairs out of every row's mma.
template <typename T, int K_STEPS, int D_TILES, int PITCH_BYTES, bool KEEP_LOW>
__device__ __forceinline__ bool masked_b_nonfinite(uint32_t b_lane, int base) {
  const int warp_edge = KEEP_LOW ? base : base + kMmaM - 1;
  uint32_t bits = 0;
#pragma unroll 1
  for (int kc = 0; kc < K_STEPS; ++kc) {
    const bool masked = KEEP_LOW ? warp_edge < (kc + 1) * kMmaK : warp_edge > kc * kMmaK;
    if (!masked) continue;  // warp-uniform
#pragma unroll
    for (int dp = 0; dp < D_TILES / 2; ++dp) {
      uint32_t b[4];
      ldmatrix_x4<true>(b, b_lane + kc * kMmaK * PITCH_BYTES + dp * 2 * kMmaN * kElemBytes);
      bits |= nonfinite_bits<T>(b);
    }
  }
  return __any_sync(0xffffffffu, bits != 0);
}

#endif  // RL_ALIGN_SM80_DEVICE

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

// Grid: x = kv head, y = sequences (grid-stride), z = key tiles (grid-stride up to kv_len). z is
// the slowest launch order: the tiles 0 of every (sequence, kv head), which see the most queries
// when causal, start first and the lightest tiles fill the last wave (longest job first), instead
// of a late heavy tile setting the kernel's tail.
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    attention_bwd_dkdv_sm80_kernel(const AttentionGradProblem gp, int group, float scale_log2) {
#ifdef RL_ALIGN_SM80_DEVICE
  constexpr int PITCH = Cfg::PITCH_BYTES, STAGES = Cfg::STAGES, BLOCK_M = Cfg::BLOCK_M;
  constexpr int SUB_M = Cfg::SUB_M;
  constexpr int QT = Cfg::Q_TILES, QS = Cfg::Q_STEPS, DT = Cfg::D_TILES, RPC = Cfg::ROWS_PER_COPY;
  const AttentionProblem& p = gp.fwd;

  extern __shared__ __align__(16) uint8_t dkdv_smem[];
  const uint32_t k_smem = smem_u32(dkdv_smem);
  const uint32_t v_smem = k_smem + Cfg::KV_TILE_BYTES;
  const uint32_t ring = v_smem + Cfg::KV_TILE_BYTES;
  const uint8_t* ring_ptr = dkdv_smem + 2 * Cfg::KV_TILE_BYTES;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int kv_head = static_cast<int>(blockIdx.x);
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  const T* __restrict__ dout = static_cast<const T*>(gp.dout);
  T* __restrict__ dk = static_cast<T*>(gp.dk);
  T* __restrict__ dv = static_cast<T*>(gp.dv);

  // K, V: A operands of the warp's 16 keys; Q, dO: B operands, rows = queries (bn pattern, for
  // S^T and dP^T) and rows = k (bk pattern, for dV and dK).
  const uint32_t k_lane = k_smem + a_lane_offset<PITCH>(lane, warp * kMmaM);
  const uint32_t v_lane = v_smem + a_lane_offset<PITCH>(lane, warp * kMmaM);
  const uint32_t q_bn_lane = ring + bn_lane_offset<PITCH>(lane);
  const uint32_t q_bk_lane = ring + bk_lane_offset<PITCH>(lane);
  // This thread's copy slot: rows copy_row + RPC c, 16-byte chunk copy_chunk.
  const int copy_row = tid / Cfg::CHUNKS_PER_ROW, copy_chunk = tid % Cfg::CHUNKS_PER_ROW;

  for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = static_cast<int>(sq.q_len);
    const int kv_len = static_cast<int>(sq.kv_len);
    if (q_len <= 0) continue;
    const int first_pos = kv_len - q_len;  // position of query 0 (0 in training: q_len = kv_len)
    const int key_tiles = (kv_len + Cfg::BLOCK_N - 1) / Cfg::BLOCK_N;
    const int64_t kv_off = sq.kv_base + static_cast<int64_t>(kv_head) * p.kv_stride_head;

    for (int tile = static_cast<int>(blockIdx.z); tile < key_tiles; tile += static_cast<int>(gridDim.z)) {
      const int key0 = tile * Cfg::BLOCK_N;
      // First query block holding a query at or after the tile's first key (every block when not
      // causal); key0 < kv_len, so it is a block of the sequence.
      const int first_qb = p.causal && key0 > first_pos ? (key0 - first_pos) / BLOCK_M : 0;
      const int q_blocks = (q_len + BLOCK_M - 1) / BLOCK_M - first_qb;
      const int iters = group * q_blocks;  // (head, query block) pairs, head-major

      auto load_kv = [&]() {
        copy_row_pair_async<T, Cfg::BLOCK_N / RPC, RPC, PITCH>(
            k_smem + copy_row * PITCH + copy_chunk * 16, Cfg::KV_TILE_BYTES, k, v,
            kv_off + static_cast<int64_t>(key0 + copy_row) * p.kv_stride_token + copy_chunk * kChunkElems,
            p.kv_stride_token, key0 + copy_row, kv_len);
      };
      // Iteration it: head g G + it / q_blocks, query block first_qb + it % q_blocks.
      auto load_q_block = [&](int stage, int it) {
        const int head = kv_head * group + it / q_blocks;
        const int qstart = (first_qb + it % q_blocks) * BLOCK_M;
        const uint32_t stage_base = ring + stage * Cfg::STAGE_BYTES;
        copy_row_pair_async<T, BLOCK_M / RPC, RPC, PITCH>(
            stage_base + copy_row * PITCH + copy_chunk * 16, Cfg::Q_TILE_BYTES, q, dout,
            sq.q_base + static_cast<int64_t>(head) * p.q_stride_head +
                static_cast<int64_t>(qstart + copy_row) * p.q_stride_token + copy_chunk * kChunkElems,
            p.q_stride_token, qstart + copy_row, q_len);
        // lse (threads 0 .. BLOCK_M-1) and delta (BLOCK_M .. 2 BLOCK_M-1) of the block's queries.
        if (tid < 2 * BLOCK_M) {
          const int i = qstart + tid % BLOCK_M;
          const float* src = tid < BLOCK_M ? p.lse : gp.delta;
          const bool in_range = i < q_len;
          cp_async_4_zfill(stage_base + 2 * Cfg::Q_TILE_BYTES + tid * 4,
                           in_range ? src + sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head + i : src,
                           in_range ? 4 : 0);
        }
      };

      // Prologue: K, V with query block 0 (group 0), then blocks 1 .. STAGES-2 (one group each,
      // empty past the end, so that group it always holds iteration it).
      load_kv();
      load_q_block(0, 0);
      cp_async_commit();
#pragma unroll
      for (int it = 1; it < STAGES - 1; ++it) {
        if (it < iters) load_q_block(it, it);
        cp_async_commit();
      }

      // This thread's keys: warp_key0 + g + 8 hh (rows hh = 0, 1 of the C fragments).
      const int warp_key0 = key0 + warp * kMmaM;
      const bool warp_has_keys = warp_key0 < kv_len;
      float dk_acc[DT][4], dv_acc[DT][4];
#pragma unroll
      for (int dn = 0; dn < DT; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[dn][e] = dv_acc[dn][e] = 0.f;
      }

      int stage = 0;
      for (int it = 0; it < iters; ++it) {
        ring_advance<STAGES>(it, 0, iters, load_q_block);
        const uint32_t stage_off = stage * Cfg::STAGE_BYTES;
        const float* lse_s = reinterpret_cast<const float*>(ring_ptr + stage_off + 2 * Cfg::Q_TILE_BYTES);
        const float* delta_s = lse_s + BLOCK_M;
#pragma unroll 1
        for (int sb = 0; sb < Cfg::SUBS; ++sb) {
          const int qstart = (first_qb + it % q_blocks) * BLOCK_M + sb * SUB_M;
          // A warp whose keys all come after the sub-block's last query (causal), or lie past
          // kv_len (never stored), would only add exact zeros / unused values: skip it.
          if (!warp_has_keys || (p.causal && warp_key0 > first_pos + qstart + SUB_M - 1)) continue;
          const uint32_t q_off = stage_off + sb * SUB_M * PITCH;  // the sub-block's Q rows
          const uint32_t do_off = q_off + Cfg::Q_TILE_BYTES;
          const float* lse_sub = lse_s + sb * SUB_M;
          const float* delta_sub = delta_s + sb * SUB_M;

          // S^T = K Q^T (keys x queries).
          float pt[QT][4];
          gemm_rows_d<T, Cfg::D_STEPS, QT, PITCH>(pt, k_lane, q_bn_lane + q_off);
          // P^T = 2^(s scale log2(e) - lse log2(e)); element (nt, e): key row hh = e / 2, query
          // qstart + 8 nt + 2 t + e % 2.
#pragma unroll
          for (int nt = 0; nt < QT; ++nt) {
            const float2 lse2 = *reinterpret_cast<const float2*>(lse_sub + nt * kMmaN + 2 * t);
            const float l0 = __fmul_rn(lse2.x, kLog2e), l1 = __fmul_rn(lse2.y, kLog2e);
#pragma unroll
            for (int e = 0; e < 4; ++e) pt[nt][e] = ex2(__fmaf_rn(pt[nt][e], scale_log2, -(e % 2 ? l1 : l0)));
          }
          // Masking, where some pair of the warp's sub-block may be masked (queries past q_len,
          // or causal with the warp's last key after the first query): query column
          // c = 8 nt + e % 2 (relative to qstart + 2t) is allowed for key row hh iff
          // lo[hh] <= c <= hi. Masked P^T and dS^T are selected to +0 (dS^T = P^T (dP^T - delta)
          // would be 0 * NaN where a masked query's dO, or its delta, is not finite).
          const bool causal_diag = p.causal && warp_key0 + kMmaM - 1 > first_pos + qstart;
          const bool sub_masked = qstart + SUB_M > q_len || causal_diag;
          auto mask_sub = [&](float (&x)[QT][4]) {
            const int hi = q_len - 1 - qstart - 2 * t;
            int lo[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              lo[hh] = p.causal ? warp_key0 + g + 8 * hh - first_pos - qstart - 2 * t : -SUB_M;
            }
#pragma unroll
            for (int nt = 0; nt < QT; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int c = nt * kMmaN + e % 2;
                if (c > hi || c < lo[e / 2]) x[nt][e] = 0.f;
              }
            }
          };
          if (sub_masked) mask_sub(pt);
          // dV += P^T dO; dP^T = V dO^T; dS^T = P^T (dP^T - delta); dK += dS^T Q, over the
          // sub-block's k16 query chunks, increasing; masked dS^T selected to +0 too (dP^T of a
          // masked pair is NaN where the query's dO or the key's own v is not finite). Two
          // copies: DIAG (causal_diag) and the rest, whose only masked queries lie past q_len,
          // zero fill (Q, dO, lse, delta), which meet P^T = dS^T = +0 as +0. On the diagonal key
          // row r sees the queries from base + r (relative to qstart) on, and the products take
          // gemm_acc_k_rows_masked where a masked dO / Q row may be non-finite.
          auto tail = [&](auto diag_tag) {
            constexpr bool DIAG = decltype(diag_tag)::value;
            const int base = warp_key0 - first_pos - qstart;
            // acc += a B over B's query rows at b_lane; on a diagonal whose masked pairs meet a
            // non-finite value in B, the per-row masked product (see masked_b_nonfinite).
            auto acc_b_rows = [&](float (&acc)[DT][4], const uint32_t (&a)[QS][4], uint32_t b_lane) {
              if (DIAG && masked_b_nonfinite<T, QS, DT, PITCH, false>(b_lane, base)) {
                gemm_acc_k_rows_masked<T, QS, DT, PITCH, false>(acc, a, b_lane, base, g, t);
              } else {
                gemm_acc_k<T, QS, DT, PITCH>(acc, a, b_lane);
              }
            };
            {
              uint32_t pa[QS][4];
#pragma unroll
              for (int kc = 0; kc < QS; ++kc) c_to_a<T>(pa[kc], pt[2 * kc], pt[2 * kc + 1]);
              acc_b_rows(dv_acc, pa, q_bk_lane + do_off);
            }
            float dst[QT][4];
            gemm_rows_d<T, Cfg::D_STEPS, QT, PITCH>(dst, v_lane, q_bn_lane + do_off);
#pragma unroll
            for (int nt = 0; nt < QT; ++nt) {
              const float2 delta2 = *reinterpret_cast<const float2*>(delta_sub + nt * kMmaN + 2 * t);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                dst[nt][e] = __fmul_rn(pt[nt][e], __fsub_rn(dst[nt][e], e % 2 ? delta2.y : delta2.x));
              }
            }
            if (sub_masked) mask_sub(dst);
            {
              uint32_t dsa[QS][4];
#pragma unroll
              for (int kc = 0; kc < QS; ++kc) c_to_a<T>(dsa[kc], dst[2 * kc], dst[2 * kc + 1]);
              acc_b_rows(dk_acc, dsa, q_bk_lane + q_off);
            }
          };
          if (causal_diag) {
            tail(std::true_type{});
          } else {
            tail(std::false_type{});
          }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
      }
      cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight

      // Epilogue: keys below kv_len; dK = scale * acc and dV rounded once.
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int key = warp_key0 + g + 8 * hh;
        if (key >= kv_len) continue;
        const int64_t off = kv_off + static_cast<int64_t>(key) * p.kv_stride_token + 2 * t;
#pragma unroll
        for (int dn = 0; dn < DT; ++dn) {
          *reinterpret_cast<uint32_t*>(dk + off + dn * kMmaN) = pack_rounded<T>(
              __fmul_rn(dk_acc[dn][2 * hh], p.scale), __fmul_rn(dk_acc[dn][2 * hh + 1], p.scale));
          *reinterpret_cast<uint32_t*>(dv + off + dn * kMmaN) =
              pack_rounded<T>(dv_acc[dn][2 * hh], dv_acc[dn][2 * hh + 1]);
        }
      }
      __syncthreads();  // every warp is done with K, V and the ring before the next tile's copies
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// Grid: x = query head, y = sequences (grid-stride), z = query tiles counted from the last
// (grid-stride up to q_len): the last tiles, which see the most keys when causal, start first.
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS, 1)
    attention_bwd_dq_sm80_kernel(const AttentionGradProblem gp, int group, float scale_log2) {
#ifdef RL_ALIGN_SM80_DEVICE
  constexpr int PITCH = Cfg::PITCH_BYTES, STAGES = Cfg::STAGES, BLOCK_M = Cfg::BLOCK_M;
  constexpr int KT = Cfg::KEY_TILES, KS = Cfg::KEY_STEPS, DT = Cfg::D_TILES, RPC = Cfg::ROWS_PER_COPY;
  const AttentionProblem& p = gp.fwd;

  extern __shared__ __align__(16) uint8_t dq_smem[];
  const uint32_t q_smem = smem_u32(dq_smem);
  const uint32_t do_smem = q_smem + Cfg::Q_TILE_BYTES;
  const uint32_t kv_ring = do_smem + Cfg::Q_TILE_BYTES;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int head = static_cast<int>(blockIdx.x);
  const int64_t kv_head = head / group;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  const T* __restrict__ dout = static_cast<const T*>(gp.dout);
  T* __restrict__ dq = static_cast<T*>(gp.dq);

  // Q, dO: A operands of the warp's 16 queries; K, V: B operands, rows = keys (bn pattern, for S
  // and dP); K again with rows = k (bk pattern, for dS K).
  const uint32_t q_lane = q_smem + a_lane_offset<PITCH>(lane, warp * kMmaM);
  const uint32_t do_lane = do_smem + a_lane_offset<PITCH>(lane, warp * kMmaM);
  const uint32_t k_bn_lane = kv_ring + bn_lane_offset<PITCH>(lane);
  const uint32_t k_bk_lane = kv_ring + bk_lane_offset<PITCH>(lane);
  const int copy_row = tid / Cfg::CHUNKS_PER_ROW, copy_chunk = tid % Cfg::CHUNKS_PER_ROW;

  for (int64_t s = blockIdx.y; s < p.num_seqs; s += gridDim.y) {
    const AttentionSeq sq = attention_seq(p, s);
    const int q_len = static_cast<int>(sq.q_len);
    const int kv_len = static_cast<int>(sq.kv_len);
    if (q_len <= 0) continue;
    const int first_pos = kv_len - q_len;
    const int tiles = (q_len + BLOCK_M - 1) / BLOCK_M;
    const int64_t q_off = sq.q_base + static_cast<int64_t>(head) * p.q_stride_head;
    const int64_t kv_off = sq.kv_base + kv_head * p.kv_stride_head;

    for (int visit = static_cast<int>(blockIdx.z); visit < tiles; visit += static_cast<int>(gridDim.z)) {
      const int qstart = (tiles - 1 - visit) * BLOCK_M;
      const int cta_last_row = (qstart + BLOCK_M < q_len ? qstart + BLOCK_M : q_len) - 1;
      const int num_blocks = p.causal ? (first_pos + cta_last_row) / kKeyBlock + 1
                                      : (kv_len + kKeyBlock - 1) / kKeyBlock;

      auto load_q = [&]() {
        copy_row_pair_async<T, BLOCK_M / RPC, RPC, PITCH>(
            q_smem + copy_row * PITCH + copy_chunk * 16, Cfg::Q_TILE_BYTES, q, dout,
            q_off + static_cast<int64_t>(qstart + copy_row) * p.q_stride_token + copy_chunk * kChunkElems,
            p.q_stride_token, qstart + copy_row, q_len);
      };
      auto load_kv = [&](int stage, int block) {
        copy_row_pair_async<T, kKeyBlock / RPC, RPC, PITCH>(
            kv_ring + stage * Cfg::STAGE_BYTES + copy_row * PITCH + copy_chunk * 16, Cfg::KV_TILE_BYTES, k, v,
            kv_off + static_cast<int64_t>(block * kKeyBlock + copy_row) * p.kv_stride_token + copy_chunk * kChunkElems,
            p.kv_stride_token, block * kKeyBlock + copy_row, kv_len);
      };

      // Prologue: Q, dO with key block 0 (group 0), then blocks 1 .. STAGES-2.
      load_q();
      load_kv(0, 0);
      cp_async_commit();
#pragma unroll
      for (int b = 1; b < STAGES - 1; ++b) {
        if (b < num_blocks) load_kv(b, b);
        cp_async_commit();
      }

      // This thread's rows: queries warp_row0 + g + 8 hh.
      const int warp_row0 = qstart + warp * kMmaM;
      const bool warp_active = warp_row0 < q_len;
      const int warp_last_row = (warp_row0 + kMmaM < q_len ? warp_row0 + kMmaM : q_len) - 1;
      float lse_l2[2], delta_r[2];
      int last_key[2];  // the row's last allowed key
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = warp_row0 + g + 8 * hh;
        const int64_t off = sq.lse_base + static_cast<int64_t>(head) * p.lse_stride_head + i;
        lse_l2[hh] = i < q_len ? __fmul_rn(p.lse[off], kLog2e) : 0.f;
        delta_r[hh] = i < q_len ? gp.delta[off] : 0.f;
        last_key[hh] = p.causal && first_pos + i < kv_len ? first_pos + i : kv_len - 1;
      }
      float dq_acc[DT][4];
#pragma unroll
      for (int dn = 0; dn < DT; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dq_acc[dn][e] = 0.f;
      }

      int stage = 0;
      for (int b = 0; b < num_blocks; ++b) {
        ring_advance<STAGES>(b, 0, num_blocks, load_kv);
        const int key0 = b * kKeyBlock;
        // A warp whose queries all precede the block (causal) would only add exact zeros.
        if (warp_active && !(p.causal && key0 > first_pos + warp_last_row)) {
          const uint32_t stage_off = stage * Cfg::STAGE_BYTES;
          // S = Q K^T (queries x keys); P = 2^(s scale log2(e) - lse log2(e)).
          float sp[KT][4];
          gemm_rows_d<T, Cfg::D_STEPS, KT, PITCH>(sp, q_lane, k_bn_lane + stage_off);
#pragma unroll
          for (int nt = 0; nt < KT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sp[nt][e] = ex2(__fmaf_rn(sp[nt][e], scale_log2, -lse_l2[e / 2]));
          }
          // Masking: key column c = 8 nt + e % 2 (relative to key0 + 2t) is allowed for row hh iff
          // c <= last_key[hh] - key0 - 2t. Masked entries are selected to +0 (never multiplied:
          // S, P and dP of a masked key with a non-finite k or v are Inf / NaN).
          auto mask_block = [&](float (&x)[KT][4]) {
            int limit[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) limit[hh] = last_key[hh] - key0 - 2 * t;
#pragma unroll
            for (int nt = 0; nt < KT; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (nt * kMmaN + e % 2 > limit[e / 2]) x[nt][e] = 0.f;
              }
            }
          };
          // P masked; dP = dO V^T; dS = P (dP - delta); dQ += dS K over the block's k16 key
          // chunks, increasing; masked dS selected to +0 too (dP of a masked pair is NaN where
          // the key's v or the row's own dO is not finite). Two copies: DIAG (some key of the
          // block past the warp's first query) and the rest, whose only masked keys lie past
          // kv_len, zero fill, which meet dS = +0 as +0. On the diagonal query row r sees the keys
          // below base + r (relative to key0; rows past q_len, never stored, are taken the same
          // way), and dS K takes gemm_acc_k_rows_masked where a masked K row may be non-finite.
          auto tail = [&](auto diag_tag) {
            constexpr bool DIAG = decltype(diag_tag)::value;
            const bool masked = DIAG || key0 + kKeyBlock > kv_len;
            if (masked) mask_block(sp);
            float ds[KT][4];
            gemm_rows_d<T, Cfg::D_STEPS, KT, PITCH>(ds, do_lane, k_bn_lane + stage_off + Cfg::KV_TILE_BYTES);
#pragma unroll
            for (int nt = 0; nt < KT; ++nt) {
#pragma unroll
              for (int e = 0; e < 4; ++e) ds[nt][e] = __fmul_rn(sp[nt][e], __fsub_rn(ds[nt][e], delta_r[e / 2]));
            }
            if (masked) mask_block(ds);
            uint32_t dsa[KS][4];
#pragma unroll
            for (int kc = 0; kc < KS; ++kc) c_to_a<T>(dsa[kc], ds[2 * kc], ds[2 * kc + 1]);
            const int base = first_pos + warp_row0 + 1 - key0;
            if (DIAG && masked_b_nonfinite<T, KS, DT, PITCH, true>(k_bk_lane + stage_off, base)) {
              gemm_acc_k_rows_masked<T, KS, DT, PITCH, true>(dq_acc, dsa, k_bk_lane + stage_off, base, g, t);
            } else {
              gemm_acc_k<T, KS, DT, PITCH>(dq_acc, dsa, k_bk_lane + stage_off);
            }
          };
          if (p.causal && key0 + kKeyBlock - 1 > first_pos + warp_row0) {
            tail(std::true_type{});
          } else {
            tail(std::false_type{});
          }
        }
        stage = stage + 1 == STAGES ? 0 : stage + 1;
      }
      cp_async_wait<0>();

      // Epilogue: queries below q_len; dQ = scale * acc rounded once.
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int i = warp_row0 + g + 8 * hh;
        if (i >= q_len) continue;
        T* dq_row = dq + q_off + static_cast<int64_t>(i) * p.q_stride_token + 2 * t;
#pragma unroll
        for (int dn = 0; dn < DT; ++dn) {
          *reinterpret_cast<uint32_t*>(dq_row + dn * kMmaN) = pack_rounded<T>(
              __fmul_rn(dq_acc[dn][2 * hh], p.scale), __fmul_rn(dq_acc[dn][2 * hh + 1], p.scale));
        }
      }
      __syncthreads();  // every warp is done with Q, dO and the ring before the next tile's copies
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

unsigned grid_dim(int64_t n, int64_t cap) { return static_cast<unsigned>(n < cap ? n : cap); }

template <typename T, int D>
gpuError_t launch_bwd(const AttentionGradProblem& gp, gpuStream_t stream) {
  using Dkv = DkvCfg<D>;
  using Dq = DqCfg<D>;
  const AttentionProblem& p = gp.fwd;
  const int64_t group = p.heads_q / p.heads_kv;
  const unsigned seq_grid = grid_dim(p.num_seqs, 65535);
  const float scale_log2 = scale_log2e(p);  // exp(scale s - lse) = 2^(s scale_log2 - lse log2(e))

  auto dkdv = attention_bwd_dkdv_sm80_kernel<T, Dkv>;
  static std::atomic<uint64_t> dkdv_raised{0};
  gpuError_t err = allow_dynamic_smem(dkdv, Dkv::SMEM_BYTES, dkdv_raised);
  if (err != cudaSuccess) return err;
  const dim3 dkdv_grid(static_cast<unsigned>(p.heads_kv), seq_grid,
                       grid_dim(ceil_div(p.max_kv_len, Dkv::BLOCK_N), 65535));
  dkdv<<<dkdv_grid, Dkv::THREADS, Dkv::SMEM_BYTES, stream>>>(gp, static_cast<int>(group), scale_log2);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  auto dq = attention_bwd_dq_sm80_kernel<T, Dq>;
  static std::atomic<uint64_t> dq_raised{0};
  err = allow_dynamic_smem(dq, Dq::SMEM_BYTES, dq_raised);
  if (err != cudaSuccess) return err;
  const dim3 dq_grid(static_cast<unsigned>(p.heads_q), seq_grid,
                     grid_dim(ceil_div(p.max_q_len, Dq::BLOCK_M), 65535));
  dq<<<dq_grid, Dq::THREADS, Dq::SMEM_BYTES, stream>>>(gp, static_cast<int>(group), scale_log2);
  return cudaGetLastError();
}

template <typename T>
gpuError_t dispatch_head_dim(const AttentionGradProblem& gp, gpuStream_t stream) {
  if (gp.fwd.head_dim == 64) return launch_bwd<T, 64>(gp, stream);
  return launch_bwd<T, 128>(gp, stream);
}


}  // namespace

// Problem requirements: tensor_core_attention_problem_error (tensor_core.h), and dout, dq, dk, dv
// 16-byte aligned like q (written in 4-byte pieces, read in 16-byte ones), delta non-null.
gpuError_t attention_bwd_sm80(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream) {
  const AttentionProblem& p = gp.fwd;
  gpuError_t err = tensor_core_attention_problem_error(dtype, p, p.heads_q);  // delta grid y: query heads
  if (err != cudaSuccess || p.num_seqs == 0 || p.max_q_len == 0) return err;
  if (gp.delta == nullptr || !aligned16(gp.dout) || !aligned16(gp.dq) || !aligned16(gp.dk) || !aligned16(gp.dv)) {
    return cudaErrorInvalidValue;
  }
  err = attention_bwd_delta(dtype, gp, stream);
  if (err != cudaSuccess) return err;
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype, [&](auto tag) { return dispatch_head_dim<decltype(tag)>(gp, stream); }, gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
gpuError_t attention_bwd_sm80(DType, const AttentionGradProblem&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
