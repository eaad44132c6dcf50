"""Backward: walk the recorded graph in reverse topological order, without recursion, freeing as it goes."""
import sys as _sys

import numpy as _np

from ..errors import AutogradError, ShapeError, fmt_shape
from . import anomaly_mode as _anomaly
from . import function as _function
from .function import _FLOAT_NP, AccumulateGrad, Node, edge_of
from .grad_mode import state

_np_ndarray = _np.ndarray
_fast_binary = None  # flame_core.kernels.pointwise_small.fast_binary, imported at first use

# set by flame_core.grad_pool when parameters are registered: f(leaf, grad_tensor) -> True if it stored the gradient
leaf_grad_sink = None

# callbacks queued during a backward run when the outermost one (a checkpointed region's recompute runs a nested
# backward inside it) has finished; _depth counts the nested runs, _pass numbers the outermost ones
_callbacks = []
_depth = 0
_pass = 0
_retaining = []  # retain_graph of each running (nested) backward, innermost last
# (node, buffers, sums) of the backward the engine is calling now (Node.take_pending_grad reads it); None under
# create_graph and between calls
_running = None


def queue_callback(fn):
    """Run `fn()` once the running backward pass -- the outermost one, so a checkpointed region's nested backward
    does not count -- has walked its whole graph (torch's `Variable._execution_engine.queue_callback`). For work
    that needs every gradient of the pass, e.g. DistributedDataParallel's last gradient buckets. Callbacks run in
    the order queued; one may queue another. None run when the pass raised."""
    if _depth == 0:
        raise AutogradError("queue_callback can only be called while a backward pass runs (from a hook)")
    _callbacks.append(fn)


def current_pass():
    """A number identifying the outermost backward pass running now (None outside one): hooks that keep state
    across the leaves of one pass tell a new pass from a stale one (an earlier pass that raised)."""
    return _pass if _depth else None


def retaining_graph():
    """Whether the innermost running backward keeps the graph (retain_graph=True or create_graph): a Function's
    backward may reuse its saved tensors' memory only when it does not (they are freed right after it anyway)."""
    return bool(_retaining and _retaining[-1])


def _zeros(meta):
    shape, dt, arr_type = meta
    import numpy as np

    from .. import backend
    from ..tensor import _wrap
    xp = backend.cupy if arr_type is not np.ndarray else np
    return _wrap(xp.zeros(shape, dtype=dt))


def _iadd(a, b, op="add"):
    """a += b (op "sub": a -= b, Node.sub_from_pending_grad) on arrays of one dtype: small contiguous cuda arrays
    take cuda_src/pointwise_small.cu (a packed launch instead of a CuPy ufunc dispatch, the same fp32 result rounded
    once), everything else the ufunc."""
    if type(a) is not _np_ndarray:
        fast = _fast_binary or _load_fast_binary()
        if fast(op, a, b, a) is not None:
            return
    if op == "add":
        a += b
    else:
        a -= b


def _sub(p, g):
    """p - g as a new tensor the engine will hold (first-order backward: nothing is recorded)."""
    pd = p._data
    if type(pd) is not _np_ndarray:
        r = (_fast_binary or _load_fast_binary())("sub", pd, g._data)
        if r is not None:
            from ..tensor import _wrap
            return _wrap(r)
    return p - g


def _load_fast_binary():
    global _fast_binary
    from ..kernels.pointwise_small import fast_binary
    _fast_binary = fast_binary
    return fast_binary


_refs = _sys.getrefcount


def _owns_memory(g, base=None):
    """Whether nothing but gradient tensor `g` (and, for a view g of the tensor `base`, base) holds g's memory: its
    array is held by g alone (g._data, the local name, getrefcount's argument) and C-contiguous; the array owning
    the memory (NumPy and CuPy collapse view chains to it) by that array alone, or also by base's array (base._data
    itself, or a view of it that base alone holds). Foreign memory (a buffer, mmap, DLPack) never counts as owned.
    The callers count the references to g and base themselves."""
    a = g._data
    if _refs(a) > 3 or not a.flags.c_contiguous:
        return False
    b = a.base
    if b is None:
        return base is None
    if type(b) is not type(a) or b.base is not None:
        return False
    held = 3  # a.base, the name b, getrefcount's argument
    if base is not None:
        bd = base._data
        if bd is b:
            held = 5  # + base._data and the name bd
        elif bd.base is b and _refs(bd) <= 3:  # base._data, the name bd, getrefcount's
            held = 4  # + bd.base
        else:
            return False
    return _refs(b) <= held


