// rms_norm_bwd_simt's fp32 kernels of casting mode fp32, in a file of their own for build time
// (simt.cuh).
#include "simt.cuh"

template struct rl_align::RmsNormBwdSimt<float, rl_align::RmsNormMode::kFp32>;
