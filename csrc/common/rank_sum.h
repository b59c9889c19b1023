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

// The symmetric-memory collectives' kernel (rl_engine_ext.distributed: one_shot, two_shot): every
// rank's workspace holds a slot region, a gather region and the flags of a barrier, mapped into
// every GPU of the group; `slots[r]`, `gather[r]`, `flags[r]` are rank r's. Data moves by stores
// into the receiving rank's memory (NVLink writes are faster than reads), and every fold reads
// local memory only. The message (numel elements) is `segments` segments of `segment` elements
// (the last one shorter); each segment is split into the same contiguous block ranges on every
// rank (a function of the segment length and the dtype only), so block b of every rank moves and
// folds the same elements, and a barrier per block (block b of every rank) is enough:
//   kOneShot       segment = the message. Block b stores its range of the message into slot `rank`
//                  of every rank, meets block b of every rank, folds its range over its own W slots
//                  (slot q = rank q's message) into out.
//   kReduceScatter the message is W segments; segment s goes to slot `rank` of rank s. After the
//                  barrier, each rank folds its slots (every rank's segment `rank`) into out (one
//                  segment).
//   kTwoShot       as kReduceScatter, then the folded range goes to every rank's gather region (at
//                  segment `rank`); a second barrier; then block b copies its range of every segment
//                  from its own gather region into out (the whole message).
// Flags: flags[r][b * kRankSumMaxParts + sender] = the epoch of the sender's latest arrival there
// (monotonic: a rank is at most one barrier ahead of another, so waiting for >= epoch suffices).
// out may be input (in place): block b reads its input range before it writes that range. A message
// larger than the workspace goes through in pieces, one launch each (rl_engine_ext.distributed).
// Few blocks: the kernel spin-waits at its barriers, and must leave SMs to the kernels a late rank may
// be waiting for (another stream's NCCL kernel on this GPU): with most SMs held by spinning blocks,
// an FSDP2 backward deadlocked (H200 x 2 and x 4).
constexpr int kPeerMaxBlocks = 32;
constexpr int64_t kPeerFlagBytes = int64_t{kPeerMaxBlocks} * kRankSumMaxParts * 4;

enum class PeerMode : int { kOneShot = 0, kReduceScatter = 1, kTwoShot = 2 };

struct PeerSumOperands {
  PeerMode mode = PeerMode::kOneShot;
  int parts = 0;
  int rank = 0;
  int64_t numel = 0;         // the message
  int64_t segment = 0;       // elements per segment (the slot size)
  int64_t input_stride = 0;  // elements between the starts of consecutive segments in input (kReduceScatter
                             // of a piece of a larger message: the whole message's segment; else segment)
  int segments = 1;
  const void* input = nullptr;
  void* out = nullptr;
  void* slots[kRankSumMaxParts] = {};
  void* gather[kRankSumMaxParts] = {};
  unsigned int* flags[kRankSumMaxParts] = {};
  unsigned int epoch = 0;  // the first barrier's; kTwoShot's second is epoch + 1
  float divisor = 0.f;
};

}  // namespace rl_align
