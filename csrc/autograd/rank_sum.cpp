// Autograd of rank_sum: none. It is the invariant collectives' building block (rl_engine_ext.distributed),
// which, like torch.distributed's collectives, records no graph.
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  rl_align::register_not_differentiable(m, {"rank_sum"});
}
