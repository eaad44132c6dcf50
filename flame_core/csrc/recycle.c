/* The small-array bin's two per-op hooks (flame_core/memory/recycle.py) in C: part of flame_core._speedups.

An eager op on a small cuda tensor runs `recycle.take` for its output and `recycle._tensor_del` when its Tensor dies:
about two microseconds of Python per op, a tenth of the whole op. These are the same two functions, statement for
statement, without the interpreter. recycle.py stays their specification and the fallback where this module is not
built (a source install without a C compiler) or FLAME_SPEEDUPS=0; tests/memory/test_recycle.py runs both against
the same fake pool.

State is read from recycle's module dictionary at every call (`configure_recycle(globals())` hands it over once):
`bins`, `held`, `counts`, `on`, `_pool`, `_nd`, `_current_stream`, `_FLAG_ATTR`, `MAX_NUMEL`, `PER_KEY`, `MAX_BYTES`, so
whatever replaces one of them (`enable`, a test's monkeypatch) is seen as the Python functions see it.

Reference counts: where the Python function asks `sys.getrefcount(x) != 3` (the holder, its local, the call's
argument), this code holds one reference of its own and asks `Py_REFCNT(x) != 2`. */
#include "speedups.h"

static PyObject *g_globals; /* recycle's module dict */

/* interned names */
static PyObject *s__data, *s_size, *s_base, *s_data, *s_mem, *s_ptr,
    *s__live, *s_free, *s_sub, *s_stream, *s__pinned_streams, *s_shape, *s_dtype, *s__lock, *s_acquire, *s_release,
    *s_tag, *s_allocated, *s_requested, *s_bytes_freed_total, *s_num_free, *s_cache_hits, *s_peak_allocated,
    *s_binned, *s_taken, *n_nd, *n_on, *n_bins, *n_held, *n_counts, *n_pool, *n_current_stream, *n_FLAG_ATTR,
    *n_MAX_NUMEL, *n_PER_KEY, *n_MAX_BYTES;

static PyObject *one; /* the int 1 */

/* recycle's global `name` (borrowed), or NULL with an exception set */
static PyObject *global(PyObject *name) {
    return speedups_name(g_globals, name);
}

/* element 0 of a one-element list global (`on`, `_pool`; borrowed) */
static PyObject *boxed(PyObject *name) {
    PyObject *box = global(name);
    if (box == NULL)
        return NULL;
    if (!PyList_Check(box) || PyList_GET_SIZE(box) < 1) {
        PyErr_Format(PyExc_TypeError, "recycle.%U is not a one-element list", name);
        return NULL;
    }
    return PyList_GET_ITEM(box, 0);
}

/* o.name += delta (sign 1) or -= delta (sign -1); 0 or -1 */
static int attr_add(PyObject *o, PyObject *name, PyObject *delta, int sign) {
    PyObject *v = PyObject_GetAttr(o, name), *nv;
    int r;
    if (v == NULL)
        return -1;
    nv = sign > 0 ? PyNumber_Add(v, delta) : PyNumber_Subtract(v, delta);
    Py_DECREF(v);
    if (nv == NULL)
        return -1;
    r = PyObject_SetAttr(o, name, nv);
    Py_DECREF(nv);
    return r;
}

/* lst[i] += delta * sign for a list global (`held`); 0 or -1 */
static int list_add(PyObject *lst, Py_ssize_t i, PyObject *delta, int sign) {
    PyObject *v, *nv;
    if (!PyList_Check(lst) || PyList_GET_SIZE(lst) <= i) {
        PyErr_SetString(PyExc_TypeError, "recycle.held is not a two-element list");
        return -1;
    }
    v = PyList_GET_ITEM(lst, i);
    nv = sign > 0 ? PyNumber_Add(v, delta) : PyNumber_Subtract(v, delta);
    if (nv == NULL)
        return -1;
    return PyList_SetItem(lst, i, nv); /* steals nv */
}

