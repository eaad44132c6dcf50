"""The PyTorch-surface sweep of flame_core (ops/surface_methods.py, torch_functions.py, scatter_copies.py,
logcumsumexp.py, covariance.py, renorm.py, integer_ops.py, windows.py, integration.py and the additions to math_ops,
matrix, order_stats, sorting, binning, arrangement and sampling): float64 hypothesis gradient checks of every new
differentiable op on random shapes, and the behaviour the golden test (test_torch_surface_golden.py, PyTorch's
numbers) cannot show: errors, in-place semantics, draws, DLPack, the namespace's other names."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError

seeds = st.integers(0, 2 ** 16)


def _t(rng, shape, device, lo=-2.0, hi=2.0):
    return flame.tensor(rng.uniform(lo, hi, size=shape), dtype=flame.float64, device=device, requires_grad=True)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), pick=st.integers(0, 2), seed=seeds)
def test_logcumsumexp_gradcheck(device, shape, pick, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, shape, device, -30, 30)
    dim = pick % len(shape) - len(shape) * (pick % 2)
    assert gradcheck(lambda t: flame.logcumsumexp(t, dim), (x,))


def test_logcumsumexp_is_stable_far_from_the_maximum(device):
    x = flame.tensor([-1000.0, 0.0, 1000.0, -1000.0], dtype=flame.float64, device=device)
    y = flame.logcumsumexp(x, 0).cpu().numpy()
    np.testing.assert_allclose(y, [-1000.0, 0.0, 1000.0, 1000.0], rtol=1e-15)
    with pytest.raises(flame.DTypeError, match="floating point"):
        flame.logcumsumexp(flame.tensor([1, 2], device=device), 0)


@given(m=st.integers(1, 4), n=st.integers(1, 4), b=st.integers(1, 3), seed=seeds)
def test_add_products_gradcheck(device, m, n, b, seed):
    rng = np.random.default_rng(seed)
    i1, i2 = _t(rng, (m,), device), _t(rng, (m, n), device)
    mat, vec, v1 = _t(rng, (m, n), device), _t(rng, (n,), device), _t(rng, (m,), device)
    b1, b2 = _t(rng, (b, m, 3), device), _t(rng, (b, 3, n), device)
    assert gradcheck(lambda i, a, v: flame.addmv(i, a, v, beta=0.5, alpha=-2.0), (i1, mat, vec))
    assert gradcheck(lambda i, a, v: flame.addr(i, a, v, beta=2.0, alpha=0.5), (i2, v1, vec))
    assert gradcheck(lambda i, a, v: flame.addbmm(i, a, v, alpha=1.5), (i2, b1, b2))


def test_beta_zero_ignores_nan_in_the_input(device):
    i = flame.full((2,), float("nan"), dtype=flame.float64, device=device)
    m = flame.ones(2, 3, dtype=flame.float64, device=device)
    v = flame.ones(3, dtype=flame.float64, device=device)
    np.testing.assert_array_equal(flame.addmv(i, m, v, beta=0).cpu().numpy(), [3.0, 3.0])


@given(v=st.integers(1, 4), n=st.integers(2, 6), weights=st.sampled_from(["none", "f", "a", "fa"]),
       correction=st.integers(0, 1), seed=seeds)
def test_cov_and_corrcoef_gradcheck(device, v, n, weights, correction, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (v, n), device)
    fw = flame.tensor(rng.integers(1, 4, n), device=device) if "f" in weights else None
    aw = flame.tensor(rng.uniform(0.5, 2, n), dtype=flame.float64, device=device) if "a" in weights else None
    assert gradcheck(lambda t: flame.cov(t, correction=correction, fweights=fw, aweights=aw), (x,))
    if n > 2:
        assert gradcheck(flame.corrcoef, (x,), atol=1e-5, rtol=1e-3)


def test_cov_checks_its_weights(device):
    x = flame.randn(2, 3, device=device)
    with pytest.raises(ShapeError, match="fweights must be 1-D with as many elements as observations"):
        flame.cov(x, fweights=flame.tensor([1, 2], device=device))
    with pytest.raises(flame.DTypeError, match="fweights must be integral"):
        flame.cov(x, fweights=flame.tensor([1.0, 2.0, 1.0], device=device))
    with pytest.raises(ValueError, match="aweights cannot be negative"):
        flame.cov(x, aweights=flame.tensor([1.0, -2.0, 1.0], device=device))
    with pytest.warns(UserWarning, match="degrees of freedom"):
        c = flame.cov(x, correction=3)
    assert np.isinf(c.cpu().numpy()).all()
    assert flame.cov(flame.tensor([[1, 2, 3]], device=device)).dtype == flame.float32   # integers: default float


@given(rows=st.integers(1, 4), cols=st.integers(1, 4), p=st.sampled_from([1.0, 2.0, 3.0]), dim=st.integers(0, 1),
       seed=seeds)
def test_renorm_gradcheck(device, rows, cols, p, dim, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (rows, cols), device)
    assert gradcheck(lambda t: flame.renorm(t, p, dim, 1.0), (x,))


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), seed=seeds)
def test_mode_values_go_to_the_indices(device, shape, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 3, shape).astype(np.float64)
    x = flame.tensor(a, device=device, requires_grad=True)
    values, indices = flame.mode(x, -1)
    idx = indices.cpu().numpy()[..., None]
    np.testing.assert_array_equal(np.take_along_axis(a, idx, -1)[..., 0], values.detach().cpu().numpy())
    counts = (a == values.detach().cpu().numpy()[..., None]).sum(-1)
    assert np.all(counts == np.max([(a == v).sum(-1) for v in (0, 1, 2)], axis=0))   # the most frequent
    go = rng.standard_normal(values.shape)
    (values * flame.tensor(go, device=device)).sum().backward()
    want = np.zeros_like(a)
    np.put_along_axis(want, idx, go[..., None], -1)
    np.testing.assert_array_equal(x.grad.cpu().numpy(), want)
    # distinct values (each once: the mode is the smallest): away from ties the gradient is the finite difference's
    y = flame.tensor(rng.permutation(int(np.prod(shape))).reshape(shape) + rng.uniform(0, 0.1, shape),
                     dtype=flame.float64, device=device, requires_grad=True)
    assert gradcheck(lambda t: flame.mode(t, -1).values, (y,))


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), spacing=st.sampled_from(["dx", "x1",
                                                                                                      "xnd"]),
       cumulative=st.booleans(), seed=seeds)
def test_trapezoid_gradcheck(device, shape, spacing, cumulative, seed):
    rng = np.random.default_rng(seed)
    y = _t(rng, shape, device)
    fn = flame.cumulative_trapezoid if cumulative else flame.trapezoid
    if spacing == "dx":
        assert gradcheck(lambda t: fn(t, dx=0.7, dim=0), (y,))
    else:
        x = _t(rng, (shape[-1],) if spacing == "x1" else shape, device)
        assert gradcheck(lambda t, s: fn(t, s), (y, x))


@given(n=st.integers(1, 5), cols=st.integers(0, 6), increasing=st.booleans(), zero=st.booleans(), seed=seeds)
def test_vander_gradcheck_at_zero_too(device, n, cols, increasing, zero, seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-2, 2, n)
    if zero:
        a[0] = 0.0
    x = flame.tensor(a, dtype=flame.float64, device=device, requires_grad=True)
    y = flame.vander(x, N=cols, increasing=increasing)
    want = np.vander(a, N=cols, increasing=increasing)
    np.testing.assert_allclose(y.detach().cpu().numpy(), want, rtol=1e-14)
    if cols:
        assert gradcheck(lambda t: flame.vander(t, N=cols, increasing=increasing), (x,))


@given(n=st.integers(1, 5), r=st.integers(1, 3), replacement=st.booleans(), seed=seeds)
def test_combinations_gradcheck(device, n, r, replacement, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (n,), device)
    out = flame.combinations(x, r, with_replacement=replacement)
    assert out.shape[1] == r
    if out.shape[0]:
        assert gradcheck(lambda t: flame.combinations(t, r, with_replacement=replacement), (x,))


@given(rows=st.integers(1, 4), cols=st.integers(1, 4), k=st.integers(1, 6), accumulate=st.booleans(), seed=seeds)
def test_index_put_and_put_gradcheck(device, rows, cols, k, accumulate, seed):
    rng = np.random.default_rng(seed)
    x, v = _t(rng, (rows, cols), device), _t(rng, (k,), device)
    if accumulate:   # repeated places add up
        r, c = rng.integers(0, rows, k), rng.integers(0, cols, k)
    else:            # distinct places (PyTorch leaves the winner of a repeated place unspecified)
        flat = rng.permutation(rows * cols)[:k]
        r, c = flat // cols, flat % cols
        v = v[:len(flat)].detach().requires_grad_()
    ri, ci = flame.tensor(r, device=device), flame.tensor(c, device=device)
    assert gradcheck(lambda t, s: flame.index_put(t, (ri, ci), s, accumulate=accumulate), (x, v))
    flat = flame.tensor(r * cols + c - rows * cols * (rng.integers(0, 2, len(r))), device=device)   # some negative
    assert gradcheck(lambda t, s: t.put(flat, s, accumulate=accumulate), (x, v))


def test_index_put_in_place_and_its_errors(device):
    x = flame.zeros(3, 4, device=device)
    out = x.index_put_((flame.tensor([0, 0, 2], device=device), flame.tensor([1, 1, 3], device=device)),
                       flame.tensor([1.0, 2.0, 3.0], device=device), accumulate=True)
    assert out is x
    assert x.cpu().numpy()[0, 1] == 3.0 and x.cpu().numpy()[2, 3] == 3.0 and x.sum().item() == 6.0
    rows = x.index_put((flame.tensor([1], device=device), None), flame.tensor(7.0, device=device))
    np.testing.assert_array_equal(rows.cpu().numpy()[1], [7.0] * 4)
    with pytest.raises(TypeError, match="values have dtype"):
        x.index_put((flame.tensor([0], device=device),), flame.tensor([1], device=device))
    with pytest.raises(ShapeError, match="cannot be broadcast to the indexed region"):
        x.index_put((flame.tensor([0, 1], device=device),), flame.ones(3, device=device))
    with pytest.raises(ShapeError, match="index has 2 elements but source has 3"):
        x.put(flame.tensor([0, 1], device=device), flame.ones(3, device=device))


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), bcast=st.booleans(), seed=seeds)
def test_masked_scatter_gradcheck(device, shape, bcast, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, shape, device)
    mshape = (1,) * (len(shape) - 1) + shape[-1:] if bcast else shape
    mask = flame.tensor(rng.random(mshape) < 0.5, device=device)
    src = _t(rng, (int(np.prod(shape)) + 2,), device)
    assert gradcheck(lambda t, s: t.masked_scatter(mask, s), (x, src))


def test_masked_scatter_takes_the_source_in_order_and_checks_it(device):
    x = flame.zeros(2, 3, device=device)
    mask = flame.tensor([[True, False, True], [False, True, False]], device=device)
    out = x.masked_scatter(mask, flame.tensor([1.0, 2.0, 3.0, 4.0], device=device))
    np.testing.assert_array_equal(out.cpu().numpy(), [[1, 0, 2], [0, 3, 0]])
    with pytest.raises(ShapeError, match="selects 3 elements but source has only 2"):
        x.masked_scatter(mask, flame.ones(2, device=device))
    with pytest.raises(ShapeError, match="must not grow it"):
        flame.zeros(3, device=device).masked_scatter(flame.ones(2, 3, device=device) > 0, flame.ones(6, device=device))
    x.masked_scatter_(mask, flame.tensor([5.0, 6.0, 7.0], device=device))
    np.testing.assert_array_equal(x.cpu().numpy(), [[5, 0, 6], [0, 7, 0]])


@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=3).map(tuple), dim=st.integers(0, 2),
       start=st.integers(-3, 3), step=st.integers(1, 3), offset=st.integers(-2, 2), seed=seeds)
def test_slice_select_diagonal_scatter_gradcheck(device, shape, dim, start, step, offset, seed):
    rng = np.random.default_rng(seed)
    d = dim % len(shape)
    x = _t(rng, shape, device)
    part = x.detach()[(slice(None),) * d + (slice(start, None, step),)]
    src = _t(rng, tuple(part.shape), device)
    assert gradcheck(lambda t, s: flame.slice_scatter(t, s, d, start, None, step), (x, src))
    sel = _t(rng, tuple(x.detach().select(d, shape[d] - 1).shape), device)
    assert gradcheck(lambda t, s: flame.select_scatter(t, s, d, -1), (x, sel))
    diag = x.detach().diagonal(offset, 0, len(shape) - 1)
    dsrc = _t(rng, tuple(diag.shape), device)
    assert gradcheck(lambda t, s: flame.diagonal_scatter(t, s, offset, 0, -1), (x, dsrc))
    # the embedded part reads back as src, everything else as the input
    y = flame.diagonal_scatter(x, dsrc, offset, 0, -1)
    np.testing.assert_array_equal(y.diagonal(offset, 0, len(shape) - 1).detach().cpu().numpy(),
                                  dsrc.detach().cpu().numpy())


def test_scatters_name_a_wrong_source_shape(device):
    x = flame.zeros(3, 4, device=device)
    with pytest.raises(ShapeError, match=r"slice_scatter: src of shape \(3, 3\) must have the shape of the embedded "
                                         r"part, \(3, 2\)"):
        flame.slice_scatter(x, flame.zeros(3, 3, device=device), 1, 0, 4, 2)
    with pytest.raises(IndexError, match="index 5 out of range"):
        flame.select_scatter(x, flame.zeros(4, device=device), 0, 5)
    with pytest.raises(ValueError, match="dim1 and dim2 cannot be the same"):
        flame.diagonal_scatter(x, flame.zeros(3, device=device), 0, 1, 1)


def test_fill_diagonal_is_in_place_with_a_zero_gradient_there(device):
    x = flame.randn(3, 3, dtype=flame.float64, device=device, requires_grad=True)
    y = x * 1
    assert y.fill_diagonal_(4.0) is y
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.cpu().numpy(), 1 - np.eye(3))
    cube = flame.zeros(2, 2, 2, device=device).fill_diagonal_(1.0).cpu().numpy()
    assert cube.sum() == 2 and cube[0, 0, 0] == 1 and cube[1, 1, 1] == 1
    with pytest.raises(ShapeError, match="all dimensions of input must be of equal length"):
        flame.zeros(2, 3, 3, device=device).fill_diagonal_(1.0)


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), seed=seeds)
def test_frexp_ldexp_logaddexp2_fmod_gradcheck(device, shape, seed):
    rng = np.random.default_rng(seed)
    x, y = _t(rng, shape, device), _t(rng, shape, device, 0.5, 2.0)
    e = flame.tensor(rng.integers(-3, 4, shape), device=device)
    assert gradcheck(lambda t: flame.frexp(t * 10).mantissa, (x,))
    assert gradcheck(lambda t, s: flame.ldexp(t, s), (x, y))
    assert gradcheck(lambda t: flame.ldexp(t, e), (x,))
    assert gradcheck(lambda a, b: flame.logaddexp2(a * 5, b * 5), (x, y))
    shifted = (x.detach() + 0.05).requires_grad_()   # away from the jumps at multiples of y
    assert gradcheck(lambda a: flame.fmod(a, 0.7), (shifted,))


def test_frexp_recombines_and_integer_ops(device):
    x = flame.tensor([0.0, 3.0, -5.0, 1e-300, 7.5e300], dtype=flame.float64, device=device)
    m, e = flame.frexp(x)
    assert e.dtype == flame.int32
    np.testing.assert_array_equal(flame.ldexp(m, e).cpu().numpy(), x.cpu().numpy())
    a, b = flame.tensor([12, -18, 0, 7], device=device), flame.tensor([8, 12, 0, 0], device=device)
    np.testing.assert_array_equal(flame.gcd(a, b).cpu().numpy(), [4, 6, 0, 7])
    np.testing.assert_array_equal(flame.lcm(a, b).cpu().numpy(), [24, 36, 0, 0])
    np.testing.assert_array_equal((a << 2).cpu().numpy(), [48, -72, 0, 28])
    np.testing.assert_array_equal((a >> 1).cpu().numpy(), [6, -9, 0, 3])
    np.testing.assert_array_equal((1 << b[:2]).cpu().numpy(), [256, 4096])
    c = a.clone()
    c <<= 1
    np.testing.assert_array_equal(c.cpu().numpy(), [24, -36, 0, 14])
    with pytest.raises(flame.DTypeError, match="expected integer operands"):
        flame.gcd(flame.tensor([1.0], device=device), flame.tensor([2.0], device=device))
    up = flame.nextafter(flame.tensor([1.0], device=device), flame.tensor([2.0], device=device))
    assert up.item() == np.nextafter(np.float32(1), np.float32(2))


def test_in_place_forms_keep_the_dtype_and_count_versions(device):
    x = flame.tensor([1.0, 2.0, 3.0], device=device)
    v = x._version[0]
    assert x.gt_(1.5) is x and x.dtype == flame.float32
    np.testing.assert_array_equal(x.cpu().numpy(), [0.0, 1.0, 1.0])
    assert x._version[0] > v
    i = flame.tensor([5, 7], device=device)
    i.bitwise_and_(flame.tensor([3, 3], device=device))
    np.testing.assert_array_equal(i.cpu().numpy(), [1, 3])
    with pytest.raises(flame.DTypeError, match="can't be cast"):
        i.true_divide_(2)
    w = flame.ones(3, requires_grad=True, device=device)
    with pytest.raises(flame.AutogradError, match="leaf tensor"):
        w.arctan_()
    assert flame.relu_(flame.tensor([-1.0, 2.0], device=device)).cpu().numpy().tolist() == [0.0, 2.0]


def test_queries_for_real_tensors(device):
    x = flame.randn(2, 3, device=device)
    assert x.conj() is x and x.resolve_conj() is x and x.real is x and flame.conj(x) is x
    assert not x.is_conj() and not flame.is_complex(x) and flame.isreal(x).all().item()
    with pytest.raises(RuntimeError, match="imag is not implemented for tensors with non-complex dtypes"):
        x.imag
    assert x.is_signed() and not flame.tensor([1], dtype=flame.uint8).is_signed()
    assert flame.tensor([3.0]).is_nonzero() and not flame.tensor([0]).is_nonzero()
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        x.is_nonzero()
    assert x.is_same_size(flame.zeros(2, 3)) and not flame.is_same_size(x, flame.zeros(3, 2))
    assert x.storage_offset() == 0 and x[1:].storage_offset() == 3 and x[:, 2].storage_offset() == 2
    assert x.is_cpu == (device == "cpu")
    assert flame.can_cast(flame.int32, flame.float16) and not flame.can_cast(flame.float32, flame.int64)
    assert flame.can_cast(flame.bool, flame.uint8) and not flame.can_cast(flame.int8, flame.bool)


def test_other_names_are_the_same_ops(device):
    x = flame.randn(3, 4, device=device)
    y = flame.randn(3, 4, device=device)
    for a, b in [(flame.absolute(x), x.abs()), (flame.negative(x), -x), (flame.multiply(x, y), x * y),
                 (flame.divide(x, y), x / y), (flame.subtract(x, y, alpha=2), x - 2 * y),
                 (flame.greater_equal(x, y), x >= y), (flame.not_equal(x, y), x != y),
                 (flame.less_equal(x, y), x <= y), (flame.swapdims(x, 0, 1), x.T), (flame.t(x), x.T),
                 (flame.moveaxis(x, 0, 1), x.T), (flame.fix(x * 3), (x * 3).trunc()),
                 (flame.rsub(x, y), y - x), (flame.argwhere(x > 0), (x > 0).nonzero()),
                 (flame.narrow_copy(x, 1, 1, 2), x[:, 1:3]), (x.adjoint(), x.T),
                 (flame.split_with_sizes(x, [1, 2])[1], x[1:])]:
        np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())
    with pytest.raises(ShapeError, match="don't sum to dimension"):
        x.split_with_sizes([1, 1])
    assert flame.dist(x, y).item() == pytest.approx((x - y).norm().item())
    assert flame.scalar_tensor(3).dtype == flame.float32 and flame.scalar_tensor(3).ndim == 0
    r = flame.randint_like(x, 5)
    assert r.dtype == x.dtype and r.shape == x.shape and 0 <= r.min().item() and r.max().item() < 5
    assert flame.get_default_device() == flame.default_device()


def test_float32_matmul_precision_is_kept_and_checked():
    old = flame.get_float32_matmul_precision()
    try:
        flame.set_float32_matmul_precision("high")
        assert flame.get_float32_matmul_precision() == "high"
        with pytest.raises(ValueError, match="expected 'highest', 'high' or 'medium'"):
            flame.set_float32_matmul_precision("low")
    finally:
        flame.set_float32_matmul_precision(old)


def test_asarray_and_from_dlpack_share_memory():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = flame.asarray(a)
    a[0, 0] = 42
    assert t[0, 0].item() == 42
    c = flame.asarray(a, copy=True)
    a[0, 1] = -1
    assert c[0, 1].item() == 1
    with pytest.raises(ValueError, match="copy=False"):
        flame.asarray(a, dtype=flame.float64, copy=False)
    d = flame.from_dlpack(a)
    a[1, 2] = 99
    assert d[1, 2].item() == 99 and d.shape == (2, 3)
    back = np.from_dlpack(d)   # and out again (Tensor.__dlpack__)
    assert back[1, 2] == 99


def test_windows_and_their_arguments():
    assert flame.hann_window(0).shape == (0,) and flame.hann_window(1).tolist() == [1.0]
    assert flame.hann_window(4).dtype == flame.float32
    np.testing.assert_allclose(flame.hann_window(5, periodic=False, dtype=flame.float64).numpy(), np.hanning(5),
                               atol=1e-15)
    np.testing.assert_allclose(flame.kaiser_window(7, False, 4.0, dtype=flame.float64).numpy(), np.kaiser(7, 4.0),
                               rtol=1e-13)
    with pytest.raises(ValueError, match="window_length must be a non-negative int"):
        flame.hann_window(-1)
    with pytest.raises(TypeError, match="floating point dtype"):
        flame.hamming_window(4, dtype=flame.int64)


@pytest.mark.parametrize("name,args,check", [
    ("exponential_", (2.0,), lambda a: abs(a.mean() - 0.5) < 0.01 and a.min() > 0),
    ("geometric_", (0.25,), lambda a: abs(a.mean() - 4.0) < 0.08 and a.min() == 1 and np.all(a == np.round(a))),
    ("log_normal_", (0.0, 0.5), lambda a: abs(np.log(a).mean()) < 0.01 and abs(np.log(a).std() - 0.5) < 0.01),
    ("cauchy_", (1.0, 2.0), lambda a: abs(np.median(a) - 1.0) < 0.05 and
     abs(np.percentile(a, 75) - np.percentile(a, 25) - 4.0) < 0.15),
    ("random_", (3, 7), lambda a: set(np.unique(a)) == {3, 4, 5, 6}),
    ("random_", (5,), lambda a: set(np.unique(a)) == {0, 1, 2, 3, 4}),
])
def test_in_place_draws_follow_their_distributions(device, name, args, check):
    x = flame.empty(40000, dtype=flame.float64, device=device)
    flame.manual_seed(0)
    assert getattr(x, name)(*args) is x
    assert check(x.cpu().numpy())


def test_random_fills_the_dtypes_range(device):
    flame.manual_seed(1)
    h = flame.empty(20000, dtype=flame.float16, device=device).random_().cpu().numpy().astype(np.float64)
    assert h.min() >= 0 and h.max() <= 2048 and h.max() > 1900
    u = flame.empty(5000, dtype=flame.uint8, device=device).random_().cpu().numpy()
    assert u.min() == 0 and u.max() == 255
    with pytest.raises(ValueError, match="expects from"):
        flame.empty(3, device=device).random_(4, 2)
    with pytest.raises(ValueError, match="p must be in"):
        flame.empty(3, device=device).geometric_(0.0)


def test_unravel_index_histogram_and_unique_consecutive_errors(device):
    with pytest.raises(IndexError, match="out of bounds for shape"):
        flame.unravel_index(flame.tensor([6], device=device), (2, 3))
    with pytest.raises(TypeError, match="integer indices"):
        flame.unravel_index(flame.tensor([1.0], device=device), (2, 3))
    with pytest.raises(ValueError, match="bin edges must increase"):
        flame.histogram(flame.randn(5, device=device), flame.tensor([0.0, 2.0, 1.0], device=device))
    with pytest.raises(ValueError, match="positive int or a 1-D tensor"):
        flame.histogram(flame.randn(5, device=device), 0)
    with pytest.raises(ShapeError, match="0-d"):
        flame.unique_consecutive(flame.tensor(1.0, device=device), dim=0)
    with pytest.raises(ValueError, match="too many to index"):
        flame.combinations(flame.zeros(200, device=device), 6)


@given(rows=st.integers(1, 4), cols=st.integers(1, 4), size=st.tuples(st.integers(0, 3), st.integers(1, 3)),
       stride=st.tuples(st.integers(0, 3), st.integers(0, 2)), seed=seeds)
def test_as_strided_and_its_scatter_gradcheck(device, rows, cols, size, stride, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (rows, cols), device)
    n = rows * cols
    span = sum((s - 1) * st for s, st in zip(size, stride)) if size[0] else 0
    if span >= n:
        with pytest.raises(ShapeError, match="reach element"):
            x.as_strided(size, stride)
        return
    offset = int(rng.integers(0, n - span))
    y = x.as_strided(size, stride, offset)
    pos = offset + np.arange(size[0])[:, None] * stride[0] + np.arange(size[1]) * stride[1]
    np.testing.assert_array_equal(y.detach().cpu().numpy(), x.detach().cpu().numpy().reshape(-1)[pos])
    assert gradcheck(lambda t: t.as_strided(size, stride, offset), (x,))
    distinct = len(set(pos.reshape(-1).tolist())) == pos.size   # a place written twice has no defined winner
    if distinct and pos.size:
        src = _t(rng, size, device)
        assert gradcheck(lambda t, s: flame.as_strided_scatter(t, s, size, stride, offset), (x, src))


def test_as_strided_is_a_view_and_checks_its_geometry(device):
    x = flame.arange(12.0, device=device).reshape(3, 4)
    v = x.as_strided((2, 2), (4, 1), 1)
    v[0, 0] = -1.0   # writes the storage the tensor reads
    assert x[0, 1].item() == -1.0 and x[1:].as_strided((2,), (1,)).tolist() == [4.0, 5.0]   # the view's offset
    with pytest.raises(ShapeError, match="negative strides"):
        x.as_strided((2,), (-1,))
    with pytest.raises(ShapeError, match="same length"):
        x.as_strided((2, 2), (1,))
    e = flame.empty_strided((2, 3), (1, 2), device=device)
    assert e.stride() == (1, 2) and e.shape == (2, 3)
    assert x.new_empty_strided((3,), (2,)).stride() == (2,)
    y = x.clone()
    assert y.as_strided_((2, 2), (1, 4)) is y and y.shape == (2, 2) and y.stride() == (1, 4)


def test_in_place_view_ops_change_shape_and_keep_history(device):
    w = flame.randn(2, 3, dtype=flame.float64, device=device, requires_grad=True)
    x = w * 2
    assert x.t_() is x and x.shape == (3, 2)
    x.unsqueeze_(0).transpose_(1, 2)
    assert x.shape == (1, 2, 3)
    x.squeeze_(0)
    x.swapdims_(0, 1)
    (x * flame.arange(6.0, dtype=flame.float64, device=device).reshape(3, 2)).sum().backward()
    np.testing.assert_array_equal(w.grad.cpu().numpy(), 2 * np.arange(6.0).reshape(3, 2).T)
    with pytest.raises(flame.AutogradError, match="leaf tensor"):
        w.t_()
    v = flame.zeros(2, 3, device=device)[0]
    v.unsqueeze_(0)
    assert v.shape == (1, 3) and v._base is not None


def test_resize_keeps_the_leading_elements(device):
    x = flame.arange(6.0, device=device)
    assert x.resize_(2, 2) is x and x.tolist() == [[0.0, 1.0], [2.0, 3.0]]
    x.resize_(3, 3)
    assert x.shape == (3, 3) and x.reshape(-1)[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
    x.resize_as_(flame.zeros(2))
    assert x.tolist() == [0.0, 1.0]
    with pytest.raises(flame.AutogradError, match="requires grad"):
        flame.zeros(2, requires_grad=True, device=device).resize_(3)
    with pytest.raises(ShapeError, match="cannot grow"):
        flame.zeros(4, device=device)[:2].resize_(5)


def test_apply_and_map_run_python_per_element():
    x = flame.tensor([1.0, 2.0, 3.0], device="cpu")
    assert x.apply_(lambda v: v * v + 1) is x and x.tolist() == [2.0, 5.0, 10.0]
    x.map_(flame.tensor([1.0, 0.0, 2.0], device="cpu"), lambda a, b: a - b)
    assert x.tolist() == [1.0, 5.0, 8.0]
    i = flame.tensor([[1, 2], [3, 4]], device="cpu")
    i.map_(flame.tensor([10, 20], device="cpu"), lambda a, b: a * b)   # broadcast
    assert i.tolist() == [[10, 40], [30, 80]] and i.dtype == flame.int64


@given(rows=st.integers(1, 4), cols=st.integers(1, 4), k=st.integers(1, 5), dim=st.integers(0, 1),
       reduce=st.sampled_from(["prod", "mean", "amax", "amin"]), include_self=st.booleans(), seed=seeds)
def test_index_reduce_gradcheck(device, rows, cols, k, dim, reduce, include_self, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, (rows, cols), device, 0.5, 2.0)
    n = (rows, cols)[dim]
    shape = (k, cols) if dim == 0 else (rows, k)
    src = _t(rng, shape, device, 0.5, 2.0)
    index = flame.tensor(rng.integers(0, n, k), device=device)
    out = x.index_reduce(dim, index, src, reduce, include_self=include_self)
    ref = flame.scatter_reduce(x, dim, index.reshape((-1, 1) if dim == 0 else (1, -1)).expand(*shape), src, reduce,
                               include_self=include_self)
    np.testing.assert_array_equal(out.detach().cpu().numpy(), ref.detach().cpu().numpy())
    assert gradcheck(lambda t, s: t.index_reduce(dim, index, s, reduce, include_self=include_self), (x, src))
    with pytest.raises(ValueError, match="reduce must be"):
        x.index_reduce(dim, index, src, "sum")


@given(n=st.integers(1, 4), batch=st.lists(st.integers(1, 2), max_size=1).map(tuple),
       scale=st.sampled_from([0.1, 1.0, 3.0]), seed=seeds)
def test_matrix_exp_gradcheck_and_identities(device, n, batch, scale, seed):
    rng = np.random.default_rng(seed)
    a = _t(rng, batch + (n, n), device, -scale, scale)
    e = flame.matrix_exp(a)
    # exp(A) exp(-A) = I; for a diagonal matrix, the exponentials of the diagonal
    np.testing.assert_allclose((e @ flame.matrix_exp(-a)).detach().cpu().numpy(), np.broadcast_to(np.eye(n), e.shape),
                               atol=1e-9 * max(1.0, float(np.abs(e.detach().cpu().numpy()).max())) ** 2)
    d = flame.diag_embed(a.detach()[..., 0])
    np.testing.assert_allclose(flame.matrix_exp(d).diagonal(0, -2, -1).cpu().numpy(),
                               np.exp(a.detach()[..., 0].cpu().numpy()), rtol=1e-13)
    assert gradcheck(flame.linalg.matrix_exp, (a,), atol=1e-6, rtol=1e-5)


@given(n=st.integers(1, 4), k=st.integers(1, 3), upper=st.booleans(), seed=seeds)
def test_cholesky_family_gradcheck(device, n, k, upper, seed):
    rng = np.random.default_rng(seed)
    m = _t(rng, (n, n), device)
    b = _t(rng, (n, k), device)
    spd = lambda t: t @ t.mT + 2 * flame.eye(n, dtype=t.dtype, device=device)   # noqa: E731
    fac = flame.cholesky(spd(m), upper)
    x = flame.cholesky_solve(b, fac, upper)
    np.testing.assert_allclose((spd(m) @ x).detach().cpu().numpy(), b.detach().cpu().numpy(), atol=1e-10)
    np.testing.assert_allclose((flame.cholesky_inverse(fac, upper) @ spd(m)).detach().cpu().numpy(), np.eye(n),
                               atol=1e-10)
    assert gradcheck(lambda t, s: flame.cholesky_solve(s, flame.cholesky(spd(t), upper), upper), (m, b))
    assert gradcheck(lambda t: flame.cholesky_inverse(flame.cholesky(spd(t), upper), upper), (m,))
    tri = (m.detach() + 3 * flame.eye(n, dtype=flame.float64, device=device)).requires_grad_()
    sol, copy = flame.triangular_solve(b, tri, upper=upper)
    assert copy is not tri and np.array_equal(copy.detach().cpu().numpy(), tri.detach().cpu().numpy())
    assert gradcheck(lambda t, s: flame.triangular_solve(s, t, upper=upper, transpose=True).solution, (tri, b))


def test_legacy_svd_and_qr_shapes(device):
    a = flame.randn(4, 3, dtype=flame.float64, device=device)
    u, s, v = flame.svd(a)
    assert u.shape == (4, 3) and v.shape == (3, 3)
    np.testing.assert_allclose((u * s @ v.mT).cpu().numpy(), a.cpu().numpy(), atol=1e-12)
    u, s, v = a.svd(some=False, compute_uv=False)
    assert u.shape == (4, 4) and v.shape == (3, 3) and not u.cpu().numpy().any()
    q, r = flame.qr(a, some=False)
    assert q.shape == (4, 4) and r.shape == (4, 3)
    np.testing.assert_allclose((q @ r).cpu().numpy(), a.cpu().numpy(), atol=1e-12)


@given(m=st.integers(1, 5), n=st.integers(1, 5), batch=st.lists(st.integers(1, 2), max_size=1).map(tuple),
       seed=seeds)
def test_lu_factor_reconstructs_and_gradchecks(device, m, n, batch, seed):
    rng = np.random.default_rng(seed)
    a = _t(rng, batch + (m, n), device)
    P, L, U = flame.linalg.lu(a)
    np.testing.assert_allclose((P @ L @ U).detach().cpu().numpy(), a.detach().cpu().numpy(), atol=1e-12)
    assert np.all(np.abs(np.tril(L.detach().cpu().numpy(), -1)) <= 1 + 1e-12)   # partial pivoting bounds L
    assert gradcheck(lambda t: flame.linalg.lu_factor(t).LU, (a,))


def test_checked_forms_raise_on_request_and_report_otherwise(device):
    sing = flame.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=flame.float64, device=device)
    good = flame.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=flame.float64, device=device)
    both = flame.stack([sing, good])
    inv, info = flame.linalg.inv_ex(both)
    assert info.tolist() == [2, 0] and np.isnan(inv[0].cpu().numpy()).all()
    np.testing.assert_allclose((inv[1] @ good).cpu().numpy(), np.eye(2), atol=1e-12)
    with pytest.raises(flame.linalg.LinAlgError, match="singular"):
        flame.linalg.inv_ex(both, check_errors=True)
    with pytest.raises(flame.linalg.LinAlgError, match="not positive-definite"):
        flame.linalg.cholesky_ex(both, check_errors=True)
    with pytest.raises(flame.linalg.LinAlgError, match="singular"):
        flame.linalg.lu_factor(sing)
    x, info = flame.linalg.solve_ex(both, flame.ones(2, 2, 1, dtype=flame.float64, device=device))
    assert info.tolist() == [2, 0] and np.isnan(x[0].cpu().numpy()).all()
    with pytest.raises(flame.linalg.LinAlgError, match="get_infos=True"):
        flame.lu(sing)
    assert flame.lu(sing, get_infos=True)[2].item() == 2


def test_lstsq_cond_tensor_functions_check_arguments(device):
    a = flame.randn(4, 3, dtype=flame.float64, device=device)
    with pytest.raises(ValueError, match="driver must be one of"):
        flame.linalg.lstsq(a, flame.randn(4, 1, dtype=flame.float64, device=device), driver="gelsx")
    with pytest.raises(ShapeError, match="do not fit"):
        flame.linalg.lstsq(a, flame.randn(3, 1, dtype=flame.float64, device=device))
    sol = flame.linalg.lstsq(a, flame.randn(4, dtype=flame.float64, device=device)).solution
    assert sol.shape == (3,)
    with pytest.raises(ValueError, match="p must be"):
        flame.linalg.cond(a, 3)
    with pytest.raises(ShapeError, match="must equal the product"):
        flame.linalg.tensorinv(flame.randn(2, 3, 4, device=device), ind=1)
    with pytest.raises(ValueError, match="N must be greater than 1"):
        flame.linalg.vander(flame.randn(3, device=device), N=1)


def test_pin_memory_of_a_tensor(device):
    t = flame.ones(3, device=device)
    if device.type == "cuda":
        with pytest.raises(RuntimeError, match="only cpu tensors"):
            t.pin_memory()
        p = flame.ones(3, device="cpu").pin_memory()
        assert p.is_pinned() and p.tolist() == [1.0, 1.0, 1.0] and not flame.ones(3, device="cpu").is_pinned()
    else:
        assert not t.is_pinned()
        if not flame.cuda_is_available():
            with pytest.raises(RuntimeError, match="needs CUDA"):
                t.pin_memory()


def test_dim_order_and_layout(device):
    x = flame.randn(2, 3, 4, device=device)
    assert x.dim_order() == (0, 1, 2) and x.permute(2, 0, 1).dim_order() == (1, 2, 0)
    assert x.layout is flame.strided and repr(flame.strided) == "flame.strided"
    with pytest.raises(ValueError, match="size must be non-negative"):
        x.nonzero_static(size=-1)


def test_more_torch_functions(device):
    x = flame.randn(2, 3, device=device)
    np.testing.assert_array_equal(flame.adjoint(x).cpu().numpy(), x.cpu().numpy().T)
    assert flame.ger(flame.ones(2, device=device), flame.ones(3, device=device)).shape == (2, 3)
    assert flame.get_device(x) == (-1 if device.type == "cpu" else device.index or 0)
    f = flame.fill(x, 2.5)
    assert f.shape == x.shape and (f.cpu().numpy() == 2.5).all() and x.cpu().numpy().min() != 2.5
    buf = bytearray(np.arange(4, dtype=np.float32).tobytes())
    t = flame.frombuffer(buf, dtype=flame.float32, offset=4, count=2)
    assert t.tolist() == [1.0, 2.0]
    y = x * 1
    flame.addmv_(y[:, 0], x, flame.ones(3, device=device))
    np.testing.assert_allclose(y[:, 0].cpu().numpy(), x.cpu().numpy()[:, 0] + x.cpu().numpy().sum(1), rtol=1e-6)


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), scale=st.sampled_from([0.5, 8.0, 45.0]),
       seed=seeds)
def test_bessel_i_gradcheck_across_the_series_and_the_expansion(device, shape, scale, seed):
    rng = np.random.default_rng(seed)
    x = _t(rng, shape, device, -scale, scale)
    for fn in (flame.special.i0e, flame.special.i1e) + ((flame.i0, flame.special.i1) if scale < 40 else ()):
        assert gradcheck(fn, (x,), rtol=1e-4)
    a = x.detach().cpu().numpy()
    np.testing.assert_allclose(flame.i0(x.detach()).cpu().numpy(), np.i0(a), rtol=2e-15)


def test_incomplete_gamma_against_mpmath(device):
    # mpmath.gammainc(a, 0, x, regularized=True) at 40 digits
    a = flame.tensor([75.49629639970996, 117.25313455272894, 55.78594575327693, 2.5, 0.5], dtype=flame.float64,
                     device=device)
    x = flame.tensor([77.95456478065483, 126.05574174801717, 48.505375394539925, 1.0, 30.0], dtype=flame.float64,
                     device=device)
    want = [0.6248260414032623, 0.795038154370844, 0.16463684629767134, 0.15085496391539036, 0.9999999999999905]
    np.testing.assert_allclose(flame.special.gammainc(a, x).cpu().numpy(), want, rtol=1e-13)
    np.testing.assert_allclose(flame.special.gammaincc(a, x).cpu().numpy()[:4], 1 - np.array(want[:4]), rtol=1e-12)
    xg = x.clone().requires_grad_()
    with pytest.raises(flame.AutogradError, match="not implemented"):
        flame.special.gammainc(a.clone().requires_grad_(), xg).sum().backward()
    assert gradcheck(lambda t: flame.special.gammainc(a[3:4], t), (xg[3:4].detach().requires_grad_(),))
