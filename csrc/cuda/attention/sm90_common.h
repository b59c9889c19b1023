// What the sm90 attention kernels (sm90_fwd.cu forward, sm90_bwd.cu backward) share: the tile
// geometry of their 128-byte-swizzle boxes, how a tensor map addresses an operand (host), and the
// exact kernels' product by cuts (device). Torch-free.
#pragma once

#include <cstdint>

#include "../../common/attention_problem.h"
#include "../../common/dtype_dispatch.h"
#include "../../common/portability.h"
#include "../../primitives/sm90_async.h"
#include "../attention_kernels.h"
#include "sm80_common.h"

#if !RL_ALIGN_HIP
#ifdef RL_ALIGN_SM90A_DEVICE
#include "../../primitives/wgmma_instructions.h"
#endif

namespace rl_align {

// A box is 64 rows (tokens) x 64 elements of d: one 128-byte swizzle row per token; head_dim 128
// takes two boxes side by side. 64 rows are also a wgmma m64 tile and a KV block.
constexpr int kBoxRows = 64;
constexpr int kBoxElems = 64;
constexpr int kBoxBytes = kBoxRows * kSwizzleRowBytes;
static_assert(kBoxRows == kAttentionKvBlock, "a box holds one KV block");
// The exact kernels' scratch for one k16 chunk of one box (rs_product_by_cuts).
constexpr int kCutBoxBytes = 16 * kSwizzleRowBytes;

// Byte offset of the 16-byte chunk `chunk` (0..7) of row `row` (0..63) of box `box` in a stack of
// boxes, as the 128-byte swizzle stores it: the chunk's place within the row XOR row % 8.
__host__ __device__ constexpr int swizzled_chunk_offset(int row, int box, int chunk) {
  return box * kBoxBytes + row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16);
}

// Arrivals per consumer warpgroup on a ring stage's "empty" barrier. The EXACT kernels also read
// ring rows with ordinary loads (rs_product_by_cuts): there every thread arrives after its own
// reads, so each read is ordered before the producer's next writes to the stage by the reading
// thread's own release (the order compute-sanitizer's racecheck follows). The fast kernels read
// the ring through wgmma only: one arrive per warp (lane 0), after that warp's own wait on the
// stage's "full" barrier. A single arrive per warpgroup is not enough where a warpgroup skips a
// block's products (no wgmma gathers its warps): the producer could then refill the stage twice
// before a lagging warp's wait, which would wait on the wrong phase forever.
template <bool EXACT>
constexpr int kStageReleaseArrivals = EXACT ? kWarpgroupThreads : kWarpgroupThreads / 32;
template <bool EXACT>
__device__ __forceinline__ bool arrives_on_stage_release(int tid) {
  return EXACT || tid % 32 == 0;
}

// How a dense operand [.., tokens, heads, d] (token-major: packed, or a batch stored so) or
// [.., heads, tokens, d] (head-major: a padded batch, the KV cache) is read through a 3-D tensor
// map in boxes of 64 tokens x 64 elements of d:
//   token-major: dims (d, heads, token rows); token j of head g of a sequence at element offset
//                base: (g, base / stride_token + j)
//   head-major:  dims (d, positions, head rows): (base % stride_head / stride_token + j,
//                base / stride_head + g)
// Rows past a dimension's end read as zeros; past the sequence they are whatever follows it.
struct OperandMap {
  bool head_major = false;
  int64_t stride_token = 0, stride_head = 0;
  __host__ __device__ void coords(int64_t base, int head, int token, int& c1, int& c2) const {
    if (head_major) {
      c1 = static_cast<int>(base % stride_head / stride_token) + token;
      c2 = static_cast<int>(base / stride_head) + head;
    } else {
      c1 = head;
      c2 = static_cast<int>(base / stride_token) + token;
    }
  }
  // The coordinates of (head, token) from those of (0, 0) (no division: for loops).
  __host__ __device__ void step(int c1_0, int c2_0, int head, int token, int& c1, int& c2) const {
    c1 = c1_0 + (head_major ? token : head);
    c2 = c2_0 + (head_major ? head : token);
  }
};

