/* The small-array pointwise fast path (flame_core/kernels/pointwise_small.py: fast_scalar, fast_binary, fast_unary,
fast_grad and the _ready checks they share) in C: part of flame_core._speedups.

Each is its Python version statement for statement: the same checks (None where the fast path does not apply), the
output from the small-array bin or a new cupy.ndarray, the same launching.PackedLaunch from the thread's cache; the
launch writes the dynamic slots into the PackedLaunch's own parameter buffer and calls the driver's cuLaunchKernel
(libcuda, as CuPy's driver.launchKernel does) with the launch's grid, block, shared memory and the current stream. A
PackedLaunch this does not launch itself (a dependent launch, dynamic slots that are not the leading ones) is launched
by its Python method.

Names are read from pointwise_small.py's and launching.py's module dicts at each call (`configure_pointwise(...)`
hands them over once), so whatever replaces one (a test's monkeypatch) is seen as the Python functions see it. */
#include "speedups.h"

#ifndef _WIN32
#include <dlfcn.h>
#endif
#include <stdint.h>

static PyObject *g_ps, *g_launching; /* the module dicts */

static PyObject *s__nd, *s_MAX_NUMEL, *s__CUPY_FLAG_ATTR, *s__KIND, *s__kstate, *s__env_get,
    *s__KERNELS_KEY, *s_backend, *s__cuda_ok, *s_loader, *s_enabled, *s__one_device, *s_current_device, *s__bits,
    *s__scalar_bits, *s__rc_on, *s__rc_take, *s__local, *s_launches, *s__SCALAR, *s__BINARY, *s__UNARY, *s__GRAD,
    *s_size, *s_shape, *s_dtype, *s_num, *s_data, *s_ptr, *s__dep, *s__lead, *s__vaddr, *s__fn,
    *s__grid, *s__block, *s__smem, *s__pa, *s__current_stream, *s_launch2, *s_launch3, *s__driver_error;
static PyObject *zero_l, *one_l;

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
static launch_fn cu_launch; /* libcuda's cuLaunchKernel, found at the first launch */
static int cu_launch_missing;

/* the contiguity test of pointwise_small._ready (its _CUPY_FLAG_ATTR: CuPy's flag, else the public flags) */
static int contiguous(PyObject *a) {
    PyObject *flag = speedups_name(g_ps, s__CUPY_FLAG_ATTR);
    return flag == NULL ? -1 : speedups_c_contiguous(a, flag);
}

