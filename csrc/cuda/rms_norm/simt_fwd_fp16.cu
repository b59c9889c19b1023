// rms_norm_fwd_simt's fp16 kernels, in a file of their own for build time (simt.cuh).
#include "simt.cuh"

template struct rl_align::RmsNormFwdSimt<rl_align::half_t>;