// The order in which a CTA takes its tiles (one per CTA, or a grid walking them): a tile is
// (visit, pair), pair = (sequence, y), y fastest (the forward: y = kv head (+ heads_kv * split),
// the visits its row tiles; the backward: y = kv head, the visits its key or row tiles); visit 0
// is a sequence's heaviest (causal). Pairs go in sections of pairs_per_section; within a section
// the heaviest tiles of every pair come first (longest job first), so that the CTAs running at
// once share their sections' streams in L2. Scheduling only: no bit depends on it.
struct TileRef {
  int64_t seq;  // < 0: past the order's end
  int visit, y;
};
struct TileOrder {
  int64_t tiles_max = 0;  // visits of the longest sequence
  int64_t grid_y = 0;     // y per sequence
  int64_t pairs = 0;      // num_seqs * grid_y
  int64_t pairs_per_section = 1;
  int64_t total = 0;      // pairs * tiles_max
  __host__ __device__ static TileOrder over(int64_t num_seqs, int64_t grid_y, int64_t tiles_max, int64_t pairs_per_section) {
    const int64_t pairs = num_seqs * grid_y;
    return TileOrder{tiles_max, grid_y, pairs, pairs_per_section < 1 ? 1 : pairs_per_section > pairs ? pairs : pairs_per_section,
                     pairs * tiles_max};
  }
  __host__ __device__ TileRef at(int64_t t) const {
    if (t >= total) return TileRef{-1, 0, 0};
    const int64_t section_tiles = pairs_per_section * tiles_max;
    const int64_t first_pair = t / section_tiles * pairs_per_section, r = t % section_tiles;
    const int64_t n_pairs = pairs - first_pair < pairs_per_section ? pairs - first_pair : pairs_per_section;
    const int64_t pair = first_pair + r % n_pairs;
    return TileRef{pair / grid_y, static_cast<int>(r / n_pairs), static_cast<int>(pair % grid_y)};
  }
};
// Tile t (< pairs * tiles_max) of the same order, for the backward kernels: they pass their
// problem's fields and a compile-time section size straight in. A TileOrder built inside them (in
// registers, its section size clamped at run time) made forward + backward 3-4% slower on the H200
// (journal, run 69); TileOrder::at's arithmetic here changes their machine code, as this
// arithmetic changes the forward's, so each keeps the form it was measured with.
// tests/cpp/tile_order_check.cu proves the two give the same order.
__host__ __device__ __forceinline__ TileRef tile_in_sections(int64_t t, int64_t pairs, int64_t grid_y, int64_t tiles_max,
                                                             int64_t pairs_per_section) {
  const int64_t first_pair = t / (pairs_per_section * tiles_max) * pairs_per_section;
  const int64_t n_pairs = pairs - first_pair < pairs_per_section ? pairs - first_pair : pairs_per_section;
  const int64_t r = t - first_pair * tiles_max, pair = first_pair + r % n_pairs;
  return TileRef{pair / grid_y, static_cast<int>(r / n_pairs), static_cast<int>(pair % grid_y)};
}

