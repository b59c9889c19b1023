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
}
