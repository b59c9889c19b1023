// The sequence descriptors of attention_kvcache / attention_varlen with validate=False, built on
// the device from the lengths (attention_seqs_from_lengths, attention_kernels.h), for every path:
// one thread per sequence, values outside SeqsFromLengths' bounds a device-side assert
// (device_assert.cuh). One source for CUDA and HIP.
#include "../attention_kernels.h"
#include "../device_assert.cuh"

namespace rl_align {

namespace {

template <typename I>
__global__ void seqs_from_lengths_kernel(const I* lengths, const I* cache_starts, SeqsFromLengths sp, int64_t* seqs) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s < kAttentionSeqStatusWords) seqs[sp.num_seqs * kAttentionSeqFields + s] = 0;  // the status words
  if (s >= sp.num_seqs) return;
  int64_t start = s, kv_first = 0, q_len, kv_len;
  if (sp.packed) {
    constexpr const char* op = "attention_varlen";
    start = static_cast<int64_t>(lengths[s]);
    const int64_t end = static_cast<int64_t>(lengths[s + 1]);
    // cu_seqlens starting at 0, ending at the token count and non-decreasing keep every
    // sequence inside q/k/v; the length bound keeps it inside the grid.
    if (s == 0 && start != 0) fail_index_out_of_range(op, "cu_seqlens[0] =", start, "packed sequences from ", 0, "");
    if (s + 1 == sp.num_seqs && end != sp.total_tokens) {
      fail_index_out_of_range(op, "cu_seqlens[-1] =", end, "packed sequences ending at the token count ",
                              sp.total_tokens, "");
    }
    if (end < start || end - start > sp.max_len) {
      fail_index_out_of_range(op, "the sequence length cu_seqlens[i+1] - cu_seqlens[i] =", end - start,
                              "0 .. max_seqlen = ", sp.max_len, "");
    }
    q_len = kv_len = end - start;
  } else {
    kv_len = static_cast<int64_t>(lengths[s]);
    q_len = kv_len < sp.new_tokens ? kv_len : sp.new_tokens;
    if (kv_len < kvcache_min_length(sp.new_tokens) || kv_len > sp.max_len) {
      fail_index_out_of_range("attention_kvcache", "cache_seqlens", kv_len, "a cache of ", sp.max_len,
                              " positions holding the new tokens");
    }
    if (cache_starts != nullptr) {
      kv_first = static_cast<int64_t>(cache_starts[s]);
      if (kv_first < 0 || kv_first > sp.max_len - kv_len) {
        fail_index_out_of_range("attention_kvcache", "cache_starts", kv_first,
                                "a cache holding cache_seqlens positions from it in ", sp.max_len, "");
      }
    }
  }
  const int64_t padding_queries = sp.packed ? 0 : sp.new_tokens - q_len;
  int64_t* f = seqs + s * kAttentionSeqFields;
  f[kSeqQBase] = start * sp.q_stride + padding_queries * sp.q_token_stride;
  f[kSeqKvBase] = start * sp.kv_stride + kv_first * sp.kv_position_stride;
  f[kSeqLseBase] = start * sp.lse_stride + padding_queries;
  f[kSeqQLen] = q_len;
  f[kSeqKvLen] = kv_len;
}

}  // namespace

gpuError_t attention_seqs_from_lengths(const void* lengths, const void* cache_starts, bool lengths_int64,
                                       const SeqsFromLengths& sp, int64_t* seqs, gpuStream_t stream) {
  if (sp.num_seqs == 0) return kGpuSuccess;  // no kernel reads the descriptors
  constexpr int kThreads = 128;
  const unsigned blocks = static_cast<unsigned>(ceil_div(sp.num_seqs, kThreads));
  if (lengths_int64) {
    seqs_from_lengths_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const int64_t*>(lengths),
                                                              static_cast<const int64_t*>(cache_starts), sp, seqs);
  } else {
    seqs_from_lengths_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const int32_t*>(lengths),
                                                              static_cast<const int32_t*>(cache_starts), sp, seqs);
  }
  return gpu_last_error();
}

}  // namespace rl_align
