/* Function.apply (flame_core/autograd/function.py: `py_apply`) in C: part of flame_core._speedups.

Every op goes through it: find the inputs' edges, run the forward with grad mode off, record one Node when an input
requires grad. It is py_apply statement for statement without the interpreter; py_apply stays its specification and
the fallback (not built, FLAME_SPEEDUPS=0), and runs in its place while held (`function.hold_python_apply`: a
memory profiler reads the op from py_apply's frame; bound references to the C apply, such as ops/__init__.py's, see
the hold too).

Names are read from function.py's module dict at each call (`configure_apply(globals())` hands it over once):
`state`, `_tensor_cls`, `Node`, `_Ctx`, `_FLOAT_NP`, `accumulator_of`, `_record_outputs`, `_forward_value_error`,
`_anomaly_stack`. */
#include "speedups.h"

static PyObject *g_fn_globals;

static PyObject *s__python_holds, *s__py_apply_fn, *s_state, *s__tensor_cls, *s_Node, *s__Ctx, *s__FLOAT_NP,
    *s_accumulator_of, *s__record_outputs,
    *s__forward_value_error, *s__anomaly_stack, *s_enabled, *s_anomaly, *s__grad_fn, *s__out_idx, *s__requires_grad,
    *s__fn, *s__saved, *s__hooks, *s__non_diff, *s__freed, *s_next_functions, *s_needs_input_grad,
    *s__forward_stack, *s_forward, *s__out_meta, *s__data, *s_dtype, *s_shape, *s__f8, *s__alias;
static PyObject *zero, *empty;

static PyObject *fglobal(PyObject *name) {
    return speedups_name(g_fn_globals, name);
}

