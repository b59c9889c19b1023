// Compiled by the host C++ compiler: the torch launchers include the kernel headers from plain
// C++ translation units, so the headers must not expose device-only code.
#include "cuda/attention_kernels.h"
#include "cuda/linear_kernels.h"
#include "cuda/rms_norm_kernels.h"

int main() {
  const bool ok = rl_align::ceil_div(3, 2) == 2 && rl_align::kLinearGradTileTokens == 64 &&
                  rl_align::kAttentionKvBlock == 64;
  return ok ? 0 : 1;
}
