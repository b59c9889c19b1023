// Torch binding of the tree-mode linear ops on the GPU: the host flow is in host/linear_tree.h;
// the leaf GEMMs are the linear kernels (path choice as linear's, linear_launcher.h), the tree over
// the leaves is rank_sum's kernel.
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "../host/linear_tree.h"
#include "linear_launcher.h"
#include "rank_sum_kernels.h"

namespace rl_align {
namespace {

// RL_ENGINE_EXT_LINEAR_TREE_FUSED=0 runs the leaf-by-leaf flow where the fused kernel would run
// (tests compare the two; the bits are the same).
constexpr const char* kFusedTreeEnv = "RL_ENGINE_EXT_LINEAR_TREE_FUSED";

struct LinearTreeCudaBackend : LinearCudaBackend {
  static bool fused_tree(const char* op, at::ScalarType dtype, const at::Tensor& t, int64_t k, int64_t leaves) {
    const char* env = std::getenv(kFusedTreeEnv);
    if (env != nullptr && std::string(env) == "0") return false;
    return choose_gemm_path(op, dtype, t.get_device()) == GemmPath::kSm90 &&
           linear_gemm_sm90_tree_supported(k, leaves);
  }
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