/* _ready(x, *others): 1 with *kind and *dev set (new references), 0 when the fast path does not apply, -1 on error */
static int ready(PyObject *x, PyObject *const *others, Py_ssize_t n_others, PyObject **kind, PyObject **dev) {
    PyObject *nd, *v, *dt = NULL, *shape = NULL, *num, *kinds, *st, *tmp;
    long long size, max_numel;
    int t, ok = -1;
    *kind = *dev = NULL;
    if ((nd = speedups_name(g_ps, s__nd)) == NULL)
        return -1;
    if ((PyObject *)Py_TYPE(x) != nd)
        return 0;
    if ((v = PyObject_GetAttr(x, s_size)) == NULL)
        return -1;
    size = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (size == -1 && PyErr_Occurred())
        return -1;
    if ((v = speedups_name(g_ps, s_MAX_NUMEL)) == NULL
        || ((max_numel = PyLong_AsLongLong(v)) == -1 && PyErr_Occurred()))
        return -1;
    if (size > max_numel)
        return 0;
    if ((t = contiguous(x)) <= 0)
        return t;
    if ((dt = PyObject_GetAttr(x, s_dtype)) == NULL)
        return -1;
    if (n_others) {
        if ((shape = PyObject_GetAttr(x, s_shape)) == NULL)
            goto end;
        for (Py_ssize_t i = 0; i < n_others; i++) {
            PyObject *o = others[i], *os, *od;
            if ((PyObject *)Py_TYPE(o) != nd) {
                ok = 0;
                goto end;
            }
            if ((os = PyObject_GetAttr(o, s_shape)) == NULL)
                goto end;
            t = PyObject_RichCompareBool(os, shape, Py_EQ);
            Py_DECREF(os);
            if (t <= 0) {
                ok = t;
                goto end;
            }
            if ((od = PyObject_GetAttr(o, s_dtype)) == NULL)
                goto end;
            t = od == dt ? 1 : PyObject_RichCompareBool(od, dt, Py_EQ);
            Py_DECREF(od);
            if (t <= 0) {
                ok = t;
                goto end;
            }
            if ((t = contiguous(o)) <= 0) {
                ok = t;
                goto end;
            }
        }
    }
    if ((num = PyObject_GetAttr(dt, s_num)) == NULL)
        goto end;
    if ((kinds = speedups_name(g_ps, s__KIND)) == NULL) {
        Py_DECREF(num);
        goto end;
    }
    v = PyDict_GetItemWithError(kinds, num);
    Py_DECREF(num);
    if (v == NULL) {
        ok = PyErr_Occurred() ? -1 : 0;
        goto end;
    }
    Py_INCREF(v);
    *kind = v;
    /* loader.enabled() read from its cached state while that state holds (pointwise_small._ready's inline test) */
    if ((st = speedups_name(g_ps, s__kstate)) == NULL)
        goto end;
    {
        PyObject *st0, *st1, *st2, *envget, *key, *raw, *be, *cuda_ok;
        int stale;
        if (!PyList_Check(st) || PyList_GET_SIZE(st) < 3) {
            PyErr_SetString(PyExc_TypeError, "pointwise_small._kstate is not loader._state");
            goto end;
        }
        st0 = PyList_GET_ITEM(st, 0);
        st1 = PyList_GET_ITEM(st, 1);
        st2 = PyList_GET_ITEM(st, 2);
        if ((t = PyObject_IsTrue(st2)) < 0)
            goto end;
        stale = t;
        if (!stale) {
            if ((t = PyObject_IsTrue(st1)) < 0)
                goto end;
            stale = !t;
        }
        if (!stale) {
            if ((envget = speedups_name(g_ps, s__env_get)) == NULL
                || (key = speedups_name(g_ps, s__KERNELS_KEY)) == NULL
                || (raw = PyObject_CallOneArg(envget, key)) == NULL)
                goto end;
            stale = raw != st0;
            Py_DECREF(raw);
        }
        if (!stale) {
            if ((be = speedups_name(g_ps, s_backend)) == NULL || (cuda_ok = PyObject_GetAttr(be, s__cuda_ok)) == NULL)
                goto end;
            stale = cuda_ok != Py_True;
            Py_DECREF(cuda_ok);
        }
        if (stale) {
            PyObject *ld = speedups_name(g_ps, s_loader), *r;
            if (ld == NULL || (r = PyObject_CallMethodNoArgs(ld, s_enabled)) == NULL)
                goto end;
            t = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (t <= 0) {
                ok = t;
                goto end;
            }
        }
    }
    if ((tmp = speedups_name(g_ps, s__one_device)) == NULL || (t = PyObject_IsTrue(tmp)) < 0)
        goto end;
    if (t) {
        Py_INCREF(zero_l);
        *dev = zero_l;
        ok = 1;
        goto end;
    }
    { /* several GPUs, or not known yet: current_device((x,) + others) */
        PyObject *cd = speedups_name(g_ps, s_current_device), *arrs = PyTuple_New(1 + n_others), *r;
        if (arrs == NULL)
            goto end;
        Py_INCREF(x);
        PyTuple_SET_ITEM(arrs, 0, x);
        for (Py_ssize_t i = 0; i < n_others; i++) {
            Py_INCREF(others[i]);
            PyTuple_SET_ITEM(arrs, 1 + i, others[i]);
        }
        r = cd == NULL ? NULL : PyObject_CallOneArg(cd, arrs);
        Py_DECREF(arrs);
        if (r == NULL)
            goto end;
        if (r == Py_None) {
            Py_DECREF(r);
            ok = 0;
            goto end;
        }
        *dev = r;
        ok = 1;
    }
end:
    Py_XDECREF(dt);
    Py_XDECREF(shape);
    if (ok != 1) {
        Py_CLEAR(*kind);
        Py_CLEAR(*dev);
    }
    return ok;
}

