"""The tape: every differentiable op is a `Function`; applying it records one `Node` (which is also its `ctx`)."""
import weakref

import ml_dtypes as _ml
import numpy as _np

from .. import speedups
from ..errors import AutogradError, FlameError, ShapeError, fmt_shape
from .grad_mode import state

_engine = None  # flame_core.autograd.engine, set when it is imported (it imports this module): no per-call import

_FREED = ("Trying to backward through the graph a second time (or to access saved tensors after they were freed). "
          "Pass retain_graph=True to the first backward if you need to backward twice.")


class Node:
    """One recorded op. Holds edges to the nodes of its inputs, the tensors its backward needs, and its rule.

    `next_functions[i]` is `(node, output_index)` for input i, or None when input i needs no gradient.
    """

    __slots__ = ("next_functions", "needs_input_grad", "_saved", "_fn", "_out_meta", "_hooks", "_freed",
                 "_non_diff", "__dict__", "__weakref__")

    def __init__(self, fn=None):
        self._fn = fn
        self._saved = None
        self._hooks = None
        self._freed = False
        self._non_diff = None

    def name(self):
        return (self._fn.__name__ if self._fn is not None else type(self).__name__) + "Backward"

    def __repr__(self):
        return f"<{self.name()}>"

    # --- ctx API used inside Function.forward / backward ---
    def save_for_backward(self, *tensors):
        saved = []
        for t in tensors:  # a loop, not a comprehension: one frame fewer on every recorded op
            saved.append(None if t is None else (t, t._version[0], None))
        self._saved = saved

    @property
    def saved_tensors(self):
        if self._freed:
            raise AutogradError(_FREED)
        out = []
        for item in self._saved or ():
            if item is None:
                out.append(None)
                continue
            t, version, out_idx = item
            if t._version[0] != version:
                raise AutogradError(
                    f"one of the tensors needed for gradient computation has been modified by an in-place "
                    f"operation: a tensor of shape {tuple(t.shape)} and dtype {t.dtype} saved by {self.name()} is at "
                    f"version {t._version[0]}; expected version {version}. Use an out-of-place op (or .clone()).")
            if out_idx is not None:  # an output of this node: re-attach it to the graph for double backward
                t = t._alias()
                t._grad_fn, t._out_idx = self, out_idx
            out.append(t)
        return tuple(out)

    def saved_values(self):
        """`saved_tensors` for a backward rule that records nothing (grad mode off, a first-order backward): the same
        checks, but a saved output comes back as the detached alias it is stored as, without the new alias
        re-attached to this node that double backward needs (one tensor fewer per saved output)."""
        if self._freed:
            raise AutogradError(_FREED)
        out = []
        for item in self._saved or ():
            if item is None:
                out.append(None)
                continue
            t = item[0]
            if t._version[0] != item[1]:
                return self.saved_tensors  # raises the version error
            out.append(t)
        return out

    def take_pending_grad(self, i):
        """Inside this node's backward: the gradient another consumer already sent to input i (a residual
        connection's, say), taken out of the engine's slot so that the backward adds it into its own gradient for
        input i in the same pass; the engine then stores that gradient instead of adding the two. The backward MUST
        return a gradient for input i that includes it. None when nothing is waiting, outside the engine's walk, or
        under create_graph (where the sum must stay differentiable)."""
        found = self._pending_slot(i)
        if found is None:
            return None
        slot, child, idx, sums = found
        g, slot[idx] = slot[idx], None
        owned = sums.get(child)
        if owned is not None:
            owned[idx] = False
        return g

    def sub_from_pending_grad(self, i, g):
        """Inside this node's backward: subtract `g` from the gradient another consumer already sent to input i,
        in the engine's slot -- in place when that gradient is a sum the engine made and holds alone, else into a
        new sum the engine then holds -- instead of returning -g for the engine to add (one kernel and no negated
        copy, where the engine would negate and then add). True when done: the backward then returns None for
        input i. False (nothing changed) when nothing is waiting, outside the engine's walk, under create_graph, or
        when g's shape, dtype or array type differ from the waiting gradient's: the backward returns -g as usual.
        The slot's value is the same as the engine's `pending + (-g)` (a + (-b) == a - b in IEEE arithmetic)."""
        found = self._pending_slot(i)
        if found is None:
            return False
        slot, child, idx, sums = found
        p = slot[idx]
        pd, gd = p._data, g._data
        if type(pd) is not type(gd) or pd.shape != gd.shape or (pd.dtype is not gd.dtype and pd.dtype != gd.dtype):
            return False
        owned = sums.get(child)
        if owned is not None and owned[idx]:
            _engine._iadd(pd, gd, "sub")
            return True
        slot[idx] = _engine._sub(p, g)
        if owned is None:
            owned = sums[child] = [False] * len(slot)
        owned[idx] = True
        return True

    def grad_is_exclusive(self, g):
        """Inside this node's backward: whether the gradient `g` it was handed is held by nothing else, so that the
        backward may write its result into g's memory (engine.grad_is_exclusive says what is counted). Pass the
        argument itself, before making views of it."""
        return _engine is not None and _engine.grad_is_exclusive(self, g, frames=2)

    def pending_grad(self, i):
        """The gradient take_pending_grad(i) would take, left in place (to check its layout first)."""
        found = self._pending_slot(i)
        return None if found is None else found[0][found[2]]

    def _pending_slot(self, i):
        """(engine slot, child node, output index, the engine's sums flags) holding a gradient for input i, or None."""
        cur = _engine._running if _engine is not None else None
        if cur is None or cur[0] is not self:
            return None
        e = self.next_functions[i]
        slot = cur[1].get(e[0]) if e is not None else None
        if slot is None or slot[e[1]] is None:
            return None
        return slot, e[0], e[1], cur[2]

    def mark_non_differentiable(self, *tensors):
        self._non_diff = {id(t) for t in tensors}

    def mark_dirty(self, *tensors):  # accepted for PyTorch compatibility; FLAME records in-place ops itself
        pass

    def register_hook(self, hook, output_index=0):
        """Hook called with the gradient of output `output_index` before this node's backward."""
        if self._hooks is None:
            self._hooks = {}
        self._hooks.setdefault(output_index, []).append(hook)

    def release(self):
        self._saved = None
        self._freed = True
        self.__dict__.clear()


