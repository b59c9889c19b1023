// FMA (SIMT) attention, forward and backward. The path for fp32
// (true fp32 FMA, never TF32) on every GPU, for head dims the tensor-core kernels lack (1..256),
// and for every dtype on HIP: one source for CUDA and HIP, no architecture-specific instruction.
// The arithmetic is the contract of csrc/common/attention_problem.h.
//
// Tiles. Every kernel works on 64 x 64 tiles (query rows x keys, or keys x query rows) with 256
// threads: thread t owns rows ty + 16 r and columns tx + 16 c (r, c = 0..3) of a score tile,
// ty = t / 16, tx = t % 16, and rows ty + 16 r, columns tx + 16 c (c < NC) of a [64, head_dim]
// accumulator tile. The 16 threads of one ty are 16 consecutive lanes of one warp (32 or 64
// lanes), the butterfly group of their rows.
//
// Orders (all fixed by head_dim and dtype only):
//   dot products over d (q.k, dO.v): one fmaf chain per score, d = 0, 1, ..., head_dim - 1,
//     from 0; operands staged in shared memory as fp32, 16 values of d at a time.
//   a row's max and sum over the 64 keys of a block: the thread's 4 keys (c = 0..3) in order,
//     then a butterfly over the 16 lanes (distances 1, 2, 4, 8: a fixed tree, and IEEE addition
//     and max are commutative, so every lane ends with the same bits).
//   accumulations (P V, dS K, P^T dO, dS^T Q): one fmaf chain per output element, the 64 keys
//     (or queries) of a block in increasing order, blocks in increasing order.
//   forward: the recurrence of attention_problem.h with expf / logf; masked keys get
//     scale s_j = -inf, so p_j = 0; fused steps: l = fmaf(l, alpha, sum p), and acc = acc * alpha
//     then acc = fmaf(p_j, v_j, acc) for j in order. KV splits of kAttentionKvSplit keys: a row
//     merges each finished partial (split 0's copied) at the next split it reaches, and its last
//     one at the end, by the contract's formula (merge_term: no fma).
//   backward: delta, then dK/dV (CTA per key tile: the group's heads in increasing order, for
//     each the query blocks in increasing order), then dQ (CTA per query tile: key blocks in
//     increasing order). P = expf(fmaf(s, scale, -lse)) and dS = P (dP - delta), masked -> 0.
// Explicit fmaf marks every fused step; the compiler emits one instruction sequence per
// (dtype, NC) instantiation, run for every row of every batch.
//
// Invariance. Key blocks and key tiles start at multiples of 64 in the sequence's own positions;
// a row's arithmetic never depends on which thread row of the tile it sits in, on the other rows
// of the tile, on strides or on max_q_len (grids only: every kernel loops to each sequence's own
// q_len / kv_len). A CTA may run a key block in which some of its rows have no allowed key; it
// adds p = 0 there: l * 1 + 0 = l, acc * 1 = acc. Masked pairs are selected out of every
// accumulation (scores -inf, P and dS 0, and the MASKED tile_accumulate skips their fmaf), so a
// NaN or Inf in data a row may not see changes none of its bits; blocks with no masked pair take
// the unmasked tile_accumulate. Rows and keys past q_len / kv_len are zero fill and are never
// written. No atomics.
#include <cmath>

#include "../attention_kernels.h"

namespace rl_align {
namespace {

constexpr int kTile = 64;                         // query rows and keys per tile
constexpr int kLanesPerRow = 16;                  // threads per tile row: one butterfly group
constexpr int kMicro = kTile / kLanesPerRow;      // rows (and score columns) per thread
constexpr int kThreads = kLanesPerRow * kLanesPerRow;
constexpr int kDepth = 16;                        // d values (or accumulation rows) per staging step
// Transposed tiles in shared memory are [kDepth][kPitch] (or [kTile][kPitch]): with a pitch of
// 64 + 2 words the stores of 16 lanes with consecutive depth index fall in distinct banks.
constexpr int kPitch = kTile + 2;
constexpr int kMaxHeadDim = static_cast<int>(kAttentionSimtMaxHeadDim);
// dK and dV both stay in registers: at most 8 column groups (128 columns of d) per CTA, wider
// heads take several column slices, each recomputing the scores.
constexpr int kMaxGradColumnGroups = 8;
static_assert(kTile == kAttentionKvBlock, "the tiles are the contract's key blocks");
static_assert(kWarpSize % kLanesPerRow == 0, "a tile row's lanes sit in one warp");
static_assert(kThreads % kWarpSize == 0, "whole warps");

// delta: kDeltaLanes lanes per (query, head) row.
constexpr int kDeltaLanes = 16;
constexpr int kDeltaRows = kThreads / kDeltaLanes;
static_assert(kWarpSize % kDeltaLanes == 0, "a delta row's lanes sit in one warp");

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Fixed butterflies over the kLanesPerRow lanes of a tile row.
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int lane_mask = 1; lane_mask < kLanesPerRow; lane_mask <<= 1) {
    v = fmaxf(v, shfl_xor(v, lane_mask, kLanesPerRow));
  }
  return v;
}

