"""group_norm_silu = silu(group_norm(x)) fused (act="silu" on the GroupNorm kernels): the reference against float64
NumPy, the op against the two ops in sequence, gradients (float64 gradcheck, create_graph), kernels vs reference."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, grad_mag, rand

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import gradcheck, gradgradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import groupnorm as K
from flame_core.kernels import norms as N
from flame_core.ops.norms import group_norm, group_norm_silu


def _gn_silu64(x, g, w, b, eps):
    """float64 forward and its gradient by hand: z = xhat w + b, y = z sigmoid(z); returns (y, vjp)."""
    n, c = x.shape[:2]
    shape = (1, c) + (1,) * (x.ndim - 2)
    xg = x.reshape(n, g, -1)
    rstd = 1 / np.sqrt(xg.var(-1, keepdims=True) + eps)
    xh = ((xg - xg.mean(-1, keepdims=True)) * rstd).reshape(x.shape)
    z = xh * w.reshape(shape) + b.reshape(shape)
    s = 1 / (1 + np.exp(-z))

    def vjp(dy):
        dz = dy * s * (1 + z * (1 - s))
        red = (0,) + tuple(range(2, x.ndim))
        dw, db = (dz * xh).sum(red), dz.sum(red)
        gw = (dz * w.reshape(shape)).reshape(n, g, -1)
        xhg = xh.reshape(n, g, -1)
        dx = rstd * (gw - gw.mean(-1, keepdims=True) - xhg * (gw * xhg).mean(-1, keepdims=True))
        return dx.reshape(x.shape), dw, db
    return z * s, vjp


def test_reference_matches_float64(rng):
    x = rng.standard_normal((3, 12, 5, 3)) * 2 + 4
    w, b, dy = rng.standard_normal(12), rng.standard_normal(12), rng.standard_normal((3, 12, 5, 3))
    y, mean, rstd = K.group_norm_forward(x, 4, w, b, 1e-5, act="silu")
    want, vjp = _gn_silu64(x, 4, w, b, 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, x.reshape(3, 4, -1).mean(-1), rtol=1e-14)
    got = K.group_norm_backward(dy, x, 4, w, mean, rstd, b, act="silu")
    for g_, w_, what in zip(got, vjp(dy), ("dx", "dweight", "dbias")):
        np.testing.assert_allclose(g_, w_, rtol=1e-10, atol=1e-12, err_msg=what)


def test_reference_float32_without_affine(rng):
    """No weight / bias: z = xhat; float32 input computes in float32 and returns float32."""
    x = (rng.standard_normal((1, 7, 9)) * 3 - 1).astype(np.float32)
    y, mean, rstd = K.group_norm_forward(x, 1, None, None, 1e-5, act="silu")
    want, vjp = _gn_silu64(x.astype(np.float64), 1, np.ones(7), np.zeros(7), 1e-5)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-6)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx, dw, db = K.group_norm_backward(dy, x, 1, None, mean, rstd, None, act="silu")
    assert dw is None and db is None and dx.dtype == np.float32
    np.testing.assert_allclose(dx, vjp(dy.astype(np.float64))[0], rtol=1e-4, atol=1e-5)


def test_errors():
    x = np.zeros((2, 6, 4), np.float32)
    with pytest.raises(ValueError, match="act.*'gelu'"):
        K.group_norm_forward(x, 3, None, None, 1e-5, act="gelu")
    with pytest.raises(ShapeError, match=r"6 channels.*4 groups"):
        K.group_norm_forward(x, 4, None, None, 1e-5, act="silu")
    _, mean, rstd = K.group_norm_forward(x, 3, None, None, 1e-5, act="silu")
    with pytest.raises(ShapeError, match=r"gradient shape \(2, 6, 3\).*\(2, 6, 4\)"):
        K.group_norm_backward(np.zeros((2, 6, 3), np.float32), x, 3, None, mean, rstd, None, act="silu")
    with pytest.raises(ShapeError, match="bias"):
        F.group_norm_silu(flame.tensor(x), 3, None, flame.tensor(np.zeros(5, np.float32)))


@settings(deadline=None, max_examples=25)
@given(n=st.integers(1, 3), g=st.integers(1, 3), cpg=st.integers(1, 3), spatial=st.sampled_from([(), (3,), (2, 3)]),
       affine=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_gradcheck(n, g, cpg, spatial, affine, seed):
    rng = np.random.default_rng(seed)
    c = g * cpg
    assume(cpg * int(np.prod(spatial)) >= 2)  # one element per group normalises to exactly zero
    x = flame.tensor(rng.standard_normal((n, c) + spatial) * 2 + 1, dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True) if affine else None
    b = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True) if affine else None
    assert gradcheck(lambda a, ww, bb: F.group_norm_silu(a, g, ww, bb, eps=1e-5), (x, w, b))


def test_double_backward():
    rng = np.random.default_rng(11)
    x = flame.tensor(rng.standard_normal((2, 4, 3)), dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal(4), dtype=flame.float64, requires_grad=True)
    b = flame.tensor(rng.standard_normal(4), dtype=flame.float64, requires_grad=True)
    assert gradgradcheck(lambda a, ww, bb: group_norm_silu(a, 2, ww, bb, eps=1e-5), (x, w, b))


@pytest.mark.parametrize("shape,g", [((3, 12, 5, 7), 4), ((1, 96, 3, 5), 32), ((2, 7, 11), 1)])
def test_matches_group_norm_then_silu(device, rng, shape, g):
    """Forward and every gradient equal the two ops in sequence (float32, on the device under test)."""
    c = shape[1]
    data = (rng.standard_normal(shape) * 2 + 1, rng.standard_normal(c) + 1, rng.standard_normal(c))
    x, w, b = (flame.tensor(a, dtype=flame.float32, device=device, requires_grad=True) for a in data)
    gout = flame.tensor(rng.standard_normal(shape), dtype=flame.float32, device=device)
    y = group_norm_silu(x, g, w, b, eps=1e-5)
    (y * gout).sum().backward()
    fused = [y.detach().numpy()] + [t.grad.numpy().copy() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    y2 = F.silu(group_norm(x, g, w, b, eps=1e-5))
    (y2 * gout).sum().backward()
    want = [y2.detach().numpy()] + [t.grad.numpy() for t in (x, w, b)]
    for got, ref, what in zip(fused, want, ("y", "dx", "dweight", "dbias")):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=what)


def test_bias_without_grad(device, rng):
    """A bias that needs no gradient still enters z; its gradient is not returned."""
    shape, g = (2, 8, 3, 3), 4
    x = flame.tensor(rng.standard_normal(shape), dtype=flame.float32, device=device, requires_grad=True)
    w = flame.tensor(rng.standard_normal(8), dtype=flame.float32, device=device, requires_grad=True)
    b = flame.tensor(rng.standard_normal(8) * 2, dtype=flame.float32, device=device)
    group_norm_silu(x, g, w, b).sum().backward()
    assert b.grad is None
    _, vjp = _gn_silu64(x.detach().numpy().astype(np.float64), g, w.detach().numpy().astype(np.float64),
                        b.numpy().astype(np.float64), 1e-5)
    dx, dw, _ = vjp(np.ones(shape))
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), dw, rtol=1e-4, atol=1e-4)


def test_half_input_keeps_z_in_float32(device):
    """bfloat16 input: the fused op rounds once (silu(z) with z in float32); the two ops round z first."""
    rng = np.random.default_rng(3)
    x = flame.tensor(rng.standard_normal((1, 4, 64)) * 3, dtype=flame.bfloat16, device=device)
    y = group_norm_silu(x, 2)
    assert y.dtype == flame.bfloat16
    want, _ = _gn_silu64(x.float().numpy().astype(np.float64), 2, np.ones(4), np.zeros(4), 1e-5)
    err = np.abs(y.float().numpy() - want)
    assert err.max() <= 2 ** -8 * np.abs(want).max()  # one bfloat16 rounding


# ragged: channel counts of odd factors, odd and prime spatial sizes, batch 1 and 3, groups 1 / 4 / 32; hw % 8 == 0
# (16-byte vectors) and not; one group too large for the cluster's shared memory (split path whatever the switch)
SHAPES = [((1, 7, 5, 3), 1), ((3, 28, 9, 11), 4), ((1, 96, 13, 7), 32), ((3, 36, 17), 4), ((3, 160, 31, 29), 32),
          ((1, 20, 64, 64), 4), ((3, 64, 16, 16), 32), ((1, 12, 97, 95), 4), ((1, 32, 256, 256), 1)]
PATHS = ["reg", "cluster", "cluster2", "split", "cluster_sums", "split_sums"]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("params", ["none", "fp32", "same"])
@pytest.mark.parametrize("path", PATHS)
def test_group_norm_silu_kernel(ab, rng, monkeypatch, dt, shape, g, params, path):
    import cupy as cp
    monkeypatch.setattr(K, "use_cluster", not path.startswith("split"))  # cluster: sm_90+ only (else split)
    monkeypatch.setattr(K, "use_gn_reg", path == "reg")
    monkeypatch.setattr(K, "gn_one_pass", 2 if path == "cluster2" else 0)
    monkeypatch.setattr(N, "single_launch_sums", path.endswith("_sums"))
    d = DTYPES[dt]
    pdt = np.float32 if params == "fp32" else d
    x, dy = rand(rng, shape, d, loc=1.5, scale=2.0), rand(rng, shape, d)
    w = cp.asarray(rand(rng, shape[1:2], pdt, loc=1.0)) if params != "none" else None
    b = cp.asarray(rand(rng, shape[1:2], pdt, scale=2.0)) if params != "none" else None
    (yk, mk, rk), (yr, mr, rr) = ab(lambda a: K.group_norm_forward(a, g, w, b, 1e-5, act="silu"), x)
    assert yk.dtype == d
    assert_close(yk, yr, dt, "y", scale=2)
    assert_close(mk, mr, "float32", "mean", scale=10)
    assert_close(rk, rr, "float32", "rstd", scale=10)
    (dxk, dwk, dbk), (dxr, dwr, dbr) = ab(
        lambda gg, a: K.group_norm_backward(gg, a, g, w, mr, rr, b, act="silu"), dy, x)
    assert dxk.dtype == d
    # |silu'| <= 1.1: the terms of dx are bounded as for the plain norm
    assert_close(dxk, dxr, dt, "dx", scale=4, mag=1.1 * grad_mag(dy, rr, w))
    if params != "none":
        tol = "float32" if pdt == np.float32 else dt
        assert dwk.dtype == pdt and dbk.dtype == pdt
        assert_close(dwk, dwr, tol, "dweight", scale=50)
        assert_close(dbk, dbr, tol, "dbias", scale=50)
    else:
        assert dwk is None and dbk is None


@pytest.mark.gpu
def test_fused_is_one_launch_on_the_cluster_path(rng, monkeypatch):
    """On sm_90+ the fused forward is the one cluster kernel the plain GroupNorm takes (silu costs no pass)."""
    import cupy as cp

    from flame_core.kernels import launching
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    x = cp.asarray(rand(rng, (2, 320, 32, 32), DTYPES["bfloat16"]))
    monkeypatch.setattr(K, "use_cluster", True)
    before = launching.launches
    K.group_norm_forward(x, 32, None, None, 1e-5, act="silu")
    assert launching.launches - before == 1
