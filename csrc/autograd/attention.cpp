// Autograd of attention and attention_varlen (why C++: common.h). The backward ops have no
// derivative of their own; attention_kvcache serves inference only and has no backward either.
#include "../common/attention_scale.h"
#include "common.h"

namespace rl_align {
namespace {

using AttentionOut = std::tuple<at::Tensor, at::Tensor>;
using AttentionGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// lse is an output for samplers and tests, not a differentiable one: its gradient is ignored.
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::attention");
    return op;
  }

  static AttentionOut kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& padding_mask,
                             std::optional<double> scale, bool causal) {
    if (!records_graph(q, k, v, padding_mask)) return call_below_autograd(forward_op(), q, k, v, padding_mask, scale, causal);
    const variable_list r = apply(q, k, v, padding_mask, scale, causal);
    return {r[0], r[1]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::optional<at::Tensor>& padding_mask,
                               std::optional<double> scale, bool causal) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = forward_op().call(q, k, v, padding_mask, scale, causal);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["mask"] = padding_mask.has_value() ? c10::IValue(*padding_mask) : c10::IValue();
    ctx->saved_data["scale"] = attention_scale(scale, q.size(-1));
    ctx->saved_data["causal"] = causal;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<AttentionGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, double, bool)>(
            "rl_align::attention_backward");
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& mask = ctx->saved_data["mask"];
    auto [dq, dk, dv] = op.call(grad_outputs[0], s[0], s[1], s[2], s[3], s[4],
                                mask.isNone() ? std::nullopt : std::optional<at::Tensor>(mask.toTensor()),
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class AttentionVarlenFunction : public torch::autograd::Function<AttentionVarlenFunction> {
 public:
  static const auto& forward_op() {
    static const auto op = typed_op<decltype(kernel)>("rl_align::attention_varlen");
    return op;
  }

  static AttentionOut kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens, std::optional<int64_t> max_seqlen,
                             std::optional<double> scale, bool causal, bool validate) {
    if (!records_graph(q, k, v, cu_seqlens)) {
      return call_below_autograd(forward_op(), q, k, v, cu_seqlens, max_seqlen, scale, causal, validate);
    }
    const variable_list r = apply(q, k, v, cu_seqlens, max_seqlen, scale, causal, validate);
    return {r[0], r[1]};
  }

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cu_seqlens,
                               std::optional<int64_t> max_seqlen, std::optional<double> scale,
                               bool causal, bool validate) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] = forward_op().call(q, k, v, cu_seqlens, max_seqlen, scale, causal, validate);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens});
    ctx->saved_data["max_seqlen"] = max_seqlen.has_value() ? c10::IValue(*max_seqlen) : c10::IValue();
    ctx->saved_data["scale"] = attention_scale(scale, q.size(-1));
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["validate"] = validate;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        typed_op<AttentionGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, std::optional<int64_t>, double, bool, bool)>(
            "rl_align::attention_varlen_backward");
    const variable_list s = ctx->get_saved_variables();
    const c10::IValue& max_seqlen = ctx->saved_data["max_seqlen"];
    auto [dq, dk, dv] = op.call(grad_outputs[0], s[0], s[1], s[2], s[3], s[4], s[5],
                                max_seqlen.isNone() ? std::nullopt : std::optional<int64_t>(max_seqlen.toInt()),
                                ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                                ctx->saved_data["validate"].toBool());
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, Autograd, m) {
  m.impl("attention", &AttentionFunction::kernel);
  m.impl("attention_varlen", &AttentionVarlenFunction::kernel);
  register_not_differentiable(m, {"attention_backward", "attention_varlen_backward", "attention_kvcache"});
}

}  // namespace rl_align
