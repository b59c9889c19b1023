// Autograd of rms_norm (why C++: common.h). The backward op has no derivative of its own.
#include <string>

#include "common.h"

namespace rl_align {
namespace {

using BackwardOutputs = std::tuple<at::Tensor, at::Tensor>;

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::rms_norm");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& weight, double eps,
                           c10::string_view mode) {
    if (!records_graph(x, weight)) return call_below_autograd(forward_op(), x, weight, eps, mode);
    return apply(x, weight, eps, std::string(mode));
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, const std::string& mode) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["mode"] = mode;
    return forward_op().call(x, weight, eps, mode);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<BackwardOutputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                 const std::optional<at::Tensor>&, c10::string_view)>(
            "rl_align::rms_norm_backward");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    auto [grad_x, grad_weight] =
        op.call(grad_outputs[0].contiguous(), x, weight, ctx->saved_data["eps"].toDouble(),
                std::nullopt, ctx->saved_data["mode"].toStringRef());
    return {ctx->needs_input_grad(0) ? grad_x : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_weight.to(weight.scalar_type()) : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("rms_norm", &RmsNormFunction::kernel);
  register_not_differentiable(m, {"rms_norm_backward"});
}

}  // namespace rl_align
