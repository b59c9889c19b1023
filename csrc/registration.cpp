// The schema block of the rl_align library and the Python module stub. Every op, forward and
// backward, is declared once, in rl_engine_ext/schemas.def (read by this file and by the Python
// fallback); device kernels register their implementations with TORCH_LIBRARY_IMPL in csrc/cpu
// and csrc/cuda, autograd in csrc/autograd.
//
// The extension is built against the stable Python ABI (abi3): it exports no Python functions,
// only a module-init stub so that `import rl_engine_ext._C` loads the shared library and runs
// the static registrations. The stub adds the native constants (host/native_constants.h) as int
// attributes of the module.
#include <Python.h>
#include <torch/library.h>

#include "host/native_constants.h"

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",  // name
      "rl_align native kernels (ops live under torch.ops.rl_align)",
      -1,       // no per-interpreter state
      nullptr,  // no methods
  };
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  for (const rl_align::NativeConstant& c : rl_align::native_constants()) {
    if (PyModule_AddIntConstant(module, c.name, static_cast<long>(c.value)) != 0) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
}

TORCH_LIBRARY(rl_align, m) {
#define RL_ALIGN_SCHEMA(schema) m.def(schema);
#define RL_ALIGN_RUNTIME_SCHEMA(schema) m.def(schema);
#include "../rl_engine_ext/schemas.def"
#undef RL_ALIGN_RUNTIME_SCHEMA
#undef RL_ALIGN_SCHEMA
}
