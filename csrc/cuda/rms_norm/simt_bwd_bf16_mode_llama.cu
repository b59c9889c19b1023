// rms_norm_bwd_simt's bf16 kernels of casting mode llama, in a file of their own for build time
// (simt.cuh).
#include "simt.cuh"

template struct rl_align::RmsNormBwdSimt<rl_align::bfloat16_t, rl_align::RmsNormMode::kLlama>;
