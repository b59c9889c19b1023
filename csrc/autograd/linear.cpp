// Autograd of linear (why C++: common.h). The gradient ops have no derivative of their own.
#include "common.h"

namespace rl_align {
namespace {

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::linear");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
    if (!records_graph(x, weight, bias)) return call_below_autograd(forward_op(), x, weight, bias);
    return apply(x, weight, bias);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias_dtype"] =
        bias.has_value() ? c10::IValue(static_cast<int64_t>(bias->scalar_type())) : c10::IValue();
    return forward_op().call(x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto grad_input_op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("rl_align::linear_grad_input");
    static const auto grad_weight_op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
            "rl_align::linear_grad_weight");
    static const auto grad_bias_op =
        typed_op<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&)>(
            "rl_align::linear_grad_bias");
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

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("linear", &LinearFunction::kernel);
  register_not_differentiable(m, {"linear_grad_input", "linear_grad_weight", "linear_grad_bias"});
}

}  // namespace rl_align
