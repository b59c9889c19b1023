// Host side of logprob and linear_logprob, shared by the CPU and GPU bindings: argument checks
// (both ops), output allocation, the empty cases and the operand descriptor. A logprob Backend
// supplies the kernel calls and the target range check:
//   static void check_targets(const char* op, const at::Tensor& targets, int64_t vocab,
//                             int64_t ignore_index);  // CPU: check_targets_in_range_cpu;
//                                                     // GPU: nothing (the kernels' device assert)
//   static void fwd(const at::Tensor& logits, const LogprobOperands& a);
//   static void bwd(const at::Tensor& logits, const LogprobOperands& a);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>
#include <optional>
#include <tuple>

#include "../common/logprob.h"
#include "common.h"

namespace rl_align {

// The kernels scale the logits by float32(1 / temperature), which must be a normal float32 number:
// below kMinTemperature it overflows to inf (every result NaN); above kMaxTemperature it is
// subnormal (few bits left) or 0 (every logit scaled to 0, a masked -inf logit to NaN). The one C++
// copy of the rule (Python: temperature_error, rl_engine_ext/ops/logprob.py).
constexpr double kMinTemperature = 1.0 / std::numeric_limits<float>::max();
constexpr double kMaxTemperature = 1.0 / std::numeric_limits<float>::min();

inline void check_temperature(const char* op, double temperature) {
  TORCH_CHECK_VALUE(temperature >= kMinTemperature && temperature <= kMaxTemperature, "rl_align::", op,
                    ": temperature must be in [", kMinTemperature, ", ", kMaxTemperature,
                    "] (1 / temperature a normal float32 number), got ", temperature);
}

// targets: int32/int64 of `shape` (the logits' or hidden's shape without the last dimension).
inline void check_targets_arg(const char* op, const at::Tensor& targets, at::IntArrayRef shape,
                              const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(targets.device() == ref.device(), "rl_align::", op, ": targets is on ",
              targets.device(), " but ", ref_name, " is on ", ref.device());
  TORCH_CHECK_VALUE(targets.scalar_type() == at::kInt || targets.scalar_type() == at::kLong,
                    "rl_align::", op, ": targets must be torch.int32 or torch.int64, got ",
                    dtype_name(targets.scalar_type()));
  TORCH_CHECK_VALUE(targets.sizes() == shape, "rl_align::", op, ": targets shape ",
                    targets.sizes(), " must be ", ref_name, " shape without the last dimension ",
                    shape);
}

// A per-row fp32 tensor (grad_logprob, grad_entropy, entropy, lse) of the targets' shape.
inline void check_row_stat(const char* op, const char* name, const at::Tensor& t,
                           const at::Tensor& targets) {
  TORCH_CHECK(t.device() == targets.device(), "rl_align::", op, ": ", name, " is on ", t.device(),
              " but targets is on ", targets.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "rl_align::", op, ": ", name,
                    " must be torch.float32, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.sizes() == targets.sizes(), "rl_align::", op, ": ", name, " shape ",
                    t.sizes(), " differs from targets shape ", targets.sizes());
}

inline void check_backward_stats(const char* op, const at::Tensor& grad_logprob,
                                 const std::optional<at::Tensor>& grad_entropy,
                                 const at::Tensor& entropy, const at::Tensor& lse,
                                 const at::Tensor& targets) {
  check_row_stat(op, "grad_logprob", grad_logprob, targets);
  if (grad_entropy.has_value()) check_row_stat(op, "grad_entropy", *grad_entropy, targets);
  check_row_stat(op, "entropy", entropy, targets);
  check_row_stat(op, "lse", lse, targets);
}

inline void check_logprob_args(const char* op, const at::Tensor& logits, const at::Tensor& targets,
                               double temperature) {
  check_dtype(op, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) > 0, "rl_align::", op,
                    ": logits must have a last (vocabulary) dimension of size > 0, got shape ",
                    logits.sizes());
  check_targets_arg(op, targets, logits.sizes().slice(0, logits.dim() - 1), "logits", logits);
  check_temperature(op, temperature);
}

inline void check_linear_logprob_args(const char* op, const at::Tensor& hidden,
                                      const at::Tensor& weight, const at::Tensor& targets,
                                      const std::optional<at::Tensor>& bias, double temperature) {
  check_dtype(op, "hidden", hidden);
  check_dtype(op, "weight", weight);
  TORCH_CHECK_VALUE(hidden.dim() >= 1, "rl_align::", op, ": hidden must have at least one dimension");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) > 0, "rl_align::", op,
                    ": weight must be 2-D [vocab, hidden] with vocab > 0, got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == hidden.size(-1), "rl_align::", op, ": weight is ",
                    weight.sizes(), " ([vocab, hidden]) but hidden's last dimension is ",
                    hidden.size(-1));
  check_same(op, "weight", weight, "hidden", hidden);
  if (bias.has_value()) {
    check_dtype(op, "bias", *bias);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "rl_align::", op,
                      ": bias must have shape [", weight.size(0), "], got ", bias->sizes());
    check_same(op, "bias", *bias, "hidden", hidden);
  }
  check_targets_arg(op, targets, hidden.sizes().slice(0, hidden.dim() - 1), "hidden", hidden);
  check_temperature(op, temperature);
}

