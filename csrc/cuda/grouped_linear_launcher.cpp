// Torch binding of the grouped (mixture-of-experts) linear ops on the GPU: the host flow is in
// host/grouped_linear.h. On the sm90 path one grouped launch runs every expert, reading the
// offsets on the device (no synchronisation); on the other paths (sm80, simt) each expert's rows
// go through linear's GEMM, with the offsets copied to the host. Same bits either way.
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "../host/grouped_linear.h"
#include "linear_launcher.h"

namespace rl_align {
namespace {

// RL_ENGINE_EXT_GROUPED_LINEAR_FUSED=0 runs one GEMM per expert where the grouped launch would run
// (tests compare the two; the bits are the same).
constexpr const char* kGroupedEnv = "RL_ENGINE_EXT_GROUPED_LINEAR_FUSED";

struct GroupedLinearCudaBackend : LinearCudaBackend {
  static bool grouped(const char* op, at::ScalarType dtype, const at::Tensor& t, int64_t groups) {
    const char* env = std::getenv(kGroupedEnv);
    if (env != nullptr && std::string(env) == "0") return false;
    return choose_gemm_path(op, dtype, t.get_device()) == GemmPath::kSm90 && groups <= kGroupedMaxGroups;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("grouped_linear", &grouped_linear_impl<GroupedLinearCudaBackend>);
  m.impl("grouped_linear_grad_input", &grouped_linear_grad_input_impl<GroupedLinearCudaBackend>);
  m.impl("grouped_linear_grad_weight", &grouped_linear_grad_weight_impl<GroupedLinearCudaBackend>);
}

}  // namespace rl_align
