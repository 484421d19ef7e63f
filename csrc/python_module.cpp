// The Python module `subnet_ext._C`. It holds no functions: importing it loads this
// library, whose static initialisers register the ops (see registration.cpp). Kept apart
// so the standalone benchmarks link the kernels without Python.
#include <Python.h>

extern "C" {
// Importing subnet_ext._C loads this library, whose static initialisers register the ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