def _sole_holder(g):
    """Whether gradient tensor `g` is the only holder of its memory, so that a leaf's .grad may keep it without a
    copy (PyTorch's AccumulateGrad steals a gradient whose use count is 1). Counted references to g: the engine's
    slot list, _accumulate_leaf's argument, this function's argument and getrefcount's; its memory as
    _owns_memory counts it. Any other holder - a second leaf handed the same gradient (Add), a Function that kept
    it, the caller's own grad_tensors, a view of it elsewhere - makes the count higher and the gradient is copied."""
    if _refs(g) > 4 or g._base is not None:
        return False
    return _owns_memory(g)


def grad_is_exclusive(node, g, frames=1):
    """Inside `node`'s backward (with the gradient it was handed; `frames`: the function arguments that hold g from
    the backward's call to this one, 1 when the backward calls this directly): whether nothing but the engine's
    walk holds gradient `g`'s memory, so that the backward may write its input's gradient into it (an element-wise
    backward saves a new buffer of the gradient's size at the moment memory peaks in backward). Counted references
    to g: the engine's gradient list, the backward's argument, the `frames` arguments and getrefcount's (and the
    engine's note of a sum it made itself, which it holds alone). g may be a view (a Linear's input gradient is the
    GEMM's 2-D result reshaped) of a base tensor that only g holds; the memory is counted by _owns_memory.
    Anything else -- the same gradient sent to two inputs (Add), a hook or retain_grad that kept it, the caller's
    grad_tensors, another view of it -- makes a count higher and the answer False; so does create_graph (the
    gradient is part of a graph then)."""
    cur = _running
    if cur is None or cur[0] is not node:
        return False
    if _refs(g) > 3 + frames + (cur[3] is g):
        return False
    base = g._base
    if base is not None and (base._base is not None or _refs(base) > 3):  # g._base, the name, getrefcount's
        return False
    return _owns_memory(g, base)


def _accumulate_leaf(leaf, g, create_graph, owned):
    if leaf_grad_sink is not None and leaf_grad_sink(leaf, g):
        return
    if g._data.dtype != leaf._data.dtype:
        g = g.to(leaf.dtype)
        owned = True
    if leaf._grad is None:
        # .grad owns its storage: a gradient the engine did not make itself may be a broadcast view or shared with
        # another leaf (Add passes one gradient to both inputs), so it is copied unless the engine owns it or it is
        # the sole holder of a contiguous array (a Function's freshly computed gradient)
        if create_graph:
            leaf._grad = g
        elif (owned and g._data.flags.c_contiguous) or _sole_holder(g):
            leaf._grad = g._detached_owned()
        else:
            leaf._grad = type(g)._from_array_copy(g._data)
    elif create_graph:
        leaf._grad = leaf._grad + g
    else:
        _iadd(leaf._grad._data, g._data)


