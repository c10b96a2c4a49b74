/* module.c — makes the shared library importable as mlx_open1b.cpu_ref._kernels. The kernels
 * themselves are plain C functions called through ctypes (cpu_ref/_lib.py), which releases the
 * GIL for the duration of each call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef o1b_module = {PyModuleDef_HEAD_INIT, "_kernels",
    "C reference kernels of mlx-open1b (called through ctypes).", -1, NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&o1b_module); }
