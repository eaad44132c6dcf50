"""column_sum.column_sum: the deterministic column sums of fp32 partial rows that the norm, GroupNorm and modulation
backwards finish with. Both forms (blocks of (32, rows) with scalar loads; blocks of (4, rows) with 16-byte loads
where cols % 4 == 0) against a float64 sum of the same rows on ragged shapes (one row, fewer rows than the block's
row lanes, rows not a multiple of them, more rows than one round of loads; cols of 1, odd, not a multiple of the
block's columns), one and two batches, in fp32 / fp16 / bf16, and the same bits on every call. The default choice
of form: the 16-byte one only where the scalar form's blocks would not all fit on the GPU at once."""
import numpy as np
import pytest
from kernel_utils import DTYPES, assert_close

from flame_core.kernels import column_sum as CS
from flame_core.kernels import launching as KL
from flame_core.kernels import plans as P

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("form", ["scalar32", "scalar8", "vec128", "vec8", "vec256"])
@pytest.mark.parametrize("parts,cols", [(1, 1), (1, 4), (3, 17), (7, 20), (396, 3072), (396, 3076), (264, 1000),
                                        (1100, 36), (2000, 3), (129, 16)])
@pytest.mark.parametrize("batches", [1, 2])
def test_column_sum(monkeypatch, rng, dt, form, parts, cols, batches):
    from flame_core import backend
    cp = backend.cupy
    rows = int(form.lstrip("scalarvec"))
    monkeypatch.setattr(CS, "column_sum_vec_rows", rows if form.startswith("vec") else 0)
    monkeypatch.setattr(CS, "column_sum_rows", rows if form.startswith("scalar") else 32)
    monkeypatch.setattr(CS, "column_sum_vec_when", "always")
    blocks = []
    real = KL.launch
    monkeypatch.setattr(KL, "launch", lambda f, g, b, *a, **k: blocks.append(b) or real(f, g, b, *a, **k))
    host = rng.standard_normal((batches, parts, cols)).astype(np.float32) * 3 + 1
    part = cp.asarray(host if batches > 1 else host[0])
    got = CS.column_sum("norms", "column_sum", part, DTYPES[dt])
    again = CS.column_sum("norms", "column_sum", part, DTYPES[dt])
    vec = form.startswith("vec") and cols % 4 == 0
    want_block = (4, rows) if vec else (32, rows if form.startswith("scalar") else 32)
    assert blocks == [want_block] * 2, f"launched with blocks {blocks}, want {want_block}"
    assert got.dtype == DTYPES[dt] and got.shape == part.shape[:-2] + (cols,)
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(again).view(np.uint8))
    want = host.astype(np.float64).sum(axis=1)
    # fp32 sums of up to 2000 terms of ~3: a few fp32 roundings of the partial sums' size beyond the output's own
    assert_close(got.reshape(batches, cols), want, dt, f"column sums {parts}x{cols}x{batches} {form}",
                 scale=20 if dt == "float32" else 1)


@pytest.mark.parametrize("cols,batches", [(3072, 1), (3072, 2), (3076, 2), (64, 2), (40000, 1)])
def test_column_sum_default_form(monkeypatch, rng, cols, batches):
    from flame_core import backend
    cp = backend.cupy
    blocks = []
    real = KL.launch
    monkeypatch.setattr(KL, "launch", lambda f, g, b, *a, **k: blocks.append(b) or real(f, g, b, *a, **k))
    host = rng.standard_normal((batches, 50, cols)).astype(np.float32)
    got = CS.column_sum("norms", "column_sum", cp.asarray(host), np.float32)
    wide = P.cdiv(cols, 32) * batches > P.sm_count() and cols % 4 == 0
    assert blocks == [(4, CS.column_sum_vec_rows) if wide else (32, CS.column_sum_rows)]
    assert_close(got, host.astype(np.float64).sum(axis=1), "float32", "default form", scale=20)
