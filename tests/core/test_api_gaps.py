"""Fixes from the API audit: DeviceError without a GPU, randint(high, size), grad-mode decorators with and without
parentheses, ShapeError naming shapes on broadcast failures, a custom backward returning the wrong number of
gradients, float8 tensors being storage only."""

import numpy as np
import pytest

import flame_core as flame
from flame_core import backend
from flame_core.autograd import (
    Function,
    enable_grad,
    inference_mode,
    is_grad_enabled,
    is_inference_mode_enabled,
    no_grad,
    set_grad_enabled,
)
from flame_core.errors import AutogradError, DeviceError, DTypeError, ShapeError


# ----------------------------------------------------------------------------- devices
@pytest.mark.skipif(backend.cuda_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("make", [lambda: flame.ones(2).cuda(), lambda: flame.ones(2).cuda(1),
                                  lambda: flame.ones(2).to("cuda"), lambda: flame.ones(2).to("cuda:0"),
                                  lambda: flame.ones(2).to(flame.device("cuda"), flame.float16),
                                  lambda: flame.zeros(2, device="cuda"), lambda: flame.randn(2, device="cuda")])
def test_cuda_without_a_gpu_raises_device_error(make):
    with pytest.raises(DeviceError, match="does not see a GPU") as e:
        make()
    assert isinstance(e.value, RuntimeError)


# ----------------------------------------------------------------------------- randint
def test_randint_overloads():
    g1, g2 = flame.Generator().manual_seed(7), flame.Generator().manual_seed(7)
    a = flame.randint(10, (3, 4), generator=g1)
    b = flame.randint(0, 10, (3, 4), generator=g2)
    assert a.shape == (3, 4) and a.dtype == flame.int64
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    for t in (flame.randint(10, size=(50,)), flame.randint(high=10, size=(50,)), flame.randint(10, [50]),
              flame.randint(10, flame.Size([50]))):
        assert t.shape == (50,) and 0 <= int(t.min()) and int(t.max()) < 10
    t = flame.randint(5, 8, (200,), dtype=flame.int32)
    assert t.dtype == flame.int32 and set(np.unique(t.numpy())) <= {5, 6, 7}
    with pytest.raises(TypeError, match="size"):
        flame.randint(10)


# ----------------------------------------------------------------------------- grad-mode decorators
def test_grad_mode_decorators():
    @no_grad
    def bare(x):
        """doc"""
        return is_grad_enabled(), x * 2

    @no_grad()
    def called():
        return is_grad_enabled()

    @enable_grad
    def enabled():
        return is_grad_enabled()

    @enable_grad()
    def enabled_called():
        return is_grad_enabled()

    @set_grad_enabled(False)
    def disabled():
        return is_grad_enabled()

    @inference_mode
    def infer_bare():
        return is_grad_enabled(), is_inference_mode_enabled()

    @inference_mode()
    def infer_called():
        return is_grad_enabled(), is_inference_mode_enabled()

    @inference_mode(False)
    def infer_off():
        return is_grad_enabled(), is_inference_mode_enabled()

    assert is_grad_enabled()
    x = flame.ones(2, requires_grad=True)
    flag, y = bare(x)
    assert flag is False and not y.requires_grad
    assert bare.__name__ == "bare" and bare.__doc__ == "doc"
    assert called() is False and disabled() is False
    assert infer_bare() == (False, True) and infer_called() == (False, True) and infer_off() == (True, False)
    assert is_grad_enabled() and not is_inference_mode_enabled()  # nothing leaked out of the decorated calls
    with no_grad():
        assert enabled() is True and enabled_called() is True
        assert not is_grad_enabled()
    with set_grad_enabled(mode=False):
        assert not is_grad_enabled()
    assert is_grad_enabled()


def test_grad_mode_decorator_restores_the_mode_after_an_exception():
    @no_grad
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        boom()
    assert is_grad_enabled()
    with pytest.raises(TypeError, match="decorator"):
        no_grad()(3)


# ----------------------------------------------------------------------------- broadcast errors name the shapes
def _mask(*shape):
    return flame.ones(*shape, dtype=flame.bool)


BROADCAST = {
    "add": lambda: flame.ones(2, 3) + flame.ones(4),
    "add_grad": lambda: flame.ones(2, 3, requires_grad=True) + flame.ones(4),
    "sub": lambda: flame.ones(2, 3) - flame.ones(4),
    "mul": lambda: flame.ones(2, 3) * flame.ones(4),
    "div": lambda: flame.ones(2, 3) / flame.ones(4),
    "pow": lambda: flame.ones(2, 3) ** flame.ones(4),
    "maximum": lambda: flame.maximum(flame.ones(2, 3), flame.ones(4)),
    "remainder": lambda: flame.ones(2, 3) % flame.ones(4),
    "fmod": lambda: flame.fmod(flame.ones(2, 3), flame.ones(4)),
    "eq": lambda: flame.ones(2, 3) == flame.ones(4),
    "lt": lambda: flame.ones(2, 3) < flame.ones(4),
    "logical_and": lambda: flame.logical_and(_mask(2, 3), _mask(4)),
    "where": lambda: flame.where(_mask(2), flame.ones(3), flame.ones(2)),
    "masked_fill": lambda: flame.ones(2, 3).masked_fill(_mask(4), 0.0),
    "einsum": lambda: flame.einsum("ij,jk->ik", flame.ones(2, 3), flame.ones(4, 5)),
    "inplace": lambda: flame.ones(2, 3).add_(flame.ones(4)),
}


@pytest.mark.parametrize("name", sorted(BROADCAST))
def test_broadcast_mismatch_is_a_shape_error_naming_the_shapes(name):
    with pytest.raises(ShapeError) as e:
        BROADCAST[name]()
    msg = str(e.value)
    assert "(2, 3)" in msg or "(2,)" in msg
    assert "(4,)" in msg or "(3,)" in msg or "(4, 5)" in msg


@pytest.mark.parametrize("requires_grad", [False, True])
def test_setitem_shape_mismatch_names_the_shapes(requires_grad):
    x = flame.ones(3, requires_grad=True) * 1 if requires_grad else flame.ones(3)
    with pytest.raises(ShapeError, match=r"value of shape \(2,\).*region of shape \(3,\)"):
        x[:] = flame.ones(2)
    y = flame.zeros(2, 3)
    with pytest.raises(ShapeError, match=r"\(4,\).*\(2, 3\)"):
        y[...] = flame.ones(4)


# ----------------------------------------------------------------------------- custom Function gradient count
class _Returns(Function):
    @staticmethod
    def forward(ctx, x, extra):
        ctx.extra = extra
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return ctx.extra(g)


@pytest.mark.parametrize("extra, ok", [(lambda g: (g * 2, None), True),
                                       (lambda g: (g * 2, None, None), True),  # trailing Nones: tolerated
                                       (lambda g: (g * 2, None, g), False),  # one gradient too many
                                       (lambda g: (g * 2,), False)])  # one too few
def test_backward_must_return_one_gradient_per_input(extra, ok):
    x = flame.ones(3, requires_grad=True)
    y = _Returns.apply(x, extra).sum()
    if ok:
        y.backward()
        np.testing.assert_array_equal(x.grad.numpy(), [2, 2, 2])
    else:
        with pytest.raises(AutogradError, match=r"incorrect number of gradients \(expected 2, got \d\)"):
            y.backward()


# ----------------------------------------------------------------------------- float8 is storage only
def _f8():
    return flame.tensor([1.0, -2.0, 0.5]).to(flame.float8_e4m3fn)


FP8_OPS = {
    "add_scalar": lambda f: f + 1, "radd": lambda f: 1.0 + f, "mul": lambda f: f * f,
    "mixed": lambda f: flame.ones(3, dtype=flame.bfloat16) + f, "div": lambda f: f / 2, "neg": lambda f: -f,
    "exp": lambda f: f.exp(), "gelu": lambda f: f.gelu(), "clamp": lambda f: f.clamp(-1, 1),
    "eq": lambda f: f == f, "where": lambda f: flame.where(_mask(3), f, f), "sum": lambda f: f.sum(),
    "mean": lambda f: f.mean(), "amax": lambda f: f.amax(), "max_dim": lambda f: f.max(0),
    "argmax": lambda f: f.argmax(), "prod": lambda f: f.prod(), "cumsum": lambda f: f.cumsum(0),
    "softmax": lambda f: f.softmax(-1), "inplace": lambda f: f.add_(1),
    "cat_mixed": lambda f: flame.cat([f, flame.ones(3, device=f.device)]),
}


@pytest.mark.parametrize("name", sorted(FP8_OPS))
def test_float8_arithmetic_raises_the_storage_only_error(name):
    with pytest.raises(DTypeError, match="float8_e4m3fn tensors are storage only"):
        FP8_OPS[name](_f8())


def test_float8_conversion_and_storage_ops_still_work():
    f = _f8()
    np.testing.assert_array_equal(f.float().numpy(), [1.0, -2.0, 0.5])
    assert f.clone().dtype == flame.float8_e4m3fn and f.reshape(3, 1).shape == (3, 1)
    assert f[1:].float().tolist() == [-2.0, 0.5]
    assert flame.cat([f, f]).dtype == flame.float8_e4m3fn and flame.stack([f, f]).dtype == flame.float8_e4m3fn
    np.testing.assert_array_equal(flame.cat([f, f]).float().numpy(), [1.0, -2.0, 0.5] * 2)
    x = flame.ones(3, requires_grad=True)
    y = x.to(flame.float8_e4m3fn)  # a differentiable conversion (as PyTorch)
    y.float().sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [1, 1, 1])


def test_float8_cannot_require_grad():
    with pytest.raises(AutogradError, match="float8"):
        _f8().requires_grad_()
    with pytest.raises(AutogradError, match="float8"):
        flame.tensor([1.0], dtype=flame.float8_e4m3fn, requires_grad=True)
    assert not _f8().requires_grad_(False).requires_grad


def test_zero_and_fill_on_a_tensor_with_history_give_zero_gradients_behind_them():
    a = flame.ones(3, requires_grad=True)
    b = a * 1
    b.zero_()
    (b + a).sum().backward()                 # PyTorch: the zeroed path contributes 0, the direct one 1
    np.testing.assert_array_equal(a.grad.numpy(), [1, 1, 1])
    a = flame.ones(3, requires_grad=True)
    b = a * 2
    b.fill_(5.0)
    (b * a).sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), [5, 5, 5])


def test_float8_matmul_and_einsum_are_refused():
    import ml_dtypes
    x = flame.tensor(np.ones((2, 2), dtype=ml_dtypes.float8_e4m3fn))
    with pytest.raises(Exception, match="float8|fp8"):
        x @ x
    with pytest.raises(Exception, match="float8|fp8"):
        flame.einsum("ij,jk->ik", x, x)