template <int LANES>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
  for (int lane_mask = 1; lane_mask < LANES; lane_mask <<= 1) v += shfl_xor(v, lane_mask, LANES);
  return v;
}

// Shared memory of one staging step: the two transposed [kDepth][kPitch] slices of a dot-product
// tile, or the [kDepth][COLS] slice of an accumulation's right-hand operand (never both at once).
__host__ __device__ constexpr int stage_floats(int cols) {
  return 2 * kDepth * kPitch > kDepth * cols ? 2 * kDepth * kPitch : kDepth * cols;
}

// dst[kk][row] = src row `row`, element d0 + kk, as fp32 (0 past `rows` or head_dim).
// Consecutive threads read consecutive d of one row.
template <typename T>
__device__ __forceinline__ void stage_transposed(float* dst, const T* src, int64_t stride, int64_t rows,
                                                 int d0, int dim) {
  for (int idx = threadIdx.x; idx < kTile * kDepth; idx += kThreads) {
    const int row = idx / kDepth, kk = idx % kDepth;
    float v = 0.f;
    if (row < rows && d0 + kk < dim) v = Convert<T>::to_float(src[row * stride + d0 + kk]);
    dst[kk * kPitch + row] = v;
  }
}

// s[r][c] = dot(a row ty + 16 r, b row tx + 16 c): one fmaf chain over d = 0 .. dim-1. Row i of a
// is a[i * a_stride + d], valid for i < a_rows (b alike). Leaves `stage` free (ends synchronised).
template <typename T>
__device__ __forceinline__ void tile_dot(float (&s)[kMicro][kMicro], const T* a, int64_t a_stride,
                                         int64_t a_rows, const T* b, int64_t b_stride, int64_t b_rows,
                                         int dim, float* stage) {
  const int ty = threadIdx.x / kLanesPerRow, tx = threadIdx.x % kLanesPerRow;
  float* a_slice = stage;
  float* b_slice = stage + kDepth * kPitch;
#pragma unroll
  for (int r = 0; r < kMicro; ++r) {
#pragma unroll
    for (int c = 0; c < kMicro; ++c) s[r][c] = 0.f;
  }
  for (int d0 = 0; d0 < dim; d0 += kDepth) {
    stage_transposed(a_slice, a, a_stride, a_rows, d0, dim);
    stage_transposed(b_slice, b, b_stride, b_rows, d0, dim);
    __syncthreads();
    // Zero-filled tail slots are skipped, not added: each chain has exactly head_dim steps.
    const int depth = dim - d0 < kDepth ? dim - d0 : kDepth;
    for (int kk = 0; kk < depth; ++kk) {
      float av[kMicro], bv[kMicro];
#pragma unroll
      for (int r = 0; r < kMicro; ++r) av[r] = a_slice[kk * kPitch + ty + kLanesPerRow * r];
#pragma unroll
      for (int c = 0; c < kMicro; ++c) bv[c] = b_slice[kk * kPitch + tx + kLanesPerRow * c];
#pragma unroll
      for (int r = 0; r < kMicro; ++r) {
#pragma unroll
        for (int c = 0; c < kMicro; ++c) s[r][c] = fmaf(av[r], bv[c], s[r][c]);
      }
    }
    __syncthreads();
  }
}

// Which accumulation indices j (0..63, keys or queries of the block) enter row r's chains in a
// block holding masked pairs: lo[r] <= j < hi[r] (the allowed pairs of every mask here form one
// range per row).
struct TileMask {
  int lo[kMicro], hi[kMicro];
};

// acc[r][c] = fmaf(w[j][ty + 16 r], m[j][col0 + tx + 16 c], acc[r][c]) for j = 0 .. 63 in
// increasing order; with MASKED only for j in [mask.lo[r], mask.hi[r]): a masked pair is selected
// out, so a non-finite m[j] it would have met (w = 0 there) changes nothing. w is a transposed tile
// in shared memory (w[j * kPitch + row]), written before the call; m row j is
// m[j * m_stride + col], valid for j < m_rows and col < dim, staged 16 rows at a time. Leaves
// `stage` and w free (ends synchronised).
template <typename T, int NC, bool MASKED>
__device__ __forceinline__ void tile_accumulate(float (&acc)[kMicro][NC], const float* w, const T* m,
                                                int64_t m_stride, int64_t m_rows, int col0, int dim,
                                                float* stage, const TileMask& mask) {
  constexpr int kCols = NC * kLanesPerRow;
  const int ty = threadIdx.x / kLanesPerRow, tx = threadIdx.x % kLanesPerRow;
  for (int j0 = 0; j0 < kTile; j0 += kDepth) {
    for (int idx = threadIdx.x; idx < kDepth * kCols; idx += kThreads) {
      const int jj = idx / kCols, col = idx % kCols;
      float v = 0.f;
      if (j0 + jj < m_rows && col0 + col < dim) {
        v = Convert<T>::to_float(m[(j0 + jj) * m_stride + col0 + col]);
      }
      stage[idx] = v;
    }
    __syncthreads();
#pragma unroll
    for (int jj = 0; jj < kDepth; ++jj) {
      float wv[kMicro];
      bool take[kMicro];
#pragma unroll
      for (int r = 0; r < kMicro; ++r) {
        wv[r] = w[(j0 + jj) * kPitch + ty + kLanesPerRow * r];
        take[r] = !MASKED || (mask.lo[r] <= j0 + jj && j0 + jj < mask.hi[r]);
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float mv = stage[jj * kCols + tx + kLanesPerRow * c];
#pragma unroll
        for (int r = 0; r < kMicro; ++r) acc[r][c] = take[r] ? fmaf(wv[r], mv, acc[r][c]) : acc[r][c];
      }
    }
    __syncthreads();
  }
}

