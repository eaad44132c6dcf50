"""The fp8 GEMM's parts: per-tensor e4m3 quantisation with current scaling (kernel bit-exact against its reference),
the byte transpose, and scaled_mm against a float64 product of the quantised operands (exact up to the order of
accumulation and the one rounding to the output dtype) -- cuBLASLt on the GPU, the emulation on the cpu."""
import ml_dtypes
import numpy as np
import pytest
from kernel_utils import DTYPES, rand

from flame_core import backend
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import fp8_tensor as T
from flame_core.kernels import scaled_mm as S

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3_FINITE = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
E4M3_FINITE = E4M3_FINITE[np.isfinite(E4M3_FINITE)]


def _values(q):
    return backend.to_numpy(q).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _reference(qa, qb, sa, sb, bias):
    """float64 sa * sb * (a @ b^T) + bias of the quantised operands, and the magnitude of the summed terms."""
    a, b = _values(qa), _values(qb)
    s = float(backend.to_numpy(sa).reshape(-1)[0]) * float(backend.to_numpy(sb).reshape(-1)[0])
    y = a @ b.T * s
    mag = np.abs(a) @ np.abs(b).T * s
    if bias is not None:
        bb = backend.to_numpy(bias).astype(np.float64)
        y, mag = y + bb, mag + np.abs(bb)
    return y, mag


# Hopper's fp8 MMA adds its products with fewer bits than fp32 inside each K chunk (cuBLASLt promotes the partial
# sums to fp32 between chunks; torch._scaled_mm gives the same bits, bench/fp8_gemm.py): measured up to 2^-14.7 of the
# summed terms' magnitude on H200 (ragged shapes here). The emulation accumulates in float32: 2^-22 holds there.
HOPPER_ACCUMULATION = 2.0 ** -12


def _assert_product(got, want, mag, out_dtype, accumulation=2.0 ** -22):
    got = backend.to_numpy(got).astype(np.float64)
    ulp = {BF16: 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24}[np.dtype(out_dtype)]
    # one rounding to the output dtype, plus the accumulation's error in any order, relative to sum |a_k b_k|
    bound = ulp * np.abs(want) + accumulation * mag + 1e-30
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


def test_quantize_per_tensor_maps_amax_to_448_and_rounds_to_nearest(rng):
    x = (rng.standard_normal((7, 33)) * 3).astype(np.float32)
    q, s = T.quantize_per_tensor(x)
    assert q.dtype == np.uint8 and q.shape == x.shape and s.dtype == np.float32 and s.shape == (2,)
    amax = np.float32(np.abs(x).max())
    assert s[0] == amax / np.float32(448) and s[1] == np.float32(448) / amax
    qv = _values(q)
    assert np.abs(qv).max() == 448.0
    scaled = x.astype(np.float64) * np.float64(s[1])
    nearest = E4M3_FINITE[np.abs(scaled[..., None] - E4M3_FINITE).argmin(-1)]
    assert np.all(np.abs(qv - scaled) <= np.abs(nearest - scaled) + 1e-6)   # no representable value is closer


def test_quantize_per_tensor_zero_and_bad_dtype():
    q, s = T.quantize_per_tensor(np.zeros((3, 4), np.float32))
    assert np.all(q == 0) and list(s) == [1.0, 1.0]
    with pytest.raises(DTypeError, match="quantize_per_tensor"):
        T.quantize_per_tensor(np.zeros(3, np.int32))


def test_transpose_fp8_cpu(rng):
    q = rng.integers(0, 256, (5, 9), dtype=np.uint8)
    np.testing.assert_array_equal(T.transpose_fp8(q), q.T)
    out = np.empty((9, 5), np.uint8)
    assert T.transpose_fp8(q, out=out) is out and np.array_equal(out, q.T)
    with pytest.raises(ShapeError, match="transpose_fp8"):
        T.transpose_fp8(q, out=np.empty((5, 9), np.uint8))


RAGGED = [(1, 1, 1), (3, 5, 7), (17, 33, 64), (130, 48, 96), (65, 200, 31)]


