// Autograd of moe_combine (why C++: common.h): gradients to expert_out and, when given, to the
// weights; positions are not differentiable. The backward op has no derivative of its own.
#include "common.h"

namespace rl_align {
namespace {

class MoeCombineFunction : public torch::autograd::Function<MoeCombineFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::moe_combine");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& expert_out, const at::Tensor& positions,
                           const std::optional<at::Tensor>& weights) {
    if (!records_graph(expert_out, weights)) return call_below_autograd(forward_op(), expert_out, positions, weights);
    return apply(expert_out, positions, weights);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& expert_out, const at::Tensor& positions,
                            const std::optional<at::Tensor>& weights) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({expert_out, positions, weights.has_value() ? *weights : at::Tensor()});
    return forward_op().call(expert_out, positions, weights);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const std::optional<at::Tensor>&)>(
            "rl_align::moe_combine_backward");
    const variable_list s = ctx->get_saved_variables();
    const bool has_weights = s[2].defined();
    const std::optional<at::Tensor> weights = has_weights ? std::optional<at::Tensor>(s[2]) : std::nullopt;
    auto [grad_x, grad_w] = op.call(grad_outputs[0], s[0], s[1], weights);
    // needs_input_grad counts only the tensor inputs: index 2 exists only with weights.
    return {ctx->needs_input_grad(0) ? grad_x : at::Tensor(), at::Tensor(),
            has_weights && ctx->needs_input_grad(2) ? grad_w : at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("moe_combine", &MoeCombineFunction::kernel);
  register_not_differentiable(m, {"moe_combine_backward"});
}

}  // namespace rl_align
