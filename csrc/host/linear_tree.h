// Host side of the tree-mode linear ops (linear_tree, linear_tree_grad_input), shared by the CPU
// and GPU bindings: argument checks and the flow. The arithmetic (common/gemm_problem.h, "Tree
// mode"): the reduction dimension is cut into `leaves` equal leaves; each leaf is one GemmProblem
// over its slice (the linear ops' own chain, from zero, fp32, unrounded); the leaves are added per
// element over the fixed binary tree of rank_sum (common/rank_sum.h: ((l0 + l1) + (l2 + l3)) ...),
// then the bias is added and the sum rounded once, or (partial) the fp32 sum is returned. A
// tensor-parallel rank holding leaves [r L / W, (r + 1) L / W) thus computes a whole subtree, and
// rank_sum over the W ranks' partials (the invariant all_reduce) completes the same tree.
//
// A Backend supplies the linear Backend's members (host/linear.h) and
//   static void fold(at::ScalarType dtype, const RankSumOperands& a);   // rank_sum's kernel
//   static bool fused_tree(const char* op, at::ScalarType dtype, const at::Tensor& t, int64_t k,
//                          int64_t leaves);  // one GemmProblem with tree_leaves runs the whole tree
// The fused kernel and the leaf-by-leaf flow give the same bits (the same leaf chains, the same
// adds); tests compare them.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../common/gemm_problem.h"
#include "../common/rank_sum.h"
#include "common.h"
#include "linear.h"

namespace rl_align {

inline void check_leaves(const char* op, int64_t leaves, int64_t reduced, const char* what) {
  TORCH_CHECK_VALUE(leaves >= 1 && leaves <= kRankSumMaxParts && (leaves & (leaves - 1)) == 0, "rl_align::", op,
                    ": leaves must be a power of two from 1 to ", kRankSumMaxParts, ", got ", leaves);
  TORCH_CHECK_VALUE(reduced % leaves == 0, "rl_align::", op, ": ", what, " (", reduced,
                    ") must be a multiple of leaves (", leaves, ")");
}

inline void check_linear_tree_args(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, int64_t leaves, bool partial) {
  constexpr const char* op = "linear_tree";
  check_linear_args(x, weight, bias, op);
  check_leaves(op, leaves, weight.size(1), "in_features");
  TORCH_CHECK_VALUE(!(partial && bias.has_value()), "rl_align::", op,
                    ": a partial (fp32 subtree) takes no bias: add it once, after the sum over ranks");
}

inline void check_linear_tree_grad_input_args(const at::Tensor& grad_out, const at::Tensor& weight,
                                              int64_t leaves) {
  check_grad_input_args(grad_out, weight, "linear_tree_grad_input");
  check_leaves("linear_tree_grad_input", leaves, weight.size(0), "out_features");
}

// Workspace bound: leaves x rows x n fp32 partials; rows are taken in chunks under it (a row's
// result depends on its own row only, so the chunking changes no bit).
constexpr int64_t kLinearTreeWorkspaceElements = int64_t{1} << 26;

// One leaf's GEMM: the problem and the operands it points into (a padded copy lives as long as this).
struct LeafGemm {
  Operand a, b;
  GemmProblem p;
};

inline LeafGemm leaf_gemm(const at::Tensor& a, const at::Tensor& b, bool b_mn_major, bool aligned) {
  LeafGemm g{gemm_operand(a, aligned), gemm_operand(b, aligned), GemmProblem()};
  g.p.m = g.a.rows.size(0);
  g.p.k = a.size(1);
  g.p.n = b_mn_major ? b.size(1) : b.size(0);
  g.p.a = g.a.rows.const_data_ptr(); g.p.lda = g.a.ld;
  g.p.b = g.b.rows.const_data_ptr(); g.p.ldb = g.b.ld; g.p.b_mn_major = b_mn_major;
  return g;
}

// out[rows, n] (allocated, contiguous; fp32 for partial, else the operands' dtype) = the tree over
// `leaves` leaves of the reduced dimension (`reduced` long). part(k_first, k_count, first, count)
// returns the LeafGemm of reduced-dimension range [k_first, k_first + k_count) for rows
// [first, first + count); this function points its output at out or into the workspace.
template <typename Backend, typename Part>
void tree_gemm(const char* op, int64_t rows, int64_t n, int64_t reduced, int64_t leaves,
               const std::optional<at::Tensor>& bias, bool partial, const at::Tensor& out,
               const at::Tensor& ref, Part part) {
  const at::ScalarType dtype = ref.scalar_type();
  if (leaves == 1 || Backend::fused_tree(op, dtype, ref, reduced, leaves)) {  // one launch
    LeafGemm g = part(0, reduced, 0, rows);
    const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
    g.p.tree_leaves = leaves;
    g.p.c = out.mutable_data_ptr(); g.p.ldc = n; g.p.c_fp32 = partial;
    g.p.bias = bias_c.defined() ? bias_c.const_data_ptr() : nullptr;
    Backend::run(op, dtype, g.p, ref);
    return;
  }
  const int64_t width = reduced / leaves;
  const int64_t chunk = std::max<int64_t>(1, kLinearTreeWorkspaceElements / (leaves * n));
  const int64_t first_chunk = std::min(chunk, rows);
  at::Tensor workspace = at::empty({leaves, first_chunk, n}, ref.options().dtype(at::kFloat));
  at::Tensor folded = partial ? at::Tensor() : at::empty({first_chunk, n}, ref.options().dtype(at::kFloat));
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat) : at::Tensor();
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    RankSumOperands a;
    a.parts = static_cast<int>(leaves);
    a.numel = count * n;
    for (int64_t l = 0; l < leaves; ++l) {
      LeafGemm g = part(l * width, width, first, count);
      g.p.c = workspace[l].mutable_data_ptr();
      g.p.ldc = n;
      g.p.c_fp32 = true;
      Backend::run(op, dtype, g.p, ref);
      a.part[l] = workspace[l].const_data_ptr();
    }
    const at::Tensor rows_out = out.narrow(0, first, count);
    if (partial) {
      a.out = rows_out.mutable_data_ptr();
      Backend::fold(at::kFloat, a);
      continue;
    }
    const at::Tensor sum = folded.narrow(0, 0, count);
    a.out = sum.mutable_data_ptr();
    Backend::fold(at::kFloat, a);
    if (bias_f.defined()) sum.add_(bias_f);  // fp32, after the whole sum, as the linear kernels
    rows_out.copy_(sum);                     // the one rounding (to nearest even)
  }
}

