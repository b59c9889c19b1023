// rope GPU kernel, forward and backward (CUDA; HIP compiles the same source).
//
// Streaming: threads move 16-byte vectors, and cos/sin are computed once per (token, frequency)
// into shared memory. An item is a chunk of one head row of q or k: V = 16 / sizeof(T) rotation
// pairs read as two vectors, NeoX lo = [cV, cV + V) and hi = [R/2 + cV, ...), GPT-J
// lo = [2cV, 2cV + V) and hi = [2cV + V, 2cV + 2V); or V pass-through elements of
// rotary_dim..head_dim-1, copied bit for bit. Items are numbered (token, head row: q's heads then
// k's, chunk), chunk fastest, within a window of chunks (all of a row's chunks unless R/2 is
// large). A tile is tile_items consecutive items of a window (kTileItems unless few heads would
// make its tokens' cos/sin overflow a table buffer), dealt round robin to the block's threads,
// kItemsPerThread each, so that consecutive lanes read consecutive 16-byte vectors. Blocks stride
// over the tiles; per tile:
//   (1) each thread issues the loads of its items;
//   (2) while they are in flight, the block fills the table of (cos, sin) of the tile's tokens and
//       the window's frequencies, one rope_cos_sin per entry;
//   (3) __syncthreads;
//   (4) each thread rotates its items with the table's entries (rope_rotate) and stores them.
// Alternate tiles use alternate table buffers, so that one barrier per tile suffices: a thread
// rewrites a buffer only after the next tile's barrier, which every reader of it has reached.
//
// Invariance: each output element is computed by the same expressions of its own token's position
// and values whatever the grid, the tiling or the token count: its table entry is the same
// rope_cos_sin call whichever thread makes it (a token split between two tiles gets the same bits
// in both), and the vector and element load paths put the same values in the same slots.
#include "rope_kernels.h"

#include <atomic>

#include "../primitives/pack.h"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;
// Two items (four 16-byte loads) in flight per thread and at least 4 blocks (1024 threads) per
// SM: at most 64 registers, which 32-bit indices fit without spills, up to 64 KB of loads in
// flight per SM. 64-bit indices need up to 80 registers (3 blocks).
constexpr int kItemsPerThread = 2;
constexpr int kMinBlocksPerSm = 4;
constexpr int kMinBlocksPerSmWide = 3;
constexpr int64_t kTileItems = int64_t{kBlockThreads} * kItemsPerThread;
// (cos, sin) entries per table buffer; two buffers: 16 KB of shared memory per block.
constexpr int64_t kTableEntries = 1024;

// Division by a launch constant d: with 32-bit indices a multiply-high, an add and a shift
// (Granlund and Montgomery's round-up method, exact for n and d below 2^31), else n / d.
struct Divisor {
  int64_t d = 1;
  uint32_t magic = 1, shift = 0;

  Divisor() = default;
  explicit Divisor(int64_t divisor) : d(divisor) {
    if (d < 1 || d >= (int64_t{1} << 31)) return;  // 64-bit indices only
    while ((int64_t{1} << shift) < d) ++shift;
    const uint64_t excess = (uint64_t{1} << shift) - static_cast<uint64_t>(d);
    magic = static_cast<uint32_t>((excess << 32) / static_cast<uint64_t>(d) + 1);
  }

  template <typename Index>
  __device__ __forceinline__ Index div(Index n) const {
    if constexpr (sizeof(Index) == 4) {
      return (__umulhi(n, magic) + n) >> shift;
    } else {
      return n / static_cast<Index>(d);
    }
  }
};

// The tiles of a problem, chosen from its head counts, head_dim and dtype (make_tiling).
struct Tiling {
  int64_t chunks, rot_chunks;  // per head row: all, and the rotary ones (the first rot_chunks)
  Divisor window_chunks;  // chunks of a head row per window
  Divisor token_items;  // a token's items in a window: head rows x window_chunks
  int64_t window_items;  // tokens x token_items
  Divisor table_row;  // table entries per token: the rotary frequencies of a window, at most
  int64_t tile_items;
  Divisor window_tiles;  // tiles per window
  int64_t tiles;  // window_tiles per window, window after window
  Divisor seq;  // token n is (n / seq, n % seq)
};

