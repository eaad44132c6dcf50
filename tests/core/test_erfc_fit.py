"""The fitted NumPy erfc / normal CDF (flame_core/kernels/erfc_fit.py) against math.erfc, its coefficients against
what tools/fit_erfc.py makes, and the CPU's exact GELU (float32 through the fit) against float64 math.erf."""
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional as F
from flame_core.kernels import erfc_fit as E

_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def test_erfc_relative_error_over_the_fitted_range():
    z = np.concatenate([np.linspace(0.0, E.ZMAX, 100001), np.geomspace(1e-12, 1e-2, 200)])
    ref = _erfc(z)
    rel = np.abs(E.erfc_nonneg(z) - ref) / ref
    assert rel.max() < 3e-10


def test_erfc_special_values():
    got = E.erfc_nonneg(np.array([0.0, E.ZMAX, E.ZMAX + 1e-9, 30.0, np.inf, np.nan]))
    assert got[0] == pytest.approx(1.0, rel=3e-10) and got[1] == pytest.approx(math.erfc(E.ZMAX), rel=1e-9)
    assert np.array_equal(got[2:5], [0.0, 0.0, 0.0]) and np.isnan(got[5])
    full = E.erfc(np.array([-np.inf, np.inf, 0.0, -1.5, np.nan]))
    assert full[0] == 2.0 and full[1] == 0.0 and full[2] == pytest.approx(1.0, rel=3e-10)
    assert full[3] == pytest.approx(math.erfc(-1.5), rel=3e-10) and np.isnan(full[4])


@given(st.floats(-30.0, 30.0))
def test_erfc_keeps_its_relative_accuracy_for_either_sign(x):
    """erfc(x) to the fit's relative accuracy (erfc(-z) = 2 - erfc(z) for negative x); past ZMAX, 0 (the true value
    is below 2.1e-45, zero in float32)."""
    ref = math.erfc(x)
    got = float(E.erfc(np.array([x]))[0])
    if x > E.ZMAX:
        assert got == 0.0 and ref < 2.1e-45
    else:
        assert abs(got - ref) <= 3e-10 * ref


def test_the_shipped_coefficients_are_the_scripts():
    path = Path(__file__).resolve().parents[2] / "tools" / "fit_erfc.py"
    spec = importlib.util.spec_from_file_location("fit_erfc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tmin, cheb = mod.fit(len(E.POLY) - 1)
    from numpy.polynomial import chebyshev as C
    assert tmin == E.TMIN
    np.testing.assert_allclose(C.cheb2poly(cheb), E.POLY, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_exact_gelu_within_a_few_roundings_of_float64(dtype):
    """F.gelu (erf form) and its gradient on the CPU, float32 / half types through the float32 fit (normal_cdf32):
    within four float32 roundings of the float64 values from math.erf in both tails (half types: within one
    rounding of their dtype); float64 inputs keep math.erf itself. (PyTorch's float32 0.5 x (1 + erf) loses the
    lower tail's digits to cancellation: a looser bound than this one.)"""
    rng = np.random.default_rng(3)
    x64 = np.concatenate([rng.standard_normal(3000) * 4, [-12.0, -9.0, -6.0, 0.0, 6.0, 9.0]])
    dt = getattr(flame, dtype)
    x = flame.tensor(x64, device="cpu").to(dt)
    xr = x.to(flame.float64).detach().numpy()
    phi = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in xr])
    want = xr * phi
    pdf = np.exp(-0.5 * xr * xr) / math.sqrt(2 * math.pi)
    x.requires_grad_(True)
    y = F.gelu(x)
    y.backward(flame.ones_like(y))
    eps = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]
    got = y.to(flame.float64).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=4 * eps if dtype == "float32" else eps,
                               atol=1e-37 if dtype == "float32" else 6e-8)
    g = x.grad.to(flame.float64).numpy()
    # the derivative Phi + x pdf is summed in the compute dtype (float32): a rounding of each term (they cancel for
    # x < 0), exp(-x^2 / 2) off by x^2's rounding; float16's results below its smallest subnormal flush to zero
    terms = np.abs(phi) + np.abs(xr * pdf)
    tiny = 6e-8 if dtype == "float16" else 1e-37
    assert np.all(np.abs(g - (phi + xr * pdf)) <= 4 * eps * terms * (1 + xr * xr) + tiny)
    x64t = flame.tensor(xr, device="cpu")
    erf = np.array([math.erf(v * (1.0 / math.sqrt(2.0))) for v in xr])
    np.testing.assert_array_equal(F.gelu(x64t).numpy(), 0.5 * xr * (1 + erf))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_erfc_op_and_ndtr_within_a_rounding(dtype):
    """Tensor.erfc / special.ndtr on the CPU below float64 (the fit): within one rounding of the dtype of math.erfc's
    float64 values, both signs (erfc(-z) = 2 - erfc(z)); float64 keeps math.erfc exactly."""
    from flame_core import special
    x64 = np.concatenate([np.linspace(-6.0, 9.0, 1201), [-30.0, 30.0, 0.0]])
    x = flame.tensor(x64, device="cpu").to(getattr(flame, dtype))
    xr = x.to(flame.float64).numpy()
    eps = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]
    tiny = 6e-8 if dtype == "float16" else 1e-37
    want = _erfc(xr)
    got = x.erfc().to(flame.float64).numpy()
    assert np.all(np.abs(got - want) <= eps * want + tiny)
    # ndtr = erfc(x * -1/sqrt(2)) / 2: the product's rounding in the dtype moves erfc by ~x^2 of it
    want = 0.5 * _erfc(-xr / math.sqrt(2.0))
    got = special.ndtr(x).to(flame.float64).numpy()
    assert np.all(np.abs(got - want) <= eps * want * (1 + xr * xr) + tiny)
    x64t = flame.tensor(x64, device="cpu")
    np.testing.assert_array_equal(x64t.erfc().numpy(), _erfc(x64))


def test_float32_normal_cdf_holds_both_tails_to_a_few_roundings():
    """normal_cdf32 on a dense grid of float32 x in [-20, 20]: within 6 float32 ulp of math.erfc's Phi wherever Phi
    is a normal float32 (the exponent in float64: no x^2 rounding in the lower tail), exactly 0 / 1 / NaN at -inf /
    inf / NaN, 1/2 at +-0; its coefficients are the degree-9 fit's."""
    x = np.linspace(-20, 20, 200001).astype(np.float32)
    got = E.normal_cdf32(x)
    assert got.dtype == np.float32
    want = 0.5 * _erfc(-x.astype(np.float64) / math.sqrt(2.0))
    ok = want > 1.2e-38
    ulp = np.abs(got[ok] - want[ok]) / np.spacing(want[ok].astype(np.float32))
    assert ulp.max() <= 6, (x[ok][np.argmax(ulp)], ulp.max())
    assert np.all(got[~ok] < 1e-37)
    special = E.normal_cdf32(np.array([-np.inf, np.inf, np.nan, 0.0, -0.0], np.float32))
    assert special[0] == 0 and special[1] == 1 and np.isnan(special[2]) and np.all(special[3:] == 0.5)
    path = Path(__file__).resolve().parents[2] / "tools" / "fit_erfc.py"
    spec = importlib.util.spec_from_file_location("fit_erfc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from numpy.polynomial import chebyshev as C
    np.testing.assert_allclose(C.cheb2poly(mod.fit(len(E.POLY32) - 1)[1]), E.POLY32, rtol=1e-9, atol=1e-15)
