// Host side of linear_logprob: linear's GEMMs (a linear Backend of host/linear.h) around logprob
// (called through the dispatcher, so it runs on logprob's own kernels), over chunks of
// linear_logprob_chunk_tokens(V) tokens. Registered by the linear bindings (csrc/cpu/linear_cpu.cpp,
// csrc/cuda/linear_launcher.cpp), which own the GEMM backends.
//
// Why the result is the unfused pair's, bit for bit: linear and logprob are batch-invariant (a
// token's logits and log-prob do not depend on the other tokens of the call), so a chunk's rows
// equal the whole call's; grad_hidden likewise; grad_weight / grad_bias chain over the chunks in
// token order in place (the accumulator is the output), and a chunk is a multiple of
// kLinearGradTileTokens, where linear_grad_weight's chain is defined to continue exactly.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "../autograd/typed_op.h"
#include "linear.h"
#include "logprob.h"

namespace rl_align {

using LogprobSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                        double, int64_t);
using LogprobBackwardSignature = at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, double, int64_t);

// Tokens per chunk: linear_logprob_chunk_tokens, or RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS (a
// positive multiple of kLinearGradTileTokens) where tests force small chunks; the results are the
// same bits for every chunk size.
inline int64_t logprob_chunk_tokens(int64_t vocab) {
  const char* forced = std::getenv("RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS");
  if (forced == nullptr || *forced == '\0') return linear_logprob_chunk_tokens(vocab, kLinearGradTileTokens);
  char* end = nullptr;
  const long long tokens = std::strtoll(forced, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && tokens > 0 && tokens % kLinearGradTileTokens == 0,
                    "rl_align::linear_logprob: RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS must be a positive "
                    "multiple of ", kLinearGradTileTokens, ", got '", forced, "'");
  return tokens;
}

// Calls f(start, n) for each chunk of rows [start, start + n) of `tokens`.
template <typename F>
void for_each_logprob_chunk(int64_t tokens, int64_t chunk, F&& f) {
  for (int64_t start = 0; start < tokens; start += chunk) f(start, std::min(chunk, tokens - start));
}

template <typename LinearBackend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index) {
  static const auto logprob_op = typed_op<LogprobSignature>("rl_align::logprob");
  check_linear_logprob_args("linear_logprob", hidden, weight, targets, bias, temperature);
  if (targets.is_cpu()) check_targets_in_range_cpu("linear_logprob", targets, weight.size(0), ignore_index);
  const int64_t tokens = targets.numel();
  const at::Tensor h = hidden.reshape({tokens, hidden.size(-1)});
  const at::Tensor t = targets.reshape({tokens});
  const int64_t chunk_tokens = logprob_chunk_tokens(weight.size(0));
  if (tokens > 0 && tokens <= chunk_tokens) {  // one chunk (decode): no copies
    const auto [logprob, entropy, lse] =
        logprob_op.call(linear_impl<LinearBackend>(h, weight, bias), t, temperature, ignore_index);
    return {logprob.view(targets.sizes()), entropy.view(targets.sizes()), lse.view(targets.sizes())};
  }
  const auto stat = [&] { return at::empty(targets.sizes(), hidden.options().dtype(at::kFloat)); };
  at::Tensor logprob = stat(), entropy = stat(), lse = stat();
  if (tokens == 0) return {logprob, entropy, lse};
  const at::Tensor outs[3] = {logprob.view({tokens}), entropy.view({tokens}), lse.view({tokens})};
  for_each_logprob_chunk(tokens, chunk_tokens, [&](int64_t start, int64_t n) {
    const at::Tensor logits = linear_impl<LinearBackend>(h.narrow(0, start, n), weight, bias);
    const auto chunk = logprob_op.call(logits, t.narrow(0, start, n), temperature, ignore_index);
    outs[0].narrow(0, start, n).copy_(std::get<0>(chunk));
    outs[1].narrow(0, start, n).copy_(std::get<1>(chunk));
    outs[2].narrow(0, start, n).copy_(std::get<2>(chunk));
  });
  return {logprob, entropy, lse};
}