/* an output of x's shape and dtype: from the bin while it is on, else a new cupy.ndarray */
static PyObject *new_output(PyObject *x) {
    PyObject *on_box, *shape, *dtype, *out = NULL, *args[2];
    int t;
    if ((on_box = speedups_name(g_ps, s__rc_on)) == NULL)
        return NULL;
    if (!PyList_Check(on_box) || PyList_GET_SIZE(on_box) < 1) {
        PyErr_SetString(PyExc_TypeError, "pointwise_small._rc_on is not recycle.on");
        return NULL;
    }
    if ((t = PyObject_IsTrue(PyList_GET_ITEM(on_box, 0))) < 0)
        return NULL;
    if ((shape = PyObject_GetAttr(x, s_shape)) == NULL)
        return NULL;
    if ((dtype = PyObject_GetAttr(x, s_dtype)) == NULL) {
        Py_DECREF(shape);
        return NULL;
    }
    args[0] = shape;
    args[1] = dtype;
    if (t) {
        PyObject *take = speedups_name(g_ps, s__rc_take);
        out = take == NULL ? NULL : PyObject_Vectorcall(take, args, 2, NULL);
        if (out == Py_None)
            Py_CLEAR(out);
        else if (out == NULL)
            goto end;
    }
    if (out == NULL) {
        PyObject *nd = speedups_name(g_ps, s__nd);
        if (nd != NULL)
            out = PyObject_Vectorcall(nd, args, 2, NULL);
    }
end:
    Py_DECREF(shape);
    Py_DECREF(dtype);
    return out;
}

static int ptr_of(PyObject *a, unsigned long long *p) {
    PyObject *mp = PyObject_GetAttr(a, s_data), *v;
    if (mp == NULL)
        return -1;
    v = PyObject_GetAttr(mp, s_ptr);
    Py_DECREF(mp);
    if (v == NULL)
        return -1;
    *p = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*p == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int attr_uint(PyObject *o, PyObject *name, unsigned long long *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int dims3(PyObject *o, PyObject *name, unsigned d[3]) {
    PyObject *t = PyObject_GetAttr(o, name);
    int ok = 0;
    if (t == NULL)
        return -1;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
        PyErr_SetString(PyExc_TypeError, "a PackedLaunch's grid / block is not a 3-tuple");
        ok = -1;
    } else {
        for (int i = 0; i < 3; i++) {
            unsigned long v = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, i));
            if (v == (unsigned long)-1 && PyErr_Occurred()) {
                ok = -1;
                break;
            }
            d[i] = (unsigned)v;
        }
    }
    Py_DECREF(t);
    return ok;
}

static launch_fn find_launch(void) {
#ifndef _WIN32
    if (cu_launch == NULL && !cu_launch_missing) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (h == NULL)
            h = dlopen("libcuda.so.1", RTLD_NOW);
        if (h != NULL)
            cu_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
        cu_launch_missing = cu_launch == NULL;
    }
#else
    cu_launch_missing = 1;
#endif
    return cu_launch;
}

