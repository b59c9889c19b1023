// Hopper (sm_90a) attention forward: a TMA K/V ring feeding wgmma, one producer warpgroup and
// one or two consumer warpgroups of 64 GQA-packed query rows (row = query * G + head in group, as
// the sm80 kernels pack them). The producer's warp 0 issues the K/V loads; its warps 1..CONSUMERS
// gather each consumer's Q (any layout, cp.async into the swizzled layout) for the next tile while
// the consumer finishes the current one; in the prefill kernel its warp CONSUMERS + 1 claims the
// CTA's tiles from a counter (a persistent grid, longest tiles first) and resolves each for the
// other warps. S = Q K^T is a wgmma RS (Q in registers; SS where two CTAs share an SM); O += P V a
// wgmma RS (P from the S accumulators). The prefill kernel's output rows leave through shared
// memory (stmatrix), as whole 16-byte chunks; where its rows cross a KV split, each consumer warp
// keeps their merged state of the finished splits in that same area (SplitState).
//
// Arithmetic: the sm80 forward's, step for step (sm80_fwd.cu header; the block recurrence
// and the split merge are recurrence.cuh's functions, called on the wgmma accumulators,
// whose per-warp layout is the m16n8 accumulator layout): S chains the k16 chunks of d in
// increasing order from zero, O takes the 4 k16 key chunks of a block in increasing order after
// the acc * alpha rescale, acc starts at +0 and is never -0. wgmma rounds these products as
// mma.sync does, so the results are the sm80 path's bits (tests/test_attention.py compares the
// two paths bit for bit); the sm80 split-combine kernel merges this path's per-split partials.
//
// Masked keys: past kv_len, V rows of the sequence's last block are zeroed in shared memory before
// the consumers see them (TMA has loaded whatever follows the sequence); K past kv_len and keys
// past a row's causal position are selected out of S (in the blocks that have such keys: a warp's
// blocks without one run first, as a copy of the block loop without selects); a non-finite V of a key past a row's
// causal position (inside the sequence) still meets p = +0 in the P V product: the epilogue flags
// a non-finite result (status word) and the launch recomputes with the EXACT instantiation.
#include <atomic>
#include <type_traits>

#include "recurrence.cuh"
#include "sm90_common.h"

