"""Single-launch column sums ("last block done", last_arrival in cuda_src/common.cuh): the backward kernels of
layer / rms norm, modulate / gated residual and GroupNorm sum their weight-gradient partial rows in the same launch.
Against the reference and the separate column-sum launch on ragged shapes (one and two levels of norms.parts_finish),
deterministic and with the counters back at zero after every call, and inside a CUDA graph (captured, replayed with
new inputs) equal to the eager result."""
import numpy as np
import pytest
from kernel_utils import DTYPES, assert_close, rand

from flame_core.kernels import column_sum as CS
from flame_core.kernels import groupnorm as G
from flame_core.kernels import launching as KL
from flame_core.kernels import loader as L
from flame_core.kernels import modulate as M
from flame_core.kernels import norms as K

pytestmark = pytest.mark.gpu


def _cp():
    from flame_core import backend
    return backend.cupy


def _dev(*arrays):
    cp = _cp()
    return [None if a is None else cp.asarray(a) for a in arrays]


def _counters_zero():
    cp = _cp()
    cp.cuda.get_current_stream().synchronize()
    for buf in CS._counters.values():
        assert int(buf.max()) == 0, "a counter was left non-zero"


def _launches(fn):
    before = KL.launches
    out = fn()
    return out, KL.launches - before


def _ab_fused(monkeypatch, module, fn):
    """(fused result, launches), (column_sum result, launches), reference result."""
    monkeypatch.setattr(module, "single_launch_sums", True)
    fused = _launches(fn)
    again = fn()
    for a, b in zip(fused[0], again):  # deterministic: the same bits on every call
        if a is not None:
            np.testing.assert_array_equal(_cp().asnumpy(a), _cp().asnumpy(b))
    _counters_zero()
    monkeypatch.setattr(module, "single_launch_sums", False)
    split = _launches(fn)
    monkeypatch.setattr(module, "single_launch_sums", True)
    with L.reference():
        ref = fn()
    return fused, split, ref


# rows x cols: one part row, <= 16 (one level), many (two levels, ragged groups), the looping path (very wide rows),
# scalar columns (cols % vec != 0)
NORM_SHAPES = [(1, 8), (3, 40), (5, 33), (67, 3072), (1500, 3072), (4608, 3072), (40000, 128), (1001, 1000),
               (130, 1000), (3, 20001), (9, 40000)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("kind", ["ln_affine", "ln_fp32", "ln_bias_only", "rms"])
def test_norm_backward_single_launch(monkeypatch, rng, dt, shape, kind):
    d = DTYPES[dt]
    x, dy = rand(rng, shape, d, loc=1.0, scale=2.0), rand(rng, shape, d)
    pdt = np.float32 if kind == "ln_fp32" else d
    w = rand(rng, shape[-1:], pdt, loc=1.0) if kind != "ln_bias_only" else None
    b = rand(rng, shape[-1:], pdt) if kind != "rms" else None
    x, dy, w, b = _dev(x, dy, w, b)
    if kind == "rms":
        _, rs = K.rms_norm_forward(x, w, 1e-6)
        fn = lambda: K.rms_norm_backward(dy, x, w, rs)  # noqa: E731
    else:
        _, mean, rstd = K.layer_norm_forward(x, w, b, 1e-5)
        fn = lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b)  # noqa: E731
    (fused, nf), (split, ns), ref = _ab_fused(monkeypatch, K, fn)
    assert nf == 1 and ns > nf, (nf, ns)
    tol = "float32" if pdt == np.float32 else dt
    for got, alt, want, what in zip(fused[1:], split[1:], ref[1:], ("dweight", "dbias")):
        if want is None:
            assert got is None
            continue
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, want, tol, what, scale=20)
        assert_close(got, alt, tol, what + " vs column_sum", scale=20)
    assert_close(fused[0], split[0], dt, "dx")


