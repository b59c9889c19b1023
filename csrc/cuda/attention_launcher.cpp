// Torch binding of the attention GPU kernels: path choice, device guard, current stream, dtype
// mapping. The kernels live in attention/: sm90_fwd.cu / sm90_bwd.cu (Hopper), sm80_fwd.cu /
// sm80_bwd.cu and simt.cu (FMA kernels), with the pieces every path shares beside them.
//
// Path: decided here and nowhere else (launch_path), from (dtype, head_dim, device) only, so
// decode, chunked prefill and training forwards of one model always share it: bf16/fp16 with
// head_dim 64 or 128 take sm90 on an sm_90a build running on compute capability 9.0, else sm80 on
// CUDA GPUs >= 8.0; fp32 (true fp32, no TF32), other head dims and HIP take simt. sm90 and sm80
// give the same bits, so a layout the sm90 path's tensor maps cannot address
// (attention_sm90_layout_problem) runs sm80 there. RL_ENGINE_EXT_ATTENTION_PATH=sm90|sm80|simt
// forces one (tests, benchmarks); forcing a path the device or the layout cannot run is an error,
// never a silent fallback.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <string>

#include "../host/attention.h"
#include "../host/provenance.h"
#include "attention_kernels.h"
#include "launcher_util.h"

namespace rl_align {
namespace {

const char* path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::kSm90: return "sm90";
    case AttentionPath::kSm80: return "sm80";
    case AttentionPath::kSimt: return "simt";
  }
  return "?";
}

struct PathChoice {
  AttentionPath path;
  bool forced;  // by RL_ENGINE_EXT_ATTENTION_PATH
};

// The path (dtype, head_dim, device) give, before the layout is known.
PathChoice choose_path(const char* op, at::ScalarType dtype, int64_t head_dim, int device) {
  const DType dt = kernel_dtype(dtype);
  constexpr AttentionPath kPaths[] = {AttentionPath::kSm90, AttentionPath::kSm80, AttentionPath::kSimt};
  const int forced = forced_path_index(op, "RL_ENGINE_EXT_ATTENTION_PATH", {"sm90", "sm80", "simt"});
  if (forced >= 0) {
    const AttentionPath path = kPaths[forced];
    TORCH_CHECK(attention_path_available(path, dt, head_dim, device), "rl_align::", op,
                ": RL_ENGINE_EXT_ATTENTION_PATH=", path_name(path), " cannot run ",
                dtype_name(dtype), " with head_dim ", head_dim, " on this device");
    return {path, true};
  }
  for (AttentionPath path : {AttentionPath::kSm90, AttentionPath::kSm80}) {
    if (attention_path_available(path, dt, head_dim, device)) return {path, false};
  }
  TORCH_CHECK_VALUE(attention_path_available(AttentionPath::kSimt, dt, head_dim, device), "rl_align::",
                    op, ": head_dim ", head_dim, " is not supported on this device (simt path: 1..256)");
  return {AttentionPath::kSimt, false};
}

// The path a launch runs: choose_path's, except that a problem whose layout the sm90 kernels'
// tensor maps cannot address runs sm80 (available wherever sm90 is; the same bits), or, with
// sm90 forced, is an error naming the layout. The one decision point: path_name(path) here is
// what ran. A problem without query rows launches nothing and keeps choose_path's path.
AttentionPath launch_path(const char* op, at::ScalarType dtype, const AttentionProblem& p, bool backward,
                          int device) {
  const PathChoice choice = choose_path(op, dtype, p.head_dim, device);
  if (choice.path != AttentionPath::kSm90 || p.num_seqs == 0 || p.max_q_len == 0) return choice.path;
  const std::string layout = attention_sm90_layout_problem(p, backward);
  if (layout.empty()) return AttentionPath::kSm90;
  TORCH_CHECK(!choice.forced, "rl_align::", op, ": RL_ENGINE_EXT_ATTENTION_PATH=sm90 cannot run this layout (",
              layout, "): the sm90 kernels read through TMA tensor maps, which cannot address it");
  return AttentionPath::kSm80;
}

