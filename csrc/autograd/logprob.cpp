// Autograd of logprob (why C++: common.h). The backward op has no derivative of its own. The
// incoming gradients are read as linear_logprob's are (logprob_grads.h); lse is an output for
// samplers and tests, not a differentiable one.
#include "common.h"
#include "logprob_grads.h"

namespace rl_align {
namespace {

class LogprobFunction : public torch::autograd::Function<LogprobFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::logprob");
    return op;
  }

  static LogprobOutputs kernel(const at::Tensor& logits, const at::Tensor& targets,
                               double temperature, int64_t ignore_index) {
    if (!records_graph(logits)) return call_below_autograd(forward_op(), logits, targets, temperature, ignore_index);
    const variable_list r = apply(logits, targets, temperature, ignore_index);
    return {r[0], r[1], r[2]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const at::Tensor& targets, double temperature, int64_t ignore_index) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [logprob, entropy, lse] = forward_op().call(logits, targets, temperature, ignore_index);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({logits, targets, entropy, lse});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->mark_non_differentiable({lse});
    return {logprob, entropy, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>(
            "rl_align::logprob_backward");
    const variable_list s = ctx->get_saved_variables();
    if (!grad_outputs[0].defined() && !grad_outputs[1].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    auto [g, gh] = incoming_grads(grad_outputs, s[2]);
    at::Tensor grad_logits = op.call(g, gh, s[0], s[1], s[2], s[3], ctx->saved_data["temperature"].toDouble(),
                                     ctx->saved_data["ignore_index"].toInt());
    return {grad_logits, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("logprob", &LogprobFunction::kernel);
  register_not_differentiable(m, {"logprob_backward"});
}

}  // namespace rl_align