// Loads and stores of the first n (0 <= n <= V) elements of a chunk's part at `at`. The vector
// path (n is 0 or V: the host has checked that whole vectors fit) loads the vector at `at` even for
// n = 0, where the caller points `at` at any readable vector: merging a conditional load with its
// alternative splits the vector into 16-bit registers. The element path zeroes the slots past n
// (the rotation reads them; its results there are not stored).
template <typename T, int V, bool VEC>
__device__ __forceinline__ void load_part(Pack<T, V>& p, const T* at, int n) {
  if constexpr (VEC) {
    p = *reinterpret_cast<const Pack<T, V>*>(at);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = j < n ? at[j] : T{};
  }
}

template <typename T, int V, bool VEC>
__device__ __forceinline__ void store_part(const Pack<T, V>& p, T* at, int n) {
  if constexpr (VEC) {
    if (n > 0) *reinterpret_cast<Pack<T, V>*>(at) = p;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j < n) at[j] = p.v[j];
    }
  }
}

// How many of the elements [off, off + V) lie below `end`.
template <int V, typename Index>
__device__ __forceinline__ int part_size(Index off, Index end) {
  return off < end ? (end - off < V ? static_cast<int>(end - off) : V) : 0;
}

template <typename Index>
__device__ __forceinline__ Index smaller(Index a, Index b) {
  return a < b ? a : b;
}

// (lo, hi) -> the pairs rotated by the (cos, sin) of the chunk's V frequencies: pair j in slots
// (j, V + j) for NeoX, (2j, 2j + 1) for GPT-J of x = [lo, hi].
template <typename T, int V, RopeStyle STYLE>
__device__ __forceinline__ void rotate(Pack<T, V>& lo, Pack<T, V>& hi, const float* cos_row,
                                       const float* sin_row) {
  float c[V], s[V], x[2 * V], y[2 * V];
#pragma unroll
  for (int j = 0; j < V; j += 4) {  // entries of a chunk start at multiples of V, of 4
    const float4 c4 = *reinterpret_cast<const float4*>(cos_row + j);
    const float4 s4 = *reinterpret_cast<const float4*>(sin_row + j);
    c[j] = c4.x, c[j + 1] = c4.y, c[j + 2] = c4.z, c[j + 3] = c4.w;
    s[j] = s4.x, s[j + 1] = s4.y, s[j + 2] = s4.z, s[j + 3] = s4.w;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    x[j] = Convert<T>::to_float(lo.v[j]);
    x[V + j] = Convert<T>::to_float(hi.v[j]);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int ia = STYLE == RopeStyle::kNeox ? j : 2 * j;
    const int ib = STYLE == RopeStyle::kNeox ? V + j : 2 * j + 1;
    rope_rotate(x[ia], x[ib], c[j], s[j], y[ia], y[ib]);
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    lo.v[j] = Convert<T>::from_float(y[j]);
    hi.v[j] = Convert<T>::from_float(y[V + j]);
  }
}