#if !RL_ALIGN_HIP
#if defined(__CUDA_ARCH__) && !defined(RL_ALIGN_SM90A_DEVICE)
// Device passes for other archs compile no kernel body: the constants only a body reads are unused.
#pragma nv_diag_suppress 177
#endif
namespace rl_align {
namespace {

constexpr int kKvBlock = static_cast<int>(kAttentionKvBlock);
constexpr int kSplitBlocks = static_cast<int>(kAttentionKvSplit / kAttentionKvBlock);
constexpr int kConsumerRows = 64;  // wgmma m64: rows per consumer warpgroup

// A tile of the order, resolved: its sequence, kv head, split, rows [row0, row0 + BLOCK_M) of the
// sequence's q_len * G, and its blocks [b_begin, b_end) (of the CTA's last row's [0, num_blocks);
// one split's).
struct alignas(16) FwdTile {
  AttentionSeq sq;
  int kv_head, split, kv_len, rows, first_pos, row0, b_begin, b_end;
};
constexpr int kFwdTileWords = static_cast<int>(sizeof(FwdTile) / 8);  // a scheduler slot's
static_assert(sizeof(FwdTile) % 8 == 0, "a slot is whole 8-byte words");

// CONSUMERS warpgroups of 64 rows (BLOCK_M rows per CTA) and a producer warpgroup; STAGES K/V
// blocks in the TMA ring; PINGPONG: the two consumers take turns issuing their wgmmas, so that one
// runs its softmax while the other's matrix products run.
// MIN_BLOCKS CTAs per SM; the register file (64K) is then split by setmaxnreg: the producer keeps
// PRODUCER_REGS, each consumer thread gets CONSUMER_REGS. Q_IN_REGISTERS (one CTA per SM): a
// consumer holds its Q as wgmma A fragments (S = Q K^T reads only K from shared memory); with two
// CTAs per SM the registers do not suffice and S reads Q from shared memory.
template <int HEAD_DIM_, int CONSUMERS_, int STAGES_, bool PINGPONG_, int MIN_BLOCKS_ = 1>
struct Sm90FwdConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int CONSUMERS = CONSUMERS_;
  static constexpr int STAGES = STAGES_;
  static constexpr bool PINGPONG = PINGPONG_ && CONSUMERS_ == 2;
  static constexpr int MIN_BLOCKS = MIN_BLOCKS_;
  static constexpr bool Q_IN_REGISTERS = MIN_BLOCKS_ == 1;
  static constexpr int PRODUCER_REGS = 56;
  // 65536 / MIN_BLOCKS registers per CTA, less the producer's, over the consumer threads (a
  // multiple of 8).
  static constexpr int CONSUMER_REGS =
      ((65536 / MIN_BLOCKS_ - 128 * PRODUCER_REGS) / (CONSUMERS_ * 128)) / 8 * 8 > 240
          ? 240
          : ((65536 / MIN_BLOCKS_ - 128 * PRODUCER_REGS) / (CONSUMERS_ * 128)) / 8 * 8;
  static constexpr int BLOCK_M = CONSUMERS * kConsumerRows;
  static constexpr int THREADS = (CONSUMERS + 1) * 128;
  static constexpr int D_BOXES = HEAD_DIM / kBoxElems;  // 128-byte swizzle boxes across d
  static constexpr int D_STEPS = HEAD_DIM / 16;         // k16 chunks of q . k
  static constexpr int KEY_STEPS = kKvBlock / 16;       // k16 chunks of P V
  static constexpr int Q_BYTES = CONSUMERS * D_BOXES * kBoxBytes;
  // STAGED_OUT (one CTA per SM: two would not fit; the fast kernel, not its EXACT relaunch): each
  // consumer warp's 16 output rows pass through O_WARP_BYTES of shared memory (fwd_epilogue).
  static constexpr bool STAGED_OUT = MIN_BLOCKS_ == 1;
  static constexpr int O_WARP_BYTES = 16 * HEAD_DIM * 2;
  // With STAGED_OUT, a MERGE launch's fast kernel keeps each consumer warp's merged split state
  // (SplitState: 16 rows of fp32 acc, then their (m, l)) in SPLIT_WARP_BYTES of shared memory,
  // which its staged epilogue then reuses as o_stage. (Both keep the ring 1024-byte aligned.)
  static constexpr int SPLIT_WARP_BYTES = 16 * HEAD_DIM * 4 + 16 * 8;
  static constexpr int O_BYTES = STAGED_OUT ? CONSUMERS * (kWarpgroupThreads / 32) * O_WARP_BYTES : 0;
  static_assert(!STAGED_OUT || (CONSUMERS * (kWarpgroupThreads / 32) * SPLIT_WARP_BYTES % 1024 == 0 && O_BYTES % 1024 == 0),
                "the ring's alignment");
  static constexpr int KV_TILE_BYTES = D_BOXES * kBoxBytes;
  static constexpr int STAGE_BYTES = 2 * KV_TILE_BYTES;  // K then V
  // DYNAMIC_TILES (the prefill kernel, not its EXACT relaunch): a persistent grid whose CTAs claim
  // tiles from a counter as they go (sm90_fwd_kernel's scheduler), published to the other warps
  // through SCHED_SLOTS slots of shared memory, one tile ahead of the consumers.
  static constexpr bool DYNAMIC_TILES = PINGPONG;
  static constexpr int SCHED_SLOTS = DYNAMIC_TILES ? 2 : 0;
  // The scheduler is the producer warpgroup's warp CONSUMERS + 1; each slot is freed by the K/V
  // producer, the Q loaders and every consumer warp (lane 0 of each).
  static constexpr int SCHED_READERS = 1 + CONSUMERS + CONSUMERS * (kWarpgroupThreads / 32);
  // 8-byte words after the ring: the scheduler slots' tiles (FwdTile); k_full, v_full, kv_empty
  // per stage, v_tail; q_full, q_empty per consumer; sched_full, sched_empty per scheduler slot.
  static constexpr int BARRIERS = 3 * STAGES + 1 + 2 * CONSUMERS + 2 * SCHED_SLOTS + SCHED_SLOTS * kFwdTileWords;
  // Slack to align the tiles to 1024 bytes; none where two CTAs must fit an SM (228 KB less 1 KB
  // reserved per CTA): the kernel then traps if the dynamic shared memory is not so aligned.
  static constexpr int ALIGN_SLACK = MIN_BLOCKS_ > 1 ? 0 : 1024;
  static constexpr int SMEM_BYTES = ALIGN_SLACK + Q_BYTES + O_BYTES + STAGES * STAGE_BYTES + BARRIERS * 8;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim");
  static_assert(CONSUMERS == 1 || CONSUMERS == 2, "consumer warpgroups");
  static_assert(BARRIERS * 8 <= 1024, "the barriers fit before the EXACT scratch");
  static_assert(MIN_BLOCKS * (SMEM_BYTES + 1024) <= 228 * 1024, "shared memory of MIN_BLOCKS CTAs");
};

// How a launch covers the KV splits (attention_problem.h); the bits are the same for all.
enum class SplitMode : int {
  kNone = 0,      // every row's keys lie in one split
  kMerge = 1,     // a CTA runs its rows over every split, folding finished splits into the workspace
  kPerSplit = 2,  // a CTA runs one split (grid y = kv head + heads_kv * split); partials of rows with
                  // several splits go to the workspace, the combine kernel merges them
};

enum class TileStep : int { kDone, kEmpty, kWork };

// Named barriers: 1 + c: consumer c's own 128 threads; 3 + c: ping-pong turn of consumer c.
constexpr int kConsumerBar = 1, kTurnBar = 3;

// Whether a launch's consumer warps keep their merged split state in shared memory (SplitState),
// the bytes per consumer warp between Q and the ring (that state, or o_stage alone), and in all.
template <typename Cfg, SplitMode MODE, bool EXACT>
constexpr bool split_state_in_smem() {
  return Cfg::STAGED_OUT && MODE == SplitMode::kMerge && !EXACT;
}
template <typename Cfg, SplitMode MODE, bool EXACT>
constexpr int stage_area_warp_bytes() {
  return split_state_in_smem<Cfg, MODE, EXACT>() ? Cfg::SPLIT_WARP_BYTES : Cfg::O_WARP_BYTES;
}
template <typename Cfg, SplitMode MODE, bool EXACT>
constexpr int stage_area_bytes() {
  return Cfg::STAGED_OUT ? Cfg::CONSUMERS * (kWarpgroupThreads / 32) * stage_area_warp_bytes<Cfg, MODE, EXACT>() : 0;
}

// EXACT: the recompute launch (the fast kernel flagged a non-finite result): every block runs S,
// the recurrence and P V in sequence, and P V of a block holding keys masked for some row runs by
// cuts: per k16 key chunk and per count u of a row's allowed keys in it, the product with the
// chunk's values of keys >= u replaced by +0 (a copy in shared memory), each row keeping the result
// of its own count (rows with none keep their acc). A row's masked keys then meet +0 where the fast
// kernel met finite values (+-0 products), so the bits are the fast kernel's wherever those values
// are finite (sm80_fwd.cu's EXACT kernel does the same with mma.sync).
// The launch's dynamic shared memory; EXACT adds the scratch 1024 bytes past the ring's end (the
// barriers sit in between).
template <typename Cfg, SplitMode MODE, bool EXACT>
constexpr int sm90_fwd_smem_bytes() {
  constexpr int bytes = Cfg::SMEM_BYTES - Cfg::O_BYTES + stage_area_bytes<Cfg, MODE, EXACT>() +
                        (EXACT ? 1024 - Cfg::BARRIERS * 8 + Cfg::CONSUMERS * Cfg::D_BOXES * kCutBoxBytes : 0);
  // (The EXACT relaunch need not fit MIN_BLOCKS CTAs per SM: it mostly finds nothing to do.)
  static_assert((EXACT ? 1 : Cfg::MIN_BLOCKS) * (bytes + 1024) <= 228 * 1024, "shared memory of MIN_BLOCKS CTAs");
  return bytes;
}

#ifdef RL_ALIGN_SM90A_DEVICE
// A Q loader warp's copy of one consumer's kConsumerRows rows c_row0.. of a (sequence, kv head)'s
// q_len * G rows (row = query row / G, head kv_head * G + row % G) into its smem at c_q_addr, in
// the layout a 128-byte-swizzle TMA box has: cp.async (no registers hold the data; rows at or past
// `rows` zero-filled), then visible to the async proxy (wgmma) before the caller's arrive.
template <typename T, int D>
__device__ __forceinline__ void load_q_rows(uint32_t c_q_addr, const T* q, const AttentionProblem& p, int64_t q_base,
                                            int kv_head, int c_row0, int rows, int group, int lane) {
  constexpr int CHUNKS = D / 8;            // 16-byte chunks per row
  constexpr int ROW_STEP = 32 / CHUNKS;    // rows one pass of the warp covers
  const int ch = lane % CHUNKS;
  PackedRowWalker walker(q_base + ch * 8, c_row0 + lane / CHUNKS, kv_head, group, p.q_stride_token, p.q_stride_head);
#pragma unroll 4
  for (int r = lane / CHUNKS; r < kConsumerRows; r += ROW_STEP) {
    const bool in_range = c_row0 + r < rows;
    cp_async_16_zfill(c_q_addr + swizzled_chunk_offset(r, ch / 8, ch % 8), in_range ? q + walker.at : q,
                      in_range ? 16 : 0);
    walker.step(ROW_STEP);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
}

// The forward's K/V ring producer (warp 0 of the producer warpgroup): a stage holds a key block's
// K tile and, KV_TILE_BYTES after it, its V tile, published apart (k_full, v_full) so that a
// consumer's S = Q K^T starts before V lands. load(): once the consumers released the next stage,
// the block of keys key0.. (map coordinates from the sequence's key 0 at kv_c1, kv_c2) lands in
// it; a block running past kv_len lands V on v_tail, and its values past kv_len (whatever follows
// the sequence in memory) become +0 before any consumer multiplies them by p = +0 (a NaN there
// reaches no row), then v_full publishes it.
template <typename Cfg>
struct KvRingProducer {
  uint8_t* ring;
  uint64_t *k_full, *v_full, *kv_empty, *v_tail;
  int stage = 0;
  uint32_t phase = 0, tail_phase = 0;
  __device__ __forceinline__ void load(const CUtensorMap* k_map, const CUtensorMap* v_map, const OperandMap& kv_at,
                                       int kv_c1, int kv_c2, int key0, int kv_len, int lane) {
    mbar_wait(&kv_empty[stage], phase ^ 1);
    const bool tail = key0 + kKvBlock > kv_len;
    uint8_t* k_tile = ring + stage * Cfg::STAGE_BYTES;
    uint8_t* v_tile = k_tile + Cfg::KV_TILE_BYTES;
    if (lane == 0) {
      int c1, c2;
      kv_at.step(kv_c1, kv_c2, 0, key0, c1, c2);
      mbar_arrive_expect_tx(&k_full[stage], Cfg::KV_TILE_BYTES);
      for (int c = 0; c < Cfg::D_BOXES; ++c)
        tma_load_3d(k_tile + c * kBoxBytes, k_map, &k_full[stage], c * kBoxElems, c1, c2);
      uint64_t* v_bar = tail ? v_tail : &v_full[stage];
      mbar_arrive_expect_tx(v_bar, Cfg::KV_TILE_BYTES);
      for (int c = 0; c < Cfg::D_BOXES; ++c)
        tma_load_3d(v_tile + c * kBoxBytes, v_map, v_bar, c * kBoxElems, c1, c2);
    }
    if (tail) {
      mbar_wait(v_tail, tail_phase);
      tail_phase ^= 1;
      const int first_zero = kv_len - key0;  // 1 .. 63
      const int chunks = (kKvBlock - first_zero) * 8 * Cfg::D_BOXES;
      for (int i = lane; i < chunks; i += 32) {
        const int box = i / ((kKvBlock - first_zero) * 8), r = i % ((kKvBlock - first_zero) * 8);
        *reinterpret_cast<uint4*>(v_tile + box * kBoxBytes + (first_zero + r / 8) * 128 + (r % 8) * 16) =
            make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();
      __syncwarp();
      if (lane == 0) mbar_arrive(&v_full[stage]);
    }
    if (++stage == Cfg::STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// MERGE: the merged state (m, l, acc) of a consumer warp's rows over their finished splits, which
// fold_split builds and the epilogue merges the last split into; a row's m and l are written by
// its lane t = 0, its acc columns by each of its 4 lanes. IN_SMEM (split_state_in_smem): in the
// warp's area of shared memory (16 rows of D floats, then the rows' (m, l)), so that no fold or
// epilogue waits for L2; else in the workspace (w.acc, w.ml) at the row's LSE index ws_row.
template <int D, bool IN_SMEM>
struct SplitState {
  float* acc;  // IN_SMEM: the warp's area; else w.acc
  float* ml;   // IN_SMEM: the area's (m, l) pairs; else w.ml
  int g, t;    // the thread's rows 8 hh + g, columns 8 dn + 2 t, + 1
  __device__ __forceinline__ float* ml_at(int hh, int64_t ws_row) const {
    return ml + 2 * (IN_SMEM ? 8 * hh + g : ws_row);
  }
  // Columns 8 dn + 2 t, + 1 of row hh. IN_SMEM: row r's 8-column groups permuted by r % 4, so that
  // the warp's float2 accesses of one dn fall on every bank (two wavefronts, not eight).
  __device__ __forceinline__ float* at(int hh, int64_t ws_row, int dn) const {
    if constexpr (IN_SMEM) {
      const int r = 8 * hh + g;
      return acc + r * D + (dn ^ (r % 4)) * 8 + 2 * t;
    } else {
      return acc + ws_row * D + dn * 8 + 2 * t;
    }
  }
};

// Row hh of the thread's accumulators merged in place with the state's earlier splits. The partial
// is read whole before the first merge: loads in the merge loop waited for L2 one by one (ncu at
// 1 x 16384: the fold took 13% of the consumers' samples, the partner consumer waiting at its turn
// meanwhile).
template <int D, bool IN_SMEM>
__device__ __forceinline__ void merge_earlier_partial(float (&acc)[1][D / 8][4], int hh, int64_t ws_row,
                                                      const SplitState<D, IN_SMEM>& state, SplitMergeWeights wt) {
  float2 prev[D / 8];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) prev[dn] = *reinterpret_cast<const float2*>(state.at(hh, ws_row, dn));
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    acc[0][dn][2 * hh] = merge_elem(prev[dn].x, acc[0][dn][2 * hh], wt);
    acc[0][dn][2 * hh + 1] = merge_elem(prev[dn].y, acc[0][dn][2 * hh + 1], wt);
  }
}

// MERGE: at the first block b of split c >= 1, a consumer warp's rows warp_row0.. (those < rows)
// that reach it fold the finished partial of split c - 1 into their merged state (the first is
// stored as it is) and restart from a fresh state; rows that end earlier keep theirs (sm80_fwd.cu's
// fold).
template <int D, bool IN_SMEM>
__device__ __forceinline__ void fold_split(int b, float (&acc)[1][D / 8][4], float (&row_max)[1][2],
                                           float (&row_sum)[1][2], const int (&row_last_key)[1][2],
                                           const SplitState<D, IN_SMEM>& state, const AttentionProblem& p,
                                           const AttentionSeq& sq, int kv_head, int rows, int group, int warp_row0,
                                           int lane) {
  const int g = lane / 4, t = lane % 4;
  const int key0 = b * kKvBlock;
  const bool first = b == kSplitBlocks;
  bool reach[2];
  int64_t ws_row[2];
  float ws_m[2], ws_l[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = warp_row0 + 8 * hh + g;
    reach[hh] = row < rows && row_last_key[0][hh] >= key0;
    ws_row[hh] = sq.lse_base + (static_cast<int64_t>(kv_head) * group + row % group) * p.lse_stride_head + row / group;
    ws_m[hh] = reach[hh] && !first ? state.ml_at(hh, ws_row[hh])[0] : 0.f;
    ws_l[hh] = reach[hh] && !first ? state.ml_at(hh, ws_row[hh])[1] : 0.f;
  }
  __syncwarp();  // the row's 4 lanes read its state before lane t = 0 rewrites it
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (!reach[hh]) continue;
    float m = row_max[0][hh], l = row_sum[0][hh];
    SplitMergeWeights wt{1.f, 1.f};
    if (!first) {
      m = ws_m[hh];
      l = ws_l[hh];
      wt = merge_split(m, l, row_max[0][hh], row_sum[0][hh]);
    }
    if (t == 0) {
      state.ml_at(hh, ws_row[hh])[0] = m;
      state.ml_at(hh, ws_row[hh])[1] = l;
    }
    if (!first) merge_earlier_partial<D>(acc, hh, ws_row[hh], state, wt);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<float2*>(state.at(hh, ws_row[hh], dn)) =
          make_float2(acc[0][dn][2 * hh], acc[0][dn][2 * hh + 1]);
      acc[0][dn][2 * hh] = 0.f;
      acc[0][dn][2 * hh + 1] = 0.f;
    }
    row_max[0][hh] = -INFINITY;
    row_sum[0][hh] = 0.f;
  }
  __syncwarp();  // lane t = 0's (m, l) before the other lanes' next read of them
}

// EXACT: acc += P V of the key block key0.. whose V tile is at v_tile, by cuts
// (rs_product_by_cuts, scratch and named barrier `bar` the consumer's own); a row's allowed keys
// end at row_last_key.
template <typename T, int D>
__device__ __forceinline__ void pv_by_cuts(float (&acc_flat)[D / 2], const uint32_t (&pa)[kKvBlock / 16][4],
                                           const int (&row_last_key)[1][2], const uint8_t* v_tile, uint8_t* scratch,
                                           int key0, int tid, int bar) {
#pragma unroll 1
  for (int kc = 0; kc < kKvBlock / 16; ++kc) {
    int count[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int c = row_last_key[0][hh] - (key0 + 16 * kc) + 1;
      count[hh] = c < 0 ? 0 : c > 16 ? 16 : c;
    }
    uint32_t a[4] = {pa[0][0], pa[0][1], pa[0][2], pa[0][3]};  // pa[kc] (a runtime index: local memory)
#pragma unroll
    for (int c = 1; c < kKvBlock / 16; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = c == kc ? pa[c][r] : a[r];
    }
    rs_product_by_cuts<T, D, true>(acc_flat, a, v_tile + 16 * kc * 128, kBoxBytes, scratch, count, tid, bar);
  }
}

// The epilogue of a consumer warp's 16 rows warp_row0.. (rows < q_len * G of the tile's sequence
// and kv head): out = acc * (1 / l) rounded once, lse by lane t = 0; a row past its first split
// merges its last partial into the earlier ones' state (MERGE: in acc) or, PER_SPLIT with several
// splits, leaves this split's partial for the combine kernel. A non-finite result sets the status
// word.
// STAGED: the rounded rows go through the warp's o_stage (16 rows, 128-byte-swizzled boxes of 64
// columns, stmatrix) and leave as whole 16-byte chunks, a row's 256 bytes per half warp, rather
// than as 4-byte words per thread. o_stage overlays the warp's SplitState area where that is in
// shared memory.
template <typename T, int D, SplitMode MODE, bool EXACT, bool STAGED, bool IN_SMEM>
__device__ __forceinline__ void fwd_epilogue(float (&acc)[1][D / 8][4], const float (&row_max)[1][2],
                                             const float (&row_sum)[1][2], const int (&row_last_key)[1][2],
                                             const SplitState<D, IN_SMEM>& state, T* out, const AttentionProblem& p,
                                             const AttentionFwdWorkspace& w, const AttentionSeq& sq, int kv_head,
                                             int split, int rows, int group, int warp_row0, uint8_t* o_stage,
                                             int lane) {
  constexpr bool MERGE = MODE == SplitMode::kMerge, PER_SPLIT = MODE == SplitMode::kPerSplit;
  static_assert(!(STAGED && PER_SPLIT), "a staged epilogue writes whole rows of out");
  static_assert(!IN_SMEM || (STAGED && MERGE), "the state's area is o_stage's");
  const int g = lane / 4, t = lane % 4;
  bool nonfinite = false;
  // Per row of the thread: whether out takes it here, and how (merged with earlier splits, 1 / l).
  bool write[2] = {false, false}, merged[2] = {false, false};
  SplitMergeWeights wt[2] = {{1.f, 1.f}, {1.f, 1.f}};
  float inv_l[2] = {0.f, 0.f};
  int64_t out_at[2] = {0, 0}, lse_row[2] = {0, 0};
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int row = warp_row0 + 8 * hh + g;
    if (row >= rows) continue;
    const int64_t i = row / group, h = static_cast<int64_t>(kv_head) * group + row % group;
    const int64_t lse_at = sq.lse_base + h * p.lse_stride_head + i;
    float m = row_max[0][hh], l = row_sum[0][hh];
    if constexpr (PER_SPLIT) {
      // A row with several splits leaves this split's partial for the combine kernel.
      const int row_splits = row_last_key[0][hh] / static_cast<int>(kAttentionKvSplit) + 1;
      if (split >= row_splits) continue;
      if (row_splits > 1) {
        const int64_t slot = lse_at * w.slots + split;
        if (t == 0) *reinterpret_cast<float2*>(w.ml + 2 * slot) = make_float2(m, l);
        float* wa = w.acc + slot * D + 2 * t;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const float2 a = make_float2(acc[0][dn][2 * hh], acc[0][dn][2 * hh + 1]);
          nonfinite |= either_nonfinite(a.x, a.y);
          *reinterpret_cast<float2*>(wa + dn * 8) = a;
        }
        continue;
      }
    }
    merged[hh] = MERGE && row_last_key[0][hh] >= static_cast<int>(kAttentionKvSplit);
    if (merged[hh]) {
      m = state.ml_at(hh, lse_at)[0];
      l = state.ml_at(hh, lse_at)[1];
      wt[hh] = merge_split(m, l, row_max[0][hh], row_sum[0][hh]);
    }
    inv_l[hh] = reciprocal(l);
    out_at[hh] = sq.q_base + i * p.q_stride_token + h * p.q_stride_head + 2 * t;
    lse_row[hh] = lse_at;
    write[hh] = true;
    if (t == 0) p.lse[lse_at] = final_lse(m, l);
  }
  if constexpr (MERGE) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (merged[hh]) merge_earlier_partial<D>(acc, hh, lse_row[hh], state, wt[hh]);
    }
    if constexpr (IN_SMEM) __syncwarp();  // every lane's reads of the area before o_stage's writes
  }
  // Columns 8 dn + 2 t, + 1 of row hh, rounded.
  auto rounded_pair = [&](int dn, int hh) -> uint32_t {
    const float a0 = acc[0][dn][2 * hh], a1 = acc[0][dn][2 * hh + 1];
    nonfinite |= write[hh] & either_nonfinite(a0, a1);
    return pack_rounded<T>(__fmul_rn(a0, inv_l[hh]), __fmul_rn(a1, inv_l[hh]));
  };
  if constexpr (STAGED) {
    constexpr int CHUNKS = D / 8, ROW_STEP = 32 / CHUNKS;  // 16-byte chunks per row; rows per pass
    constexpr int STAGE_BOX_BYTES = 16 * kSwizzleRowBytes;  // 16 rows x 64 columns
    auto staged_at = [&](int r, int ch) {
      return (ch / 8) * STAGE_BOX_BYTES + r * kSwizzleRowBytes + ((ch % 8) ^ (r % 8)) * 16;
    };
    const int m = lane / 8;  // the matrix whose row lane % 8 this lane addresses: (row half, chunk)
#pragma unroll
    for (int dn = 0; dn < D / 8; dn += 2) {
      const uint32_t r[4] = {rounded_pair(dn, 0), rounded_pair(dn, 1), rounded_pair(dn + 1, 0),
                             rounded_pair(dn + 1, 1)};
      stmatrix_x4(smem_addr(o_stage) + staged_at(8 * (m % 2) + lane % 8, dn + m / 2), r);
    }
    __syncwarp();
    // Without PER_SPLIT every row below `rows` is written here.
    const int ch = lane % CHUNKS, r0 = lane / CHUNKS;
    PackedRowWalker row(sq.q_base + ch * 8, warp_row0 + r0, kv_head, group, p.q_stride_token, p.q_stride_head);
#pragma unroll
    for (int j = 0; j < 16 / ROW_STEP; ++j) {
      const int r = r0 + j * ROW_STEP;
      const uint4 v = *reinterpret_cast<const uint4*>(o_stage + staged_at(r, ch));
      if (warp_row0 + r < rows) *reinterpret_cast<uint4*>(out + row.at) = v;
      row.step(ROW_STEP);
    }
    __syncwarp();  // every lane's reads done before the next tile's stmatrix
  } else {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (!write[hh]) continue;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) *reinterpret_cast<uint32_t*>(out + out_at[hh] + dn * 8) = rounded_pair(dn, hh);
    }
  }
  if (!EXACT && w.masked_nonfinite != nullptr && __any_sync(0xffffffffu, nonfinite) && lane == 0) {
    *w.masked_nonfinite = 1;
  }
}
#endif  // RL_ALIGN_SM90A_DEVICE