template <typename LinearBackend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_logprob_backward_impl(
    const at::Tensor& grad_logprob, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& targets, const at::Tensor& entropy, const at::Tensor& lse, double temperature,
    int64_t ignore_index, const std::optional<at::Tensor>& dweight_accum,
    const std::optional<at::Tensor>& dbias_accum) {
  constexpr const char* op = "linear_logprob_backward";
  static const auto logprob_backward_op = typed_op<LogprobBackwardSignature>("rl_align::logprob_backward");
  check_linear_logprob_args(op, hidden, weight, targets, bias, temperature);
  check_backward_stats(op, grad_logprob, grad_entropy, entropy, lse, targets);
  const int64_t vocab = weight.size(0), width = weight.size(1);
  check_fp32_accum(op, "dweight_accum", dweight_accum, {vocab, width}, hidden);
  TORCH_CHECK_VALUE(bias.has_value() || !dbias_accum.has_value(), "rl_align::", op,
                    ": dbias_accum is given but bias is None");
  check_fp32_accum(op, "dbias_accum", dbias_accum, {vocab}, hidden);
  if (targets.is_cpu()) check_targets_in_range_cpu(op, targets, vocab, ignore_index);

  at::Tensor grad_hidden =
      at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  const auto fp32 = hidden.options().dtype(at::kFloat);
  at::Tensor grad_weight = at::empty({vocab, width}, fp32);
  at::Tensor grad_bias = at::empty({bias.has_value() ? vocab : 0}, fp32);
  const at::Tensor weight_start = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  const at::Tensor bias_start = dbias_accum.has_value() ? dbias_accum->contiguous() : at::Tensor();
  const int64_t tokens = targets.numel();
  if (tokens == 0) {
    weight_start.defined() ? grad_weight.copy_(weight_start) : grad_weight.zero_();
    bias_start.defined() ? grad_bias.copy_(bias_start) : grad_bias.zero_();
    return {grad_hidden, grad_weight, grad_bias};
  }
  const at::Tensor h = hidden.reshape({tokens, width});
  const at::Tensor t = targets.reshape({tokens});
  const at::Tensor g = grad_logprob.reshape({tokens});
  const std::optional<at::Tensor> gh =
      grad_entropy.has_value() ? std::optional<at::Tensor>(grad_entropy->reshape({tokens})) : std::nullopt;
  const at::Tensor ent = entropy.reshape({tokens}), lse_rows = lse.reshape({tokens});
  const at::Tensor grad_hidden_rows = grad_hidden.view({tokens, width});
  // The first chunk starts from the given accumulators (or 0); the next ones from the outputs
  // themselves (every path reads an element's sum before writing it).
  const float* dw_start = weight_start.defined() ? weight_start.const_data_ptr<float>() : nullptr;
  const float* db_start = bias_start.defined() ? bias_start.const_data_ptr<float>() : nullptr;
  for_each_logprob_chunk(tokens, logprob_chunk_tokens(vocab), [&](int64_t start, int64_t n) {
    const at::Tensor h_chunk = h.narrow(0, start, n);
    const at::Tensor logits = linear_impl<LinearBackend>(h_chunk, weight, bias);
    const auto chunk_of = [&](const at::Tensor& rows) { return rows.narrow(0, start, n); };
    const at::Tensor grad_logits = logprob_backward_op.call(
        chunk_of(g), gh.has_value() ? std::optional<at::Tensor>(chunk_of(*gh)) : std::nullopt,
        logits, chunk_of(t), chunk_of(ent), chunk_of(lse_rows), temperature, ignore_index);
    if (width > 0) {
      linear_grad_input_into<LinearBackend>(grad_logits, weight, grad_hidden_rows.narrow(0, start, n));
      linear_grad_weight_into<LinearBackend>(grad_logits, h_chunk, start == 0 ? dw_start : grad_weight.const_data_ptr<float>(),
                                             grad_weight);
    }
    if (bias.has_value()) {
      LinearBackend::bias_grad(hidden.scalar_type(), grad_logits,
                               start == 0 ? db_start : grad_bias.const_data_ptr<float>(),
                               grad_bias.mutable_data_ptr<float>());
    }
  });
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace rl_align
