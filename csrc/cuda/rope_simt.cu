// rope GPU kernel, forward and backward (CUDA; HIP compiles the same source).
//
// A thread owns one chunk of one token: V = 16 / sizeof(T) rotation pairs, or V
// pass-through elements (rotary_dim..head_dim-1), for a group of heads of q and of k. It computes
// its pairs' cos/sin once (common/rope.h: full-accuracy sincosf) and applies them to every head of
// its group, kHeadUnroll heads' loads in flight at a time. Chunk of a NeoX token: pairs
// (cV + j, R/2 + cV + j) read as two vectors lo = [cV, cV + V), hi = [R/2 + cV, ...); GPT-J:
// pairs (2(cV + j), 2(cV + j) + 1) read as lo = [2cV, 2cV + V), hi = [2cV + V, 2cV + 2V).
//
// Invariance: each output element is computed by the same expressions of its own token's
// position and values whatever the grid (the head groups and the number of blocks follow the token
// count, which only changes which thread computes an element), and the vector and element load
// paths put the same values in the same slots.
#include "rope_kernels.h"

#include "../primitives/pack.h"

namespace rl_align {
namespace {

constexpr int kBlockThreads = 256;
// Two heads' loads in flight per thread and at least 3 blocks (768 threads) per SM, which caps
// registers at 80. Measured on the H100 (bf16, 16384 Qwen3-8B tokens, fraction of copy
// bandwidth, fwd): 0.843 against 0.802 for 4 heads x 2 blocks (128 registers) and 0.807 for
// 2 x 2; 4 heads x 3 blocks spills 400 bytes and falls to 0.315; 1 head x 4 blocks 0.69.
constexpr int kHeadUnroll = 2;
constexpr int kMinBlocksPerSm = 3;
// Threads per SM the head-group split aims for when tokens are few: about three waves of the 768
// resident threads, so that each thread has few heads (few dependent load rounds). Measured at
// 16384 tokens: 2048 and 1024 alike (0.84 of copy), 768 or fewer (one head group) 0.78.
constexpr int64_t kTargetThreadsPerSm = 2048;

// The part of a row a chunk reads: `V` elements from `off`, those below `end` valid (all of them
// on the vector path, where the host has checked that whole vectors fit).
struct Part {
  int64_t off, end;
};

template <typename T, int V, bool VEC>
__device__ __forceinline__ void load_part(Pack<T, V>& p, const T* row, Part part) {
  if constexpr (VEC) {
    if (part.off < part.end) p = *reinterpret_cast<const Pack<T, V>*>(row + part.off);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (part.off + j < part.end) p.v[j] = row[part.off + j];
    }
  }
}

template <typename T, int V, bool VEC>
__device__ __forceinline__ void store_part(const Pack<T, V>& p, T* row, Part part) {
  if constexpr (VEC) {
    if (part.off < part.end) *reinterpret_cast<Pack<T, V>*>(row + part.off) = p;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (part.off + j < part.end) row[part.off + j] = p.v[j];
    }
  }
}

// Heads [h0, h1) of operand o at token (b, s): load lo and hi, f(lo, hi) in registers, store.
template <typename T, int V, bool VEC, typename F>
__device__ __forceinline__ void for_heads(const RopeOperand& o, int64_t b, int64_t s, int64_t h0,
                                          int64_t h1, Part lo, Part hi, F f) {
  const T* in = static_cast<const T*>(o.in) + b * o.in_stride_b + s * o.in_stride_s;
  T* out = static_cast<T*>(o.out) + b * o.out_stride_b + s * o.out_stride_s;
  for (int64_t h = h0; h < h1; h += kHeadUnroll) {
    Pack<T, V> x[kHeadUnroll][2] = {};
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      if (h + u < h1) {
        load_part<T, V, VEC>(x[u][0], in + (h + u) * o.in_stride_h, lo);
        load_part<T, V, VEC>(x[u][1], in + (h + u) * o.in_stride_h, hi);
      }
    }
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      if (h + u < h1) {
        f(x[u][0], x[u][1]);
        store_part<T, V, VEC>(x[u][0], out + (h + u) * o.out_stride_h, lo);
        store_part<T, V, VEC>(x[u][1], out + (h + u) * o.out_stride_h, hi);
      }
    }
  }
}

// Head range of group `g` of `groups` over `heads` heads.
__device__ __forceinline__ void head_range(int64_t heads, int g, int groups, int64_t& h0, int64_t& h1) {
  const int64_t per = ceil_div(heads, groups);
  h0 = g * per < heads ? g * per : heads;
  h1 = h0 + per < heads ? h0 + per : heads;
}