// CPU tensors: an IndexError naming the first target (in row order) that is neither ignore_index
// nor in [0, vocab). (On a GPU the kernels check, with a device-side assert: no host sync.)
inline void check_targets_in_range_cpu(const char* op, const at::Tensor& targets, int64_t vocab,
                                       int64_t ignore_index) {
  const at::Tensor t = targets.reshape({targets.numel()}).to(at::kLong).contiguous();
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < t.numel(); ++r) {
    TORCH_CHECK_INDEX(p[r] == ignore_index || (p[r] >= 0 && p[r] < vocab), "rl_align::", op,
                      ": target ", p[r], " out of range for a vocabulary of ", vocab,
                      " (ignore_index ", ignore_index, ")");
  }
}

// The operands of a logprob call on [rows, vocab] logits views (the per-row tensors flat and
// contiguous). The descriptor points into both tensors: the caller holds them until the kernel ran.
inline LogprobOperands logprob_operands(Lvalue<at::Tensor> logits_rows, Lvalue<at::Tensor> targets_flat,
                                        double temperature, int64_t ignore_index) {
  LogprobOperands a;
  a.rows = logits_rows->size(0);
  a.vocab = logits_rows->size(1);
  a.target_vocab = a.vocab;
  a.logits = logits_rows->const_data_ptr();
  a.logits_stride = row_stride(*logits_rows);
  a.targets = targets_flat->const_data_ptr();
  a.targets_int64 = targets_flat->scalar_type() == at::kLong;
  a.ignore_index = ignore_index;
  a.inv_temperature = static_cast<float>(1.0 / temperature);
  return a;
}

inline at::Tensor flat_rows(const at::Tensor& t) { return t.reshape({t.numel()}).contiguous(); }

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprob_impl(const at::Tensor& logits,
                                                             const at::Tensor& targets,
                                                             double temperature,
                                                             int64_t ignore_index) {
  constexpr const char* op = "logprob";
  check_logprob_args(op, logits, targets, temperature);
  const auto stat = [&] { return at::empty(targets.sizes(), logits.options().dtype(at::kFloat)); };
  at::Tensor logprob = stat(), entropy = stat(), lse = stat();
  if (targets.numel() == 0) return {logprob, entropy, lse};
  const at::Tensor targets_flat = flat_rows(targets);
  Backend::check_targets(op, targets_flat, logits.size(-1), ignore_index);
  const at::Tensor logits_rows = as_rows(logits);
  LogprobOperands a = logprob_operands(logits_rows, targets_flat, temperature, ignore_index);
  a.logprob = logprob.mutable_data_ptr<float>();
  a.entropy = entropy.mutable_data_ptr<float>();
  a.lse = lse.mutable_data_ptr<float>();
  Backend::fwd(logits, a);
  return {logprob, entropy, lse};
}

// The backward's per-row inputs as flat contiguous fp32 rows, held while a kernel reads them.
struct LogprobBackwardRows {
  at::Tensor g, gh, entropy, lse;
  LogprobBackwardRows(const at::Tensor& grad_logprob, const std::optional<at::Tensor>& grad_entropy,
                      const at::Tensor& entropy_, const at::Tensor& lse_)
      : g(flat_rows(grad_logprob)),
        gh(grad_entropy.has_value() ? flat_rows(*grad_entropy) : at::Tensor()),
        entropy(flat_rows(entropy_)),
        lse(flat_rows(lse_)) {}
  // Points a's backward inputs at these rows and its output at grad_logits (both held by the
  // caller until the kernel ran: a temporary does not compile).
  void set(LogprobOperands& a, Lvalue<at::Tensor> grad_logits) const& {
    a.grad_logprob = g.const_data_ptr<float>();
    a.grad_entropy = gh.defined() ? gh.const_data_ptr<float>() : nullptr;
    a.saved_lse = lse.const_data_ptr<float>();
    a.saved_entropy = entropy.const_data_ptr<float>();
    a.grad_logits = grad_logits->mutable_data_ptr();
  }
  void set(LogprobOperands& a, Lvalue<at::Tensor> grad_logits) const&& = delete;
};

template <typename Backend>
at::Tensor logprob_backward_impl(const at::Tensor& grad_logprob,
                                 const std::optional<at::Tensor>& grad_entropy,
                                 const at::Tensor& logits, const at::Tensor& targets,
                                 const at::Tensor& entropy, const at::Tensor& lse,
                                 double temperature, int64_t ignore_index) {
  constexpr const char* op = "logprob_backward";
  check_logprob_args(op, logits, targets, temperature);
  check_backward_stats(op, grad_logprob, grad_entropy, entropy, lse, targets);
  at::Tensor grad_logits =
      at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (targets.numel() == 0) return grad_logits;
  const at::Tensor targets_flat = flat_rows(targets);
  Backend::check_targets(op, targets_flat, logits.size(-1), ignore_index);
  const LogprobBackwardRows rows(grad_logprob, grad_entropy, entropy, lse);
  const at::Tensor logits_rows = as_rows(logits);
  LogprobOperands a = logprob_operands(logits_rows, targets_flat, temperature, ignore_index);
  rows.set(a, grad_logits);
  Backend::bwd(logits, a);
  return grad_logits;
}

}  // namespace rl_align