// Index: uint32_t where the launch has checked that every index fits, else uint64_t.
template <typename T, RopeStyle STYLE, bool VEC, typename Index>
__global__ void __launch_bounds__(kBlockThreads, sizeof(Index) == 4 ? kMinBlocksPerSm : kMinBlocksPerSmWide)
    rope_kernel(RopeProblem p, Tiling t, bool inverse) {
  constexpr int V = 16 / sizeof(T);
  alignas(16) __shared__ float cos_table[2][kTableEntries];
  alignas(16) __shared__ float sin_table[2][kTableEntries];
  const RopeOperand& q = p.operand[0];
  const RopeOperand& k = p.operand[1];
  const auto index = [](int64_t v) { return static_cast<Index>(v); };
  const Index half = index(p.rotary_dim / 2), rot_chunks = index(t.rot_chunks);
  const Index hi_step = STYLE == RopeStyle::kNeox ? half : V;  // from a rotary chunk's lo to its hi
  const T* const any_in = static_cast<const T*>(q.heads > 0 ? q.in : k.in);  // a readable vector
  int buffer = 0;
  for (Index tile = blockIdx.x; tile < index(t.tiles); tile += gridDim.x, buffer ^= 1) {
    const Index window = t.window_tiles.div(tile);
    const Index chunk0 = window * index(t.window_chunks.d);
    const Index begin = (tile - window * index(t.window_tiles.d)) * index(t.tile_items);
    const Index end = smaller(begin + index(t.tile_items), index(t.window_items));
    const Index token0 = t.token_items.div(begin);  // the table's first token
    float* const cos_tab = cos_table[buffer];
    float* const sin_tab = sin_table[buffer];

    // (1) The loads of this thread's items. What the store needs stays in registers: lo's output
    // address (hi's is hi_step elements further), the sizes of lo and hi, the table entry.
    Pack<T, V> x[kItemsPerThread][2];
    T* out[kItemsPerThread];
    int lo_n[kItemsPerThread], hi_n[kItemsPerThread];
    bool rotary[kItemsPerThread];
    uint32_t entry[kItemsPerThread];  // < kTableEntries
#pragma unroll
    for (int u = 0; u < kItemsPerThread; ++u) {
      const Index i = begin + u * kBlockThreads + threadIdx.x;
      const Index token = t.token_items.div(i);
      const Index r = i - token * index(t.token_items.d);
      const Index row = t.window_chunks.div(r);
      const Index c = r - row * index(t.window_chunks.d);
      const Index g = chunk0 + c;  // the chunk of the head row
      rotary[u] = g < rot_chunks;
      lo_n[u] = 0;
      hi_n[u] = 0;
      const T* in = any_in;  // for an item that reads nothing
      if (i < end && g < index(t.chunks)) {  // else past the tile, or the last window's overhang
        // lo's first element in the head row and the ends of lo and hi (pass-through: no hi).
        Index lo_off, lo_end, hi_end;
        if (!rotary[u]) {
          lo_off = index(p.rotary_dim) + (g - rot_chunks) * V, lo_end = index(p.head_dim), hi_end = 0;
        } else if (STYLE == RopeStyle::kNeox) {
          lo_off = g * V, lo_end = half, hi_end = index(p.rotary_dim);
        } else {
          lo_off = 2 * g * V, lo_end = index(p.rotary_dim), hi_end = index(p.rotary_dim);
        }
        lo_n[u] = part_size<V>(lo_off, lo_end);
        hi_n[u] = part_size<V>(lo_off + hi_step, hi_end);
        entry[u] = static_cast<uint32_t>((token - token0) * index(t.table_row.d) + c * V);
        const Index b = t.seq.div(token), s = token - b * index(t.seq.d);
        const bool is_k = row >= index(q.heads);
        const Index head = is_k ? row - index(q.heads) : row;
        in = static_cast<const T*>(is_k ? k.in : q.in) + lo_off +
             (b * index(is_k ? k.in_stride_b : q.in_stride_b) +
              s * index(is_k ? k.in_stride_s : q.in_stride_s) +
              head * index(is_k ? k.in_stride_h : q.in_stride_h));
        out[u] = static_cast<T*>(is_k ? k.out : q.out) + lo_off +
                 (b * index(is_k ? k.out_stride_b : q.out_stride_b) +
                  s * index(is_k ? k.out_stride_s : q.out_stride_s) +
                  head * index(is_k ? k.out_stride_h : q.out_stride_h));
      }
      load_part<T, V, VEC>(x[u][0], in, lo_n[u]);
      load_part<T, V, VEC>(x[u][1], hi_n[u] > 0 ? in + hi_step : in, hi_n[u]);  // no hi: lo again
    }

    // (2) While they are in flight, the table: entry e is (token token0 + e / table_row, frequency
    // chunk0 V + e % table_row).
    const Index entries = (t.token_items.div(end - 1) - token0 + 1) * index(t.table_row.d);
#pragma unroll 1
    for (Index e = threadIdx.x; e < entries; e += kBlockThreads) {
      const Index tl = t.table_row.div(e);
      const Index f = chunk0 * V + (e - tl * index(t.table_row.d));
      const Index token = token0 + tl, b = t.seq.div(token);
      float c = 0.f, s = 0.f;  // past R/2: the last chunk's or window's padding, never stored
      if (f < half) {
        const int64_t pos = rope_position(p, b, token - b * index(t.seq.d));
        rope_cos_sin(pos, p.inv_freq[f], p.scaling, inverse, c, s);
      }
      cos_tab[e] = c;
      sin_tab[e] = s;
    }
    __syncthreads();  // (3)

    // (4) Rotate and store.
#pragma unroll
    for (int u = 0; u < kItemsPerThread; ++u) {
      if (lo_n[u] == 0) continue;
      if (rotary[u]) {  // a store in each branch: no merge of rotated and loaded values
        rotate<T, V, STYLE>(x[u][0], x[u][1], cos_tab + entry[u], sin_tab + entry[u]);
        store_part<T, V, VEC>(x[u][0], out[u], lo_n[u]);
        store_part<T, V, VEC>(x[u][1], out[u] + hi_step, hi_n[u]);
      } else {
        store_part<T, V, VEC>(x[u][0], out[u], lo_n[u]);
      }
    }
  }
}

