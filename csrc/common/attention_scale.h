// The softmax scale an attention op uses. Torch-free, so that the autograd Functions (which save
// it for the backward) take it without the attention host flow.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

namespace rl_align {

// `scale`, or 1/sqrt(head_dim): the one place C++ resolves it. The host wrappers reject a
// non-finite result (checked_attention_scale, host/attention.h) before any kernel or autograd
// Function reads it.
inline double attention_scale(const std::optional<double>& scale, int64_t head_dim) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

}  // namespace rl_align
