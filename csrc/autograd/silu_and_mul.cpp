// Autograd of silu_and_mul and silu_mul (why C++: common.h). The backward ops have no
// derivative of their own.
#include "common.h"

namespace rl_align {
namespace {

class SiluAndMulFunction : public torch::autograd::Function<SiluAndMulFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::silu_and_mul");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& gate_up) {
    if (!records_graph(gate_up)) return call_below_autograd(forward_op(), gate_up);
    return apply(gate_up);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({gate_up});
    return forward_op().call(gate_up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op = typed_op<at::Tensor(const at::Tensor&, const at::Tensor&)>(
        "rl_align::silu_and_mul_backward");
    return {op.call(grad_outputs[0], ctx->get_saved_variables()[0])};
  }
};

class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::silu_mul");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& gate, const at::Tensor& up) {
    if (!records_graph(gate, up)) return call_below_autograd(forward_op(), gate, up);
    return apply(gate, up);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({gate, up});
    return forward_op().call(gate, up);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&)>("rl_align::silu_mul_backward");
    const variable_list saved = ctx->get_saved_variables();
    auto [d_gate, d_up] = op.call(grad_outputs[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? d_gate : at::Tensor(),
            ctx->needs_input_grad(1) ? d_up : at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("silu_and_mul", &SiluAndMulFunction::kernel);
  m.impl("silu_mul", &SiluMulFunction::kernel);
  register_not_differentiable(m, {"silu_and_mul_backward", "silu_mul_backward"});
}

}  // namespace rl_align
