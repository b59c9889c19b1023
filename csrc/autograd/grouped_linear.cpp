// Autograd of grouped_linear (why C++: common.h). The gradient ops have no derivative of their own.
#include "common.h"

namespace rl_align {
namespace {

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::grouped_linear");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& offsets,
                           bool validate) {
    if (!records_graph(x, weight)) return call_below_autograd(forward_op(), x, weight, offsets, validate);
    return apply(x, weight, offsets, validate);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& offsets, bool validate) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight, offsets});
    return forward_op().call(x, weight, offsets, validate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto grad_input_op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>(
            "rl_align::grouped_linear_grad_input");
    static const auto grad_weight_op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, bool, bool)>("rl_align::grouped_linear_grad_weight");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& offsets = saved[2];
    const at::Tensor grad = grad_outputs[0].contiguous();
    // The forward validated the offsets (or was told not to): the backward reads them on the device.
    at::Tensor grad_x, grad_weight;
    if (ctx->needs_input_grad(0)) grad_x = grad_input_op.call(grad, weight, offsets, false);
    // The kernel rounds the fp32 sums to the weight's dtype (the bits of a cast of the fp32 result).
    if (ctx->needs_input_grad(1)) grad_weight = grad_weight_op.call(grad, x, offsets, std::nullopt, false, false);
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("grouped_linear", &GroupedLinearFunction::kernel);
  register_not_differentiable(m, {"grouped_linear_grad_input", "grouped_linear_grad_weight"});
}

}  // namespace rl_align
