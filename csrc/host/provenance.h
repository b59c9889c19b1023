// Kernel provenance: counts of which rl_align kernels ran on which path, while a recorder is
// active (rl_engine_ext.record_kernels; the rl_align::kernel_record_* ops below read them).
//
// Every launch site calls one of these, once per kernel launch, in the backend function that
// launches it (so backward kernels run by the C++ autograd functions count too):
//   note_cpu_kernel("rms_norm_fwd");            // counted as ("rms_norm_fwd", "cpu")
//   note_gpu_kernel("linear_gemm", "sm90");     // counted as ("linear_gemm", "cuda/sm90")
// The kernel name is the kernel entry point's without its path suffix (rms_norm_fwd_cpu,
// linear_gemm_sm90); GPU paths carry torch's device type "cuda" on ROCm builds too. With no
// recorder active a call is one relaxed atomic load. Launches replayed by a CUDA graph do not pass
// through the host code and are not counted.
#pragma once

#include <atomic>

namespace rl_align {
namespace provenance {

// The number of active recorders (kernel_record_start minus kernel_record_stop).
extern std::atomic<int> active_recorders;

// Adds one to the count of (kernel, path); thread-safe.
void count(const char* kernel, const char* device, const char* path);

}  // namespace provenance

inline void note_cpu_kernel(const char* kernel) {
  if (provenance::active_recorders.load(std::memory_order_relaxed) > 0) {
    provenance::count(kernel, "cpu", nullptr);
  }
}

inline void note_gpu_kernel(const char* kernel, const char* path) {
  if (provenance::active_recorders.load(std::memory_order_relaxed) > 0) {
    provenance::count(kernel, "cuda", path);
  }
}

}  // namespace rl_align
