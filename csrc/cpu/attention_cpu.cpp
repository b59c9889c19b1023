// Torch binding of the attention ops' CPU kernels (attention_cpu_kernels.cpp).
#include <torch/library.h>

#include "../host/attention.h"
#include "../host/native_constants.h"
#include "attention_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static bool needs_aligned_operands(at::ScalarType, int64_t, const at::Tensor&) { return false; }
  static void fwd(const char*, at::ScalarType dtype, const AttentionProblem& p, const at::Tensor&) {
    attention_fwd_cpu(dtype, p);
  }
  static void bwd(const char*, at::ScalarType dtype, const AttentionGradProblem& p, const at::Tensor&) {
    attention_bwd_cpu(dtype, p);
  }
  // attention_kvcache(validate=False): host memory, so the lengths are checked as with validate.
  static void check_cache_seqlens(const at::Tensor& lens, int64_t new_tokens, int64_t capacity) {
    const int64_t* l = lens.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < lens.numel(); ++b) check_cache_seqlen(b, l[b], new_tokens, capacity);
  }
};

}  // namespace

RL_ALIGN_NATIVE_CONSTANT(ATTENTION_KV_BLOCK, kAttentionKvBlock);
RL_ALIGN_NATIVE_CONSTANT(ATTENTION_KV_SPLIT, kAttentionKvSplit);

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("attention", &attention_impl<CpuBackend>);
  m.impl("attention_backward", &attention_backward_impl<CpuBackend>);
  m.impl("attention_varlen", &attention_varlen_impl<CpuBackend>);
  m.impl("attention_varlen_backward", &attention_varlen_backward_impl<CpuBackend>);
  m.impl("attention_kvcache", &attention_kvcache_impl<CpuBackend>);
}

}  // namespace rl_align