template <typename T, typename Cfg, bool SCALE_NONNEG, SplitMode MODE, bool EXACT>
__global__ void __launch_bounds__(Cfg::THREADS, Cfg::MIN_BLOCKS)
    attention_fwd_sm90_kernel(const __grid_constant__ CUtensorMap k_map, const __grid_constant__ CUtensorMap v_map,
                              const OperandMap kv_at, const AttentionProblem p, const AttentionFwdWorkspace w, const TileOrder order,
                              int group, float scale_log2) {
#ifdef RL_ALIGN_SM90A_DEVICE
  constexpr int D = Cfg::HEAD_DIM, STAGES = Cfg::STAGES, BLOCK_M = Cfg::BLOCK_M;
  constexpr bool MERGE = MODE == SplitMode::kMerge, PER_SPLIT = MODE == SplitMode::kPerSplit;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  if (EXACT && *w.masked_nonfinite == 0) return;  // the fast kernel's results stand
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows from such an address.
  if (Cfg::ALIGN_SLACK == 0 && smem_addr(smem_raw) % 1024 != 0) __trap();
  uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  uint8_t* q_smem = smem;
  uint8_t* o_stage = smem + Cfg::Q_BYTES;
  constexpr bool SPLIT_IN_SMEM = split_state_in_smem<Cfg, MODE, EXACT>();
  constexpr int STAGE_WARP_BYTES = stage_area_warp_bytes<Cfg, MODE, EXACT>();
  uint8_t* ring = o_stage + stage_area_bytes<Cfg, MODE, EXACT>();
  FwdTile* sched_tile = reinterpret_cast<FwdTile*>(ring + STAGES * Cfg::STAGE_BYTES);
  uint64_t* k_full = reinterpret_cast<uint64_t*>(sched_tile + Cfg::SCHED_SLOTS);
  uint64_t* v_full = k_full + STAGES;
  uint64_t* kv_empty = v_full + STAGES;
  uint64_t* v_tail = kv_empty + STAGES;
  uint64_t* q_full = v_tail + 1;
  uint64_t* q_empty = q_full + Cfg::CONSUMERS;
  uint64_t* sched_full = q_empty + Cfg::CONSUMERS;
  uint64_t* sched_empty = sched_full + Cfg::SCHED_SLOTS;
  // EXACT: a 1024-aligned scratch of D_BOXES x 16 value rows per consumer, after the barriers.
  uint8_t* cut_scratch = ring + STAGES * Cfg::STAGE_BYTES + 1024;
  auto k_stage = [&](int s) { return ring + s * Cfg::STAGE_BYTES; };
  auto v_stage = [&](int s) { return ring + s * Cfg::STAGE_BYTES + Cfg::KV_TILE_BYTES; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&kv_empty[s], Cfg::CONSUMERS * kStageReleaseArrivals<EXACT>);
    }
    mbar_init(v_tail, 1);
    for (int c = 0; c < Cfg::CONSUMERS; ++c) {
      mbar_init(&q_full[c], 32);
      mbar_init(&q_empty[c], kWarpgroupThreads);
    }
    for (int s = 0; s < Cfg::SCHED_SLOTS; ++s) {
      mbar_init(&sched_full[s], 1);
      mbar_init(&sched_empty[s], Cfg::SCHED_READERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Broadcast from lane 0: the compiler then knows these values are warp-uniform, and the wgmma
  // code they guard is not a divergent path (which would serialize the wgmma pipeline, C7520).
  auto uniform = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
  const int warpgroup = uniform(static_cast<int>(threadIdx.x) / kWarpgroupThreads);
  // What tile `tile` of the order holds (FwdTile), the same for every role. Empty: no row, or no
  // row reaching the split.
  auto resolve = [&](const TileRef& tile, FwdTile& job) -> bool {
    const int visit = uniform(tile.visit), y = uniform(tile.y);
    job.kv_head = PER_SPLIT ? y % static_cast<int>(p.heads_kv) : y;
    job.split = PER_SPLIT ? y / static_cast<int>(p.heads_kv) : 0;
    job.sq = attention_seq(p, tile.seq);
    const int q_len = uniform(static_cast<int>(job.sq.q_len));
    job.kv_len = uniform(static_cast<int>(job.sq.kv_len));
    job.rows = q_len * group;
    const int tiles = (job.rows + BLOCK_M - 1) / BLOCK_M;
    if (visit >= tiles) return false;  // also q_len = 0
    job.first_pos = job.kv_len - q_len;
    job.row0 = (tiles - 1 - visit) * BLOCK_M;
    const int last_pos = job.first_pos + ((job.row0 + BLOCK_M < job.rows ? job.row0 + BLOCK_M : job.rows) - 1) / group;
    const int num_blocks = p.causal ? last_pos / kKvBlock + 1 : (job.kv_len + kKvBlock - 1) / kKvBlock;
    job.b_begin = job.split * kSplitBlocks;
    job.b_end = PER_SPLIT && job.b_begin + kSplitBlocks < num_blocks ? job.b_begin + kSplitBlocks : num_blocks;
    return job.b_begin < job.b_end;
  };

  // The CTA's n-th tile into `job`, the same for every role. DYNAMIC: the scheduler's, resolved
  // (read from its slot, which the warp's lane 0 then frees): the order's 64-bit divisions and the
  // sequence descriptor's load run once per tile, a tile ahead, not in every warp between two
  // tiles, and the scheduler skips empty tiles. Else every gridDim.x-th from blockIdx.x.
  constexpr bool DYNAMIC = Cfg::DYNAMIC_TILES && !EXACT;
  auto next_tile = [&](int n, FwdTile& job) -> TileStep {
    if constexpr (DYNAMIC) {
      const int slot = n % Cfg::SCHED_SLOTS;
      mbar_wait(&sched_full[slot], (n / Cfg::SCHED_SLOTS) & 1);
      // Lane 0 reads the slot and frees it after its own read (the order racecheck follows); the
      // warp takes the tile from lane 0 by shuffles.
      uint64_t words[kFwdTileWords] = {};
      if (threadIdx.x % 32 == 0) {
        const uint64_t* slot_words = reinterpret_cast<const uint64_t*>(&sched_tile[slot]);
#pragma unroll
        for (int i = 0; i < kFwdTileWords; ++i) words[i] = slot_words[i];
        mbar_arrive(&sched_empty[slot]);
      }
#pragma unroll
      for (int i = 0; i < kFwdTileWords; ++i) words[i] = __shfl_sync(0xffffffffu, words[i], 0);
      memcpy(&job, words, sizeof(job));
      return job.b_end < 0 ? TileStep::kDone : TileStep::kWork;
    } else {
      const TileRef tile = order.at(blockIdx.x + static_cast<int64_t>(n) * gridDim.x);
      if (tile.seq < 0) return TileStep::kDone;
      return resolve(tile, job) ? TileStep::kWork : TileStep::kEmpty;
    }
  };

  if (warpgroup == 0) {
    // ------------------------------------------------------------------------ producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Cfg::PRODUCER_REGS));
    const int producer_warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
    FwdTile job{};
    if constexpr (DYNAMIC) {
      if (producer_warp == Cfg::CONSUMERS + 1) {
        // ------------------------------------------------------------------------------ scheduler
        // Publishes blockIdx.x, then claims the CTA's next tile (the counter counts claims past the
        // first wave) once the consumers have begun the tile before it: one tile ahead, so the Q
        // loaders fetch the next tile's Q while this one runs, and the order stays longest first
        // across CTAs. Every CTA stops at its first claim past the end, so the launch makes exactly
        // order.total claims: the last one zeroes the counter for the next launch. Empty tiles are
        // claimed past, unpublished. The warp's lanes resolve together (resolve's broadcasts).
        auto claim = [&]() -> int64_t {
          unsigned long long c = 0;
          if (lane == 0) {
            c = atomicAdd(w.tile_counter, 1ull);
            if (c == static_cast<unsigned long long>(order.total - 1)) atomicExch(w.tile_counter, 0ull);
          }
          return gridDim.x + static_cast<int64_t>(__shfl_sync(0xffffffffu, c, 0));
        };
        int64_t tile = blockIdx.x;
        for (int n = 0;; ++n) {
          const int slot = n % Cfg::SCHED_SLOTS;
          if (n > 0) {
            mbar_wait(&sched_empty[slot], ((n / Cfg::SCHED_SLOTS) & 1) ^ 1);
            tile = claim();
          }
          TileRef ref = order.at(tile);
          while (ref.seq >= 0 && !resolve(ref, job)) ref = order.at(claim());
          if (ref.seq < 0) job.b_end = -1;  // done
          if (lane == 0) {
            sched_tile[slot] = job;
            mbar_arrive(&sched_full[slot]);
          }
          if (ref.seq < 0) return;
        }
      }
    }
    if (producer_warp >= 1 && producer_warp <= Cfg::CONSUMERS) {
      // ---------------------------------------------------------- Q loader of consumer (warp - 1)
      // Q of consumer c's 64 rows (load_q_rows) for the next tile while the consumer finishes
      // this one (its last P V, its epilogue).
      const int c = producer_warp - 1;
      uint8_t* c_q = q_smem + c * Cfg::D_BOXES * kBoxBytes;
      const T* q = static_cast<const T*>(p.q);
      const uint32_t c_q_addr = smem_addr(c_q);
      uint32_t q_phase = 0;
      for (int n = 0;; ++n) {
        const TileStep step = next_tile(n, job);
        if (step == TileStep::kDone) return;
        if (step == TileStep::kEmpty || job.row0 + c * kConsumerRows >= job.rows) continue;
        const int c_row0 = job.row0 + c * kConsumerRows;
        mbar_wait(&q_empty[c], q_phase ^ 1);
        load_q_rows<T, D>(c_q_addr, q, p, job.sq.q_base, job.kv_head, c_row0, job.rows, group, lane);
        // Each lane arrives after its own copies landed (the order racecheck follows, as q_empty).
        mbar_arrive(&q_full[c]);
        q_phase ^= 1;
      }
    }
    if (producer_warp != 0) return;
    // ------------------------------------------------------------------- K/V producer (warp 0)
    KvRingProducer<Cfg> kv_ring{ring, k_full, v_full, kv_empty, v_tail};
    for (int n = 0;; ++n) {
      const TileStep step = next_tile(n, job);
      if (step == TileStep::kDone) return;
      if (step == TileStep::kEmpty) continue;
      int kv_c1, kv_c2;  // the map coordinates of the sequence's key 0 of this kv head
      kv_at.coords(job.sq.kv_base, job.kv_head, 0, kv_c1, kv_c2);
      for (int b = job.b_begin; b < job.b_end; ++b) {
        kv_ring.load(&k_map, &v_map, kv_at, kv_c1, kv_c2, b * kKvBlock, job.kv_len, lane);
      }
    }
  }

  // ------------------------------------------------------------------ consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Cfg::CONSUMER_REGS));
  const int consumer = warpgroup - 1;
  const int tid = static_cast<int>(threadIdx.x) % kWarpgroupThreads;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  T* __restrict__ out = static_cast<T*>(p.out);
  uint8_t* my_q = q_smem + consumer * Cfg::D_BOXES * kBoxBytes;
  const uint32_t my_q_addr = smem_addr(my_q);
  // Descriptors: Q and K K-major (128-byte rows of d), V MN-major (128-byte rows of d per key); a
  // stage's are offsets from stage 0's (smem_desc_at).
  const uint64_t q_desc = box_desc(my_q_addr), k_desc = box_desc(smem_addr(k_stage(0))),
                 v_desc = box_desc(smem_addr(v_stage(0)));
  auto turn_sync = [&]() {
    if constexpr (Cfg::PINGPONG && !EXACT) named_bar_sync(kTurnBar + consumer, 2 * kWarpgroupThreads);
  };
  auto turn_pass = [&]() {
    if constexpr (Cfg::PINGPONG && !EXACT) named_bar_arrive(kTurnBar + (consumer ^ 1), 2 * kWarpgroupThreads);
  };
  if (Cfg::PINGPONG && !EXACT && consumer == 1) turn_pass();  // consumer 0 issues first

  int stage = 0;
  uint32_t phase = 0;
  auto advance = [&]() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  };
  auto release = [&](int s) { mbar_arrive_if(&kv_empty[s], arrives_on_stage_release<EXACT>(tid)); };

  uint32_t q_phase = 0;
  FwdTile job;
  for (int n = 0;; ++n) {
    const TileStep step = next_tile(n, job);
    if (step == TileStep::kDone) break;
    if (step == TileStep::kEmpty) continue;  // (the producer and the Q loaders skip it too)
    const AttentionSeq sq = job.sq;
    const int kv_head = job.kv_head, split = job.split, kv_len = job.kv_len, rows = job.rows;
    const int first_pos = job.first_pos, row0 = job.row0, b_begin = job.b_begin, b_end = job.b_end;
    {
      const int my_row0 = row0 + consumer * kConsumerRows;
      const bool active = my_row0 < rows;
      const int my_last_pos = first_pos + ((my_row0 + kConsumerRows < rows ? my_row0 + kConsumerRows : rows) - 1) / group;
      // Blocks past every row of this warpgroup would add exact zeros: skipped (waited on and
      // released only).
      int my_end = !active ? b_begin : p.causal ? my_last_pos / kKvBlock + 1 : b_end;
      my_end = my_end < b_begin ? b_begin : my_end > b_end ? b_end : my_end;

      // Q (the loader's), released once the tile's last S is done; Q_IN_REGISTERS: read once as the
      // A fragments of S (wgmma RS), the loader's buffer then released at once. Every thread
      // arrives after its own reads: each read is then ordered before the loader's next writes by
      // the reading thread's own release (the order compute-sanitizer's racecheck follows).
      auto release_q = [&]() {
        if (!active) return;
        mbar_arrive(&q_empty[consumer]);
        q_phase ^= 1;
      };
      auto release_q_after_scores = [&]() {
        if constexpr (!Cfg::Q_IN_REGISTERS) release_q();
      };
      uint32_t qa[Cfg::Q_IN_REGISTERS ? Cfg::D_STEPS : 1][4];
      if (active) {
        mbar_wait(&q_full[consumer], q_phase);
        if constexpr (Cfg::Q_IN_REGISTERS) {
          const int quad = lane / 8, r = warp * 16 + 8 * (quad & 1) + lane % 8;
#pragma unroll
          for (int ks = 0; ks < Cfg::D_STEPS; ++ks) {
            // k16 chunk ks: box ks / 4, 16-byte chunks 2 (ks % 4) (lanes 0..15) and + 1 (lanes 16..31).
            ldmatrix_x4<false>(qa[ks], my_q_addr + swizzled_chunk_offset(r, ks / 4, (ks % 4) * 2 + (quad >> 1)));
          }
          release_q();
        }
      }

      const int warp_row0 = my_row0 + warp * 16;
      const int warp_first_pos = first_pos + warp_row0 / group;
      int row_last_key[1][2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int pos = first_pos + (warp_row0 + 8 * hh + g) / group;
        row_last_key[0][hh] = p.causal && pos < kv_len ? pos : kv_len - 1;
      }
      uint8_t* warp_area = o_stage + (consumer * (kWarpgroupThreads / 32) + warp) * STAGE_WARP_BYTES;
      float* warp_area_floats = reinterpret_cast<float*>(warp_area);
      const SplitState<D, SPLIT_IN_SMEM> split_state{SPLIT_IN_SMEM ? warp_area_floats : w.acc,
                                                     SPLIT_IN_SMEM ? warp_area_floats + 16 * D : w.ml, g, t};
      float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
      float acc[1][D / 8][4];
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][dn][e] = 0.f;
      }
      float(&acc_flat)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&acc[0][0][0]);
      float score[1][8][4];
      float(&score_flat)[32] = *reinterpret_cast<float(*)[32]>(&score[0][0][0]);
      uint32_t pa[Cfg::KEY_STEPS][4];

      // S = Q K^T of block b into `score` (issued, not waited for).
      auto issue_scores = [&](int st) {
        const uint64_t k_st = smem_desc_at(k_desc, st * Cfg::STAGE_BYTES);
#pragma unroll
        for (int ks = 0; ks < Cfg::D_STEPS; ++ks) {
          if constexpr (Cfg::Q_IN_REGISTERS) {
            WgmmaRs<64, T>::template mma<0>(score_flat, qa[ks], kmajor_chunk(k_st, ks), ks > 0);
          } else {
            Wgmma<64, T>::template mma<0, 0>(score_flat, kmajor_chunk(q_desc, ks),
                                             kmajor_chunk(k_st, ks), ks > 0);
          }
        }
      };
      // acc += P V of the block in stage st (issued, not waited for).
      auto issue_pv = [&](int st) {
        const uint64_t v_st = smem_desc_at(v_desc, st * Cfg::STAGE_BYTES);
#pragma unroll
        for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) {
          WgmmaRs<D, T>::template mma<1>(acc_flat, pa[kc], mn_chunk(v_st, kc), 1);
        }
      };
      // The block recurrence on `score` (block b): m, l updated, scores turned into p; acc * alpha
      // once no P V that reads acc is in flight (the caller's order).
      float row_alpha[1][2];
      // masked: b >= mask_from, a constant in each of the steady loops below.
      const int mask_from = first_masked_block(kv_len, warp_first_pos, p.causal);
      auto softmax = [&](int b, bool masked) {
        return softmax_block<SCALE_NONNEG>(score, row_max, row_sum, row_alpha, row_last_key, b * kKvBlock + 2 * t,
                                           masked, scale_log2);
      };
      auto rescale_acc = [&]() {
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[0][dn][e] = __fmul_rn(acc[0][dn][e], row_alpha[0][e / 2]);
        }
      };
      // P in the input dtype as the A fragments of P V (the m16n8 layout of c_to_a is wgmma's).
      auto to_p = [&]() {
#pragma unroll
        for (int kc = 0; kc < Cfg::KEY_STEPS; ++kc) c_to_a<T>(pa[kc], score[0][2 * kc], score[0][2 * kc + 1]);
      };
      // The pipeline, in straight-line segments (a wgmma or a read of its registers under a
      // branch the compiler cannot prove finished makes ptxas serialize every wgmma, C7514):
      //   block b_begin: S; the recurrence.
      //   block b = b_begin + 1 .. my_end - 1: S of b on the tensor cores with P V of b - 1, the
      //     recurrence of b, then (P V of b - 1 done) acc * alpha_b: per row the contract's order
      //     acc = (acc * alpha_b) + P_b V_b. At a split's first block (MERGE) P V of b - 1 finishes
      //     first and the finished split folds into the workspace before the recurrence of b.
      //   then P V of the last block; then the skipped blocks, waited for and released.
      // Each block and the final P V is one ping-pong turn for both consumers (b_end - b_begin + 1),
      // skipped blocks included, so the turns pair up.
      int prev_stage = stage;
      uint32_t prev_phase = phase;
      auto step_scores_and_pv = [&](bool with_pv) {
        mbar_wait(&k_full[stage], phase);
        if (with_pv) mbar_wait(&v_full[prev_stage], prev_phase);
        turn_sync();
        wgmma_fence();
        issue_scores(stage);
        wgmma_commit();
        if (with_pv) {
          issue_pv(prev_stage);
          wgmma_commit();
        }
        turn_pass();
      };
      if constexpr (EXACT) {
        // In sequence, no ping-pong: S, the recurrence, P V (by cuts where the warpgroup's rows
        // have masked keys in the block: past kv_len or past the first row's causal position).
        const int my_first_pos = first_pos + my_row0 / group;
        for (int b = b_begin; b < b_end; ++b) {
          mbar_wait(&k_full[stage], phase);
          mbar_wait(&v_full[stage], phase);
          if (b < my_end) {
            wgmma_fence();
            issue_scores(stage);
            wgmma_commit();
            wgmma_wait<0>();
            fence_accumulators(score_flat);
            if (MERGE && b > 0 && b % kSplitBlocks == 0) {
              fold_split<D>(b, acc, row_max, row_sum, row_last_key, split_state, p, sq, kv_head, rows, group, warp_row0,
                            lane);
            }
            if (softmax(b, b >= mask_from)) rescale_acc();
            to_p();
            const int key0 = b * kKvBlock;
            if (key0 + kKvBlock > kv_len || (p.causal && key0 + kKvBlock - 1 > my_first_pos)) {
              pv_by_cuts<T, D>(acc_flat, pa, row_last_key, v_stage(stage),
                               cut_scratch + consumer * Cfg::D_BOXES * kCutBoxBytes, key0, tid, kConsumerBar + consumer);
            } else {
              wgmma_fence();
              issue_pv(stage);
              wgmma_commit();
              wgmma_wait<0>();
              fence_accumulators(acc_flat);
            }
          }
          release(stage);
          advance();
        }
        release_q_after_scores();
      } else if (my_end > b_begin) {
        step_scores_and_pv(false);
        wgmma_wait<0>();
        fence_accumulators(score_flat);
        if (softmax(b_begin, b_begin >= mask_from)) rescale_acc();
        to_p();
        prev_stage = stage;
        prev_phase = phase;
        advance();
        auto steady_block = [&](int b, bool masked) {
          step_scores_and_pv(true);
          if (MERGE && b % kSplitBlocks == 0) {
            wgmma_wait<0>();
            fence_accumulators(score_flat);
            fence_accumulators(acc_flat);
            release(prev_stage);
            fold_split<D>(b, acc, row_max, row_sum, row_last_key, split_state, p, sq, kv_head, rows, group, warp_row0,
                            lane);
            if (softmax(b, masked)) rescale_acc();
          } else {
            wgmma_wait<1>();  // S done; P V of b - 1 may still run (pa is rewritten only after it)
            fence_accumulators(score_flat);
            // The wait for P V of b - 1 in each arm of a branch on the recurrence's result: in
            // straight-line code ptxas hoists it above the recurrence, which then no longer
            // overlaps that P V. The branch is warp-uniform (the wait is .aligned; a thread whose
            // alphas are all 1 then multiplies by 1: the same bits).
            if (__any_sync(0xffffffffu, softmax(b, masked))) {
              wgmma_wait<0>();
              fence_accumulators(acc_flat);
              rescale_acc();
            } else {
              wgmma_wait<0>();
              fence_accumulators(acc_flat);
            }
            release(prev_stage);
          }
          to_p();
          prev_stage = stage;
          prev_phase = phase;
          advance();
        };
        // The blocks without a masked key, then those with: two loops, so that the first (most
        // blocks of a long row) carries no per-score mask selects (128 instructions per block).
        // (uniform: the loops' bounds are then warp-uniform to the compiler, which keeps the stage
        // index and the wgmma descriptors in uniform registers.)
        const int unmasked_end = uniform(mask_from <= b_begin ? b_begin + 1 : mask_from > my_end ? my_end : mask_from);
        int b = b_begin + 1;
        for (; b < unmasked_end; ++b) steady_block(b, false);
        for (; b < my_end; ++b) steady_block(b, true);
        release_q_after_scores();  // every S of the tile is done
        mbar_wait(&v_full[prev_stage], prev_phase);
        turn_sync();
        wgmma_fence();
        issue_pv(prev_stage);
        wgmma_commit();
        turn_pass();
        wgmma_wait<0>();
        fence_accumulators(acc_flat);
        release(prev_stage);
      } else {
        release_q_after_scores();
        turn_sync();  // the turn of the final P V
        turn_pass();
      }
      for (int b = my_end; b < b_end && !EXACT; ++b) {
        turn_sync();
        turn_pass();
        // Released only once loaded, so that the release counts toward this use of the stage
        // (the producer waits for both consumers' releases of each use).
        mbar_wait(&k_full[stage], phase);
        mbar_wait(&v_full[stage], phase);
        release(stage);
        advance();
      }
      if (!active) continue;

      // ------------------------------------------------------------------ epilogue
      constexpr bool STAGED = Cfg::STAGED_OUT && !EXACT;
      fwd_epilogue<T, D, MODE, EXACT, STAGED>(acc, row_max, row_sum, row_last_key, split_state, out, p, w, sq, kv_head,
                                               split, rows, group, warp_row0, warp_area, lane);
    }
  }