/* pl.launch2(a, b) / pl.launch3(a, b, c): the leading dynamic slots written, then one driver launch; 0 or -1 */
static int launch(PyObject *pl, const unsigned long long *vals, int n) {
    PyObject *v, *st, *sp, *counter, *cs;
    unsigned long long vaddr, fn, smem, pa, stream;
    unsigned grid[3], block[3];
    long long lead;
    int dep, status;
    launch_fn f = find_launch();
    if ((v = PyObject_GetAttr(pl, s__dep)) == NULL)
        return -1;
    dep = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (dep < 0 || (v = PyObject_GetAttr(pl, s__lead)) == NULL)
        return -1;
    lead = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (lead == -1 && PyErr_Occurred())
        return -1;
    if (dep || lead != n || f == NULL) { /* the Python method: a dependent launch, other slots, no libcuda here */
        PyObject *r, *a0 = PyLong_FromUnsignedLongLong(vals[0]), *a1 = PyLong_FromUnsignedLongLong(vals[1]),
                     *a2 = n > 2 ? PyLong_FromUnsignedLongLong(vals[2]) : NULL;
        if (a0 == NULL || a1 == NULL || (n > 2 && a2 == NULL))
            r = NULL;
        else
            r = n > 2 ? PyObject_CallMethodObjArgs(pl, s_launch3, a0, a1, a2, NULL)
                      : PyObject_CallMethodObjArgs(pl, s_launch2, a0, a1, NULL);
        Py_XDECREF(a0);
        Py_XDECREF(a1);
        Py_XDECREF(a2);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    if (attr_uint(pl, s__vaddr, &vaddr) < 0 || attr_uint(pl, s__fn, &fn) < 0 || attr_uint(pl, s__smem, &smem) < 0
        || attr_uint(pl, s__pa, &pa) < 0 || dims3(pl, s__grid, grid) < 0 || dims3(pl, s__block, block) < 0)
        return -1;
    if ((cs = speedups_name(g_launching, s__current_stream)) == NULL || (st = PyObject_CallNoArgs(cs)) == NULL)
        return -1;
    sp = PyObject_GetAttr(st, s_ptr);
    Py_DECREF(st);
    if (sp == NULL)
        return -1;
    stream = PyLong_AsUnsignedLongLong(sp);
    Py_DECREF(sp);
    if (stream == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    /* launching.launches += 1 (tests read it to prove a kernel path ran) */
    if ((counter = speedups_name(g_launching, s_launches)) == NULL || (v = PyNumber_Add(counter, one_l)) == NULL)
        return -1;
    status = PyDict_SetItem(g_launching, s_launches, v);
    Py_DECREF(v);
    if (status < 0)
        return -1;
    for (int i = 0; i < n; i++)
        ((unsigned long long *)(uintptr_t)vaddr)[i] = vals[i];
    status = f((void *)(uintptr_t)fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], (unsigned)smem,
               (void *)(uintptr_t)stream, (void **)(uintptr_t)pa, NULL);
    if (status != 0) {
        PyObject *err = speedups_name(g_launching, s__driver_error), *code, *r;
        if (err == NULL)
            return -1;
        if ((code = PyLong_FromLong(status)) == NULL)
            return -1;
        r = PyObject_CallOneArg(err, code); /* raises CuPy's CUDADriverError */
        Py_DECREF(code);
        Py_XDECREF(r);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %d", status);
        return -1;
    }
    return 0;
}

/* The thread's PackedLaunch for (name, kind, n, dev): _local.launches[key] (its __missing__ builds one) */
static PyObject *packed(PyObject *name, PyObject *kind, PyObject *n, PyObject *dev) {
    PyObject *local = speedups_name(g_ps, s__local), *ls, *key, *pl;
    if (local == NULL || (ls = PyObject_GetAttr(local, s_launches)) == NULL)
        return NULL;
    key = PyTuple_Pack(4, name, kind, n, dev);
    if (key == NULL) {
        Py_DECREF(ls);
        return NULL;
    }
    pl = PyObject_GetItem(ls, key);
    Py_DECREF(key);
    Py_DECREF(ls);
    return pl;
}

/* The common tail: out (new or given) and the launch of `name` with (inputs..., out[, bits]) */
static PyObject *run(PyObject *table, PyObject *op, PyObject *x, PyObject *y, PyObject *out, int has_bits,
                     unsigned long long bits, PyObject *kind, PyObject *dev) {
    PyObject *name = NULL, *nobj = NULL, *pl = NULL, *tbl;
    unsigned long long vals[3];
    long long n;
    int k = 0;
    if (out == NULL) {
        if ((out = new_output(x)) == NULL)
            return NULL;
    } else {
        Py_INCREF(out);
    }
    if ((nobj = PyObject_GetAttr(x, s_size)) == NULL)
        goto fail;
    n = PyLong_AsLongLong(nobj);
    if (n == -1 && PyErr_Occurred())
        goto fail;
    if (n) {
        if (table != NULL) { /* the op's kernel name (_SCALAR / _BINARY / _UNARY[op]); fast_grad's is its argument */
            if ((tbl = speedups_name(g_ps, table)) == NULL || (name = PyObject_GetItem(tbl, op)) == NULL)
                goto fail;
        } else {
            Py_INCREF(op);
            name = op;
        }
        if (ptr_of(x, &vals[k++]) < 0)
            goto fail;
        if (y != NULL && ptr_of(y, &vals[k++]) < 0)
            goto fail;
        if (ptr_of(out, &vals[k++]) < 0)
            goto fail;
        if (has_bits)
            vals[k++] = bits;
        if ((pl = packed(name, kind, nobj, dev)) == NULL || launch(pl, vals, k) < 0)
            goto fail;
    }
    Py_XDECREF(pl);
    Py_DECREF(nobj);
    Py_XDECREF(name);
    return out;
fail:
    Py_XDECREF(pl);
    Py_XDECREF(nobj);
    Py_XDECREF(out);
    Py_XDECREF(name);
    return NULL;
}

static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi, const char *fn) {
    if (nargs < lo || nargs > hi) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", fn, lo, hi, nargs);
        return -1;
    }
    return 0;
}