__device__ __forceinline__ bool key_allowed(int64_t key, int64_t query_pos, int64_t kv_len, bool causal) {
  return key < kv_len && (!causal || key <= query_pos);
}

// n clamped to [0, kTile]: a block-relative bound of a TileMask.
__device__ __forceinline__ int block_bound(int64_t n) {
  return n < 0 ? 0 : n > kTile ? kTile : static_cast<int>(n);
}

// p, with the compiler no longer knowing what it points to: an array reached through it stays in
// (thread-local) memory instead of being promoted to registers.
__device__ __forceinline__ float* local_memory(float* p) {
#if RL_ALIGN_HIP
  asm volatile("" : "+v"(p));
#else
  asm volatile("" : "+l"(p));
#endif
  return p;
}

// fl(fl(x a) + fl(y b)), never an fma: a term of the contract's split merge. HIP's __fmul_rn and
// __fadd_rn are plain operators that clang contracts across the inlined calls, hence the pragma.
__device__ __forceinline__ float merge_term(float x, float a, float y, float b) {
#if RL_ALIGN_HIP
#pragma clang fp contract(off)
  return x * a + y * b;
#else
  return __fadd_rn(__fmul_rn(x, a), __fmul_rn(y, b));
#endif
}

// The contract's merge scale of a state with max `from` into a merged max `to`: 1 when equal, so a
// partial holding the maximum (or an -inf max meeting an -inf) is never scaled.
__device__ __forceinline__ float merge_scale(float from, float to) { return from == to ? 1.f : expf(from - to); }

// ------------------------------------------------------------------------------------------------
// Forward: CTA = (sequence, query head, tile of 64 queries); grid-stride over all three.
// ------------------------------------------------------------------------------------------------