def run_backward(roots, grad_roots, retain_graph=False, create_graph=False, inputs=None, allow_unused=False):
    """Core of `Tensor.backward` and `autograd.grad`.

    With `inputs` given, returns their gradients (in order) and leaves `.grad` untouched (autograd.grad semantics).
    """
    root_edges = []
    for t, g in zip(roots, grad_roots):
        e = edge_of(t)
        if e is None:
            raise AutogradError(f"element of shape {fmt_shape(t.shape)} does not require grad and has no grad_fn")
        root_edges.append((e, g))

    capture = None
    if inputs is not None:
        capture = {}
        for k, t in enumerate(inputs):
            e = edge_of(t)
            if e is None:
                raise AutogradError(f"input {k} of shape {fmt_shape(t.shape)} does not require grad")
            capture.setdefault((id(e[0]), e[1]), []).append(k)

    # dependency counts over the reachable graph (iterative DFS); keyed by the nodes themselves (identity hash), which
    # the graph keeps alive for the whole walk
    deps = {}
    roots_set = {e[0] for e, _ in root_edges}
    stack = list(roots_set)
    while stack:
        n = stack.pop()
        for e in n.next_functions:
            if e is None:
                continue
            c = e[0]
            d = deps.get(c)
            if d is None:
                deps[c] = 1
                if c not in roots_set:
                    stack.append(c)
            else:
                deps[c] = d + 1

    anomaly = state.anomaly   # anomaly detection (anomaly_mode.py): read once per pass
    check_nan = state.anomaly_nan
    # node -> [grad per output]. `sums` (node -> flags) marks the outputs whose gradient is a sum the engine made
    # itself and holds only in this slot: safe to accumulate into in place. The flags live with the slot, so a tensor
    # that left it (popped for its node's backward, which may hand one gradient to several inputs, as Add does) is
    # never written into; an id-keyed set went stale when Python reused a dead sum's id.
    buffers = {}
    sums = {}

    def add_grad(node, idx, g):
        slot = buffers.get(node)
        if slot is None:
            meta = node._out_meta
            if meta is None or len(meta) == 1:
                buffers[node] = [g]
            else:
                slot = buffers[node] = [None] * len(meta)
                slot[idx] = g
            return
        cur = slot[idx]
        if cur is None:
            slot[idx] = g
            return
        owned = sums.get(node)
        if owned is not None and owned[idx]:
            cd, gd = cur._data, g._data
            if cd.dtype == gd.dtype and cd.shape == gd.shape:
                _iadd(cd, gd)
                return
        slot[idx] = cur + g
        if not create_graph:
            if owned is None:
                owned = sums[node] = [False] * len(slot)
            owned[idx] = True

    for (node, idx), g in root_edges:
        add_grad(node, idx, g)

    results = [None] * len(inputs) if inputs is not None else None
    ready = [n for n in dict.fromkeys(e[0] for e, _ in root_edges) if n not in deps]
    global _depth, _pass, _running
    outermost = _depth == 0
    if outermost:
        _pass += 1
        _callbacks.clear()
    _depth += 1
    _retaining.append(bool(retain_graph or create_graph))
    prev = state.enabled
    state.enabled = create_graph
    try:
        while ready:
            node = ready.pop()
            grads = buffers.pop(node)
            owned = sums.pop(node, None) if sums else None
            own0 = grads[0] if owned is not None and owned[0] else None  # a sum a leaf may keep without a copy
            if node._hooks:
                for i, hooks in node._hooks.items():
                    # retain_grad hooks run last (they see what the other hooks made of the gradient)
                    for h in sorted(hooks, key=lambda h: getattr(h, "_retains_grad", False)):
                        if grads[i] is not None:
                            r = h(grads[i])
                            if r is not None:
                                grads[i] = r
            if capture is not None:
                for i, g in enumerate(grads):
                    ks = capture.get((id(node), i))
                    if ks:
                        for k in ks:
                            results[k] = g
            if isinstance(node, AccumulateGrad):
                leaf_hooks = node.variable._hooks
                if leaf_hooks and grads[0] is not None:
                    for h in leaf_hooks:
                        r = h(grads[0])
                        if r is not None:
                            grads[0] = r
                if capture is None and grads[0] is not None:
                    leaf = node.variable
                    _accumulate_leaf(leaf, grads[0], create_graph, grads[0] is own0)
                    if leaf._post_acc_hooks:
                        for h in tuple(leaf._post_acc_hooks):
                            h(leaf)
                continue
            if node._freed:
                raise AutogradError("Trying to backward through the graph a second time (or to access saved tensors "
                                    "after they were freed). Pass retain_graph=True to the first backward if you "
                                    "need to backward twice.")
            _running = None if create_graph else (node, buffers, sums, own0)
            try:
                if len(grads) == 1 and grads[0] is not None:
                    in_grads = node._fn.backward(node, grads[0])
                else:
                    meta = node._out_meta
                    for i, g in enumerate(grads):
                        if g is None:
                            grads[i] = _zeros(meta[i]) if meta[i] is not None else None
                    in_grads = node._fn.backward(node, *grads)
            except Exception as e:
                if anomaly:
                    _anomaly.annotate(e, node)
                raise
            _running = None
            del grads
            if type(in_grads) is not tuple:
                in_grads = (in_grads,) if not isinstance(in_grads, tuple) else in_grads
            if check_nan:
                _anomaly.check_nan(node, in_grads)
            edges = node.next_functions
            if len(in_grads) != len(edges):
                _check_grad_count(node, in_grads, len(edges))
            for e, g in zip(edges, in_grads):
                if e is None:
                    continue
                child, idx = e
                if g is not None:
                    # _validate_grad's common cases inlined: a gradient of the shape and dtype of the non-leaf output
                    # (or of the leaf, for an AccumulateGrad: the only node without output metadata) it flows into
                    meta = child._out_meta
                    gd = g._data
                    if meta is None:
                        vd = child.variable._data
                        if gd.shape != vd.shape or (gd.dtype is not vd.dtype and gd.dtype != vd.dtype):
                            g = _validate_grad(node, child, idx, g)
                    else:
                        m = meta[idx]
                        if m is None or gd.shape != m[0] or (gd.dtype is not m[1] and gd.dtype != m[1]):
                            g = _validate_grad(node, child, idx, g)
                    slot = buffers.get(child)
                    if slot is None:
                        if meta is None or len(meta) == 1:
                            buffers[child] = [g]
                        else:
                            add_grad(child, idx, g)
                    elif len(slot) == 1 and not create_graph:
                        # add_grad's accumulation into a one-output slot, inlined (the gradients of a tensor used
                        # several times: a leaf's, a residual stream's)
                        cur = slot[0]
                        if cur is None:
                            slot[0] = g
                        else:
                            flags = sums.get(child)
                            if flags is not None and flags[0]:  # a sum the engine made and holds only here
                                cd = cur._data
                                if cd.dtype == gd.dtype and cd.shape == gd.shape:
                                    _iadd(cd, gd)
                                else:
                                    slot[0] = cur + g
                            else:
                                slot[0] = cur + g
                                if flags is None:
                                    sums[child] = [True]
                                else:  # emptied by take_pending_grad, refilled since: the new sum is the engine's
                                    flags[0] = True
                    else:
                        add_grad(child, idx, g)
                d = deps[child] - 1
                deps[child] = d
                if d == 0:
                    if child in buffers:
                        ready.append(child)
                    else:  # nothing flowed into it: propagate "no gradient" through its subgraph
                        _skip(child, deps, buffers, ready)
            if not retain_graph:
                if type(node) is Node:  # Node.release, inlined
                    node._saved = None
                    node._freed = True
                    node.__dict__.clear()
                else:
                    node.release()
            del in_grads
            # these names must not keep the last gradient alive while later nodes run
            g = gd = slot = cur = cd = vd = None
        if outermost:
            while _callbacks:
                _callbacks.pop(0)()
    finally:
        _running = None
        state.enabled = prev
        _depth -= 1
        _retaining.pop()
        if outermost:
            _callbacks.clear()
    if inputs is not None:
        for k, r in enumerate(results):
            if r is None and not allow_unused:
                raise AutogradError(f"One of the differentiated tensors (input {k}) appears to not have been used "
                                    f"in the graph. Set allow_unused=True if this is the desired behavior.")
        return results
    return None


