// CPU kernels of embedding, forward and backward. Torch types only at the interface (the dtype).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace rl_align {

// The position of the first id outside [0, num_embeddings) in token order, or -1.
int64_t embedding_first_bad_id_cpu(const int64_t* ids, int64_t tokens, int64_t num_embeddings);

// out[t, :] = weight[ids[t], :], a byte copy of each row (ids checked by the caller). weight rows
// are weight_row_stride elements apart; out is contiguous [tokens, hidden].
void embedding_fwd_cpu(const int64_t* ids, int64_t tokens, const void* weight,
                       int64_t weight_row_stride, void* out, int64_t hidden, int64_t element_size);

// dweight[v, :] = dweight_accum[v, :] (or 0), then += float(grad_out[t, :]) for each token t with
// ids[t] == v in increasing t: one fp32 add per token and element, no other rounding. Rows equal
// to padding_idx (-1: none) take no tokens. dtype is grad_out's: at::kFloat, at::kHalf or
// at::kBFloat16 (caller has checked). dweight_accum may be null; both are contiguous [V, hidden].
void embedding_bwd_cpu(at::ScalarType dtype, const void* grad_out, int64_t grad_out_row_stride,
                       const int64_t* ids, int64_t tokens, int64_t padding_idx,
                       const float* dweight_accum, float* dweight, int64_t num_embeddings,
                       int64_t hidden);

}  // namespace rl_align