// Two CTAs per SM up to NC = 8 (128 registers, what ptxas chose for NC = 2..8 before the splits):
// left free, it takes more for NC = 8 and drops to one CTA, or spills.
template <typename T, int NC>
__global__ void __launch_bounds__(kThreads, NC <= 8 ? 2 : 1) attention_fwd_simt_kernel(const AttentionProblem p) {
  __shared__ float probs[kTile * kPitch];  // probs[key][query row]
  __shared__ float stage[stage_floats(NC * kLanesPerRow)];
  // The merged state (M, L, A) of the splits a row has finished, touched only at split boundaries
  // and at the end: kept in thread-local memory rather than doubling the accumulator's registers.
  float merged_state[kMicro * (NC + 2)];
  const int ty = threadIdx.x / kLanesPerRow, tx = threadIdx.x % kLanesPerRow;
  const int dim = static_cast<int>(p.head_dim);
  const int64_t group = p.heads_q / p.heads_kv;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);

  for (int64_t seq = blockIdx.z; seq < p.num_seqs; seq += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, seq);
    const int64_t q_len = sq.q_len, kv_len = sq.kv_len;
    for (int64_t head = blockIdx.y; head < p.heads_q; head += gridDim.y) {
      const int64_t kv_offset = sq.kv_base + (head / group) * p.kv_stride_head;
      for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile; i0 < q_len;
           i0 += static_cast<int64_t>(gridDim.x) * kTile) {
        const int64_t rows = q_len - i0;
        const int64_t pos0 = kv_len - q_len + i0;  // position of the tile's row 0
        const T* q_tile = q + sq.q_base + i0 * p.q_stride_token + head * p.q_stride_head;
        const int64_t last_key = p.causal ? min64(pos0 + min64(rows, kTile) - 1, kv_len - 1) : kv_len - 1;
        // One past the last key row r may see (key_allowed's bound), capped to the keys this tile
        // visits (only padding rows reach further).
        const auto key_end = [&](int r) {
          const int64_t end = p.causal ? min64(pos0 + ty + kLanesPerRow * r + 1, kv_len) : kv_len;
          return min64(end, last_key + 1);
        };
        // A block ending by full_end holds no masked pair (the tile's row 0 sees the fewest keys).
        const int64_t full_end = p.causal ? min64(pos0 + 1, kv_len) : kv_len;

        float m[kMicro], l[kMicro], acc[kMicro][NC];
#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          m[r] = -INFINITY;
          l[r] = 0.f;
#pragma unroll
          for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
        }

        for (int64_t key0 = 0; key0 <= last_key; key0 += kTile) {
          if (key0 != 0 && key0 % kAttentionKvSplit == 0) {
            // Split boundary: a row that reaches the new split folds its finished partial into
            // its merged state (the first one is copied: merging starts from split 0's partial)
            // and starts a fresh one; a row that does not keeps its partial, which the split's
            // blocks, all masked for it, leave unchanged.
#pragma unroll
            for (int r = 0; r < kMicro; ++r) {
              if (key_end(r) <= key0) continue;
              float* merged = local_memory(merged_state);
              if (key0 == kAttentionKvSplit) {
                merged[r] = m[r];
                merged[kMicro + r] = l[r];
#pragma unroll
                for (int c = 0; c < NC; ++c) merged[2 * kMicro + r * NC + c] = acc[r][c];
              } else {
                const float big_m = merged[r];
                const float new_m = fmaxf(big_m, m[r]);
                const float a = merge_scale(big_m, new_m), b = merge_scale(m[r], new_m);
                merged[r] = new_m;
                merged[kMicro + r] = merge_term(merged[kMicro + r], a, l[r], b);
#pragma unroll
                for (int c = 0; c < NC; ++c) merged[2 * kMicro + r * NC + c] = merge_term(merged[2 * kMicro + r * NC + c], a, acc[r][c], b);
              }
              m[r] = -INFINITY;
              l[r] = 0.f;
#pragma unroll
              for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
            }
          }
          float s[kMicro][kMicro];
          tile_dot(s, q_tile, p.q_stride_token, rows, k + kv_offset + key0 * p.kv_stride_token,
                   p.kv_stride_token, kv_len - key0, dim, stage);
#pragma unroll
          for (int r = 0; r < kMicro; ++r) {
            const int64_t pos = pos0 + ty + kLanesPerRow * r;
            float scaled[kMicro];
            float block_max = -INFINITY;
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const int64_t key = key0 + tx + kLanesPerRow * c;
              scaled[c] = key_allowed(key, pos, kv_len, p.causal) ? s[r][c] * p.scale : -INFINITY;
              block_max = fmaxf(block_max, scaled[c]);
            }
            // A split's first block holds its first key, allowed for every row that starts a
            // partial there: m is finite from then on (alpha = 1 in blocks masked for the row).
            const float m_new = fmaxf(m[r], row_max(block_max));
            const float alpha = expf(m[r] - m_new);
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const float prob = expf(scaled[c] - m_new);
              sum += prob;
              probs[(tx + kLanesPerRow * c) * kPitch + ty + kLanesPerRow * r] = prob;
            }
            l[r] = fmaf(l[r], alpha, lanes_sum<kLanesPerRow>(sum));
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[r][c] *= alpha;
            m[r] = m_new;
          }
          // tile_accumulate synchronises after staging, before it reads probs.
          const T* v_block = v + kv_offset + key0 * p.kv_stride_token;
          if (key0 + kTile <= full_end) {
            tile_accumulate<T, NC, false>(acc, probs, v_block, p.kv_stride_token, kv_len - key0, 0, dim, stage,
                                          TileMask{});
          } else {
            TileMask mask;
#pragma unroll
            for (int r = 0; r < kMicro; ++r) {
              mask.lo[r] = 0;
              mask.hi[r] = block_bound(key_end(r) - key0);
            }
            tile_accumulate<T, NC, true>(acc, probs, v_block, p.kv_stride_token, kv_len - key0, 0, dim, stage,
                                         mask);
          }
        }

#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          // A row past split 0 merges its last partial; (m, l, acc) become the merged state.
          if (key_end(r) <= kAttentionKvSplit) continue;
          float* merged = local_memory(merged_state);
          const float big_m = merged[r];
          const float new_m = fmaxf(big_m, m[r]);
          const float a = merge_scale(big_m, new_m), b = merge_scale(m[r], new_m);
          l[r] = merge_term(merged[kMicro + r], a, l[r], b);
#pragma unroll
          for (int c = 0; c < NC; ++c) acc[r][c] = merge_term(merged[2 * kMicro + r * NC + c], a, acc[r][c], b);
          m[r] = new_m;
        }
#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          const int row = ty + kLanesPerRow * r;
          if (row >= rows) continue;
          T* out_row = out + sq.q_base + (i0 + row) * p.q_stride_token + head * p.q_stride_head;
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            const int col = tx + kLanesPerRow * c;
            // + 0.f: a zero output is +0 whatever the sign of its accumulator's zero.
            if (col < dim) out_row[col] = Convert<T>::from_float(acc[r][c] / l[r] + 0.f);
          }
          if (tx == 0) p.lse[sq.lse_base + head * p.lse_stride_head + i0 + row] = m[r] + logf(l[r]);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward
