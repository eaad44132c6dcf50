"""autocast: output dtypes per op as documented (flame_core/amp/README.md), values against float64 references of
the rounded inputs, nesting / disabled regions / decorator, the weight-cast cache, custom_fwd/custom_bwd."""
import contextlib

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
from flame_core import amp
from flame_core.errors import DeviceError, DTypeError

LOW = [flame.bfloat16, flame.float16]


def _t(rng, *shape, dtype=flame.float32, device="cpu", requires_grad=False):
    return flame.tensor(rng.standard_normal(shape), dtype=dtype, device=device, requires_grad=requires_grad)


def _round(a, dt):
    """float64 copy of `a` rounded through dtype `dt` (what the op's inputs become under autocast)."""
    np_dt = ml_dtypes.bfloat16 if dt == flame.bfloat16 else np.float16
    return np.asarray(a, dtype=np.float64).astype(np_dt).astype(np.float64)


# op name -> (callable on fp32 tensors, number of inputs, input shapes)
LOWER_OPS = {
    "matmul": (lambda a, b: flame.matmul(a, b), [(3, 5, 8), (8, 4)]),
    "mm": (lambda a, b: flame.mm(a, b), [(5, 8), (8, 4)]),
    "bmm": (lambda a, b: flame.bmm(a, b), [(2, 5, 8), (2, 8, 4)]),
    "@": (lambda a, b: a @ b, [(5, 8), (8, 4)]),
    "einsum": (lambda a, b: flame.einsum("bij,jk->bik", a, b), [(2, 5, 8), (8, 4)]),
}
FP32_OPS = {
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: flame.log_softmax(x, 1),
    "sum": lambda x: x.sum(-1),
    "mean": lambda x: x.mean((0, 2)),
}
REF_FP32 = {
    "softmax": lambda a: np.exp(a - a.max(-1, keepdims=True)) / np.exp(a - a.max(-1, keepdims=True)).sum(-1,
                                                                                                    keepdims=True),
    "log_softmax": lambda a: a - a.max(1, keepdims=True) - np.log(np.exp(a - a.max(1, keepdims=True)).sum(
        1, keepdims=True)),
    "sum": lambda a: a.sum(-1),
    "mean": lambda a: a.mean((0, 2)),
}


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", list(LOWER_OPS))
def test_lower_precision_ops_run_in_the_autocast_dtype(device, name, low):
    fn, shapes = LOWER_OPS[name]
    rng = np.random.default_rng(0)
    xs = [_t(rng, *s, device=device) for s in shapes]
    with amp.autocast(device.type, dtype=low):
        y = fn(*xs)
    assert y.dtype == low
    ref = fn(*[flame.tensor(_round(x.numpy(), low), dtype=flame.float64, device=device) for x in xs]).numpy()
    tol = 8e-3 if low == flame.bfloat16 else 1e-3   # one rounding of the output to `low`
    np.testing.assert_allclose(y.float().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert fn(*xs).dtype == flame.float32            # outside the region: untouched


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", list(FP32_OPS))
def test_fp32_ops_run_in_float32(device, name, low):
    rng = np.random.default_rng(1)
    x = _t(rng, 3, 4, 7, dtype=low, device=device)
    with amp.autocast(device.type, dtype=low):
        y = FP32_OPS[name](x)
    assert y.dtype == flame.float32
    ref = REF_FP32[name](x.float().numpy().astype(np.float64))
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert FP32_OPS[name](x).dtype == low             # outside: the input dtype


def test_float64_integers_and_other_devices_are_left_alone(device):
    rng = np.random.default_rng(2)
    a64, b64 = _t(rng, 4, 4, dtype=flame.float64, device=device), _t(rng, 4, 4, dtype=flame.float64,
                                                                    device=device)
    i = flame.arange(12, device=device).reshape(3, 4)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        assert (a64 @ b64).dtype == flame.float64
        assert i.sum().dtype == flame.int64
        assert flame.softmax(a64, -1).dtype == flame.float64
    other = "cuda" if device.type == "cpu" else "cpu"
    a32 = _t(rng, 4, 4, device=device)
    no_gpu = other == "cuda" and not flame.cuda_is_available()
    with pytest.warns(UserWarning, match="sees no GPU") if no_gpu else contextlib.nullcontext():
        ctx = amp.autocast(other, dtype=flame.bfloat16)
    with ctx:
        assert amp.is_autocast_enabled(other) != no_gpu
        assert (a32 @ a32).dtype == flame.float32     # the region is for the other device type


def test_nesting_disabled_regions_and_state_restore(device):
    dt = device.type
    rng = np.random.default_rng(3)
    a = _t(rng, 4, 4, device=device)
    assert not amp.is_autocast_enabled(dt)
    with amp.autocast(dt, dtype=flame.bfloat16):
        assert amp.is_autocast_enabled(dt) and amp.get_autocast_dtype(dt) == flame.bfloat16
        assert (a @ a).dtype == flame.bfloat16
        with amp.autocast(dt, enabled=False):
            assert not amp.is_autocast_enabled(dt)
            assert (a @ a).dtype == flame.float32
            with amp.autocast(dt, dtype=flame.float16):
                assert (a @ a).dtype == flame.float16
            assert (a @ a).dtype == flame.float32
        assert (a @ a).dtype == flame.bfloat16
        with pytest.raises(ZeroDivisionError):
            with amp.autocast(dt, dtype=flame.float16):
                1 / 0
        assert amp.get_autocast_dtype(dt) == flame.bfloat16 and (a @ a).dtype == flame.bfloat16
    assert not amp.is_autocast_enabled(dt) and not amp.autocast_mode.active
    assert (a @ a).dtype == flame.float32


def test_decorator_and_recursion(device):
    dt = device.type
    rng = np.random.default_rng(4)
    a = _t(rng, 3, 3, device=device)

    @amp.autocast(dt, dtype=flame.bfloat16)
    def f(x, depth):
        y = x @ x
        return [y.dtype] + (f(x, depth - 1) if depth else [])
    assert f(a, 2) == [flame.bfloat16] * 3
    assert not amp.is_autocast_enabled(dt)
    assert (a @ a).dtype == flame.float32


def test_gradients_flow_back_in_the_leaf_dtype(device):
    rng = np.random.default_rng(5)
    x = _t(rng, 6, 8, device=device, requires_grad=True)
    w = _t(rng, 8, 5, device=device, requires_grad=True)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        loss = (x @ w).softmax(-1).log().mean()
    assert loss.dtype == flame.float32
    loss.backward()
    assert x.grad.dtype == flame.float32 and w.grad.dtype == flame.float32
    # float64 reference on the bf16-rounded operands: d mean(log softmax(xw)) / dw
    xr, wr = _round(x.detach().numpy(), flame.bfloat16), _round(w.detach().numpy(), flame.bfloat16)
    z = xr @ wr
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    gz = (1.0 - 5 * p) / z.size                      # d/dz of mean over all entries of (z - logsumexp(z))
    np.testing.assert_allclose(w.grad.numpy(), xr.T @ gz, rtol=3e-2, atol=3e-2 * np.abs(xr.T @ gz).max())
    np.testing.assert_allclose(x.grad.numpy(), gz @ wr.T, rtol=3e-2, atol=3e-2 * np.abs(gz @ wr.T).max())


def test_weight_cast_cache(device):
    rng = np.random.default_rng(6)
    w = _t(rng, 4, 4, device=device, requires_grad=True)
    act = _t(rng, 4, 4, device=device)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        (c1,) = amp.cast_inputs("lower", w)
        (c2,) = amp.cast_inputs("lower", w)
        assert c1 is c2                                  # a weight is cast once per region
        (a1,) = amp.cast_inputs("lower", act)
        (a2,) = amp.cast_inputs("lower", act)
        assert a1 is not a2                              # activations are not cached
        with flame.no_grad():
            (c3,) = amp.cast_inputs("lower", w)
        assert c3 is not c1 and c3.grad_fn is None and c1.grad_fn is not None
        with flame.no_grad():
            w.mul_(2.0)                                  # an in-place update invalidates the cached cast
        (c4,) = amp.cast_inputs("lower", w)
        assert c4 is not c1
        np.testing.assert_array_equal(c4.detach().float().numpy(), _round(w.detach().numpy(), flame.bfloat16))
        y = (act @ w).sum() + (act @ w).sum()            # the weight used twice: gradient is the sum
        y.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * np.tile(
        _round(act.numpy(), flame.bfloat16).sum(0)[:, None], (1, 4)), rtol=1e-2)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        (c5,) = amp.cast_inputs("lower", w)
    assert c5 is not c4                                  # cleared when the outermost region exits
    with amp.autocast(device.type, dtype=flame.bfloat16, cache_enabled=False):
        assert amp.cast_inputs("lower", w)[0] is not amp.cast_inputs("lower", w)[0]


