// CPU kernels of rms_norm, forward and backward. Torch types only at the interface (the dtype);
// the arithmetic each promises is spelled out below and in rms_norm_cpu_kernels.cpp.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/rms_norm_mode.h"

namespace rl_align {

// y[r, :] = the `mode` formula of common/rms_norm_mode.h (fp32 math; kFp32 rounds once), with
// inv_rms = 1 / sqrt(sum_sq / hidden + eps), sum_sq over the row in the fixed lane order of
// rms_norm_cpu_kernels.cpp. add_rms_norm (residual non-null): new_residual[r, :] =
// round(x + residual) is written first and normalised in place of x. Rows are *_row_stride
// elements apart; the last dim is dense. dtype: at::kFloat, at::kHalf, at::kBFloat16 (checked).
void rms_norm_fwd_cpu(at::ScalarType dtype, RmsNormMode mode, const void* x, int64_t x_row_stride,
                      const void* residual, int64_t residual_row_stride, const void* weight,
                      void* y, int64_t y_row_stride, void* new_residual,
                      int64_t new_residual_row_stride, int64_t rows, int64_t hidden, float eps);

// grad_x (dtype) and dweight_out (fp32): dweight_out = dweight_accum (or 0) + the sum over the
// row tiles of rms_norm_dweight_tile_rows(hidden) rows, each tile summed in row order, the tiles
// added in row order. dweight_accum may be null and may alias dweight_out. add_rms_norm
// (grad_residual non-null): grad_x = round(round(dx) + grad_residual), autograd's order.
void rms_norm_bwd_cpu(at::ScalarType dtype, RmsNormMode mode, const void* grad_out,
                      int64_t grad_out_row_stride, const void* grad_residual,
                      int64_t grad_residual_row_stride, const void* x, int64_t x_row_stride,
                      const void* weight, void* grad_x, int64_t grad_x_row_stride,
                      const float* dweight_accum, float* dweight_out, int64_t rows, int64_t hidden,
                      float eps);

}  // namespace rl_align