class AccumulateGrad(Node):
    """The sink of a leaf that requires grad: adds incoming gradients into `leaf.grad`."""

    __slots__ = ("variable",)

    def __init__(self, variable):
        super().__init__(None)
        self.variable = variable
        self.next_functions = ()
        self._out_meta = None

    def name(self):
        return "AccumulateGrad"

    def release(self):
        pass


def accumulator_of(t):
    """The (cached) AccumulateGrad node of a leaf tensor."""
    ref = t._accum_ref
    node = ref() if ref is not None else None
    if node is None:
        node = AccumulateGrad(t)
        t._accum_ref = weakref.ref(node)
    return node


def edge_of(t):
    """Where the gradient of tensor `t` must be sent: its grad_fn (and output index) or its accumulator."""
    fn = t._grad_fn
    if fn is not None:
        return (fn, t._out_idx)
    if t._requires_grad:
        return (accumulator_of(t), 0)
    return None


_FLOAT_NP = frozenset(_np.dtype(d) for d in (_np.float16, _np.float32, _np.float64, _ml.bfloat16, _ml.float8_e4m3fn))
_tensor_cls = [None]  # filled in by flame_core.tensor (avoids an import on every op)


def broadcast_error(op, args, cause):
    """A ShapeError naming the shapes of the tensors an op could not broadcast together."""
    Tensor = _tensor_cls[0]
    shapes = [fmt_shape(a.shape) for a in args if isinstance(a, Tensor)]
    listed = ", ".join(shapes[:-1]) + " and " + shapes[-1] if len(shapes) > 1 else "".join(shapes)
    return ShapeError(f"{op}: the shapes of its operands {listed} cannot be broadcast together ({cause})")


class FunctionMeta(type):
    pass


