"""The eager per-op fast paths (issue 48) keep the checks and results of the general paths they skip: linear's and
layer_norm's argument checks on the arrays, reshape's size inference, the lazily settled cpu storage accounting, and
the one-frame Function.apply."""
import gc

import numpy as np
import pytest

import flame_core as flame
import flame_core.memory as M
import flame_nn.functional as F
from flame_core.errors import DTypeError, ShapeError


def test_linear_fast_path_matches_the_composed_result():
    x = flame.randn(2, 3, 4)
    w, b = flame.randn(5, 4), flame.randn(5)
    want = x.numpy() @ w.numpy().T + b.numpy()
    np.testing.assert_allclose(F.linear(x, w, b).numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(F.linear(x, w).numpy(), x.numpy() @ w.numpy().T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad, err", [
    (lambda: F.linear(flame.randn(2, 4), flame.randn(5, 3)), ShapeError),
    (lambda: F.linear(flame.randn(2, 4), flame.randn(5, 4), flame.randn(4)), ShapeError),
    (lambda: F.linear(flame.randn(2, 4), flame.randn(5, 4), flame.randn(5, dtype=flame.float64)), DTypeError),
    (lambda: F.linear(flame.randn(2, 4, dtype=flame.float64), flame.randn(5, 4)), DTypeError),
    (lambda: F.linear(flame.ones(2, 4, dtype=flame.int64), flame.ones(5, 4, dtype=flame.int64)), DTypeError),
    (lambda: F.linear(flame.randn(()), flame.randn(5, 4)), ShapeError),
])
def test_linear_checks_still_raise(bad, err):
    with pytest.raises(err):
        bad()


def test_layer_norm_fast_path_and_its_checks():
    x = flame.randn(3, 6)
    w, b = flame.randn(6), flame.randn(6)
    xn = x.numpy()
    mu, var = xn.mean(-1, keepdims=True), xn.var(-1, keepdims=True)
    want = (xn - mu) / np.sqrt(var + 1e-5) * w.numpy() + b.numpy()
    np.testing.assert_allclose(F.layer_norm(x, (6,), w, b).numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(F.layer_norm(x, 6, w, b).numpy(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError):
        F.layer_norm(x, (6,), flame.randn(5), b)
    with pytest.raises(ShapeError):
        F.layer_norm(x, (5,), flame.randn(5), flame.randn(5))


def test_reshape_sizes():
    x = flame.arange(24)
    assert tuple(x.reshape(2, 3, 4).shape) == (2, 3, 4)
    assert tuple(x.reshape((4, -1)).shape) == (4, 6)
    assert tuple(x.reshape(np.int64(6), 4).shape) == (6, 4)
    with pytest.raises(ShapeError):
        x.reshape(5, 5)
    with pytest.raises(ShapeError):
        x.reshape(-1, -1)


def test_cpu_accounting_settles_deaths_before_any_read():
    flame.manual_seed(0)
    gc.collect()   # cpu tensors in reference cycles of earlier tests die at the collect below, not in the base
    base = M.memory_allocated("cpu")
    t = flame.randn(1000, device="cpu")  # 4000 bytes of cpu storage (the default device may be cuda)
    assert M.memory_allocated("cpu") == base + 4000
    peak = M.max_memory_allocated("cpu")
    del t
    gc.collect()
    assert M.memory_allocated("cpu") == base  # the death is accounted at the read, not at the next birth
    assert M.max_memory_allocated("cpu") == peak
    u = flame.randn(1000, device="cpu")
    assert M.memory_allocated("cpu") == base + 4000
    del u


def test_a_recorded_op_and_its_backward_through_one_frame_apply():
    x = flame.randn(4, requires_grad=True)
    y = ((x * 2.0 + 1.0).tanh() - x).sum()
    y.backward()
    xn = x.detach().numpy()
    want = 2.0 * (1 - np.tanh(xn * 2 + 1) ** 2) - 1
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert y.grad_fn is not None and x.grad_fn is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,dim,keepdim", [((8, 16, 32), -1, True), ((8, 16, 32), (0, 2), False),
                                               ((5, 7), None, False), ((300, 300), 0, False), ((3,), 0, True)])
def test_cuda_mean_is_the_float32_sum_times_the_reciprocal(dtype, shape, dim, keepdim):
    """mean on cuda (float32 / half types): PyTorch's arithmetic -- the float32 sum times float32(1 / n), rounded
    once to the dtype -- through the small-array scalar kernel or CuPy's multiply; the gradient is g / n spread."""
    import ml_dtypes
    rng = np.random.default_rng(11)
    host = rng.standard_normal(shape).astype(np.float32)
    dt = getattr(flame, dtype)
    x = flame.tensor(host, device="cuda").to(dt).requires_grad_(True)
    y = x.mean(dim, keepdim=keepdim)
    xs = x.detach().to(flame.float32).cpu().numpy()
    axes = None if dim is None else dim
    n = xs.size if dim is None else int(np.prod([shape[d] for d in ((dim,) if isinstance(dim, int) else dim)]))
    s32 = flame.tensor(xs, device="cuda").sum(axes, keepdim=keepdim).cpu().numpy()
    want = (s32 * np.float32(1.0 / n)).astype(np.float32)
    npdt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    got = y.detach().cpu().numpy()
    assert got.dtype == np.dtype(npdt)
    if dtype == "float32":   # the same sum of the same array: bit for bit
        np.testing.assert_array_equal(got, want)
    else:   # summed from the half type by CuPy (its reduction may order the sum differently): one rounding apart
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.to(flame.float32).cpu().numpy(), np.full(shape, 1.0 / n, np.float32),
                               rtol=1e-2 if dtype != "float32" else 1e-6)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_numpy_norm_reference_is_the_plain_formula(rms, dtype):
    """The CPU norm path (in place, row means as add.reduce / n) gives the plain out-of-place formula's bits."""
    import ml_dtypes

    from flame_core.kernels import loader as L
    from flame_core.kernels import norms as N
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(dt) for s in ((4, 6, 33), (33,), (33,)))
    cd = L.compute_dtype(x.dtype)
    xf = x.astype(cd)
    mean = None if rms else xf.mean(axis=-1, keepdims=True)
    xc = xf if rms else xf - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + cd(1e-5))
    want = ((xc * rstd * w.astype(cd) + b.astype(cd)).astype(x.dtype), None if rms else mean[..., 0], rstd[..., 0])
    got = N._layer_ref(x, w, b, 1e-5, rms)
    for g, v in zip(got, want):
        if v is None:
            assert g is None
            continue
        assert g.dtype == v.dtype and np.array_equal(g.view(np.uint8), v.view(np.uint8))
