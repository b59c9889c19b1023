// Torch binding of the embedding CPU kernels (embedding_cpu_kernels.cpp): the host flow is
// embedding_impl / embedding_grad_weight_impl (host/embedding.h); this backend supplies the id
// range check (an IndexError naming the first bad id in token order) and the kernel calls.
#include <torch/library.h>

#include "../host/embedding.h"
#include "../host/provenance.h"
#include "embedding_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void check_ids(const char* op, const at::Tensor& ids, int64_t num_embeddings) {
    const at::Tensor ids64 = ids.to(at::kLong);
    const int64_t* p = ids64.const_data_ptr<int64_t>();
    const int64_t bad = embedding_first_bad_id_cpu(p, ids64.numel(), num_embeddings);
    TORCH_CHECK_INDEX(bad < 0, "rl_align::", op, ": id ", bad < 0 ? 0 : p[bad],
                      " out of range for ", num_embeddings, " embeddings");
  }
  static void fwd(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& out) {
    const at::Tensor ids64 = ids.to(at::kLong);
    note_cpu_kernel("embedding_fwd");
    embedding_fwd_cpu(ids64.const_data_ptr<int64_t>(), ids64.numel(), weight.const_data_ptr(),
                      row_stride(weight), out.mutable_data_ptr(), weight.size(1),
                      weight.element_size());
  }
  static void bwd(const at::Tensor& grad_rows, const at::Tensor& ids, int64_t padding_idx,
                  const float* accum, const at::Tensor& dweight) {
    const at::Tensor ids64 = ids.to(at::kLong);
    note_cpu_kernel("embedding_bwd");
    embedding_bwd_cpu(grad_rows.scalar_type(), grad_rows.const_data_ptr(), row_stride(grad_rows),
                      ids64.const_data_ptr<int64_t>(), ids64.numel(), padding_idx, accum,
                      dweight.mutable_data_ptr<float>(), dweight.size(0), dweight.size(1));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("embedding", &embedding_impl<CpuBackend>);
  m.impl("embedding_grad_weight", &embedding_grad_weight_impl<CpuBackend>);
}

}  // namespace rl_align