/* d[key] += 1 for the `counts` dict; 0 or -1 */
static int count_up(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key), *nv;
    int r;
    if (v == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    nv = PyNumber_Add(v, one);
    if (nv == NULL)
        return -1;
    r = PyDict_SetItem(d, key, nv);
    Py_DECREF(nv);
    return r;
}

/* an int global as a long long; -1 with an exception set on failure */
static long long global_ll(PyObject *name) {
    PyObject *v = global(name);
    return v == NULL ? -1 : PyLong_AsLongLong(v);
}

/* lock.acquire(False): 1 taken, 0 busy, -1 error */
static int try_acquire(PyObject *lock) {
    PyObject *r = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    int t;
    if (r == NULL)
        return -1;
    t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

static int release(PyObject *lock) {
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The bin's part of a dying Tensor (recycle._tensor_del); bound to the class as its __del__ by `del_for`. */
static PyObject *tensor_del(PyObject *self, PyObject *noargs) {
    PyObject *dict = NULL, *a = NULL, *mp = NULL, *mem = NULL, *live = NULL, *ptr = NULL, *blk = NULL, *sub = NULL,
             *stream = NULL, *size = NULL, *pinned = NULL, *key = NULL, *lst = NULL, *lock = NULL, *tmp = NULL,
             *pool_ref = NULL;
    PyObject *nd, *pool, *on, *held, *bins, *counts, *req, *flag;
    long long numel, max_numel, held_bytes, nbytes, max_bytes, per_key;
    int t, locked = 0, failed = 0;
    (void)noargs;

    dict = PyObject_GenericGetDict(self, NULL);
    if (dict == NULL)
        goto error;
    a = PyDict_GetItemWithError(dict, s__data);
    if (a == NULL) {
        if (PyErr_Occurred())
            goto error;
        goto done;
    }
    Py_INCREF(a);
    if ((nd = global(n_nd)) == NULL)
        goto error;
    if ((PyObject *)Py_TYPE(a) != nd)
        goto done;
    if ((tmp = PyObject_GetAttr(a, s_size)) == NULL)
        goto error;
    numel = PyLong_AsLongLong(tmp);
    Py_CLEAR(tmp);
    if (numel == -1 && PyErr_Occurred())
        goto error;
    if ((max_numel = global_ll(n_MAX_NUMEL)) == -1 && PyErr_Occurred())
        goto error;
    if (numel > max_numel || Py_REFCNT(a) != 2)
        goto done;
    if ((tmp = PyObject_GetAttr(a, s_base)) == NULL)
        goto error;
    t = tmp != Py_None;
    Py_CLEAR(tmp);
    if (t)
        goto done;
    if ((flag = global(n_FLAG_ATTR)) == NULL || (t = speedups_c_contiguous(a, flag)) < 0)
        goto error;
    if (!t)
        goto done;
    if ((mp = PyObject_GetAttr(a, s_data)) == NULL)
        goto error;
    if ((mem = PyObject_GetAttr(mp, s_mem)) == NULL)
        goto error;
    if (Py_REFCNT(mp) != 2 || Py_REFCNT(mem) != 2) /* another array (or pointer) over the same memory */
        goto done;
    if ((pool = boxed(n_pool)) == NULL || (on = boxed(n_on)) == NULL)
        goto error;
    if (pool == Py_None)
        goto done;
    if ((t = PyObject_IsTrue(on)) < 0)
        goto error;
    if (!t)
        goto done;
    Py_INCREF(pool);
    pool_ref = pool;
    if ((live = PyObject_GetAttr(pool, s__live)) == NULL || (ptr = PyObject_GetAttr(mp, s_ptr)) == NULL)
        goto error;
    if (!PyDict_Check(live)) {
        PyErr_SetString(PyExc_TypeError, "the pool's _live is not a dict");
        goto error;
    }
    blk = PyDict_GetItemWithError(live, ptr);
    if (blk == NULL) {
        if (PyErr_Occurred())
            goto error;
        goto done;
    }
    Py_INCREF(blk);
    if ((tmp = PyObject_GetAttr(blk, s_free)) == NULL)
        goto error;
    t = PyObject_IsTrue(tmp);
    Py_CLEAR(tmp);
    if (t < 0)
        goto error;
    if (t)
        goto done;
    if ((sub = PyObject_GetAttr(blk, s_sub)) == NULL || (stream = PyObject_GetAttr(sub, s_stream)) == NULL
        || (size = PyObject_GetAttr(blk, s_size)) == NULL
        || (pinned = PyObject_GetAttr(pool, s__pinned_streams)) == NULL)
        goto error;
    if ((t = PySequence_Contains(pinned, stream)) < 0)
        goto error;
    if (t)
        goto done;
    if ((held = global(n_held)) == NULL)
        goto error;
    if (!PyList_Check(held) || PyList_GET_SIZE(held) < 2) {
        PyErr_SetString(PyExc_TypeError, "recycle.held is not a two-element list");
        goto error;
    }
    held_bytes = PyLong_AsLongLong(PyList_GET_ITEM(held, 1));
    if (held_bytes == -1 && PyErr_Occurred())
        goto error;
    nbytes = PyLong_AsLongLong(size);
    if (nbytes == -1 && PyErr_Occurred())
        goto error;
    if ((max_bytes = global_ll(n_MAX_BYTES)) == -1 && PyErr_Occurred())
        goto error;
    if (held_bytes + nbytes > max_bytes)
        goto done;
    {
        PyObject *shape = PyObject_GetAttr(a, s_shape), *dtype;
        if (shape == NULL)
            goto error;
        dtype = PyObject_GetAttr(a, s_dtype);
        if (dtype == NULL) {
            Py_DECREF(shape);
            goto error;
        }
        key = PyTuple_Pack(3, shape, dtype, stream);
        Py_DECREF(shape);
        Py_DECREF(dtype);
        if (key == NULL)
            goto error;
    }
    if ((bins = global(n_bins)) == NULL)
        goto error;
    if (!PyDict_Check(bins)) {
        PyErr_SetString(PyExc_TypeError, "recycle.bins is not a dict");
        goto error;
    }
    lst = PyDict_GetItemWithError(bins, key);
    if (lst == NULL) {
        if (PyErr_Occurred())
            goto error;
        if ((lst = PyList_New(0)) == NULL)
            goto error;
        if (PyDict_SetItem(bins, key, lst) < 0)
            goto error;
    } else {
        Py_INCREF(lst);
        if ((per_key = global_ll(n_PER_KEY)) == -1 && PyErr_Occurred())
            goto error;
        if (!PyList_Check(lst) || PyList_GET_SIZE(lst) >= per_key)
            goto done;
    }
    if ((lock = PyObject_GetAttr(pool, s__lock)) == NULL)
        goto error;
    if ((t = try_acquire(lock)) < 0)
        goto error;
    if (!t) /* the pool is busy (another thread, or GC inside malloc): let the array die */
        goto done;
    locked = 1;
    if ((on = boxed(n_on)) == NULL || (t = PyObject_IsTrue(on)) < 0)
        goto error;
    if (!t)
        goto done;
    if ((counts = global(n_counts)) == NULL)
        goto error;
    if (PyObject_SetAttr(blk, s_tag, Py_None) < 0 || attr_add(pool, s_allocated, size, -1) < 0)
        goto error;
    if ((req = PyObject_GetAttr(blk, s_requested)) == NULL)
        goto error;
    t = attr_add(pool, s_requested, req, -1);
    Py_DECREF(req);
    if (t < 0 || attr_add(pool, s_bytes_freed_total, size, 1) < 0 || attr_add(pool, s_num_free, one, 1) < 0
        || list_add(held, 0, one, 1) < 0 || list_add(held, 1, size, 1) < 0 || count_up(counts, s_binned) < 0)
        goto error;
    if ((tmp = PyTuple_Pack(2, a, blk)) == NULL)
        goto error;
    t = PyList_Append(lst, tmp);
    Py_CLEAR(tmp);
    if (t < 0)
        goto error;
    goto done;

error:
    failed = 1;
done:
    if (locked) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (release(lock) < 0) {
            if (failed) /* keep the first error */
                PyErr_Clear();
            else
                failed = 1, et = ev = tb = NULL;
        }
        if (et != NULL)
            PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(dict);
    Py_XDECREF(a);
    Py_XDECREF(mp);
    Py_XDECREF(mem);
    Py_XDECREF(live);
    Py_XDECREF(ptr);
    Py_XDECREF(blk);
    Py_XDECREF(sub);
    Py_XDECREF(stream);
    Py_XDECREF(size);
    Py_XDECREF(pinned);
    Py_XDECREF(key);
    Py_XDECREF(lst);
    Py_XDECREF(lock);
    Py_XDECREF(tmp);
    Py_XDECREF(pool_ref);
    if (failed) {
        /* interpreter shutdown: recycle's globals may be None, or gone from its dict */
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_NameError)) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef tensor_del_def = {"__del__", tensor_del, METH_NOARGS,
                                     "Bin the tensor's array when it is the last holder (recycle._tensor_del)."};

/* take(shape, dtype): recycle.take */
static PyObject *take(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *bins, *cs, *st = NULL, *sptr = NULL, *key = NULL, *lst, *pool, *lock = NULL, *item = NULL, *a = NULL,
             *blk, *size = NULL, *req = NULL, *held, *counts, *alloc = NULL, *peak = NULL;
    Py_ssize_t n;
    int t, locked = 0;
    (void)mod;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(shape, dtype)");
        return NULL;
    }
    if ((bins = global(n_bins)) == NULL || (cs = global(n_current_stream)) == NULL)
        return NULL;
    if ((st = PyObject_CallNoArgs(cs)) == NULL)
        return NULL;
    sptr = PyObject_GetAttr(st, s_ptr);
    Py_DECREF(st);
    if (sptr == NULL)
        return NULL;
    key = PyTuple_Pack(3, args[0], args[1], sptr);
    Py_DECREF(sptr);
    if (key == NULL)
        return NULL;
    lst = PyDict_GetItemWithError(bins, key);
    Py_DECREF(key);
    if (lst == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (!PyList_Check(lst) || PyList_GET_SIZE(lst) == 0)
        Py_RETURN_NONE;
    Py_INCREF(lst);
    if ((pool = boxed(n_pool)) == NULL)
        goto error;
    Py_INCREF(pool);
    if ((lock = PyObject_GetAttr(pool, s__lock)) == NULL)
        goto error_pool;
    if ((t = try_acquire(lock)) < 0)
        goto error_pool;
    if (!t)
        goto none_pool;
    locked = 1;
    n = PyList_GET_SIZE(lst);
    if (n == 0)
        goto none_pool;
    item = PyList_GET_ITEM(lst, n - 1);
    Py_INCREF(item);
    if (PyList_SetSlice(lst, n - 1, n, NULL) < 0)
        goto error_pool;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        PyErr_SetString(PyExc_TypeError, "a bin entry is not an (array, block) pair");
        goto error_pool;
    }
    a = PyTuple_GET_ITEM(item, 0);
    blk = PyTuple_GET_ITEM(item, 1);
    if ((size = PyObject_GetAttr(blk, s_size)) == NULL || (held = global(n_held)) == NULL
        || (counts = global(n_counts)) == NULL)
        goto error_pool;
    if (list_add(held, 0, one, -1) < 0 || list_add(held, 1, size, -1) < 0 || count_up(counts, s_taken) < 0
        || attr_add(pool, s_cache_hits, one, 1) < 0)
        goto error_pool;
    if ((req = PyObject_GetAttr(blk, s_requested)) == NULL || attr_add(pool, s_requested, req, 1) < 0)
        goto error_pool;
    if (attr_add(pool, s_allocated, size, 1) < 0 || (alloc = PyObject_GetAttr(pool, s_allocated)) == NULL
        || (peak = PyObject_GetAttr(pool, s_peak_allocated)) == NULL)
        goto error_pool;
    if ((t = PyObject_RichCompareBool(alloc, peak, Py_GT)) < 0)
        goto error_pool;
    if (t && PyObject_SetAttr(pool, s_peak_allocated, alloc) < 0)
        goto error_pool;
    Py_INCREF(a);
    Py_DECREF(item);
    item = NULL;
    if (release(lock) < 0) {
        locked = 0;
        Py_DECREF(a);
        goto error_pool;
    }
    Py_DECREF(lock);
    Py_DECREF(pool);
    Py_DECREF(lst);
    Py_XDECREF(size);
    Py_XDECREF(req);
    Py_XDECREF(alloc);
    Py_XDECREF(peak);
    return a;

none_pool:
    if (locked && release(lock) < 0) {
        locked = 0;
        goto error_pool;
    }
    Py_XDECREF(lock);
    Py_DECREF(pool);
    Py_DECREF(lst);
    Py_RETURN_NONE;
error_pool:
    if (locked) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (release(lock) < 0)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    Py_XDECREF(lock);
    Py_XDECREF(item);
    Py_XDECREF(size);
    Py_XDECREF(req);
    Py_XDECREF(alloc);
    Py_XDECREF(peak);
    Py_DECREF(pool);
error:
    Py_DECREF(lst);
    return NULL;
}

/* del_for(cls): a method descriptor of `cls` whose call is tensor_del, to install as cls.__del__ */
static PyObject *del_for(PyObject *mod, PyObject *cls) {
    (void)mod;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "del_for(cls) takes a class");
        return NULL;
    }
    return PyDescr_NewMethod((PyTypeObject *)cls, &tensor_del_def);
}