@pytest.mark.parametrize("shape", RAGGED)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_emulation_matches_float64_of_the_quantised_operands(rng, shape, with_bias):
    M, N, K = shape
    qa, sa = T.quantize_per_tensor(rand(rng, (M, K), BF16, scale=3.0))
    qb, sb = T.quantize_per_tensor(rand(rng, (N, K), BF16, scale=0.05))
    bias = rand(rng, (N,), BF16) if with_bias else None
    y = S.scaled_mm(qa, qb, sa, sb, bias=bias, out_dtype=BF16)
    assert S.last_path == "emulated" and y.dtype == BF16 and y.shape == (M, N)
    _assert_product(y, *_reference(qa, qb, sa, sb, bias), BF16)


def test_pick_fastest_takes_the_quickest_that_ran_and_the_first_on_ties():
    assert S.pick_fastest(["a", "b", "c"], {"a": 0.3, "b": 0.1, "c": 0.2}.get) == (1, [0.3, 0.1, 0.2])
    assert S.pick_fastest(["a", "b", "c"], {"a": 0.2, "b": None, "c": 0.2}.get)[0] == 0   # a tie: the heuristic's
    assert S.pick_fastest(["a", "b"], {"a": None, "b": 0.5}.get)[0] == 1                   # a failed one never wins
    assert S.pick_fastest(["a", "b"], lambda c: None) == (0, [None, None])                 # none ran: the first


def test_scaled_mm_rejects_bad_operands(rng):
    q = np.zeros((4, 8), np.uint8)
    s = np.ones(2, np.float32)
    with pytest.raises(ShapeError, match="scaled_mm"):
        S.scaled_mm(q, np.zeros((4, 9), np.uint8), s, s)
    with pytest.raises(DTypeError, match="scaled_mm: a"):
        S.scaled_mm(q.astype(np.float32), q, s, s)
    with pytest.raises(DTypeError, match="scale_b"):
        S.scaled_mm(q, q, s, s.astype(np.float64))
    with pytest.raises(ShapeError, match="bias"):
        S.scaled_mm(q, q, s, s, bias=np.zeros(3, BF16))


# ----------------------------------------------------------------------------- GPU
SHAPES = [(1, 7), (5, 33), (257, 64), (130, 1000), (3, 3072), (2, 20001), (1024, 3072)]   # the last: every block
                                                                                          # loops (grid-wide barrier)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_per_tensor_kernel_bit_exact(ab, rng, dt, shape):
    x = rand(rng, shape, DTYPES[dt], scale=5.0)
    (qk, sk), (qr, sr) = ab(T.quantize_per_tensor, x)
    np.testing.assert_array_equal(backend.to_numpy(sk), backend.to_numpy(sr))
    np.testing.assert_array_equal(backend.to_numpy(qk), backend.to_numpy(qr))


@pytest.mark.gpu
def test_quantize_per_tensor_kernel_unaligned_and_zero(rng):
    cp = backend.cupy
    x = cp.asarray(rand(rng, (1001,), BF16, scale=2.0))[1:]   # an offset view (copied to an aligned buffer)
    q, s = T.quantize_per_tensor(x)
    qr, sr = T._quantize_ref(x)
    assert cp.array_equal(q, qr) and cp.array_equal(s, sr)
    q, s = T.quantize_per_tensor(cp.zeros((4, 16), BF16))
    assert int(q.sum()) == 0 and backend.to_numpy(s).tolist() == [1.0, 1.0]


