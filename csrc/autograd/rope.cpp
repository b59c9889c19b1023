// Autograd of rope (why C++: common.h): the backward is rope_backward, the transposed rotation,
// which needs only the positions and frequencies. rope_backward has no derivative of its own.
#include <string>

#include "common.h"

namespace rl_align {
namespace {

using RopePair = std::tuple<at::Tensor, at::Tensor>;

class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::rope");
    return op;
  }

  static RopePair kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                         const at::Tensor& inv_freq, c10::string_view style,
                         c10::string_view layout, double attention_scaling) {
    if (!records_graph(q, k, inv_freq)) return call_below_autograd(forward_op(), q, k, positions, inv_freq, style, layout, attention_scaling);
    const variable_list r = apply(q, k, positions, inv_freq, std::string(style),
                                  std::string(layout), attention_scaling);
    return {r[0], r[1]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& positions, const at::Tensor& inv_freq,
                               const std::string& style, const std::string& layout,
                               double attention_scaling) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_out, k_out] = forward_op().call(q, k, positions, inv_freq, style, layout, attention_scaling);
    ctx->save_for_backward({positions, inv_freq});
    ctx->saved_data["style"] = style;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["attention_scaling"] = attention_scaling;
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = typed_op<decltype(kernel)>("rl_align::rope_backward");
    const variable_list saved = ctx->get_saved_variables();
    auto [dq, dk] = op.call(grad_outputs[0], grad_outputs[1], saved[0], saved[1],
                            ctx->saved_data["style"].toStringRef(),
                            ctx->saved_data["layout"].toStringRef(),
                            ctx->saved_data["attention_scaling"].toDouble());
    return {ctx->needs_input_grad(0) ? dq : at::Tensor(), ctx->needs_input_grad(1) ? dk : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("rope", &RopeFunction::kernel);
  register_not_differentiable(m, {"rope_backward"});
}

}  // namespace rl_align
