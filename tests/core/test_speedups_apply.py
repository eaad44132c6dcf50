"""Function.apply in C (flame_core/csrc/apply.c) against its specification, py_apply (flame_core/autograd/function.py):
each case runs under both and must record the same graph, give the same values and gradients, raise the same errors
and leave grad mode as it found it. The whole suite runs with the C apply where it is built; `.ci/run` reruns
tests/core with FLAME_SPEEDUPS=0 for the Python one."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import autograd, speedups
from flame_core.autograd import function
from flame_core.autograd.function import Function
from flame_core.errors import ShapeError

IMPLS = ["python", pytest.param("c", marks=pytest.mark.skipif(speedups.module is None, reason="flame_core._speedups "
                                                               "is not built (no C compiler at install)"))]


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    c = request.param == "c"
    monkeypatch.setattr(Function, "apply", classmethod(speedups.module.apply) if c else function.py_apply)
    return request.param


class Scale(Function):  # kwargs, a non-tensor argument, a saved input
    @staticmethod
    def forward(ctx, x, s, *, shift=0.0):
        ctx.save_for_backward(x)
        ctx.s = s
        assert not flame.is_grad_enabled()
        return x.detach() * s + shift

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        assert x is not None
        return g * ctx.s, None


class TanhSaved(Function):  # saves its own output: kept as a detached alias
    @staticmethod
    def forward(ctx, x):
        y = x.detach().tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class Split(Function):  # a tuple of outputs, one marked non-differentiable
    @staticmethod
    def forward(ctx, x):
        a, b = x.detach() * 2.0, (x.detach() > 0).float()
        ctx.mark_non_differentiable(b)
        return a, b

    @staticmethod
    def backward(ctx, ga, gb):
        return ga * 2.0


class NonDiff(Function):  # a single output marked non-differentiable
    @staticmethod
    def forward(ctx, x):
        y = x.detach() + 1.0
        ctx.mark_non_differentiable(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


class Nothing(Function):
    @staticmethod
    def forward(ctx, x):
        return None

    @staticmethod
    def backward(ctx, g):
        return g


class Broadcasts(Function):
    @staticmethod
    def forward(ctx, a, b):
        return flame.tensor(np.add(a.detach().numpy(), b.detach().numpy()))  # NumPy's own broadcast ValueError

    @staticmethod
    def backward(ctx, g):
        return g, g


class Fails(Function):
    @staticmethod
    def forward(ctx, x, exc):
        raise exc

    @staticmethod
    def backward(ctx, g):
        return g, None


class IntOut(Function):
    @staticmethod
    def forward(ctx, x):
        return x.detach().long()

    @staticmethod
    def backward(ctx, g):
        return g


def test_recorded_op_graph_values_and_gradients(impl):
    x = flame.tensor([0.5, -1.0, 2.0], requires_grad=True, device="cpu")
    y = Scale.apply(x, 3.0, shift=1.0)
    assert type(y.grad_fn) is function.Node and y.grad_fn._fn is Scale
    assert y.grad_fn.needs_input_grad == (True, False)
    assert y.grad_fn.next_functions[1] is None and y.grad_fn.next_functions[0][1] == 0
    assert y.grad_fn._out_meta == [((3,), np.dtype(np.float32), np.ndarray)]
    np.testing.assert_allclose(y.detach().numpy(), [2.5, -2.0, 7.0])
    z = TanhSaved.apply(y)
    assert z.grad_fn._saved[0][0] is not z and z.grad_fn._saved[0][2] == 0  # the alias, output index 0
    z.sum().backward()
    want = 3.0 * (1 - np.tanh([2.5, -2.0, 7.0]) ** 2)
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-7)
    assert flame.is_grad_enabled()


def test_unrecorded_paths_and_grad_mode(impl):
    x = flame.tensor([1.0, 2.0], device="cpu")
    y = Scale.apply(x, 2.0)  # no input requires grad
    assert y.grad_fn is None and flame.is_grad_enabled()
    xr = x.clone().requires_grad_()
    with flame.no_grad():
        y = Scale.apply(xr, 2.0)
        assert y.grad_fn is None and not flame.is_grad_enabled()
    assert flame.is_grad_enabled()
    assert Nothing.apply(xr) is None


def test_tuple_outputs_non_differentiable_and_integer_outputs(impl):
    x = flame.tensor([1.0, -2.0], requires_grad=True, device="cpu")
    a, b = Split.apply(x)
    assert a.grad_fn is not None and a._out_idx == 0 and b.grad_fn is None
    assert NonDiff.apply(x).grad_fn is None
    n = IntOut.apply(x)
    assert n.grad_fn is None
    a.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0])


def test_errors_and_grad_mode_after_them(impl):
    a = flame.ones(3, requires_grad=True, device="cpu")
    b = flame.ones(4, device="cpu")
    with pytest.raises(ShapeError, match=r"broadcasts: the shapes of its operands \(3,\) and \(4,\)") as info:
        Broadcasts.apply(a, b)
    assert isinstance(info.value.__cause__, ValueError)
    assert flame.is_grad_enabled()
    with pytest.raises(ValueError, match="plain"):
        Fails.apply(a, ValueError("plain"))
    with pytest.raises(KeyError):
        Fails.apply(a, KeyError("k"))
    assert flame.is_grad_enabled()
    with flame.no_grad():
        with pytest.raises(RuntimeError):
            Fails.apply(a, RuntimeError("r"))
        assert not flame.is_grad_enabled()
    assert flame.is_grad_enabled()


def test_anomaly_mode_keeps_the_callers_stack(impl):
    x = flame.ones(2, requires_grad=True, device="cpu")
    with autograd.detect_anomaly():
        y = Scale.apply(x, 2.0)
    stack = y.grad_fn._forward_stack
    assert "test_anomaly_mode_keeps_the_callers_stack" in stack.splitlines()[-2]  # the caller's line, last
    assert "forward_stack" not in stack and "_anomaly_stack" not in stack


def test_the_memory_profiler_holds_the_python_apply(monkeypatch):
    """While a MemoryProfiler is open, every call of the C apply (a bound reference from before it opened too) runs
    py_apply, whose frame names the op."""
    import inspect

    from flame_core.memory.profiler import MemoryProfiler
    seen = []

    class Probe(Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(any(f.frame.f_code is function._py_apply_fn.__code__ for f in inspect.stack()))
            return x.detach() * 2.0

    bound = Probe.apply  # bound before the hold
    x = flame.ones(2, requires_grad=True, device="cpu")
    bound(x)
    with MemoryProfiler(device="cpu"):
        bound(x)
        Probe.apply(x)
    bound(x)
    assert function._python_holds == [0]
    assert seen == ([False, True, True, False] if speedups.module is not None else [True] * 4)


def test_loading_the_extension(monkeypatch):
    """FLAME_SPEEDUPS=0 chooses the Python versions; an extension that is not built is no error; one that is built
    but does not load is None with the reason kept in speedups.error."""
    import importlib

    monkeypatch.setattr(speedups, "error", None)
    monkeypatch.setenv("FLAME_SPEEDUPS", "0")
    assert speedups._load() is None and speedups.error is None
    monkeypatch.delenv("FLAME_SPEEDUPS")

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert speedups._load() is None and speedups.error is None

    def broken(name):
        raise ImportError("undefined symbol: PyFoo")

    monkeypatch.setattr(importlib, "import_module", broken)
    assert speedups._load() is None and "undefined symbol: PyFoo" in speedups.error
