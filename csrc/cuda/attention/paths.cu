// The attention path table: which kernel family (AttentionPath, attention_kernels.h) this build
// and a device can run for a (dtype, head_dim), and which layouts the sm90 path's tensor maps
// address. Host code only; the kernels live in simt.cu, sm80_*.cu and sm90_*.cu (sm90_fwd.cu also
// answers attention_sm90_compiled_for: only it knows its own cubin).
#include "../attention_kernels.h"
#include "sm90_common.h"

namespace rl_align {

bool attention_path_available(AttentionPath path, DType dtype, int64_t head_dim, int device) {
  switch (path) {
    case AttentionPath::kSimt: return head_dim >= 1 && head_dim <= kAttentionSimtMaxHeadDim;
    case AttentionPath::kSm90:
      return dtype != DType::kFloat32 && (head_dim == 64 || head_dim == 128) && attention_sm90_compiled_for(device);
    case AttentionPath::kSm80: {
#if RL_ALIGN_HIP
      (void)dtype;
      (void)device;
      return false;
#else
      int major = 0;
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      return dtype != DType::kFloat32 && major >= 8 && (head_dim == 64 || head_dim == 128);
#endif
    }
  }
  return false;
}

std::string attention_sm90_layout_problem(const AttentionProblem& p, bool backward) {
#if RL_ALIGN_HIP
  (void)p;
  (void)backward;
  return "the sm90 kernels are not built for HIP";
#else
  OperandMap at;
  const char* why = nullptr;
  if (backward) {
    why = q_map_problem(p, &at);
    if (why != nullptr) return std::string("q's and dout's layout: ") + why;
  }
  why = kv_map_problem(p, &at);
  if (why != nullptr) return std::string("k's and v's layout: ") + why;
  return std::string();
#endif
}

}  // namespace rl_align