// grid.x covers tokens x chunks (chunk fastest), grid.y the head groups.
template <typename T, RopeStyle STYLE, bool VEC>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm)
    rope_kernel(RopeProblem p, int rot_chunks, int chunks, bool inverse) {
  constexpr int V = 16 / sizeof(T);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t token = idx / chunks;
  if (token >= p.batch * p.seq) return;
  const int chunk = static_cast<int>(idx - token * chunks);
  const int64_t b = token / p.seq, s = token - b * p.seq;
  const int64_t half = p.rotary_dim / 2;
  int64_t h0[2], h1[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) head_range(p.operand[i].heads, blockIdx.y, gridDim.y, h0[i], h1[i]);

  if (chunk >= rot_chunks) {  // pass-through elements, copied bit for bit
    const Part part{p.rotary_dim + static_cast<int64_t>(chunk - rot_chunks) * V, p.head_dim};
    const Part none{0, 0};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      for_heads<T, V, VEC>(p.operand[i], b, s, h0[i], h1[i], part, none, [](Pack<T, V>&, Pack<T, V>&) {});
    }
    return;
  }

  const int64_t first = static_cast<int64_t>(chunk) * V;  // first frequency of the chunk
  const int64_t pos = rope_position(p, b, s);
  float c[V], sn[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    c[j] = 0.f;
    sn[j] = 0.f;
    if (first + j < half) rope_cos_sin(pos, p.inv_freq[first + j], p.scaling, inverse, c[j], sn[j]);
  }
  const Part lo = STYLE == RopeStyle::kNeox ? Part{first, half} : Part{2 * first, p.rotary_dim};
  const Part hi = STYLE == RopeStyle::kNeox ? Part{half + first, p.rotary_dim}
                                            : Part{2 * first + V, p.rotary_dim};
  const auto rotate = [&](Pack<T, V>& x_lo, Pack<T, V>& x_hi) {
    float x[2 * V], y[2 * V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      x[j] = Convert<T>::to_float(x_lo.v[j]);
      x[V + j] = Convert<T>::to_float(x_hi.v[j]);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {  // pair j: slots (j, V + j) for NeoX, (2j, 2j + 1) for GPT-J
      const int ia = STYLE == RopeStyle::kNeox ? j : 2 * j;
      const int ib = STYLE == RopeStyle::kNeox ? V + j : 2 * j + 1;
      rope_rotate(x[ia], x[ib], c[j], sn[j], y[ia], y[ib]);
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      x_lo.v[j] = Convert<T>::from_float(y[j]);
      x_hi.v[j] = Convert<T>::from_float(y[V + j]);
    }
  };
#pragma unroll  // q and k: compile-time indices keep h0/h1 in registers
  for (int i = 0; i < 2; ++i) for_heads<T, V, VEC>(p.operand[i], b, s, h0[i], h1[i], lo, hi, rotate);
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

template <typename T, RopeStyle STYLE>
gpuError_t launch(const RopeProblem& p, bool inverse, gpuStream_t stream) {
  constexpr int64_t V = 16 / sizeof(T);
  const int64_t tokens = p.batch * p.seq;
  const int rot_chunks = static_cast<int>(ceil_div(p.rotary_dim / 2, V));
  const int chunks = rot_chunks + static_cast<int>(ceil_div(p.head_dim - p.rotary_dim, V));
  if (tokens == 0 || chunks == 0) return kGpuSuccess;
  const int64_t threads = tokens * chunks;
  // Few tokens: split the heads into groups (grid.y) until the GPU is full. Which thread computes
  // an element never changes its value.
  const int64_t max_heads = p.operand[0].heads > p.operand[1].heads ? p.operand[0].heads : p.operand[1].heads;
  const int64_t target = static_cast<int64_t>(multiprocessor_count(current_device())) * kTargetThreadsPerSm;
  int64_t groups = ceil_div(target, threads);
  groups = groups < max_heads ? groups : max_heads;
  groups = groups < 65535 ? (groups > 0 ? groups : 1) : 65535;
  const dim3 grid(static_cast<unsigned>(ceil_div(threads, kBlockThreads)), static_cast<unsigned>(groups));
  if (vector_io<T>(p)) {
    rope_kernel<T, STYLE, true><<<grid, kBlockThreads, 0, stream>>>(p, rot_chunks, chunks, inverse);
  } else {
    rope_kernel<T, STYLE, false><<<grid, kBlockThreads, 0, stream>>>(p, rot_chunks, chunks, inverse);
  }
  return gpu_last_error();
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
