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
  // The backward ops have no derivative of their own: differentiating through them raises
  // instead of silently treating them as constants.
  for (const char* op : {"rms_norm_backward", "linear_grad_input", "linear_grad_weight",
                         "linear_grad_bias"}) {
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
  }
}

}  // namespace rl_align
