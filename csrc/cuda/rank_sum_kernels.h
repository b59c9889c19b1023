// Host entry point of the rank_sum GPU kernel. Torch-free: the operand descriptor and the tree are
// in common/rank_sum.h (shared with the CPU kernel); the torch binding is rank_sum_launcher.cpp.
// The parts may live on other GPUs (peer-mapped symmetric memory, rl_engine_ext.distributed): the
// kernel reads them with ordinary loads.
#pragma once

#include "../common/portability.h"
#include "../common/rank_sum.h"

namespace rl_align {

// out = the tree over a.part[0 .. a.parts-1] per element, rounded once to dtype.
gpuError_t rank_sum_simt(DType dtype, const RankSumOperands& a, gpuStream_t stream);

// The symmetric-memory kernel (common/rank_sum.h, PeerSumOperands): how a segment is split into
// block ranges (the same on every rank), and the entry point (every mode).
struct PeerBlocks {
  int blocks;
  int64_t chunk;  // elements per block range, a multiple of the 16-byte group
};
PeerBlocks peer_blocks(int64_t segment, int elem);
gpuError_t peer_reduce_simt(DType dtype, const PeerSumOperands& a, gpuStream_t stream);

}  // namespace rl_align
