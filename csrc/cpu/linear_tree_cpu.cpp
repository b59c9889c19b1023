// Torch binding of the tree-mode linear ops on CPU: the host flow is in host/linear_tree.h; the
// leaf GEMMs are the linear CPU kernels, the tree over the leaves is rank_sum's CPU kernel.
#include <torch/library.h>

#include "../host/linear_tree.h"
#include "../host/native_constants.h"
#include "../host/provenance.h"
#include "linear_cpu.h"
#include "rank_sum_cpu_kernels.h"

namespace rl_align {
namespace {

RL_ALIGN_NATIVE_CONSTANT(LINEAR_TREE_LEAVES, kLinearTreeLeaves);

struct LinearTreeCpuBackend : LinearCpuBackend {
  static bool fused_tree(const char*, at::ScalarType, const at::Tensor&, int64_t, int64_t) { return false; }
  static void fold(at::ScalarType dtype, const RankSumOperands& a) {
    note_cpu_kernel("rank_sum");
    rank_sum_cpu(dtype, a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("linear_tree", &linear_tree_impl<LinearTreeCpuBackend>);
  m.impl("linear_tree_grad_input", &linear_tree_grad_input_impl<LinearTreeCpuBackend>);
}

}  // namespace rl_align
