"""GroupNorm on (N, C, *spatial): reference vs float64, gradients, kernels vs reference."""
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, grad_mag, rand

import flame_core as flame
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import groupnorm as K
from flame_core.kernels import norms as N
from flame_core.ops.norms import group_norm


def _gn64(x, g, w, b, eps):
    n, c = x.shape[:2]
    xg = x.reshape(n, g, -1)
    y = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return y.reshape(x.shape) * w.reshape(shape) + b.reshape(shape)


def test_reference_matches_float64(rng):
    x = rng.standard_normal((2, 6, 5, 3)) * 2 + 4
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    y, mean, rstd = K.group_norm_forward(x, 3, w, b, 1e-5)
    np.testing.assert_allclose(y, _gn64(x, 3, w, b, 1e-5), rtol=1e-12, atol=1e-12)
    assert mean.shape == (2, 3) and rstd.shape == (2, 3)
    np.testing.assert_allclose(mean, x.reshape(2, 3, -1).mean(-1), rtol=1e-14)


def test_errors_name_shapes():
    with pytest.raises(ShapeError, match=r"6 channels.*\(2, 6, 4\).*4 groups"):
        K.group_norm_forward(np.zeros((2, 6, 4), np.float32), 4, None, None, 1e-5)
    with pytest.raises(ShapeError, match="weight"):
        K.group_norm_forward(np.zeros((2, 6, 4), np.float32), 3, np.ones(5, np.float32), None, 1e-5)


@given(n=st.integers(1, 2), g=st.integers(1, 3), cpg=st.integers(1, 2), spatial=st.sampled_from([(), (3,), (2, 2)]),
       affine=st.booleans())
def test_gradcheck(n, g, cpg, spatial, affine):
    rng = np.random.default_rng(n * 100 + g * 10 + cpg)
    c = g * cpg
    assume(cpg * int(np.prod(spatial)) >= 2)  # one element per group normalises to exactly zero
    x = flame.tensor(rng.standard_normal((n, c) + spatial) + 1, dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True) if affine else None
    b = flame.tensor(rng.standard_normal(c), dtype=flame.float64, requires_grad=True) if affine else None
    assert gradcheck(lambda a, ww, bb: group_norm(a, g, ww, bb, eps=1e-5), (x, w, b))


