// Host side of linear_logprob: linear's GEMMs (a linear Backend of host/linear.h) around logprob,
// never materialising [T, V]. Its bindings (csrc/cpu/linear_logprob_cpu.cpp,
// csrc/cuda/linear_logprob_launcher.cpp) extend the linear Backend with
// logprob_grad(logits, operands), logprob's backward kernel.
//
// Forward: chunks of linear_logprob_chunk_tokens(V) tokens, each linear then logprob (through the
// dispatcher). linear and logprob are batch-invariant, so a chunk's rows equal the whole call's.
// Backward: slices of linear_logprob_slice_columns(T) vocabulary columns for all tokens at once
// (common/logprob.h). Per slice the logits are recomputed, their gradient taken (logprob's kernel
// on the slice's columns: a logit's gradient needs only its row's saved lse and entropy), and
//   d weight rows of the slice = one GEMM over all tokens: the unfused GEMM's rows (its sum over
//     tokens is unchanged by which rows of the output are computed), from dweight_accum as
//     linear_grad_weight;
//   d bias entries likewise;
//   d hidden: the sum over the vocabulary is continued through the slices in order in an fp32
//     accumulator, each slice's GEMM resuming it (a slice is a multiple of every path's k chunk),
//     then rounded once: the unfused GEMM's chain and rounding.
// The unfused pair's bits, and the weight gradient written once, not read and written per chunk.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "linear.h"
#include "logprob.h"
#include "typed_op.h"

namespace rl_align {

using LogprobSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                        double, int64_t);

// A test override from the environment: 0 when `env` is unset or empty, else its value, which
// must be a positive multiple of `multiple`.
inline int64_t forced_multiple(const char* env, int64_t multiple) {
  const char* forced = std::getenv(env);
  if (forced == nullptr || *forced == '\0') return 0;
  char* end = nullptr;
  const long long value = std::strtoll(forced, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && value > 0 && value % multiple == 0, "rl_align::linear_logprob: ", env,
                    " must be a positive multiple of ", multiple, ", got '", forced, "'");
  return value;
}

// Tokens per forward chunk: linear_logprob_chunk_tokens, or RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS
// (a positive multiple of kLinearGradTileTokens) where tests force small chunks; the results are
// the same bits for every chunk size.
inline int64_t logprob_chunk_tokens(int64_t vocab) {
  const int64_t forced = forced_multiple("RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS", kLinearGradTileTokens);
  return forced > 0 ? forced : linear_logprob_chunk_tokens(vocab, kLinearGradTileTokens);
}

