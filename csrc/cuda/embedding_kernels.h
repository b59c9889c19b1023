// Host entry points of the embedding GPU kernels. Torch-free: raw pointers, the portability
// layer's dtype enum and stream type. The torch binding is embedding_launcher.cpp.
//
// Out-of-range ids never cause an out-of-bounds access: the forward checks each id on the device
// and, for a bad one, prints "rl_align::embedding: id X out of range for V embeddings" and fails a
// device-side assert (the stream's next synchronisation raises "device-side assert triggered", as
// torch's own embedding does); the backward does the same from the sorted ids (its first and last).
#pragma once

#include <cstdint>

#include "../common/portability.h"

namespace rl_align {

// out[t, :] = weight[ids[t], :] for t < tokens (a copy of rows). ids: int32 or int64
// (ids_int64), contiguous; weight rows are weight_row_stride elements apart, the last dim dense;
// out is contiguous [tokens, hidden].
gpuError_t embedding_fwd_simt(DType dtype, const void* ids, bool ids_int64, int64_t tokens,
                              const void* weight, int64_t weight_row_stride,
                              int64_t num_embeddings, void* out, int64_t hidden,
                              gpuStream_t stream);

// Elements of int64 scratch that embedding_bwd_simt needs (the segment starts of every row).
inline int64_t embedding_bwd_workspace_elements(int64_t num_embeddings) { return num_embeddings + 1; }

// dweight[v, :] = dweight_accum[v, :] (or 0), then += grad_out[t, :] for the tokens t with id v in
// increasing t, on one fp32 accumulator per element: every row written once, by one thread per
// column, no atomics. sorted_ids (int32 or int64) and order (int64) are a STABLE sort of the
// tokens' ids and the token positions in that order (ties in token order). Rows equal to
// padding_idx (-1: none) take no tokens. dweight_accum (may be null) and dweight are contiguous fp32
// [num_embeddings, hidden]; grad_out rows are grad_out_row_stride elements apart.
gpuError_t embedding_bwd_simt(DType dtype, const void* grad_out, int64_t grad_out_row_stride,
                              const void* sorted_ids, bool ids_int64, const int64_t* order,
                              int64_t tokens, int64_t padding_idx, const float* dweight_accum,
                              float* dweight, int64_t* workspace, int64_t num_embeddings,
                              int64_t hidden, gpuStream_t stream);

}  // namespace rl_align
