// Torch binding of the tree-mode linear ops on the GPU: the host flow is in host/linear_tree.h;
// the leaf GEMMs are the linear kernels (path choice as linear's, linear_launcher.h), the tree over
// the leaves is rank_sum's kernel.
#include <torch/library.h>

#include "../host/linear_tree.h"
#include "linear_launcher.h"
#include "rank_sum_kernels.h"

namespace rl_align {
namespace {

struct LinearTreeCudaBackend : LinearCudaBackend {
  static void fold(at::ScalarType dtype, const RankSumOperands& a) {
    note_gpu_kernel("rank_sum", "simt");
    check_launch("linear_tree", rank_sum_simt(kernel_dtype(dtype), a, at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("linear_tree", &linear_tree_impl<LinearTreeCudaBackend>);
  m.impl("linear_tree_grad_input", &linear_tree_grad_input_impl<LinearTreeCudaBackend>);
}

}  // namespace rl_align
