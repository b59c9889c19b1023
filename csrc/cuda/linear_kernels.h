// Host entry points of the linear (GEMM) GPU kernels. Torch-free: the problem is a
// GemmProblem (csrc/common/gemm_problem.h); the torch binding is linear_launcher.cpp.
#pragma once

#include <cstdint>

#include "../common/gemm_problem.h"
#include "../common/portability.h"

namespace rl_align {

// Kernel families. Which one runs is chosen from (dtype, device arch) only, never from m: each
// family fixes its own reduction chunking, so one family must serve every batch size.
enum class GemmPath : int {
  kSm90 = 0,  // wgmma + TMA (sm_90a build, compute capability 9.0), bf16/fp16
  kSm80 = 1,  // mma.sync m16n8k16 + ldmatrix + cp.async (any CUDA GPU >= sm_80), bf16/fp16
  kSimt = 2,  // FMA tiles, sequential k: fp32 everywhere, every dtype on HIP and older GPUs
};

// The tensor-core paths read A and B with 16-byte copies: both pointers 16-byte aligned and
// lda, ldb multiples of 16 bytes. Callers pad operands that are not (see linear_launcher.cpp).
constexpr int64_t kGemmOperandAlignBytes = 16;

// Whether `path` was compiled into this build and runs on `device` for `dtype`.
bool gemm_path_available(GemmPath path, DType dtype, int device);
// Whether this build holds sm_90a code for the wgmma kernels and `device` can run it.
bool gemm_sm90_compiled_for(int device);

// Entry points are named <op>_<fwd|bwd>_<path>, except the shared GEMM linear_gemm_<path>: one
// GemmProblem GEMM serves the forward (linear) and both gradients (linear_grad_input,
// linear_grad_weight), which differ only in operand layouts and output type (host/linear.h).
// The sm90 GEMM's tile configurations (linear/sm90.cu says what each is). kAuto picks one from
// the problem's shape; RL_ENGINE_EXT_SM90_GEMM_CONFIG=<name> forces one for the plain chain (tests
// prove every configuration gives the same bits; benchmarks compare their speed). A configuration
// that cannot take a problem's layout is an error (cudaErrorNotSupported), never replaced.
enum class Sm90GemmConfig : int {
  kAuto = -1,
  kDecode32,
  kDecode48,
  kDecode64,
  kMedium,
  kMediumPair,
  kWidePair,
  kLarge,
};
inline constexpr const char* kSm90GemmConfigNames[] = {"decode32",    "decode48",  "decode64", "medium",
                                                       "medium_pair", "wide_pair", "large"};
gpuError_t linear_gemm_sm90(DType dtype, const GemmProblem& p, gpuStream_t stream,
                            Sm90GemmConfig config = Sm90GemmConfig::kAuto);
// Whether the sm90 GEMM folds a tree of `leaves` leaves over k in one launch (p.tree_leaves):
// 2, 4 or 8 leaves of whole 64-deep k-blocks. Otherwise linear_tree runs one GEMM per leaf.
bool linear_gemm_sm90_tree_supported(int64_t k, int64_t leaves);
gpuError_t linear_gemm_sm80(DType dtype, const GemmProblem& p, gpuStream_t stream);
gpuError_t linear_gemm_simt(DType dtype, const GemmProblem& p, gpuStream_t stream);

// dbias[j] = accum[j] (or 0) + sum_i dy[i, j], over tiles of kLinearGradTileTokens rows: each
// tile summed sequentially in fp32, tiles added in row order. dy is (m x n), row stride ld.
int64_t linear_bias_bwd_workspace_elements(int64_t m, int64_t n);
gpuError_t linear_bias_bwd_simt(DType dtype, const void* dy, int64_t ld, int64_t m, int64_t n,
                                 const float* accum, float* dbias, float* workspace,
                                 gpuStream_t stream);

}  // namespace rl_align