/* state.enabled = value, keeping whatever exception is set (a `finally:`); 0 or -1 */
static int set_enabled(PyObject *state, PyObject *value) {
    PyObject *et, *ev, *tb;
    int r;
    PyErr_Fetch(&et, &ev, &tb);
    r = PyObject_SetAttr(state, s_enabled, value);
    if (et != NULL) {
        if (r < 0)
            PyErr_Clear();
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return r;
}

/* The forward raised: a ValueError that is a broadcast failure becomes function.py's ShapeError naming the shapes
   (`_forward_value_error` decides, as py_apply's except clause). Returns NULL with the exception to raise set. */
static PyObject *forward_failed(PyObject *cls, PyObject *const *args, Py_ssize_t n) {
    PyObject *et, *ev, *tb, *helper, *targs, *err;
    if (!PyErr_ExceptionMatches(PyExc_ValueError))
        return NULL;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (tb != NULL)
        PyException_SetTraceback(ev, tb);
    helper = fglobal(s__forward_value_error);
    targs = helper == NULL ? NULL : PyTuple_New(n);
    if (targs == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(targs, i, args[i]);
    }
    err = PyObject_CallFunctionObjArgs(helper, cls, targs, ev, NULL);
    Py_DECREF(targs);
    if (err == NULL) { /* the helper itself failed: that error stands */
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
    }
    if (err == ev) { /* not a broadcast failure: the forward's own error, as raised */
        Py_DECREF(err);
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    PyErr_SetObject((PyObject *)Py_TYPE(err), err);
    Py_DECREF(err);
    return NULL;
}

/* cls.forward(ctx, *args, **kwargs) with grad mode switched to `during` and back to `after` */
static PyObject *run_forward(PyObject *cls, PyObject *ctx, PyObject *state, PyObject *const *args, Py_ssize_t n,
                             PyObject *kwnames, PyObject *during, PyObject *after) {
    PyObject *fwd, *out, *small[8], **buf;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames), total = 1 + n + nkw;
    if ((fwd = PyObject_GetAttr(cls, s_forward)) == NULL)
        return NULL;
    buf = total <= 7 ? small + 1 : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (buf == NULL) {
        Py_DECREF(fwd);
        return PyErr_NoMemory();
    }
    if (total > 7)
        buf += 1;
    buf[0] = ctx;
    for (Py_ssize_t i = 0; i < n + nkw; i++)
        buf[1 + i] = args[i];
    if (during != NULL && PyObject_SetAttr(state, s_enabled, during) < 0) {
        out = NULL;
    } else {
        out = PyObject_Vectorcall(fwd, buf, (size_t)(1 + n) | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames);
        if (out == NULL)
            forward_failed(cls, args, n);
        if (set_enabled(state, after) < 0)
            Py_CLEAR(out);
    }
    if (total > 7)
        PyMem_Free(buf - 1);
    Py_DECREF(fwd);
    return out;
}

/* A ctx that records nothing: _Ctx with _fn and needs_input_grad (False per argument) */
static PyObject *light_ctx(PyObject *cls, Py_ssize_t n) {
    PyObject *ctx_cls = fglobal(s__Ctx), *ctx, *needs;
    if (ctx_cls == NULL)
        return NULL;
    if ((ctx = PyBaseObject_Type.tp_new((PyTypeObject *)ctx_cls, empty, NULL)) == NULL)
        return NULL;
    if ((needs = PyTuple_New(n)) == NULL) {
        Py_DECREF(ctx);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(Py_False);
        PyTuple_SET_ITEM(needs, i, Py_False);
    }
    if (PyObject_SetAttr(ctx, s__fn, cls) < 0 || PyObject_SetAttr(ctx, s_needs_input_grad, needs) < 0) {
        Py_DECREF(needs);
        Py_DECREF(ctx);
        return NULL;
    }
    Py_DECREF(needs);
    return ctx;
}

/* The edge of one argument: (grad_fn, out_idx), (accumulator, 0), or None (new references); NULL on error */
static PyObject *edge_of(PyObject *a, PyObject *tensor_cls) {
    PyObject *fn, *idx, *e, *rg, *acc_of, *acc;
    int t;
    if (!PyObject_TypeCheck(a, (PyTypeObject *)tensor_cls))
        Py_RETURN_NONE;
    if ((fn = PyObject_GetAttr(a, s__grad_fn)) == NULL)
        return NULL;
    if (fn != Py_None) {
        if ((idx = PyObject_GetAttr(a, s__out_idx)) == NULL) {
            Py_DECREF(fn);
            return NULL;
        }
        e = PyTuple_Pack(2, fn, idx);
        Py_DECREF(fn);
        Py_DECREF(idx);
        return e;
    }
    Py_DECREF(fn);
    if ((rg = PyObject_GetAttr(a, s__requires_grad)) == NULL)
        return NULL;
    t = PyObject_IsTrue(rg);
    Py_DECREF(rg);
    if (t < 0)
        return NULL;
    if (!t)
        Py_RETURN_NONE;
    if ((acc_of = fglobal(s_accumulator_of)) == NULL || (acc = PyObject_CallOneArg(acc_of, a)) == NULL)
        return NULL;
    e = PyTuple_Pack(2, acc, zero);
    Py_DECREF(acc);
    return e;
}

/* The single Tensor output's recording (py_apply's tail) */
static int record_output(PyObject *node, PyObject *out) {
    PyObject *d = NULL, *dt = NULL, *shape = NULL, *m = NULL, *meta = NULL, *non_diff = NULL, *fl, *saved = NULL,
             *f8;
    int ok = -1, diff, t;
    if ((d = PyObject_GetAttr(out, s__data)) == NULL || (dt = PyObject_GetAttr(d, s_dtype)) == NULL
        || (shape = PyObject_GetAttr(d, s_shape)) == NULL)
        goto end;
    if ((m = PyTuple_Pack(3, shape, dt, (PyObject *)Py_TYPE(d))) == NULL || (meta = PyList_New(1)) == NULL)
        goto end;
    Py_INCREF(m);
    PyList_SET_ITEM(meta, 0, m);
    if (PyObject_SetAttr(node, s__out_meta, meta) < 0 || (non_diff = PyObject_GetAttr(node, s__non_diff)) == NULL)
        goto end;
    diff = 1;
    if (non_diff != Py_None) {
        PyObject *id = PyLong_FromVoidPtr(out);
        if (id == NULL)
            goto end;
        t = PySequence_Contains(non_diff, id);
        Py_DECREF(id);
        if (t < 0)
            goto end;
        diff = !t;
    }
    if (diff) {
        if ((fl = fglobal(s__FLOAT_NP)) == NULL || (t = PySequence_Contains(fl, dt)) < 0)
            goto end;
        if (!t) {
            if ((f8 = PyObject_GetAttr(out, s__f8)) == NULL)
                goto end;
            t = PyObject_IsTrue(f8);
            Py_DECREF(f8);
            if (t < 0)
                goto end;
        }
        if (t && (PyObject_SetAttr(out, s__grad_fn, node) < 0 || PyObject_SetAttr(out, s__out_idx, zero) < 0))
            goto end;
    }
    if ((saved = PyObject_GetAttr(node, s__saved)) == NULL || (t = PyObject_IsTrue(saved)) < 0)
        goto end;
    if (t) { /* saved outputs are kept as detached aliases: no reference cycle output -> node -> output */
        Py_ssize_t k, len = PyObject_Length(saved);
        if (len < 0)
            goto end;
        for (k = 0; k < len; k++) {
            PyObject *item = PySequence_GetItem(saved, k), *t0, *alias, *repl;
            if (item == NULL)
                goto end;
            if (item == Py_None) {
                Py_DECREF(item);
                continue;
            }
            if ((t0 = PySequence_GetItem(item, 0)) == NULL) {
                Py_DECREF(item);
                goto end;
            }
            Py_DECREF(t0); /* identity only */
            if (t0 != out) {
                Py_DECREF(item);
                continue;
            }
            alias = PyObject_CallMethodNoArgs(out, s__alias);
            if (alias == NULL) {
                Py_DECREF(item);
                goto end;
            }
            {
                PyObject *v1 = PySequence_GetItem(item, 1);
                if (v1 == NULL) {
                    Py_DECREF(alias);
                    Py_DECREF(item);
                    goto end;
                }
                repl = PyTuple_Pack(3, alias, v1, zero);
                Py_DECREF(v1);
            }
            Py_DECREF(alias);
            Py_DECREF(item);
            if (repl == NULL)
                goto end;
            t = PySequence_SetItem(saved, k, repl);
            Py_DECREF(repl);
            if (t < 0)
                goto end;
        }
    }
    ok = 0;
end:
    Py_XDECREF(d);
    Py_XDECREF(dt);
    Py_XDECREF(shape);
    Py_XDECREF(m);
    Py_XDECREF(meta);
    Py_XDECREF(non_diff);
    Py_XDECREF(saved);
    return ok;
}

/* apply(cls, *args, **kwargs): installed as Function.apply = classmethod(apply) */
static PyObject *apply(PyObject *mod, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), n, i;
    PyObject *cls, *state, *en, *ctx, *out, *box, *tensor_cls, *edges = NULL, *needs = NULL, *node = NULL,
             *node_cls, *holds;
    int t, record = 0;
    (void)mod;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "apply() needs the Function class");
        return NULL;
    }
    /* held (hold_python_apply): py_apply runs, whose frame the memory profiler reads */
    if ((holds = fglobal(s__python_holds)) == NULL)
        return NULL;
    if (!PyList_Check(holds) || PyList_GET_SIZE(holds) < 1) {
        PyErr_SetString(PyExc_TypeError, "function._python_holds is not a one-element list");
        return NULL;
    }
    if ((t = PyObject_IsTrue(PyList_GET_ITEM(holds, 0))) < 0)
        return NULL;
    if (t) {
        PyObject *pyfn = fglobal(s__py_apply_fn);
        return pyfn == NULL ? NULL : PyObject_Vectorcall(pyfn, args, nargsf, kwnames);
    }
    cls = args[0];
    args += 1;
    n = nargs - 1;
    if ((state = fglobal(s_state)) == NULL || (en = PyObject_GetAttr(state, s_enabled)) == NULL)
        return NULL;
    t = PyObject_IsTrue(en);
    Py_DECREF(en);
    if (t < 0)
        return NULL;
    Py_INCREF(state);
    if (!t) { /* grad mode is off: nothing to record and no mode to switch (a forward that switches it restores it) */
        if ((ctx = light_ctx(cls, n)) == NULL) {
            Py_DECREF(state);
            return NULL;
        }
        out = run_forward(cls, ctx, state, args, n, kwnames, NULL, Py_False);
        Py_DECREF(ctx);
        Py_DECREF(state);
        return out;
    }
    if ((box = fglobal(s__tensor_cls)) == NULL)
        goto fail;
    if (!PyList_Check(box) || PyList_GET_SIZE(box) < 1 || !PyType_Check(PyList_GET_ITEM(box, 0))) {
        PyErr_SetString(PyExc_TypeError, "function._tensor_cls[0] is not the Tensor class");
        goto fail;
    }
    tensor_cls = PyList_GET_ITEM(box, 0);
    if ((edges = PyTuple_New(n)) == NULL || (needs = PyTuple_New(n)) == NULL)
        goto fail;
    for (i = 0; i < n; i++) {
        PyObject *e = edge_of(args[i], tensor_cls);
        if (e == NULL)
            goto fail;
        PyTuple_SET_ITEM(edges, i, e);
        t = e != Py_None;
        record |= t;
        Py_INCREF(t ? Py_True : Py_False);
        PyTuple_SET_ITEM(needs, i, t ? Py_True : Py_False);
    }
    if (!record) {
        Py_CLEAR(edges);
        Py_CLEAR(needs);
        if ((ctx = light_ctx(cls, n)) == NULL)
            goto fail;
        out = run_forward(cls, ctx, state, args, n, kwnames, Py_False, Py_True);
        Py_DECREF(ctx);
        Py_DECREF(state);
        return out;
    }
    /* at least one input requires grad: run forward, record one Node (Node.__init__ inlined) */
    if ((node_cls = fglobal(s_Node)) == NULL
        || (node = PyBaseObject_Type.tp_new((PyTypeObject *)node_cls, empty, NULL)) == NULL)
        goto fail;
    if (PyObject_SetAttr(node, s__fn, cls) < 0 || PyObject_SetAttr(node, s__saved, Py_None) < 0
        || PyObject_SetAttr(node, s__hooks, Py_None) < 0 || PyObject_SetAttr(node, s__non_diff, Py_None) < 0
        || PyObject_SetAttr(node, s__freed, Py_False) < 0 || PyObject_SetAttr(node, s_next_functions, edges) < 0
        || PyObject_SetAttr(node, s_needs_input_grad, needs) < 0)
        goto fail;
    Py_CLEAR(edges);
    Py_CLEAR(needs);
    if ((en = PyObject_GetAttr(state, s_anomaly)) == NULL)
        goto fail;
    t = PyObject_IsTrue(en);
    Py_DECREF(en);
    if (t < 0)
        goto fail;
    if (t) {
        PyObject *fs = fglobal(s__anomaly_stack), *stack;
        if (fs == NULL || (stack = PyObject_CallNoArgs(fs)) == NULL)
            goto fail;
        t = PyObject_SetAttr(node, s__forward_stack, stack);
        Py_DECREF(stack);
        if (t < 0)
            goto fail;
    }
    out = run_forward(cls, node, state, args, n, kwnames, Py_False, Py_True);
    if (out == NULL)
        goto fail;
    if (PyTuple_Check(out)) {
        PyObject *ro = fglobal(s__record_outputs), *r;
        r = ro == NULL ? NULL : PyObject_CallFunctionObjArgs(ro, node, out, NULL);
        Py_DECREF(out);
        Py_DECREF(node);
        Py_DECREF(state);
        return r;
    }
    if (out == Py_None) {
        PyObject *meta = PyList_New(1);
        if (meta == NULL)
            goto fail_out;
        Py_INCREF(Py_None);
        PyList_SET_ITEM(meta, 0, Py_None);
        t = PyObject_SetAttr(node, s__out_meta, meta);
        Py_DECREF(meta);
        if (t < 0)
            goto fail_out;
    } else if (record_output(node, out) < 0) {
        goto fail_out;
    }
    Py_DECREF(node);
    Py_DECREF(state);
    return out;