// Why an operand (token/head strides, `heads`, `elements`, dim 0's `stride_outer`:
// AttentionProblem) cannot be addressed as OperandMap says, or nullptr where it can (then *info
// says how): every sequence base a whole number of tokens (stride_outer a multiple of the token
// stride), the larger of the two strides a multiple of the smaller, and coordinates within int.
// Equal strides: one of the two dimensions has one entry (a dense operand), the heads' if
// heads == 1, else the tokens'.
inline const char* operand_map_problem(int64_t stride_token, int64_t stride_head, int64_t heads, int64_t elements,
                                       int64_t stride_outer, OperandMap* info) {
  if (stride_token <= 0 || stride_head <= 0 || elements <= 0) return "a token or head stride is not positive";
  if (stride_outer % stride_token != 0) {
    return "the batch dimension's stride is not a whole number of token strides (sequences start between tokens)";
  }
  info->head_major = stride_head > stride_token || (stride_head == stride_token && heads > 1);
  info->stride_token = stride_token;
  info->stride_head = stride_head;
  const int64_t inner = info->head_major ? stride_token : stride_head;
  const int64_t outer = info->head_major ? stride_head : stride_token;
  if (outer % inner != 0) return "the larger of the token and head strides is not a multiple of the smaller";
  if (elements / inner > INT32_MAX) return "its rows exceed a tensor map's int coordinates";
  return nullptr;
}
// The two operand groups of a problem: Q (and dO, laid out as Q) and K/V (K and V share strides).
inline const char* q_map_problem(const AttentionProblem& p, OperandMap* info) {
  return operand_map_problem(p.q_stride_token, p.q_stride_head, p.heads_q, p.q_elements, p.q_stride_outer, info);
}
inline const char* kv_map_problem(const AttentionProblem& p, OperandMap* info) {
  return operand_map_problem(p.kv_stride_token, p.kv_stride_head, p.heads_kv, p.kv_elements, p.kv_stride_outer, info);
}

// The tensor map of an operand `info` describes (operand_map_problem), in boxes of 64 x 64.
inline bool encode_operand_map(CUtensorMap* map, const OperandMap& info, DType dtype, const void* ptr,
                               int64_t head_dim, int64_t elements) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const int64_t inner = info.head_major ? info.stride_token : info.stride_head;  // dim 1's stride
  const int64_t outer = info.head_major ? info.stride_head : info.stride_token;  // dim 2's stride
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(outer / inner),
                              static_cast<cuuint64_t>((elements + outer - 1) / outer)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner) * 2, static_cast<cuuint64_t>(outer) * 2};
  const cuuint32_t box[3] = {kBoxElems, info.head_major ? kBoxRows : 1u, info.head_major ? 1u : kBoxRows};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                const_cast<void*>(ptr), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#ifdef RL_ALIGN_SM90A_DEVICE
// The first key block (64 keys) in which a warp's rows, the first of them at position first_pos,
// have keys to mask: past kv_len (blocks from kv_len / 64 on), or causal, past the first row's
// position (b * 64 + 63 > first_pos). The blocks before it take no per-score mask select.
__device__ __forceinline__ int first_masked_block(int kv_len, int first_pos, bool causal) {
  const int tail_from = kv_len / kBoxRows, causal_from = (first_pos + 1) / kBoxRows;
  return causal && causal_from < tail_from ? causal_from : tail_from;
}

// Where a GQA-packed row (row = query * group + head in group, as the kernels pack a kv head's
// query rows) lives in a [token, head] operand: `at`, the element offset of its (query,
// kv_head * group + head in group) from the sequence's base, stepped from row to row without a
// division per row (the loaders and the staged output walk each lane's rows this way).
struct PackedRowWalker {
  int64_t at;
  int head_in_group, group;
  int64_t stride_token, stride_head;
  __device__ __forceinline__ PackedRowWalker(int64_t base, int row, int kv_head, int group_, int64_t stride_token_,
                                             int64_t stride_head_)
      : head_in_group(row % group_), group(group_), stride_token(stride_token_), stride_head(stride_head_) {
    at = base + static_cast<int64_t>(row / group) * stride_token +
         (static_cast<int64_t>(kv_head) * group + head_in_group) * stride_head;
  }
  // To the row n (> 0) rows on.
  __device__ __forceinline__ void step(int n) {
    at += n * stride_head;
    for (head_in_group += n; head_in_group >= group; head_in_group -= group) at += stride_token - group * stride_head;
  }
};

