// Torch binding of the rank_sum CPU kernel (rank_sum_cpu_kernels.cpp): the host flow is in
// host/rank_sum.h; this backend supplies the kernel call.
#include <torch/library.h>

#include "../host/provenance.h"
#include "../host/rank_sum.h"
#include "../host/native_constants.h"
#include "rank_sum_cpu_kernels.h"

namespace rl_align {
namespace {

RL_ALIGN_NATIVE_CONSTANT(RANK_SUM_MAX_PARTS, kRankSumMaxParts);
RL_ALIGN_NATIVE_CONSTANT(RANK_SUM_PEER_FLAG_BYTES, kPeerFlagBytes);

struct CpuBackend {
  static void run(const at::Tensor& ref, const RankSumOperands& a) {
    note_cpu_kernel("rank_sum");
    rank_sum_cpu(ref.scalar_type(), a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) { m.impl("rank_sum", &rank_sum_impl<CpuBackend>); }

}  // namespace rl_align
