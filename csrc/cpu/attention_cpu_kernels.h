// CPU kernels of the attention ops, forward and backward, over the AttentionProblem of
// common/attention_problem.h (p.seqs is a host array here). The arithmetic (sequences and
// positions, causal rule, GQA, the online-softmax recurrence over 64-key blocks, the backward) is
// stated once, in common/attention_problem.h; this header lists only the CPU path's specifics.
//
// CPU specifics, both directions: q, k, v (and out, dout) are converted to fp32 on load (exact);
// every dot product and every accumulation is one fp32 accumulator, started from 0, that takes
// acc = acc + a * b (an fp32 multiply, then an fp32 add; no fused multiply-add, pinned by
// -ffp-contract=off in setup.py) term by term in the order given below; exp and log are std::exp /
// std::log on float. Each output element is rounded once to the input dtype (round to nearest
// even). Work is split over whole query (key) tiles, so the thread count changes no chain.
#pragma once

#include <c10/core/ScalarType.h>

#include "../common/attention_problem.h"

namespace rl_align {

// Forward, for every query row (s, h, i) with i < q_len[s]: the recurrence of
// common/attention_problem.h, with
//   s_j = sum_d q[d] * k_j[d], d = 0 .. head_dim-1 in order; x_j = scale * s_j;
//   a block with no allowed key for the row is skipped;
//   l = l * alpha + (sum_j p_j) and acc[d] = acc[d] * alpha + (sum_j p_j v_j[d]): each per-block
//   sum its own chain from 0 over the block's allowed keys only, j increasing, then multiply,
//   then add (a masked key's k_j, v_j enter no product that is read);
//   a row reaching several KV splits merges their partials by the contract's formula, a and b
//   from std::exp;
//   out[d] = acc[d] / l (rounded once), lse = m + std::log(l) (fp32).
// Rows of sequences with q_len = 0 are not written. dtype: at::kFloat, at::kHalf, at::kBFloat16.
void attention_fwd_cpu(at::ScalarType dtype, const AttentionProblem& p);

// Backward (common/attention_problem.h's backward), with the forward's out and lse (p.fwd.out,
// p.fwd.lse) and dout, per sequence and head, in these orders:
//   delta_i = sum_d dout_i[d] * out_i[d]          d in order (out as stored), into p.delta
//   P_ij = std::exp(scale * s_ij - lse_i); dP_ij = sum_d dout_i[d] * v_j[d] (d in order);
//   dS_ij = P_ij * (dP_ij - delta_i)
//   dq_i[d] = scale * (sum_j dS_ij k_j[d])        allowed keys j increasing
//   dk_j[d] = scale * (sum_{h, i} dS_ij q_i[d])   the group's heads h increasing, then the allowed
//   dv_j[d] = sum_{h, i} P_ij dout_i[d]           queries i increasing, one chain across heads
// Masked pairs (i, j) are left out of every chain (no P = dS = 0 term), so a NaN or Inf in a
// masked k_j, v_j, q_i or dout_i reaches no gradient of a row that may not see it.
// Every key 0 .. kv_len-1 of every sequence gets dk and dv (zero if no query attends to it).
void attention_bwd_cpu(at::ScalarType dtype, const AttentionGradProblem& p);

}  // namespace rl_align