// wgmma descriptors of a tile of boxes (kBoxBytes apart): box_desc of its first box, then its k16
// chunk as an offset from that (smem_desc_at): chunk ks of a K-major tile (128-byte rows of d),
// chunk kc of an MN-major one (16 rows of k each).
__device__ __forceinline__ uint64_t box_desc(uint32_t addr) { return smem_desc(addr, kBoxBytes, kSwizzleAtomBytes); }
__device__ __forceinline__ uint64_t kmajor_chunk(uint64_t tile, int ks) {
  return smem_desc_at(tile, (ks / 4) * kBoxBytes + (ks % 4) * 32);
}
__device__ __forceinline__ uint64_t mn_chunk(uint64_t tile, int kc) { return smem_desc_at(tile, kc * 16 * kSwizzleRowBytes); }

// Four 8x8 b16 matrices from the m16n8 accumulator layout (r[j]: matrix j's row lane / 4, columns
// 2 (lane % 4) and + 1) to shared memory; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// acc (a warpgroup's m64 x N accumulators, N = 64 BOXES) += A B for one k16 chunk, each row summing
// only its allowed k positions whatever B holds at the others: A in registers (a), B = 16 rows (k)
// of an MN-major tile of BOXES boxes, row r at b_rows + box * box_bytes + r * 128. Row hh of the
// thread may use `count[hh]` of the 16 k positions: the first ones (KEEP_LOW) or the last ones.
// Per count n = 16 .. 1 the product runs with B's rows outside the count's positions replaced by
// +0 (a copy in `scratch`, BOXES x 16 rows, 1024-aligned) from the current accumulators, and only
// the rows with that count keep it; rows with count 0 keep acc. An mma element depends only on its
// own A row, B column and accumulator, so a row gets the bits of a product whose masked B rows are
// zeros, whatever they held. bar: a named barrier of the warpgroup's 128 threads.
template <typename T, int N, bool KEEP_LOW>
__device__ __forceinline__ void rs_product_by_cuts(float (&acc)[N / 2], const uint32_t (&a)[4], const uint8_t* b_rows,
                                                   int box_bytes, uint8_t* scratch, const int (&count)[2], int tid,
                                                   int bar) {
  constexpr int BOXES = N / 64;
  named_bar_sync(bar, kWarpgroupThreads);  // earlier products are done with the scratch
  for (int i = tid; i < BOXES * 16 * 8; i += kWarpgroupThreads) {
    const int box = i / 128, r = i % 128 / 8, c16 = i % 8;
    // Bytes as they are: a row keeps its place in the 8-row swizzle period (chunks start at
    // multiples of 16 rows).
    *reinterpret_cast<uint4*>(scratch + box * kCutBoxBytes + r * 128 + c16 * 16) =
        *reinterpret_cast<const uint4*>(b_rows + box * box_bytes + r * 128 + c16 * 16);
  }
  const uint32_t scratch_addr = smem_addr(scratch);
#pragma unroll 1
  for (int n = 16; n >= 1; --n) {
    fence_proxy_async();
    named_bar_sync(bar, kWarpgroupThreads);
    float tmp[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) tmp[i] = acc[i];
    wgmma_fence();
    WgmmaRs<N, T>::template mma<1>(tmp, a, smem_desc(scratch_addr, kCutBoxBytes, kSwizzleAtomBytes), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(tmp);
    // Accumulator register 4 j + e is row hh = e / 2 of the thread.
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = count[(i % 4) / 2] == n ? tmp[i] : acc[i];
    named_bar_sync(bar, kWarpgroupThreads);
    // The k position that the next count (n - 1) leaves out becomes +0.
    const int gone = KEEP_LOW ? n - 1 : 16 - n;
    if (tid < BOXES * 8) {
      *reinterpret_cast<uint4*>(scratch + (tid / 8) * kCutBoxBytes + gone * 128 + (tid % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
  }
}
#endif  // RL_ALIGN_SM90A_DEVICE

}  // namespace rl_align
#endif  // !RL_ALIGN_HIP
