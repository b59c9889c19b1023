// Autograd for the rl_align ops is registered in C++, at the Autograd dispatch key: one file per
// differentiable op family (csrc/autograd/<op>.cpp), each with its own
// TORCH_LIBRARY_IMPL(rl_align, Autograd, m) block that also registers the family's
// non-differentiable ops (backward ops, inference-only ops) with autogradNotImplementedFallback,
// so differentiating through them raises instead of silently treating them as constants.
//
// Why C++ rather than torch.library.register_autograd: a Python autograd kernel runs Python on
// every call, forward and backward (and under no_grad), which costs more host time than the
// kernels themselves at decode sizes: benchmarks/bench_autograd_host.py measures both on one
// build (H100: linear forward+backward at M=1 151 vs 279 us, a 2-layer model's no_grad decode
// step 1.13 vs 2.25 ms). It is also why the wheels are per torch release rather than on the
// LibTorch stable ABI, which has no autograd (README, "One wheel per torch minor release"). The backward calls the op's backward
// schema, so the kernels (and their invariance) are the same whichever way the gradient is
// reached. The fake (meta) kernels stay in Python (rl_engine_ext/ops/*.py), which is all
// torch.compile needs to trace through these.
//
// This header: the includes every autograd file needs (typed_op, host/typed_op.h, among them).
// The signature of an autograd entry point is the signature of its schema: a Function keeps its
// entry point as a static member `kernel` and looks the op up as
// typed_op<decltype(kernel)>("rl_align::<op>").
//
// Function::apply allocates a graph node and fills its context on every call, even when nothing
// needs a gradient: about 2 us of host time, the whole budget of a decode-size op. So `kernel`
// calls the op below Autograd directly unless records_graph(differentiable inputs...).
#pragma once

#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <tuple>
#include <utility>

#include "../host/typed_op.h"

namespace rl_align {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether a call must go through Function::apply: grad mode on and an input requiring grad, or an
// input carrying a forward-mode tangent (apply raises for those: no jvp; the direct call would
// drop the tangent silently).
inline bool needs_autograd(const at::Tensor& t, bool grad_mode) {
  return t.defined() && ((grad_mode && t.requires_grad()) || t._fw_grad(/*level=*/0).defined());
}
inline bool needs_autograd(const std::optional<at::Tensor>& t, bool grad_mode) {
  return t.has_value() && needs_autograd(*t, grad_mode);
}
template <typename... Tensors>
bool records_graph(const Tensors&... inputs) {
  const bool grad_mode = at::GradMode::is_enabled();
  return (needs_autograd(inputs, grad_mode) || ...);
}

// The op called below Autograd (what Function::apply's forward does, without the node).
template <typename Signature, typename... Args>
decltype(auto) call_below_autograd(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

// Registers autogradNotImplementedFallback for ops with no derivative of their own.
inline void register_not_differentiable(torch::Library& m, std::initializer_list<const char*> ops) {
  for (const char* op : ops) m.impl(op, torch::autograd::autogradNotImplementedFallback());
}

}  // namespace rl_align
