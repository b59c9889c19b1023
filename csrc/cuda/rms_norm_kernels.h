// Host entry points of the rms_norm GPU kernels. Torch-free: raw pointers, the portability
// layer's dtype enum and stream type. The torch binding is rms_norm_launcher.cpp.
#pragma once

#include <cstdint>

#include "../common/portability.h"
#include "../common/rms_norm_mode.h"
#include "../common/rms_norm_partition.h"

namespace rl_align {

// y[r, :] = the `mode` formula of common/rms_norm_mode.h with inv_rms = rsqrt(mean(x[r, :]^2) +
// eps), fp32 math. add_rms_norm (residual non-null): new_residual[r, :] = round(x + residual) is
// written and normalised in place of x. Rows are *_row_stride elements apart; the last dim is
// dense.
gpuError_t rms_norm_fwd_simt(DType dtype, RmsNormMode mode, const void* x, int64_t x_row_stride,
                             const void* residual, int64_t residual_row_stride,
                             const void* weight, void* y, int64_t y_row_stride,
                             void* new_residual, int64_t new_residual_row_stride, int64_t rows,
                             int64_t hidden, float eps, gpuStream_t stream);

// Number of fp32 elements of scratch that rms_norm_bwd_simt needs (the per-tile dweight sums).
int64_t rms_norm_bwd_workspace_elements(int64_t rows, int64_t hidden);

// dx (dtype of x) and dweight (fp32): dweight_out = dweight_accum (or 0) + sum over row tiles,
// the tiles added in row order. `dweight_accum` may be null and may alias `dweight_out`.
// add_rms_norm_backward (grad_residual non-null): dx = round(round(dx) + grad_residual).
gpuError_t rms_norm_bwd_simt(DType dtype, RmsNormMode mode, const void* grad_out,
                             int64_t grad_out_row_stride, const void* grad_residual,
                             int64_t grad_residual_row_stride, const void* x,
                             int64_t x_row_stride, const void* weight, void* grad_x,
                             int64_t grad_x_row_stride, const float* dweight_accum,
                             float* dweight_out, float* workspace, int64_t rows, int64_t hidden,
                             float eps, gpuStream_t stream);

}  // namespace rl_align