/* configure_recycle(globals): the module dict whose names the hooks read (recycle's) */
static PyObject *configure(PyObject *mod, PyObject *d) {
    (void)mod;
    return speedups_keep_dict(&g_globals, d);
}

PyMethodDef recycle_methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "take(shape, dtype): recycle.take in C."},
    {"del_for", del_for, METH_O, "del_for(cls): recycle._tensor_del in C, as a method descriptor of cls."},
    {"configure_recycle", configure, METH_O, "configure_recycle(globals): recycle.py's module dict."},
    {NULL, NULL, 0, NULL}};

int recycle_init(void) {
    INTERN(s__data, "_data") INTERN(s_size, "size") INTERN(s_base, "base") INTERN(s_data, "data") INTERN(s_mem, "mem")
    INTERN(s_ptr, "ptr") INTERN(s__live, "_live") INTERN(s_free, "free") INTERN(s_sub, "sub")
    INTERN(s_stream, "stream") INTERN(s__pinned_streams, "_pinned_streams") INTERN(s_shape, "shape")
    INTERN(s_dtype, "dtype") INTERN(s__lock, "_lock") INTERN(s_acquire, "acquire") INTERN(s_release, "release")
    INTERN(s_tag, "tag") INTERN(s_allocated, "allocated") INTERN(s_requested, "requested")
    INTERN(s_bytes_freed_total, "bytes_freed_total") INTERN(s_num_free, "num_free")
    INTERN(s_cache_hits, "cache_hits") INTERN(s_peak_allocated, "peak_allocated") INTERN(s_binned, "binned")
    INTERN(s_taken, "taken") INTERN(n_nd, "_nd") INTERN(n_on, "on") INTERN(n_bins, "bins") INTERN(n_held, "held")
    INTERN(n_counts, "counts") INTERN(n_pool, "_pool") INTERN(n_current_stream, "_current_stream")
    INTERN(n_FLAG_ATTR, "_FLAG_ATTR") INTERN(n_MAX_NUMEL, "MAX_NUMEL") INTERN(n_PER_KEY, "PER_KEY")
    INTERN(n_MAX_BYTES, "MAX_BYTES")
    if ((one = PyLong_FromLong(1)) == NULL)
        return -1;
    return 0;
}
