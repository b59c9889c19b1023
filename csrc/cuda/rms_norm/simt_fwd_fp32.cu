// rms_norm_fwd_simt's fp32 kernels, in a file of their own for build time (simt.cuh).
#include "simt.cuh"

template struct rl_align::RmsNormFwdSimt<float>;
