// Torch binding of the linear GPU kernels: path choice, device guard, current stream, dtype
// mapping. The GEMMs live in linear_sm90.cu (wgmma), linear_sm80.cu (mma.sync) and
// linear_simt.cu (FMA tiles, bias gradient). linear_logprob runs on the same backend and on
// logprob's kernels (host/linear_logprob.h).
//
// Path: chosen from (dtype, device) only: bf16/fp16 take sm90 on an sm_90a build running on
// compute capability 9.0, else sm80 on any CUDA GPU >= 8.0, else simt; fp32 always takes simt
// (true fp32, no TF32). RL_ENGINE_EXT_LINEAR_PATH=sm90|sm80|simt forces one (tests, benchmarks);
// forcing a path the device cannot run is an error, never a silent fallback.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../host/linear.h"
#include "../host/linear_logprob.h"
#include "launcher_util.h"
#include "linear_kernels.h"
#include "logprob_kernels.h"

namespace rl_align {
namespace {

const char* path_name(GemmPath path) {
  switch (path) {
    case GemmPath::kSm90: return "sm90";
    case GemmPath::kSm80: return "sm80";
    case GemmPath::kSimt: return "simt";
  }
  return "?";
}

GemmPath choose_path(const char* op, at::ScalarType dtype, int device) {
  const DType dt = kernel_dtype(dtype);
  constexpr GemmPath kPaths[] = {GemmPath::kSm90, GemmPath::kSm80, GemmPath::kSimt};
  const int forced = forced_path_index(op, "RL_ENGINE_EXT_LINEAR_PATH", {"sm90", "sm80", "simt"});
  if (forced >= 0) {
    const GemmPath path = kPaths[forced];
    TORCH_CHECK(gemm_path_available(path, dt, device), "rl_align::", op,
                ": RL_ENGINE_EXT_LINEAR_PATH=", path_name(path), " cannot run ", dtype_name(dtype),
                " on this device");
    return path;
  }
  for (GemmPath path : {GemmPath::kSm90, GemmPath::kSm80}) {
    if (gemm_path_available(path, dt, device)) return path;
  }
  return GemmPath::kSimt;
}

struct CudaBackend {
  static bool needs_aligned_operands(const char* op, at::ScalarType dtype, const at::Tensor& t) {
    return choose_path(op, dtype, t.get_device()) != GemmPath::kSimt;
  }
  static void run(const char* op, at::ScalarType dtype, const GemmProblem& p, const at::Tensor& t) {
    const c10::cuda::CUDAGuard guard(t.device());
    const GemmPath path = choose_path(op, dtype, t.get_device());
    const gpuStream_t stream = at::cuda::getCurrentCUDAStream();
    gpuError_t err;
    switch (path) {
      case GemmPath::kSm90: err = linear_gemm_sm90(kernel_dtype(dtype), p, stream); break;
      case GemmPath::kSm80: err = linear_gemm_sm80(kernel_dtype(dtype), p, stream); break;
      default: err = linear_gemm_simt(kernel_dtype(dtype), p, stream); break;
    }
    TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": ", path_name(path),
                " GEMM launch failed: ", gpu_error_string(err));
  }
  static void bias_grad(at::ScalarType dtype, const at::Tensor& dy, const float* accum, float* dbias) {
    const c10::cuda::CUDAGuard guard(dy.device());
    const at::Tensor workspace = at::empty(
        {linear_bias_bwd_workspace_elements(dy.size(0), dy.size(1))}, dy.options().dtype(at::kFloat));
    const gpuError_t err = linear_bias_bwd_simt(
        kernel_dtype(dtype), dy.const_data_ptr(), row_stride(dy), dy.size(0), dy.size(1), accum,
        dbias, workspace.mutable_data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == kGpuSuccess, "rl_align::linear_grad_bias: kernel launch failed: ",
                gpu_error_string(err));
  }
  static void logprob_grad(const at::Tensor& logits, const LogprobOperands& a) {
    const c10::cuda::CUDAGuard guard(logits.device());
    check_launch("linear_logprob_backward", logprob_bwd_simt(kernel_dtype(logits.scalar_type()), a,
                                                             at::cuda::getCurrentCUDAStream()));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("linear", &linear_impl<CudaBackend>);
  m.impl("linear_grad_input", &linear_grad_input_impl<CudaBackend>);
  m.impl("linear_grad_weight", &linear_grad_weight_impl<CudaBackend>);
  m.impl("linear_grad_bias", &linear_grad_bias_impl<CudaBackend>);
  m.impl("linear_logprob", &linear_logprob_impl<CudaBackend>);
  m.impl("linear_logprob_backward", &linear_logprob_backward_impl<CudaBackend>);
}

}  // namespace rl_align
