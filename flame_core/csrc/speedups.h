/* flame_core._speedups: the per-op hot paths of the eager API in C (module.c). Each part keeps its Python version as
its specification and fallback: recycle.c (flame_core/memory/recycle.py: take, _tensor_del), apply.c
(flame_core/autograd/function.py: Function.apply) and pointwise.c (flame_core/kernels/pointwise_small.py: fast_scalar,
fast_binary, fast_unary, fast_grad) and tensor.c (flame_core/tensor.py: _wrap). alloc.c is FLAME's CuPy allocator
(flame_core/memory/cuda.py): CuPy's PythonFunctionAllocator with each block's free on an object the garbage collector
does not track; without the module, cuda.py uses CuPy's own. */
#ifndef FLAME_SPEEDUPS_H
#define FLAME_SPEEDUPS_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyMethodDef recycle_methods[];
extern PyMethodDef apply_methods[];
extern PyMethodDef pointwise_methods[];
extern PyMethodDef tensor_methods[];
int recycle_init(void);
int apply_init(void);
int pointwise_init(void);
int tensor_init(void);
int alloc_init(void);
int alloc_add_types(PyObject *m); /* BlockOwner, Allocator */

/* module.c: shared by the parts */
/* `name` in the module dict `globals` (borrowed), or NULL with an exception set (NameError where it is missing;
   RuntimeError where the part's configure_*() has not handed the dict over yet) */
PyObject *speedups_name(PyObject *globals, PyObject *name);
/* configure_*(d): keep the module dict `d` in *slot (a new reference; the old one dropped); None or NULL */
PyObject *speedups_keep_dict(PyObject **slot, PyObject *d);

/* 1 when the array `x` is C-contiguous, 0 when not, -1 on error: x._c_contiguous where `use_flag` is true (CuPy's
   internal flag, when it has one), else x.flags.c_contiguous */
int speedups_c_contiguous(PyObject *x, PyObject *use_flag);

/* an interned name for attribute and dict lookups, in a part's init function (which returns -1 on failure) */
#define INTERN(var, text)                                                                                             \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                                             \
        return -1;

#endif
