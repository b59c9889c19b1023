// Torch binding of the attention ops' CPU kernels (attention_cpu_kernels.cpp).
#include <torch/library.h>

#include "../host/attention.h"
#include "../host/native_constants.h"
#include "../host/provenance.h"
#include "attention_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static bool needs_aligned_operands(at::ScalarType, int64_t, const at::Tensor&) { return false; }
  static void fwd(const char*, at::ScalarType dtype, const AttentionProblem& p, const at::Tensor&) {
    note_cpu_kernel("attention_fwd");
    attention_fwd_cpu(dtype, p);
  }
  static void bwd(const char*, at::ScalarType dtype, const AttentionGradProblem& p, const at::Tensor&) {
    note_cpu_kernel("attention_bwd");
    attention_bwd_cpu(dtype, p);
  }
  static void refuse_graph_capture(const char*) {}
  static at::Tensor to_device(const at::Tensor& host, const at::Tensor&) { return host; }
  // validate=False: the lengths are in host memory, so they are checked as with validate.
  static at::Tensor device_seqs(const char* op, const at::Tensor& lengths, const std::optional<at::Tensor>& starts,
                                const SeqsFromLengths& sp) {
    const std::vector<int64_t> l = host_int64(op, "lengths", lengths, lengths);
    const std::vector<int64_t> first = starts ? host_int64(op, "cache_starts", *starts, lengths) : std::vector<int64_t>{};
    return seqs_tensor<CpuBackend>(flatten(seqs_from_lengths(op, l, first, sp)), lengths);
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
