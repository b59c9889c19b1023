// RMSNorm CPU kernels.
//
// Invariance: each row is reduced in a fixed order (kLanes interleaved fp32 partial sums, then a
// fixed pairwise combine), and at::parallel_for only splits the rows, so neither the number of
// rows nor the number of threads changes any row's arithmetic. dweight uses the same row tiles
// as the GPU (rms_norm_dweight_tile_rows): rows summed in order inside a tile, tiles added to the
// accumulator in order.
#include "rms_norm_cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../common/rms_norm_partition.h"
#include "cpu_dtype_dispatch.h"

namespace rl_align {
namespace {

// Interleaved partial sums let the compiler vectorise the loop while keeping a fixed order.
constexpr int64_t kLanes = 16;

// sum_h term(h) in a fixed order: kLanes interleaved fp32 partial sums (lane j takes h = j mod
// kLanes, in increasing h), then a fixed pairwise combine of the lanes.
template <typename Term>
float lane_sum(int64_t hidden, Term term) {
  float lanes[kLanes] = {};
  int64_t h = 0;
  for (; h + kLanes <= hidden; h += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += term(h + j);
  }
  for (int64_t j = 0; h + j < hidden; ++j) lanes[j] += term(h + j);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

template <typename T>
float sum_squares(const T* x, int64_t hidden) {
  return lane_sum(hidden, [x](int64_t h) {
    const float v = static_cast<float>(x[h]);
    return v * v;
  });
}

// sum_h dy[h] * weight_factor(w[h]) * x[h], in the same lane order as sum_squares.
template <RmsNormMode MODE, typename T>
float sum_grad_weight_x(const T* dy, const T* w, const T* x, int64_t hidden) {
  return lane_sum(hidden, [dy, w, x](int64_t h) {
    return static_cast<float>(dy[h]) * rms_norm_weight_factor<MODE>(static_cast<float>(w[h])) *
           static_cast<float>(x[h]);
  });
}

// fp32 -> T -> fp32: the roundings of the llama mode and of add_rms_norm.
template <typename T>
float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float inv_rms_of(float sum_sq, int64_t hidden, float eps) {
  return 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
}

template <typename T, RmsNormMode MODE>
void rms_norm_fwd_kernel(const T* x, int64_t x_row_stride, const T* res, int64_t res_row_stride,
                         const T* w, T* y, int64_t y_row_stride, T* new_res,
                         int64_t new_res_row_stride, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_row_stride;
      if (res != nullptr) {
        // add_rms_norm normalises the rounded sum it returns (== rms_norm(x + residual)).
        T* nr = new_res + r * new_res_row_stride;
        const T* rr = res + r * res_row_stride;
        for (int64_t h = 0; h < hidden; ++h) {
          nr[h] = static_cast<T>(static_cast<float>(xr[h]) + static_cast<float>(rr[h]));
        }
        xr = nr;
      }
      T* yr = y + r * y_row_stride;
      const float inv_rms = inv_rms_of(sum_squares(xr, hidden), hidden, eps);
      for (int64_t h = 0; h < hidden; ++h) {
        yr[h] = static_cast<T>(rms_norm_output<MODE>(static_cast<float>(xr[h]) * inv_rms,
                                                     static_cast<float>(w[h]), round_to<T>));
      }
    }
  });
}

template <typename T, RmsNormMode MODE>
void rms_norm_bwd_kernel(const T* dy, int64_t dy_row_stride, const T* dres, int64_t dres_row_stride,
                         const T* x, int64_t x_row_stride, const T* w, T* dx,
                         int64_t dx_row_stride, const float* dweight_accum, float* dweight_out,
                         int64_t rows, int64_t hidden, float eps) {
  const int64_t tile_rows = rms_norm_dweight_tile_rows(hidden);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  std::vector<float> tile_sums(static_cast<size_t>(tiles * hidden), 0.f);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* acc = tile_sums.data() + t * hidden;
      const int64_t last = std::min(rows, (t + 1) * tile_rows);
      for (int64_t r = t * tile_rows; r < last; ++r) {
        const T* xr = x + r * x_row_stride;
        const T* dyr = dy + r * dy_row_stride;
        T* dxr = dx + r * dx_row_stride;
        const T* dresr = dres != nullptr ? dres + r * dres_row_stride : nullptr;
        const float inv_rms = inv_rms_of(sum_squares(xr, hidden), hidden, eps);
        // dx = inv_rms * (gw - xhat * c), gw = dy * weight_factor(w), c = mean(gw * xhat)
        const float c =
            sum_grad_weight_x<MODE>(dyr, w, xr, hidden) * inv_rms / static_cast<float>(hidden);
        for (int64_t h = 0; h < hidden; ++h) {
          const float xhat = static_cast<float>(xr[h]) * inv_rms;
          const float g = static_cast<float>(dyr[h]);
          const T d = static_cast<T>(
              inv_rms * (g * rms_norm_weight_factor<MODE>(static_cast<float>(w[h])) - xhat * c));
          dxr[h] = dresr != nullptr
                       ? static_cast<T>(static_cast<float>(d) + static_cast<float>(dresr[h]))
                       : d;
          acc[h] += g * rms_norm_dweight_factor<MODE>(xhat, round_to<T>);
        }
      }
    }
  });
  at::parallel_for(0, hidden, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float total = dweight_accum != nullptr ? dweight_accum[h] : 0.f;
      for (int64_t t = 0; t < tiles; ++t) total += tile_sums[t * hidden + h];
      dweight_out[h] = total;
    }
  });
}

}  // namespace

void rms_norm_fwd_cpu(at::ScalarType dtype, RmsNormMode mode, const void* x, int64_t x_row_stride,
                      const void* residual, int64_t residual_row_stride, const void* weight,
                      void* y, int64_t y_row_stride, void* new_residual,
                      int64_t new_residual_row_stride, int64_t rows, int64_t hidden, float eps) {
  dispatch_cpu_dtype("rms_norm", dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_rms_norm_mode(mode, [&](auto mode_tag) {
      rms_norm_fwd_kernel<T, decltype(mode_tag)::value>(
          static_cast<const T*>(x), x_row_stride, static_cast<const T*>(residual),
          residual_row_stride, static_cast<const T*>(weight), static_cast<T*>(y), y_row_stride,
          static_cast<T*>(new_residual), new_residual_row_stride, rows, hidden, eps);
    });
  });
}

void rms_norm_bwd_cpu(at::ScalarType dtype, RmsNormMode mode, const void* grad_out,
                      int64_t grad_out_row_stride, const void* grad_residual,
                      int64_t grad_residual_row_stride, const void* x, int64_t x_row_stride,
                      const void* weight, void* grad_x, int64_t grad_x_row_stride,
                      const float* dweight_accum, float* dweight_out, int64_t rows, int64_t hidden,
                      float eps) {
  dispatch_cpu_dtype("rms_norm_backward", dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_rms_norm_mode(mode, [&](auto mode_tag) {
      rms_norm_bwd_kernel<T, decltype(mode_tag)::value>(
          static_cast<const T*>(grad_out), grad_out_row_stride,
          static_cast<const T*>(grad_residual), grad_residual_row_stride,
          static_cast<const T*>(x), x_row_stride, static_cast<const T*>(weight),
          static_cast<T*>(grad_x), grad_x_row_stride, dweight_accum, dweight_out, rows, hidden,
          eps);
    });
  });
}

}  // namespace rl_align
