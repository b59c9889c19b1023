// Autograd of add_rms_norm (why C++: common.h). The backward op has no derivative of its own.
#include <string>

#include "common.h"

namespace rl_align {
namespace {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;

// (y, new_residual); x and residual get the same gradient, the one of new_residual.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::add_rms_norm");
    return op;
  }

  static TensorPair kernel(const at::Tensor& x, const at::Tensor& residual,
                                const at::Tensor& weight, double eps, c10::string_view mode) {
    if (!records_graph(x, residual, weight)) return call_below_autograd(forward_op(), x, residual, weight, eps, mode);
    const variable_list out = apply(x, residual, weight, eps, std::string(mode));
    return {out[0], out[1]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               const std::string& mode) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, new_residual] = forward_op().call(x, residual, weight, eps, mode);
    // An unused output's gradient stays undefined (not zeros): adding a zero grad_residual would
    // turn a -0 of dx into +0, where the unfused pair keeps it.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({new_residual, weight});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["mode"] = mode;
    return {y, new_residual};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<TensorPair(const at::Tensor&, const std::optional<at::Tensor>&,
                                 const at::Tensor&, const at::Tensor&, double,
                                 const std::optional<at::Tensor>&, c10::string_view)>(
            "rl_align::add_rms_norm_backward");
    const at::Tensor& grad_y = grad_outputs[0];
    const at::Tensor& grad_residual = grad_outputs[1];
    if (!grad_y.defined()) return {grad_residual, grad_residual, at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    auto [grad_input, grad_weight] = op.call(
        grad_y.contiguous(),
        grad_residual.defined() ? std::optional<at::Tensor>(grad_residual) : std::nullopt,
        saved[0], weight, ctx->saved_data["eps"].toDouble(), std::nullopt,
        ctx->saved_data["mode"].toStringRef());
    return {ctx->needs_input_grad(0) ? grad_input : at::Tensor(),
            ctx->needs_input_grad(1) ? grad_input : at::Tensor(),
            ctx->needs_input_grad(2) ? grad_weight.to(weight.scalar_type()) : at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("add_rms_norm", &AddRmsNormFunction::kernel);
  register_not_differentiable(m, {"add_rms_norm_backward"});
}

}  // namespace rl_align
