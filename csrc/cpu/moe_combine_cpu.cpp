// Torch binding of the moe_combine CPU kernels (moe_combine_cpu_kernels.cpp): the host flow is in
// host/moe_combine.h; this backend supplies the position range check (an IndexError naming the
// first bad position in row-major order), the row owners and the kernel calls.
#include <torch/library.h>

#include "../host/moe_combine.h"
#include "../host/provenance.h"
#include "moe_combine_cpu_kernels.h"

namespace rl_align {
namespace {

struct CpuBackend {
  static void check_positions(const char* op, const at::Tensor& positions, int64_t rows) {
    const int64_t* p = positions.const_data_ptr<int64_t>();
    const int64_t bad = moe_combine_first_bad_position_cpu(p, positions.numel(), rows);
    TORCH_CHECK_INDEX(bad < 0, "rl_align::", op, ": position ", bad < 0 ? 0 : p[bad],
                      " out of range for ", rows, " rows of expert_out");
  }
  static void fwd(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    note_cpu_kernel("moe_combine_fwd");
    moe_combine_fwd_cpu(expert_out.scalar_type(), a);
  }
  static void owners(const char* op, const at::Tensor& positions, const at::Tensor& owner) {
    check_positions(op, positions, owner.size(0));
    moe_combine_owners_cpu(positions.const_data_ptr<int64_t>(), positions.numel(),
                           owner.mutable_data_ptr<int64_t>(), owner.size(0));
  }
  static void bwd_rows(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    note_cpu_kernel("moe_combine_bwd_rows");
    moe_combine_bwd_rows_cpu(expert_out.scalar_type(), a);
  }
  static void bwd_weights(const at::Tensor& expert_out, const MoeCombineOperands& a) {
    note_cpu_kernel("moe_combine_bwd_weights");
    moe_combine_bwd_weights_cpu(expert_out.scalar_type(), a);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CPU, m) {
  m.impl("moe_combine", &moe_combine_impl<CpuBackend>);
  m.impl("moe_combine_backward", &moe_combine_backward_impl<CpuBackend>);
}

}  // namespace rl_align
