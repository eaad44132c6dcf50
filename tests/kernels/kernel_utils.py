"""Shared helpers of the kernel tests: dtypes, tolerances, comparison, random data."""
import ml_dtypes
import numpy as np

from flame_core import backend

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# (rtol, atol relative to the reference's largest magnitude): one rounding of the output dtype plus fp32 noise
TOL = {"float32": (2e-5, 2e-6), "float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 8e-3)}


def to64(a):
    if a is None:
        return None
    return backend.to_numpy(a).astype(np.float64)


def assert_close(got, want, dtype_name, what="", scale=1.0, mag=None):
    """Compare float64 copies with the dtype's tolerance. atol scales with `mag`, by default the reference's largest
    magnitude; results formed by cancellation (a norm's dx) pass the magnitude of the terms that cancel."""
    got, want = to64(got), to64(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    rtol, atol = TOL[dtype_name]
    if mag is None:
        mag = float(np.abs(want).max()) if want.size else 0.0
    mag = max(float(mag), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol * scale, atol=atol * scale * mag, err_msg=what)


def rand(rng, shape, dtype, loc=0.0, scale=1.0):
    """Random normal data rounded to `dtype` (NumPy)."""
    return (rng.standard_normal(shape) * scale + loc).astype(np.dtype(dtype))


def grad_mag(dy, rstd, weight=None):
    """The size of the terms a normalisation's dx is formed from: max |dy * w| * max rstd (dx itself may cancel to ~0,
    e.g. rows or groups of one or two elements)."""
    g = np.abs(to64(dy)).max() if dy.size else 0.0
    if weight is not None:
        g *= np.abs(to64(weight)).max()
    return g * (np.abs(to64(rstd)).max() if rstd.size else 0.0)
