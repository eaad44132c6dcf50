"""Concatenation as row-block copies (flame_core/kernels/copy_rows.py, cuda_src/copy_rows.cu): which arrays are row
blocks (any machine), and on cuda cat / stack against NumPy on ragged shapes in every dtype, with transposed, sliced
and odd-offset pieces (the 16-, 4- and 1-byte forms), many pieces, and inside a CUDA graph capture."""
import numpy as np
import pytest

import flame_core as flame
from flame_core import backend
from flame_core import dtypes as D
from flame_core.kernels.copy_rows import _row_blocks


def test_row_blocks_of_contiguous_sliced_and_transposed_arrays():
    a = np.zeros((2, 3, 4, 5), dtype=np.float32)
    assert _row_blocks(a, 0) == (1, 480, 480)
    assert _row_blocks(a, 2) == (6, 80, 80)
    assert _row_blocks(a[:, :, 1:3], 2) == (6, 40, 80)          # a slice along d: shorter rows, same stride
    assert _row_blocks(a[:, 1:], 2) is None                      # leading dims no longer collapse
    assert _row_blocks(a[:1, 1:], 2) == (2, 80, 80)              # ... unless the outer one has size 1
    assert _row_blocks(a.transpose(0, 1, 3, 2), 2) is None       # rows not packed
    assert _row_blocks(a[..., None, :], 3) == (24, 20, 20)       # an unsqueezed piece (stack)


DTYPES = [np.float32, np.float16, D.bfloat16.np, np.int64, np.uint8, np.bool_]


def _pieces(rng, shape, dim, sizes, dtype, kind):
    out = []
    for n in sizes:
        s = list(shape)
        s[dim] = n
        a = rng.standard_normal(s) * 10
        out.append(a.astype(dtype))
    cp = backend.cupy
    dev = [cp.asarray(a) for a in out]
    if kind == "offset":      # a view one element in: odd addresses, the narrow forms
        dev = [cp.concatenate([cp.zeros(1, dtype=a.dtype), a.ravel()])[1:].reshape(a.shape) for a in dev]
    elif kind == "transposed":  # rows not packed: the strided fallback for that piece
        dev = [cp.ascontiguousarray(cp.swapaxes(a, -1, -2)).swapaxes(-1, -2) if a.ndim > 1 else a for a in dev]
    return out, dev


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,sizes", [((3, 5, 7), 1, (2, 9, 1)), ((4608, 24, 8), 0, (512, 4096)),
                                             ((2, 33, 130), 2, (64, 66, 3)), ((1, 77, 6), 1, (0, 5, 77)),
                                             ((5,), 0, tuple(range(1, 12)))])
@pytest.mark.parametrize("kind", ["contiguous", "offset", "transposed"])
def test_cat_matches_numpy(rng, dtype, shape, dim, sizes, kind):
    host, dev = _pieces(rng, shape, dim, sizes, dtype, kind)
    ts = [flame.as_tensor(a) for a in dev]
    got = backend.cupy.asnumpy(flame.cat(ts, dim=dim)._data)
    np.testing.assert_array_equal(got, np.concatenate(host, axis=dim))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [D.bfloat16.np, np.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_cat_of_views_of_a_fused_projection_copies_rows(rng, dtype, batch):
    """v of two streams' qkv projections (B, L, heads, D) views, rows packed only after the token dim: joined by
    row copies (one per batch index; no CuPy strided copy), equal to NumPy's."""
    from unittest import mock

    from flame_core.kernels import copy_rows as CR
    cp = backend.cupy
    host = [(rng.standard_normal((batch, n, 3 * 4 * 16)) * 10).astype(dtype) for n in (7, 33)]
    views = [cp.asarray(a)[:, :, 2 * 64:3 * 64].reshape(batch, a.shape[1], 4, 16) for a in host]
    with mock.patch.object(CR, "copy_rows", wraps=CR.copy_rows) as rows:
        got = cp.asnumpy(flame.cat([flame.as_tensor(v) for v in views], dim=1)._data)
    assert rows.call_count == 2 * batch
    want = np.concatenate([a[:, :, 128:192].reshape(batch, a.shape[1], 4, 16) for a in host], axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_stack_and_its_backward_and_a_graph_capture(rng):
    xs = [flame.tensor(rng.standard_normal((4, 6, 8)), dtype=flame.bfloat16, device="cuda", requires_grad=True)
          for _ in range(3)]
    y = flame.stack(xs, dim=2)                                   # (4, 6, 3, 8): strided rows per piece
    ref = np.stack([backend.cupy.asnumpy(x._data) for x in xs], axis=2)
    np.testing.assert_array_equal(backend.cupy.asnumpy(y._data), ref)
    g = flame.tensor(rng.standard_normal((4, 6, 3, 8)), dtype=flame.bfloat16, device="cuda")
    (y * g).sum().backward()
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(backend.cupy.asnumpy(x.grad._data), backend.cupy.asnumpy(g._data)[:, :, i])
    parts = [flame.tensor(rng.standard_normal((16, 3)), dtype=flame.float32, device="cuda") for _ in range(10)]
    run = flame.cuda.graphed(lambda *p: flame.cat(list(p), dim=1), warmup=1)
    eager = backend.cupy.asnumpy(flame.cat(parts, dim=1)._data)
    for _ in range(3):
        out = run(*parts)
    np.testing.assert_array_equal(backend.cupy.asnumpy(out._data), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, D.bfloat16.np, np.float16])
def test_contiguous_copies_of_row_block_views(rng, dtype):
    """plans.contiguous (what kernels call on their operands): a q / k view of a fused qkv output goes through the
    row-block copy; a transposed array does not (CuPy's copy); both equal NumPy's."""
    from flame_core.kernels import copy_rows as CR
    from flame_core.kernels import plans as P
    cp = backend.cupy
    qkv = cp.asarray(rng.standard_normal((2, 37, 3, 5, 16)).astype(dtype))
    for i in range(3):
        view = qkv[:, :, i]                                     # (B, L, heads, D), rows 3*heads*D apart
        assert not view.flags.c_contiguous
        assert CR.contiguous(view) is not None
        out = P.contiguous(view)
        assert out.flags.c_contiguous
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(qkv)[:, :, i])
    t = cp.asarray(rng.standard_normal((33, 20)).astype(dtype)).T
    assert CR.contiguous(t) is None
    np.testing.assert_array_equal(cp.asnumpy(P.contiguous(t)), cp.asnumpy(t))
    x = flame.as_tensor(qkv)[:, :, 1]
    w = flame.tensor(rng.standard_normal(16), dtype=flame.float32, device="cuda").to(x.dtype)
    from flame_core.ops.norms import rms_norm
    got = rms_norm(x, (16,), w, eps=1e-6)
    ref = rms_norm(x.contiguous(), (16,), w, eps=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(got._data), cp.asnumpy(ref._data))
