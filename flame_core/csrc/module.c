/* flame_core._speedups: the module (speedups.h lists its parts). */
#include "speedups.h"

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "flame_core._speedups",
                                       "The eager API's per-op hot paths in C (flame_core/csrc).", -1, NULL,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m;
    if (recycle_init() < 0 || apply_init() < 0 || pointwise_init() < 0 || tensor_init() < 0)
        return NULL;
    if ((m = PyModule_Create(&moduledef)) == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, recycle_methods) < 0 || PyModule_AddFunctions(m, apply_methods) < 0
        || PyModule_AddFunctions(m, pointwise_methods) < 0 || PyModule_AddFunctions(m, tensor_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
