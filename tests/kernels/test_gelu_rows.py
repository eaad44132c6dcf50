"""GELU(tanh) read from a column block of a wider matrix (cuda_src/gelu_rows.cu) against the contiguous reference."""
import pytest
from kernel_utils import DTYPES, assert_close, rand

from flame_core.kernels import activations as A
from flame_core.kernels import gelu_rows as K

SHAPES = [(1, 8, 8, 0), (7, 24, 40, 16), (33, 12288, 21504, 9216), (5, 13, 29, 3), (300, 64, 64, 0)]  # rows, cols,
# width of the full matrix, first column of the block


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("rows,cols,width,start", SHAPES)
def test_gelu_rows_matches_the_reference(ab, rng, dt, rows, cols, width, start):
    import cupy as cp
    full = cp.asarray(rand(rng, (rows, width), DTYPES[dt], scale=3.0))
    dy = rand(rng, (rows, cols), DTYPES[dt])
    x = full[:, start:start + cols]
    k, r = ab(lambda: K.gelu_tanh_rows_forward(x))
    assert k.flags.c_contiguous and k.shape == (rows, cols)
    assert_close(k, A._gelu_ref(cp.ascontiguousarray(x), "tanh"), dt, "forward")
    assert_close(k, r, dt, "forward vs reference path")
    k, r = ab(lambda g: K.gelu_tanh_rows_backward(g, x), dy)
    assert_close(k, A._gelu_grad_ref(cp.asarray(dy), cp.ascontiguousarray(x), "tanh"), dt, "backward")
