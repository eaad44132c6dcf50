"""Hypothesis gradient checks (float64 central differences) for the differentiable ops of flame_core.ops.math_ops
and order_stats: random shapes (0-d and size-1 dims included), broadcasting for the two-operand ones, non-contiguous
inputs; domains kept away from poles and kinks (the golden test checks the edges themselves against PyTorch)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
from flame_core.autograd import gradcheck

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
nonempty = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


def _t(rng, shape, device, lo, hi, noncontig=False):
    a = rng.uniform(lo, hi, size=shape)
    if noncontig and len(shape) >= 2:
        t = flame.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2)), dtype=flame.float64, device=device)
        return t.transpose(-1, -2).detach().requires_grad_()
    return flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)


UNARY = {
    "tan": (flame.tan, (-1.2, 1.2)),
    "asin": (flame.asin, (-0.9, 0.9)),
    "acos": (flame.acos, (-0.9, 0.9)),
    "atan": (flame.atan, (-3.0, 3.0)),
    "sinh": (flame.sinh, (-2.0, 2.0)),
    "cosh": (flame.cosh, (-2.0, 2.0)),
    "asinh": (flame.asinh, (-3.0, 3.0)),
    "acosh": (flame.acosh, (1.1, 4.0)),
    "atanh": (flame.atanh, (-0.9, 0.9)),
    "expm1": (flame.expm1, (-2.0, 2.0)),
    "exp2": (flame.exp2, (-2.0, 2.0)),
    "log2": (flame.log2, (0.2, 3.0)),
    "log10": (flame.log10, (0.2, 3.0)),
    "erfc": (flame.erfc, (-2.0, 2.0)),
    "erfinv": (flame.erfinv, (-0.9, 0.9)),
    "sinc": (flame.sinc, (-2.0, 2.0)),
    "logit": (flame.logit, (0.05, 0.95)),
    "logit_eps": (lambda x: flame.logit(x, eps=0.01), (0.05, 0.95)),
    "nan_to_num": (flame.nan_to_num, (-2.0, 2.0)),
    "frac": (lambda x: flame.frac(x * 0.4 + 0.3), (-0.6, 0.6)),
    "nansum": (lambda x: flame.nansum(x, dim=-1) if x.ndim else flame.nansum(x), (-2.0, 2.0)),
    "nanmean": (lambda x: flame.nanmean(x), (-2.0, 2.0)),
    "lgamma": (flame.lgamma, (0.2, 6.0)),
    "lgamma_negative": (lambda x: flame.lgamma(x - 2.0), (0.1, 0.9)),
    "digamma": (flame.digamma, (0.2, 12.0)),
    "digamma_negative": (lambda x: flame.digamma(-x), (1.1, 1.9)),
    "polygamma_1": (lambda x: flame.polygamma(1, x), (0.3, 12.0)),
    "polygamma_2_negative": (lambda x: flame.polygamma(2, -x), (0.2, 0.8)),
    "mvlgamma": (lambda x: flame.mvlgamma(x, 3), (1.2, 5.0)),
    "ndtr": (flame.special.ndtr, (-3.0, 3.0)),
    "ndtri": (flame.special.ndtri, (0.05, 0.95)),
    "log_ndtr": (flame.special.log_ndtr, (-30.0, 6.0)),
    "entr": (flame.special.entr, (0.05, 2.0)),
    "zeta_in_q": (lambda q: flame.special.zeta(2.5, q), (0.3, 6.0)),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=shapes, noncontig=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_unary_gradcheck(device, name, shape, noncontig, seed):
    fn, (lo, hi) = UNARY[name]
    x = _t(np.random.default_rng(seed), shape, device, lo, hi, noncontig)
    assert gradcheck(fn, (x,))


BINARY = {
    "atan2": (flame.atan2, (-2.0, 2.0), (0.3, 2.0)),
    "hypot": (flame.hypot, (0.3, 2.0), (-2.0, -0.3)),
    "xlogy": (flame.xlogy, (-2.0, 2.0), (0.3, 2.0)),
    "xlog1py": (flame.special.xlog1py, (-2.0, 2.0), (-0.7, 2.0)),
    "logaddexp": (flame.logaddexp, (-3.0, 3.0), (-3.0, 3.0)),
    "copysign": (flame.copysign, (0.3, 2.0), (-2.0, 2.0)),
    "fmax": (flame.fmax, (-2.0, -0.1), (0.1, 2.0)),
    "fmin": (flame.fmin, (-2.0, -0.1), (0.1, 2.0)),
    "float_power": (flame.float_power, (0.3, 2.0), (-1.5, 1.5)),
    "addcmul": (lambda a, b: flame.addcmul(a, b, a, value=0.3), (-2.0, 2.0), (-2.0, 2.0)),
    "addcdiv": (lambda a, b: flame.addcdiv(b, a, b, value=-0.7), (-2.0, 2.0), (0.4, 2.0)),
}


@st.composite
def broadcast_pair(draw):
    shape = draw(nonempty)
    other = [1 if draw(st.booleans()) else n for n in shape]
    return shape, tuple(other[draw(st.integers(0, len(other))):])


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair(), swap=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_binary_gradcheck_broadcast(device, name, pair, swap, seed):
    fn, da, db = BINARY[name]
    sa, sb = pair if not swap else pair[::-1]
    rng = np.random.default_rng(seed)
    assert gradcheck(fn, (_t(rng, sa, device, *da), _t(rng, sb, device, *db)))


def _distinct(rng, shape, device):
    """Values with gaps of at least 0.05 between any two (order statistics are then smooth under eps)."""
    n = int(np.prod(shape)) if shape else 1
    vals = rng.permutation(n) * 0.1 + rng.uniform(-0.02, 0.02, n)
    return flame.tensor(vals.reshape(shape), dtype=flame.float64, device=device, requires_grad=True)


ORDER = {
    "median": lambda x, d: flame.median(x, d).values if d is not None else flame.median(x),
    "nanmedian": lambda x, d: flame.nanmedian(x, d).values if d is not None else flame.nanmedian(x),
    "kthvalue": lambda x, d: flame.kthvalue(x, 1, d if d is not None else -1).values,
    "quantile": lambda x, d: flame.quantile(x, 0.37, d),
    "quantile_midpoint": lambda x, d: flame.quantile(x, 0.37, d, interpolation="midpoint"),
    "nanquantile_vec": lambda x, d: flame.nanquantile(x, flame.tensor([0.1, 0.9], dtype=flame.float64), d),
    "cummax": lambda x, d: flame.cummax(x, d if d is not None else 0).values,
    "cummin": lambda x, d: flame.cummin(x, d if d is not None else 0).values,
}


@pytest.mark.parametrize("name", sorted(ORDER))
@given(shape=nonempty, pick=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_order_statistics_gradcheck(device, name, shape, pick, seed):
    dim = None if pick == 3 else pick % len(shape)
    x = _distinct(np.random.default_rng(seed), shape, device)
    assert gradcheck(lambda t: ORDER[name](t, dim), (x,))


def _spd(X):
    n = X.shape[-1]
    return X @ X.mT + n * flame.eye(n, dtype=X.dtype, device=X.device)


LINALG = {
    "det": (lambda X: flame.linalg.det(X), "square"),
    "slogdet": (lambda X: flame.linalg.slogdet(X).logabsdet, "square"),
    "cholesky": (lambda X: flame.linalg.cholesky(_spd(X)), "square"),
    "cholesky_upper": (lambda X: flame.linalg.cholesky(_spd(X), upper=True), "square"),
    "qr_Q": (lambda X: flame.linalg.qr(X).Q, "any"),
    "qr_R": (lambda X: flame.linalg.qr(X).R, "any"),
    "eigh_values": (lambda X: flame.linalg.eigh(X + X.mT).eigenvalues, "square"),
    "eigh_vectors": (lambda X: flame.linalg.eigh(X + X.mT).eigenvectors.abs(), "square"),
    "eigvalsh": (lambda X: flame.linalg.eigvalsh(X + X.mT), "square"),
    "pinv": (lambda X: flame.linalg.pinv(X), "any"),
    "matrix_power": (lambda X: flame.linalg.matrix_power(X, -3), "square"),
    "solve_triangular": (lambda X: flame.linalg.solve_triangular(
        X + 4 * flame.eye(X.shape[-1], dtype=X.dtype, device=X.device), X.mT, upper=False), "square"),
}


@pytest.mark.parametrize("name", sorted(LINALG))
@given(n=st.integers(1, 4), extra=st.integers(0, 2), batch=st.lists(st.integers(1, 2), max_size=1),
       wide=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linalg_gradcheck(device, name, n, extra, batch, wide, seed):
    fn, kind = LINALG[name]
    rows, cols = (n, n) if kind == "square" else ((n, n + extra) if wide else (n + extra, n))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(tuple(batch) + (rows, cols))
    if kind == "square":   # well conditioned: away from singular matrices and repeated eigenvalues
        a = a + np.diag(np.arange(1, n + 1) * 1.5)
    x = flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)
    assert gradcheck(fn, (x,), atol=1e-5, rtol=1e-4)


@given(k=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2)),
       stride=st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2)), pad=st.integers(0, 1),
       groups=st.sampled_from([1, 2]), transposed=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_conv3d_and_conv_transpose3d_gradcheck(device, k, stride, pad, groups, transposed, seed):
    import flame_nn.functional as F
    rng = np.random.default_rng(seed)
    x = flame.tensor(rng.standard_normal((1, 2, 3, 3, 3)), dtype=flame.float64, device=device, requires_grad=True)
    wshape = (2, 2 // groups) + k   # (in, out / groups, ...) transposed, (out, in / groups, ...) not: 2 channels
    w = flame.tensor(rng.standard_normal(wshape) * 0.5, dtype=flame.float64, device=device, requires_grad=True)
    b = flame.tensor(rng.standard_normal(2), dtype=flame.float64, device=device, requires_grad=True)
    if transposed:
        pad = min(pad, *[kk - 1 for kk in k]) if min(k) > 1 else 0
        fn = lambda x, w, b: F.conv_transpose3d(x, w, b, stride=stride, padding=pad, groups=groups)  # noqa: E731
    else:
        fn = lambda x, w, b: F.conv3d(x, w, b, stride=stride, padding=pad, groups=groups)  # noqa: E731
    assert gradcheck(fn, (x, w, b))
