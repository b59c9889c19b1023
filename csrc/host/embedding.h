// Host side of embedding, shared by the CPU and GPU bindings: argument checks, output allocation,
// the empty cases and the views. A Backend supplies the id range check and the kernel calls:
//   static void check_ids(const char* op, const at::Tensor& ids_flat, int64_t num_embeddings);
//   static void fwd(const at::Tensor& ids_flat, const at::Tensor& weight, const at::Tensor& out_rows);
//   static void bwd(const at::Tensor& grad_rows, const at::Tensor& ids_flat, int64_t padding_idx,
//                   const float* dweight_accum, const at::Tensor& dweight);
// ids_flat is contiguous 1-D int32/int64; weight [V, H] has a dense last dimension (any row
// stride); out_rows is contiguous [T, H]; grad_rows is [T, H] with a dense last dimension;
// padding_idx is normalised to [0, V) or -1 for none; dweight_accum is null or contiguous fp32
// [V, H]; dweight is contiguous fp32 [V, H].
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "common.h"

namespace rl_align {

inline void check_embedding_ids(const char* op, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, "rl_align::", op,
                    ": ids must be torch.int32 or torch.int64, got ", dtype_name(ids.scalar_type()));
}

// padding_idx in [-V, V) (negative counts from the end, as torch); returns it in [0, V), or -1.
inline int64_t normalized_padding_idx(const char* op, const std::optional<int64_t>& padding_idx,
                                      int64_t num_embeddings) {
  if (!padding_idx.has_value()) return -1;
  const int64_t p = *padding_idx;
  TORCH_CHECK_VALUE(p >= -num_embeddings && p < num_embeddings, "rl_align::", op,
                    ": padding_idx must be in [-", num_embeddings, ", ", num_embeddings, "), got ", p);
  return p < 0 ? p + num_embeddings : p;
}

inline int64_t check_embedding_args(const at::Tensor& ids, const at::Tensor& weight,
                                    const std::optional<int64_t>& padding_idx) {
  constexpr const char* op = "embedding";
  check_dtype(op, "weight", weight);
  check_embedding_ids(op, ids);
  TORCH_CHECK_VALUE(weight.dim() == 2, "rl_align::", op,
                    ": weight must be 2-D [num_embeddings, hidden], got shape ", weight.sizes());
  TORCH_CHECK(ids.device() == weight.device(), "rl_align::", op, ": ids is on ", ids.device(),
              " but weight is on ", weight.device());
  return normalized_padding_idx(op, padding_idx, weight.size(0));
}

inline int64_t check_embedding_grad_weight_args(const at::Tensor& grad_out, const at::Tensor& ids,
                                                int64_t num_embeddings,
                                                const std::optional<int64_t>& padding_idx,
                                                const std::optional<at::Tensor>& dweight_accum) {
  constexpr const char* op = "embedding_grad_weight";
  check_dtype(op, "grad_out", grad_out);
  check_embedding_ids(op, ids);
  TORCH_CHECK_VALUE(num_embeddings >= 0, "rl_align::", op, ": num_embeddings must be >= 0, got ",
                    num_embeddings);
  TORCH_CHECK_VALUE(grad_out.dim() == ids.dim() + 1 &&
                        grad_out.sizes().slice(0, ids.dim()) == ids.sizes(),
                    "rl_align::", op, ": grad_out shape ", grad_out.sizes(), " must be ids shape ",
                    ids.sizes(), " + [hidden]");
  TORCH_CHECK(ids.device() == grad_out.device(), "rl_align::", op, ": ids is on ", ids.device(),
              " but grad_out is on ", grad_out.device());
  const int64_t pad = normalized_padding_idx(op, padding_idx, num_embeddings);
  check_fp32_accum(op, "dweight_accum", dweight_accum, {num_embeddings, grad_out.size(-1)}, grad_out);
  return pad;
}

template <typename Backend>
at::Tensor embedding_impl(const at::Tensor& ids, const at::Tensor& weight,
                          std::optional<int64_t> padding_idx) {
  constexpr const char* op = "embedding";
  check_embedding_args(ids, weight, padding_idx);
  const int64_t hidden = weight.size(1);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(hidden);
  at::Tensor out = at::empty(shape, weight.options());
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  Backend::check_ids(op, flat, weight.size(0));
  if (out.numel() == 0) return out;
  const at::Tensor w = hidden > 1 && weight.stride(1) != 1 ? weight.contiguous() : weight;
  Backend::fwd(flat, w, out.view({flat.size(0), hidden}));
  return out;
}

template <typename Backend>
at::Tensor embedding_grad_weight_impl(const at::Tensor& grad_out, const at::Tensor& ids,
                                      int64_t num_embeddings, std::optional<int64_t> padding_idx,
                                      const std::optional<at::Tensor>& dweight_accum) {
  constexpr const char* op = "embedding_grad_weight";
  const int64_t pad =
      check_embedding_grad_weight_args(grad_out, ids, num_embeddings, padding_idx, dweight_accum);
  const int64_t hidden = grad_out.size(-1);
  at::Tensor dweight = at::empty({num_embeddings, hidden}, grad_out.options().dtype(at::kFloat));
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  Backend::check_ids(op, flat, num_embeddings);
  if (dweight.numel() == 0) return dweight;
  const at::Tensor acc = dweight_accum.has_value() ? dweight_accum->contiguous() : at::Tensor();
  Backend::bwd(as_rows(grad_out), flat, pad,
               acc.defined() ? acc.const_data_ptr<float>() : nullptr, dweight);
  return dweight;
}

}  // namespace rl_align