// ------------------------------------------------------------------------------------------------

// delta_i = dot(dO_i, O_i): lane t of a row's 16 takes d = t, t + 16, ... in order (an fmaf
// chain), then the butterfly. CTA = (sequence, query head, 16 queries); grid-stride.
template <typename T>
__global__ void __launch_bounds__(kThreads) attention_delta_simt_kernel(const AttentionGradProblem gp) {
  const AttentionProblem& p = gp.fwd;
  const int lane = threadIdx.x % kDeltaLanes, row = threadIdx.x / kDeltaLanes;
  const T* out = static_cast<const T*>(p.out);
  const T* dout = static_cast<const T*>(gp.dout);
  for (int64_t seq = blockIdx.z; seq < p.num_seqs; seq += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, seq);
    const int64_t q_len = sq.q_len;
    for (int64_t head = blockIdx.y; head < p.heads_q; head += gridDim.y) {
      for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kDeltaRows; i0 < q_len;
           i0 += static_cast<int64_t>(gridDim.x) * kDeltaRows) {
        const int64_t i = i0 + row;
        float acc = 0.f;
        if (i < q_len) {
          const int64_t offset = sq.q_base + i * p.q_stride_token + head * p.q_stride_head;
          for (int64_t d = lane; d < p.head_dim; d += kDeltaLanes) {
            acc = fmaf(Convert<T>::to_float(dout[offset + d]), Convert<T>::to_float(out[offset + d]), acc);
          }
        }
        acc = lanes_sum<kDeltaLanes>(acc);
        if (i < q_len && lane == 0) gp.delta[sq.lse_base + head * p.lse_stride_head + i] = acc;
      }
    }
  }
}

