// Integer constants of the native library exported as attributes of the rl_engine_ext._C module
// (e.g. rl_engine_ext._C.LINEAR_GRAD_TILE_TOKENS), so Python reads the kernels' own numbers.
//
// An op declares its constants in its own always-compiled file (its CPU binding):
//   RL_ALIGN_NATIVE_CONSTANT(LINEAR_GRAD_TILE_TOKENS, kLinearGradTileTokens);
// Each declaration is a static registrar: it runs when the shared library is loaded (dlopen),
// before Python calls PyInit__C, which adds every registered constant to the module
// (csrc/registration.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace rl_align {

struct NativeConstant {
  const char* name;
  int64_t value;
};

// Every registered constant, in registration order. A function-local static: built on first use,
// so registrars in any translation unit may run in any order.
inline std::vector<NativeConstant>& native_constants() {
  static std::vector<NativeConstant> constants;
  return constants;
}

struct NativeConstantRegistrar {
  NativeConstantRegistrar(const char* name, int64_t value) { native_constants().push_back({name, value}); }
};

}  // namespace rl_align

#define RL_ALIGN_NATIVE_CONSTANT(name, value)                                              \
  static const ::rl_align::NativeConstantRegistrar rl_align_native_constant_##name(#name, \
                                                                                 (value))
