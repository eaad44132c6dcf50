/* flame_core._speedups: the module (speedups.h lists its parts). */
#include "speedups.h"

PyObject *speedups_name(PyObject *globals, PyObject *name) {
    PyObject *v;
    if (globals == NULL) {
        PyErr_Format(PyExc_RuntimeError, "flame_core._speedups: the module dict holding %R was not configured", name);
        return NULL;
    }
    v = PyDict_GetItemWithError(globals, name);
    if (v == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_NameError, name);
    return v;
}

PyObject *speedups_keep_dict(PyObject **slot, PyObject *d) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "flame_core._speedups: configure_*() takes a module's globals() dict");
        return NULL;
    }
    Py_INCREF(d);
    Py_XSETREF(*slot, d);
    Py_RETURN_NONE;
}

static PyObject *s__c_contiguous, *s_flags, *s_c_contiguous;

int speedups_c_contiguous(PyObject *x, PyObject *use_flag) {
    PyObject *v, *flags;
    int t = PyObject_IsTrue(use_flag);
    if (t < 0)
        return -1;
    if (t) {
        v = PyObject_GetAttr(x, s__c_contiguous);
    } else {
        if ((flags = PyObject_GetAttr(x, s_flags)) == NULL)
            return -1;
        v = PyObject_GetAttr(flags, s_c_contiguous);
        Py_DECREF(flags);
    }
    if (v == NULL)
        return -1;
    t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int module_init(void) {
    INTERN(s__c_contiguous, "_c_contiguous") INTERN(s_flags, "flags") INTERN(s_c_contiguous, "c_contiguous")
    return 0;
}

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "flame_core._speedups",
                                       "The eager API's per-op hot paths in C (flame_core/csrc).", -1, NULL,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__speedups(void) {
    PyObject *m;
    if (module_init() < 0 || recycle_init() < 0 || apply_init() < 0 || pointwise_init() < 0 || tensor_init() < 0
        || alloc_init() < 0)
        return NULL;
    if ((m = PyModule_Create(&moduledef)) == NULL)
        return NULL;
    if (PyModule_AddFunctions(m, recycle_methods) < 0 || PyModule_AddFunctions(m, apply_methods) < 0
        || PyModule_AddFunctions(m, pointwise_methods) < 0 || PyModule_AddFunctions(m, tensor_methods) < 0
        || alloc_add_types(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