template <typename Backend>
at::Tensor linear_tree_impl(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, int64_t leaves, bool partial) {
  constexpr const char* op = "linear_tree";
  check_linear_tree_args(x, weight, bias, leaves, partial);
  const int64_t n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options()
                                          .dtype(partial ? at::kFloat : x.scalar_type())
                                          .memory_format(at::MemoryFormat::Contiguous));
  const int64_t m = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // an empty sum: the bias alone
    if (bias.has_value()) y.copy_(bias->expand_as(y)); else y.zero_();
    return y;
  }
  const at::Tensor x_rows = as_rows(x);
  const bool aligned = Backend::needs_aligned_operands(op, x.scalar_type(), x);
  tree_gemm<Backend>(op, m, n, k, leaves, bias, partial, y.view({m, n}), x,
                     [&](int64_t k_first, int64_t k_count, int64_t first, int64_t count) {
                       return leaf_gemm(x_rows.narrow(0, first, count).narrow(1, k_first, k_count),
                                        weight.narrow(1, k_first, k_count), false, aligned);
                     });
  return y;
}

template <typename Backend>
at::Tensor linear_tree_grad_input_impl(const at::Tensor& grad_out, const at::Tensor& weight,
                                       int64_t leaves, bool partial) {
  constexpr const char* op = "linear_tree_grad_input";
  check_linear_tree_grad_input_args(grad_out, weight, leaves);
  const int64_t n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> out_shape(grad_out.sizes().begin(), grad_out.sizes().end());
  out_shape.back() = k;
  at::Tensor dx = at::empty(out_shape, grad_out.options()
                                           .dtype(partial ? at::kFloat : grad_out.scalar_type())
                                           .memory_format(at::MemoryFormat::Contiguous));
  const int64_t m = n == 0 ? dx.numel() / std::max<int64_t>(k, 1) : grad_out.numel() / n;
  if (m == 0 || k == 0) return dx;
  if (n == 0) return dx.zero_();
  const at::Tensor dy_rows = as_rows(grad_out);
  const bool aligned = Backend::needs_aligned_operands(op, grad_out.scalar_type(), grad_out);
  tree_gemm<Backend>(op, m, k, n, leaves, std::nullopt, partial, dx.view({m, k}), grad_out,
                     [&](int64_t n_first, int64_t n_count, int64_t first, int64_t count) {
                       return leaf_gemm(dy_rows.narrow(0, first, count).narrow(1, n_first, n_count),
                                        weight.narrow(0, n_first, n_count), true, aligned);
                     });
  return dx;
}

}  // namespace rl_align
