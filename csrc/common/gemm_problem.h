// The one GEMM problem every linear op reduces to, and the arithmetic every path promises.
// Torch-free: shared by the CPU kernels, the CUDA/HIP kernels and their torch bindings.
//
//   C[i, j] = round( bias[j] + acc_K )    acc_0 = c_accum[i, j] (or 0),
//                                         acc_{s+1} = acc_s + (chunk s of sum_k A[i, k] B[k, j])
//
// The reduction over k always runs from k = 0 upwards in chunks of the path's MMA depth
// (16 on tensor-core paths, 1 on the FMA paths), each chunk added to one fp32 accumulator in
// order. Nothing about the chunking depends on m, so row i of C depends only on row i of A
// (batch invariance), and resuming from c_accum at a chunk boundary continues the same chain
// (micro-batch chaining of weight gradients).
//
// The three linear GEMMs (x [M, K], weight [N, K], dy [M, N]):
//   forward      y  = x  @ W^T : A = x  (K-major), B = W (K-major), m=M, n=N, k=K
//   grad input   dx = dy @ W   : A = dy (K-major), B = W (MN-major), m=M, n=K, k=N
//   grad weight  dW = dy^T @ x : A = dy (MN-major), B = x (MN-major), m=N, n=K, k=M (tokens)
#pragma once

#include <cstdint>

namespace rl_align {

// Tree mode (linear_tree, linear_tree_grad_input; host/linear_tree.h): the reduction dimension is
// cut into L equal leaves, each reduced as above from zero, and the leaves added per element over
// the fixed binary tree ((l0 + l1) + (l2 + l3)) + ... in fp32 before the one rounding. A
// tensor-parallel split of that dimension over W ranks (W a power of two dividing L) gives each
// rank whole subtrees, and the invariant all-reduce's tree over ranks completes the same tree, so
// TP = 1, 2, 4, 8 give the same bits. kLinearTreeLeaves is the default (and the TP patch's) L.
constexpr int64_t kLinearTreeLeaves = 8;

// Tokens per chaining tile of the weight and bias gradients: micro-batches whose token counts
// are multiples of this chain bit for bit on every path (a multiple of every path's MMA depth).
constexpr int64_t kLinearGradTileTokens = 64;

// Grouped problems (grouped_linear; host/grouped_linear.h): `groups` experts whose
// ranges are given by group_offsets[groups + 1] in device memory, read as o'_0 = 0,
// o'_e = min(max(o_e, o'_{e-1}), rows), o'_groups = rows (valid offsets unchanged; never out of
// bounds otherwise). kRows: the rows of A and C (m) are cut into the ranges; group e multiplies
// by its own B at b + e * b_group_stride (forward, grad input: each row is the ungrouped GEMM's
// row). kReduction: the reduction (k, tokens) is cut into the ranges; group e's C (and c_accum)
// is at c + e * c_group_stride, its chain over its own tokens from its accumulator or zero, as
// an ungrouped GEMM over those tokens alone (weight gradients; an empty group: its accumulator or 0).
enum class GroupMode : int { kNone = 0, kRows = 1, kReduction = 2 };
// The most groups one grouped launch takes (the offsets table lives in shared memory).
constexpr int64_t kGroupedMaxGroups = 1024;

struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  // A (m x k). K-major: A[i, kk] = a[i * lda + kk]. MN-major: A[i, kk] = a[kk * lda + i].
  const void* a = nullptr;
  int64_t lda = 0;
  bool a_mn_major = false;
  // B (k x n). K-major: B[kk, j] = b[j * ldb + kk] (nn.Linear weight layout).
  //            MN-major: B[kk, j] = b[kk * ldb + j].
  const void* b = nullptr;
  int64_t ldb = 0;
  bool b_mn_major = false;
  // C (m x n), row-major: C[i, j] = c[i * ldc + j]; in the input dtype, or fp32 if c_fp32.
  void* c = nullptr;
  int64_t ldc = 0;
  bool c_fp32 = false;
  // Optional [n] bias in the input dtype, added in fp32 after the reduction, before rounding.
  const void* bias = nullptr;
  // Optional fp32 (m x n) start of the accumulator (row stride ldc); only with c_fp32. May alias c.
  // (A reduction split along k at chunk boundaries thus gives the unsplit bits: linear_logprob's
  // d hidden over vocabulary slices.)
  const float* c_accum = nullptr;
  // Tree mode in one launch (kernels that support it: linear_gemm_sm90_tree_supported): k is
  // tree_leaves equal leaves, each from zero, folded over the tree before the bias and the
  // rounding (or stored fp32). 0 or 1: the plain chain.
  int64_t tree_leaves = 0;
  // Grouped (see GroupMode above; kernels that support it: linear_gemm_sm90_grouped_supported).
  GroupMode group_mode = GroupMode::kNone;
  int64_t groups = 0;
  const void* group_offsets = nullptr;  // int32, or int64 with group_offsets_int64
  bool group_offsets_int64 = false;
  int64_t b_group_stride = 0;  // kRows: elements between the groups' B
  int64_t c_group_stride = 0;  // kReduction: elements between the groups' C / c_accum
};

}  // namespace rl_align
