// Autograd of rms_norm and add_rms_norm (why C++: typed_op.h). The backward ops have no
// derivative of their own.
#include <string>

#include "typed_op.h"

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

// (y, new_residual); x and residual get the same gradient, the one of new_residual.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::add_rms_norm");
    return op;
  }

  static BackwardOutputs kernel(const at::Tensor& x, const at::Tensor& residual,
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
        typed_op<BackwardOutputs(const at::Tensor&, const std::optional<at::Tensor>&,
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
  m.impl("rms_norm", &RmsNormFunction::kernel);
  m.impl("add_rms_norm", &AddRmsNormFunction::kernel);
  register_not_differentiable(m, {"rms_norm_backward", "add_rms_norm_backward"});
}

}  // namespace rl_align
