// Torch binding of the moe_router CPU kernels (moe_router_cpu_kernels.cpp): the host flow is in
// host/moe_router.h; this backend supplies the kernel calls and the family's native constants.
#include <torch/library.h>

#include "../host/moe_router.h"
#include "../host/native_constants.h"
#include "../host/provenance.h"
#include "moe_router_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void fwd(const at::Tensor& logits, const MoeRouterOperands& a) {
    note_cpu_kernel("moe_router_fwd");
    moe_router_fwd_cpu(logits.scalar_type(), a);
  }
  static void bwd(const at::Tensor& logits, const MoeRouterOperands& a) {
    note_cpu_kernel("moe_router_bwd");
    moe_router_bwd_cpu(logits.scalar_type(), a);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(MOE_ROUTER_MAX_EXPERTS, kMoeRouterMaxExperts);
RL_ALIGN_NATIVE_CONSTANT(MOE_ROUTER_MAX_TOP_K, kMoeRouterMaxTopK);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("moe_router", &moe_router_impl<CpuBackend>);
  m.impl("moe_router_backward", &moe_router_backward_impl<CpuBackend>);
}

}  // namespace rl_align