#endif  // RL_ALIGN_SM90A_DEVICE
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

// The two configurations, chosen from shapes only (every one gives the same bits):
//   few rows (a decode step, short chunks: at most one consumer tile of rows per sequence and kv
//     head): one consumer, a 3-block ring, two CTAs per SM, so that a few long sequences' splits
//     keep the GPU's bandwidth busy;
//   prefill: two consumers taking ping-pong turns over a 4-block ring.
template <int D>
using FewRowsConfig = Sm90FwdConfig<D, 1, 3, false, 2>;
template <int D>
using PrefillConfig = Sm90FwdConfig<D, 2, 4, true>;

bool few_rows(const AttentionProblem& p) { return p.max_q_len * (p.heads_q / p.heads_kv) <= kConsumerRows; }

template <typename T, typename Cfg, bool SCALE_NONNEG, SplitMode MODE, bool EXACT>
gpuError_t launch_kernel(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w, const OperandMap& kv_at,
                         float scale_log2, gpuStream_t stream) {
  auto kernel = attention_fwd_sm90_kernel<T, Cfg, SCALE_NONNEG, MODE, EXACT>;
  constexpr int kSmem = sm90_fwd_smem_bytes<Cfg, MODE, EXACT>();
  static std::atomic<uint64_t> raised{0};
  gpuError_t err = allow_dynamic_smem(kernel, kSmem, raised);
  if (err != cudaSuccess) return err;
  CUtensorMap k_map, v_map;
  if (!encode_operand_map(&k_map, kv_at, dtype, p.k, p.head_dim, p.kv_elements) ||
      !encode_operand_map(&v_map, kv_at, dtype, p.v, p.head_dim, p.kv_elements)) {
    return cudaErrorInvalidValue;
  }
  const int64_t group = p.heads_q / p.heads_kv;
  // Sections of pairs whose K/V (one kv head of one sequence each) take about 20 MB of L2.
  const int64_t kv_pair_bytes = 2 * p.max_kv_len * p.head_dim * 2;
  const TileOrder order = TileOrder::over(
      p.num_seqs, MODE == SplitMode::kPerSplit ? p.heads_kv * attention_split_count(p) : p.heads_kv,
      ceil_div(p.max_q_len * group, static_cast<int64_t>(Cfg::BLOCK_M)),
      (int64_t{20} << 20) / (kv_pair_bytes > 0 ? kv_pair_bytes : 1));
  // One wave where the CTAs claim their tiles (DYNAMIC_TILES); the EXACT launch mostly finds
  // nothing to do: one wave keeps it to a few microseconds.
  const int64_t wave = static_cast<int64_t>(multiprocessor_count(current_device())) * Cfg::MIN_BLOCKS;
  const int64_t cap = Cfg::DYNAMIC_TILES || EXACT ? wave : INT32_MAX;
  const int64_t ctas = order.total < cap ? order.total : cap;
  kernel<<<static_cast<unsigned>(ctas), Cfg::THREADS, kSmem, stream>>>(k_map, v_map, kv_at, p, w, order,
                                                                       static_cast<int>(group), scale_log2);
  return cudaGetLastError();
}