/* fast_scalar(op, x, s, out=None) */
static PyObject *fast_scalar(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *op, *x, *s, *out, *kind, *dev, *bits_o, *tables, *table, *r;
    unsigned long long bits;
    int t;
    (void)mod;
    if (parse(args, nargs, 3, 4, "fast_scalar") < 0)
        return NULL;
    op = args[0];
    x = args[1];
    s = args[2];
    out = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    if (!PyFloat_CheckExact(s) && !PyLong_CheckExact(s))
        Py_RETURN_NONE;
    t = out == NULL || out == x ? ready(x, NULL, 0, &kind, &dev) : ready(x, &out, 1, &kind, &dev);
    if (t < 0)
        return NULL;
    if (t == 0)
        Py_RETURN_NONE;
    if ((tables = speedups_name(g_ps, s__bits)) == NULL || (table = PyObject_GetItem(tables, kind)) == NULL)
        goto fail;
    bits_o = PyDict_Check(table) ? PyDict_GetItemWithError(table, s) : NULL;
    Py_XINCREF(bits_o);
    Py_DECREF(table);
    if (bits_o == NULL) {
        PyObject *sb;
        if (PyErr_Occurred() || (sb = speedups_name(g_ps, s__scalar_bits)) == NULL)
            goto fail;
        if ((bits_o = PyObject_CallFunctionObjArgs(sb, kind, s, NULL)) == NULL)
            goto fail;
        if (bits_o == Py_None) {
            Py_DECREF(bits_o);
            Py_DECREF(kind);
            Py_DECREF(dev);
            Py_RETURN_NONE;
        }
    }
    bits = PyLong_AsUnsignedLongLong(bits_o);
    Py_DECREF(bits_o);
    if (bits == (unsigned long long)-1 && PyErr_Occurred())
        goto fail;
    r = run(s__SCALAR, op, x, NULL, out, 1, bits, kind, dev);
    Py_DECREF(kind);
    Py_DECREF(dev);
    return r;
fail:
    Py_DECREF(kind);
    Py_DECREF(dev);
    return NULL;
}

/* fast_binary(op, a, b, out=None) */
static PyObject *fast_binary(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *a, *b, *out, *kind, *dev, *others[2], *r;
    int t;
    (void)mod;
    if (parse(args, nargs, 3, 4, "fast_binary") < 0)
        return NULL;
    a = args[1];
    b = args[2];
    out = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    others[0] = b;
    others[1] = out;
    t = ready(a, others, out == NULL || out == a ? 1 : 2, &kind, &dev);
    if (t <= 0)
        return t < 0 ? NULL : Py_NewRef(Py_None);
    r = run(s__BINARY, args[0], a, b, out, 0, 0, kind, dev);
    Py_DECREF(kind);
    Py_DECREF(dev);
    return r;
}

/* fast_unary(op, x) */
static PyObject *fast_unary(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *kind, *dev, *r;
    int t;
    (void)mod;
    if (parse(args, nargs, 2, 2, "fast_unary") < 0)
        return NULL;
    t = ready(args[1], NULL, 0, &kind, &dev);
    if (t <= 0)
        return t < 0 ? NULL : Py_NewRef(Py_None);
    r = run(s__UNARY, args[0], args[1], NULL, NULL, 0, 0, kind, dev);
    Py_DECREF(kind);
    Py_DECREF(dev);
    return r;
}

