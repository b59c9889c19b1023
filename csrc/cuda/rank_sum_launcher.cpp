// Torch binding of the rank_sum GPU kernel (rank_sum_simt.cu): the host flow is in
// host/rank_sum.h; this backend supplies the device guard, the current stream and the kernel call.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "../host/provenance.h"
#include "../host/rank_sum.h"
#include "launcher_util.h"
#include "rank_sum_kernels.h"

namespace rl_align {
namespace {

struct CudaBackend {
  static void run(const at::Tensor& ref, const RankSumOperands& a) {
    const c10::cuda::CUDAGuard guard(ref.device());
    note_gpu_kernel("rank_sum", "simt");
    check_launch("rank_sum", rank_sum_simt(kernel_dtype(ref.scalar_type()), a, at::cuda::getCurrentCUDAStream()));
  }
};

constexpr const char* kPeerSum = "peer_rank_sum";
constexpr const char* kPeerGather = "peer_gather";

// The operands both symmetric-memory ops share: every rank's buffer and flags, the epoch, the
// message of `numel` elements in segments of `segment`.
PeerSumOperands peer_operands(const char* op, const at::Tensor& ref, int64_t numel, at::IntArrayRef buffers,
                              at::IntArrayRef flags, int64_t rank, int64_t segment, int64_t epoch) {
  TORCH_CHECK(ref.is_cuda(), "rl_align::", op, ": needs CUDA tensors, got ", ref.device());
  check_dtype(op, "out", ref);
  const int64_t parts = static_cast<int64_t>(buffers.size());
  TORCH_CHECK_VALUE(parts >= 1 && parts <= kRankSumMaxParts && static_cast<int64_t>(flags.size()) == parts,
                    "rl_align::", op, ": buffers and flags must hold one address per rank (1 to ", kRankSumMaxParts,
                    "), got ", buffers.size(), " and ", flags.size());
  TORCH_CHECK_VALUE(rank >= 0 && rank < parts, "rl_align::", op, ": rank ", rank, " outside [0, ", parts, ")");
  TORCH_CHECK_VALUE(segment > 0 || numel == 0, "rl_align::", op, ": segment must be positive, got ", segment);
  PeerSumOperands a;
  a.parts = static_cast<int>(parts);
  a.rank = static_cast<int>(rank);
  a.numel = numel;
  a.segment = segment > 0 ? segment : 1;
  a.segments = static_cast<int>(numel > 0 ? (numel + a.segment - 1) / a.segment : 1);
  TORCH_CHECK_VALUE(a.segments <= kRankSumMaxParts, "rl_align::", op, ": ", a.segments, " segments of ", segment,
                    " elements, at most ", kRankSumMaxParts);
  for (int64_t r = 0; r < parts; ++r) {
    a.buffer[r] = reinterpret_cast<void*>(static_cast<uintptr_t>(buffers[r]));
    a.flags[r] = reinterpret_cast<unsigned int*>(static_cast<uintptr_t>(flags[r]));
  }
  a.epoch = static_cast<unsigned int>(epoch);
  return a;
}

void peer_rank_sum(const at::Tensor& input, const at::Tensor& out, at::IntArrayRef buffers, at::IntArrayRef flags,
                   int64_t rank, int64_t segment, int64_t segment_index, int64_t epoch, std::optional<double> divisor) {
  check_same(kPeerSum, "input", input, "out", out);
  TORCH_CHECK_VALUE(input.is_contiguous() && out.is_contiguous(), "rl_align::", kPeerSum, ": input and out must be contiguous");
  PeerSumOperands a = peer_operands(kPeerSum, out, input.numel(), buffers, flags, rank, segment, epoch);
  // A rank past the last segment (a message shorter than one segment per rank) sums nothing but
  // still meets the others.
  TORCH_CHECK_VALUE(segment_index >= 0 && segment_index < std::max(a.segments, a.parts), "rl_align::", kPeerSum,
                    ": segment_index ", segment_index, " outside [0, ", std::max(a.segments, a.parts), ")");
  const int64_t own = std::min(a.segment, a.numel - segment_index * a.segment);
  TORCH_CHECK_VALUE(out.numel() == std::max<int64_t>(own, 0), "rl_align::", kPeerSum, ": out must hold segment ",
                    segment_index, "'s ", own, " elements, got ", out.numel());
  a.segment_index = static_cast<int>(segment_index);
  a.input = input.const_data_ptr();
  a.out = out.mutable_data_ptr();
  if (divisor.has_value()) {
    TORCH_CHECK_VALUE(*divisor > 0, "rl_align::", kPeerSum, ": divisor must be positive, got ", *divisor);
    a.divisor = static_cast<float>(*divisor);
  }
  const c10::cuda::CUDAGuard guard(out.device());
  note_gpu_kernel("peer_rank_sum", "simt");
  check_launch(kPeerSum, peer_rank_sum_simt(kernel_dtype(out.scalar_type()), a, at::cuda::getCurrentCUDAStream()));
}

void peer_gather(const at::Tensor& out, at::IntArrayRef buffers, at::IntArrayRef flags, int64_t rank, int64_t segment,
                 int64_t epoch) {
  TORCH_CHECK_VALUE(out.is_contiguous(), "rl_align::", kPeerGather, ": out must be contiguous");
  PeerSumOperands a = peer_operands(kPeerGather, out, out.numel(), buffers, flags, rank, segment, epoch);
  TORCH_CHECK_VALUE(a.segments <= a.parts, "rl_align::", kPeerGather, ": ", a.segments, " segments for ", a.parts,
                    " ranks");
  a.out = out.mutable_data_ptr();
  const c10::cuda::CUDAGuard guard(out.device());
  note_gpu_kernel("peer_gather", "simt");
  check_launch(kPeerGather, peer_gather_simt(kernel_dtype(out.scalar_type()), a, at::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("rank_sum", &rank_sum_impl<CudaBackend>);
  m.impl("peer_rank_sum", &peer_rank_sum);
  m.impl("peer_gather", &peer_gather);
}

}  // namespace rl_align