// The fast kernel; then, where keys are masked inside a sequence (more than one query), the EXACT
// one, which recomputes only if the fast one flagged a non-finite result; then the split merge.
template <typename T, typename Cfg, bool SCALE_NONNEG, SplitMode MODE>
gpuError_t launch(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w, const OperandMap& kv_at,
                  float scale_log2, gpuStream_t stream) {
  gpuError_t err = launch_kernel<T, Cfg, SCALE_NONNEG, MODE, false>(dtype, p, w, kv_at, scale_log2, stream);
  if (err == cudaSuccess && p.max_q_len > 1) {
    err = launch_kernel<T, Cfg, SCALE_NONNEG, MODE, true>(dtype, p, w, kv_at, scale_log2, stream);
  }
  if (err != cudaSuccess || MODE != SplitMode::kPerSplit) return err;
  return attention_split_combine(dtype, p, w, stream);
}

template <typename T, typename Cfg, SplitMode MODE>
gpuError_t launch_sign(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w, const OperandMap& kv_at,
                       gpuStream_t stream) {
  const float scale_log2 = scale_log2e(p);
  if (scale_log2 < 0.f) return launch<T, Cfg, false, MODE>(dtype, p, w, kv_at, scale_log2, stream);
  return launch<T, Cfg, true, MODE>(dtype, p, w, kv_at, scale_log2, stream);
}

