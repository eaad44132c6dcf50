"""GEMM epilogues on cuda: cuBLASLt's bias epilogue (gemm_lt.matmul_bias) and cuBLAS's alpha / beta accumulation into
a column block of a wider output (gemm.matmul(out=, alpha=, beta=)) against float64 NumPy references, on ragged
shapes in float32 / float16 / bfloat16, with transposed and offset (unaligned) operands; linear() takes the epilogue
and gives the GEMM-then-add numbers; both run inside a CUDA graph capture."""
from unittest import mock

import numpy as np
import pytest

import flame_core as flame
from flame_core import backend
from flame_core import dtypes as D

pytestmark = pytest.mark.gpu

DTYPES = [(np.float32, 1e-5), (np.float16, 2e-3), (D.bfloat16.np, 1.6e-2)]
SHAPES = [(1, 1, 1), (7, 13, 5), (77, 96, 64), (130, 33, 300), (513, 257, 129)]


def _dev(x, dtype):
    return backend.cupy.asarray(x.astype(dtype))


def _host(x):
    return backend.cupy.asnumpy(x).astype(np.float64)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout", ["nn", "nt", "offset"])
def test_matmul_bias_matches_reference(M, N, K, dtype, tol, layout, rng):
    from flame_core.kernels import gemm_lt
    a = rng.standard_normal((M, K + 1))
    b = rng.standard_normal((K, N)) if layout != "nt" else rng.standard_normal((N, K))
    bias = rng.standard_normal(N)
    ad = _dev(a, dtype)
    ad = ad[:, 1:] if layout == "offset" else ad[:, :K]        # a view at an odd element offset / a row stride > K
    bd = _dev(b, dtype) if layout != "nt" else _dev(b, dtype).T  # column-major b
    y = gemm_lt.matmul_bias(ad, bd, _dev(bias, dtype))
    if y is None:   # cuBLASLt offered no algorithm: the caller falls back (allowed only for unaligned views)
        assert layout == "offset"
        return
    ref = _host(ad) @ _host(bd) + _host(_dev(bias, dtype))
    scale = np.abs(ref).max() + 1
    assert y.shape == (M, N) and y.dtype == np.dtype(dtype)
    assert np.abs(_host(y) - ref).max() <= tol * scale * max(1, np.sqrt(K) / 4)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.37, 1.0), (2.0, 0.5)])
def test_matmul_alpha_beta_into_a_column_block(dtype, tol, alpha, beta, rng):
    from flame_core.kernels import gemm
    M, N, K, W, lo = 45, 19, 16, 64, 21
    a, b, c = rng.standard_normal((M, K)), rng.standard_normal((K, N)), rng.standard_normal((M, W))
    out = _dev(c, dtype)
    before = _host(out)
    gemm.matmul(_dev(a, dtype), _dev(b, dtype), out=out[:, lo:lo + N], alpha=alpha, beta=beta)
    ref = before.copy()
    ref[:, lo:lo + N] = alpha * (_host(_dev(a, dtype)) @ _host(_dev(b, dtype))) + beta * before[:, lo:lo + N]
    got = _host(out)
    np.testing.assert_array_equal(np.delete(got, np.s_[lo:lo + N], 1), np.delete(before, np.s_[lo:lo + N], 1))
    assert np.abs(got - ref).max() <= tol * (np.abs(ref).max() + 1) * 2


def test_linear_uses_the_epilogue_and_matches_gemm_then_add(rng, monkeypatch):
    from flame_core.kernels import gemm_lt
    x = flame.tensor(rng.standard_normal((3, 50, 64)), dtype=flame.bfloat16, device="cuda")
    w = flame.tensor(rng.standard_normal((96, 64)) * 0.1, dtype=flame.bfloat16, device="cuda")
    b = flame.tensor(rng.standard_normal(96), dtype=flame.bfloat16, device="cuda")
    from flame_core.kernels import gemm_small
    from flame_core.ops.linear import linear
    monkeypatch.setattr(gemm_small, "MAX_MACS", -1)   # cuBLASLt's path is the one under test, whatever the small
                                                      # GEMM kernel's bounds
    def spy(name):
        real, got = getattr(gemm_lt, name), []

        def wrapper(*a):
            got.append(real(*a))
            return got[-1]
        return mock.patch.object(gemm_lt, name, wrapper), got
    patch, got = spy("linear_bias")
    with patch:
        y = linear(x, w, b)
    assert len(got) == 1 and got[0] is not None                  # contiguous operands: the per-op path took it
    patch, got = spy("matmul_bias")
    with patch:
        y2 = linear(x[:, ::2], w, b)                              # a strided input: matmul_bias's general path
    assert len(got) == 1 and got[0] is not None
    ref2 = (_host(x._data)[:, ::2].reshape(-1, 64) @ _host(w._data).T + _host(b._data)).reshape(3, 25, 96)
    assert np.abs(_host(y2._data) - ref2).max() <= 1.6e-2 * (np.abs(ref2).max() + 1)
    with mock.patch.object(gemm_lt, "ENABLED", False):
        y0 = linear(x, w, b)
    ref = (_host(x._data).reshape(-1, 64) @ _host(w._data).T + _host(b._data)).reshape(3, 50, 96)
    e1, e0 = np.abs(_host(y._data) - ref).max(), np.abs(_host(y0._data) - ref).max()
    assert e1 <= e0 + 1e-6 * np.abs(ref).max()   # one rounding instead of two: never worse


