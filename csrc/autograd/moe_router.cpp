// Autograd of moe_router (why C++: common.h): the gradient reaches the logits through the weights;
// the chosen experts (int64) are not differentiable. The backward op has no derivative of its own.
#include "common.h"

namespace rl_align {
namespace {

using RouterOutputs = std::tuple<at::Tensor, at::Tensor>;

class MoeRouterFunction : public torch::autograd::Function<MoeRouterFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::moe_router");
    return op;
  }

  static RouterOutputs kernel(const at::Tensor& logits, int64_t top_k, bool normalize) {
    if (!records_graph(logits)) return call_below_autograd(forward_op(), logits, top_k, normalize);
    const variable_list r = apply(logits, top_k, normalize);
    return {r[0], r[1]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t top_k, bool normalize) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [weights, experts] = forward_op().call(logits, top_k, normalize);
    ctx->save_for_backward({logits, experts});
    ctx->saved_data["normalize"] = normalize;
    ctx->mark_non_differentiable({experts});
    return {weights, experts};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>(
            "rl_align::moe_router_backward");
    const variable_list s = ctx->get_saved_variables();
    at::Tensor grad_logits = op.call(grad_outputs[0], s[0], s[1], ctx->saved_data["normalize"].toBool());
    return {grad_logits, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("moe_router", &MoeRouterFunction::kernel);
  register_not_differentiable(m, {"moe_router_backward"});
}

}  // namespace rl_align