MOD_SHAPES = [(1, 1, 8), (2, 5, 7), (3, 33, 64), (1, 4608, 3072), (2, 257, 3072), (4, 9, 40), (1, 1000, 1000)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", MOD_SHAPES)
@pytest.mark.parametrize("mods", ["same", "fp32", "shared"])
def test_modulate_backward_single_launch(monkeypatch, rng, dt, shape, mods):
    d = DTYPES[dt]
    b, _, h = shape
    mshape = (1, 1, h) if mods == "shared" else (b, 1, h)
    md = np.float32 if mods == "fp32" else d
    x, y, g = _dev(rand(rng, shape, d), rand(rng, shape, d), rand(rng, shape, d))
    sh, sc, gt = _dev(rand(rng, mshape, md), rand(rng, mshape, md, scale=0.5), rand(rng, mshape, md))
    tol = "float32" if md == np.float32 else dt
    (fused, nf), (split, ns), ref = _ab_fused(monkeypatch, M, lambda: M.modulate_backward(g, x, sh, sc))
    assert ns == nf + 2
    for i, what in ((1, "dshift"), (2, "dscale")):
        assert fused[i].shape == mshape and fused[i].dtype == md
        assert_close(fused[i], ref[i], tol, what, scale=20)
        assert_close(fused[i], split[i], tol, what + " vs column_sum", scale=20)
    (fused, nf), (split, ns), ref = _ab_fused(monkeypatch, M, lambda: M.gated_residual_backward(g, gt, y))
    assert ns == nf + 1
    assert fused[1].shape == mshape and fused[1].dtype == md
    assert_close(fused[1], ref[1], tol, "dgate", scale=20)
    assert_close(fused[2], ref[2], dt, "dy")


GN_SHAPES = [((1, 4, 1), 2), ((2, 6, 7), 3), ((3, 32, 5, 5), 32), ((2, 64, 9, 11), 8), ((2, 320, 32, 32), 32),
             ((5, 12, 3, 3, 3), 4)]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape,g", GN_SHAPES)
@pytest.mark.parametrize("path", ["cluster", "split"])
@pytest.mark.parametrize("params", ["fp32", "same", "bias_only"])
def test_group_norm_backward_single_launch(monkeypatch, rng, dt, shape, g, path, params):
    monkeypatch.setattr(G, "use_cluster", path == "cluster")
    d = DTYPES[dt]
    pdt = np.float32 if params == "fp32" else d
    x, dy = _dev(rand(rng, shape, d, loc=1.5, scale=2.0), rand(rng, shape, d))
    w = None if params == "bias_only" else _dev(rand(rng, shape[1:2], pdt, loc=1.0))[0]
    b = _dev(rand(rng, shape[1:2], pdt))[0]
    _, mean, rstd = G.group_norm_forward(x, g, w, b, 1e-5)
    (fused, nf), (split, ns), ref = _ab_fused(monkeypatch, K,  # the switch is norms' (shared)
                                              lambda: G.group_norm_backward(dy, x, g, w, mean, rstd, b))
    assert ns > nf
    tol = "float32" if pdt == np.float32 else dt
    for i, what in ((1, "dweight"), (2, "dbias")):
        if ref[i] is None:
            assert fused[i] is None
            continue
        assert fused[i].dtype == ref[i].dtype
        assert_close(fused[i], ref[i], tol, what, scale=50)
        assert_close(fused[i], split[i], tol, what + " vs column_sum", scale=50)


def test_counters_are_per_stream():
    cp = _cp()
    a = CS.reduction_counters(4)
    with cp.cuda.Stream(non_blocking=True):
        b = CS.reduction_counters(4)
        assert b.data.ptr != a.data.ptr
    assert CS.reduction_counters(2).data.ptr == a.data.ptr
    assert CS.reduction_counters(5000).size >= 5000


def _capture_and_replay(fn, inputs, fresh):
    """Capture fn() into a CUDA graph, replay it: equal to the eager result; new values copied into the inputs, the
    replay equals the eager result on them (twice: the counters were reset by the replay before)."""
    from flame_core.cuda import CUDAGraph, graph
    cp = _cp()
    eager = [None if o is None else o.copy() for o in fn()]
    g = CUDAGraph()
    with graph(g):
        out = fn()
    g.replay()
    cp.cuda.Device().synchronize()
    for o, e in zip(out, eager):
        if e is not None:
            np.testing.assert_array_equal(cp.asnumpy(o), cp.asnumpy(e))
    for a, v in zip(inputs, fresh):
        a[...] = v
    want = [None if o is None else o.copy() for o in fn()]
    for _ in range(2):
        g.replay()
        cp.cuda.Device().synchronize()
        for o, e in zip(out, want):
            if e is not None:
                np.testing.assert_array_equal(cp.asnumpy(o), cp.asnumpy(e))
    assert not np.array_equal(cp.asnumpy(want[1]), cp.asnumpy(eager[1]))
    _counters_zero()


@pytest.mark.parametrize("shape", [(1500, 3072), (40000, 128), (5, 33)])
def test_norm_backward_in_cuda_graph(rng, shape):
    d = DTYPES["bfloat16"]
    x, dy, w, b = _dev(rand(rng, shape, d), rand(rng, shape, d), rand(rng, shape[-1:], d, loc=1.0),
                       rand(rng, shape[-1:], d))
    _, mean, rstd = K.layer_norm_forward(x, w, b, 1e-5)
    _capture_and_replay(lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b), [dy], _dev(rand(rng, shape, d)))
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    _capture_and_replay(lambda: K.rms_norm_backward(dy, x, w, rs), [dy], _dev(rand(rng, shape, d)))


def test_modulate_and_group_norm_backward_in_cuda_graph(rng):
    d = DTYPES["bfloat16"]
    x, g = _dev(rand(rng, (2, 300, 3072), d), rand(rng, (2, 300, 3072), d))
    sh, sc = _dev(rand(rng, (2, 1, 3072), d), rand(rng, (2, 1, 3072), d, scale=0.5))
    _capture_and_replay(lambda: M.modulate_backward(g, x, sh, sc), [g], _dev(rand(rng, (2, 300, 3072), d)))
    _capture_and_replay(lambda: M.gated_residual_backward(g, sc, x), [g], _dev(rand(rng, (2, 300, 3072), d)))
    for cluster in (True, False):
        G.use_cluster = cluster
        try:
            xg, dyg = _dev(rand(rng, (2, 64, 16, 16), d, loc=1.0), rand(rng, (2, 64, 16, 16), d))
            w, b = _dev(rand(rng, (64,), np.float32, loc=1.0), rand(rng, (64,), np.float32))
            _, mean, rstd = G.group_norm_forward(xg, 8, w, b, 1e-5)
            _capture_and_replay(lambda: G.group_norm_backward(dyg, xg, 8, w, mean, rstd, b), [dyg],
                                _dev(rand(rng, (2, 64, 16, 16), d)))
        finally:
            G.use_cluster = True
