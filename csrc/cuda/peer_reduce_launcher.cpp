// Torch binding of the symmetric-memory collectives' kernel (rank_sum_simt.cu, peer_reduce_simt):
// peer_reduce, a runtime op of rl_engine_ext.distributed (RL_ALIGN_RUNTIME_SCHEMA: CUDA only, not an
// op of the registry, no reference: its operands are other GPUs' memory). The operands are checked
// here; the addresses are the workspace's (rl_engine_ext/distributed.py), trusted as given.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../host/common.h"
#include "../host/provenance.h"
#include "launcher_util.h"
#include "rank_sum_kernels.h"

namespace rl_align {
namespace {

constexpr const char* kPeer = "peer_reduce";

std::vector<void*> addresses(at::IntArrayRef values) {
  std::vector<void*> out;
  for (int64_t v : values) out.push_back(reinterpret_cast<void*>(static_cast<uintptr_t>(v)));
  return out;
}

// The symmetric-memory collectives' one op (common/rank_sum.h, PeerSumOperands): mode 0 one_shot,
// 1 reduce_scatter, 2 two_shot; slots / gather / flags: every rank's addresses, in rank order.
void peer_reduce(const at::Tensor& input, const at::Tensor& out, int64_t mode, at::IntArrayRef slots,
                 at::IntArrayRef gather, at::IntArrayRef flags, int64_t rank, int64_t segment, int64_t input_stride,
                 int64_t epoch, std::optional<double> divisor) {
  TORCH_CHECK(out.is_cuda(), "rl_align::", kPeer, ": needs CUDA tensors, got ", out.device());
  check_dtype(kPeer, "out", out);
  check_same(kPeer, "input", input, "out", out);
  TORCH_CHECK_VALUE(input.is_contiguous() && out.is_contiguous(), "rl_align::", kPeer, ": input and out must be contiguous");
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "rl_align::", kPeer, ": mode must be 0, 1 or 2, got ", mode);
  const int64_t parts = static_cast<int64_t>(slots.size());
  TORCH_CHECK_VALUE(parts >= 1 && parts <= kRankSumMaxParts && static_cast<int64_t>(flags.size()) == parts,
                    "rl_align::", kPeer, ": slots and flags must hold one address per rank (1 to ", kRankSumMaxParts,
                    "), got ", slots.size(), " and ", flags.size());
  TORCH_CHECK_VALUE(rank >= 0 && rank < parts, "rl_align::", kPeer, ": rank ", rank, " outside [0, ", parts, ")");
  // reduce_scatter of a piece: W segments of `segment` elements, input_stride apart in input.
  const bool scatter = mode == static_cast<int64_t>(PeerMode::kReduceScatter);
  const int64_t numel = scatter ? parts * segment : input.numel();
  TORCH_CHECK_VALUE(segment > 0 || numel == 0, "rl_align::", kPeer, ": segment must be positive, got ", segment);
  TORCH_CHECK_VALUE(scatter ? input_stride >= segment && input.numel() >= (parts - 1) * input_stride + segment
                            : input_stride == segment,
                    "rl_align::", kPeer, ": input of ", input.numel(), " elements cannot hold ", parts,
                    " segments of ", segment, " elements ", input_stride, " apart");
  PeerSumOperands a;
  a.mode = static_cast<PeerMode>(mode);
  a.parts = static_cast<int>(parts);
  a.rank = static_cast<int>(rank);
  a.numel = numel;
  a.segment = std::max<int64_t>(segment, 1);
  a.input_stride = std::max<int64_t>(input_stride, 1);
  a.segments = static_cast<int>(numel > 0 ? (numel + a.segment - 1) / a.segment : 1);
  const int64_t want_out = a.mode == PeerMode::kReduceScatter ? segment : numel;
  TORCH_CHECK_VALUE(out.numel() == want_out, "rl_align::", kPeer, ": out must hold ", want_out, " elements, got ",
                    out.numel());
  switch (a.mode) {
    case PeerMode::kOneShot:
      TORCH_CHECK_VALUE(segment == numel, "rl_align::", kPeer, ": one_shot's segment is the message");
      break;
    case PeerMode::kReduceScatter:
      break;
    case PeerMode::kTwoShot:
      TORCH_CHECK_VALUE(a.segments <= parts && static_cast<int64_t>(gather.size()) == parts, "rl_align::", kPeer,
                        ": two_shot needs at most one segment per rank and one gather address per rank");
      break;
  }
  const std::vector<void*> slot_ptrs = addresses(slots), gather_ptrs = addresses(gather), flag_ptrs = addresses(flags);
  for (int64_t r = 0; r < parts; ++r) {
    a.slots[r] = slot_ptrs[r];
    a.gather[r] = r < static_cast<int64_t>(gather_ptrs.size()) ? gather_ptrs[r] : nullptr;
    a.flags[r] = static_cast<unsigned int*>(flag_ptrs[r]);
  }
  a.input = input.const_data_ptr();
  a.out = out.mutable_data_ptr();
  a.epoch = static_cast<unsigned int>(epoch);
  if (divisor.has_value()) {
    TORCH_CHECK_VALUE(*divisor > 0, "rl_align::", kPeer, ": divisor must be positive, got ", *divisor);
    a.divisor = static_cast<float>(*divisor);
  }
  const c10::cuda::CUDAGuard guard(out.device());
  note_gpu_kernel("peer_reduce", "simt");
  check_launch(kPeer, peer_reduce_simt(kernel_dtype(out.scalar_type()), a, at::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) { m.impl("peer_reduce", &peer_reduce); }

}  // namespace rl_align