class Function(metaclass=FunctionMeta):
    """Custom differentiable op, PyTorch style: subclass with static `forward(ctx, ...)` and `backward(ctx, ...)`,
    call with `MyFn.apply(...)`. Built-in ops use exactly this mechanism."""

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError("a Function subclass must define forward(ctx, ...)")

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise NotImplementedError("a Function subclass must define backward(ctx, ...)")

    @classmethod
    def apply(cls, *args, **kwargs):
        # the per-op path of every op, in one frame: one pass over the arguments finds the edges (a tensor that
        # requires grad is exactly one with an edge); an op that records nothing (no_grad -- every op a backward rule
        # runs --, or no input requiring grad) gets a light ctx that keeps nothing, and a single Tensor output skips
        # the tuple bookkeeping. `cls` keeps its name: the memory profiler reads it from this frame.
        if not state.enabled:
            # grad mode is off: nothing to record and no mode to switch (a forward that switches it restores it)
            ctx = _new(_Ctx)
            ctx._fn = cls
            n = len(args)
            ctx.needs_input_grad = _NO_GRAD[n] if n < 8 else (False,) * n
            try:
                return cls.forward(ctx, *args, **kwargs)
            except ValueError as e:
                if isinstance(e, FlameError) or "broadcast" not in str(e):
                    raise
                raise broadcast_error(cls.__name__.lower(), args, e) from e
            finally:
                state.enabled = False
        Tensor = _tensor_cls[0]
        n = len(args)
        if 0 < n < 4:  # the common arities (unary, binary, binary + a scalar option): the edges without lists
            a = args[0]
            e0 = e1 = e2 = None
            if isinstance(a, Tensor):  # edge_of, inlined (as for each argument below)
                fn = a._grad_fn
                if fn is not None:
                    e0 = (fn, a._out_idx)
                elif a._requires_grad:
                    e0 = (accumulator_of(a), 0)
            if n > 1:
                a = args[1]
                if isinstance(a, Tensor):
                    fn = a._grad_fn
                    if fn is not None:
                        e1 = (fn, a._out_idx)
                    elif a._requires_grad:
                        e1 = (accumulator_of(a), 0)
                if n > 2:
                    a = args[2]
                    if isinstance(a, Tensor):
                        fn = a._grad_fn
                        if fn is not None:
                            e2 = (fn, a._out_idx)
                        elif a._requires_grad:
                            e2 = (accumulator_of(a), 0)
            record = e0 is not None or e1 is not None or e2 is not None
            if record:
                if n == 1:
                    edges, needs = (e0,), _NEEDS1
                elif n == 2:
                    edges, needs = (e0, e1), (e0 is not None, e1 is not None)
                else:
                    edges, needs = (e0, e1, e2), (e0 is not None, e1 is not None, e2 is not None)
        else:
            edges = []
            needs = []
            record = False
            for a in args:
                if isinstance(a, Tensor):
                    fn = a._grad_fn
                    if fn is not None:
                        edges.append((fn, a._out_idx))
                        needs.append(True)
                        record = True
                        continue
                    if a._requires_grad:
                        edges.append((accumulator_of(a), 0))
                        needs.append(True)
                        record = True
                        continue
                edges.append(None)
                needs.append(False)
            if record:
                edges, needs = tuple(edges), tuple(needs)
        if not record:
            ctx = _new(_Ctx)
            ctx._fn = cls
            ctx.needs_input_grad = _NO_GRAD[n] if n < 8 else (False,) * n
            state.enabled = False
            try:
                return cls.forward(ctx, *args, **kwargs)
            except ValueError as e:  # free when nothing is raised; NumPy/CuPy broadcast errors get the shapes named
                if isinstance(e, FlameError) or "broadcast" not in str(e):
                    raise
                raise broadcast_error(cls.__name__.lower(), args, e) from e
            finally:
                state.enabled = True
        # at least one input requires grad: run forward, record one Node (Node.__init__ inlined)
        node = _new(Node)
        node._fn = cls
        node._saved = node._hooks = node._non_diff = None
        node._freed = False
        node.next_functions = edges
        node.needs_input_grad = needs
        if state.anomaly:
            from .anomaly_mode import forward_stack
            node._forward_stack = forward_stack()
        state.enabled = False
        try:
            out = cls.forward(node, *args, **kwargs)
        except ValueError as e:
            if isinstance(e, FlameError) or "broadcast" not in str(e):
                raise
            raise broadcast_error(cls.__name__.lower(), args, e) from e
        finally:
            state.enabled = True
        if isinstance(out, tuple):
            return _record_outputs(node, out)
        if out is None:
            node._out_meta = [None]
            return out
        d = out._data
        dt = d.dtype
        # keep only shape/dtype/module of outputs for zero-filling missing gradients (not the arrays themselves)
        node._out_meta = [(d.shape, dt, type(d))]
        non_diff = node._non_diff
        if (non_diff is None or id(out) not in non_diff) and (dt in _FLOAT_NP or out._f8):
            out._grad_fn = node
            out._out_idx = 0
        saved = node._saved
        if saved:  # saved outputs are kept as detached aliases: no reference cycle output -> node -> output
            for k, item in enumerate(saved):
                if item is not None and item[0] is out:
                    saved[k] = (out._alias(), item[1], 0)
        return out


