// The merge of a forward's per-split partial states (AttentionFwdWorkspace, attention_kernels.h)
// and the split plan that sizes them, shared by the tensor-core paths (sm80_fwd.cu, sm90_fwd.cu):
// a kPerSplit launch (few rows, each KV split on CTAs of its own) leaves one partial state per
// split of a row in the workspace, and this kernel merges them in increasing split order
// (merge_split, recurrence.cuh) and finalises the row as the main kernels' epilogue does.
// Plain fp32 arithmetic, no mma: the merged bits are those of a kMerge CTA.
#include "../attention_kernels.h"
#include "recurrence.cuh"
#include "tensor_core.h"
#include "../../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

namespace rl_align {
namespace {

// Combine: one warp per (query, head) row of a sequence whose row has several splits; the
// partials merge in increasing split order (merge_split, as a kMerge CTA does) and the result is
// finalised like the main kernel's epilogue. Grid: x = row groups (grid-stride), z = sequences.
constexpr int kCombineWarps = 4;

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kCombineWarps * kWarpSize)
    attention_split_combine_kernel(const AttentionProblem p, const AttentionFwdWorkspace w) {
#ifdef RL_ALIGN_SM80_DEVICE
  constexpr int PAIRS = HEAD_DIM / (2 * kWarpSize);  // element pairs per lane
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  T* __restrict__ out = static_cast<T*>(p.out);
  for (int64_t s = blockIdx.z; s < p.num_seqs; s += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, s);
    const int64_t rows = sq.q_len * p.heads_q;
    for (int64_t r = static_cast<int64_t>(blockIdx.x) * kCombineWarps + warp; r < rows;
         r += static_cast<int64_t>(gridDim.x) * kCombineWarps) {
      const int64_t i = r / p.heads_q, h = r % p.heads_q;
      const int64_t last_key = p.causal ? sq.first_pos() + i : sq.kv_len - 1;
      const int64_t splits = last_key / kAttentionKvSplit + 1;
      if (splits <= 1) continue;  // finalised by the main kernel
      const int64_t lse_at = sq.lse_base + h * p.lse_stride_head + i;
      const int64_t slot0 = lse_at * w.slots;
      float m = w.ml[2 * slot0], l = w.ml[2 * slot0 + 1];
      float2 a[PAIRS];
#pragma unroll
      for (int e = 0; e < PAIRS; ++e) {
        a[e] = *reinterpret_cast<const float2*>(w.acc + slot0 * HEAD_DIM + 2 * (lane + kWarpSize * e));
      }
      for (int64_t c = 1; c < splits; ++c) {
        const int64_t slot = slot0 + c;
        const SplitMergeWeights wt = merge_split(m, l, w.ml[2 * slot], w.ml[2 * slot + 1]);
#pragma unroll
        for (int e = 0; e < PAIRS; ++e) {
          const float2 x = *reinterpret_cast<const float2*>(w.acc + slot * HEAD_DIM + 2 * (lane + kWarpSize * e));
          a[e] = make_float2(merge_elem(a[e].x, x.x, wt), merge_elem(a[e].y, x.y, wt));
        }
      }
      const float inv_l = reciprocal(l);
      T* out_row = out + sq.q_base + i * p.q_stride_token + h * p.q_stride_head;
#pragma unroll
      for (int e = 0; e < PAIRS; ++e) {
        *reinterpret_cast<uint32_t*>(out_row + 2 * (lane + kWarpSize * e)) =
            pack_rounded<T>(__fmul_rn(a[e].x, inv_l), __fmul_rn(a[e].y, inv_l));
      }
      if (lane == 0) p.lse[lse_at] = final_lse(m, l);
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

template <typename T, int D>
gpuError_t launch_combine(const AttentionProblem& p, const AttentionFwdWorkspace& w, gpuStream_t stream) {
  const int64_t groups = ceil_div(p.max_q_len * p.heads_q, kCombineWarps);
  const dim3 grid(static_cast<unsigned>(groups < 65535 ? groups : 65535), 1,
                  static_cast<unsigned>(p.num_seqs < 65535 ? p.num_seqs : 65535));
  attention_split_combine_kernel<T, D><<<grid, kCombineWarps * kWarpSize, 0, stream>>>(p, w);
  return cudaGetLastError();
}

}  // namespace

gpuError_t attention_split_combine(DType dtype, const AttentionProblem& p, const AttentionFwdWorkspace& w,
                                   gpuStream_t stream) {
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype,
      [&](auto tag) {
        using T = decltype(tag);
        return p.head_dim == 64 ? launch_combine<T, 64>(p, w, stream) : launch_combine<T, 128>(p, w, stream);
      },
      gpu_not_supported);
}

// The launch plan, from shapes only: a few-rows launch (a decode step, short chunks) runs each
// split on CTAs of its own (kPerSplit: one slot per split), so that a few long sequences fill the
// GPU; a prefill launch merges as it goes (kMerge: one slot; its rows already give enough CTAs).
int64_t attention_fwd_split_slots(const AttentionProblem& p) {
  const int64_t splits = attention_split_count(p);
  if (splits <= 1) return 0;
  if (p.max_q_len * (p.heads_q / p.heads_kv) <= kAttentionPerSplitMaxRows && p.heads_kv * splits <= 65535) {
    return splits;
  }
  return 1;
}

}  // namespace rl_align

#else  // RL_ALIGN_HIP

namespace rl_align {
int64_t attention_fwd_split_slots(const AttentionProblem&) { return 0; }
}  // namespace rl_align

#endif  // RL_ALIGN_HIP
