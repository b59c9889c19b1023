// Autograd for the rl_align ops, registered in C++ at the Autograd dispatch key.
//
// Why C++ rather than torch.library.register_autograd: a Python autograd kernel runs Python on
// every call, forward and backward, which costs more host time than the kernels themselves at
// decode sizes (M=1). The backward calls the op's backward schema, so the kernels (and their
// invariance) are the same whichever way the gradient is reached. The fake (meta) kernels stay in
// Python (rl_engine_ext/ops/*.py), which is all torch.compile needs to trace through these.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

namespace rl_align {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("rl_align::rms_norm", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return op.call(x, weight, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::rms_norm_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double,
                                                      const std::optional<at::Tensor>&)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    auto [grad_x, grad_weight] = op.call(grad_outputs[0].contiguous(), x, weight,
                                         ctx->saved_data["eps"].toDouble(), std::nullopt);
    return {ctx->needs_input_grad(0) ? grad_x : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_weight.to(weight.scalar_type()) : at::Tensor(),
            at::Tensor()};
  }
};

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("rl_align::linear", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                 const std::optional<at::Tensor>&)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias_dtype"] =
        bias.has_value() ? c10::IValue(static_cast<int64_t>(bias->scalar_type())) : c10::IValue();
    return op.call(x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto grad_input_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::linear_grad_input", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    static const auto grad_weight_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::linear_grad_weight", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&)>();
    static const auto grad_bias_op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::linear_grad_bias", "")
            .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor grad = grad_outputs[0].contiguous();
    at::Tensor grad_x, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) grad_x = grad_input_op.call(grad, weight);
    if (ctx->needs_input_grad(1))
      grad_weight = grad_weight_op.call(grad, x, std::nullopt).to(weight.scalar_type());
    // needs_input_grad counts only the tensor inputs: index 2 exists only with a bias.
    const c10::IValue& bias_dtype = ctx->saved_data["bias_dtype"];
    if (!bias_dtype.isNone() && ctx->needs_input_grad(2)) {
      grad_bias = grad_bias_op.call(grad, std::nullopt)
                      .to(static_cast<at::ScalarType>(bias_dtype.toInt()));
    }
    return {grad_x, grad_weight, grad_bias};
  }
};

using AttentionOut = std::tuple<at::Tensor, at::Tensor>;
using AttentionGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Scale as the ops resolve it, so that the backward gets the forward's value.
double resolved_scale(std::optional<double> scale, const at::Tensor& q) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// lse is an output for samplers and tests, not a differentiable one: its gradient is ignored.
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& padding_mask,
                               std::optional<double> scale, bool causal) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::attention", "")
            .typed<AttentionOut(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, std::optional<double>, bool)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = op.call(q, k, v, padding_mask, scale, causal);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["mask"] = padding_mask.has_value() ? c10::IValue(*padding_mask) : c10::IValue();
    ctx->saved_data["scale"] = resolved_scale(scale, q);
    ctx->saved_data["causal"] = causal;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::attention_backward", "")
            .typed<AttentionGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&, double, bool)>();
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& mask = ctx->saved_data["mask"];
    auto [dq, dk, dv] = op.call(grad_outputs[0], s[0], s[1], s[2], s[3], s[4],
                                mask.isNone() ? std::nullopt : std::optional<at::Tensor>(mask.toTensor()),
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class AttentionVarlenFunction : public torch::autograd::Function<AttentionVarlenFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cu_seqlens,
                               std::optional<int64_t> max_seqlen, std::optional<double> scale,
                               bool causal) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::attention_varlen", "")
            .typed<AttentionOut(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, std::optional<int64_t>, std::optional<double>,
                                bool)>();
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = op.call(q, k, v, cu_seqlens, max_seqlen, scale, causal);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens});
    ctx->saved_data["max_seqlen"] = max_seqlen.has_value() ? c10::IValue(*max_seqlen) : c10::IValue();
    ctx->saved_data["scale"] = resolved_scale(scale, q);
    ctx->saved_data["causal"] = causal;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("rl_align::attention_varlen_backward", "")
            .typed<AttentionGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, std::optional<int64_t>, double, bool)>();
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& max_seqlen = ctx->saved_data["max_seqlen"];
    auto [dq, dk, dv] = op.call(grad_outputs[0], s[0], s[1], s[2], s[3], s[4], s[5],
                                max_seqlen.isNone() ? std::nullopt : std::optional<int64_t>(max_seqlen.toInt()),
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

AttentionOut attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& padding_mask,
                                std::optional<double> scale, bool causal) {
  const variable_list r = AttentionFunction::apply(q, k, v, padding_mask, scale, causal);
  return {r[0], r[1]};
}

AttentionOut attention_varlen_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens, std::optional<int64_t> max_seqlen,
                                       std::optional<double> scale, bool causal) {
  const variable_list r = AttentionVarlenFunction::apply(q, k, v, cu_seqlens, max_seqlen, scale, causal);
  return {r[0], r[1]};
}

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(x, weight, bias);
}

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("linear", &linear_autograd);
  m.impl("attention", &attention_autograd);
  m.impl("attention_varlen", &attention_varlen_autograd);
  // The backward ops have no derivative of their own: differentiating through them raises
  // instead of silently treating them as constants.
  // The KV-cache op serves inference only: it has no backward either.
  for (const char* op : {"rms_norm_backward", "linear_grad_input", "linear_grad_weight",
                         "linear_grad_bias", "attention_backward", "attention_varlen_backward",
                         "attention_kvcache"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace rl_align