template <typename T, int D>
gpuError_t dispatch_config(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                           const OperandMap& kv_at, gpuStream_t stream) {
  // w.slots: attention_fwd_split_slots (per-split slots only for few rows).
  if (w.slots > 1) return launch_sign<T, FewRowsConfig<D>, SplitMode::kPerSplit>(dtype, p, w, kv_at, stream);
  if (few_rows(p)) {
    if (w.slots == 1) return launch_sign<T, FewRowsConfig<D>, SplitMode::kMerge>(dtype, p, w, kv_at, stream);
    return launch_sign<T, FewRowsConfig<D>, SplitMode::kNone>(dtype, p, w, kv_at, stream);
  }
  if (w.slots == 1) return launch_sign<T, PrefillConfig<D>, SplitMode::kMerge>(dtype, p, w, kv_at, stream);
  return launch_sign<T, PrefillConfig<D>, SplitMode::kNone>(dtype, p, w, kv_at, stream);
}

}  // namespace

bool attention_sm90_compiled_for(int device) {
  // Asked at every call (the path choice): the answer per device is cached.
  static std::atomic<int> known[64];  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  const int cached = known[device].load(std::memory_order_relaxed);
  if (cached != 0) return cached == 2;
  cudaFuncAttributes attr{};
  bool ok = cudaFuncGetAttributes(&attr, attention_fwd_sm90_kernel<bfloat16_t, PrefillConfig<128>, true,
                                                                   SplitMode::kNone, false>) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();
  int major = 0, minor = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  // The sm_90a cubin (binaryVersion 90) runs only on compute capability 9.0.
  ok = ok && major == 9 && minor == 0 && attr.binaryVersion == 90 && tensor_map_encoder() != nullptr;
  known[device].store(ok ? 2 : 1, std::memory_order_relaxed);
  return ok;
}

