// The linear path table: which GEMM family (GemmPath, linear_kernels.h) this build and a device
// can run for a dtype. Host code only; the kernels live in simt.cu, sm80.cu and
// sm90.cu (which also answers gemm_sm90_compiled_for: only it knows its own cubin).
#include "../linear_kernels.h"

namespace rl_align {

bool gemm_path_available(GemmPath path, DType dtype, int device) {
  switch (path) {
    case GemmPath::kSimt: return true;
    case GemmPath::kSm90: return dtype != DType::kFloat32 && gemm_sm90_compiled_for(device);
    case GemmPath::kSm80: {
#if RL_ALIGN_HIP
      return false;
#else
      int major = 0;
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      return dtype != DType::kFloat32 && major >= 8;
#endif
    }
  }
  return false;
}

}  // namespace rl_align
