// Autograd of embedding (why C++: common.h): differentiable in weight only (ids are integers).
// embedding_grad_weight has no derivative of its own.
#include "common.h"

namespace rl_align {
namespace {

class EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::embedding");
    return op;
  }

  static at::Tensor kernel(const at::Tensor& ids, const at::Tensor& weight,
                           std::optional<int64_t> padding_idx) {
    if (!records_graph(weight)) return call_below_autograd(forward_op(), ids, weight, padding_idx);
    return apply(ids, weight, padding_idx);
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& ids, const at::Tensor& weight,
                            std::optional<int64_t> padding_idx) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({ids});
    ctx->saved_data["num_embeddings"] = weight.size(0);
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["padding_idx"] = padding_idx;
    return forward_op().call(ids, weight, padding_idx);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto grad_weight_op =
        typed_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, std::optional<int64_t>,
                            const std::optional<at::Tensor>&)>("rl_align::embedding_grad_weight");
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(1)) {
      grad_weight = grad_weight_op
                        .call(grad_outputs[0], saved[0], ctx->saved_data["num_embeddings"].toInt(),
                              ctx->saved_data["padding_idx"].toOptional<int64_t>(), std::nullopt)
                        .to(static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt()));
    }
    return {at::Tensor(), grad_weight, at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("embedding", &EmbeddingFunction::kernel);
  register_not_differentiable(m, {"embedding_grad_weight"});
}

}  // namespace rl_align
