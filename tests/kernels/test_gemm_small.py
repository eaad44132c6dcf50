"""Small GEMMs (cuda_src/gemm_small.cu, flame_core/kernels/gemm_small.py) against float64 NumPy on ragged shapes in
fp32 / fp16 / bf16; which problems take the path; F.linear / @ and their backward through it against the cuBLAS path."""
import itertools

import numpy as np
import pytest
from kernel_utils import DTYPES, assert_close, rand

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.kernels import gemm_small as GS
from flame_core.kernels import launching

# (M, N, K): tile edges (16), one past and one short of them, single rows / columns, the largest sides allowed
SHAPES = ((1, 2, 3), (16, 64, 64), (17, 15, 33), (5, 1, 7), (33, 47, 1), (2, 128, 31), (64, 16, 128), (96, 80, 100),
          (200, 256, 80), (255, 3, 256))


def _mag(a, b):
    """max over outputs of sum |a_ir| |b_rj| (what a product's rounding error scales with)."""
    return float((np.abs(a) @ np.abs(b)).max())


def _cp(a):
    return backend.cupy.asarray(a)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_linear_matches_numpy(dtype):
    rng = np.random.default_rng(0)
    for (m, n, k), bias, lead in itertools.product(SHAPES, (False, True), ((), (3,))):
        if lead and m % 3:
            continue
        x = rand(rng, lead + (m // 3 if lead else m, k), DTYPES[dtype])
        w = rand(rng, (n, k), DTYPES[dtype], scale=0.5)
        b = rand(rng, (n,), DTYPES[dtype]) if bias else None
        xc, wc, bc = _cp(x), _cp(w), None if b is None else _cp(b)
        before = launching.launches
        got = GS.linear(xc, wc, bc)
        assert got is not None and launching.launches == before + 1, (m, n, k)
        cached = GS.cached_launches()
        again = GS.linear(xc, wc, bc)   # the same problem again: the same launch, the same bits
        assert GS.cached_launches() == cached and launching.launches == before + 2
        assert np.array_equal(backend.to_numpy(again).view(np.uint8), backend.to_numpy(got).view(np.uint8))
        x64, w64 = x.astype(np.float64).reshape(-1, k), w.astype(np.float64)
        want = x64 @ w64.T + (0 if b is None else b.astype(np.float64))
        assert got.dtype == x.dtype and got.shape == x.shape[:-1] + (n,)
        assert_close(got.reshape(-1, n), want, dtype, f"linear {dtype} {(m, n, k)} bias={bias}",
                     mag=_mag(x64, w64.T) + (0 if b is None else np.abs(b.astype(np.float64)).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_matmul_matches_numpy_row_major_and_transposed(dtype):
    rng = np.random.default_rng(1)
    for m, n, k in SHAPES:
        a = rand(rng, (m, k), DTYPES[dtype])
        b = rand(rng, (k, n), DTYPES[dtype])
        want = a.astype(np.float64) @ b.astype(np.float64)
        mag = _mag(a.astype(np.float64), b.astype(np.float64))
        assert_close(GS.matmul(_cp(a), _cp(b)), want, dtype, f"a @ b {(m, n, k)}", mag=mag)
        bt = _cp(np.ascontiguousarray(b.T)).T    # an F-contiguous view: the transpose of a row-major (N, K)
        assert_close(GS.matmul(_cp(a), bt), want, dtype, f"a @ c.T {(m, n, k)}", mag=mag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_linear_grads_every_combination(dtype):
    rng = np.random.default_rng(2)
    for m, n, k in SHAPES:
        g = rand(rng, (m, n), DTYPES[dtype])
        x = rand(rng, (m, k), DTYPES[dtype])
        w = rand(rng, (n, k), DTYPES[dtype])
        g64, x64, w64 = (a.astype(np.float64) for a in (g, x, w))
        for need in itertools.product((False, True), repeat=3):
            if not any(need):
                assert GS.linear_grads(_cp(g), _cp(x), _cp(w), *need) is None
                continue
            ndx, ndw, ndb = need
            before = launching.launches
            dx, dw, db = GS.linear_grads(_cp(g), _cp(x) if ndw else None, _cp(w) if ndx else None, *need)
            assert launching.launches == before + 1, "one launch for the whole backward"
            what = f"{dtype} {(m, n, k)} needs {need}"
            assert (dx is None) != ndx and (dw is None) != ndw and (db is None) != ndb, what
            if ndx:
                assert_close(dx, g64 @ w64, dtype, "dx " + what, mag=_mag(g64, w64))
            if ndw:
                assert_close(dw, g64.T @ x64, dtype, "dW " + what, mag=_mag(g64.T, x64))
            if ndb:
                assert_close(db, g64.sum(0), dtype, "db " + what, mag=np.abs(g64).sum(0).max())


@pytest.mark.gpu
def test_what_takes_the_path():
    cp = backend.cupy
    x, w, b = cp.ones((16, 64), cp.float32), cp.ones((64, 64), cp.float32), cp.ones(64, cp.float32)
    assert GS.linear(x, w, b) is not None
    assert GS.linear(x.astype(cp.float64), w.astype(cp.float64), None) is None      # float64: cuBLAS
    assert GS.linear(x, w.astype(cp.float16), None) is None                          # mixed dtypes
    assert GS.linear(cp.ones((16, 128), cp.float32)[:, ::2], w, None) is None        # not C-contiguous
    big = GS.MAX_DIM + 1
    assert GS.linear(cp.ones((2, big), cp.float32), cp.ones((2, big), cp.float32), None) is None   # a long K
    side = GS.MAX_DIM   # side^3 multiply-adds: past MAX_MACS though every side is within MAX_DIM
    assert side ** 3 > GS.MAX_MACS
    assert GS.linear(cp.ones((side, side), cp.float32), cp.ones((side, side), cp.float32), None) is None
    assert GS.linear(cp.ones((0, 64), cp.float32), w, None) is None                  # nothing to compute
    assert GS.matmul(x, cp.ones((64, 128), cp.float32)[:, ::2]) is None              # b neither C nor F order


def test_numpy_arrays_do_not_take_the_path():
    x, w = np.ones((4, 8), np.float32), np.ones((3, 8), np.float32)
    assert GS.linear(x, w, None) is None and GS.matmul(x, w.T) is None
    assert GS.linear_grads(np.ones((4, 3), np.float32), x, w, True, True, True) is None


def _run_linear(dtype, shape_x, n, bias, small):
    """y, dx, dW, db of sum(tanh(F.linear(x, w, b)) * c) on cuda, with the small-GEMM path on or off."""
    rng = np.random.default_rng(3)
    dt = getattr(flame, dtype)
    k = shape_x[-1]
    x = flame.tensor(rng.standard_normal(shape_x), device="cuda", dtype=dt).requires_grad_()
    w = flame.tensor(rng.standard_normal((n, k)) * 0.3, device="cuda", dtype=dt).requires_grad_()
    b = flame.tensor(rng.standard_normal(n), device="cuda", dtype=dt).requires_grad_() if bias else None
    c = flame.tensor(rng.standard_normal(shape_x[:-1] + (n,)), device="cuda", dtype=dt)
    old = GS.MAX_MACS
    GS.MAX_MACS = old if small else -1
    try:
        before = launching.launches
        y = F.linear(x, w, b)
        (y.tanh() * c).sum().backward()
        launched = launching.launches - before
    finally:
        GS.MAX_MACS = old
    return [t.detach().float().cpu().numpy() for t in (y, x.grad, w.grad) + ((b.grad,) if bias else ())], launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_F_linear_and_its_backward_match_the_cublas_path(dtype):
    for shape_x, n, bias in (((16, 64), 64, True), ((2, 9, 33), 17, False), ((5, 3), 40, True)):
        small, n_small = _run_linear(dtype, shape_x, n, bias, True)
        ref, n_ref = _run_linear(dtype, shape_x, n, bias, False)
        assert n_small > n_ref, "the small path launched no kernel of its own"
        for got, want, name in zip(small, ref, ("y", "dx", "dW", "db")):
            tol = 2e-5 if dtype == "float32" else 2e-2
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())),
                                       err_msg=f"{name} {dtype} {shape_x} n={n}")


@pytest.mark.gpu
def test_matmul_operator_and_its_backward_match_the_cublas_path():
    rng = np.random.default_rng(4)
    a0, b0 = rng.standard_normal((12, 40)), rng.standard_normal((40, 24))
    outs = []
    for small in (True, False):
        a = flame.tensor(a0, device="cuda", dtype=flame.float32).requires_grad_()
        b = flame.tensor(b0, device="cuda", dtype=flame.float32).requires_grad_()
        old = GS.MAX_MACS
        GS.MAX_MACS = old if small else -1
        try:
            y = a @ b
            (y * y).sum().backward()
        finally:
            GS.MAX_MACS = old
        outs.append([t.detach().cpu().numpy() for t in (y, a.grad, b.grad)])
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
