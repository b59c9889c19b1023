// The one attention problem every attention op reduces to (padded batch, packed varlen, KV
// cache), and the arithmetic every path promises. Torch-free: shared by the CPU kernels, the
// CUDA/HIP kernels and their torch bindings.
//
// A problem is a list of sequences. Sequence s holds kv_len[s] keys/values at positions
// 0 .. kv_len[s]-1 (position 0 = the sequence's own first token, whatever padding or packing
// surrounds it) and q_len[s] <= kv_len[s] queries, the last q_len[s] positions:
//   query i (0 <= i < q_len) sits at position p = kv_len - q_len + i
//   causal:     it attends to keys 0 .. p
//   not causal: it attends to keys 0 .. kv_len-1
// A training forward has q_len == kv_len; a KV-cache step (decode: q_len = 1, chunked prefill:
// q_len > 1) has q_len < kv_len. Query head h reads key/value head h / (heads_q / heads_kv) (GQA).
//
// Arithmetic (every path; the dot products' inner order and the exp form (exp, or exp2 of
// log2(e)-prescaled values) are the path's own, fixed for every shape):
//   s_j = dot(q_p, k_j)                                      (fp32 accumulation)
//   keys are taken in blocks of kAttentionKvBlock positions, block b = [64 b, 64 b + 64), in
//   increasing b; a block holding no allowed key is skipped or contributes exact zeros.
//   Running state per (query, head), fp32: max m (starts -inf), sum l (starts 0), acc[D] (0).
//   Per block: m' = max(m, max_j scale * s_j); alpha = exp(m - m'); p_j = exp(scale * s_j - m')
//   (masked keys: p_j = 0); l = l * alpha + sum_j p_j; acc = acc * alpha + sum_j p_j v_j.
//   out = acc / l (rounded once to the input dtype); lse = m + log(l) (fp32).
// KV splits. The keys are also cut into splits of kAttentionKvSplit positions, split c =
//   [c L, c L + L) with L = kAttentionKvSplit (a multiple of the block), counted from the
//   sequence's own position 0. A row whose allowed keys lie in one split (every row below
//   position L, and every row of a causal sequence at positions < L) runs the recurrence above
//   unchanged. Otherwise each split c the row reaches (its first key c L is allowed) runs the
//   recurrence from a fresh state (m = -inf, l = 0, acc = 0) over its own blocks, giving the
//   partial (m_c, l_c, acc_c), and the partials merge in increasing c, starting from split 0's:
//     M' = max(M, m_c);  a = M == M' ? 1 : exp(M - M');  b = m_c == M' ? 1 : exp(m_c - M')
//     L  = fl(fl(L a) + fl(l_c b));   A[d] = fl(fl(A[d] a) + fl(acc_c[d] b))   (no fma)
//   then out = A / L and lse = M + log(L) as above. exp/log are the path's own (the same ones as
//   its block recurrence, on its own score domain). Which thread, CTA or kernel computes a
//   partial, and whether partials are merged as they complete (a prefill row finishing split c)
//   or after all of them (a decode step running the splits on separate CTAs), changes nothing:
//   the same partials merge by the same formula in the same order. Splits exist so that a few
//   long sequences can spread their keys over the whole GPU in a decode step (DESIGN.md section
//   4 allows a split only in this form); a prefill reproduces them so that decode == prefill.
// Masked keys (past the row's causal position, or past kv_len) never enter a product, a max or
// a sum: their terms are selected out, not multiplied by 0, so a NaN or Inf in a masked key's k
// or v changes no bit of the rows that may not see it (forward and backward).
// Nothing in this chain depends on other sequences, other queries, how many queries share a
// launch, or where the sequence sits in memory, so a token's out/lse are the same bits in a
// batch of 1 or N, padded left or right, packed next to anything, in a chunked prefill at any
// chunk size, or in a KV-cache decode step: the batch invariance contract
// (docs/design.md, "The numerical contract").
// Rows with no allowed key (q_len = 0 sequences have none) are never written by the kernels.
//
// Backward (q_len == kv_len, no KV cache), per sequence and head, with dO the output gradient
// (unchanged by the splits: it recomputes P from the forward's lse; masked pairs (i, j) have
// P = dS = 0 selected and their k_j, q_i, v_j, dO_i never enter a product):
//   delta_i = dot(dO_i, O_i) in fp32 (O as stored, in the input dtype)
//   P_ij recomputed as exp(scale * s_ij - lse_i); dP_ij = dot(dO_i, v_j); dS_ij = P_ij (dP_ij - delta_i)
//   dQ_i = scale * sum_j dS_ij k_j        over key blocks in increasing order
//   dK_j = scale * sum_i dS_ij q_i        over the group's query heads in increasing order, and
//   dV_j = sum_i P_ij dO_i                for each head over query blocks in increasing order
// Each gradient element is one fp32 accumulator owned by one thread, rounded once: no atomics,
// no split whose order could change with the batch.
#pragma once

#include "host_device.h"

#include <cstdint>