// dK, dV: CTA = (sequence, kv head g x column slice, tile of 64 keys). Thread rows are keys,
// score columns queries. For each query head of the group in increasing order, for each block of
// 64 queries from the first that can see the tile (causal) in increasing order:
//   S^T = K Q^T, P^T = expf(fmaf(S^T, scale, -lse)), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q      (this CTA's columns of d);
// at the end dK *= scale. Each element one fp32 accumulator, rounded once. Heads wider than
// kMaxGradColumnGroups * 16 take several column slices, each recomputing S and dP.
// Two CTAs per SM for NC <= 2 (the 128 registers ptxas chose before masked selection, which
// otherwise spills in the query loop).
template <typename T, int NC>
__global__ void __launch_bounds__(kThreads, NC <= 2 ? 2 : 1) attention_bwd_dkdv_simt_kernel(const AttentionGradProblem gp) {
  constexpr int kCols = NC * kLanesPerRow;
  __shared__ float probs[kTile * kPitch];       // probs[query][key row]
  __shared__ float grad_scores[kTile * kPitch];  // dS, the same layout
  __shared__ float stage[stage_floats(kCols)];
  const AttentionProblem& p = gp.fwd;
  const int ty = threadIdx.x / kLanesPerRow, tx = threadIdx.x % kLanesPerRow;
  const int dim = static_cast<int>(p.head_dim);
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t slices = ceil_div(p.head_dim, kCols);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(gp.dout);
  T* dk = static_cast<T*>(gp.dk);
  T* dv = static_cast<T*>(gp.dv);

  for (int64_t seq = blockIdx.z; seq < p.num_seqs; seq += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, seq);
    const int64_t q_len = sq.q_len, kv_len = sq.kv_len;
    for (int64_t head_slice = blockIdx.y; head_slice < p.heads_kv * slices; head_slice += gridDim.y) {
      const int64_t kv_head = head_slice / slices;
      const int col0 = static_cast<int>(head_slice % slices) * kCols;
      for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile; j0 < kv_len;
           j0 += static_cast<int64_t>(gridDim.x) * kTile) {
        const int64_t keys = kv_len - j0;
        const int64_t kv_offset = sq.kv_base + j0 * p.kv_stride_token + kv_head * p.kv_stride_head;
        // Query i sits at position kv_len - q_len + i; the first block holding one that sees key j0.
        const int64_t first_query = p.causal && j0 > kv_len - q_len ? j0 - (kv_len - q_len) : 0;
        // Key row r sees the queries [its causal first, q_len): the block of queries from i0 as a
        // TileMask (key rows past kv_len are never written). In a block at or past full_begin (the
        // tile's last key's first query) every pair is allowed when no row or query is padding.
        const auto query_mask = [&](int64_t i0) {
          TileMask mask;
#pragma unroll
          for (int r = 0; r < kMicro; ++r) {
            const int64_t key = j0 + ty + kLanesPerRow * r;
            mask.lo[r] = p.causal ? block_bound(key - (kv_len - q_len) - i0) : 0;
            mask.hi[r] = block_bound(q_len - i0);
          }
          return mask;
        };
        const int64_t full_begin = p.causal ? j0 + kTile - 1 - (kv_len - q_len) : 0;

        float dk_acc[kMicro][NC], dv_acc[kMicro][NC];
#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
#pragma unroll
          for (int c = 0; c < NC; ++c) dk_acc[r][c] = dv_acc[r][c] = 0.f;
        }

        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
          for (int64_t i0 = first_query / kTile * kTile; i0 < q_len; i0 += kTile) {
            const int64_t queries = q_len - i0;
            const int64_t q_offset = sq.q_base + i0 * p.q_stride_token + head * p.q_stride_head;
            // One score tile live at a time: P^T goes to shared memory and feeds dV before dP^T is
            // computed; dS^T then reads back the thread's own P^T entries.
            float scores[kMicro][kMicro];
            tile_dot(scores, k + kv_offset, p.kv_stride_token, keys, q + q_offset, p.q_stride_token, queries,
                     dim, stage);
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const int64_t i = i0 + tx + kLanesPerRow * c;
              const float lse = i < q_len ? p.lse[sq.lse_base + head * p.lse_stride_head + i] : 0.f;
#pragma unroll
              for (int r = 0; r < kMicro; ++r) {
                const int64_t key = j0 + ty + kLanesPerRow * r;
                const bool allowed = i < q_len && key_allowed(key, kv_len - q_len + i, kv_len, p.causal);
                probs[(tx + kLanesPerRow * c) * kPitch + ty + kLanesPerRow * r] =
                    allowed ? expf(fmaf(scores[r][c], p.scale, -lse)) : 0.f;
              }
            }
            // Every pair of the tile is allowed, or the products of masked ones are selected out.
            const bool full = j0 + kTile <= kv_len && i0 + kTile <= q_len && i0 >= full_begin;
            if (full) {
              tile_accumulate<T, NC, false>(dv_acc, probs, dout + q_offset, p.q_stride_token, queries, col0, dim,
                                            stage, TileMask{});
            } else {
              tile_accumulate<T, NC, true>(dv_acc, probs, dout + q_offset, p.q_stride_token, queries, col0, dim,
                                           stage, query_mask(i0));
            }
            tile_dot(scores, v + kv_offset, p.kv_stride_token, keys, dout + q_offset, p.q_stride_token,
                     queries, dim, stage);
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const int64_t i = i0 + tx + kLanesPerRow * c;
              const float delta = i < q_len ? gp.delta[sq.lse_base + head * p.lse_stride_head + i] : 0.f;
#pragma unroll
              for (int r = 0; r < kMicro; ++r) {
                const int64_t key = j0 + ty + kLanesPerRow * r;
                const bool allowed = i < q_len && key_allowed(key, kv_len - q_len + i, kv_len, p.causal);
                const int at = (tx + kLanesPerRow * c) * kPitch + ty + kLanesPerRow * r;
                grad_scores[at] = allowed ? probs[at] * (scores[r][c] - delta) : 0.f;
              }
            }
            if (full) {
              tile_accumulate<T, NC, false>(dk_acc, grad_scores, q + q_offset, p.q_stride_token, queries, col0,
                                            dim, stage, TileMask{});
            } else {
              tile_accumulate<T, NC, true>(dk_acc, grad_scores, q + q_offset, p.q_stride_token, queries, col0,
                                           dim, stage, query_mask(i0));
            }
          }
        }

#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          const int row = ty + kLanesPerRow * r;
          if (row >= keys) continue;
          const int64_t offset = kv_offset + row * p.kv_stride_token;
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            const int col = col0 + tx + kLanesPerRow * c;
            if (col >= dim) continue;
            dk[offset + col] = Convert<T>::from_float(p.scale * dk_acc[r][c]);
            dv[offset + col] = Convert<T>::from_float(dv_acc[r][c]);
          }
        }
      }
    }
  }
}