// Vocabulary columns per backward slice for `tokens` tokens: linear_logprob_slice_columns, or
// RL_ENGINE_EXT_LINEAR_LOGPROB_SLICE_COLUMNS (a positive multiple of kLinearLogprobSliceColumns)
// where tests force small slices; the results are the same bits for every slice width.
inline int64_t logprob_slice_columns(int64_t tokens) {
  const int64_t forced = forced_multiple("RL_ENGINE_EXT_LINEAR_LOGPROB_SLICE_COLUMNS", kLinearLogprobSliceColumns);
  return forced > 0 ? forced : linear_logprob_slice_columns(tokens);
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
    const std::optional<at::Tensor>& dbias_accum, bool fp32_param_grads) {
  constexpr const char* op = "linear_logprob_backward";
  check_linear_logprob_args(op, hidden, weight, targets, bias, temperature);
  check_backward_stats(op, grad_logprob, grad_entropy, entropy, lse, targets);
  const int64_t vocab = weight.size(0), width = weight.size(1);
  check_fp32_accum(op, "dweight_accum", dweight_accum, {vocab, width}, hidden);
  TORCH_CHECK_VALUE(bias.has_value() || !dbias_accum.has_value(), "rl_align::", op,
                    ": dbias_accum is given but bias is None");
  check_fp32_accum(op, "dbias_accum", dbias_accum, {vocab}, hidden);
  TORCH_CHECK_VALUE(fp32_param_grads || (!dweight_accum.has_value() && !dbias_accum.has_value()),
                    "rl_align::", op, ": fp32_param_grads=False rounds the weight and bias gradients "
                    "to their dtypes and takes no dweight_accum / dbias_accum");
  if (targets.is_cpu()) check_targets_in_range_cpu(op, targets, vocab, ignore_index);

  at::Tensor grad_hidden =
      at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  const auto fp32 = hidden.options().dtype(at::kFloat);
  at::Tensor grad_weight = at::empty({vocab, width}, fp32_param_grads ? fp32 : weight.options());
  at::Tensor grad_bias = at::empty({bias.has_value() ? vocab : 0}, fp32_param_grads || !bias ? fp32 : bias->options());
  const at::Tensor weight_start = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  const at::Tensor bias_start = dbias_accum.has_value() ? dbias_accum->contiguous() : at::Tensor();
  const int64_t tokens = targets.numel();
  if (tokens == 0) {
    weight_start.defined() ? grad_weight.copy_(weight_start) : grad_weight.zero_();
    bias_start.defined() ? grad_bias.copy_(bias_start) : grad_bias.zero_();
    return {grad_hidden, grad_weight, grad_bias};
  }
  const at::Tensor h = hidden.reshape({tokens, width});
  const at::Tensor t = flat_rows(targets);
  const LogprobBackwardRows rows(grad_logprob, grad_entropy, entropy, lse);
  const at::Tensor grad_hidden_rows = grad_hidden.view({tokens, width});
  const int64_t columns = logprob_slice_columns(tokens);
  // One slice: d hidden straight into grad_hidden; several: the fp32 sum, rounded at the end.
  const at::Tensor hidden_sum = columns < vocab && width > 0 ? at::empty({tokens, width}, fp32) : grad_hidden_rows;
  const at::Tensor bias_sum = grad_bias.scalar_type() == at::kFloat ? grad_bias : at::empty({vocab}, fp32);
  const float* dw_start = weight_start.defined() ? weight_start.const_data_ptr<float>() : nullptr;
  const float* db_start = bias_start.defined() ? bias_start.const_data_ptr<float>() : nullptr;
  for (int64_t first = 0; first < vocab; first += columns) {
    const int64_t n = std::min(columns, vocab - first);
    const at::Tensor w_slice = weight.narrow(0, first, n);
    const std::optional<at::Tensor> b_slice =
        bias.has_value() ? std::optional<at::Tensor>(bias->narrow(0, first, n)) : std::nullopt;
    const at::Tensor logits = linear_impl<LinearBackend>(h, w_slice, b_slice);
    const at::Tensor grad_logits = at::empty_like(logits);
    LogprobOperands a = logprob_operands(logits, t, temperature, ignore_index);
    a.column_offset = first;
    a.target_vocab = vocab;
    rows.set(a, grad_logits);
    LinearBackend::logprob_grad(logits, a);
    if (width > 0) {
      linear_grad_input_into<LinearBackend>(grad_logits, w_slice, hidden_sum,
                                            first == 0 ? nullptr : hidden_sum.const_data_ptr<float>());
      linear_grad_weight_into<LinearBackend>(grad_logits, h, dw_start == nullptr ? nullptr : dw_start + first * width,
                                             grad_weight.narrow(0, first, n));
    }
    if (bias.has_value()) {
      LinearBackend::bias_grad(hidden.scalar_type(), grad_logits, db_start == nullptr ? nullptr : db_start + first,
                               bias_sum.mutable_data_ptr<float>() + first);
    }
  }
  if (!hidden_sum.is_same(grad_hidden_rows)) grad_hidden_rows.copy_(hidden_sum);
  if (!bias_sum.is_same(grad_bias)) grad_bias.copy_(bias_sum);
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace rl_align