namespace rl_align {

// Key/value positions per block of the online softmax (every path): blocks start at multiples
// of it in the sequence's own positions.
constexpr int64_t kAttentionKvBlock = 64;
// Key positions per KV split (every path, dtype and head_dim): splits start at multiples of it in
// the sequence's own positions. 2048 lets one sequence of 32k keys spread over 16 x kv-heads CTAs
// in a decode step while prefills up to 2048 tokens never cross a split boundary.
constexpr int64_t kAttentionKvSplit = 2048;
static_assert(kAttentionKvSplit % kAttentionKvBlock == 0, "splits are whole blocks");

// Per-sequence descriptor: kAttentionSeqFields int64 values per sequence, in this order.
enum AttentionSeqField : int {
  kSeqQBase = 0,    // element offset of the sequence's query 0, head 0, dim 0 in q (and out, dout, dq)
  kSeqKvBase = 1,   // element offset of its key 0, head 0, dim 0 in k (and v, dk, dv)
  kSeqLseBase = 2,  // element offset of its query 0, head 0 in lse (and delta)
  kSeqQLen = 3,     // queries (the last q_len positions of the sequence)
  kSeqKvLen = 4,    // keys / values, positions 0 .. kv_len-1
};
constexpr int kAttentionSeqFields = 5;
// Zero int64 words after the descriptors: AttentionProblem::status, then a counter the sm90
// forward's CTAs claim tiles from (cuda/attention/sm90_fwd.cu; its last claim zeroes it again).
constexpr int kAttentionSeqStatusWords = 2;

// Descriptors built from sequence lengths where those live (the ops' validate=False paths, which
// read no length on the host): sequence s starts at element start(s) * stride of each operand,
// start(s) = cu_seqlens[s] when packed, else s (one cache row per sequence). A KV cache may also
// give per-row start offsets (cache_starts: a left-padded cache read in place): the sequence's
// key 0 is then at cache position cache_starts[s], and positions count from there.
struct SeqsFromLengths {
  bool packed = false;     // lengths: cu_seqlens [num_seqs + 1] (attention_varlen), else the KV
                           // lengths [num_seqs] (attention_kvcache)
  int64_t num_seqs = 0;
  int64_t q_stride = 0, kv_stride = 0, lse_stride = 0;
  int64_t new_tokens = 0;    // KV cache: each sequence's queries (its last positions), q_len;
                             // a sequence shorter than that (new_tokens > 1 only) owns its last
                             // kv_len queries, the ones before its position 0 are padding
  int64_t q_token_stride = 0;  // KV cache: elements between queries (to skip padding queries)
  int64_t kv_position_stride = 0;  // KV cache: elements between cache positions (for cache_starts)
  int64_t max_len = 0;       // the longest allowed sequence: the cache's positions / max_seqlen
  int64_t total_tokens = 0;  // packed: where cu_seqlens must end (the token count)
};

// The shortest sequence a KV-cache call of n new tokens takes: decode needs its new token; a chunk
// of n > 1 may start before the sequence (its first queries are then padding), even hold none of it.
RL_ALIGN_HOST_DEVICE int64_t kvcache_min_length(int64_t new_tokens) { return new_tokens > 1 ? 0 : new_tokens; }

struct AttentionProblem {
  int64_t num_seqs = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0;
  // Upper bounds of q_len and kv_len over the sequences: they size grids only. Kernels loop
  // until each sequence's own lengths, so a bound that is too large costs idle blocks, never
  // results; a bound that is too small is a caller bug the host wrappers rule out.
  int64_t max_q_len = 0, max_kv_len = 0;
  // [num_seqs][kAttentionSeqFields] int64, in the kernel's memory space (device for GPU paths).
  const int64_t* seqs = nullptr;
  // The first of the kAttentionSeqStatusWords zero words right after seqs, 0 when a forward
  // starts: a path may record there that it must recompute (the sm80 forward: a non-finite
  // result, cuda/attention/sm80_fwd.cu). Null: none.
  int64_t* status = nullptr;
  // Q[s][h][i][d] = q[seqs[s].q_base + i * q_stride_token + h * q_stride_head + d]; out, dout
  // and dq use the same offsets and strides.
  const void* q = nullptr;
  int64_t q_stride_token = 0, q_stride_head = 0;
  // K[s][g][j][d] = k[seqs[s].kv_base + j * kv_stride_token + g * kv_stride_head + d]; v, dk, dv
  // the same.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t kv_stride_token = 0, kv_stride_head = 0;
  // Where the sm90 path's tensor maps may read (they address q and k by coordinates, not by
  // pointer): the elements from q (out, dout, dq) and from k (v, dk, dv) to the end of their dense
  // storage, and dim 0's stride (between batch rows; the token stride when packed; 0 for a single
  // row): every sequence's base offset is a multiple of it plus whole tokens.
  int64_t q_elements = 0, kv_elements = 0;
  int64_t q_stride_outer = 0, kv_stride_outer = 0;
  // Output in the input dtype; lse fp32: LSE[s][h][i] = lse[seqs[s].lse_base + h * lse_stride_head + i].
  void* out = nullptr;
  float* lse = nullptr;
  int64_t lse_stride_head = 0;
  float scale = 1.f;  // applied to q.k in fp32
  bool causal = true;
};


// Sequence s of a problem: its descriptor row.
struct AttentionSeq {
  int64_t q_base, kv_base, lse_base, q_len, kv_len;
  RL_ALIGN_HOST_DEVICE int64_t first_pos() const { return kv_len - q_len; }  // position of query 0
};

RL_ALIGN_HOST_DEVICE AttentionSeq attention_seq(const AttentionProblem& p, int64_t s) {
  const int64_t* f = p.seqs + s * kAttentionSeqFields;
  return {f[kSeqQBase], f[kSeqKvBase], f[kSeqLseBase], f[kSeqQLen], f[kSeqKvLen]};
}

// Backward: the forward's problem (its out and lse are inputs now) plus the gradients.
struct AttentionGradProblem {
  AttentionProblem fwd;  // fwd.out and fwd.lse: the saved forward output and log-sum-exp
  const void* dout = nullptr;  // same layout as q
  void* dq = nullptr;          // same layout as q, input dtype
  void* dk = nullptr;          // same layout as k, input dtype
  void* dv = nullptr;          // same layout as v, input dtype
  float* delta = nullptr;      // fp32 workspace, same layout as lse
};

}  // namespace rl_align
