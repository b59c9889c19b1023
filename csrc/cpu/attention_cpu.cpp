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
  static void refuse_graph_capture(const char*) {}
  static at::Tensor to_device(const at::Tensor& host, const at::Tensor&) { return host; }
  // attention_kvcache(validate=False): host memory, so the lengths are checked as with validate.
  static at::Tensor kvcache_seqs(const at::Tensor& lens, const KvcacheStrides& st) {
    const at::Tensor l = lens.to(at::kLong).contiguous();
    const int64_t* len = l.const_data_ptr<int64_t>();
    at::Tensor seqs = at::zeros({l.numel() * kAttentionSeqFields + 1}, l.options());  // + the status word
    int64_t* f = seqs.mutable_data_ptr<int64_t>();
    for (int64_t b = 0; b < l.numel(); ++b, f += kAttentionSeqFields) {
      check_cache_seqlen(b, len[b], st.new_tokens, st.capacity);
      f[kSeqQBase] = b * st.q;
      f[kSeqKvBase] = b * st.kv;
      f[kSeqLseBase] = b * st.lse;
      f[kSeqQLen] = st.new_tokens;
      f[kSeqKvLen] = len[b];
    }
    return seqs;
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
