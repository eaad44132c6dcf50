"""The PyTorch-surface functions beyond their golden values: Tensor methods and in-place forms (an AdamW update
written with addcmul_ / addcdiv_ as in a hand-written optimizer), the random draws' distributions and rules
(multinomial, bernoulli, normal), and the clear errors on bad input."""
import math

import numpy as np
import pytest

import flame_core as flame


def _np(t):
    return t.detach().cpu().numpy()


METHODS = ("tan asin acos atan arcsin arccos arctan sinh cosh asinh acosh atanh arcsinh arccosh arctanh expm1 exp2 "
           "log2 log10 erfc erfinv logit sinc nan_to_num frac deg2rad rad2deg sgn signbit positive atan2 arctan2 "
           "hypot xlogy logaddexp copysign fmax fmin float_power heaviside addcmul addcdiv median nanmedian quantile "
           "nanquantile kthvalue cummax cummin aminmax nansum nanmean var_mean diff tile fliplr flipud rot90 hsplit "
           "vsplit dsplit take_along_dim kron inner cross bincount histc isin bernoulli multinomial det logdet slogdet "
           "inverse pinverse matrix_power").split()
INPLACE = ("tan_ asin_ acos_ atan_ sinh_ cosh_ asinh_ acosh_ atanh_ expm1_ exp2_ log2_ log10_ erfc_ erfinv_ sinc_ "
           "frac_ deg2rad_ rad2deg_ sgn_ logit_ nan_to_num_ atan2_ hypot_ xlogy_ copysign_ float_power_ addcmul_ "
           "addcdiv_ bernoulli_").split()


def test_every_function_is_also_a_tensor_method():
    missing = [m for m in METHODS + INPLACE if not hasattr(flame.Tensor, m)]
    assert not missing, missing


def test_inplace_forms_match_their_functions(device):
    x = flame.tensor([0.1, 0.4, -0.3], dtype=flame.float64, device=device)
    for name in ("tan", "asin", "atanh", "expm1", "log10", "erfinv", "sinc"):
        src = x.abs() if name == "log10" else x
        want = _np(getattr(flame, name)(src))
        y = src.clone()
        assert getattr(y, name + "_")() is y
        np.testing.assert_allclose(_np(y), want, rtol=1e-15, atol=0)


def test_adamw_step_written_with_addcmul_and_addcdiv_matches_numpy(device):
    """A hand-written AdamW step (PyTorch's reference algorithm, the in-place Tensor methods a user copies from
    torch.optim) against NumPy; gradients flow through the out-of-place forms."""
    rng = np.random.default_rng(0)
    p0, g0 = rng.standard_normal(6), rng.standard_normal(6)
    p = flame.tensor(p0, device=device)
    m, v = flame.zeros(6, dtype=flame.float64, device=device), flame.zeros(6, dtype=flame.float64, device=device)
    g = flame.tensor(g0, device=device)
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    pn, mn, vn = p0.copy(), np.zeros(6), np.zeros(6)
    for step in range(1, 4):
        p.mul_(1 - lr * wd)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / (1 - b2 ** step)).sqrt().add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))
        pn *= 1 - lr * wd
        mn = b1 * mn + (1 - b1) * g0
        vn = b2 * vn + (1 - b2) * g0 * g0
        pn += -lr / (1 - b1 ** step) * mn / (np.sqrt(vn / (1 - b2 ** step)) + eps)
    np.testing.assert_allclose(_np(p), pn, rtol=1e-12, atol=1e-14)
    a = flame.tensor(p0, requires_grad=True, device=device)
    flame.addcdiv(a, a, a * a + 1, value=0.5).sum().backward()
    np.testing.assert_allclose(_np(a.grad), 1 + 0.5 * (1 - p0 ** 2) / (p0 ** 2 + 1) ** 2, rtol=1e-12)