def _check_grad_count(node, in_grads, n_inputs):
    """A backward must return one gradient per forward input; extra trailing Nones are tolerated (as PyTorch)."""
    if len(in_grads) > n_inputs and all(g is None for g in in_grads[n_inputs:]):
        return
    raise AutogradError(f"function {node.name()} returned an incorrect number of gradients (expected {n_inputs}, got "
                        f"{len(in_grads)}): backward must return one gradient (or None) per forward input")


def _skip(node, deps, buffers, ready):
    stack = [node]
    while stack:
        n = stack.pop()
        for e in n.next_functions:
            if e is None:
                continue
            c = e[0]
            d = deps[c] - 1
            deps[c] = d
            if d == 0:
                if c in buffers:
                    ready.append(c)
                else:
                    stack.append(c)


def _validate_grad(node, child, idx, g):
    """The gradient flowing into `child` output `idx`: shape checked, and cast to that output's floating dtype when
    the backward rule returned another one (as PyTorch's engine does). Without the cast a bf16 activation could get an
    fp32 gradient (from an fp32 residual stream, say) and every matmul behind it would run in fp32."""
    meta = child._out_meta
    if isinstance(child, AccumulateGrad):
        v = child.variable
        expect, dt = v._data.shape, (None if v._f8 else v._data.dtype)
    elif meta is not None and meta[idx] is not None:
        expect, dt = meta[idx][0], meta[idx][1]
    else:
        return g
    if g._data.shape != expect:
        raise ShapeError(f"{node.name()} returned a gradient of shape {fmt_shape(g._data.shape)} for an input of "
                         f"shape {fmt_shape(expect)}")
    if dt is not None and g._data.dtype != dt and dt in _FLOAT_NP and g._data.dtype in _FLOAT_NP:
        from ..dtypes import dtype_of
        g = g.to(dtype_of(dt))
    return g


_function._engine = _sys.modules[__name__]  # Node's backward-time methods read the engine's state through it
