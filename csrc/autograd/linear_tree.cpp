// Autograd of the tree-mode linear ops: none here. The differentiable tree-mode linear is
// rl_engine_ext.tree_linear (and the tensor-parallel layers, rl_engine_ext.tensor_parallel), whose
// backward pairs these ops with linear_grad_weight and the collectives.
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  rl_align::register_not_differentiable(m, {"linear_tree", "linear_tree_grad_input"});
}