def test_multinomial_distributions_and_rules(device):
    flame.manual_seed(0)
    w = flame.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 2.0, 0.0, 4.0]], dtype=flame.float32, device=device)
    draws = _np(flame.multinomial(w, 4000, replacement=True))
    assert draws.shape == (2, 4000) and draws.dtype == np.int64
    for r, row in enumerate(_np(w)):
        freq = np.bincount(draws[r], minlength=4) / 4000
        np.testing.assert_allclose(freq, row / row.sum(), atol=0.03)
        assert not np.any(freq[row == 0])        # a zero weight is never drawn
    no_rep = _np(flame.multinomial(w, 2))
    assert all(len(set(r)) == 2 for r in no_rep)
    assert set(no_rep[0]) == {1, 2}               # the only two non-zero weights, both drawn
    first = np.bincount(np.array([_np(flame.multinomial(w[1], 1))[0] for _ in range(3000)]), minlength=4) / 3000
    np.testing.assert_allclose(first, [0.25, 0.25, 0, 0.5], atol=0.03)   # the first draw follows the weights
    g1, g2 = flame.Generator(device=device).manual_seed(7), flame.Generator(device=device).manual_seed(7)
    np.testing.assert_array_equal(_np(flame.multinomial(w, 5, True, generator=g1)),
                                  _np(flame.multinomial(w, 5, True, generator=g2)))
    with pytest.raises(ValueError, match="without replacement"):
        flame.multinomial(w, 3)
    for bad in ([1.0, -1.0], [1.0, math.nan], [0.0, 0.0], [1.0, math.inf]):
        with pytest.raises(ValueError, match="multinomial"):
            flame.multinomial(flame.tensor(bad, device=device), 1, True)
    with pytest.raises(ShapeErrorOrValue):
        flame.multinomial(flame.ones(2, 2, 2, device=device), 1)


ShapeErrorOrValue = (flame.ShapeError, ValueError)


def test_bernoulli_and_normal(device):
    flame.manual_seed(1)
    p = flame.tensor(np.linspace(0, 1, 5), dtype=flame.float32, device=device).expand(4000, 5)
    b = _np(flame.bernoulli(p))
    assert b.dtype == np.float32 and set(np.unique(b)) <= {0.0, 1.0}
    np.testing.assert_allclose(b.mean(0), np.linspace(0, 1, 5), atol=0.03)
    assert b[:, 0].sum() == 0 and b[:, -1].sum() == 4000
    z = flame.zeros(20000, device=device).bernoulli_(0.3)
    assert abs(_np(z).mean() - 0.3) < 0.02
    with pytest.raises(ValueError, match="bernoulli"):
        flame.bernoulli(flame.tensor([0.5, 1.5], device=device))
    n = _np(flame.normal(2.0, 3.0, (20000,), device=device))
    assert abs(n.mean() - 2.0) < 0.1 and abs(n.std() - 3.0) < 0.1
    mean = flame.tensor([0.0, 10.0], device=device).expand(10000, 2)
    std = flame.tensor([1.0, 0.5], device=device)
    d = _np(flame.normal(mean, std))
    assert d.shape == (10000, 2)
    np.testing.assert_allclose(d.mean(0), [0.0, 10.0], atol=0.05)
    np.testing.assert_allclose(d.std(0), [1.0, 0.5], atol=0.05)
    assert _np(flame.normal(flame.ones(3, device=device))).shape == (3,)
    with pytest.raises(TypeError, match="size"):
        flame.normal(0.0, 1.0)
    with pytest.raises(ValueError, match="std"):
        flame.normal(flame.zeros(2, device=device), flame.tensor([1.0, -1.0], device=device))


def test_errors_name_the_problem(device):
    x = flame.ones(2, 3, device=device)
    with pytest.raises(flame.ShapeError, match="tensordot"):
        flame.tensordot(x, x, 1)
    with pytest.raises(flame.ShapeError, match="cross"):
        flame.cross(flame.ones(2, 4, device=device), flame.ones(2, 4, device=device))
    with pytest.raises(flame.ShapeError, match="cross"):
        flame.cross(x, x, dim=0)
    with pytest.raises(flame.ShapeError, match="rot90"):
        flame.rot90(x, 1, (0, 0))
    with pytest.raises(flame.ShapeError, match="hsplit"):
        flame.hsplit(x, 2)
    with pytest.raises(ValueError, match="interpolation"):
        flame.quantile(x, 0.5, interpolation="cubic")
    with pytest.raises(ValueError, match="q must"):
        flame.quantile(x, 1.5)
    with pytest.raises(IndexError, match="kthvalue"):
        flame.kthvalue(x, 4, dim=1)
    with pytest.raises(flame.DTypeError, match="bincount"):
        flame.bincount(flame.tensor([0.5], device=device))
    with pytest.raises(ValueError, match="negative"):
        flame.bincount(flame.tensor([1, -1], device=device))
    with pytest.raises(ValueError, match="side"):
        flame.searchsorted(flame.arange(3, device=device), flame.ones(2, device=device), side="middle")
    with pytest.raises(RuntimeError, match="heaviside"):
        flame.heaviside(flame.ones(2, requires_grad=True, device=device), flame.zeros(2, device=device))
    with pytest.raises(flame.ShapeError, match="median"):
        flame.median(flame.ones(0, device=device))