def test_cast_inputs_categories_and_errors(device):
    rng = np.random.default_rng(7)
    h = _t(rng, 3, dtype=flame.bfloat16, device=device)
    f = _t(rng, 3, dtype=flame.float16, device=device)
    s = _t(rng, 3, device=device)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        out = amp.cast_inputs("promote", h, f, 2.0, None)
        assert [o.dtype for o in out[:2]] == [flame.float32, flame.float32] and out[2:] == (2.0, None)
        assert [o.dtype for o in amp.cast_inputs("fp32", h, s)] == [flame.float32, flame.float32]
        assert [o.dtype for o in amp.cast_inputs("lower", f, s)] == [flame.bfloat16, flame.bfloat16]
        with pytest.raises(ValueError, match="unknown autocast category"):
            amp.cast_inputs("fast", s)
    assert amp.cast_inputs("lower", s)[0] is s           # no region: untouched
    with pytest.raises(DTypeError, match="float32"):
        amp.autocast(device.type, dtype=flame.float32)
    with pytest.raises(DeviceError, match="'tpu'"):
        amp.autocast("tpu")
    assert amp.category_of("linear") == "lower" and amp.category_of("layer_norm") == "native"
    assert amp.category_of("relu") is None
    assert set(amp.LOWER_PRECISION_OPS).isdisjoint(amp.FP32_OPS)


def test_custom_fwd_bwd(device):
    class Square(flame.autograd.Function):
        @staticmethod
        @amp.custom_fwd(device_type=device.type, cast_inputs=flame.float32)
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.seen = (x.dtype, amp.is_autocast_enabled(device.type))
            return x * x

        @staticmethod
        @amp.custom_bwd(device_type=device.type)
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            assert not amp.is_autocast_enabled(device.type)   # backward sees forward's (disabled) state
            return 2.0 * x * g

    x = flame.tensor([1.5, -2.0], dtype=flame.bfloat16, device=device, requires_grad=True)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        y = Square.apply(x)
        seen = y.grad_fn.seen
    assert seen == (flame.float32, False)
    assert y.dtype == flame.float32
    y.sum().backward()
    assert x.grad.dtype == flame.bfloat16
    np.testing.assert_allclose(x.grad.float().numpy(), [3.0, -4.0])
