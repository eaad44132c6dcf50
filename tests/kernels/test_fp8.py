"""Per-row fp8 e4m3 quantization: reference properties, Tensor helpers, kernels bit-exact against the reference."""
import ml_dtypes
import numpy as np
import pytest
from kernel_utils import DTYPES, rand

import flame_core as flame
from flame_core.kernels import fp8 as K
from flame_core.ops.fp8 import dequantize_fp8, quantize_fp8

E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
E4M3_FINITE = np.unique(E4M3_VALUES[np.isfinite(E4M3_VALUES)])


def test_row_amax_maps_to_448_and_values_round_to_nearest(rng):
    x = rng.standard_normal((5, 40)) * np.array([1e-3, 1, 10, 300, 1e4])[:, None]
    q, s = K.quantize_per_row(x)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.dtype == np.float32 and s.shape == (5,)
    qv = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_allclose(np.abs(qv).max(-1), 448.0)
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 448, rtol=1e-6)
    scaled = x.astype(np.float32) * (np.float32(448) / np.abs(x).max(-1).astype(np.float32))[:, None]
    nearest = E4M3_FINITE[np.abs(scaled[..., None] - E4M3_FINITE).argmin(-1)]
    err = np.abs(qv - scaled)
    assert np.all(err <= np.abs(nearest - scaled) + 1e-6)   # no representable value is closer


def test_round_trip_error_is_within_half_an_fp8_step(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    q, s = K.quantize_per_row(x)
    y = K.dequantize_per_row(q, s, np.float32)
    rel = np.abs(y - x) / np.abs(x).max(-1, keepdims=True)
    assert rel.max() <= 16 / 448 * 1.0001  # the widest e4m3 step (256..448) is 32: half of it over the row amax 448
    assert rel.max() > 1e-3  # and fp8 really is coarse: the check above is not vacuous


def test_zero_rows_get_unit_scale():
    q, s = K.quantize_per_row(np.zeros((2, 3), np.float32))
    assert np.all(q == 0) and np.all(s == 1)


def test_tensor_helpers(device, rng):
    x = flame.tensor(rng.standard_normal((3, 16)), dtype=flame.bfloat16, device=device)
    q, s = quantize_fp8(x)
    assert q.dtype == flame.float8_e4m3fn and q.shape == x.shape and s.shape == (3,)
    y = dequantize_fp8(q, s, flame.bfloat16)
    assert y.dtype == flame.bfloat16
    np.testing.assert_allclose(y.float().numpy(), x.float().numpy(), atol=float(x.abs().max().item()) / 16)


SHAPES = [(1, 1), (1, 7), (5, 33), (257, 64), (130, 1000), (3, 3072), (2, 16384), (2, 20001), (1000, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_bit_exact(ab, rng, dt, shape):
    x = rand(rng, shape, DTYPES[dt], scale=5.0)
    x[..., 0] = 0 if shape[-1] > 3 else x[..., 0]
    (qk, sk), (qr, sr) = ab(K.quantize_per_row, x)
    np.testing.assert_array_equal(qk.get(), qr.get())
    np.testing.assert_array_equal(sk.get(), sr.get())
    k, r = ab(lambda q, s: K.dequantize_per_row(q, s, DTYPES[dt]), qr, sr)
    np.testing.assert_array_equal(k.get().astype(np.float32), r.get().astype(np.float32))


def test_dequantize_into_out_and_its_refusals(rng):
    """out=: the same values written into the given array (returned); a misshaped, mistyped or strided out refused
    before anything is written."""
    q, s = K.quantize_per_row(rng.standard_normal((4, 24)).astype(np.float32))
    want = K.dequantize_per_row(q, s, np.float32)
    buf = np.full(4 * 24 + 8, np.nan, np.float32)
    out = buf[:96].reshape(4, 24)
    assert K.dequantize_per_row(q, s, np.float32, out=out) is out
    np.testing.assert_array_equal(out, want)
    assert np.isnan(buf[96:]).all()  # nothing beyond the view
    for bad in (np.empty((4, 23), np.float32), np.empty((4, 24), np.float16), np.empty((24, 4), np.float32).T):
        with pytest.raises(flame.errors.ShapeError, match="out must be"):
            K.dequantize_per_row(q, s, np.float32, out=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
def test_dequantize_into_a_reused_out_is_bit_exact(rng, dt):
    """The packed launch of a reused out (one per q / scales / out address set) writes what a fresh output gets:
    two weights into one buffer view, then the first again, then a strided q (the general launch)."""
    import cupy
    a = K.quantize_per_row(cupy.asarray(rand(rng, (33, 130), np.float32, scale=3.0)))
    b = K.quantize_per_row(cupy.asarray(rand(rng, (33, 130), np.float32, scale=7.0)))
    buf = cupy.empty(33 * 130, DTYPES[dt])
    out = buf.reshape(33, 130)
    for q, s in (a, b, a):
        want = K.dequantize_per_row(q, s, DTYPES[dt]).get().astype(np.float32)
        assert K.dequantize_per_row(q, s, DTYPES[dt], out=out) is out
        np.testing.assert_array_equal(out.get().astype(np.float32), want)
    wide = cupy.concatenate([a[0], a[0]], axis=1)[:, :130]  # strided: copied, then the general launch
    K.dequantize_per_row(wide, a[1], DTYPES[dt], out=out)
    np.testing.assert_array_equal(out.get().astype(np.float32),
                                  K.dequantize_per_row(a[0], a[1], DTYPES[dt]).get().astype(np.float32))
    # a square q packed once, then its transpose: the same address, shape and dtypes, another layout -- the packed
    # launch must not be taken for it
    sq, ss = K.quantize_per_row(cupy.asarray(rand(rng, (32, 32), np.float32, scale=5.0)))
    sout = cupy.empty((32, 32), DTYPES[dt])
    K.dequantize_per_row(sq, ss, DTYPES[dt], out=sout)
    K.dequantize_per_row(sq, ss, DTYPES[dt], out=sout)
    assert sq.T.data.ptr == sq.data.ptr and sq.T.shape == sq.shape
    K.dequantize_per_row(sq.T, ss, DTYPES[dt], out=sout)
    np.testing.assert_array_equal(
        sout.get().astype(np.float32),
        K.dequantize_per_row(cupy.ascontiguousarray(sq.T), ss, DTYPES[dt]).get().astype(np.float32))
