// rank_sum: the fixed reduction tree of the invariant collectives (rl_engine_ext.distributed) and
// the operand descriptor of its kernels. Torch-free and GPU-runtime-free; the CPU and GPU kernels
// both fold with RankSumTree below, so every path adds the same operands in the same order.
//
// The tree over W parts p_0 .. p_{W-1} (one per rank, in rank order), per element, in fp32:
//
//   level 1: (p0 + p1), (p2 + p3), ...       a part without a partner (W odd) goes up as it is
//   level 2: ((p0 + p1) + (p2 + p3)), ...    the same rule on the level's sums
//   ...      until one value is left; then divided by `divisor` if one is given; rounded once
//
// e.g. W = 4: ((p0 + p1) + (p2 + p3)); W = 3: ((p0 + p1) + p2); W = 6: (((p0 + p1) + (p2 + p3)) +
// (p4 + p5)). Each + is one IEEE fp32 addition rounded to nearest (add_rn), the left operand the
// lower ranks' sum. The order depends on W alone: never on the message size, how a collective
// split the message, or which kernel ran, which is why a value's bits do not depend on them.
//
// RankSumTree computes this tree in one pass over the parts (as a binary counter: slot k holds the
// pending sum of the last complete block of 2^k parts), so a kernel holds log2(W) + 1 partial sums,
// not W values: part r is added into the blocks it completes (the bits set in r, lowest first,
// each time as block + carry), and at the end the pending blocks are folded from the smallest up
// (block + carry). For every W this is the level-by-level tree above (tests/test_rank_sum.py
// checks it against a level-by-level reference for W = 1 .. 64).
#pragma once

#include <cstdint>

#include "host_device.h"

namespace rl_align {

// Parts one call takes: 64 ranks of one group. kRankSumDepth slots cover it (bit 6 is 64's).
constexpr int kRankSumMaxParts = 64;
constexpr int kRankSumDepth = 7;

struct RankSumOperands {
  int parts = 0;
  int64_t numel = 0;
  const void* part[kRankSumMaxParts] = {};  // each `numel` dense elements of the one dtype
  void* out = nullptr;                      // `numel` dense elements of that dtype
  float divisor = 0.f;                      // 0: none (a sum); else the sum divided by it (an average)
};

struct RankSumTree {
  float slot[kRankSumDepth] = {};

  // Part r (0-based, in rank order) of the fold.
  RL_ALIGN_HOST_DEVICE void add(int r, float value) {
    float carry = value;
    bool placed = false;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
    for (int k = 0; k < kRankSumDepth; ++k) {
      if (!placed) {
        if ((r >> k) & 1) {
          carry = add_rn(slot[k], carry);  // the earlier block on the left
        } else {
          slot[k] = carry;
          placed = true;
        }
      }
    }
  }

  // The tree's value after `parts` parts were added (parts >= 1), divided by `divisor` if nonzero.
  RL_ALIGN_HOST_DEVICE float result(int parts, float divisor) const {
    float acc = 0.f;
    bool any = false;
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#pragma unroll
#endif
    for (int k = 0; k < kRankSumDepth; ++k) {
      if ((parts >> k) & 1) {
        acc = any ? add_rn(slot[k], acc) : slot[k];
        any = true;
      }
    }
    return divisor != 0.f ? div_rn(acc, divisor) : acc;
  }
};

// The symmetric-memory collectives' fused kernels (rl_engine_ext.distributed, one_shot / two_shot):
// every rank's workspace holds its data region and its flags; `buffer[r]` / `flags[r]` are rank r's,
// mapped into this GPU. The message (numel elements) is `segments` segments of `segment` elements
// (the last one shorter), each split into the same contiguous block ranges on every rank (a function
// of segment and dtype only), so block b of every rank handles the same elements.
//   peer_rank_sum: block b copies its range of every segment of `input` into buffer[rank], signals
//     every rank, waits for every rank's block b (flags), then folds segment `segment_index`'s range
//     over buffer[0 .. parts-1] with RankSumTree into `out` (out may be input: in place).
//   peer_gather: block b signals and waits likewise, then copies segment r's range from buffer[r]
//     into `out` for every r (two_shot's second shot: buffer[r] holds rank r's summed segment).
// Flags: flags[r][b * kRankSumMaxParts + sender] = the epoch of the sender's latest arrival
// (monotonic: a rank is at most one call ahead of another, so waiting for >= epoch suffices).
constexpr int kPeerMaxBlocks = 128;
constexpr int64_t kPeerFlagBytes = int64_t{kPeerMaxBlocks} * kRankSumMaxParts * 4;

struct PeerSumOperands {
  int parts = 0;
  int rank = 0;
  int64_t numel = 0;
  int64_t segment = 0;       // elements per segment
  int segments = 1;
  int segment_index = 0;     // peer_rank_sum: the segment this rank sums
  const void* input = nullptr;
  void* out = nullptr;
  void* buffer[kRankSumMaxParts] = {};
  unsigned int* flags[kRankSumMaxParts] = {};
  unsigned int epoch = 0;
  float divisor = 0.f;
};

}  // namespace rl_align
