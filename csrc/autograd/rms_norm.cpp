// Autograd of rms_norm (why C++: typed_op.h). rms_norm_backward has no derivative of its own.
#include "typed_op.h"

namespace rl_align {
namespace {

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& weight, double eps) {
    return apply(x, weight, eps);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    static const auto op = typed_op<decltype(kernel)>("rl_align::rms_norm");
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return op.call(x, weight, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, double,
                                                    const std::optional<at::Tensor>&)>(
            "rl_align::rms_norm_backward");
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

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("rms_norm", &RmsNormFunction::kernel);
  register_not_differentiable(m, {"rms_norm_backward"});
}

}  // namespace rl_align
