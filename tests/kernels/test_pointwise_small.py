"""The small-array pointwise fast path (cuda_src/pointwise_small.cu, flame_core/kernels/pointwise_small.py) against
CuPy's ufuncs and the pointwise_grad.cu rules, and a Tensor-level op chain against the reference path."""
import numpy as np
import pytest
from kernel_utils import DTYPES, TOL, rand

import flame_core as flame
from flame_core import backend, speedups
from flame_core.kernels import launching, loader, plans
from flame_core.kernels import pointwise_small as PS

SIZES = (1, 7, 1000, 65536)
MANT = {"float32": 23, "float16": 10, "bfloat16": 7}
MIN_EXP = {"float32": -126, "float16": -14, "bfloat16": -126}


@pytest.fixture(autouse=True, params=["python", pytest.param("c", marks=pytest.mark.skipif(
    speedups.module is None, reason="flame_core._speedups is not built (no C compiler at install)"))])
def impl(request, monkeypatch):
    """Every test under both implementations of the entry points: the Python functions and their C versions
    (flame_core/csrc/pointwise.c, the default where built), wherever the ops call them (PS.fast_*)."""
    for name in ("fast_scalar", "fast_binary", "fast_unary", "fast_grad"):
        fn = getattr(speedups.module, name) if request.param == "c" else getattr(PS, "py_" + name)
        monkeypatch.setattr(PS, name, fn)
    return request.param


def _np(a):
    return backend.to_numpy(a)


def assert_ulps(got, want, dtype_name, ulps=1, what=""):
    """|got - want| <= ulps units in the last place of want's dtype (NaN where NaN, infinities equal)."""
    g, w = _np(got).astype(np.float64), _np(want).astype(np.float64)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    assert np.array_equal(np.isnan(g), np.isnan(w)), what
    fin = np.isfinite(w)
    assert np.array_equal(g[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)]), what
    e = np.floor(np.log2(np.maximum(np.abs(w[fin]), 2.0 ** MIN_EXP[dtype_name])))
    ulp = 2.0 ** (np.maximum(e, MIN_EXP[dtype_name]) - MANT[dtype_name])
    err = np.abs(g[fin] - w[fin])
    assert np.all(err <= ulps * ulp), f"{what}: max error {(err / ulp).max():.2f} ulp"


def assert_bits(got, want, what=""):
    g, w = _np(got), _np(want)
    assert g.dtype == w.dtype and g.shape == w.shape, what
    assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"{what}: not bit-identical"


def _check(got, want, dtype_name, exact, what):
    if exact and dtype_name == "float32":
        assert_bits(got, want, what)
    else:
        assert_ulps(got, want, dtype_name, 1, what)


def _twice(fn):
    """fn() twice: the first may build the launch, the second must reuse it (no new cache entry), both launch."""
    first = fn()
    n_cached = PS.cached_launches()
    before = launching.launches
    second = fn()
    assert launching.launches == before + 1, "the second call did not launch a kernel"
    assert PS.cached_launches() == n_cached, "the second call built a new launch"
    assert first is not None and second is not None
    assert np.array_equal(_np(first).view(np.uint8), _np(second).view(np.uint8))
    return second


# ----------------------------------------------------------------------------- GPU: each op against CuPy
_SREF = {"mul": lambda x, s: x * s, "add": lambda x, s: x + s, "sub": lambda x, s: x - s, "rsub": lambda x, s: s - x}
# the reference: x and the scalar in float32, one rounding of the result to x's dtype (PyTorch's arithmetic for a
# half-precision tensor and a Python scalar; CuPy alone would return float32 for bfloat16)
SCALAR_REF = {op: (lambda f: lambda x, s: f(x.astype(np.float32), np.float32(s)).astype(x.dtype))(f)
              for op, f in _SREF.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(SCALAR_REF))
