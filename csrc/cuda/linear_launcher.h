// The CUDA Backend (host/linear.h) of the linear launcher (linear_launcher.cpp), and the GEMMs
// linear_logprob's CUDA backend runs on (linear_logprob_launcher.cpp): path choice, device guard,
// current stream, dtype mapping. The GEMMs live in linear/sm90.cu (wgmma), linear/sm80.cu
// (mma.sync) and linear/simt.cu (FMA tiles, bias gradient).
//
// Path: chosen from (dtype, device) only: bf16/fp16 take sm90 on an sm_90a build running on
// compute capability 9.0, else sm80 on any CUDA GPU >= 8.0, else simt; fp32 always takes simt
// (true fp32, no TF32). RL_ENGINE_EXT_LINEAR_PATH=sm90|sm80|simt forces one (tests, benchmarks);
// forcing a path the device cannot run is an error, never a silent fallback.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "../host/linear.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "linear_kernels.h"

namespace rl_align {

inline const char* gemm_path_name(GemmPath path) {
  switch (path) {
    case GemmPath::kSm90: return "sm90";
    case GemmPath::kSm80: return "sm80";
    case GemmPath::kSimt: return "simt";
  }
  return "?";
}

inline GemmPath choose_gemm_path(const char* op, at::ScalarType dtype, int device) {
  const DType dt = kernel_dtype(dtype);
  constexpr GemmPath kPaths[] = {GemmPath::kSm90, GemmPath::kSm80, GemmPath::kSimt};
  const int forced = forced_path_index(op, "RL_ENGINE_EXT_LINEAR_PATH", {"sm90", "sm80", "simt"});
  if (forced >= 0) {
    const GemmPath path = kPaths[forced];
    TORCH_CHECK(gemm_path_available(path, dt, device), "rl_align::", op,
                ": RL_ENGINE_EXT_LINEAR_PATH=", gemm_path_name(path), " cannot run ", dtype_name(dtype),
                " on this device");
    return path;
  }
  for (GemmPath path : {GemmPath::kSm90, GemmPath::kSm80}) {
    if (gemm_path_available(path, dt, device)) return path;
  }
  return GemmPath::kSimt;
}

// RL_ENGINE_EXT_SM90_GEMM_CONFIG=<name> (kSm90GemmConfigNames) forces the sm90 tile configuration
// of the plain GEMMs; one that cannot take a problem's layout fails the launch.
inline Sm90GemmConfig forced_sm90_config(const char* op) {
  constexpr int kCount = static_cast<int>(sizeof(kSm90GemmConfigNames) / sizeof(kSm90GemmConfigNames[0]));
  return static_cast<Sm90GemmConfig>(
      forced_choice_index(op, "RL_ENGINE_EXT_SM90_GEMM_CONFIG", kSm90GemmConfigNames, kCount));
}

struct LinearCudaBackend {
  static bool needs_aligned_operands(const char* op, at::ScalarType dtype, const at::Tensor& t) {
    return choose_gemm_path(op, dtype, t.get_device()) != GemmPath::kSimt;
  }
  static void run(const char* op, at::ScalarType dtype, const GemmProblem& p, const at::Tensor& t) {
    const c10::cuda::CUDAGuard guard(t.device());
    const GemmPath path = choose_gemm_path(op, dtype, t.get_device());
    const gpuStream_t stream = at::cuda::getCurrentCUDAStream();
    note_gpu_kernel("linear_gemm", gemm_path_name(path));
    gpuError_t err;
    switch (path) {
      case GemmPath::kSm90: err = linear_gemm_sm90(kernel_dtype(dtype), p, stream, forced_sm90_config(op)); break;
      case GemmPath::kSm80: err = linear_gemm_sm80(kernel_dtype(dtype), p, stream); break;
      default: err = linear_gemm_simt(kernel_dtype(dtype), p, stream); break;
    }
    TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": ", gemm_path_name(path), " GEMM launch failed: ",
                gpu_error_string(err),
                path == GemmPath::kSm90 && forced_sm90_config(op) != Sm90GemmConfig::kAuto
                    ? " (RL_ENGINE_EXT_SM90_GEMM_CONFIG forces a tile configuration this layout cannot take)"
                    : "");
  }
  static void bias_grad(at::ScalarType dtype, const at::Tensor& dy, const float* accum, float* dbias) {
    const c10::cuda::CUDAGuard guard(dy.device());
    const at::Tensor workspace = at::empty(
        {linear_bias_bwd_workspace_elements(dy.size(0), dy.size(1))}, dy.options().dtype(at::kFloat));
    note_gpu_kernel("linear_bias_bwd", "simt");
    const gpuError_t err = linear_bias_bwd_simt(
        kernel_dtype(dtype), dy.const_data_ptr(), row_stride(dy), dy.size(0), dy.size(1), accum,
        dbias, workspace.mutable_data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == kGpuSuccess, "rl_align::linear_grad_bias: kernel launch failed: ",
                gpu_error_string(err));
  }
};

}  // namespace rl_align
