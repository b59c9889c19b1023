// Ampere-class (sm_80+) tensor-core primitives shared by the mma.sync kernels (linear_sm80.cu,
// attention_sm80.cu): cp.async copies, ldmatrix, mma.sync m16n8k16 with fp32 accumulators.
// Device code only; defined where the target is sm_80 or newer (RL_ALIGN_SM80_DEVICE), so host
// passes and HIP builds see nothing but the macro test.
#pragma once

#include <cstdint>
#include <cstring>

#include "../common/portability.h"

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

}  // namespace rl_align
#endif  // RL_ALIGN_SM80_DEVICE