fail_out:
    Py_DECREF(out);
fail:
    Py_XDECREF(edges);
    Py_XDECREF(needs);
    Py_XDECREF(node);
    Py_DECREF(state);
    return NULL;
}

/* configure_apply(globals): function.py's module dict */
static PyObject *configure_apply(PyObject *mod, PyObject *d) {
    (void)mod;
    return speedups_keep_dict(&g_fn_globals, d);
}

PyMethodDef apply_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL | METH_KEYWORDS,
     "apply(cls, *args, **kwargs): Function.apply in C (install as a classmethod)."},
    {"configure_apply", configure_apply, METH_O, "configure_apply(globals): function.py's module dict."},
    {NULL, NULL, 0, NULL}};

int apply_init(void) {
    INTERN(s__python_holds, "_python_holds") INTERN(s__py_apply_fn, "_py_apply_fn") INTERN(s_state, "state")
    INTERN(s__tensor_cls, "_tensor_cls") INTERN(s_Node, "Node") INTERN(s__Ctx, "_Ctx")
    INTERN(s__FLOAT_NP, "_FLOAT_NP") INTERN(s_accumulator_of, "accumulator_of")
    INTERN(s__record_outputs, "_record_outputs") INTERN(s__forward_value_error, "_forward_value_error")
    INTERN(s__anomaly_stack, "_anomaly_stack") INTERN(s_enabled, "enabled") INTERN(s_anomaly, "anomaly")
    INTERN(s__grad_fn, "_grad_fn") INTERN(s__out_idx, "_out_idx") INTERN(s__requires_grad, "_requires_grad")
    INTERN(s__fn, "_fn") INTERN(s__saved, "_saved") INTERN(s__hooks, "_hooks") INTERN(s__non_diff, "_non_diff")
    INTERN(s__freed, "_freed") INTERN(s_next_functions, "next_functions")
    INTERN(s_needs_input_grad, "needs_input_grad") INTERN(s__forward_stack, "_forward_stack")
    INTERN(s_forward, "forward") INTERN(s__out_meta, "_out_meta") INTERN(s__data, "_data") INTERN(s_dtype, "dtype")
    INTERN(s_shape, "shape") INTERN(s__f8, "_f8") INTERN(s__alias, "_alias")
    if ((zero = PyLong_FromLong(0)) == NULL || (empty = PyTuple_New(0)) == NULL)
        return -1;
    return 0;
}
