// Host side of linear_logprob: linear's GEMMs (a linear Backend of host/linear.h) around logprob,
// never materialising [T, V]. Its bindings (csrc/cpu/linear_logprob_cpu.cpp,
// csrc/cuda/linear_logprob_launcher.cpp) extend the linear Backend with
// logprob_grad(logits, operands), logprob's backward kernel, and round_like_gemm(fp32 sum, out), the
// GEMM epilogue's rounding of an fp32 sum to the input dtype (NaNs included).
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
// Fused gradient (linear_logprob_fused_grad, below): the forward's chunks also take the gradients
// from cotangents given up front, three GEMMs per chunk instead of the backward's recomputation.
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
// The fused-gradient mode's chunks are kLinearLogprobFusedChunkFactor of those (a forced size is
// taken as it is).
inline int64_t logprob_chunk_tokens(int64_t vocab, int64_t factor = 1) {
  const int64_t forced = forced_multiple("RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS", kLinearGradTileTokens);
  return forced > 0 ? forced : factor * linear_logprob_chunk_tokens(vocab, kLinearGradTileTokens);
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

// The parameter-gradient arguments of the backward and fused-gradient ops (the one C++ copy).
inline void check_param_grad_args(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& dweight_accum,
                                  const std::optional<at::Tensor>& dbias_accum, bool fp32_param_grads) {
  check_fp32_accum(op, "dweight_accum", dweight_accum, {weight.size(0), weight.size(1)}, hidden);
  TORCH_CHECK_VALUE(bias.has_value() || !dbias_accum.has_value(), "rl_align::", op,
                    ": dbias_accum is given but bias is None");
  check_fp32_accum(op, "dbias_accum", dbias_accum, {weight.size(0)}, hidden);
  TORCH_CHECK_VALUE(fp32_param_grads || (!dweight_accum.has_value() && !dbias_accum.has_value()),
                    "rl_align::", op, ": fp32_param_grads=False rounds the weight and bias gradients "
                    "to their dtypes and takes no dweight_accum / dbias_accum");
}

// The gradients (grad_hidden in hidden's dtype; grad_weight and grad_bias fp32, or rounded to the
// parameters' dtypes with fp32_param_grads=False; grad_bias [0] without a bias) and the sums they
// continue (contiguous accumulators, or undefined).
struct LinearLogprobGrads {
  at::Tensor hidden, weight, bias, weight_start, bias_start;
  LinearLogprobGrads(const at::Tensor& h, const at::Tensor& w, const std::optional<at::Tensor>& b,
                     const std::optional<at::Tensor>& dweight_accum, const std::optional<at::Tensor>& dbias_accum,
                     bool fp32_param_grads) {
    const auto fp32 = h.options().dtype(at::kFloat);
    hidden = at::empty(h.sizes(), h.options().memory_format(at::MemoryFormat::Contiguous));
    weight = at::empty({w.size(0), w.size(1)}, fp32_param_grads ? fp32 : w.options());
    bias = at::empty({b.has_value() ? w.size(0) : 0}, fp32_param_grads || !b ? fp32 : b->options());
    if (dweight_accum.has_value()) weight_start = dweight_accum->contiguous();
    if (dbias_accum.has_value()) bias_start = dbias_accum->contiguous();
  }
  // No tokens: the parameters' sums are their starts (or zero).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> from_starts() const {
    weight_start.defined() ? weight.copy_(weight_start) : weight.zero_();
    bias_start.defined() ? bias.copy_(bias_start) : bias.zero_();
    return {hidden, weight, bias};
  }
};

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
  check_param_grad_args(op, hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads);
  const int64_t vocab = weight.size(0), width = weight.size(1);
  if (targets.is_cpu()) check_targets_in_range_cpu(op, targets, vocab, ignore_index);

  const LinearLogprobGrads out(hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads);
  const at::Tensor &grad_hidden = out.hidden, &grad_weight = out.weight, &grad_bias = out.bias;
  const at::Tensor &weight_start = out.weight_start, &bias_start = out.bias_start;
  const auto fp32 = hidden.options().dtype(at::kFloat);
  const int64_t tokens = targets.numel();
  if (tokens == 0) return out.from_starts();
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

using LinearLogprobFusedOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// linear_logprob_fused_grad: the forward and, from cotangents known at forward time, the backward
// in one pass over the forward's token chunks, bit for bit linear_logprob then
// linear_logprob_backward with those cotangents, with three GEMMs instead of four. Per chunk:
//   logits = linear(h_chunk, W), then logprob (the forward's steps);
//   grad_logits = logprob's backward kernel from the chunk's lse and entropy (the backward's);
//   d hidden rows = one GEMM over the whole vocabulary, rounded once: the backward's sum over the
//     vocabulary is this GEMM's chain (its slices resume it at k-chunk boundaries);
//   d weight (d bias) = the fp32 sum over tokens continued from the previous chunk (from
//     dweight_accum / dbias_accum for the first): chunks are whole kLinearGradTileTokens tiles, so
//     this is linear_grad_weight's chain over all tokens (its chaining contract), the backward's.
// The weight gradient's fp32 sum lives in grad_weight itself when that is fp32 (fp32_param_grads,
// or fp32 parameters) and when one chunk holds every token (its GEMM rounds, as the backward's);
// otherwise in a [V, H] fp32 buffer rounded once at the end: the mode's one extra allocation.
template <typename LinearBackend>
LinearLogprobFusedOutputs linear_logprob_fused_grad_impl(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, double temperature, int64_t ignore_index,
    const at::Tensor& grad_logprob, const std::optional<at::Tensor>& grad_entropy,
    const std::optional<at::Tensor>& dweight_accum, const std::optional<at::Tensor>& dbias_accum,
    bool fp32_param_grads) {
  static const auto logprob_op = typed_op<LogprobSignature>("rl_align::logprob");
  constexpr const char* op = "linear_logprob_fused_grad";
  check_linear_logprob_args(op, hidden, weight, targets, bias, temperature);
  check_row_stat(op, "grad_logprob", grad_logprob, targets);
  if (grad_entropy.has_value()) check_row_stat(op, "grad_entropy", *grad_entropy, targets);
  check_param_grad_args(op, hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads);
  const int64_t vocab = weight.size(0), width = weight.size(1);
  if (targets.is_cpu()) check_targets_in_range_cpu(op, targets, vocab, ignore_index);

  const auto stat = [&] { return at::empty(targets.sizes(), hidden.options().dtype(at::kFloat)); };
  const at::Tensor logprob = stat(), entropy = stat(), lse = stat();
  LinearLogprobGrads out(hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads);
  const int64_t tokens = targets.numel();
  if (tokens == 0) {
    const auto [grad_hidden, grad_weight, grad_bias] = out.from_starts();
    return {logprob, entropy, lse, grad_hidden, grad_weight, grad_bias};
  }
  const auto fp32 = hidden.options().dtype(at::kFloat);
  const int64_t chunk_tokens = logprob_chunk_tokens(vocab, kLinearLogprobFusedChunkFactor);
  const at::Tensor h = hidden.reshape({tokens, width});
  const at::Tensor t = flat_rows(targets);
  const at::Tensor g = flat_rows(grad_logprob);
  const at::Tensor gh = grad_entropy.has_value() ? flat_rows(*grad_entropy) : at::Tensor();
  const at::Tensor stats[3] = {logprob.view({tokens}), entropy.view({tokens}), lse.view({tokens})};
  const at::Tensor grad_hidden_rows = out.hidden.view({tokens, width});
  const bool one_chunk = tokens <= chunk_tokens;
  const bool weight_in_place = out.weight.scalar_type() == at::kFloat || one_chunk || width == 0;
  const at::Tensor weight_sum = weight_in_place ? out.weight : at::empty({vocab, width}, fp32);
  const auto weight_options = out.weight.options();
  if (!weight_in_place) out.weight = at::Tensor();  // allocated after the chunks: a lower peak
  const at::Tensor bias_sum = out.bias.scalar_type() == at::kFloat ? out.bias : at::empty({vocab}, fp32);
  const float* dw_start = out.weight_start.defined() ? out.weight_start.const_data_ptr<float>() : nullptr;
  const float* db_start = out.bias_start.defined() ? out.bias_start.const_data_ptr<float>() : nullptr;
  for_each_logprob_chunk(tokens, chunk_tokens, [&](int64_t start, int64_t n) {
    const at::Tensor h_chunk = h.narrow(0, start, n);
    const at::Tensor t_chunk = t.narrow(0, start, n);
    const at::Tensor logits = linear_impl<LinearBackend>(h_chunk, weight, bias);
    const auto [lp_chunk, ent_chunk, lse_chunk] = logprob_op.call(logits, t_chunk, temperature, ignore_index);
    stats[0].narrow(0, start, n).copy_(lp_chunk);
    stats[1].narrow(0, start, n).copy_(ent_chunk);
    stats[2].narrow(0, start, n).copy_(lse_chunk);
    const at::Tensor grad_logits = at::empty_like(logits);
    const LogprobBackwardRows rows(g.narrow(0, start, n),
                                   gh.defined() ? std::optional<at::Tensor>(gh.narrow(0, start, n)) : std::nullopt,
                                   ent_chunk, lse_chunk);
    LogprobOperands a = logprob_operands(logits, t_chunk, temperature, ignore_index);
    rows.set(a, grad_logits);
    LinearBackend::logprob_grad(logits, a);
    if (width > 0) {
      linear_grad_input_into<LinearBackend>(grad_logits, weight, grad_hidden_rows.narrow(0, start, n));
      linear_grad_weight_into<LinearBackend>(grad_logits, h_chunk,
                                             start == 0 ? dw_start : weight_sum.const_data_ptr<float>(), weight_sum);
    }
    if (bias.has_value()) {
      LinearBackend::bias_grad(hidden.scalar_type(), grad_logits, start == 0 ? db_start : bias_sum.const_data_ptr<float>(),
                               bias_sum.mutable_data_ptr<float>());
    }
  });
  // The weight gradient rounded as the backward's GEMM writes it; the bias's as the backward does.
  if (!weight_in_place) {
    out.weight = at::empty({vocab, width}, weight_options);
    LinearBackend::round_like_gemm(weight_sum, out.weight);
  }
  if (!bias_sum.is_same(out.bias)) out.bias.copy_(bias_sum);
  return {logprob, entropy, lse, out.hidden, out.weight, out.bias};
}

}  // namespace rl_align
