// How logprob's and linear_logprob's autograd Functions read their incoming gradients, one rule
// for both, so that the fused op's gradients are the unfused pair's bit for bit: an unused entropy
// gets no entropy term (grad_entropy None, not a zero tensor), an unused logprob a zero gradient.
#pragma once

#include <optional>
#include <tuple>
#include <utility>

#include "common.h"

namespace rl_align {

// (logprob, entropy, lse): the outputs of both forward ops.
using LogprobOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// grad_logprob (zeros when logprob is unused) and grad_entropy (None when unused).
inline std::pair<at::Tensor, std::optional<at::Tensor>> incoming_grads(const variable_list& grads,
                                                                       const at::Tensor& entropy) {
  return {grads[0].defined() ? grads[0] : at::zeros_like(entropy),
          grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt};
}

}  // namespace rl_align