def test_the_epilogue_runs_inside_a_graph_capture(rng):
    from flame_core.ops.linear import linear
    x = flame.tensor(rng.standard_normal((64, 32)), dtype=flame.bfloat16, device="cuda")
    w = flame.tensor(rng.standard_normal((48, 32)), dtype=flame.bfloat16, device="cuda")
    b = flame.tensor(rng.standard_normal(48), dtype=flame.bfloat16, device="cuda")
    run = flame.cuda.graphed(lambda x: linear(x, w, b), warmup=1)
    eager = _host(linear(x, w, b)._data)
    for _ in range(3):
        out = run(x)
    np.testing.assert_array_equal(_host(out._data), eager)


def test_cublas_and_cublaslt_share_one_workspace():
    """cuBLASLt (bias epilogue, fp8) runs in the current cuBLAS handle's workspace: one 32 MiB block of the pool, as
    PyTorch's, not one per library; interleaved calls on one stream still give the references."""
    from flame_core.kernels import gemm, gemm_lt
    rng = np.random.default_rng(3)
    a, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((300, 200), (170, 200), (170,)))
    A, W, B = (backend.cupy.asarray(v) for v in (a, w, b))
    for _ in range(3):
        y = gemm_lt.matmul_bias(A, W.T, B)
        z = gemm.matmul(A, W.T)
        assert y is not None
        np.testing.assert_allclose(_host(y), a @ w.T + b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(_host(z), a @ w.T, rtol=1e-4, atol=1e-4)
    assert gemm_lt._handle()[1] is gemm.workspace()
    assert gemm.workspace().nbytes == gemm.WORKSPACE_BYTES == gemm_lt.WORKSPACE_BYTES


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("lead,N,K", [((1,), 2, 2), ((77,), 2304, 768), ((2, 5), 33, 300), ((3, 1, 4), 129, 64)])
def test_linear_bias_is_matmul_bias(lead, N, K, dtype, tol, rng):
    """linear_bias (nn.Linear's per-op path: x (..., K), w (N, K), no transposed view) gives matmul_bias's numbers
    bit for bit, in x's leading shape; it declines (None) what it does not take: N or K of 1, a non-contiguous
    operand, mixed dtypes, a misaligned bias."""
    from flame_core.kernels import gemm_lt
    cp = backend.cupy
    x, w, bias = (_dev(rng.standard_normal(s), dtype) for s in (lead + (K,), (N, K), (N,)))
    y = gemm_lt.linear_bias(x, w, bias)
    ref = gemm_lt.matmul_bias(x.reshape(-1, K), w.T, bias)
    assert y is not None and ref is not None and y.shape == lead + (N,) and y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(cp.asnumpy(y.reshape(-1, N)).view(np.uint8), cp.asnumpy(ref).view(np.uint8))
    assert gemm_lt.linear_bias(x, w[:1], bias[:1]) is None
    assert gemm_lt.linear_bias(x[..., :1], w[:, :1].copy(), bias) is None
    assert gemm_lt.linear_bias(x, w.T.copy().T, bias) is None                      # column-major w
    other = np.float32 if np.dtype(dtype) != np.float32 else np.float16
    assert gemm_lt.linear_bias(x, w, bias.astype(other)) is None
    b2 = cp.empty(N + 1, dtype=dtype)[1:]
    b2[...] = bias
    assert gemm_lt.linear_bias(x, w, b2) is None


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 2, 2), (7, 13, 5), (77, 96, 64), (130, 33, 300), (513, 257, 129)])
def test_weight_bias_grad_is_the_weight_gradient_and_the_row_sum(M, N, K, dtype, tol, rng):
    """gemm_lt.weight_bias_grad (nn.Linear's dW and db from one cuBLASLt matmul, the bias gradient in its BGRADB
    epilogue) against float64 g^T x and g.sum(0); an offset (16-byte misaligned) gradient still gives right numbers
    or None, never wrong ones."""
    from flame_core.kernels import gemm_lt
    g, x = rng.standard_normal((M, N)), rng.standard_normal((M, K))
    got = gemm_lt.weight_bias_grad(_dev(g, dtype), _dev(x, dtype))
    assert got is not None, "cuBLASLt offered no BGRADB algorithm for an aligned problem"
    dw, db = got
    assert dw.shape == (N, K) and db.shape == (N,) and dw.dtype == db.dtype == np.dtype(dtype)
    gq, xq = g.astype(dtype).astype(np.float64), x.astype(dtype).astype(np.float64)
    scale = np.sqrt(M)
    np.testing.assert_allclose(_host(dw), gq.T @ xq, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(_host(db), gq.sum(0), rtol=tol, atol=tol * scale)
    buf = _dev(np.concatenate([np.zeros(M), g.ravel()]), dtype)[M - 1:M - 1 + M * N].reshape(M, N)  # odd offset
    got = gemm_lt.weight_bias_grad(buf, _dev(x, dtype))
    if got is not None:
        np.testing.assert_allclose(_host(got[1]), _host(buf).sum(0), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_backward_on_arrays_matches_the_graph_building_backward(dtype, tol, bias, rng):
    """Linear's usual backward (on arrays; dW and db from one matmul where cuBLASLt has it) gives the gradients of
    the create_graph backward (Tensor ops), within the dtype's rounding, for every needs_input_grad combination."""
    import flame_nn.functional as F
    fd = D.dtype(dtype)
    x0, w0, b0, g0 = (rng.standard_normal(s) for s in ((3, 11, 40), (24, 40), (24,), (3, 11, 24)))
    for need in ((True, True, True), (False, True, True), (True, False, False), (False, True, False)):
        grads = []
        for create_graph in (False, True):
            x = flame.tensor(x0, device="cuda").to(fd).requires_grad_(need[0])
            w = flame.tensor(w0, device="cuda").to(fd).requires_grad_(need[1])
            b = flame.tensor(b0, device="cuda").to(fd).requires_grad_(need[2] and bias) if bias else None
            y = F.linear(x, w, b)
            leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
            gs = flame.autograd.grad(y, leaves, flame.tensor(g0, device="cuda").to(fd), create_graph=create_graph)
            grads.append([_host(t._data) for t in gs])
        for a, c in zip(*grads):
            np.testing.assert_allclose(a, c, rtol=tol, atol=tol * 4)


def test_the_gemm_handle_follows_the_current_stream_and_keeps_its_workspace():
    """FLAME's own cuBLAS handle (one per thread and device) is set to a stream only when the current stream changes,
    and its workspace is set again then (cublasSetStream resets it): products on alternating streams (each waited for
    before the next: one handle's workspace serves one stream at a time), with CuPy's own cuBLAS calls (its handle)
    in between, all give the references; the handle is not CuPy's."""
    from flame_core.kernels import gemm
    cp = backend.cupy
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 80)).astype(np.float32)
    A, B = cp.asarray(a), cp.asarray(b)
    cp.cuda.Device().synchronize()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    outs = []
    for k in range(6):
        s = s1 if k % 2 else s2
        with s:
            outs.append(gemm.matmul(A, B))
            assert gemm._state().stream == s.ptr
            cp.matmul(A[:4], B)   # CuPy's own cuBLAS handle and stream setting
        s.synchronize()
    for o in outs:
        np.testing.assert_allclose(cp.asnumpy(o), a @ b, rtol=1e-4, atol=1e-4)
    assert gemm._state().ptr != cp.cuda.device.get_cublas_handle()


