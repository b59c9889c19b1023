// rms_norm_fwd_simt's bf16 kernels, in a file of their own for build time (rms_norm_simt.cuh).
#include "rms_norm_simt.cuh"

template struct rl_align::RmsNormFwdSimt<rl_align::bfloat16_t>;