@pytest.mark.gpu
def test_quantize_per_tensor_kernel_leaves_its_barrier_ready_for_the_next_call(rng):
    """The kernel keeps its amax and barrier counters in module memory and zeroes them itself: a call after one with
    a larger amax gets its own scale (a stale amax would shrink it), in eager calls and in a replayed CUDA graph."""
    from flame_core.cuda import CUDAGraph, graph
    cp = backend.cupy
    big = cp.asarray(rand(rng, (512, 3072), BF16, scale=100.0))
    small = cp.asarray(rand(rng, (700, 1000), BF16, scale=0.01))
    for x in (big, small, big, small):
        q, s = T.quantize_per_tensor(x)
        qr, sr = T._quantize_ref(x)
        assert cp.array_equal(s, sr) and cp.array_equal(q, qr)
    g = CUDAGraph()
    with graph(g):
        q_big, s_big = T.quantize_per_tensor(big)
        q_small, s_small = T.quantize_per_tensor(small)
    small[...] = cp.asarray(rand(rng, (700, 1000), BF16, scale=0.5))
    for _ in range(2):
        g.replay()
        cp.cuda.Device().synchronize()
        for x, q, s in ((big, q_big, s_big), (small, q_small, s_small)):
            qr, sr = T._quantize_ref(x)
            assert cp.array_equal(s, sr) and cp.array_equal(q, qr)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (64, 3072), (3072, 257)])
def test_transpose_fp8_kernel(ab, rng, shape):
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    k, r = ab(T.transpose_fp8, q)
    np.testing.assert_array_equal(backend.to_numpy(k), q.T)
    np.testing.assert_array_equal(backend.to_numpy(r), q.T)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 64), (128, 3072), (3072, 9216), (192, 320)])
def test_transpose_fp8_64_kernel(rng, monkeypatch, shape):
    """Sides multiples of 64: the 16-byte tile kernel, the exact transpose (also into an out whose rows start 16
    bytes apart, and with the switch off: the byte kernel); an out not 16-byte aligned takes the byte kernel."""
    cp = backend.cupy
    from flame_core.kernels import loader as L
    used = []
    get = L.get_function
    monkeypatch.setattr(L, "get_function", lambda stem, name, *a: used.append(name) or get(stem, name, *a))
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    d = cp.asarray(q)
    np.testing.assert_array_equal(backend.to_numpy(T.transpose_fp8(d)), q.T)
    assert used[-1] == "fp8_transpose_64"
    buf = cp.zeros(shape[0] * shape[1] + 16, dtype=np.uint8)
    out = buf[16:].reshape(shape[1], shape[0])
    assert T.transpose_fp8(d, out=out) is out and np.array_equal(backend.to_numpy(out), q.T)
    assert used[-1] == "fp8_transpose_64" and int(buf[:16].sum()) == 0
    odd = buf[1:1 + shape[0] * shape[1]].reshape(shape[1], shape[0])
    np.testing.assert_array_equal(backend.to_numpy(T.transpose_fp8(d, out=odd)), q.T)
    assert used[-1] == "fp8_transpose"
    monkeypatch.setattr(T, "TRANSPOSE_64", False)
    np.testing.assert_array_equal(backend.to_numpy(T.transpose_fp8(d)), q.T)
    assert used[-1] == "fp8_transpose"