// dQ: CTA = (sequence, query head, tile of 64 queries). Key blocks in increasing order up to the
// tile's causal limit: S = Q K^T, P, dP = dO V^T, dS as in dK/dV (the same bits: products
// commute), dQ += dS K; at the end dQ *= scale.
template <typename T, int NC>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_simt_kernel(const AttentionGradProblem gp) {
  __shared__ float grad_scores[kTile * kPitch];  // grad_scores[key][query row]
  __shared__ float stage[stage_floats(NC * kLanesPerRow)];
  const AttentionProblem& p = gp.fwd;
  const int ty = threadIdx.x / kLanesPerRow, tx = threadIdx.x % kLanesPerRow;
  const int dim = static_cast<int>(p.head_dim);
  const int64_t group = p.heads_q / p.heads_kv;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(gp.dout);
  T* dq = static_cast<T*>(gp.dq);

  for (int64_t seq = blockIdx.z; seq < p.num_seqs; seq += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, seq);
    const int64_t q_len = sq.q_len, kv_len = sq.kv_len;
    for (int64_t head = blockIdx.y; head < p.heads_q; head += gridDim.y) {
      const int64_t kv_offset = sq.kv_base + (head / group) * p.kv_stride_head;
      for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile; i0 < q_len;
           i0 += static_cast<int64_t>(gridDim.x) * kTile) {
        const int64_t rows = q_len - i0;
        const int64_t pos0 = kv_len - q_len + i0;
        const int64_t q_offset = sq.q_base + i0 * p.q_stride_token + head * p.q_stride_head;
        const int64_t last_key = p.causal ? min64(pos0 + min64(rows, kTile) - 1, kv_len - 1) : kv_len - 1;

        float lse[kMicro], delta[kMicro], acc[kMicro][NC];
#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          const int64_t i = i0 + ty + kLanesPerRow * r;
          const int64_t lse_index = sq.lse_base + head * p.lse_stride_head + i;
          lse[r] = i < q_len ? p.lse[lse_index] : 0.f;
          delta[r] = i < q_len ? gp.delta[lse_index] : 0.f;
#pragma unroll
          for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
        }

        for (int64_t key0 = 0; key0 <= last_key; key0 += kTile) {
          const int64_t keys = kv_len - key0;
          const int64_t key_offset = kv_offset + key0 * p.kv_stride_token;
          // One score tile live at a time: P goes to shared memory, dS reads back the thread's own
          // entries after dP.
          float scores[kMicro][kMicro];
          tile_dot(scores, q + q_offset, p.q_stride_token, rows, k + key_offset, p.kv_stride_token, keys, dim,
                   stage);
#pragma unroll
          for (int r = 0; r < kMicro; ++r) {
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const bool allowed = i0 + ty + kLanesPerRow * r < q_len &&
                                   key_allowed(key0 + tx + kLanesPerRow * c, pos0 + ty + kLanesPerRow * r, kv_len,
                                               p.causal);
              grad_scores[(tx + kLanesPerRow * c) * kPitch + ty + kLanesPerRow * r] =
                  allowed ? expf(fmaf(scores[r][c], p.scale, -lse[r])) : 0.f;
            }
          }
          tile_dot(scores, dout + q_offset, p.q_stride_token, rows, v + key_offset, p.kv_stride_token, keys,
                   dim, stage);
#pragma unroll
          for (int r = 0; r < kMicro; ++r) {
#pragma unroll
            for (int c = 0; c < kMicro; ++c) {
              const bool allowed = i0 + ty + kLanesPerRow * r < q_len &&
                                   key_allowed(key0 + tx + kLanesPerRow * c, pos0 + ty + kLanesPerRow * r, kv_len,
                                               p.causal);
              const int at = (tx + kLanesPerRow * c) * kPitch + ty + kLanesPerRow * r;
              grad_scores[at] = allowed ? grad_scores[at] * (scores[r][c] - delta[r]) : 0.f;
            }
          }
          // No masked pair in the block (row 0 sees the fewest keys; no full_end kept live: it made
          // ptxas spill in this loop).
          if (key0 + kTile <= kv_len && (!p.causal || key0 + kTile - 1 <= pos0)) {
            tile_accumulate<T, NC, false>(acc, grad_scores, k + key_offset, p.kv_stride_token, keys, 0, dim, stage,
                                          TileMask{});
          } else {
            TileMask mask;
#pragma unroll
            for (int r = 0; r < kMicro; ++r) {
              const int64_t end = p.causal ? min64(pos0 + ty + kLanesPerRow * r + 1, kv_len) : kv_len;
              mask.lo[r] = 0;
              mask.hi[r] = block_bound(end - key0);
            }
            tile_accumulate<T, NC, true>(acc, grad_scores, k + key_offset, p.kv_stride_token, keys, 0, dim, stage,
                                         mask);
          }
        }

