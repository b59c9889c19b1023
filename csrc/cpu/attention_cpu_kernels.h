// CPU kernels of the attention ops, forward and backward, over the AttentionProblem of
// common/attention_problem.h (p.seqs is a host array here). Torch types only at the interface;
// the arithmetic each promises is spelled out below.
//
// Common to both: q, k, v (and out, dout) are converted to fp32 on load (exact); every dot
// product and every accumulation is one fp32 accumulator, started from 0, that takes
// acc = acc + a * b (an fp32 multiply, then an fp32 add; no fused multiply-add) term by term in
// the order given; exp and log are std::exp / std::log on float. Each output element is rounded
// once to the input dtype (round to nearest even). A query i of sequence s sits at position
// pos = kv_len - q_len + i; key j is allowed for it if j <= pos (causal) or always (not causal);
// query head h reads key/value head h / (heads_q / heads_kv).
#pragma once

#include <ATen/ATen.h>

#include "../common/attention_problem.h"

namespace rl_align {

// For every query row (s, h, i) with i < q_len[s]:
//   s_j = sum_d q[d] * k_j[d]                                  d = 0 .. head_dim-1 in order
//   keys in blocks [64 b, 64 b + 64) of the sequence's own positions, b increasing; a block with
//   no allowed key for the row is skipped. m = -inf, l = 0, acc[d] = 0; per block, over its
//   allowed keys j (increasing):
//     x_j = scale * s_j;  m' = max(m, max_j x_j);  alpha = exp(m - m');  p_j = exp(x_j - m')
//     l = l * alpha + (sum_j p_j)                 the sum from 0, j increasing
//     acc[d] = acc[d] * alpha + (sum_j p_j v_j[d])  the sum from 0, j increasing
//   out[d] = acc[d] / l (rounded once), lse = m + log(l) (fp32).
// Rows of sequences with q_len = 0 are not written. dtype: at::kFloat, at::kHalf, at::kBFloat16.
void attention_fwd_cpu(at::ScalarType dtype, const AttentionProblem& p);

// With the forward's out and lse (p.fwd.out, p.fwd.lse) and dout, per sequence and head:
//   delta_i = sum_d dout_i[d] * out_i[d]                       d in order (out as stored), into p.delta
//   P_ij = exp(scale * s_ij - lse_i), dP_ij = sum_d dout_i[d] * v_j[d] (d in order),
//   dS_ij = P_ij * (dP_ij - delta_i); masked (i, j): P_ij = dS_ij = 0
//   dq_i[d] = scale * (sum_j dS_ij k_j[d])        keys j increasing
//   dk_j[d] = scale * (sum_{h, i} dS_ij q_i[d])   the group's heads h increasing, then queries i
//   dv_j[d] = sum_{h, i} P_ij dout_i[d]           increasing, one chain across heads
// Every key 0 .. kv_len-1 of every sequence gets dk and dv (zero if no query attends to it).
// Written for q_len == kv_len (the contract's backward); positions follow the forward's rule.
void attention_bwd_cpu(at::ScalarType dtype, const AttentionGradProblem& p);

}  // namespace rl_align
