// typed_op: an rl_align op's typed dispatcher handle, so that a caller names each schema's C++
// signature once. Used where one op calls another through the dispatcher: the host flow of
// linear_logprob (which calls logprob) and the autograd Functions (csrc/autograd/common.h).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace rl_align {

// The op `name` ("rl_align::<op>", default overload) as a typed handle; the dispatcher checks
// Signature against the schema. Look it up once, into a function-local static.
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace rl_align