struct CudaBackend {
  static bool needs_aligned_operands(at::ScalarType dtype, int64_t head_dim, const at::Tensor& t) {
    // sm90 and sm80 (launch_path may move a layout from one to the other) both take aligned ones.
    return choose_path("attention", dtype, head_dim, t.get_device()).path != AttentionPath::kSimt;
  }
  static void fwd(const char* op, at::ScalarType dtype, const AttentionProblem& p, const at::Tensor& t) {
    const c10::cuda::CUDAGuard guard(t.device());
    const AttentionPath path = launch_path(op, dtype, p, /*backward=*/false, t.get_device());
    const gpuStream_t stream = at::cuda::getCurrentCUDAStream();
    note_gpu_kernel("attention_fwd", path_name(path));
    gpuError_t err;
    if (path != AttentionPath::kSimt) {
      // Split workspace: rows = lse elements = q elements / head_dim (every layout).
      AttentionFwdWorkspace w;
      w.slots = attention_fwd_split_slots(p);
      at::Tensor buffer;
      if (w.slots > 0) {
        const int64_t rows = t.numel() / p.head_dim;
        buffer = at::empty({rows * w.slots * (p.head_dim + 2)}, t.options().dtype(at::kFloat));
        w.acc = buffer.mutable_data_ptr<float>();
        w.ml = w.acc + rows * w.slots * p.head_dim;
      }
      if (p.max_q_len > 1) w.masked_nonfinite = p.status;
      w.tile_counter = reinterpret_cast<unsigned long long*>(p.status + 1);
      err = path == AttentionPath::kSm90 ? attention_fwd_sm90(kernel_dtype(dtype), p, w, stream)
                                         : attention_fwd_sm80(kernel_dtype(dtype), p, w, stream);
    } else {
      err = attention_fwd_simt(kernel_dtype(dtype), p, stream);
    }
    TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": ", path_name(path),
                " attention forward launch failed: ", gpu_error_string(err));
  }
  static void bwd(const char* op, at::ScalarType dtype, const AttentionGradProblem& p, const at::Tensor& t) {
    const c10::cuda::CUDAGuard guard(t.device());
    const AttentionPath path = launch_path(op, dtype, p.fwd, /*backward=*/true, t.get_device());
    const gpuStream_t stream = at::cuda::getCurrentCUDAStream();
    note_gpu_kernel("attention_bwd", path_name(path));
    gpuError_t err;
    switch (path) {
      case AttentionPath::kSm90: {
        // dQ by ordered turns where no sequence has more than kOrderedDqMaxKvLen keys (its
        // workspace: rows = lse elements = q elements / head_dim in every layout), else recomputed
        // by the dQ kernel: the same bits. RL_ENGINE_EXT_ATTENTION_DQ=ordered|recompute forces one.
        const int forced = forced_path_index(op, "RL_ENGINE_EXT_ATTENTION_DQ", {"ordered", "recompute"});
        const bool ordered = forced == 0 || (forced < 0 && p.fwd.max_kv_len <= kOrderedDqMaxKvLen);
        at::Tensor dq_accum, turns;
        AttentionBwdWorkspace w;
        if (ordered) {
          const int64_t rows = t.numel() / p.fwd.head_dim;
          dq_accum = at::empty({rows * p.fwd.head_dim}, t.options().dtype(at::kFloat));
          turns = at::zeros({1 + rows}, t.options().dtype(at::kInt));
          w.dq_accum = dq_accum.mutable_data_ptr<float>();
          w.turns = turns.mutable_data_ptr<int32_t>();
          w.rows = rows;
        }
        err = attention_bwd_sm90(kernel_dtype(dtype), p, w, stream);
        break;
      }
      case AttentionPath::kSm80: err = attention_bwd_sm80(kernel_dtype(dtype), p, stream); break;
      default: err = attention_bwd_simt(kernel_dtype(dtype), p, stream); break;
    }
    TORCH_CHECK(err == kGpuSuccess, "rl_align::", op, ": ", path_name(path),
                " attention backward launch failed: ", gpu_error_string(err));
  }
  // Host-read lengths and host-built descriptors: under graph capture the reads would fail and the
  // copy would replay from a host buffer reused since, so those ops refuse to be captured.
  static void refuse_graph_capture(const char* op) {
    TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
                "rl_align::", op, " builds its sequence descriptors on the host and cannot be captured in a "
                "CUDA graph; attention_kvcache and attention_varlen with validate=False can");
  }
  // Pinned and copied asynchronously: the op does not synchronise the stream.
  static at::Tensor to_device(const at::Tensor& host, const at::Tensor& like) {
    return host.pin_memory().to(like.device(), /*non_blocking=*/true);
  }
  // validate=False: descriptors built and lengths checked on the device.
  static at::Tensor device_seqs(const char* op, const at::Tensor& lengths, const std::optional<at::Tensor>& starts,
                                const SeqsFromLengths& sp) {
    const c10::cuda::CUDAGuard guard(lengths.device());
    // Both int32 when lengths are (starts converted on the device), else both int64.
    const at::ScalarType index_type = lengths.scalar_type() == at::kInt ? at::kInt : at::kLong;
    const at::Tensor l = lengths.to(index_type).contiguous();
    const at::Tensor first = starts ? starts->to(index_type).contiguous() : at::Tensor();
    at::Tensor seqs =
        at::empty({sp.num_seqs * kAttentionSeqFields + kAttentionSeqStatusWords}, l.options().dtype(at::kLong));
    note_gpu_kernel("attention_seqs_from_lengths", "simt");
    check_launch(op, attention_seqs_from_lengths(l.const_data_ptr(), starts ? first.const_data_ptr() : nullptr,
                                                 index_type == at::kLong, sp, seqs.mutable_data_ptr<int64_t>(),
                                                 at::cuda::getCurrentCUDAStream()));
    return seqs;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(rl_align, CUDA, m) {
  m.impl("attention", &attention_impl<CudaBackend>);
  m.impl("attention_backward", &attention_backward_impl<CudaBackend>);
  m.impl("attention_varlen", &attention_varlen_impl<CudaBackend>);
  m.impl("attention_varlen_backward", &attention_varlen_backward_impl<CudaBackend>);
  m.impl("attention_kvcache", &attention_kvcache_impl<CudaBackend>);
}

}  // namespace rl_align
