// Pieces every torch launcher of the GPU kernels shares: the forced-path environment variables
// of the multi-path ops. (The torch dtype -> kernel DType map, kernel_dtype, is in host/common.h.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "../common/portability.h"
#include "../host/common.h"

namespace rl_align {

// The choice an environment variable forces: its index in names[0 .. count), or -1 when it is
// unset, empty or "auto". Tests and benchmarks force paths and tile configurations; an unknown
// name is an error, never ignored.
inline int forced_choice_index(const char* op, const char* env, const char* const* names, int count) {
  const char* forced = std::getenv(env);
  if (forced == nullptr || *forced == '\0' || std::strcmp(forced, "auto") == 0) return -1;
  std::string choices = "auto";
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(forced, names[i]) == 0) return i;
    choices += std::string(", ") + names[i];
  }
  TORCH_CHECK_VALUE(false, "rl_align::", op, ": ", env, " must be one of ", choices, ", got '", forced, "'");
}
inline int forced_path_index(const char* op, const char* env, std::initializer_list<const char*> names) {
  return forced_choice_index(op, env, names.begin(), static_cast<int>(names.size()));
}

// A kernel entry point's return code as the op's error.
inline void check_launch(const char* op, gpuError_t err) {
  TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": kernel launch failed: ", gpu_error_string(err));
}

}  // namespace rl_align
