// delta_i = dot(dO_i, O_i) per (query, head), the first kernel of both tensor-core backwards
// (sm80_bwd.cu, sm90_bwd.cu): D / 8 lanes per row, each an fma chain over its 8 consecutive
// elements of d (increasing), then a butterfly over the lanes (lane distances 1, 2, 4, ...: a fixed
// tree, and every lane ends with the same bits). Plain fp32 arithmetic, no mma.
#include "../attention_kernels.h"
#include "tensor_core.h"
#include "../../primitives/mma_sm80.h"

#if !RL_ALIGN_HIP

namespace rl_align {
namespace {

// delta: ROW_LANES lanes (one 16-byte chunk of O and dO each) per (query, head) row.
template <int HEAD_DIM_>
struct DeltaConfig {
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int THREADS = 256;
  static constexpr int ROW_LANES = HEAD_DIM / kChunkElems;
  static constexpr int ROWS = THREADS / ROW_LANES;  // query rows (of one head) per CTA
  static_assert(kWarpSize % ROW_LANES == 0, "a row's lanes sit in one warp");
};

// Grid: x = blocks of ROWS queries (grid-stride up to q_len), y = query head, z = sequences
// (grid-stride).
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::THREADS) attention_bwd_delta_kernel(const AttentionGradProblem gp) {
#ifdef RL_ALIGN_SM80_DEVICE
  const AttentionProblem& p = gp.fwd;
  const int tid = static_cast<int>(threadIdx.x);
  const int row = tid / Cfg::ROW_LANES, chunk = tid % Cfg::ROW_LANES;
  const int64_t head = blockIdx.y;
  const T* __restrict__ out = static_cast<const T*>(p.out);
  const T* __restrict__ dout = static_cast<const T*>(gp.dout);
  for (int64_t s = blockIdx.z; s < p.num_seqs; s += gridDim.z) {
    const AttentionSeq sq = attention_seq(p, s);
    const int64_t q_len = sq.q_len;
    const int64_t row_off = sq.q_base + head * p.q_stride_head + chunk * kChunkElems;
    // The loop condition is uniform per CTA, so every lane reaches the shuffles.
    for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * Cfg::ROWS; i0 < q_len;
         i0 += static_cast<int64_t>(gridDim.x) * Cfg::ROWS) {
      const int64_t i = i0 + row;
      float acc = 0.f;
      if (i < q_len) {
        const int64_t off = row_off + i * p.q_stride_token;
        const uint4 o_bits = *reinterpret_cast<const uint4*>(out + off);
        const uint4 do_bits = *reinterpret_cast<const uint4*>(dout + off);
        const T* o = reinterpret_cast<const T*>(&o_bits);
        const T* d = reinterpret_cast<const T*>(&do_bits);
#pragma unroll
        for (int e = 0; e < kChunkElems; ++e) {
          acc = __fmaf_rn(Convert<T>::to_float(d[e]), Convert<T>::to_float(o[e]), acc);
        }
      }
#pragma unroll
      for (int m = 1; m < Cfg::ROW_LANES; m *= 2) acc = __fadd_rn(acc, shfl_xor(acc, m, Cfg::ROW_LANES));
      if (i < q_len && chunk == 0) gp.delta[sq.lse_base + head * p.lse_stride_head + i] = acc;
    }
  }
#endif  // RL_ALIGN_SM80_DEVICE
}

unsigned grid_dim(int64_t n, int64_t cap) { return static_cast<unsigned>(n < cap ? n : cap); }

template <typename T, int D>
gpuError_t launch_delta(const AttentionGradProblem& gp, gpuStream_t stream) {
  using Delta = DeltaConfig<D>;
  const AttentionProblem& p = gp.fwd;
  const dim3 delta_grid(grid_dim(ceil_div(p.max_q_len, Delta::ROWS), INT32_MAX),
                        static_cast<unsigned>(p.heads_q), grid_dim(p.num_seqs, 65535));
  attention_bwd_delta_kernel<T, Delta><<<delta_grid, Delta::THREADS, 0, stream>>>(gp);
  return cudaGetLastError();
}

}  // namespace

gpuError_t attention_bwd_delta(DType dtype, const AttentionGradProblem& gp, gpuStream_t stream) {
  return dispatch_dtype<KernelTypes, DTypeSet::kHalfOnly>(
      dtype,
      [&](auto tag) {
        using T = decltype(tag);
        return gp.fwd.head_dim == 64 ? launch_delta<T, 64>(gp, stream) : launch_delta<T, 128>(gp, stream);
      },
      gpu_not_supported);
}

}  // namespace rl_align

#endif  // !RL_ALIGN_HIP
