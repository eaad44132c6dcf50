"""fp8 delayed scaling (flame_core.kernels.fp8_tensor.quantize_delayed / quantize_with_scale): the first call of a
site is current scaling, later calls cast with the factor of the site's history (saturating beyond it) and add their
amax to it; the GPU kernel against the NumPy reference bit for bit, over a sequence of calls, and in a graph."""
import ml_dtypes
import numpy as np
import pytest
from kernel_utils import DTYPES, rand

from flame_core import backend
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import fp8_tensor as T

F = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
RAGGED = [(1,), (7, 9), (33, 130), (257, 1000), (4096, 24)]


def _e4m3(v):
    return np.clip(np.asarray(v, F), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _np(a):
    return backend.to_numpy(a)


def test_the_first_call_is_current_scaling_and_starts_the_history(rng):
    x = rng.standard_normal((16, 24)).astype(F) * 3
    site = T.DelayedScaling(history=4)
    q, s = T.quantize_delayed(x, site)
    qc, sc = T.quantize_per_tensor(x)
    np.testing.assert_array_equal(q, qc)
    np.testing.assert_array_equal(s, sc)
    amax = F(np.abs(x).max())
    st = _np(site.state)
    assert st.shape == (3 + 4,) and st[2] == 0 and st[4:].tolist() == [0, 0, 0]
    np.testing.assert_allclose(st[3], amax, rtol=1e-6)
    np.testing.assert_array_equal(st[:2], sc)


def test_later_calls_cast_with_the_history_factor_and_saturate_beyond_it(rng):
    x = rng.standard_normal((8, 40)).astype(F)
    site = T.DelayedScaling(history=4)
    _, s1 = T.quantize_delayed(x, site)
    y = 2 * x                                        # twice the range the history knows
    q2, s2 = T.quantize_delayed(y, site)
    np.testing.assert_array_equal(s2, s1)            # this call used the first call's pair
    np.testing.assert_array_equal(q2, _e4m3(y * s1[1]))
    sat = np.abs(y * s1[1]) >= 448
    assert sat.any() and (q2[sat] & 0x7F == 0x7E).all()     # saturated to +-448, never NaN
    st = site.state                                  # the next factor comes from the larger amax
    a2 = F(np.abs(y).max())
    assert st[3] == a2 and st[0] == a2 / F(448) and st[1] == F(448) / a2
    q3, s3 = T.quantize_delayed(y, site)
    np.testing.assert_array_equal(s3, [a2 / F(448), F(448) / a2])
    np.testing.assert_array_equal(q3, T.quantize_per_tensor(y)[0])   # the same range: as current scaling


def test_the_factor_is_the_max_over_the_last_history_calls(rng):
    site = T.DelayedScaling(history=3)
    base = rng.standard_normal((4, 16)).astype(F)
    base /= np.abs(base).max()                       # amax exactly 1
    T.quantize_delayed(8 * base, site)               # amax 8 (the first call)
    for k in range(2):                               # amax 1, 1: the 8 is still in the window of 3
        T.quantize_delayed(base, site)
        assert site.state[1] == F(448) / F(8)
    T.quantize_delayed(base, site)                   # the 8 leaves the window
    assert site.state[3:].tolist() == [1, 1, 1] and site.state[1] == F(448)
    site.reset()
    assert site.state is None
    q, s = T.quantize_delayed(4 * base, site)        # after reset: current scaling again
    np.testing.assert_array_equal(s, T.quantize_per_tensor(4 * base)[1])


def test_a_non_finite_call_records_nothing(rng):
    x = rng.standard_normal((4, 8)).astype(F)
    site = T.DelayedScaling(history=2)
    T.quantize_delayed(x, site)
    before = site.state.copy()
    y = x.copy()
    y[1, 2] = np.nan
    y[2, 3] = np.inf
    q, s = T.quantize_delayed(y, site)
    np.testing.assert_array_equal(s, before[:2])
    assert q[1, 2] & 0x7F == 0x7F                    # NaN stays NaN; inf saturates
    assert q[2, 3] == 0x7E
    assert site.state[3] == 0 and site.state[4] == before[3]   # 0 recorded, the old amax shifted
    assert site.state[1] == before[1]                # the factor still from the finite amax


def test_quantize_with_scale_repeats_a_pair_without_touching_anything(rng):
    x = rng.standard_normal((5, 11)).astype(F)
    pair = np.array([F(2) / F(448), F(448) / F(2)], F)
    q, s = T.quantize_with_scale(x, pair)
    np.testing.assert_array_equal(q, _e4m3(x * pair[1]))
    np.testing.assert_array_equal(s, pair)
    assert s is not pair


def test_bad_inputs_are_refused():
    with pytest.raises(DTypeError):
        T.quantize_delayed(np.zeros(4, np.int32), T.DelayedScaling())
    with pytest.raises(DTypeError):
        T.quantize_with_scale(np.zeros(4, np.int64), np.ones(2, F))
    with pytest.raises(ValueError):
        T.DelayedScaling(history=0)


def _parts(rng, rows, widths, dtype=F, scale=1.0):
    return [(rng.standard_normal((rows, w)) * scale).astype(dtype) for w in widths]


@pytest.mark.parametrize("widths", [(8,), (16, 24), (5, 3, 7), (64, 64, 64, 192), (3, 4, 5, 6, 7)])
def test_parts_are_quantised_as_their_concatenation_with_one_site(rng, widths):
    one, whole = T.DelayedScaling(history=3), T.DelayedScaling(history=3)
    for scale in (1.0, 3.0, 0.5):
        ps = _parts(rng, 9, widths, scale=scale)
        qp, sp = T.quantize_parts_delayed(ps, one)
        qw, sw = T.quantize_delayed(np.concatenate(ps, axis=1), whole)
        np.testing.assert_array_equal(qp, qw)
        np.testing.assert_array_equal(sp, sw)
        np.testing.assert_array_equal(one.state, whole.state)
    pair = one.state[:2].copy()
    ps = _parts(rng, 9, widths, scale=2.0)
    qp, sp = T.quantize_parts_with_scale(ps, pair)
    qw, sw = T.quantize_with_scale(np.concatenate(ps, axis=1), pair)
    np.testing.assert_array_equal(qp, qw)
    np.testing.assert_array_equal(sp, sw)


def test_parts_checks(rng):
    with pytest.raises(ShapeError, match="one row count"):
        T.quantize_parts_delayed([np.zeros((2, 3), F), np.zeros((3, 3), F)], T.DelayedScaling())
    with pytest.raises(DTypeError):
        T.quantize_parts_with_scale([np.zeros((2, 3), F), np.zeros((2, 3), np.float16)], np.ones(2, F))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("widths", [(16, 24), (5, 3, 7), (64, 64, 64, 192), (3, 4, 5, 6, 7)])
def test_the_parts_kernel_equals_the_reference(rng, dt, widths):
    cp = backend.cupy
    gpu, ref = T.DelayedScaling(history=3), T.DelayedScaling(history=3)
    for scale in (1.0, 4.0, 0.25, 1.0):
        ps = [rand(rng, (33, w), DTYPES[dt], scale=scale) for w in widths]
        qg, sg = T.quantize_parts_delayed([cp.asarray(p) for p in ps], gpu)
        qr, sr = T.quantize_parts_delayed(ps, ref)
        np.testing.assert_array_equal(_np(sg), sr)
        np.testing.assert_array_equal(_np(qg), qr)
        np.testing.assert_array_equal(_np(gpu.state), ref.state)
    pair = ref.state[:2].copy()
    ps = [rand(rng, (33, w), DTYPES[dt], scale=2.0) for w in widths]
    qg, sg = T.quantize_parts_with_scale([cp.asarray(p) for p in ps], cp.asarray(pair))
    qr, sr = T.quantize_parts_with_scale(ps, pair)
    np.testing.assert_array_equal(_np(qg), qr)
    np.testing.assert_array_equal(_np(sg), sr)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", RAGGED)
def test_the_kernel_equals_the_reference_over_a_sequence_of_calls(rng, dt, shape):
    """Five calls on one site (ranges up and down, one non-finite), the kernel's q, scale and whole state against
    the reference run on NumPy copies, bit for bit."""
    cp = backend.cupy
    gpu, ref = T.DelayedScaling(history=3), T.DelayedScaling(history=3)
    for k, scale in enumerate((1.0, 4.0, 0.25, 1.0, 2.0)):
        x = rand(rng, shape, DTYPES[dt], scale=scale)
        if k == 3:
            x.reshape(-1)[0] = np.nan
        qg, sg = T.quantize_delayed(cp.asarray(x), gpu)
        qr, sr = T.quantize_delayed(x, ref)
        np.testing.assert_array_equal(_np(sg), sr)
        np.testing.assert_array_equal(_np(qg), qr)
        np.testing.assert_array_equal(_np(gpu.state), ref.state)
    pair = ref.state[:2].copy()
    x = rand(rng, shape, DTYPES[dt], scale=3.0)
    qg, sg = T.quantize_with_scale(cp.asarray(x), cp.asarray(pair))
    qr, sr = T.quantize_with_scale(x, pair)
    np.testing.assert_array_equal(_np(qg), qr)
    np.testing.assert_array_equal(_np(sg), sr)
    np.testing.assert_array_equal(_np(gpu.state), ref.state)   # quantize_with_scale moved nothing


@pytest.mark.gpu
def test_a_first_call_inside_a_capture_is_refused(rng):
    from flame_core.cuda import CUDAGraph, graph
    from flame_core.cuda.graphs import GraphCaptureError
    x = backend.cupy.asarray(rand(rng, (64, 64), BF16))
    with pytest.raises(GraphCaptureError, match="before a CUDA graph capture"):
        with graph(CUDAGraph()):
            T.quantize_delayed(x, T.DelayedScaling())


@pytest.mark.gpu
def test_a_captured_call_moves_the_history_at_every_replay(rng):
    from flame_core.cuda import CUDAGraph, graph
    cp = backend.cupy
    x = cp.asarray(rand(rng, (300, 257), BF16, scale=1.0))
    gpu, ref = T.DelayedScaling(history=4), T.DelayedScaling(history=4)
    T.quantize_delayed(x, gpu)                       # the first call (current scaling) before the capture
    T.quantize_delayed(_np(x), ref)
    g = CUDAGraph()
    with graph(g):
        q, s = T.quantize_delayed(x, gpu)
    for scale in (2.0, 0.5, 8.0):
        x[...] = cp.asarray(rand(rng, (300, 257), BF16, scale=scale))
        g.replay()
        cp.cuda.Device().synchronize()
        qr, sr = T.quantize_delayed(_np(x), ref)
        np.testing.assert_array_equal(_np(s), sr)
        np.testing.assert_array_equal(_np(q), qr)
        np.testing.assert_array_equal(_np(gpu.state), ref.state)