#pragma unroll
        for (int r = 0; r < kMicro; ++r) {
          const int row = ty + kLanesPerRow * r;
          if (row >= rows) continue;
          T* dq_row = dq + q_offset + row * p.q_stride_token;
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            const int col = tx + kLanesPerRow * c;
            if (col < dim) dq_row[col] = Convert<T>::from_float(p.scale * acc[r][c]);
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------------

unsigned grid_dim(int64_t n, int64_t cap) { return static_cast<unsigned>(n < cap ? n : cap); }

// Column groups of 16 per thread for a head_dim: the smallest of 1, 2, 4, 8, 16 that covers it.
// Padding columns are computed and dropped; they never enter a kept element's chain.
int column_groups(int64_t head_dim) {
  int groups = 1;
  while (groups * kLanesPerRow < head_dim) groups *= 2;
  return groups;
}

template <typename T, int NC>
gpuError_t launch_fwd(const AttentionProblem& p, gpuStream_t stream) {
  const dim3 grid(grid_dim(ceil_div(p.max_q_len, kTile), INT32_MAX), grid_dim(p.heads_q, 65535),
                  grid_dim(p.num_seqs, 65535));
  attention_fwd_simt_kernel<T, NC><<<grid, kThreads, 0, stream>>>(p);
  return gpu_last_error();
}

template <typename T, int NC>
gpuError_t launch_bwd(const AttentionGradProblem& gp, gpuStream_t stream) {
  constexpr int kGradGroups = NC < kMaxGradColumnGroups ? NC : kMaxGradColumnGroups;
  const AttentionProblem& p = gp.fwd;
  const unsigned seq_grid = grid_dim(p.num_seqs, 65535);
  const unsigned head_grid = grid_dim(p.heads_q, 65535);

  const dim3 delta_grid(grid_dim(ceil_div(p.max_q_len, kDeltaRows), INT32_MAX), head_grid, seq_grid);
  attention_delta_simt_kernel<T><<<delta_grid, kThreads, 0, stream>>>(gp);
  gpuError_t err = gpu_last_error();
  if (err != kGpuSuccess) return err;

  const int64_t slices = ceil_div(p.head_dim, kGradGroups * kLanesPerRow);
  const dim3 dkdv_grid(grid_dim(ceil_div(p.max_kv_len, kTile), INT32_MAX),
                       grid_dim(p.heads_kv * slices, 65535), seq_grid);
  attention_bwd_dkdv_simt_kernel<T, kGradGroups><<<dkdv_grid, kThreads, 0, stream>>>(gp);
  err = gpu_last_error();
  if (err != kGpuSuccess) return err;

  const dim3 dq_grid(grid_dim(ceil_div(p.max_q_len, kTile), INT32_MAX), head_grid, seq_grid);
  attention_bwd_dq_simt_kernel<T, NC><<<dq_grid, kThreads, 0, stream>>>(gp);
  return gpu_last_error();
}

template <typename T>
gpuError_t dispatch_fwd(const AttentionProblem& p, gpuStream_t stream) {
  switch (column_groups(p.head_dim)) {
    case 1: return launch_fwd<T, 1>(p, stream);
    case 2: return launch_fwd<T, 2>(p, stream);
    case 4: return launch_fwd<T, 4>(p, stream);
    case 8: return launch_fwd<T, 8>(p, stream);
    case 16: return launch_fwd<T, 16>(p, stream);
  }
  return RL_GPU(ErrorNotSupported);
}

template <typename T>
gpuError_t dispatch_bwd(const AttentionGradProblem& gp, gpuStream_t stream) {
  switch (column_groups(gp.fwd.head_dim)) {
    case 1: return launch_bwd<T, 1>(gp, stream);
    case 2: return launch_bwd<T, 2>(gp, stream);
    case 4: return launch_bwd<T, 4>(gp, stream);
    case 8: return launch_bwd<T, 8>(gp, stream);
    case 16: return launch_bwd<T, 16>(gp, stream);
  }
  return RL_GPU(ErrorNotSupported);
}

// Shape and pointer checks shared by forward and backward; kGpuSuccess when the problem is valid.
gpuError_t check_problem(const AttentionProblem& p) {
  if (p.head_dim < 1) return RL_GPU(ErrorInvalidValue);
  if (p.head_dim > kMaxHeadDim) return RL_GPU(ErrorNotSupported);
  if (p.num_seqs < 0 || p.max_q_len < 0 || p.max_kv_len < p.max_q_len) return RL_GPU(ErrorInvalidValue);
  if (p.heads_q <= 0 || p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return RL_GPU(ErrorInvalidValue);
  if (p.seqs == nullptr || p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr ||
      p.lse == nullptr) {
    return RL_GPU(ErrorInvalidValue);
  }
  return kGpuSuccess;
}

}  // namespace

gpuError_t attention_fwd_simt(DType dtype, const AttentionProblem& p, gpuStream_t stream) {
  const gpuError_t err = check_problem(p);
  if (err != kGpuSuccess) return err;
  if (p.num_seqs == 0 || p.max_q_len == 0) return kGpuSuccess;  // no query rows anywhere
  return dispatch_dtype<KernelTypes>(
      dtype, [&](auto tag) { return dispatch_fwd<decltype(tag)>(p, stream); }, gpu_not_supported);
}

gpuError_t attention_bwd_simt(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream) {
  const gpuError_t err = check_problem(gp.fwd);
  if (err != kGpuSuccess) return err;
  if (gp.dout == nullptr || gp.dq == nullptr || gp.dk == nullptr || gp.dv == nullptr ||
      gp.delta == nullptr) {
    return RL_GPU(ErrorInvalidValue);
  }
  if (gp.fwd.num_seqs == 0 || gp.fwd.max_q_len == 0) return kGpuSuccess;  // no tokens anywhere
  return dispatch_dtype<KernelTypes>(
      dtype, [&](auto tag) { return dispatch_bwd<decltype(tag)>(gp, stream); }, gpu_not_supported);
}

}  // namespace rl_align