def _record_outputs(node, outs):
    """The recording of a Function whose forward returned a tuple of outputs."""
    non_diff = node._non_diff
    meta = []
    for i, o in enumerate(outs):
        if o is None:
            meta.append(None)
            continue
        d = o._data
        meta.append((d.shape, d.dtype, type(d)))
        if non_diff is not None and id(o) in non_diff:
            continue
        if d.dtype in _FLOAT_NP or o._f8:
            o._grad_fn = node
            o._out_idx = i
    saved = node._saved
    if saved:  # saved outputs are kept as detached aliases: no reference cycle output -> node -> output
        for k, item in enumerate(saved):
            if item is not None:
                for i, o in enumerate(outs):
                    if item[0] is o:
                        saved[k] = (o._alias(), item[1], i)
                        break
    node._out_meta = meta
    return outs


class _Ctx(Node):
    """The ctx of an op that records nothing (grad mode off, or no input requires grad): the ctx API of `Node`, but
    `save_for_backward` only keeps the tensors for `saved_tensors` within the forward (no version bookkeeping), and
    nothing refers to it once the forward returns."""

    __slots__ = ()

    def save_for_backward(self, *tensors):
        self._saved = tensors

    @property
    def saved_tensors(self):
        try:
            return tuple(self._saved)
        except AttributeError:
            return ()


_new = object.__new__
_NO_GRAD = tuple((False,) * n for n in range(8))
_NEEDS1 = (True,)


# ----------------------------------------------------------------------------- Function.apply in C
# flame_core/csrc/apply.c is `py_apply` without the interpreter; it reads this module's names (state, Node, _Ctx,
# _tensor_cls, _FLOAT_NP, accumulator_of, _record_outputs and the two helpers below) at each call. py_apply stays the
# specification and the fallback, and runs in the C apply's place while something reads the op from its frame (the
# memory profiler: `hold_python_apply`).
py_apply = Function.__dict__["apply"]  # the classmethod


def _forward_value_error(cls, args, e):
    """What the C apply raises for a ValueError from a forward: py_apply's except clause (a broadcast failure becomes
    a ShapeError naming the shapes, caused by it; anything else is raised as it is)."""
    if isinstance(e, FlameError) or "broadcast" not in str(e):
        return e
    err = broadcast_error(cls.__name__.lower(), args, e)
    err.__cause__ = e
    return err


def _anomaly_stack():
    """The C apply's forward stack under anomaly detection: this frame stands where py_apply's would."""
    from .anomaly_mode import forward_stack
    return forward_stack()


_py_apply_fn = py_apply.__func__  # what the C apply calls while held
_python_holds = [0]
_c = speedups.module
_c_apply = None
if _c is not None:
    _c.configure_apply(globals())
    _c_apply = classmethod(_c.apply)
    Function.apply = _c_apply


def hold_python_apply(on):
    """Run py_apply in the C apply's place while held (on=True) until the last hold is released (on=False):
    Function.apply is py_apply meanwhile, and the C apply reads the count at each call, so references bound before
    the hold (ops/__init__.py's) run py_apply too."""
    _python_holds[0] += 1 if on else -1
    if _c_apply is not None:
        Function.apply = py_apply if _python_holds[0] > 0 else _c_apply
