// The casting modes of rms_norm and add_rms_norm: the per-element formulas, written once for the
// CPU and the GPU kernels (docs/design.md, "rms_norm"). Pure C++ (no torch); `round` is the
// caller's fp32 -> storage dtype -> fp32 rounding.
//
// With xhat = x * inv_rms, inv_rms = 1 / sqrt(mean(x^2) + eps), every product an fp32 product:
//   kFp32  (ours, the default): y = round(xhat * w)                        (one rounding)
//   kLlama (HF LlamaRMSNorm / Qwen3RMSNorm): y = round(round(xhat) * w)    (two roundings)
//   kGemma (HF GemmaRMSNorm): y = round(xhat * (1 + w)), 1 + w in fp32
// Backward (the exact derivative of each formula, ignoring the roundings):
//   gw = dy * w (kFp32, kLlama) or dy * (1 + w) (kGemma)
//   dx = inv_rms * (gw - xhat * mean(gw * xhat))
//   dweight = sum over rows of dy * xhat (kFp32, kGemma) or dy * round(xhat) (kLlama: the h
//   that the forward multiplied by w)
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RL_ALIGN_NORM_INLINE __host__ __device__ __forceinline__
#else
#define RL_ALIGN_NORM_INLINE inline
#endif

namespace rl_align {

// The values are the kernels' template arguments; the names are the schemas' `mode` strings.
enum class RmsNormMode : int { kFp32 = 0, kLlama = 1, kGemma = 2 };

constexpr const char* kRmsNormModeNames[] = {"fp32", "llama", "gemma"};
constexpr int kRmsNormModes = 3;

// The weight factor of the forward and of gw: w, or 1 + w for kGemma.
template <RmsNormMode MODE>
RL_ALIGN_NORM_INLINE float rms_norm_weight_factor(float w) {
  if constexpr (MODE == RmsNormMode::kGemma) return 1.f + w;
  return w;
}

// The fp32 value of y before its final rounding; xhat = x * inv_rms.
template <RmsNormMode MODE, typename Round>
RL_ALIGN_NORM_INLINE float rms_norm_output(float xhat, float w, Round round) {
  if constexpr (MODE == RmsNormMode::kLlama) return round(xhat) * w;
  return xhat * rms_norm_weight_factor<MODE>(w);
}

// The factor of dy in dweight's sum.
template <RmsNormMode MODE, typename Round>
RL_ALIGN_NORM_INLINE float rms_norm_dweight_factor(float xhat, Round round) {
  if constexpr (MODE == RmsNormMode::kLlama) return round(xhat);
  return xhat;
}

template <RmsNormMode MODE>
struct RmsNormModeTag {
  static constexpr RmsNormMode value = MODE;
};

// Host side: f(RmsNormModeTag<MODE>{}) for a runtime mode.
template <typename F>
auto dispatch_rms_norm_mode(RmsNormMode mode, F&& f) {
  switch (mode) {
    case RmsNormMode::kLlama: return f(RmsNormModeTag<RmsNormMode::kLlama>{});
    case RmsNormMode::kGemma: return f(RmsNormModeTag<RmsNormMode::kGemma>{});
    default: return f(RmsNormModeTag<RmsNormMode::kFp32>{});  // the host checked the mode
  }
}

}  // namespace rl_align