// Problem requirements: tensor_core_attention_problem_error and tensor_core_workspace_ok
// (tensor_core.h), a tile counter, and K and V addressable through tensor maps (kv_map_problem:
// the launcher sends other layouts to the sm80 path, attention_sm90_layout_problem);
// cudaErrorInvalidValue otherwise.
gpuError_t attention_fwd_sm90(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                              gpuStream_t stream) {
  const gpuError_t err = tensor_core_attention_problem_error(dtype, p, 1);  // a 1-D grid
  if (err != cudaSuccess || p.num_seqs == 0 || p.max_q_len == 0) return err;
  OperandMap kv_at;
  if (!tensor_core_workspace_ok(p, w) || w.tile_counter == nullptr || kv_map_problem(p, &kv_at) != nullptr) {
    return cudaErrorInvalidValue;
  }
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype,
      [&](auto tag) {
        using T = decltype(tag);
        return p.head_dim == 64 ? dispatch_config<T, 64>(dtype, p, w, kv_at, stream)
                                : dispatch_config<T, 128>(dtype, p, w, kv_at, stream);
      },
      gpu_not_supported);
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
bool attention_sm90_compiled_for(int) { return false; }
gpuError_t attention_fwd_sm90(DType, const AttentionProblem&, const AttentionFwdWorkspace&, gpuStream_t) {
  return RL_GPU(ErrorNotSupported);
}
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
