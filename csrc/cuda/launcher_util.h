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

// The path an environment variable forces: its index in `names`, or -1 when it is unset, empty
// or "auto". Tests and benchmarks force paths; an unknown name is an error, never ignored.
inline int forced_path_index(const char* op, const char* env, std::initializer_list<const char*> names) {
  const char* forced = std::getenv(env);
  if (forced == nullptr || *forced == '\0' || std::strcmp(forced, "auto") == 0) return -1;
  int i = 0;
  std::string choices = "auto";
  for (const char* name : names) {
    if (std::strcmp(forced, name) == 0) return i;
    choices += std::string(", ") + name;
    ++i;
  }
  TORCH_CHECK_VALUE(false, "rl_align::", op, ": ", env, " must be one of ", choices, ", got '", forced, "'");
}

// A kernel entry point's return code as the op's error.
inline void check_launch(const char* op, gpuError_t err) {
  TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": kernel launch failed: ", gpu_error_string(err));
}

}  // namespace rl_align
