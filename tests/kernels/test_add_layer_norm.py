"""add_layer_norm / add_rms_norm: (x + r, norm(x + r) w + b) in one kernel each way -- the reference against the
composed ops in float64, the op against add + layer_norm forward and backward (with s's own gradient), float64
gradients, the errors, and the kernels against the reference on ragged and misaligned shapes in fp32 / fp16 / bf16."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, grad_mag, rand, to64

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import add_layer_norm as K


def _composed64(x, r, w, b, eps, rms=False):
    s = x.astype(np.float64) + r.astype(np.float64)
    c = s if rms else s - s.mean(-1, keepdims=True)
    y = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps)
    if w is not None:
        y = y * w.astype(np.float64)
    if b is not None:
        y = y + b.astype(np.float64)
    return s, y


@pytest.mark.parametrize("rms", [False, True])
def test_reference_is_the_add_then_the_norm(rng, rms):
    x, r = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 3, 16)) * 3
    w, b = rng.standard_normal(16), None if rms else rng.standard_normal(16)
    s, y, mean, rstd = K.add_layer_norm_forward(x, r, w, b, 1e-5, rms)
    s64, y64 = _composed64(x, r, w, b, 1e-5, rms)
    np.testing.assert_array_equal(s, s64)
    np.testing.assert_allclose(y, y64, rtol=1e-12, atol=1e-13)
    assert (mean is None) == rms and rstd.shape == (2, 3)


def test_reference_normalises_the_rounded_sum(rng):
    x, r = rand(rng, (4, 64), np.float16), rand(rng, (4, 64), np.float16, scale=100.0)
    s, y, _, _ = K.add_layer_norm_forward(x, r, None, None, 1e-5)
    assert s.dtype == np.float16
    np.testing.assert_array_equal(s, x + r)
    want = _composed64(s, np.zeros_like(s), None, None, 1e-5)[1]  # the norm of s as stored
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_op_matches_add_then_norm_forward_and_backward(rng, affine, rms):
    D = 12
    x = flame.tensor(rng.standard_normal((2, 5, D)), dtype=flame.float32, requires_grad=True)
    r = flame.tensor(rng.standard_normal((2, 5, D)), dtype=flame.float32, requires_grad=True)
    w = flame.tensor(rng.standard_normal(D), dtype=flame.float32, requires_grad=True) if affine else None
    b = flame.tensor(rng.standard_normal(D), dtype=flame.float32, requires_grad=True) if affine and not rms else None
    gy, gs = (flame.tensor(rng.standard_normal((2, 5, D)), dtype=flame.float32) for _ in range(2))
    params = [p for p in (x, r, w, b) if p is not None]

    s, y = F.add_rms_norm(x, r, w, 1e-6) if rms else F.add_layer_norm(x, r, w, b, 1e-5)
    assert y.grad_fn.name() == "AddLayerNormBackward" and s.grad_fn is y.grad_fn
    ((y * gy).sum() + (s * gs).sum()).backward()
    fused = [p.grad.numpy().copy() for p in params]
    for p in params:
        p.grad = None

    s2 = x + r
    y2 = F.rms_norm(s2, (D,), w, 1e-6) if rms else F.layer_norm(s2, (D,), w, b, 1e-5)
    ((y2 * gy).sum() + (s2 * gs).sum()).backward()
    np.testing.assert_array_equal(s.detach().numpy(), s2.detach().numpy())
    np.testing.assert_allclose(y.detach().numpy(), y2.detach().numpy(), rtol=1e-5, atol=1e-6)
    for got, p in zip(fused, params):
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_only_the_normed_output_used(rng):
    x = flame.tensor(rng.standard_normal((3, 8)), requires_grad=True)
    r = flame.tensor(rng.standard_normal((3, 8)))
    w = flame.tensor(rng.standard_normal(8))
    g = rng.standard_normal((3, 8))
    _, y = F.add_layer_norm(x, r, w, None)
    (y * flame.tensor(g)).sum().backward()
    s = x.detach().numpy() + r.numpy()
    _, _, mean, rstd = K.add_layer_norm_forward(s, np.zeros_like(s), w.numpy(), None)
    want = K._backward_ref(g, None, s, w.numpy(), mean, rstd, False, False, False)[0]
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-12)
    assert r.grad is None
    assert np.abs(x.grad.numpy().sum(-1)).max() < 1e-12  # layer_norm's dx sums to 0 over a row


def test_mixed_dtypes_promote_as_the_add(rng):
    x = flame.tensor(rng.standard_normal((2, 8)), dtype=flame.float32)
    r = flame.tensor(rng.standard_normal((2, 8)), dtype=flame.bfloat16)
    s, y = F.add_layer_norm(x, r)
    assert s.dtype == flame.float32 and y.dtype == flame.float32
    np.testing.assert_array_equal(s.numpy(), (x + r).numpy())


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), d=st.integers(1, 6), affine=st.booleans(),
       rms=st.booleans(), use_s=st.booleans())
def test_gradcheck(lead, d, affine, rms, use_s):
    rng = np.random.default_rng(len(lead) * 1000 + sum(lead) * 100 + d * 10 + affine)
    shape = tuple(lead) + (d,)
    x, r = (flame.tensor(rng.standard_normal(shape), dtype=flame.float64, requires_grad=True) for _ in range(2))
    ps = []
    if affine:
        ps.append(flame.tensor(rng.standard_normal(d), dtype=flame.float64, requires_grad=True))
        if not rms:
            ps.append(flame.tensor(rng.standard_normal(d), dtype=flame.float64, requires_grad=True))
    gs = flame.tensor(rng.standard_normal(shape), dtype=flame.float64)

    def fn(x, r, *p):
        w, b = (p + (None, None))[:2]
        s, y = F.add_rms_norm(x, r, w) if rms else F.add_layer_norm(x, r, w, b)
        return y + s * gs if use_s else y
    assert gradcheck(fn, (x, r) + tuple(ps))


def test_errors_name_the_shapes():
    x = flame.zeros((2, 3, 8))
    with pytest.raises(ShapeError, match=r"input \(2, 3, 8\) and residual \(3, 8\)"):
        F.add_layer_norm(x, flame.zeros((3, 8)))
    with pytest.raises(ShapeError, match=r"weight has shape \(7,\), expected \(8,\) for x \(2, 3, 8\)"):
        F.add_layer_norm(x, x, flame.zeros(7))
    with pytest.raises(ShapeError, match=r"bias has shape \(4,\), expected \(8,\)"):
        K.add_layer_norm_forward(np.zeros((2, 8)), np.zeros((2, 8)), None, np.zeros(4))
    with pytest.raises(ShapeError, match=r"x \(2, 8\) float64 and residual \(2, 8\) float32"):
        K.add_layer_norm_forward(np.zeros((2, 8)), np.zeros((2, 8), np.float32))
    with pytest.raises(ShapeError, match=r"gradients \(2, 7\) and None, expected \(2, 8\)"):
        K.add_layer_norm_backward(np.zeros((2, 7)), None, np.zeros((2, 8)), None, np.zeros(2), np.ones(2))


# (leading shape, D): ragged rows, every thread-group width (1 .. 256 threads per row), the widest D (vectors: 4096,
# scalars: 4001), D not a multiple of a vector (the scalar path: 1, 3, 33, 4001)
CASES = [((3, 5), 64), ((2, 77), 768), ((1,), 1), ((7,), 3), ((4,), 200), ((2, 9), 1280), ((3,), 4096),
         ((5,), 33), ((1, 333), 512), ((2,), 4001)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("params", ["none", "same", "f32", "rms"])
@pytest.mark.parametrize("offset", [0, 1])
def test_kernels_against_the_reference(ab, rng, dt, case, params, offset):
    lead, D = case
    dtype, shape = DTYPES[dt], lead + (D,)
    n = int(np.prod(shape))
    rms = params == "rms"
    xb, rb = rand(rng, (n + offset,), dtype), rand(rng, (n + offset,), dtype, scale=3.0)
    wdt = np.float32 if params == "f32" else dtype
    w = None if params == "none" else rand(rng, (D,), wdt, loc=1.0, scale=0.3)
    b = None if params in ("none", "rms") else rand(rng, (D,), wdt, scale=0.3)
    gy, gs = rand(rng, shape, dtype), rand(rng, shape, dtype)

    def view(a):  # offset 1: a contiguous array whose start is not 16-byte aligned
        return a[offset:offset + n].reshape(shape)

    k, r = ab(lambda xb, rb, w, b: K.add_layer_norm_forward(view(xb), view(rb), w, b, 1e-5, rms), xb, rb, w, b)
    assert k[0].shape == shape and k[1].shape == shape and k[0].dtype == dtype and k[1].dtype == dtype
    np.testing.assert_array_equal(to64(k[0]), to64(r[0]))  # s: the same rounding of the same sum
    assert_close(k[1], r[1], dt, "add_layer_norm y")
    assert_close(k[3], r[3], "float32", "rstd")
    if not rms:
        assert_close(k[2], r[2], "float32", "mean", mag=1.0)
    s64 = view(xb).astype(np.float64) + view(rb).astype(np.float64)
    s_rounded = view(xb) + view(rb)
    assert_close(k[1], _composed64(s_rounded, np.zeros_like(s_rounded), w, b, 1e-5, rms)[1], dt, "y vs float64")

    s, mean, rstd = k[0], k[2], k[3]
    for with_s in (False, True):
        kb, rbk = ab(lambda gy, gs, wd: K.add_layer_norm_backward(gy, gs if with_s else None, s, wd, mean, rstd, rms,
                                                                   weight_grad=w is not None, bias_grad=b is not None),
                     gy, gs, w)
        rstd64 = 1 / np.sqrt(s64.var(-1) + 1e-5)
        mag = grad_mag(gy, rstd64, w) + (np.abs(gs.astype(np.float64)).max() if with_s else 0.0)
        assert_close(kb[0], rbk[0], dt, f"dsum (ds: {with_s})", scale=2.0, mag=mag)
        if w is not None:
            assert_close(kb[1], rbk[1], "float32", "dw", scale=4.0)
        if b is not None:
            assert_close(kb[2], rbk[2], "float32", "db")


@pytest.mark.gpu
def test_op_on_the_gpu_matches_the_composed_ops(rng):
    dev, D = flame.device("cuda"), 768
    x, r = (flame.tensor(rng.standard_normal((2, 77, D)), dtype=flame.bfloat16, device=dev, requires_grad=True)
            for _ in range(2))
    w = flame.tensor(rng.standard_normal(D) * 0.2 + 1, dtype=flame.bfloat16, device=dev, requires_grad=True)
    b = flame.tensor(rng.standard_normal(D) * 0.2, dtype=flame.bfloat16, device=dev, requires_grad=True)
    gy, gs = (flame.tensor(rng.standard_normal((2, 77, D)), dtype=flame.bfloat16, device=dev) for _ in range(2))
    s, y = F.add_layer_norm(x, r, w, b)
    ((y.float() * gy.float()).sum() + (s.float() * gs.float()).sum()).backward()
    fused = [p.grad.float().numpy() for p in (x, r, w, b)]
    for p in (x, r, w, b):
        p.grad = None
    s2 = x + r
    y2 = F.layer_norm(s2, (D,), w, b)
    ((y2.float() * gy.float()).sum() + (s2.float() * gs.float()).sum()).backward()
    np.testing.assert_array_equal(s.detach().float().numpy(), s2.detach().float().numpy())
    assert_close(y.detach().float().numpy(), y2.detach().float().numpy(), "bfloat16", "forward")
    for got, p, what in zip(fused, (x, r, w, b), ("dx", "dr", "dw", "db")):
        assert_close(got, p.grad.float().numpy(), "bfloat16", what, scale=2.0)



@pytest.mark.parametrize("rms", [False, True])
def test_forward_without_statistics_gives_the_same_outputs(device, rng, rms):
    """stats=False (no backward to come: the op passes it under no_grad): s and y as with the statistics, none
    kept; and the op under no_grad gives the outputs it gives with grad."""
    dev = flame.device(device)
    x, r = (flame.tensor(rng.standard_normal((3, 5, 40)), dtype=flame.bfloat16, device=dev) for _ in range(2))
    w = flame.tensor(rng.standard_normal(40) * 0.1 + 1, dtype=flame.bfloat16, device=dev)
    b = None if rms else flame.tensor(rng.standard_normal(40) * 0.1, dtype=flame.bfloat16, device=dev)
    arrays = (x._data, r._data, w._data, None if b is None else b._data)
    full = K.add_layer_norm_forward(*arrays, 1e-5, rms)
    bare = K.add_layer_norm_forward(*arrays, 1e-5, rms, stats=False)
    assert bare[2] is None and bare[3] is None and full[3] is not None
    for a, c in zip(full[:2], bare[:2]):
        np.testing.assert_array_equal(flame.tensor(a).float().numpy(), flame.tensor(c).float().numpy())
    op = (lambda: F.add_rms_norm(x, r, w)) if rms else (lambda: F.add_layer_norm(x, r, w, b))
    with flame.no_grad():
        s0, y0 = op()
    w.requires_grad_(True)
    s1, y1 = op()
    assert y1.grad_fn is not None
    for a, c in ((s0, s1), (y0, y1)):
        np.testing.assert_array_equal(a.float().numpy(), c.detach().float().numpy())


@pytest.mark.gpu
def test_packed_launch_path_matches_the_general_path(rng, monkeypatch):
    """The eager per-op path (one PackedLaunch per configuration, `_forward_cached`) gives the general path's outputs
    bit for bit, and keys every scalar: a call with another eps, rms, statistics or alignment is not served by an
    earlier configuration's launch; a repeated call reuses it; misaligned arrays take the general path (which copies
    them: the same 16-byte vectors, the same sums)."""
    import cupy as cp
    dt = DTYPES["bfloat16"]
    xb, rb = (cp.asarray(rand(rng, (2 * 77 * 768 + 1,), dt)) for _ in range(2))
    w, b = cp.asarray(rand(rng, (768,), dt, loc=1.0, scale=0.3)), cp.asarray(rand(rng, (768,), dt, scale=0.3))
    calls = [(xb[:-1].reshape(2, 77, 768), rb[:-1].reshape(2, 77, 768), w, b, 1e-5, False, True),
             (xb[:-1].reshape(2, 77, 768), rb[:-1].reshape(2, 77, 768), w, b, 1e-2, False, True),
             (xb[:-1].reshape(2, 77, 768), rb[:-1].reshape(2, 77, 768), w, None, 1e-5, True, True),
             (xb[:-1].reshape(2, 77, 768), rb[:-1].reshape(2, 77, 768), None, None, 1e-5, False, False),
             (xb[1:].reshape(2, 77, 768), rb[1:].reshape(2, 77, 768), w, b, 1e-5, False, True)]  # unaligned
    K._FWD.clear()
    fast = [K.add_layer_norm_forward(*c[:6], stats=c[6]) for c in calls + calls]
    assert len(K._FWD) == len(calls) - 1   # the unaligned call has no packed launch
    monkeypatch.setattr(K, "_forward_cached", lambda *a: None)
    general = [K.add_layer_norm_forward(*c[:6], stats=c[6]) for c in calls]
    for f, f2, g in zip(fast, fast[len(calls):], general):
        for a, a2, c in zip(f, f2, g):
            assert (a is None) == (c is None) and (a2 is None) == (c is None)
            if c is not None:
                np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint16 if a.itemsize == 2 else np.uint32),
                                              cp.asnumpy(c).view(np.uint16 if c.itemsize == 2 else np.uint32))
                np.testing.assert_array_equal(cp.asnumpy(a2).view(np.uint16 if a.itemsize == 2 else np.uint32),
                                              cp.asnumpy(c).view(np.uint16 if c.itemsize == 2 else np.uint32))
