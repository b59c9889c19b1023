// rms_norm_bwd_simt's fp16 kernels of casting mode gemma, in a file of their own for build time
// (simt.cuh).
#include "simt.cuh"

template struct rl_align::RmsNormBwdSimt<rl_align::half_t, rl_align::RmsNormMode::kGemma>;
