// The attention path table: which kernel family (AttentionPath, attention_kernels.h) this build
// and a device can run for a (dtype, head_dim). Host code only; the kernels live in
// attention_simt.cu, attention_sm80*.cu and attention_sm90*.cu (which also answers
// attention_sm90_compiled_for: only it knows its own cubin).
#include "attention_kernels.h"

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

}  // namespace rl_align
