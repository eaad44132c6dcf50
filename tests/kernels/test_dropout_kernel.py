"""The fused dropout kernel (cuda_src/philox.cu philox_dropout, flame_core/kernels/dropout.py) against the composed
path it replaces (a float32 draw, a comparison, a cast, a scale, a product) and a NumPy reference of the draw."""
import numpy as np
import pytest
from kernel_utils import DTYPES

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.kernels import launching, loader

SHAPES = ((1,), (7,), (3, 5, 9), (4, 1030), (2, 3, 4, 4))
RATES = (0.1, 0.5, 0.9, 1.0)


def _np(t):
    return backend.to_numpy(t._data if isinstance(t, flame.Tensor) else t)


def _bits(a):
    a = _np(a)
    return a.view(np.uint8)


def _run(x_np, dtype, p, seed, fused):
    """(y, x.grad, generator offset after) of F.dropout on cuda with the fused kernel on or off."""
    g = flame.Generator("cuda").manual_seed(seed)
    x = flame.tensor(x_np, device="cuda").to(getattr(flame, dtype))
    x.requires_grad_(True)
    before = launching.launches
    if fused:
        y = F.dropout(x, p, True, generator=g)
        assert launching.launches > before, "the fused kernel did not launch"
    else:
        with loader.reference():
            y = F.dropout(x, p, True, generator=g)
    up = flame.tensor(np.linspace(-2.0, 3.0, x_np.size).reshape(x_np.shape), device="cuda").to(y.dtype)
    (y * up).sum().backward()
    return y, x.grad, g.get_state()["offset"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", RATES)
def test_fused_dropout_equals_composed_path(dtype, shape, p):
    rng = np.random.default_rng(hash((dtype, shape, p)) % 2**32)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    y1, g1, off1 = _run(x, dtype, p, 1234, True)
    y2, g2, off2 = _run(x, dtype, p, 1234, False)
    assert y1.dtype == y2.dtype and tuple(y1.shape) == shape
    assert np.array_equal(_bits(y1), _bits(y2)), "outputs differ from the composed path"
    assert np.array_equal(_bits(g1), _bits(g2)), "input gradients differ from the composed path"
    assert off1 == off2 == 4 * ((x.size + 3) // 4)


@pytest.mark.gpu
def test_fused_dropout_rate_and_scale():
    """The kept fraction is ~1 - p and survivors are scaled by exactly 1 / (1 - p) (float32)."""
    x = flame.ones(256, 1024, device="cuda")
    for p in (0.1, 0.3, 0.75):
        y = _np(F.dropout(x, p, True))
        kept = y != 0
        assert abs(kept.mean() - (1 - p)) < 0.01
        assert np.all(y[kept] == np.float32(1.0 / (1.0 - p)))
    assert np.all(_np(F.dropout(x, 1.0, True)) == 0)


@pytest.mark.gpu
def test_fused_dropout_mask_matches_numpy_philox_draw():
    """The mask is `u >= float32(p)` for the uniforms rand() draws at the same generator state."""
    g = flame.Generator("cuda").manual_seed(99)
    state = g.get_state()
    u = _np(flame.rand(5, 37, generator=g, device="cuda"))
    g.set_state(state)
    x = flame.randn(5, 37, device="cuda")
    y = F.dropout(x, 0.37, True, generator=g)
    keep = u >= np.float32(0.37)
    np.testing.assert_array_equal(_np(y) != 0, keep & (_np(x) != 0))
    np.testing.assert_array_equal(_np(y)[keep], (_np(x)[keep] * np.float32(1 / 0.63)).astype(np.float32))


@pytest.mark.gpu
def test_fused_dropout_falls_back_where_it_does_not_apply():
    """Strided, float64 and in-place inputs take the composed path and still drop."""
    x = flame.randn(8, 16, device="cuda")
    for t in (x.transpose(0, 1), x.to(flame.float64)):
        y = _np(F.dropout(t, 0.5, True))
        assert 0 < (y == 0).mean() < 1
    z = x.clone()
    F.dropout(z, 0.5, True, inplace=True)
    assert 0 < (_np(z) == 0).mean() < 1


@pytest.mark.gpu
def test_fused_dropout_refused_while_capturing():
    """A draw inside a CUDA graph capture raises, as the composed path's draw did."""
    from flame_core.cuda.graphs import GraphCaptureError
    cp = backend.cupy
    x = flame.randn(64, device="cuda")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            with pytest.raises(GraphCaptureError):
                F.dropout(x, 0.5, True)
        finally:
            s.end_capture()