def test_a_threads_gemm_handle_is_destroyed_when_the_thread_ends():
    """Each thread that runs a product gets its own cuBLAS handle; when the thread ends the handle is destroyed
    (cublasDestroy returned success: it leaves the live set only then), so threads started per task do not pile up
    handles. Products on the ended threads' handles gave the references."""
    import gc
    import threading
    import weakref

    from flame_core.kernels import gemm
    cp = backend.cupy
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((16, 24)).astype(np.float32)
    A, B = cp.asarray(a), cp.asarray(b)
    cp.cuda.Device().synchronize()
    results, errors, handles = [], [], []

    def work(together):
        try:
            results.append(cp.asnumpy(gemm.matmul(A, B)))
            st = gemm._state()
            handles.append((weakref.ref(st), st.ptr))
        except Exception as e:   # noqa: BLE001 - reported by the assertion below
            errors.append(repr(e))
        finally:   # the eight threads of a round hold their handles at once (a thread that ended first would
            together.wait(timeout=30)   # free its handle, whose address cuBLAS may then give the next one)

    for _ in range(3):
        together = threading.Barrier(8)
        threads = [threading.Thread(target=work, args=(together,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    gc.collect()
    assert not errors, errors
    assert len(results) == 24 and len(handles) == 24
    for r in results:
        np.testing.assert_allclose(r, a @ b, rtol=1e-4, atol=1e-4)
    assert all(ref() is None for ref, _ in handles)              # each thread's handle went with its thread
    assert not {ptr for _, ptr in handles} & gemm._live          # ... destroyed (cublasDestroy returned success)
    assert len({ptr for _, ptr in handles}) >= 8                 # eight threads at a time had eight handles
    st = gemm._state()
    n = gemm.live_handles()
    st.close()   # an explicit close: destroyed once; the thread's next product then makes a new handle
    st.close()
    assert st.ptr is None and gemm.live_handles() == n - 1
    gemm._local.handles.clear()
    np.testing.assert_allclose(cp.asnumpy(gemm.matmul(A, B)), a @ b, rtol=1e-4, atol=1e-4)
    assert gemm._state() is not st and gemm._state().ptr is not None


def test_linear_bias_runs_keep_each_bias_and_stay_bounded(rng, monkeypatch):
    """Linears of one shape with different biases (each bias address has its own descriptor in the thread's runs)
    alternate and each gets its own bias; bias gradients written to changing addresses land where asked; past
    the runs' limit they are dropped and rebuilt with the same numbers."""
    from flame_core.kernels import gemm_lt
    cp = backend.cupy
    x, w = (_dev(rng.standard_normal(s), np.float32) for s in ((16, 64), (32, 64)))
    biases = [_dev(rng.standard_normal(32), np.float32) for _ in range(6)]
    refs = [cp.asnumpy(gemm_lt.matmul_bias(x, w.T, b)) for b in biases]
    monkeypatch.setattr(gemm_lt._RUNS, "limit", 4)
    gemm_lt._RUNS.clear()   # the bound holds from the next new run on
    for _ in range(3):
        for b, ref in zip(biases, refs):
            y = gemm_lt.linear_bias(x, w, b)
            np.testing.assert_array_equal(cp.asnumpy(y), ref)
            assert len(gemm_lt._RUNS) <= 4
    g = _dev(rng.standard_normal((16, 32)), np.float32)
    want = cp.asnumpy(g).sum(0)
    outs = [gemm_lt.weight_bias_grad(g, x) for _ in range(5)]   # five live bias gradients: five addresses
    assert len({db.data.ptr for _, db in outs}) == 5
    for dw, db in outs:
        np.testing.assert_allclose(cp.asnumpy(db), want, rtol=1e-5, atol=1e-5)


def test_linear_bias_from_many_threads(rng):
    """Threads running the same problem shape with their own biases at once (each thread its own runs and
    descriptors) get their own results."""
    import threading

    from flame_core.kernels import gemm_lt
    cp = backend.cupy
    x, w = (_dev(rng.standard_normal(s), np.float32) for s in ((8, 32), (16, 32)))
    biases = [_dev(rng.standard_normal(16), np.float32) for _ in range(8)]
    refs = [cp.asnumpy(gemm_lt.matmul_bias(x, w.T, b)) for b in biases]
    cp.cuda.Device().synchronize()
    errors = []

    def work(i):
        try:
            with cp.cuda.Stream():
                for _ in range(50):
                    y = gemm_lt.linear_bias(x, w, biases[i])
                    dw, db = gemm_lt.weight_bias_grad(y, x)
                got, gdb = cp.asnumpy(y), cp.asnumpy(db)
            np.testing.assert_array_equal(got, refs[i])
            np.testing.assert_allclose(gdb, refs[i].sum(0), rtol=1e-5, atol=1e-4)
        except Exception as e:   # noqa: BLE001 - reported by the assertion below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