def test_scalar_ops_match_cupy(op, dtype):
    cp = backend.cupy
    rng = np.random.default_rng(0)
    for n in SIZES:
        x = cp.asarray(rand(rng, (n,), DTYPES[dtype], scale=3.0))
        for s in (1.01, 0.5, -3, 1e-3):
            got = _twice(lambda: PS.fast_scalar(op, x, s))
            want = SCALAR_REF[op](x, s)
            assert got.dtype == want.dtype == x.dtype and got.shape == x.shape
            _check(got, want, dtype, True, f"{op} {dtype} n={n} s={s}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_scalar_zero_keeps_its_sign(dtype):
    cp = backend.cupy
    x = cp.asarray(np.array([1.0, -2.0, 0.0], dtype=DTYPES[dtype]))
    assert_bits(PS.fast_scalar("mul", x, 0.0), SCALAR_REF["mul"](x, 0.0))
    assert_bits(PS.fast_scalar("mul", x, -0.0), SCALAR_REF["mul"](x, -0.0))


BINARY_REF = {"mul": lambda a, b: a * b, "add": lambda a, b: a + b, "sub": lambda a, b: a - b}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(BINARY_REF))
def test_binary_ops_match_cupy(op, dtype):
    cp = backend.cupy
    rng = np.random.default_rng(1)
    for n in SIZES:
        shape = (n,) if n < 1000 else (n // 8, 8)
        a = cp.asarray(rand(rng, shape, DTYPES[dtype], scale=2.0))
        b = cp.asarray(rand(rng, shape, DTYPES[dtype], scale=2.0))
        got = _twice(lambda: PS.fast_binary(op, a, b))
        _check(got, BINARY_REF[op](a, b), dtype, True, f"{op} {dtype} n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_binary_add_in_place(dtype):
    cp = backend.cupy
    rng = np.random.default_rng(2)
    for n in SIZES:
        a = cp.asarray(rand(rng, (n,), DTYPES[dtype]))
        b = cp.asarray(rand(rng, (n,), DTYPES[dtype]))
        want = a + b
        ptr = a.data.ptr
        r = PS.fast_binary("add", a, b, a)
        assert r is a and a.data.ptr == ptr
        _check(a, want, dtype, True, f"in-place add {dtype} n={n}")


UNARY_REF = {"neg": lambda x: -x,
             "tanh": lambda x: backend.cupy.tanh(x.astype(np.float32)).astype(x.dtype)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(UNARY_REF))
def test_unary_ops_match_cupy(op, dtype):
    cp = backend.cupy
    rng = np.random.default_rng(3)
    for n in SIZES:
        x = cp.asarray(rand(rng, (n,), DTYPES[dtype], scale=2.0))
        got = _twice(lambda: PS.fast_unary(op, x))
        _check(got, UNARY_REF[op](x), dtype, op == "neg", f"{op} {dtype} n={n}")


GRAD_REF = {"tanh_bwd": lambda g, v: g * (1 - v * v), "sigmoid_bwd": lambda g, v: g * v * (1 - v),
            "relu_bwd": lambda g, v: np.where(v > 0, g, 0.0), "sqrt_bwd": lambda g, v: g * 0.5 / v,
            "rsqrt_bwd": lambda g, v: -0.5 * g * v ** 3, "abs_bwd": lambda g, v: g * np.sign(v)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kernel", sorted(GRAD_REF))
def test_grad_rules_match_pointwise_grad(kernel, dtype):
    """The packed launch of cuda_src/pointwise_grad.cu's kernel: bit for bit the result of its usual launch, and
    float64 math within the dtype's tolerance."""
    cp = backend.cupy
    rng = np.random.default_rng(4)
    for n in SIZES:
        g = cp.asarray(rand(rng, (n,), DTYPES[dtype]))
        s = rand(rng, (n,), np.float64)
        s = np.abs(s) + 0.1 if kernel in ("sqrt_bwd", "rsqrt_bwd") else np.tanh(s)
        s = cp.asarray(s.astype(DTYPES[dtype]))
        got = _twice(lambda: PS.fast_grad(kernel, g, s))
        big = cp.empty_like(g)
        launching.launch(loader.get_function("pointwise_grad", kernel, g.dtype), (plans.cdiv(n, 256),), (256,),
                      (g, s, big, np.int64(n)))
        assert_bits(got, big, f"{kernel} {dtype} n={n} vs the usual launch")
        want = GRAD_REF[kernel](_np(g).astype(np.float64), _np(s).astype(np.float64))
        rtol, atol = TOL[dtype]
        np.testing.assert_allclose(_np(got).astype(np.float64), want, rtol=rtol * 4,
                                   atol=atol * max(1.0, np.abs(want).max()))
    assert PS.fast_grad("no_such_rule", g, s) is None


@pytest.mark.gpu
def test_not_applicable_on_gpu():
    cp = backend.cupy
    x = cp.ones((8, 8), dtype=np.float32)
    assert PS.fast_scalar("mul", x.T, 2.0) is None                                  # not C-contiguous
    assert PS.fast_scalar("mul", cp.ones(PS.MAX_NUMEL + 1, np.float32), 2.0) is None  # too big
    assert PS.fast_scalar("mul", cp.ones(4, np.float64), 2.0) is None                # float64
    assert PS.fast_scalar("mul", cp.ones(4, np.int32), 2) is None                    # int
    assert PS.fast_scalar("mul", x, np.float32(2)) is None                           # not a Python scalar
    assert PS.fast_scalar("mul", cp.ones(4, np.float16), 1e39) is None               # scalar beyond float32
    assert bool(cp.isinf(PS.fast_scalar("mul", cp.ones(4, np.float16), 1e6)).all())  # result overflows fp16
    assert PS.fast_binary("add", x, x[:4]) is None                                   # shapes differ
    assert PS.fast_binary("add", x, x.astype(np.float16)) is None                    # dtypes differ
    assert PS.fast_binary("add", x, x, cp.empty((8, 8), np.float16)) is None         # out of another dtype
    assert PS.fast_grad("tanh_bwd", x, x.T) is None
    with loader.reference():
        assert PS.fast_scalar("mul", x, 2.0) is None
        assert PS.fast_unary("tanh", x) is None
    assert PS.fast_scalar("mul", cp.ones(0, np.float32), 2.0).shape == (0,)


# ----------------------------------------------------------------------------- GPU: Tensor level
def _chain(x, n_ops):
    y = x
    for _ in range(n_ops // 4):
        y = y * 1.01
        y = y + 0.5
        y = y.tanh()
        y = y - x
    y = -y * x + 0.25 * y - (1 - y)  # neg, tensor*tensor, scalar*tensor, scalar-tensor
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("n", [16, 1000])
def test_chain_gradients_match_reference_path(dtype, n):
    rng = np.random.default_rng(5)
    a = rng.standard_normal(n)
    g = rng.standard_normal(n)

    def run():
        x = flame.tensor(a, device="cuda").to(getattr(flame, dtype)).requires_grad_()
        y = _chain(x, 40)
        y.backward(flame.tensor(g, device="cuda").to(getattr(flame, dtype)))
        return y.detach().float().numpy(), x.grad.float().numpy()

    before = launching.launches
    y_fast, gx_fast = run()
    # forward: 40 ops + 5; backward: per round mul-scalar, tanh_bwd, neg, an accumulation; at least one per op
    assert launching.launches - before >= 80, "the small-array fast path did not run"
    with loader.reference():
        before = launching.launches
        y_ref, gx_ref = run()
        assert launching.launches == before
    if dtype == "float32":
        np.testing.assert_allclose(y_fast, y_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gx_fast, gx_ref, rtol=1e-4, atol=1e-5)
    else:  # ten rounds of half-precision math: reference-path roundings differ (its tanh backward rounds 3 times)
        rtol = {"float16": 2e-2, "bfloat16": 1e-1}[dtype]
        np.testing.assert_allclose(y_fast, y_ref, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(gx_fast, gx_ref, rtol=rtol, atol=rtol * np.abs(gx_ref).max())


@pytest.mark.gpu
def test_chain_forward_float32_is_bit_identical_to_cupy():
    """mul/add/sub by scalars and tensors and neg: the fast path gives CuPy's results bit for bit."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal(64).astype(np.float32)
    x = flame.tensor(a, device="cuda")
    z = flame.tensor(rng.standard_normal(64).astype(np.float32), device="cuda")

    def run():
        y = x
        for _ in range(5):
            y = -(y * 1.01 + 0.5 - z) * z - 0.3
        return y._data.copy()

    before = launching.launches
    fast = run()
    assert launching.launches - before == 30  # six ops a round
    with loader.reference():
        ref = run()
    assert_bits(fast, ref)


@pytest.mark.gpu
def test_gradient_accumulation_takes_the_fast_path():
    x = flame.tensor(np.arange(16, dtype=np.float32), device="cuda", requires_grad=True)
    y = x * 2.0 + x * 3.0 + x * 4.0  # three contributions to x: a sum, then one in-place accumulation
    before = launching.launches
    y.backward(flame.ones(16, device="cuda"))
    assert launching.launches > before
    np.testing.assert_array_equal(x.grad.numpy(), np.full(16, 9.0, dtype=np.float32))
    y = x * 1.5
    y.backward(flame.ones(16, device="cuda"))  # .grad exists: accumulated in place
    np.testing.assert_array_equal(x.grad.numpy(), np.full(16, 10.5, dtype=np.float32))


# ----------------------------------------------------------------------------- CPU
def test_returns_none_on_numpy_arrays():
    x = np.ones(16, dtype=np.float32)
    assert PS.fast_scalar("mul", x, 2.0) is None
    assert PS.fast_binary("add", x, x) is None
    assert PS.fast_binary("add", x, x, x) is None
    assert PS.fast_unary("neg", x) is None
    assert PS.fast_unary("tanh", x) is None
    assert PS.fast_grad("tanh_bwd", x, x) is None


def test_scalar_bits_round_to_the_dtype():
    f32, f16, bf16 = 0, 1, 2
    assert launching.f32_bits(1.0) == 0x3F800000
    assert launching.f32_bits(-0.0) == 0x80000000
    assert PS._scalar_bits(f32, 1.01) == int(np.float32(1.01).view(np.uint32))
    assert PS._scalar_bits(f16, 1.01) == int(np.float32(1.01).view(np.uint32))   # float32, whatever the dtype
    assert PS._scalar_bits(bf16, 1.01) == int(np.float32(1.01).view(np.uint32))
    assert PS._scalar_bits(f16, 3) == 0x40400000
    assert PS._scalar_bits(f16, 1e39) is None           # beyond float32: the reference path decides
    assert PS._scalar_bits(f32, 1 << 40) is None        # an int not exact in float32
    assert PS._scalar_bits(f32, float("inf")) == 0x7F800000
    # 0.0 and -0.0 are equal dict keys: neither is cached, so each keeps its sign
    assert PS._scalar_bits(f32, 0.0) == 0 and PS._scalar_bits(f32, -0.0) == 0x80000000
    assert 0.0 not in PS._bits[f32]


def test_cpu_tensor_ops_unchanged():
    """The cpu path (NumPy ufuncs) still computes the chain; nothing launches."""
    x = flame.tensor(np.linspace(-1, 1, 16, dtype=np.float32), requires_grad=True, device="cpu")
    before = launching.launches
    y = _chain(x, 8)
    y.sum().backward()
    assert launching.launches == before
    a = np.linspace(-1, 1, 16, dtype=np.float32)
    y_ref = a
    for _ in range(2):
        y_ref = np.tanh(y_ref * np.float32(1.01) + np.float32(0.5)) - a
    y_ref = -y_ref * a + np.float32(0.25) * y_ref - (1 - y_ref)
    np.testing.assert_allclose(y.detach().numpy(), y_ref, rtol=1e-6, atol=1e-6)
    assert x.grad is not None and np.all(np.isfinite(x.grad.numpy()))


# ----------------------------------------------------------------------------- clamp
CLAMP_BOUNDS = [(-1.0, 1.0), (0.1, None), (None, -0.3), (2, 5), (1.0, -1.0), (float("nan"), 1.0),
                (-float("inf"), float("inf")), (0.0, 0.0)]


def _clamp_ref(x, lo, hi):
    """np.maximum / np.minimum in float64 with the bounds rounded to x's dtype (CuPy's ufuncs on a half-precision
    array and a Python bound), rounded back (exact: every value is x's or a bound's)."""
    dt = x.dtype
    v = x.astype(np.float64)
    if lo is not None:
        v = np.maximum(v, float(np.asarray(lo, dtype=dt)))
    if hi is not None:
        v = np.minimum(v, float(np.asarray(hi, dtype=dt)))
    return v.astype(dt)


def _clamp_grad_ref(g, x, lo, hi):
    dt = x.dtype
    v = x.astype(np.float64)
    keep = np.ones(v.shape, bool)
    if lo is not None:
        keep &= v >= float(np.asarray(lo, dtype=dt))
    if hi is not None:
        keep &= v <= float(np.asarray(hi, dtype=dt))
    return (g.astype(np.float64) * keep.astype(np.float64)).astype(dt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("lo,hi", CLAMP_BOUNDS)
def test_clamp_and_its_backward_match_the_ufuncs(dtype, lo, hi):
    """fast_clamp / fast_clamp_grad bit for bit against np.maximum / np.minimum and g * mask: NaN in x or in a bound
    propagates, lo > hi gives hi, a masked gradient of inf or NaN stays NaN (0 * inf), -0 for a negative one."""
    cp = backend.cupy
    rng = np.random.default_rng(7)
    for n in SIZES:
        host = rand(rng, (n,), DTYPES[dtype], scale=2.0)
        host[: min(n, 4)] = np.array([np.nan, np.inf, -np.inf, -0.0][: min(n, 4)], dtype=DTYPES[dtype])
        g = rand(rng, (n,), DTYPES[dtype], scale=2.0)
        g[: min(n, 2)] = np.array([np.inf, np.nan][: min(n, 2)], dtype=DTYPES[dtype])
        x, gd = cp.asarray(host), cp.asarray(g)
        got = _twice(lambda: PS.fast_clamp(x, lo, hi))
        _bits_or_nan(got, _clamp_ref(host, lo, hi), f"clamp {dtype} n={n} [{lo}, {hi}]")
        got = _twice(lambda: PS.fast_clamp_grad(gd, x, lo, hi))
        _bits_or_nan(got, _clamp_grad_ref(g, host, lo, hi), f"clamp grad {dtype} n={n} [{lo}, {hi}]")


def _bits_or_nan(got, want, what):
    """Bit for bit, NaN where NaN (payloads differ: CUDA writes its canonical NaN, the host NumPy 0xFFC00000 and a
    half NaN's own payload)."""
    g, w = _np(got), _np(want)
    assert g.dtype == w.dtype and g.shape == w.shape, what
    gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ"
    assert np.array_equal(g[~gn].view(np.uint8), w[~wn].view(np.uint8)), f"{what}: not bit-identical"


@pytest.mark.gpu
def test_clamp_declines_what_it_does_not_take():
    cp = backend.cupy
    x = cp.ones(8, dtype=np.float32)
    assert PS.fast_clamp(x, 1 << 30, None) is None                   # an int not exact in float32
    assert PS.fast_clamp(x, cp.zeros(()), None) is None              # an array bound
    assert PS.fast_clamp(x.astype(np.float64), 0.0, 1.0) is None     # float64
    assert PS.fast_clamp(x[::2], 0.0, 1.0) is None                   # not contiguous


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tensor_clamp_equals_the_reference_path(dtype):
    """Tensor.clamp forward and backward on cuda (the packed kernels) equal the reference path bit for bit."""
    rng = np.random.default_rng(8)
    host = rng.standard_normal((4, 33)).astype(np.float32) * 2

    def run():
        x = flame.tensor(host, device="cuda").to(getattr(flame, dtype)).requires_grad_(True)
        y = x.clamp(-0.7, 1.3)
        y.backward(flame.tensor(np.linspace(-1, 1, host.size).reshape(host.shape), device="cuda").to(y.dtype))
        return _np(y._data), _np(x.grad._data)

    before = launching.launches
    y1, g1 = run()
    assert launching.launches > before
    with loader.reference():
        y2, g2 = run()
    assert_bits(y1, y2, "forward")
    assert_bits(g1, g2, "backward")
