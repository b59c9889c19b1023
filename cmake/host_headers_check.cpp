// Compiled by the host C++ compiler: the torch launchers include the kernel headers from plain
// C++ translation units, so the headers must not expose device-only code.
#include "cuda/linear_kernels.h"
#include "cuda/rms_norm_kernels.h"

int main() { return rl_align::ceil_div(3, 2) == 2 && rl_align::kLinearGradTileTokens == 64 ? 0 : 1; }