def test_fused_grads_match_composed_ops(device, rng):
    shape, g = (2, 8, 4, 5), 4
    x, w, b = (flame.tensor(a, dtype=flame.float32, device=device, requires_grad=True) for a in
               (rng.standard_normal(shape) * 2 + 1, rng.standard_normal(8), rng.standard_normal(8)))
    gout = flame.tensor(rng.standard_normal(shape), dtype=flame.float32, device=device)
    (group_norm(x, g, w, b, eps=1e-5) * gout).sum().backward()
    fused = [t.grad.numpy().copy() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    xg = x.reshape(2, g, -1)
    xc = xg - xg.mean(-1, keepdim=True)
    y = (xc * ((xc * xc).mean(-1, keepdim=True) + 1e-5).rsqrt()).reshape(shape)
    y = y * w.reshape(1, 8, 1, 1) + b.reshape(1, 8, 1, 1)
    (y * gout).sum().backward()
    for got, t in zip(fused, (x, w, b)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_double_backward():
    from flame_core.autograd import gradgradcheck
    rng = np.random.default_rng(7)
    x = flame.tensor(rng.standard_normal((1, 4, 3)), dtype=flame.float64, requires_grad=True)
    w = flame.tensor(rng.standard_normal(4), dtype=flame.float64, requires_grad=True)
    assert gradgradcheck(lambda a, ww: group_norm(a, 2, ww, None, eps=1e-5), (x, w))


SHAPES = [((1, 4, 1), 2), ((2, 6, 7), 3), ((3, 32, 5, 5), 32), ((2, 64, 9, 11), 8), ((2, 320, 32, 32), 32),
          ((1, 128, 64, 64), 32), ((5, 12, 3, 3, 3), 4), ((1, 24, 40, 40), 8), ((1, 80, 128, 128), 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("path", ["reg", "cluster", "cluster1", "cluster2", "split"])
def test_group_norm_kernel(ab, rng, monkeypatch, dt, shape, g, affine, path):
    import cupy as cp
    monkeypatch.setattr(K, "use_cluster", path != "split")  # cluster: sm_90+ only (else the split path runs)
    monkeypatch.setattr(K, "use_gn_reg", path == "reg")     # register slices where they fit, else shared memory
    # shared-memory forward: 2 statistics passes (cluster), 1 (cluster1), 1 as the slice loads (cluster2)
    monkeypatch.setattr(K, "gn_one_pass", int(path[-1]) if path in ("cluster1", "cluster2") else 0)
    d = DTYPES[dt]
    x, dy = rand(rng, shape, d, loc=1.5, scale=2.0), rand(rng, shape, d)
    w = cp.asarray(rand(rng, shape[1:2], np.float32, loc=1.0)) if affine else None
    b = cp.asarray(rand(rng, shape[1:2], np.float32)) if affine else None
    (yk, mk, rk), (yr, mr, rr) = ab(lambda a: K.group_norm_forward(a, g, w, b, 1e-5), x)
    assert_close(yk, yr, dt, "y")
    assert_close(mk, mr, "float32", "mean", scale=10)
    assert_close(rk, rr, "float32", "rstd", scale=10)
    (dxk, dwk, dbk), (dxr, dwr, dbr) = ab(lambda gg, a: K.group_norm_backward(gg, a, g, w, mr, rr, b), dy, x)
    assert_close(dxk, dxr, dt, "dx", scale=3, mag=grad_mag(dy, rr, w))
    if affine:
        assert_close(dwk, dwr, "float32", "dweight", scale=50)
        assert_close(dbk, dbr, "float32", "dbias", scale=50)


@pytest.mark.gpu
def test_cluster_path_is_one_launch_per_pass(rng, monkeypatch):
    """On sm_90+ a group that fits the cluster's shared memory is normalised in one kernel (the backward too, its
    dweight / dbias column sums included); without clusters (use_cluster False) the split path takes three."""
    import cupy as cp

    from flame_core.kernels import launching
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    x = cp.asarray(rand(rng, (2, 320, 32, 32), DTYPES["bfloat16"]))
    for cluster, want in ((True, 1), (False, 3)):
        monkeypatch.setattr(K, "use_cluster", cluster)
        before = launching.launches
        K.group_norm_forward(x, 32, None, None, 1e-5)
        assert launching.launches - before == want


@pytest.mark.gpu
def test_register_slice_plan(monkeypatch):
    """The register-slice kernels take aligned 16-byte-vector slices of <= 10 * GN_THREADS vectors (V the smallest
    instantiated slot count that holds the slice), nothing else."""
    import cupy as cp
    bf = DTYPES["bfloat16"]
    x = cp.empty((2, 320, 128, 128), bf)
    assert K._gn_reg_v(x, 10, 128 * 128) == 10         # SDXL 1024 px: 20480 elements = 2560 vectors per block
    assert K._gn_reg_v(x, 20, 64 * 64) == 6            # 10240 elements: 1280 vectors
    assert K._gn_reg_v(x, 40, 32 * 32) == 4            # 5120 elements: 640 vectors
    assert K._gn_reg_v(x, 11, 128 * 128) is None       # 2816 vectors: more than 10 slots per thread
    assert K._gn_reg_v(x, 2, 99) is None               # hw % 8: not the vector path
    assert K._gn_reg_v(x[..., 1:], 2, 128) is None     # not 16-byte aligned
    assert K._gn_reg_v(x.astype(np.float32), 10, 128 * 128) is None  # 5120 fp32 vectors
    monkeypatch.setattr(K, "use_gn_reg", False)
    assert K._gn_reg_v(x, 10, 128 * 128) is None


@pytest.mark.parametrize("shape,g,dt,arrays,fits", [
    ((2, 320, 128, 128), 32, "bfloat16", 1, True),    # SDXL 1024 px: 10 x 16384 per group, 40 KiB per block
    ((2, 320, 128, 128), 32, "bfloat16", 2, True),    # backward: x and dy, 80 KiB per block
    ((1, 512, 512, 512), 32, "bfloat16", 1, False),   # VAE decoder: 16 x 262144 per group
    ((2, 64, 9, 11), 8, "float32", 2, True),          # hw % 4 != 0: scalar slices
])
def test_cluster_shared_memory_plan(monkeypatch, shape, g, dt, arrays, fits):
    monkeypatch.setattr(N, "_device_props", lambda: (65536, 2048, 233472, 232448, 90))
    x = np.empty(shape, DTYPES[dt])
    n, c = shape[:2]
    hw = x.size // (n * c)
    smem = K._gn_cluster_smem(x, c // g, hw, arrays)
    assert (smem is not None) == fits
    if fits:
        per_block = -(-(c // g) * hw // K.GN_CL)
        assert K.GN_HEAD + arrays * per_block * x.dtype.itemsize <= smem <= 232448 - 1024
    monkeypatch.setattr(N, "_device_props", lambda: (65536, 2048, 233472, 232448, 80))
    assert K._gn_cluster_smem(x, c // g, hw, arrays) is None   # no clusters before sm_90
    monkeypatch.setattr(N, "_device_props", lambda: (65536, 2048, 233472, 232448, 90))
    monkeypatch.setattr(K, "use_cluster", False)
    assert K._gn_cluster_smem(x, c // g, hw, arrays) is None
