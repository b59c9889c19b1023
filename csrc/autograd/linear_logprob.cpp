// Autograd of linear_logprob (why C++: common.h). The backward op and the fused-gradient op have no
// derivative of their own.
// The incoming gradients are read as logprob's are (logprob_grads.h); lse is an output for
// samplers and tests, not a differentiable one.
#include "common.h"
#include "logprob_grads.h"

namespace rl_align {
namespace {

class LinearLogprobFunction : public torch::autograd::Function<LinearLogprobFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::linear_logprob");
    return op;
  }

  static LogprobOutputs kernel(const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& targets, const std::optional<at::Tensor>& bias,
                               double temperature, int64_t ignore_index) {
    if (!records_graph(hidden, weight, bias)) return call_below_autograd(forward_op(), hidden, weight, targets, bias, temperature, ignore_index);
    const variable_list r = apply(hidden, weight, targets, bias, temperature, ignore_index);
    return {r[0], r[1], r[2]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden,
                               const at::Tensor& weight, const at::Tensor& targets,
                               const std::optional<at::Tensor>& bias, double temperature,
                               int64_t ignore_index) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [logprob, entropy, lse] = forward_op().call(hidden, weight, targets, bias, temperature, ignore_index);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({hidden, weight, targets, entropy, lse});
    ctx->saved_data["bias"] = bias.has_value() ? c10::IValue(*bias) : c10::IValue();
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->mark_non_differentiable({lse});
    return {logprob, entropy, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = typed_op<LogprobOutputs(
        const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
        const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        double, int64_t, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool)>(
        "rl_align::linear_logprob_backward");
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& bias_value = ctx->saved_data["bias"];
    const std::optional<at::Tensor> bias =
        bias_value.isNone() ? std::nullopt : std::optional<at::Tensor>(bias_value.toTensor());
    const variable_list none(6);
    if (!grad_outputs[0].defined() && !grad_outputs[1].defined()) return none;
    auto [g, gh] = incoming_grads(grad_outputs, s[3]);
    auto [grad_hidden, grad_weight, grad_bias] =
        op.call(g, gh, s[0], s[1], bias, s[2], s[3], s[4], ctx->saved_data["temperature"].toDouble(),
                ctx->saved_data["ignore_index"].toInt(), std::nullopt, std::nullopt,
                /*fp32_param_grads=*/false);
    // As linear's backward: the fp32 sums rounded once to the parameters' dtypes (by the op).
    return {ctx->needs_input_grad(0) ? grad_hidden : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_weight : at::Tensor(),
            at::Tensor(),
            bias.has_value() && ctx->needs_input_grad(3) ? grad_bias : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("linear_logprob", &LinearLogprobFunction::kernel);
  // linear_logprob_fused_grad returns gradients: its autograd (declared cotangents checked at
  // backward) is Python's, rl_engine_ext/ops/linear_logprob.py.
  register_not_differentiable(m, {"linear_logprob_backward", "linear_logprob_fused_grad"});
}

}  // namespace rl_align