# (M, N, K): ragged M and N, K a multiple of 16 (cuBLASLt's fp8 requirement); Flux's widths at the end
GEMM_SHAPES = [(1, 16, 16), (7, 24, 48), (100, 40, 64), (333, 136, 272), (4608 // 9, 3072, 3072),
               (77, 9216, 3072), (64, 3072, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out", ["bfloat16", "float16"])
def test_scaled_mm_cublaslt_matches_float64_of_the_quantised_operands(rng, shape, with_bias, out):
    cp = backend.cupy
    M, N, K = shape
    out_dtype = DTYPES[out]
    qa, sa = T.quantize_per_tensor(cp.asarray(rand(rng, (M, K), BF16, scale=3.0)))
    qb, sb = T.quantize_per_tensor(cp.asarray(rand(rng, (N, K), BF16, scale=0.02)))
    bias = cp.asarray(rand(rng, (N,), out_dtype)) if with_bias else None
    y = S.scaled_mm(qa, qb, sa, sb, bias=bias, out_dtype=out_dtype)
    assert S.last_path == "cublaslt", "cuBLASLt had no fp8 algorithm for an aligned problem"
    assert y.dtype == out_dtype and y.shape == (M, N)
    _assert_product(y, *_reference(qa, qb, sa, sb, bias), out_dtype, HOPPER_ACCUMULATION)


@pytest.mark.gpu
def test_scaled_mm_falls_back_to_emulation_when_k_is_unaligned(rng):
    cp = backend.cupy
    qa, sa = T.quantize_per_tensor(cp.asarray(rand(rng, (9, 37), BF16)))
    qb, sb = T.quantize_per_tensor(cp.asarray(rand(rng, (11, 37), BF16)))
    y = S.scaled_mm(qa, qb, sa, sb, out_dtype=BF16)
    assert S.last_path == "emulated"
    _assert_product(y, *_reference(qa, qb, sa, sb, None), BF16)


@pytest.mark.gpu
def test_scaled_mm_times_the_heuristics_candidates_once_per_problem(rng):
    """The algorithm is the fastest of the heuristic's candidates, timed on the first eager call and cached; inside a
    CUDA graph capture an untimed problem takes the heuristic's first and stays untimed."""
    from flame_core.cuda import CUDAGraph, graph
    cp = backend.cupy
    M, N, K = 4608, 3072, 3072
    qa, sa = T.quantize_per_tensor(cp.asarray(rand(rng, (M, K), BF16)))
    qb, sb = T.quantize_per_tensor(cp.asarray(rand(rng, (N, K), BF16, scale=0.02)))
    S.scaled_mm(qa[:16], qb[:16], sa, sb, out_dtype=BF16)   # cuBLASLt's handle and workspace: made outside capture
    S._plans.clear()
    g = CUDAGraph()
    with graph(g):
        y_graph = S.scaled_mm(qa, qb, sa, sb, out_dtype=BF16)
    (plan,) = S._plans.values()
    assert plan.algo is None and plan.times_ms is None
    g.replay()
    y = S.scaled_mm(qa, qb, sa, sb, out_dtype=BF16)
    assert S.last_path == "cublaslt" and plan.algo is not None
    times = plan.times_ms
    assert len(times) == len(plan.candidates) >= 1
    ran = [t for t in times if t is not None]
    if len(plan.candidates) > 1:
        assert ran and min(ran) == times[plan.candidates.index(plan.algo)]
    print("candidates ms:", [None if t is None else round(t, 4) for t in times])
    S.scaled_mm(qa, qb, sa, sb, out_dtype=BF16)
    assert plan.times_ms is times                     # not timed again
    cp.cuda.Device().synchronize()
    _assert_product(y, *_reference(qa, qb, sa, sb, None), BF16, HOPPER_ACCUMULATION)
    _assert_product(y_graph, *_reference(qa, qb, sa, sb, None), BF16, HOPPER_ACCUMULATION)


# Fast accumulation (no promotion of the tensor cores' partial sums): bounded by the worst case of ~14-bit partial
# sums over K / 32 additions; bench/fp8_quality.py measures its effect on the output's error.
FAST_ACCUMULATION = 2.0 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(100, 40, 64), (4608 // 9, 3072, 3072), (64, 3072, 12288), (128, 3072, 15360)])
def test_scaled_mm_fast_accumulation_within_its_bound(rng, shape):
    cp = backend.cupy
    M, N, K = shape
    qa, sa = T.quantize_per_tensor(cp.asarray(rand(rng, (M, K), BF16, scale=3.0)))
    qb, sb = T.quantize_per_tensor(cp.asarray(rand(rng, (N, K), BF16, scale=0.02)))
    bias = cp.asarray(rand(rng, (N,), BF16))
    y = S.scaled_mm(qa, qb, sa, sb, bias=bias, out_dtype=BF16, fast_accum=True)
    assert S.last_path == "cublaslt"
    want, mag = _reference(qa, qb, sa, sb, bias)
    err = np.abs(backend.to_numpy(y).astype(np.float64) - want) - 2.0 ** -8 * np.abs(want)
    print(f"fast accumulation {shape}: worst 2^{np.log2(max(float(np.max(err / mag)), 1e-30)):.1f} of the terms")
    _assert_product(y, want, mag, BF16, FAST_ACCUMULATION)
