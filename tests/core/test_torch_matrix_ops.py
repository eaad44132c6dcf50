"""PyTorch's matrix-shaped ops (issue 31): cdist, addmm / baddbmm, einsum (diagonals, sublists), outer, diag /
diagonal / diag_embed / trace, each against NumPy on random shapes, with float64 gradient checks and named errors."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.errors import DTypeError, ShapeError


def _f64(a, device, grad=False):
    return flame.tensor(np.asarray(a, dtype=np.float64), dtype=flame.float64, device=device, requires_grad=grad)


def _ref_cdist(a, b, p):
    d = np.abs(a[..., :, None, :] - b[..., None, :, :])
    if p == 0:
        return (d != 0).sum(-1).astype(a.dtype)
    if p == np.inf:
        return d.max(-1)
    return (d ** p).sum(-1) ** (1 / p)


# ----------------------------------------------------------------------------- cdist
@given(P=st.integers(1, 5), R=st.integers(1, 5), M=st.integers(1, 4),
       batch=st.sampled_from([((), ()), ((2,), (2,)), ((2, 1), (3,)), ((1,), (2,))]),
       p=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, np.inf]), seed=st.integers(0, 2 ** 16))
def test_cdist_matches_numpy(device, P, R, M, batch, p, seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=batch[0] + (P, M)), rng.normal(size=batch[1] + (R, M))
    a[..., 0, :] = b[..., 0, :] if len(batch[0]) == len(batch[1]) and batch[0] == batch[1] else a[..., 0, :]
    d = flame.cdist(_f64(a, device), _f64(b, device), p=p)
    np.testing.assert_allclose(d.numpy(), _ref_cdist(a, b, p), rtol=1e-10, atol=1e-12)
    if p == 2.0:
        mm = flame.cdist(_f64(a, device), _f64(b, device), compute_mode="use_mm_for_euclid_dist")
        np.testing.assert_allclose(mm.numpy(), _ref_cdist(a, b, 2), rtol=1e-6, atol=1e-6)


@given(p=st.sampled_from([1.0, 2.0, 3.0, np.inf]), seed=st.integers(0, 2 ** 16),
       mode=st.sampled_from(["use_mm_for_euclid_dist_if_necessary", "use_mm_for_euclid_dist"]))
@settings(max_examples=15)
def test_cdist_gradcheck(device, p, seed, mode):
    rng = np.random.default_rng(seed)
    a, b = _f64(rng.normal(size=(2, 3, 4)), device, True), _f64(rng.normal(size=(4, 4)), device, True)
    assert gradcheck(lambda a, b: flame.cdist(a, b, p=p, compute_mode=mode), (a, b))


def test_cdist_coincident_points_and_errors(device):
    a = _f64([[0.0, 1.0], [2.0, 2.0]], device, True)
    b = _f64([[0.0, 1.0]], device, True)
    for mode in ("donot_use_mm_for_euclid_dist", "use_mm_for_euclid_dist"):
        d = flame.cdist(a, b, compute_mode=mode)
        g_a, g_b = flame.autograd.grad(d.sum(), (a, b))
        assert d.detach().numpy()[0, 0] < 1e-7 and np.isfinite(g_a.numpy()).all()
        np.testing.assert_allclose(g_a.numpy()[0], 0.0)  # zero distance: zero gradient, as PyTorch
        np.testing.assert_allclose(g_a.numpy()[1], [2 / 5 ** 0.5, 1 / 5 ** 0.5], rtol=1e-6)
    big = flame.cdist(flame.zeros(30, 3, device=device), flame.ones(2, 3, device=device))  # the mm path (P > 25)
    np.testing.assert_allclose(big.numpy(), 3 ** 0.5, rtol=1e-6)
    d0 = flame.cdist(a, b, p=0)
    d0.sum().backward()
    assert a.grad is not None and float(a.grad.abs().sum()) == 0.0
    with pytest.raises(ShapeError, match=r"same number of columns"):
        flame.cdist(flame.zeros(2, 3, device=device), flame.zeros(2, 4, device=device))
    with pytest.raises(ValueError, match="p must be a non-negative number"):
        flame.cdist(flame.zeros(2, 3, device=device), flame.zeros(2, 3, device=device), p=-1)
    with pytest.raises(DTypeError, match="same floating dtype"):
        flame.cdist(flame.zeros(2, 3, device=device), flame.zeros(2, 3, dtype=flame.float64, device=device))
    with pytest.raises(ValueError, match="compute_mode must be one of"):
        flame.cdist(flame.zeros(2, 3, device=device), flame.zeros(2, 3, device=device), compute_mode="fast")
    with pytest.raises(ShapeError, match="batch dims"):
        flame.cdist(flame.zeros(2, 2, 3, device=device), flame.zeros(3, 2, 3, device=device))


# ----------------------------------------------------------------------------- addmm / baddbmm
@given(n=st.integers(1, 4), m=st.integers(1, 4), p=st.integers(1, 4), b=st.integers(1, 3),
       ishape=st.sampled_from(["full", "row", "col", "scalar"]), beta=st.sampled_from([0.0, 1.0, -0.5]),
       alpha=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=20)
def test_addmm_baddbmm(device, n, m, p, b, ishape, beta, alpha, seed):
    rng = np.random.default_rng(seed)
    shp = {"full": (n, p), "row": (p,), "col": (n, 1), "scalar": ()}[ishape]
    inp, m1, m2 = rng.normal(size=shp), rng.normal(size=(n, m)), rng.normal(size=(m, p))
    out = flame.addmm(_f64(inp, device), _f64(m1, device), _f64(m2, device), beta=beta, alpha=alpha)
    np.testing.assert_allclose(out.numpy(), beta * inp + alpha * m1 @ m2, rtol=1e-12, atol=1e-12)
    args = (_f64(inp, device, True), _f64(m1, device, True), _f64(m2, device, True))
    assert gradcheck(lambda i, a, c: flame.addmm(i, a, c, beta=beta, alpha=alpha), args)
    b1, b2, bi = rng.normal(size=(b, n, m)), rng.normal(size=(b, m, p)), rng.normal(size=shp)
    out = _f64(bi, device).baddbmm(_f64(b1, device), _f64(b2, device), beta=beta, alpha=alpha)
    np.testing.assert_allclose(out.numpy(), beta * bi + alpha * b1 @ b2, rtol=1e-12, atol=1e-12)
    args = (_f64(bi, device, True), _f64(b1, device, True), _f64(b2, device, True))
    assert gradcheck(lambda i, a, c: flame.baddbmm(i, a, c, beta=beta, alpha=alpha), args)


def test_addmm_beta_zero_ignores_nan_and_inplace(device):
    nan = flame.full((2, 2), float("nan"), device=device)
    e = flame.eye(2, device=device)
    np.testing.assert_array_equal(flame.addmm(nan, e, e, beta=0).numpy(), np.eye(2))
    y = flame.ones(2, 2, device=device)
    v = y._version[0]
    y.addmm_(e, e * 2, alpha=0.5)
    assert y._version[0] == v + 1
    np.testing.assert_array_equal(y.numpy(), np.ones((2, 2)) + np.eye(2))
    with pytest.raises(ShapeError, match=r"addmm: input of shape \(3,\) does not broadcast"):
        flame.addmm(flame.ones(3, device=device), e, e)
    with pytest.raises(DTypeError, match="addmm: input has dtype float64"):
        flame.addmm(flame.ones(2, dtype=flame.float64, device=device), e, e)
    with pytest.raises(ShapeError, match="bmm"):
        flame.baddbmm(flame.ones(2, device=device), e, e)


# ----------------------------------------------------------------------------- einsum / outer
@pytest.mark.parametrize("eq,shapes", [
    ("ii->i", [(3, 3)]), ("ii", [(4, 4)]), ("iij->j", [(2, 2, 3)]), ("bii->bi", [(2, 3, 3)]),
    ("ij,jj->i", [(2, 3), (3, 3)]), ("iji->j", [(3, 2, 3)]), ("ii,i->", [(3, 3), (3,)]),
    ("ij,kj->ik", [(2, 3), (4, 3)]), ("...ij,...jk", [(2, 2, 3), (3, 4)]),
])
def test_einsum_diagonals_values_and_gradients(device, rng, eq, shapes):
    arrs = [rng.normal(size=s) for s in shapes]
    ts = [_f64(a, device, True) for a in arrs]
    np.testing.assert_allclose(flame.einsum(eq, *ts).detach().numpy(), np.einsum(eq, *arrs), rtol=1e-12)
    assert gradcheck(lambda *xs: flame.einsum(eq, *xs), tuple(ts))


def test_einsum_sublist_form_and_double_backward(device, rng):
    a, b = rng.normal(size=(2, 3)), rng.normal(size=(3, 4))
    ta, tb = _f64(a, device, True), _f64(b, device, True)
    np.testing.assert_allclose(flame.einsum(ta, [0, 1], tb, [1, 2], [0, 2]).detach().numpy(), a @ b)
    np.testing.assert_allclose(flame.einsum(ta, [Ellipsis, 1], tb, [1, 2]).detach().numpy(), a @ b)
    assert gradgradcheck(lambda x: flame.einsum("ii->i", x), (_f64(rng.normal(size=(3, 3)), device, True),))
    with pytest.raises(ValueError, match=r"sublist entries must be ints in \[0, 52\)"):
        flame.einsum(ta, [0, 60], tb, [60, 2])


def test_outer(device, rng):
    u, v = rng.normal(size=3), rng.normal(size=4)
    np.testing.assert_allclose(flame.outer(_f64(u, device), _f64(v, device)).numpy(), np.outer(u, v))
    np.testing.assert_allclose(_f64(u, device).outer(_f64(v, device)).numpy(), np.outer(u, v))
    with pytest.raises(ShapeError, match="outer: expected 1-D tensors"):
        flame.outer(flame.ones(2, 2, device=device), flame.ones(2, device=device))


# ----------------------------------------------------------------------------- diag family
@given(n=st.integers(1, 5), m=st.integers(1, 5), k=st.integers(-6, 6), seed=st.integers(0, 2 ** 16))
def test_diag_both_directions(device, n, m, k, seed):
    rng = np.random.default_rng(seed)
    v, A = rng.normal(size=n), rng.normal(size=(n, m))
    np.testing.assert_array_equal(flame.diag(_f64(v, device), k).numpy(), np.diag(v, k))
    np.testing.assert_array_equal(_f64(A, device).diag(k).numpy(), np.diag(A, k))
    assert gradcheck(lambda t: flame.diag(t, k), (_f64(v, device, True),))
    if np.diag(A, k).size:
        assert gradcheck(lambda t: t.diag(k), (_f64(A, device, True),))


def test_diagonal_diag_embed_trace(device, rng):
    a = rng.normal(size=(2, 3, 4))
    x = _f64(a, device, True)
    for off, d1, d2 in ((0, 0, 1), (1, -1, 0), (-1, 2, 1), (2, 0, 2)):
        np.testing.assert_array_equal(x.diagonal(off, d1, d2).detach().numpy(), np.diagonal(a, off, d1, d2))
        assert gradcheck(lambda t: flame.diagonal(t, off, d1, d2), (x,))
    v = rng.normal(size=(2, 3))
    e = flame.diag_embed(_f64(v, device), offset=1)
    assert e.shape == (2, 4, 4)
    np.testing.assert_array_equal(e.numpy()[1], np.diag(v[1], 1))
    e2 = flame.diag_embed(_f64(v, device), 0, 0, 2)  # (3, 2, 3): the diagonal in dims 0 and 2
    np.testing.assert_array_equal(e2.numpy()[:, 1, :], np.diag(v[1]))
    assert gradcheck(lambda t: flame.diag_embed(t, -1, 0, 2), (_f64(v, device, True),))
    m = rng.normal(size=(3, 4))
    assert flame.trace(_f64(m, device)).item() == pytest.approx(np.trace(m))
    with pytest.raises(ShapeError, match=r"diag: expected a 1-D or 2-D tensor, got shape \(2, 3, 4\)"):
        flame.diag(x)
    with pytest.raises(ShapeError, match="dim1 and dim2 cannot be the same"):
        x.diagonal(0, 1, -2)
    with pytest.raises(ShapeError, match="trace: expected a 2-D tensor"):
        flame.trace(x)
