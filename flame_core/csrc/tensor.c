/* Tensor birth (flame_core/tensor.py: `py_wrap`, imported everywhere as `_wrap`) in C: part of flame_core._speedups.
Statement for statement: the array kept as it is when it is a NumPy or CuPy array (else np.asarray of it), a bare
Tensor with _data and a fresh version counter, requires_grad when asked, the memory hook told of the birth. Names are
read from tensor.py's module dict at each call (`configure_tensor(globals())` hands it over once). */
#include "speedups.h"

static PyObject *g_tensor;
static PyObject *s__ndarray, *s__cupy_ndarray, *s_backend, *s_is_cuda_array, *s_np, *s_asarray, *s_Tensor,
    *s__memory_hook, *s__data, *s__version, *s__requires_grad, *s_requires_grad, *zero_t, *empty_t;

static PyObject *tglobal(PyObject *name) {
    return speedups_name(g_tensor, name);
}

/* wrap(arr, requires_grad=False) */
static PyObject *wrap(PyObject *mod, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *arr, *rg = NULL, *nd, *cnd, *cls, *t = NULL, *ver = NULL, *hook;
    int want_grad = 0;
    (void)mod;
    if (nargs < 1 || nargs + nkw > 2) {
        PyErr_SetString(PyExc_TypeError, "_wrap(arr, requires_grad=False)");
        return NULL;
    }
    arr = args[0];
    if (nargs == 2)
        rg = args[1];
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (nargs == 2 || PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), s_requires_grad) != 0) {
            PyErr_SetString(PyExc_TypeError, "_wrap(arr, requires_grad=False)");
            return NULL;
        }
        rg = args[nargs + i];
    }
    if (rg != NULL && (want_grad = PyObject_IsTrue(rg)) < 0)
        return NULL;
    if ((nd = tglobal(s__ndarray)) == NULL || (cnd = tglobal(s__cupy_ndarray)) == NULL)
        return NULL;
    Py_INCREF(arr);
    if ((PyObject *)Py_TYPE(arr) != nd && (PyObject *)Py_TYPE(arr) != cnd) {
        PyObject *be = tglobal(s_backend), *r, *np;
        int is_cuda;
        if (be == NULL || (r = PyObject_CallMethodOneArg(be, s_is_cuda_array, arr)) == NULL)
            goto fail;
        is_cuda = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (is_cuda < 0)
            goto fail;
        if (!is_cuda) {
            PyObject *a2;
            if ((np = tglobal(s_np)) == NULL || (a2 = PyObject_CallMethodOneArg(np, s_asarray, arr)) == NULL)
                goto fail;
            Py_SETREF(arr, a2);
        }
    }
    if ((cls = tglobal(s_Tensor)) == NULL || !PyType_Check(cls))
        goto fail;
    if ((t = PyBaseObject_Type.tp_new((PyTypeObject *)cls, empty_t, NULL)) == NULL)
        goto fail;
    if ((ver = PyList_New(1)) == NULL)
        goto fail;
    Py_INCREF(zero_t);
    PyList_SET_ITEM(ver, 0, zero_t);
    if (PyObject_SetAttr(t, s__data, arr) < 0 || PyObject_SetAttr(t, s__version, ver) < 0)
        goto fail;
    if (want_grad && PyObject_SetAttr(t, s__requires_grad, Py_True) < 0)
        goto fail;
    if ((hook = tglobal(s__memory_hook)) == NULL)
        goto fail;
    if (hook != Py_None) {
        PyObject *r = PyObject_CallOneArg(hook, arr);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    Py_DECREF(ver);
    Py_DECREF(arr);
    return t;
fail:
    Py_XDECREF(ver);
    Py_XDECREF(t);
    Py_DECREF(arr);
    return NULL;
}

static PyObject *configure_tensor(PyObject *mod, PyObject *d) {
    (void)mod;
    return speedups_keep_dict(&g_tensor, d);
}

PyMethodDef tensor_methods[] = {
    {"wrap", (PyCFunction)(void (*)(void))wrap, METH_FASTCALL | METH_KEYWORDS, "tensor._wrap in C."},
    {"configure_tensor", configure_tensor, METH_O, "configure_tensor(globals): tensor.py's module dict."},
    {NULL, NULL, 0, NULL}};

int tensor_init(void) {
    INTERN(s__ndarray, "_ndarray") INTERN(s__cupy_ndarray, "_cupy_ndarray") INTERN(s_backend, "backend")
    INTERN(s_is_cuda_array, "is_cuda_array") INTERN(s_np, "np") INTERN(s_asarray, "asarray")
    INTERN(s_Tensor, "Tensor") INTERN(s__memory_hook, "_memory_hook") INTERN(s__data, "_data")
    INTERN(s__version, "_version") INTERN(s__requires_grad, "_requires_grad")
    INTERN(s_requires_grad, "requires_grad")
    if ((zero_t = PyLong_FromLong(0)) == NULL || (empty_t = PyTuple_New(0)) == NULL)
        return -1;
    return 0;
}
