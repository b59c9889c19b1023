// The GPU kernels' out-of-range index check (embedding ids, logprob targets): print the op and the
// index, then fail a device-side assert, as torch's CUDA_KERNEL_ASSERT does (independent of NDEBUG;
// HIP: abort()). The kernel stops there and the context is unusable afterwards, as after
// F.embedding's; never an out-of-bounds access, never a host sync.
#pragma once

#include <cstdint>
#include <cstdio>

#include "../common/portability.h"

#if !RL_ALIGN_HIP
// Declared by <assert.h> only without NDEBUG; the device-side assert must not depend on it.
extern "C" __host__ __device__ void __assert_fail(const char*, const char*, unsigned int, const char*) noexcept;
#endif

namespace rl_align {

// Prints "rl_align::<op>: <what> <value> out of range for <before><bound><after>".
static __device__ __noinline__ void fail_index_out_of_range(const char* op, const char* what, int64_t value,
                                                            const char* before, int64_t bound, const char* after) {
  printf("rl_align::%s: %s %lld out of range for %s%lld%s\n", op, what, static_cast<long long>(value), before,
         static_cast<long long>(bound), after);
#if RL_ALIGN_HIP
  abort();
#else
  __assert_fail("rl_align: index out of range", __FILE__, __LINE__, op);
#endif
}

}  // namespace rl_align
