// Ampere-class (sm_80+) tensor-core primitives shared by the mma.sync kernels (linear/sm80.cu,
// attention/sm80_fwd.cu, attention/sm80_bwd.cu): tile constants and an alignment test (host and
// device), and device code defined only where the target is sm_80 or newer
// (RL_ALIGN_SM80_DEVICE): cp.async copies, ldmatrix and its per-lane addresses, mma.sync m16n8k16
// with fp32 accumulators, fp32 -> bf16/fp16 fragment packing, ex2.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "../common/portability.h"

namespace rl_align {

// mma.sync.m16n8k16 on 2-byte operands (bf16 / fp16), copied and loaded in 16-byte units (one
// cp.async, one ldmatrix row).
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;
constexpr int kElemBytes = 2;
constexpr int kChunkElems = 16 / kElemBytes;
// Shared-memory rows are padded by 16 bytes: the row pitch is then an odd number of 16-byte
// units, so the 8 row addresses of one ldmatrix 8x8 matrix (same column, 8 consecutive rows) fall
// in 8 different 16-byte bank groups (conflict-free), for both K-major and MN-major tiles.
constexpr int kPadElems = kChunkElems;

// Operands the 16-byte copies read in place: non-null and 16-byte aligned.
inline bool aligned16(const void* ptr) {
  return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

#if !RL_ALIGN_HIP
// Raises `kernel`'s dynamic shared-memory limit to `bytes` (past the 48 KB default) once per
// device: `raised` (one per kernel instantiation) holds bit d once device d has been raised.
template <typename Kernel>
gpuError_t allow_dynamic_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& raised) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  const int device = current_device();
  const uint64_t bit = device >= 0 && device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (raised.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const gpuError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) raised.fetch_or(bit, std::memory_order_relaxed);
  return err;
}
#endif  // !RL_ALIGN_HIP

}  // namespace rl_align

#if !RL_ALIGN_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RL_ALIGN_SM80_DEVICE 1
#endif

#ifdef RL_ALIGN_SM80_DEVICE
namespace rl_align {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that reads only the first `src_bytes` (0..16) bytes of `src` and
// writes zeros to the rest of the 16 destination bytes. src_bytes = 0 reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix.x4: lanes 8q..8q+7 give the addresses of the 8 rows (16 bytes each) of matrix q, and
// r[q] receives matrix q. Without .trans lane l holds row l/4, columns 2(l%4), 2(l%4)+1 of the
// matrix as stored; with .trans it holds rows 2(l%4), 2(l%4)+1 of column l/4 (the stored matrix
// transposed). The lower 16 bits hold the first of the two elements.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d = A (16x16) B (16x8) + d, fp32 accumulate.
// Fragments (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4, t = lane % 4, each .b32 register holding two 16-bit elements (lower half first):
//   A: a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//      a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B: b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C/D: d[0], d[1] = D[g][2t, 2t+1]   d[2], d[3] = D[g+8][2t, 2t+1]
template <typename T>
struct Mma;

template <>
struct Mma<bfloat16_t> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <>
struct Mma<half_t> {
  __device__ __forceinline__ static void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(T x, T y) {
  struct alignas(4) Pair {
    T x, y;
  } pair{x, y};
  uint32_t bits;
  memcpy(&bits, &pair, sizeof(bits));
  return bits;
}

// 2^x, approximate (ex2.approx.ftz: subnormal results flush to +0, ex2(-inf) = +0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack_rounded(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack_rounded<bfloat16_t>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack_rounded<half_t>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The m16n8 accumulators of n8 tiles 2 kc and 2 kc + 1, rounded to the input dtype, as the m16k16
// A fragment of k16 chunk kc (PTX fragment order: a[1] rows + 8, a[2] columns + 8).
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_rounded<T>(lo[0], lo[1]);
  a[1] = pack_rounded<T>(lo[2], lo[3]);
  a[2] = pack_rounded<T>(hi[0], hi[1]);
  a[3] = pack_rounded<T>(hi[2], hi[3]);
}

// ------------------------------------------------------------------------------------------------
// Shared -> registers: per-lane ldmatrix.x4 addresses (lane l feeds row l % 8 of matrix l / 8) in
// a tile stored [row][d] with pitch PITCH_BYTES.
// ------------------------------------------------------------------------------------------------
// A operand, rows = m (no trans): matrix q = rows 8 (q & 1) + r, columns 8 (q >> 1): r[q] = a[q]
//   of the m16 x k16 fragment at (row0, column 0).
template <int PITCH_BYTES>
__device__ __forceinline__ uint32_t a_lane_offset(int lane, int row0) {
  const int r = lane % 8, q = lane / 8;
  return (row0 + 8 * (q & 1) + r) * PITCH_BYTES + 8 * (q >> 1) * kElemBytes;
}

// B operand with rows = n (B[k][n] = tile[n][k], no trans): matrix q = rows 8 (q >> 1) + r,
//   columns 8 (q & 1); lane holds row g, columns 2t, 2t + 1: r[0], r[1] = b[0], b[1] of n8 tile
//   rows 0..7 and r[2], r[3] = b[0], b[1] of rows 8..15.
template <int PITCH_BYTES>
__device__ __forceinline__ uint32_t bn_lane_offset(int lane) {
  const int r = lane % 8, q = lane / 8;
  return (8 * (q >> 1) + r) * PITCH_BYTES + 8 * (q & 1) * kElemBytes;
}

// B operand with rows = k (B[k][n] = tile[k][n], trans): matrix q = rows 8 (q & 1) + r, columns
//   8 (q >> 1); .trans gives rows 2t, 2t + 1 of column g: r[0], r[1] = b[0], b[1] of n8 tile
//   columns 0..7 and r[2], r[3] of columns 8..15.
template <int PITCH_BYTES>
__device__ __forceinline__ uint32_t bk_lane_offset(int lane) {
  const int r = lane % 8, q = lane / 8;
  return (8 * (q & 1) + r) * PITCH_BYTES + 8 * (q >> 1) * kElemBytes;
}

}  // namespace rl_align
#endif  // RL_ALIGN_SM80_DEVICE