template <typename T>
bool aligned16(const void* ptr, std::initializer_list<int64_t> strides) {
  bool ok = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  for (int64_t st : strides) ok = ok && (st * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  return ok;
}

// 16-byte vectors when every chunk is whole vectors at 16-byte aligned addresses.
template <typename T>
bool vector_io(const RopeProblem& p) {
  constexpr int64_t V = 16 / sizeof(T);
  const int64_t half = p.rotary_dim / 2;
  bool ok = (p.style == RopeStyle::kNeox ? half % V == 0 : p.rotary_dim % (2 * V) == 0) &&
            (p.head_dim - p.rotary_dim) % V == 0;
  for (const RopeOperand& o : p.operand) {
    ok = ok && aligned16<T>(o.in, {o.in_stride_b, o.in_stride_s, o.in_stride_h}) &&
         aligned16<T>(o.out, {o.out_stride_b, o.out_stride_s, o.out_stride_h});
  }
  return ok;
}

template <typename T>
Tiling make_tiling(const RopeProblem& p) {
  constexpr int64_t V = 16 / sizeof(T);
  Tiling t;
  t.rot_chunks = ceil_div(p.rotary_dim / 2, V);
  t.chunks = t.rot_chunks + ceil_div(p.head_dim - p.rotary_dim, V);
  // Windows narrower than a head row only where one token's table would take more than half a
  // buffer, so that a buffer always holds two tokens' tables: a tile no longer than a token's items
  // spans at most two tokens.
  const int64_t window_chunks = 2 * t.rot_chunks * V <= kTableEntries ? t.chunks : kTableEntries / (2 * V);
  const int64_t table_row = (t.rot_chunks < window_chunks ? t.rot_chunks : window_chunks) * V;
  const int64_t token_items = (p.operand[0].heads + p.operand[1].heads) * window_chunks;
  // L consecutive items span at most ceil((L - 1) / token_items) + 1 tokens, whose table rows
  // must fit a buffer: L <= (kTableEntries / table_row - 1) * token_items + 1.
  int64_t tile_items = kTileItems;
  if (table_row > 0) {
    const int64_t fit = (kTableEntries / table_row - 1) * token_items + 1;
    tile_items = fit < tile_items ? fit : tile_items;
  }
  t.window_chunks = Divisor(window_chunks);
  t.token_items = Divisor(token_items);
  t.window_items = p.batch * p.seq * token_items;
  t.table_row = Divisor(table_row);
  t.tile_items = tile_items;
  const int64_t window_tiles = ceil_div(t.window_items, tile_items);
  t.window_tiles = Divisor(window_tiles);
  t.tiles = window_tiles * ceil_div(t.chunks, window_chunks);
  t.seq = Divisor(p.seq);
  return t;
}

// Whether every index the kernel forms stays below 2^31, so that uint32_t holds it and the sum of
// any two, and the Divisors' method is exact: element offsets to a vector past each operand's last
// row, chunks of a row (and their elements), items of a window plus a tile, tiles plus the grid
// (at most the tiles).
bool fits_32bit(const RopeProblem& p, const Tiling& t) {
  constexpr int64_t kLimit = int64_t{1} << 31;
  bool ok = t.window_items + kTileItems < kLimit && 2 * t.tiles < kLimit &&
            (t.chunks + t.window_chunks.d) * 16 < kLimit;
  for (const RopeOperand& o : p.operand) {
    if (o.heads == 0) continue;
    const int64_t in_last =
        (p.batch - 1) * o.in_stride_b + (p.seq - 1) * o.in_stride_s + (o.heads - 1) * o.in_stride_h;
    const int64_t out_last =
        (p.batch - 1) * o.out_stride_b + (p.seq - 1) * o.out_stride_s + (o.heads - 1) * o.out_stride_h;
    ok = ok && in_last + p.head_dim + 16 < kLimit && out_last + p.head_dim + 16 < kLimit;
  }
  return ok;
}

// Blocks of KERNEL resident on the current device at once, cached per device so that a launch
// makes no occupancy query.
template <auto KERNEL>
int64_t resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cached[kMaxDevices];
  const int device = current_device();
  if (device < kMaxDevices) {
    const int64_t hit = cached[device].load(std::memory_order_relaxed);
    if (hit > 0) return hit;
  }
  const int64_t blocks = static_cast<int64_t>(multiprocessor_count(device)) *
                         max_active_blocks_per_multiprocessor(KERNEL, kBlockThreads);
  if (device < kMaxDevices) cached[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

template <typename T, RopeStyle STYLE, bool VEC, typename Index>
gpuError_t launch_kernel(const RopeProblem& p, const Tiling& t, bool inverse, gpuStream_t stream) {
  constexpr auto kernel = rope_kernel<T, STYLE, VEC, Index>;
  // A block per tile, at most as many as are resident at once: they then stride over the tiles.
  const int64_t resident = resident_blocks<kernel>();
  const unsigned grid = static_cast<unsigned>(t.tiles < resident ? t.tiles : resident);
  kernel<<<grid, kBlockThreads, 0, stream>>>(p, t, inverse);
  return gpu_last_error();
}

template <typename T, RopeStyle STYLE>
gpuError_t launch(const RopeProblem& p, bool inverse, gpuStream_t stream) {
  if (p.batch * p.seq == 0 || p.operand[0].heads + p.operand[1].heads == 0 || p.head_dim == 0) {
    return kGpuSuccess;
  }
  const Tiling t = make_tiling<T>(p);
  const bool narrow = fits_32bit(p, t);
  if (vector_io<T>(p)) {
    return narrow ? launch_kernel<T, STYLE, true, uint32_t>(p, t, inverse, stream)
                  : launch_kernel<T, STYLE, true, uint64_t>(p, t, inverse, stream);
  }
  return narrow ? launch_kernel<T, STYLE, false, uint32_t>(p, t, inverse, stream)
                : launch_kernel<T, STYLE, false, uint64_t>(p, t, inverse, stream);
}

gpuError_t rope_simt(DType dtype, const RopeProblem& p, bool inverse, gpuStream_t stream) {
  return dispatch_dtype<KernelTypes>(dtype, [&](auto tag) {
    using T = decltype(tag);
    return p.style == RopeStyle::kNeox ? launch<T, RopeStyle::kNeox>(p, inverse, stream)
                                       : launch<T, RopeStyle::kGptj>(p, inverse, stream);
  }, gpu_not_supported);
}

}  // namespace

gpuError_t rope_fwd_simt(DType dtype, const RopeProblem& p, gpuStream_t stream) {
  return rope_simt(dtype, p, false, stream);
}

gpuError_t rope_bwd_simt(DType dtype, const RopeProblem& p, gpuStream_t stream) {
  return rope_simt(dtype, p, true, stream);
}

}  // namespace rl_align
