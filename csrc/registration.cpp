// The one schema block of the rl_align library: every op, forward and backward, is declared here.
// Device kernels register their implementations with TORCH_LIBRARY_IMPL in csrc/cpu and csrc/cuda.
//
// The extension is built against the stable Python ABI (abi3): it exports no Python functions,
// only a module-init stub so that `import rl_engine_ext._C` loads the shared library and runs
// the static registrations below.
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "rl_align native kernels (ops live under torch.ops.rl_align)",
      -1,       // no per-interpreter state
      nullptr,  // no methods
  };
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(rl_align, m) {
  // y = x * rsqrt(mean(x^2, -1) + eps) * weight; fp32 math, one rounding to x.dtype.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // Returns (grad_x in x.dtype, grad_weight in fp32). grad_weight = dweight_accum (or 0) + the
  // sum over rows, taken over fixed row tiles in row order (see rl_engine_ext.rms_norm_tile_rows),
  // so micro-batches chain bit for bit through dweight_accum.
  m.def(
      "rms_norm_backward(Tensor grad_out, Tensor x, Tensor weight, float eps, "
      "Tensor? dweight_accum=None) -> (Tensor, Tensor)");

  // y = x @ weight.T (+ bias); weight [out, in] (nn.Linear layout), x [..., in]. fp32
  // accumulation over `in` in a fixed order, one rounding to x.dtype.
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  // grad_x = grad_out @ weight: [..., out] x [out, in] -> [..., in], in the input dtype.
  m.def("linear_grad_input(Tensor grad_out, Tensor weight) -> Tensor");
  // grad_weight (fp32 [out, in]) = dweight_accum (or 0) + grad_out^T @ x, the sum over tokens one
  // fp32 accumulation chain in token order: micro-batches of multiples of
  // rl_engine_ext.LINEAR_GRAD_TILE_TOKENS tokens chain bit for bit through dweight_accum.
  m.def("linear_grad_weight(Tensor grad_out, Tensor x, Tensor? dweight_accum=None) -> Tensor");
  // grad_bias (fp32 [out]) = dbias_accum (or 0) + the sum of grad_out over tokens, in tiles of
  // LINEAR_GRAD_TILE_TOKENS tokens added in order.
  m.def("linear_grad_bias(Tensor grad_out, Tensor? dbias_accum=None) -> Tensor");

  // Attention: softmax(scale * q k^T) v per sequence, causal by default, GQA (query heads a
  // multiple of key/value heads; query head h reads kv head h / (Hq / Hkv)). Returns (out in
  // q.dtype and q's layout, lse = fp32 log-sum-exp per query and head). A token's out and lse
  // depend only on its own sequence's q/k/v up to its position, bit for bit: keys are taken in
  // blocks of 64 positions of the sequence's own numbering (csrc/common/attention_problem.h).
  // Padded batch: q [B, Hq, S, D], k/v [B, Hkv, S, D]; padding_mask [B, S] marks real tokens (one
  // run per row: left or right padding); lse [B, Hq, S]; padding rows give out 0, lse -inf.
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor? padding_mask=None, float? scale=None, "
      "bool causal=True) -> (Tensor, Tensor)");
  // Returns (grad_q, grad_k, grad_v) in the input dtype; no atomics, fixed accumulation order.
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? padding_mask, float scale, bool causal) -> (Tensor, Tensor, Tensor)");
  // Packed: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [num_seqs + 1] (int32/int64); lse [Hq, T].
  // max_seqlen, when given, is checked against the sequences.
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int? max_seqlen=None, "
      "float? scale=None, bool causal=True) -> (Tensor, Tensor)");
  m.def(
      "attention_varlen_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor cu_seqlens, int? max_seqlen, float scale, bool causal) -> "
      "(Tensor, Tensor, Tensor)");
  // KV cache (decode: n = 1, chunked prefill: n > 1): q [B, Hq, n, D] are positions
  // cache_seqlens[b]-n .. cache_seqlens[b]-1 of sequence b, attending causally to positions
  // 0 .. cache_seqlens[b]-1 of k_cache/v_cache [B, Hkv, S_max, D] (new keys already written).
  // Same bits as the prefill of the whole sequence. lse [B, Hq, n]. Not differentiable.
  m.def(
      "attention_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
      "float? scale=None) -> (Tensor, Tensor)");
}
