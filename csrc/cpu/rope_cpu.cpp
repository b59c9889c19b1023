// Torch binding of the rope CPU kernel (rope_cpu_kernels.cpp): the host flow is rope_run
// (host/rope.h); this backend supplies the kernel call.
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/rope.h"
#include "rope_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void check_input(const char* op, const at::Tensor& q) {
    TORCH_CHECK(q.device().is_cpu(), "rl_align::", op, " (CPU kernel): q must be a CPU tensor");
  }
  static void fwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q) {
    check_input(op, q);
    note_cpu_kernel("rope_fwd");
    rope_fwd_cpu(dtype, p);
  }
  static void bwd(const char* op, at::ScalarType dtype, const RopeProblem& p, const at::Tensor& q) {
    check_input(op, q);
    note_cpu_kernel("rope_bwd");
    rope_bwd_cpu(dtype, p);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("rope", &rope_impl<CpuBackend>);
  m.impl("rope_backward", &rope_backward_impl<CpuBackend>);
}

}  // namespace rl_align