/* fast_grad(kernel, g, s, out=None) */
static PyObject *fast_grad(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *kernel, *g, *s, *out, *kind, *dev, *grads, *others[2], *r;
    int t;
    (void)mod;
    if (parse(args, nargs, 3, 4, "fast_grad") < 0)
        return NULL;
    kernel = args[0];
    g = args[1];
    s = args[2];
    out = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    if ((grads = speedups_name(g_ps, s__GRAD)) == NULL || (t = PySequence_Contains(grads, kernel)) < 0)
        return NULL;
    if (!t)
        Py_RETURN_NONE;
    others[0] = s;
    others[1] = out;
    t = ready(g, others, out == NULL || out == g ? 1 : 2, &kind, &dev);
    if (t <= 0)
        return t < 0 ? NULL : Py_NewRef(Py_None);
    r = run(NULL, kernel, g, s, out, 0, 0, kind, dev);
    Py_DECREF(kind);
    Py_DECREF(dev);
    return r;
}

/* configure_pointwise(pointwise_small_globals, launching_globals) */
static PyObject *configure_pointwise(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *r;
    (void)mod;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "configure_pointwise(pointwise_small globals, launching globals)");
        return NULL;
    }
    if ((r = speedups_keep_dict(&g_ps, args[0])) == NULL)
        return NULL;
    Py_DECREF(r);
    return speedups_keep_dict(&g_launching, args[1]);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
PyMethodDef pointwise_methods[] = {
    {"fast_scalar", FASTCALL(fast_scalar), "pointwise_small.fast_scalar in C."},
    {"fast_binary", FASTCALL(fast_binary), "pointwise_small.fast_binary in C."},
    {"fast_unary", FASTCALL(fast_unary), "pointwise_small.fast_unary in C."},
    {"fast_grad", FASTCALL(fast_grad), "pointwise_small.fast_grad in C."},
    {"configure_pointwise", FASTCALL(configure_pointwise),
     "configure_pointwise(pointwise_small globals, launching globals)."},
    {NULL, NULL, 0, NULL}};

int pointwise_init(void) {
    INTERN(s__nd, "_nd") INTERN(s_MAX_NUMEL, "MAX_NUMEL") INTERN(s__CUPY_FLAG_ATTR, "_CUPY_FLAG_ATTR")
    INTERN(s__KIND, "_KIND") INTERN(s__kstate, "_kstate")
    INTERN(s__env_get, "_env_get") INTERN(s__KERNELS_KEY, "_KERNELS_KEY") INTERN(s_backend, "backend")
    INTERN(s__cuda_ok, "_cuda_ok") INTERN(s_loader, "loader") INTERN(s_enabled, "enabled")
    INTERN(s__one_device, "_one_device") INTERN(s_current_device, "current_device") INTERN(s__bits, "_bits")
    INTERN(s__scalar_bits, "_scalar_bits") INTERN(s__rc_on, "_rc_on") INTERN(s__rc_take, "_rc_take")
    INTERN(s__local, "_local") INTERN(s_launches, "launches") INTERN(s__SCALAR, "_SCALAR")
    INTERN(s__BINARY, "_BINARY") INTERN(s__UNARY, "_UNARY") INTERN(s__GRAD, "_GRAD") INTERN(s_size, "size")
    INTERN(s_shape, "shape") INTERN(s_dtype, "dtype") INTERN(s_num, "num")
    INTERN(s_data, "data") INTERN(s_ptr, "ptr") INTERN(s__dep, "_dep") INTERN(s__lead, "_lead")
    INTERN(s__vaddr, "_vaddr") INTERN(s__fn, "_fn") INTERN(s__grid, "_grid") INTERN(s__block, "_block")
    INTERN(s__smem, "_smem") INTERN(s__pa, "_pa") INTERN(s__current_stream, "_current_stream")
    INTERN(s_launch2, "launch2") INTERN(s_launch3, "launch3") INTERN(s__driver_error, "_driver_error")
    if ((zero_l = PyLong_FromLong(0)) == NULL || (one_l = PyLong_FromLong(1)) == NULL)
        return -1;
    return 0;
}
