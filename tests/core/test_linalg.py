"""flame_core.linalg (torch.linalg's names): norms, solve, inv, svd against numpy.linalg on random batched shapes,
float64 gradient checks, and the errors bad input gets."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
from flame_core import linalg
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.errors import DTypeError, ShapeError

INF = float("inf")


def _f64(a, device, grad=False):
    return flame.tensor(np.asarray(a, dtype=np.float64), dtype=flame.float64, device=device, requires_grad=grad)


def _well_conditioned(rng, shape):
    n = shape[-1]
    return rng.normal(size=shape) + 3 * np.eye(n)


# ----------------------------------------------------------------------------- norms
@st.composite
def shape_dims(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    kind = draw(st.sampled_from(["none", "int", "tuple"]))
    if kind == "none":
        return shape, None
    if kind == "int":
        return shape, draw(st.integers(-len(shape), len(shape) - 1))
    return shape, tuple(draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True)))


@given(sd=shape_dims(), ord=st.sampled_from([2, 1, 3, 0.5, -1, INF, -INF, 0]), keepdim=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_vector_norm_matches_numpy(device, sd, ord, keepdim, seed):
    shape, dim = sd
    a = np.random.default_rng(seed).choice([-2.0, -0.5, 0.0, 0.7, 1.5], size=shape)
    axes = tuple(range(len(shape))) if dim is None else ((dim,) if isinstance(dim, int) else dim)
    flat = np.moveaxis(a, axes, tuple(range(-len(axes), 0)))
    flat = flat.reshape(flat.shape[:flat.ndim - len(axes)] + (-1,))
    with np.errstate(divide="ignore"):
        ref = np.linalg.norm(flat, ord, axis=-1)
    if keepdim:
        ref = np.expand_dims(ref, tuple(sorted(d % len(shape) for d in axes)))
    got = linalg.vector_norm(_f64(a, device), ord, dim, keepdim)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12)


@given(sd=shape_dims(), ord=st.sampled_from([2, 1, 3, 0.5, -1.5]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=15)
def test_vector_norm_gradcheck(device, sd, ord, seed):
    shape, dim = sd
    a = np.random.default_rng(seed).uniform(0.3, 2.0, size=shape) * np.random.default_rng(seed + 1).choice(
        [-1, 1], size=shape)  # away from 0, where |x|^p is not smooth
    assert gradcheck(lambda t: linalg.vector_norm(t, ord, dim), (_f64(a, device, True),))


def test_vector_norm_zero_gradient_and_dtype(device):
    x = _f64([0.0, 0.0, 0.0], device, True)
    linalg.vector_norm(x).backward()
    np.testing.assert_array_equal(x.grad.numpy(), 0.0)  # the subgradient 0 at the origin (PyTorch)
    h = flame.tensor([3.0, 4.0], dtype=flame.float16, device=device)
    assert linalg.vector_norm(h).dtype == flame.float16
    assert linalg.vector_norm(h, dtype=flame.float64).dtype == flame.float64
    assert linalg.vector_norm(h, axis=0, keepdims=True).shape == (1,)
    with pytest.raises(DTypeError, match="expected a floating point tensor, got int64"):
        linalg.vector_norm(flame.tensor([1, 2], device=device))
    with pytest.raises(ValueError, match="ord must be a number"):
        linalg.vector_norm(h.float(), "fro")


@given(batch=st.sampled_from([(), (2,), (2, 1)]), m=st.integers(1, 4), n=st.integers(1, 4),
       ord=st.sampled_from(["fro", "nuc", 2, -2, 1, -1, INF, -INF]), keepdim=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=30)
def test_matrix_norm_matches_numpy_and_gradcheck(device, batch, m, n, ord, keepdim, seed):
    a = np.random.default_rng(seed).normal(size=batch + (m, n))
    got = linalg.matrix_norm(_f64(a, device), ord, keepdim=keepdim)
    np.testing.assert_allclose(got.numpy(), np.linalg.norm(a, ord, axis=(-2, -1), keepdims=keepdim), rtol=1e-10)
    assert gradcheck(lambda t: linalg.matrix_norm(t, ord), (_f64(a, device, True),))


def test_matrix_norm_other_dims_and_norm_dispatch(device, rng):
    a = rng.normal(size=(3, 2, 4))
    x = _f64(a, device)
    for ord in ("fro", "nuc", 1, INF, -2):
        got = linalg.matrix_norm(x, ord, dim=(2, 0), keepdim=True)
        ref = np.linalg.norm(a, ord, axis=(2, 0), keepdims=True)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10)
    np.testing.assert_allclose(linalg.norm(x).numpy(), np.linalg.norm(a.reshape(-1)))
    np.testing.assert_allclose(linalg.norm(x, dim=1).numpy(), np.linalg.norm(a, axis=1))
    np.testing.assert_allclose(linalg.norm(x, 1, dim=(0, 2)).numpy(), np.linalg.norm(a, 1, axis=(0, 2)))
    np.testing.assert_allclose(linalg.norm(x[0], "nuc").numpy(), np.linalg.norm(a[0], "nuc"))
    np.testing.assert_allclose(linalg.norm(x[0, 0], 3).numpy(), np.linalg.norm(a[0, 0], 3))
    with pytest.raises(ShapeError, match="input must be 1-D or 2-D"):
        linalg.norm(x, 2)
    with pytest.raises(ValueError, match="ord must be 'fro', 'nuc'"):
        linalg.matrix_norm(x, 3)
    with pytest.raises(ValueError, match="dims must be different"):
        linalg.matrix_norm(x, dim=(1, -2))


# ----------------------------------------------------------------------------- solve / inv
@given(n=st.integers(1, 4), k=st.integers(1, 3), batch=st.sampled_from([((), ()), ((2,), ()), ((), (3,)),
                                                                        ((2, 1), (3,)), ((2,), (2,))]),
       vector=st.booleans(), seed=st.integers(0, 2 ** 16))
@settings(max_examples=20)
def test_solve_matches_numpy_and_gradcheck(device, n, k, batch, vector, seed):
    rng = np.random.default_rng(seed)
    A = _well_conditioned(rng, batch[0] + (n, n))
    B = rng.normal(size=batch[0] + (n,) if vector else batch[1] + (n, k))
    X = linalg.solve(_f64(A, device), _f64(B, device))
    vector = vector or B.shape == A.shape[:-1]  # PyTorch's rule: then B is a batch of vectors
    ref = np.linalg.solve(A, B[..., None])[..., 0] if vector else np.linalg.solve(A, B)
    np.testing.assert_allclose(X.numpy(), ref, rtol=1e-10, atol=1e-12)
    assert gradcheck(linalg.solve, (_f64(A, device, True), _f64(B, device, True)))
    Bt = rng.normal(size=batch[1] + (k, n))
    if Bt.shape != A.shape[:-1]:  # else a vector right-hand side, which left=False refuses (as PyTorch)
        Xl = linalg.solve(_f64(A, device), _f64(Bt, device), left=False)
        np.testing.assert_allclose((Xl.numpy() @ A), np.broadcast_to(Bt, Xl.shape), rtol=1e-9, atol=1e-10)


@given(n=st.integers(1, 4), batch=st.sampled_from([(), (3,), (2, 2)]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=15)
def test_inv_matches_numpy_and_gradcheck(device, n, batch, seed):
    A = _well_conditioned(np.random.default_rng(seed), batch + (n, n))
    np.testing.assert_allclose(linalg.inv(_f64(A, device)).numpy(), np.linalg.inv(A), rtol=1e-10, atol=1e-12)
    assert gradcheck(linalg.inv, (_f64(A, device, True),))


def test_solve_inv_double_backward_and_errors(device, rng):
    A = _f64(_well_conditioned(rng, (3, 3)), device, True)
    assert gradgradcheck(linalg.inv, (A,))
    assert gradgradcheck(lambda a: linalg.solve(a, flame.ones(3, dtype=flame.float64, device=device)), (A,))
    sing = flame.tensor([[1.0, 2.0], [2.0, 4.0]], device=device)
    with pytest.raises(linalg.LinAlgError, match=r"linalg.inv: the matrix is singular \(input of shape \(2, 2\);"):
        linalg.inv(sing)
    with pytest.raises(linalg.LinAlgError, match="linalg.solve: A is singular"):
        linalg.solve(sing, flame.ones(2, device=device))
    assert isinstance(linalg.LinAlgError("x"), RuntimeError)
    with pytest.raises(DTypeError, match=r"linalg.inv: supports float32 and float64, got bfloat16 \(cast"):
        linalg.inv(flame.eye(2, device=device).bfloat16())
    with pytest.raises(ShapeError, match=r"expected a batch of square matrices, got shape \(2, 3\)"):
        linalg.solve(flame.zeros(2, 3, device=device), flame.zeros(2, device=device))
    with pytest.raises(ShapeError, match=r"A \(2, 2\) and B \(3, 1\) do not fit"):
        linalg.solve(flame.eye(2, device=device), flame.zeros(3, 1, device=device))
    with pytest.raises(ShapeError, match="left=False needs B"):
        linalg.solve(flame.eye(2, device=device), flame.zeros(2, device=device), left=False)
    with pytest.raises(DTypeError, match="same dtype"):
        linalg.solve(flame.eye(2, device=device), flame.zeros(2, dtype=flame.float64, device=device))


# ----------------------------------------------------------------------------- svd
@given(batch=st.sampled_from([(), (2,)]), m=st.integers(1, 4), n=st.integers(1, 4), full=st.booleans(),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=20)
def test_svd_reconstructs_and_matches_numpy(device, batch, m, n, full, seed):
    a = np.random.default_rng(seed).normal(size=batch + (m, n))
    U, S, Vh = linalg.svd(_f64(a, device), full_matrices=full)
    k = min(m, n)
    assert U.shape == batch + (m, m if full else k) and Vh.shape == batch + (n if full else k, n)
    np.testing.assert_allclose(S.numpy(), np.linalg.svd(a, compute_uv=False), rtol=1e-10, atol=1e-12)
    u, vh = U.numpy()[..., :k], Vh.numpy()[..., :k, :]
    np.testing.assert_allclose((u * S.numpy()[..., None, :]) @ vh, a, atol=1e-10)
    np.testing.assert_allclose(np.swapaxes(U.numpy(), -1, -2) @ U.numpy(), np.broadcast_to(np.eye(U.shape[-1]),
                               U.shape[:-2] + (U.shape[-1],) * 2), atol=1e-10)
    np.testing.assert_allclose(linalg.svdvals(_f64(a, device)).numpy(), S.numpy(), rtol=1e-12)


@given(m=st.integers(1, 4), n=st.integers(1, 4), full=st.booleans(), seed=st.integers(0, 2 ** 16))
@settings(max_examples=15)
def test_svd_gradcheck(device, m, n, full, seed):
    # losses that do not depend on the signs of the singular vectors (each column pair can flip together)
    a = _f64(np.random.default_rng(seed).normal(size=(m, n)), device, True)
    k = min(m, n)
    assert gradcheck(lambda t: linalg.svdvals(t), (a,))
    assert gradcheck(lambda t: linalg.svd(t, full_matrices=full).S, (a,))
    assert gradcheck(lambda t: [(linalg.svd(t, full)[0][..., :k] ** 2), (linalg.svd(t, full)[2][..., :k, :] ** 2)],
                     (a,))
    assert gradcheck(lambda t: linalg.svd(t, False).U @ linalg.svd(t, False).Vh, (a,))


def test_svd_repeated_singular_values_keep_the_gradient_of_s(device):
    x = flame.eye(3, dtype=flame.float64, device=device).requires_grad_()
    U, S, Vh = linalg.svd(x)
    S.sum().backward()  # d(sum S)/dA = U Vh: finite although every singular value is 1
    np.testing.assert_allclose(x.grad.numpy(), (U @ Vh).detach().numpy(), atol=1e-12)
