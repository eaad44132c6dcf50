"""The gamma family and flame_core.special beyond the golden values (tests/core/test_torch_surface_golden.py): dtypes
(half types computed in float32 and rounded once, integers to the default float), the Tensor methods and their
in-place forms, the aliases, and the errors."""
import math

import numpy as np
import pytest

import flame_core as flame


@pytest.mark.parametrize("dtype", [flame.float16, flame.bfloat16, flame.float32])
def test_half_and_single_types_round_the_float64_value_once(device, dtype):
    vals = [0.3, 1.7, 4.2, 9.5, -0.5]
    x = flame.tensor(vals, device=device).to(dtype)
    xs = x.to(flame.float64)   # the values the low-precision tensor holds
    for fn in (flame.lgamma, flame.digamma, lambda t: flame.polygamma(2, t), flame.special.log_ndtr):
        got = fn(x)
        assert got.dtype == dtype
        want = fn(xs).to(dtype).to(flame.float64).cpu().numpy()
        # float32 is computed in float32 (as PyTorch): digamma's shift sums cancel near its root (1.46)
        tol = (1e-2, 1e-2) if dtype != flame.float32 else (1e-5, 1e-6)
        np.testing.assert_allclose(got.to(flame.float64).cpu().numpy(), want, rtol=tol[0], atol=tol[1])


def test_integer_inputs_give_the_default_float(device):
    x = flame.tensor([1, 2, 5], device=device)
    y = flame.lgamma(x)
    assert y.dtype == flame.float32
    np.testing.assert_allclose(y.cpu().numpy(), [0.0, 0.0, math.log(24)], atol=1e-6)
    z = flame.special.zeta(flame.tensor([2, 4], device=device), 1)
    assert z.dtype == flame.float32
    np.testing.assert_allclose(z.cpu().numpy(), [math.pi ** 2 / 6, math.pi ** 4 / 90], rtol=1e-6)


def test_methods_inplace_forms_and_aliases(device):
    x = flame.tensor([0.5, 2.0, 3.5], dtype=flame.float64, device=device)
    np.testing.assert_allclose(x.lgamma().cpu().numpy(), [math.lgamma(v) for v in (0.5, 2.0, 3.5)], rtol=1e-14)
    np.testing.assert_allclose(x.polygamma(1).cpu().numpy(), flame.polygamma(1, x).cpu().numpy())
    np.testing.assert_allclose((x + 1).mvlgamma(2).cpu().numpy(), flame.mvlgamma(x + 1, 2).cpu().numpy())
    y = x.clone()
    y.digamma_()
    np.testing.assert_allclose(y.cpu().numpy(), flame.digamma(x).cpu().numpy())
    y = x.clone()
    y.polygamma_(2)
    np.testing.assert_allclose(y.cpu().numpy(), flame.polygamma(2, x).cpu().numpy())
    assert flame.special.gammaln is flame.lgamma and flame.special.psi is flame.digamma
    assert flame.special.multigammaln is flame.mvlgamma and flame.special.expit is flame.sigmoid
    np.testing.assert_array_equal(flame.polygamma(0, x).cpu().numpy(), flame.digamma(x).cpu().numpy())


def test_bad_arguments_raise_clear_errors(device):
    x = flame.tensor([0.5, 2.0], device=device)
    for n in (-1, 1.5, True, x):
        with pytest.raises(ValueError, match="polygamma: n must be a non-negative int"):
            flame.polygamma(n, x)
    with pytest.raises(ValueError, match="mvlgamma: p must be a positive int"):
        flame.mvlgamma(x, 0)
    with pytest.raises(ValueError, match=r"greater than \(p - 1\) / 2 = 1.0"):
        flame.mvlgamma(x, 3)
    with pytest.raises(TypeError, match="zeta: expected at least one tensor"):
        flame.special.zeta(2.0, 1.0)


def test_zeta_has_no_derivative_in_x(device):
    s = flame.tensor([2.0, 3.0], dtype=flame.float64, device=device, requires_grad=True)
    q = flame.tensor([1.0, 2.0], dtype=flame.float64, device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="zeta: the derivative with respect to its first argument"):
        flame.special.zeta(s, q).sum().backward()
