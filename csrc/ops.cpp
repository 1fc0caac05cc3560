// The one place where every dllm op schema is defined. Kernels register their
// implementations from csrc/cpu/<family>.cpp (CPU) and csrc/cuda/<family>.cu
// (CUDA); a CPU-only build simply does not compile the .cu files.
#include <Python.h>
#include <torch/library.h>

// `import dllm_ops._C` only needs to run the static registrars below; the
// module itself exposes nothing (no pybind11, so the ABI stays small).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(dllm, m) {
  // ---- family: select -------------------------------------------------------
  m.def("cosine_drift(Tensor x, Tensor x_prev) -> Tensor");
}
