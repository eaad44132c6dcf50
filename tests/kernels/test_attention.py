"""Scaled dot-product attention: the chunked reference and the Tensor op against a dense float64 formula (forward and
analytic gradients), gradchecks, errors; on the GPU the FlashAttention-2 kernels on ragged shapes, masks, layouts, and
the memory bound (no Lq x Lk allocation at L = 16384)."""
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flame_core as flame
from flame_core import backend
from flame_core.autograd import gradcheck
from flame_core.errors import DTypeError, ShapeError
from flame_core.kernels import attention as K
from flame_core.kernels import launching, loader
from flame_core.ops.attention import qkv_attention
from flame_core.ops.attention import scaled_dot_product_attention as sdpa

BF16 = np.dtype(ml_dtypes.bfloat16)
REL_TOL = {"bfloat16": 1e-2, "float16": 5e-3}  # relative (Frobenius) error against float64


# ----------------------------------------------------------------------------- dense float64 oracle
def dense(q, k, v, mask=None, causal=False, scale=None, do=None):
    """softmax(q k^T * scale + mask) v in float64 with the whole score matrix; with `do` also (dq, dk, dv) by the
    textbook formulas (dP = dO V^T, dS = P * (dP - rowsum(dP * P)))."""
    q, k, v = (np.asarray(backend.to_numpy(a), np.float64) for a in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        m = backend.to_numpy(mask)
        s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + m.astype(np.float64)
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.arange(lk)[None, :] > np.arange(lq)[:, None], -np.inf, s)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(s - mx)
    l = e.sum(-1, keepdims=True)
    p = e / np.where(l > 0, l, 1.0)
    o = p @ v
    lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + mx, np.inf)[..., 0]
    if do is None:
        return o, lse
    g = np.asarray(backend.to_numpy(do), np.float64)
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return o, lse, (ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ g)


def rel_err(got, want):
    got = np.asarray(backend.to_numpy(got), np.float64)
    den = np.linalg.norm(want)
    return np.linalg.norm(got - want) / (den if den > 0 else 1.0)


def make_mask(rng, kind, b, h, lq, lk):
    if kind is None:
        return None
    if kind == "bool":
        m = rng.random((b, 1, lq, lk)) > 0.3
        m[..., 0] = True  # every row keeps a key (fully masked rows have their own test)
        return m
    if kind == "keypad":  # (B, 1, 1, Lk): the text padding mask of a batch
        m = np.ones((b, 1, 1, lk), bool)
        m[0, ..., max(1, lk // 2):] = False
        return m
    if kind == "keypad-text":  # Chroma's padded text: runs of masked keys across granules of 64 (the Hopper kernels'
        m = np.ones((b, 1, 1, lk), bool)  # FA_MASK_KEYPAD: kept, masked and mixed key tiles)
        m[0, ..., 70:300] = False
        if b > 1:
            m[1, ..., 128:256] = False
        return m
    if kind == "float":
        return rng.standard_normal((1, h, lq, lk)) * 2.0
    raise ValueError(kind)


# ----------------------------------------------------------------------------- reference (NumPy), any device
@given(b=st.integers(1, 2), h=st.integers(1, 3), lq=st.integers(1, 40), lk=st.integers(1, 40),
       e=st.integers(1, 12), ev=st.integers(1, 12), kind=st.sampled_from([None, "bool", "keypad", "float"]),
       causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_reference_matches_dense(b, h, lq, lk, e, ev, kind, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(s) for s in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, ev), (b, h, lq, ev)))
    mask = None if causal else make_mask(rng, kind, b, h, lq, lk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "CHUNK_BYTES", 700)  # a few query rows per chunk: exercises the chunk seams
        o, lse = K.flash_attention_forward(q, k, v, mask, causal, 0.7)
        got = K.flash_attention_backward(do, q, k, v, o, lse, mask, causal, 0.7)
    want_o, want_lse, grads = dense(q, k, v, mask, causal, 0.7, do)
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    for name, g, w in zip(("dq", "dk", "dv"), got, grads):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11, err_msg=name)


def test_reference_half_inputs_compute_in_float32(rng):
    q, k, v = (rng.standard_normal((1, 2, 33, 16)).astype(BF16) for _ in range(3))
    o, lse = K.flash_attention_forward(q, k, v)
    assert o.dtype == BF16 and lse.dtype == np.float32
    want_o, want_lse = dense(q, k, v)
    assert rel_err(o, want_o) < 5e-3
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5)


def test_fully_masked_rows_are_zero(rng):
    b, h, lq, lk, e = 1, 2, 6, 9, 8
    q, k, v, do = (rng.standard_normal(s) for s in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, e), (b, h, lq, e)))
    mask = rng.random((lq, lk)) > 0.4
    mask[0] = False
    mask[3] = False
    mask[1, 2] = True
    o, lse = K.flash_attention_forward(q, k, v, mask)
    assert np.all(o[:, :, [0, 3]] == 0) and np.all(np.isinf(lse[:, :, [0, 3]]))
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, mask)
    assert np.all(dq[:, :, [0, 3]] == 0)
    want_o, _, grads = dense(q, k, v, mask, do=do)
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12)
    for g, w in zip((dq, dk, dv), grads):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)


def test_empty_key_sequence_gives_zeros(rng):
    q, k, v = rng.standard_normal((1, 1, 4, 8)), np.zeros((1, 1, 0, 8)), np.zeros((1, 1, 0, 5))
    o, lse = K.flash_attention_forward(q, k, v)
    assert o.shape == (1, 1, 4, 5) and np.all(o == 0) and np.all(np.isinf(lse))


def test_reference_holds_one_chunk_of_scores(monkeypatch, rng):
    """At L = 4096 the whole score matrix is 64 MiB of float32; with a 1 MiB chunk budget the forward + backward peak
    is a few chunks (tracemalloc sees NumPy's buffers)."""
    monkeypatch.setattr(K, "CHUNK_BYTES", 1 << 20)
    n, e = 4096, 32
    q, k, v, do = (rng.standard_normal((1, 1, n, e)).astype(np.float32) for _ in range(4))
    tracemalloc.start()
    try:
        o, lse = K.flash_attention_forward(q, k, v, is_causal=True)
        K.flash_attention_backward(do, q, k, v, o, lse, is_causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    full = n * n * 4
    assert peak < 8 * K.CHUNK_BYTES <= full // 8, f"peak {peak} bytes, a full score matrix is {full}"


# ----------------------------------------------------------------------------- Tensor op
def _t(a, device, requires_grad=False, dtype=flame.float64):
    return flame.tensor(a, dtype=dtype, device=device, requires_grad=requires_grad)


@given(lead=st.sampled_from([((2,), (2,), (2,)), ((2, 2), (1, 2), (2, 1)), ((), (), ()), ((1, 2, 1), (2, 1, 1),
                                                                                       (2, 1, 1))]),
       lq=st.integers(1, 4), lk=st.integers(1, 4), e=st.integers(1, 3), ev=st.integers(1, 3),
       kind=st.sampled_from([None, "bool", "float", "causal"]), transposed=st.booleans(), seed=st.integers(0, 999))
def test_sdpa_gradcheck(lead, lq, lk, e, ev, kind, transposed, seed):
    rng = np.random.default_rng(seed)
    lq_, lk_, lv_ = lead
    q = rng.standard_normal(lq_ + (lq, e))
    k = rng.standard_normal(lk_ + (lk, e))
    v = rng.standard_normal(lv_ + (lk, ev))
    if transposed:  # non-contiguous views with the intended values
        qt = _t(np.ascontiguousarray(np.swapaxes(q, -1, -2)), "cpu").transpose(-1, -2).detach().requires_grad_()
    else:
        qt = _t(q, "cpu", True)
    kt, vt = _t(k, "cpu", True), _t(v, "cpu", True)
    mask = None
    if kind == "bool":
        m = rng.random((lq, lk)) > 0.3
        m[:, 0] = True
        mask = flame.tensor(m, device="cpu")
    elif kind == "float":
        mask = _t(rng.standard_normal((lq, lk)), "cpu")
    assert gradcheck(lambda a, b_, c: sdpa(a, b_, c, attn_mask=mask, is_causal=kind == "causal", scale=0.9),
                     (qt, kt, vt))


def test_sdpa_matches_dense_on_device(device, rng):
    b, h, lq, lk, e = 2, 3, 45, 31, 16
    q, k, v, g = (rng.standard_normal(s) for s in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, e), (b, h, lq, e)))
    mask = rng.random((b, 1, lq, lk)) > 0.2
    mask[..., 0] = True
    qt, kt, vt = (_t(a, device, True, flame.float32) for a in (q, k, v))
    out = sdpa(qt, kt, vt, attn_mask=flame.tensor(mask, device=device))
    out.backward(_t(g, device, dtype=flame.float32))
    want_o, _, grads = dense(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), mask, do=g)
    assert out.dtype == flame.float32 and tuple(out.shape) == (b, h, lq, e)
    np.testing.assert_allclose(out.detach().numpy(), want_o, rtol=1e-4, atol=1e-5)
    for t, w in zip((qt, kt, vt), grads):
        np.testing.assert_allclose(t.grad.numpy(), w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,h,lq,lk,e,ev", [(1, 1, 1, 1, 1, 1), (2, 3, 45, 31, 16, 16), (1, 2, 7, 130, 40, 24),
                                           (3, 1, 129, 65, 64, 64)])
def test_float32_dense_path_matches_float64_and_the_chunked_reference(rng, monkeypatch, b, h, lq, lk, e, ev, causal):
    """float32 cuda attention without a mask runs dense (two cuBLAS products around the softmax kernels): forward,
    lse and gradients against the float64 oracle, and against the chunked reference it replaced (forced off)."""
    cp = backend.cupy
    q, k, v, do = (rng.standard_normal(s) for s in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, ev), (b, h, lq, ev)))
    arrs = [cp.asarray(a.astype(np.float32)) for a in (q, k, v, do)]
    kt = cp.asarray(np.ascontiguousarray(np.swapaxes(k, -1, -2)).astype(np.float32)).swapaxes(-1, -2)  # strided k
    assert K._dense_ok(arrs[0], kt, arrs[2], None)
    o, lse = K.flash_attention_forward(arrs[0], kt, arrs[2], None, causal, 0.6)
    grads = K.flash_attention_backward(arrs[3], arrs[0], kt, arrs[2], o, lse, None, causal, 0.6)
    want_o, want_lse, want_g = dense(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), None, causal,
                                     0.6, do.astype(np.float32))
    assert o.dtype == np.float32 and lse.dtype == np.float32 and lse.shape == (b, h, lq)
    np.testing.assert_allclose(cp.asnumpy(o), want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(cp.asnumpy(lse), want_lse, rtol=2e-6, atol=2e-5)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_g):
        assert g.dtype == np.float32
        np.testing.assert_allclose(cp.asnumpy(g), w, rtol=1e-4, atol=5e-5, err_msg=name)
    monkeypatch.setattr(K, "_dense_ok", lambda *a: False)
    o2, lse2 = K.flash_attention_forward(arrs[0], kt, arrs[2], None, causal, 0.6)
    grads2 = K.flash_attention_backward(arrs[3], arrs[0], kt, arrs[2], o2, lse2, None, causal, 0.6)
    np.testing.assert_allclose(cp.asnumpy(o), cp.asnumpy(o2), rtol=2e-5, atol=2e-6)
    for g, g2 in zip(grads, grads2):
        np.testing.assert_allclose(cp.asnumpy(g), cp.asnumpy(g2), rtol=1e-4, atol=2e-5)


def test_sdpa_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = (rng.standard_normal((1, 5, 9)) for _ in range(3))
    got = sdpa(_t(q, "cpu"), _t(k, "cpu"), _t(v, "cpu")).detach().numpy()
    np.testing.assert_allclose(got, dense(q, k, v, scale=1 / 3)[0], rtol=1e-12)
    assert not np.allclose(got, dense(q, k, v, scale=1.0)[0])


def test_sdpa_errors():
    q, k, v = flame.randn(1, 2, 4, 8), flame.randn(1, 2, 5, 8), flame.randn(1, 2, 5, 6)
    with pytest.raises(ShapeError, match=r"\(1, 2, 4, 8\)"):
        sdpa(q, flame.randn(1, 2, 5, 7), v)
    with pytest.raises(ShapeError, match="broadcast"):
        sdpa(q, flame.randn(3, 2, 5, 8), flame.randn(3, 2, 5, 6)[:2])
    with pytest.raises(ValueError, match="not both"):
        sdpa(q, k, v, attn_mask=flame.ones(4, 5, dtype=flame.bool), is_causal=True)
    with pytest.raises(DTypeError, match="int64"):
        sdpa(q, k, v, attn_mask=flame.ones(4, 5, dtype=flame.int64))
    with pytest.raises(ShapeError, match=r"\(4, 4\)"):
        sdpa(q, k, v, attn_mask=flame.ones(4, 4, dtype=flame.bool))
    with pytest.raises(DTypeError, match="share a dtype"):
        sdpa(q, k.to(flame.float64), v)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        sdpa(q, k, v, dropout_p=1.5)
    with pytest.raises(ShapeError, match="divides the query's"):
        sdpa(flame.randn(1, 3, 4, 8), flame.randn(1, 2, 5, 8), flame.randn(1, 2, 5, 8), enable_gqa=True)
    with pytest.raises(ShapeError, match="broadcast"):
        K.flash_attention_forward(np.zeros((1, 2, 4, 8)), np.zeros((1, 2, 5, 8)), np.zeros((1, 2, 5, 8)),
                                  np.zeros((3, 4, 5), bool))


def test_sdpa_enable_gqa_shares_key_value_heads(device, rng):
    """enable_gqa: 2 key / value heads serve 6 query heads (each 3), as torch: the same as repeating them by hand."""
    q = flame.tensor(rng.standard_normal((2, 6, 5, 8)), device=device)
    k = flame.tensor(rng.standard_normal((2, 2, 7, 8)), device=device)
    v = flame.tensor(rng.standard_normal((2, 2, 7, 4)), device=device)
    got = sdpa(q, k, v, enable_gqa=True, is_causal=True)
    want = sdpa(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    o, _ = dense(q.numpy()[:, :1], k.numpy()[:, :1], v.numpy()[:, :1], causal=True)
    np.testing.assert_allclose(got.numpy()[:, :1], o, rtol=1e-10)


def test_sdpa_dropout_drops_attention_weights(device, rng):
    """dropout_p > 0: the weights of a dense path dropped (kept ones scaled by 1 / (1 - p)): p = 1 gives zeros, a
    fixed seed gives the same output and the same gradient (checked in float64), the mean over many draws approaches
    the undropped output, and the masks (bool, additive, causal) still apply."""
    q = flame.tensor(rng.standard_normal((1, 2, 4, 8)), device=device)
    k = flame.tensor(rng.standard_normal((1, 2, 6, 8)), device=device)
    v = flame.tensor(rng.standard_normal((1, 2, 6, 3)), device=device)
    assert not sdpa(q, k, v, dropout_p=1.0).numpy().any()
    flame.manual_seed(5)
    a = sdpa(q, k, v, dropout_p=0.3).numpy()
    flame.manual_seed(5)
    np.testing.assert_array_equal(sdpa(q, k, v, dropout_p=0.3).numpy(), a)
    mean = np.mean([sdpa(q, k, v, dropout_p=0.3).numpy() for _ in range(400)], axis=0)
    np.testing.assert_allclose(mean, sdpa(q, k, v).numpy(), atol=0.15)
    # tiny p: the weights are (almost surely) all kept -- the dense path equals the fused one, masks included
    for kw in (dict(is_causal=True), dict(attn_mask=flame.tensor(rng.standard_normal((4, 6)), device=device)),
               dict(attn_mask=flame.tensor(rng.random((1, 2, 4, 6)) > 0.3, device=device))):
        if "attn_mask" in kw and kw["attn_mask"].dtype == flame.bool:
            kw["attn_mask"][..., 0] = True
        np.testing.assert_allclose(sdpa(q, k, v, dropout_p=1e-12, **kw).numpy(), sdpa(q, k, v, **kw).numpy(),
                                   rtol=1e-10, atol=1e-12)

    def seeded(a, b, c):
        flame.manual_seed(11)
        return sdpa(a, b, c, dropout_p=0.4)
    args = tuple(flame.tensor(t.numpy(), dtype=flame.float64, device=device, requires_grad=True) for t in (q, k, v))
    assert gradcheck(seeded, args)


# ----------------------------------------------------------------------------- qkv_attention (packed projection)
def _split(qkv, heads):
    """The (B, heads, L, D) q, k, v of a packed (B, L, 3 * heads * D) array, as a model would split them."""
    b, l, w = qkv.shape
    a = qkv.reshape(b, l, 3, heads, w // (3 * heads)).transpose(2, 0, 3, 1, 4)
    return a[0], a[1], a[2]


@pytest.mark.parametrize("kind", [None, "causal", "bool", "float"])
def test_qkv_attention_matches_dense_on_device(device, rng, kind):
    b, heads, l, d = 2, 3, 13, 8
    qkv, g = rng.standard_normal((b, l, 3 * heads * d)), rng.standard_normal((b, l, heads * d))
    mask = None
    if kind == "bool":  # CLIP's causal & padding mask (B, 1, L, L)
        mask = (np.arange(l)[:, None] >= np.arange(l)[None, :])[None, None] & (rng.random((b, 1, 1, l)) > 0.3)
        mask[..., 0] = True
    elif kind == "float":  # T5's position bias (1, heads, L, L)
        mask = rng.standard_normal((1, heads, l, l)).astype(np.float32)
    t = _t(qkv, device, True, flame.float32)
    m = None if mask is None else flame.tensor(mask, device=device)
    out = qkv_attention(t, heads, attn_mask=m, is_causal=kind == "causal")
    out.backward(_t(g, device, dtype=flame.float32))
    q, k, v = _split(qkv.astype(np.float32), heads)
    do = g.reshape(b, l, heads, d).transpose(0, 2, 1, 3)
    want_o, _, (dq, dk, dv) = dense(q, k, v, mask, causal=kind == "causal", do=do)
    assert out.dtype == flame.float32 and tuple(out.shape) == (b, l, heads * d)
    np.testing.assert_allclose(out.detach().numpy(), want_o.transpose(0, 2, 1, 3).reshape(b, l, heads * d),
                               rtol=1e-4, atol=1e-5)
    want_g = np.stack([x.transpose(0, 2, 1, 3) for x in (dq, dk, dv)], axis=2).reshape(qkv.shape)
    np.testing.assert_allclose(t.grad.numpy(), want_g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", [None, "bool", "causal"])
def test_qkv_attention_gradcheck(rng, kind):
    b, heads, l, d = 1, 2, 4, 3
    t = _t(rng.standard_normal((b, l, 3 * heads * d)), "cpu", True)
    mask = None
    if kind == "bool":
        m = rng.random((b, 1, l, l)) > 0.3
        m[..., 0] = True
        mask = flame.tensor(m, device="cpu")
    assert gradcheck(lambda a: qkv_attention(a, heads, attn_mask=mask, is_causal=kind == "causal", scale=0.9), (t,))


def test_qkv_attention_is_sdpa_over_split_heads_bit_for_bit(device, rng):
    """The same kernels on the same strided operands: equal to splitting the heads around sdpa, in bf16 too."""
    b, heads, l, d = 1, 4, 77, 16
    dt = flame.bfloat16 if device.type == "cuda" else flame.float32
    t = flame.tensor(rng.standard_normal((b, l, 3 * heads * d)).astype(np.float32), device=device).to(dt)
    q, k, v = t.reshape(b, l, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
    want = sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, l, heads * d)
    got = qkv_attention(t, heads, is_causal=True)
    assert got.dtype == dt
    np.testing.assert_array_equal(got.float().numpy(), want.float().numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("b,heads,l,d", [(1, 12, 77, 64), (2, 20, 77, 64), (1, 4, 333, 128), (1, 1, 9, 64),
                                         (1, 3, 20, 12)])
def test_qkv_attention_packed_launch_path(rng, monkeypatch, b, heads, l, d):
    """cuda's per-op path (K.qkv_attention_forward: a configuration's launch packed at its first call, later calls
    launch on q, k, v's addresses in the packed array) gives the head-split path's outputs and gradients bit for bit,
    on the first call and on the repeated ones; causal and not; D = 12 (padded) has no packed launch."""
    dt = flame.bfloat16
    x = rng.standard_normal((b, l, 3 * heads * d)).astype(np.float32)
    g = flame.tensor(rng.standard_normal((b, l, heads * d)).astype(np.float32), device="cuda").to(dt)
    K._qkv_plans.clear()
    for causal in (True, False):
        runs = []
        for fast in (True, True, True, False):
            if not fast:
                monkeypatch.setattr(K, "qkv_attention_forward", lambda *a: None)
            t = flame.tensor(x, device="cuda").to(dt).requires_grad_(True)
            out = qkv_attention(t, heads, is_causal=causal)
            out.backward(g)
            runs.append((out.detach().float().numpy(), t.grad.float().numpy()))
            monkeypatch.undo()
        for o, dg in runs[:3]:
            np.testing.assert_array_equal(o, runs[3][0])
            # the backward is the same kernel on the same arrays, but dQ sums its key blocks' shares in fp32 in the
            # order they arrive (one key block at L = 77: bit-equal there); a bf16 ulp elsewhere
            ref = runs[3][1]
            if l <= 64:
                np.testing.assert_array_equal(dg, ref)
            np.testing.assert_allclose(dg, ref, rtol=0, atol=8e-3 * np.abs(ref).max())
    assert len(K._qkv_plans) == (0 if d % 8 else 2)


def test_qkv_attention_default_scale_and_errors(rng):
    qkv = rng.standard_normal((1, 5, 3 * 2 * 9))
    q, k, v = _split(qkv, 2)
    got = qkv_attention(_t(qkv, "cpu"), 2).numpy()
    np.testing.assert_allclose(got, dense(q, k, v, scale=1 / 3)[0].transpose(0, 2, 1, 3).reshape(1, 5, 18),
                               rtol=1e-12)
    t = flame.randn(1, 4, 24)
    with pytest.raises(ShapeError, match=r"\(1, 4, 24\) for num_heads=5"):
        qkv_attention(t, 5)
    with pytest.raises(ShapeError, match="3 \\* num_heads"):
        qkv_attention(flame.randn(4, 24), 2)
    with pytest.raises(ValueError, match="not both"):
        qkv_attention(t, 2, attn_mask=flame.ones(4, 4, dtype=flame.bool), is_causal=True)
    with pytest.raises(ShapeError, match=r"\(1, 2, 4, 4\)"):
        qkv_attention(t, 2, attn_mask=flame.ones(4, 5, dtype=flame.bool))
    with pytest.raises(DTypeError, match="int64"):
        qkv_attention(t, 2, attn_mask=flame.ones(4, 4, dtype=flame.int64))
    with pytest.raises(DTypeError, match="floating"):
        qkv_attention(flame.ones(1, 4, 24, dtype=flame.int32), 2)


# ----------------------------------------------------------------------------- GPU kernels
# (B, H, Lq, Lk, E, mask, causal, layout): ragged lengths, cross-attention, generic head dims, key padding, layouts
CASES = [
    (1, 1, 1, 1, 64, None, False, "bhld"),
    (2, 3, 77, 100, 64, None, False, "bhld"),
    (1, 2, 130, 77, 128, None, False, "blhd"),        # SDXL-like cross-attention, (B, L, H, D) memory
    (2, 2, 257, 255, 128, None, True, "bhld"),
    (1, 2, 200, 90, 64, None, True, "bhld"),          # causal with Lq > Lk
    (1, 2, 70, 300, 128, None, True, "blhd"),         # causal with Lq < Lk
    (2, 2, 150, 140, 64, "bool", False, "bhld"),
    (2, 3, 96, 77, 128, "keypad", False, "bhld"),
    (1, 2, 129, 161, 64, "float", False, "bhld"),
    (1, 2, 100, 200, 128, "float", False, "blhd"),
    (1, 2, 300, 300, 40, None, False, "bhld"),        # generic head dims: zero-padded tiles
    (1, 1, 129, 64, 96, None, True, "bhld"),
    (1, 2, 150, 300, 96, None, False, "blhd"),        # the tiled dQ's second 64 columns past the head dim
    (2, 1, 100, 120, 200, None, False, "bhld"),
    (1, 1, 66, 90, 256, "bool", False, "bhld"),
    (1, 2, 50, 70, 20, None, False, "bhld"),          # E not a multiple of 8
    (1, 2, 4096, 77, 64, None, False, "bhld"),        # few key blocks: the backward splits the query blocks
    (1, 2, 333, 1000, 128, None, False, "bhld"),      # many key blocks, even and odd counts
    (1, 2, 520, 640, 64, None, False, "blhd"),
    (2, 2, 300, 700, 128, "keypad-text", False, "bhld"),
    (2, 3, 200, 600, 64, "keypad-text", False, "blhd"),
    (1, 2, 400, 450, 128, "keypad-text", True, "bhld"),
]


def _gpu_inputs(rng, case, dt):
    cp = backend.cupy
    b, h, lq, lk, e, kind, causal, layout = case
    shapes = ((b, h, lq, e), (b, h, lk, e), (b, h, lk, e), (b, h, lq, e))
    host = [rng.standard_normal(s).astype(dt) for s in shapes]
    if layout == "blhd":  # (B, L, H, E) memory viewed as (B, H, L, E)
        dev = [cp.asarray(np.ascontiguousarray(a.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3) for a in host]
    else:
        dev = [cp.asarray(a) for a in host]
    mask = make_mask(rng, kind, b, h, lq, lk)
    return host, dev, mask, (None if mask is None else cp.asarray(mask)), causal


@pytest.mark.gpu
# the Hopper kernels (forward and backward; the backward's dQ through bulk reductions or through atomics) or the
# sm_80 ones
@pytest.mark.parametrize("fwd", ["sm90", "sm90-atomic-dq", "sm90-cp-async", "sm90-plain", "sm80"])
@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{'causal' * c[6]}{c[7]}")
def test_flash_kernel_against_float64(rng, monkeypatch, dt, case, fwd):
    if fwd.startswith("sm90") and not loader.arch_available("sm_90a"):
        pytest.skip("the sm_90a forward needs a compute capability 9.0 GPU")
    monkeypatch.setattr(K, "SM90_FWD", fwd.startswith("sm90"))
    monkeypatch.setattr(K, "SM90_BWD", fwd.startswith("sm90"))
    monkeypatch.setattr(K, "SM90_BWD_BULK_DQ", fwd != "sm90-atomic-dq")
    monkeypatch.setattr(K, "SM90_FWD_TMA", fwd != "sm90-cp-async")
    monkeypatch.setattr(K, "SM90_BWD_TMA", fwd != "sm90-cp-async")
    monkeypatch.setattr(K, "SM90_FWD_OVERLAP", fwd != "sm90-plain")  # plain: without the overlap
    host, (q, k, v, do), mask, dmask, causal = _gpu_inputs(rng, case, np.dtype(BF16 if dt == "bfloat16" else dt))
    before = launching.launches
    o, lse = K.flash_attention_forward(q, k, v, dmask, causal)
    o2, lse2 = K.flash_attention_forward(q, k, v, dmask, causal)  # the second call takes the cached launch plan
    assert bool((o2 == o).all()) and bool((lse2 == lse).all())
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, dmask, causal)
    assert launching.launches >= before + 3, "the kernel path did not run"
    again = K.flash_attention_backward(do, q, k, v, o, lse, dmask, causal)  # the cached launch plan, unmasked
    want_o, want_lse, grads = dense(*host[:3], mask, causal, do=host[3])
    tol = REL_TOL[dt]
    assert o.dtype == q.dtype and o.shape == q.shape
    if case[7] == "blhd":  # outputs keep the (B, L, H, E) memory layout of the inputs
        assert o.strides == q.strides and dq.strides == q.strides
    assert rel_err(o, want_o) < tol, f"o: {rel_err(o, want_o)}"
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=2e-3, atol=2e-3)
    for name, g, g2, w in zip(("dq", "dk", "dv"), (dq, dk, dv), again, grads):
        assert g.shape == w.shape and g.dtype == q.dtype and g2.strides == g.strides
        assert rel_err(g, w) < tol, f"{name}: {rel_err(g, w)}"
        assert rel_err(g2, w) < tol, f"{name} (second call): {rel_err(g2, w)}"


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("case", [c for c in CASES if c[4] in (64, 128) and c[3] > K.SMALL_LK],
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{'causal' * c[6]}{c[7]}")
def test_the_overlap_schedule_gives_the_plain_schedules_numbers_bit_for_bit(rng, monkeypatch, case, tma, pingpong):
    """The sm90 forward's intra-warpgroup overlap (SM90_FWD_OVERLAP: S of a key tile issued before the previous
    tile's P V is waited for), alone or under the ping-pong between the two warpgroups (SM90_FWD_PINGPONG), does the
    plain loop's arithmetic in the plain loop's order: the same O and lse, bit for bit, for every mask kind, causal or
    not, K / V by TMA or cp.async."""
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    monkeypatch.setattr(K, "SM90_FWD_TMA", tma)
    monkeypatch.setattr(K, "_fwd_plans", {})   # every call forms its launch (no plan another test left)
    ran = []
    kernel = K._kernel
    monkeypatch.setattr(K, "_kernel", lambda stem, expr, *a: (ran.append(expr), kernel(stem, expr, *a))[1])
    _, (q, k, v, _), _, dmask, causal = _gpu_inputs(rng, case, np.dtype(BF16))
    out = {}
    for ov in (False, True):
        monkeypatch.setattr(K, "SM90_FWD_OVERLAP", ov)
        monkeypatch.setattr(K, "SM90_FWD_PINGPONG", pingpong and ov)  # the plain schedule without the ping-pong
        out[ov] = K.flash_attention_forward(q, k, v, dmask, causal)
    (o0, l0), (o1, l1) = out[False], out[True]
    assert len(ran) == 2 and ran[0].endswith(", 0>") and ran[1].endswith(f", {int(pingpong)}, 1>"), ran
    assert bool((o1 == o0).all()), float(abs(o1.astype(np.float32) - o0.astype(np.float32)).max())
    assert bool((l1 == l0).all())   # (+inf, a row that attends nothing, equals itself)


@pytest.mark.gpu
@pytest.mark.parametrize("keypad", [True, False])
def test_a_key_padding_mask_runs_the_keypad_kernels_on_hopper(rng, monkeypatch, keypad):
    """A bool mask the same for every query takes FA_MASK_KEYPAD (kind 3) in both Hopper kernels (SM90_KEYPAD), the
    same numbers as the element-wise kind 1 within rounding; a mask that varies by query keeps kind 1."""
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    cp = backend.cupy
    monkeypatch.setattr(K, "SM90_KEYPAD", keypad)
    monkeypatch.setattr(K, "_functions", {})
    host, (q, k, v, do), mask, dmask, _ = _gpu_inputs(rng, (2, 2, 260, 700, 128, "keypad-text", False, "bhld"),
                                                       np.dtype(BF16))
    o, lse = K.flash_attention_forward(q, k, v, dmask)
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, dmask)
    kinds = {key[0]: key[1].split(",")[5 if key[0].startswith("flash_attention_fwd") else 4].strip()
             for key in K._functions if key[0].endswith("_sm90")}
    assert kinds == {"flash_attention_fwd_sm90": "3" if keypad else "1",
                     "flash_attention_bwd_sm90": "3" if keypad else "1"}
    want_o, _, grads = dense(*host[:3], mask, do=host[3])
    assert rel_err(o, want_o) < REL_TOL["bfloat16"]
    for g, w in zip((dq, dk, dv), grads):
        assert rel_err(g, w) < REL_TOL["bfloat16"]
    per_query = cp.asarray(np.broadcast_to(mask, (2, 1, 260, 700)).copy())   # (B, 1, Lq, Lk): kind 1
    monkeypatch.setattr(K, "_functions", {})
    o2, _ = K.flash_attention_forward(q, k, v, per_query)
    assert all(key[1].split(",")[5].strip() == "1" for key in K._functions if key[0] == "flash_attention_fwd_sm90")
    assert rel_err(o2, want_o) < REL_TOL["bfloat16"]


def test_the_backward_tail_schedule_fills_the_last_wave():
    """_bwd_tail's model (cpu): SD3.5 1024² (1330 key blocks of 35 query blocks on 132 SMs, 10.08 waves) cuts the last
    10 key blocks into pieces of 3 query blocks and finishes near 10.1 blocks' time instead of 11; no schedule where the
    waves are whole, there is less than one wave, or a key block has one query block."""
    assert K._tail_makespan(3, [0.5, 0.5], 2, 0.0) == 2.0          # 3 whole on 2 SMs: loads 2, 1; pieces -> 1.5, 2.0
    assert K._tail_makespan(2, [0.25] * 4, 2, 0.0) == 1.5
    assert K._bwd_tail(1330, 35, 132) == (1320, 3)
    u_whole, per = K._bwd_tail(1330, 35, 132)
    fracs = [min(per, 35 - i * per) / 35 for i in range(-(-35 // per))] * (1330 - u_whole)
    assert K._tail_makespan(u_whole, fracs, 132, K.TAIL_PIECE_COST) < 10.2
    assert K._bwd_tail(132 * 7, 35, 132) is None
    assert K._bwd_tail(100, 35, 132) is None
    assert K._bwd_tail(1330, 1, 132) is None
    assert K._bwd_tail(1330, 35, 132, cost=2.0) is None            # pieces too dear: one CTA per key block


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 7, 333, 1000, 128, None, False, "bhld"),
                                  (2, 3, 200, 700, 64, "keypad-text", False, "blhd"),
                                  (1, 3, 520, 770, 64, None, False, "blhd"),
                                  (2, 2, 300, 700, 128, "keypad-text", False, "bhld"),
                                  (1, 7, 700, 333, 64, "float", False, "bhld")],
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{c[7]}")
def test_the_backward_tail_schedule_matches_float64(rng, monkeypatch, case):
    """The Hopper backward under the tail schedule (a 1-D grid: whole key blocks, then the last key blocks in pieces
    whose dK / dV go through the fp32 accumulators of the last rows only) against float64, and against the schedule
    off; a small SM count makes these shapes leave a partial last wave."""
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    from flame_core.kernels import plans as P
    monkeypatch.setattr(P, "sm_count", lambda: 5)
    chosen = []
    real = K._bwd_tail
    monkeypatch.setattr(K, "_bwd_tail", lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    host, (q, k, v, do), mask, dmask, _ = _gpu_inputs(rng, case, np.dtype(BF16))
    o, lse = K.flash_attention_forward(q, k, v, dmask)
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, dmask)
    again = K.flash_attention_backward(do, q, k, v, o, lse, dmask)   # the cached plan where there is one
    assert chosen and chosen[0] is not None, f"no tail schedule chosen: {chosen}"
    monkeypatch.setattr(K, "SM90_BWD_TAIL", False)
    plain = K.flash_attention_backward(do, q, k, v, o, lse, dmask)
    _, _, grads = dense(*host[:3], mask, do=host[3])
    for name, g, g2, g0, w in zip(("dq", "dk", "dv"), (dq, dk, dv), again, plain, grads):
        assert g.strides == g0.strides
        assert rel_err(g, w) < REL_TOL["bfloat16"], f"{name}: {rel_err(g, w)}"
        assert rel_err(g2, w) < REL_TOL["bfloat16"], f"{name} (second call): {rel_err(g2, w)}"
        assert rel_err(g, backend.to_numpy(g0).astype(np.float64)) < 4e-3, name   # summation order only


def _forward_kernels():
    return {key[1].split("<")[0] for key in K._functions if key[0] == "flash_attention_fwd_sm90"}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c[3] > K.SMALL_LK and c[4] <= 128],
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{'causal' * c[6]}{c[7]}")
def test_tma_forward_is_bit_equal_to_the_cp_async_forward(rng, monkeypatch, case):
    """The Hopper forward's TMA producer changes only how K and V reach shared memory (zero-filled past the keys and
    the head dim, as the cp.async copies): outputs and logsumexp bit-equal, on ragged shapes, masks, causal, padded head
    dims and (B, L, H, D) memory; the TMA kernel is the default wherever the strides allow."""
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    if not K.tma.available():
        pytest.skip("the driver encodes no tensor maps")
    _, (q, k, v, _), _, dmask, causal = _gpu_inputs(rng, case, BF16)
    monkeypatch.setattr(K, "_functions", {})
    monkeypatch.setattr(K, "_fwd_plans", {})  # no plan of an earlier test: the launch goes through _kernel
    o_t, lse_t = K.flash_attention_forward(q, k, v, dmask, causal)
    assert _forward_kernels() == {"flash_attn_fwd_sm90_tma"}
    monkeypatch.setattr(K, "SM90_FWD_TMA", False)
    monkeypatch.setattr(K, "_functions", {})
    o_c, lse_c = K.flash_attention_forward(q, k, v, dmask, causal)
    assert _forward_kernels() == {"flash_attn_fwd_sm90"}
    assert bool((o_t == o_c).all()) and bool((lse_t == lse_c).all())


def _backward_kernels():
    return {key[1].split("<")[0] for key in K._functions if key[0] == "flash_attention_bwd_sm90"}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c[4] <= 128],
                         ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}-{'causal' * c[6]}{c[7]}")
def test_tma_backward_matches_the_cp_async_backward(rng, monkeypatch, case):
    """The Hopper backward's TMA producer changes only how Q and dO reach shared memory (zero-filled past the queries
    and the head dim, as the cp.async copies): dq, dk, dv the same on ragged shapes, masks, causal, padded head dims,
    split query blocks and (B, L, H, D) memory up to the order in which CTAs add their fp32 parts (dQ's bulk
    reductions, split / tail dK and dV), which no run fixes (hence a tolerance, not bit equality); the TMA kernel is
    the default wherever the strides allow."""
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    if not K.tma.available():
        pytest.skip("the driver encodes no tensor maps")
    _, (q, k, v, do), _, dmask, causal = _gpu_inputs(rng, case, BF16)
    o, lse = K.flash_attention_forward(q, k, v, dmask, causal)
    monkeypatch.setattr(K, "_functions", {})
    monkeypatch.setattr(K, "_bwd_plans", {})  # no plan of an earlier test: the launch goes through _kernel
    got = K.flash_attention_backward(do, q, k, v, o, lse, dmask, causal)
    again = K.flash_attention_backward(do, q, k, v, o, lse, dmask, causal)  # the cached plan (unmasked cases)
    assert _backward_kernels() == {"flash_attn_bwd_sm90_tma"}
    monkeypatch.setattr(K, "SM90_BWD_TMA", False)
    monkeypatch.setattr(K, "_functions", {})
    want = K.flash_attention_backward(do, q, k, v, o, lse, dmask, causal)
    assert _backward_kernels() == {"flash_attn_bwd_sm90"}
    for name, a, a2, w in zip(("dq", "dk", "dv"), got, again, want):
        w = np.asarray(backend.to_numpy(w), np.float64)
        assert rel_err(a, w) < 2e-3, f"{name}: {rel_err(a, w)}"  # bf16 rounding of reordered fp32 sums only
        assert rel_err(a2, w) < 2e-3, f"{name} (second call): {rel_err(a2, w)}"


@pytest.mark.gpu
def test_tma_backward_plan_re_encodes_the_maps_for_new_arrays(rng, monkeypatch):
    """The backward's cached plan re-encodes its Q / dO maps when the arrays move: new inputs of the same shape give
    their own gradients, equal to the cp.async kernel's."""
    if not loader.arch_available("sm_90a") or not K.tma.available():
        pytest.skip("needs a compute capability 9.0 GPU and tensor maps")
    cp = backend.cupy
    q1, q2, k, v, g1, g2 = (cp.asarray(rng.standard_normal((1, 3, 300, 64)).astype(BF16)) for _ in range(6))
    o1, l1 = K.flash_attention_forward(q1, k, v)
    o2, l2 = K.flash_attention_forward(q2, k, v)
    K.flash_attention_backward(g1, q1, k, v, o1, l1)
    a1 = K.flash_attention_backward(g1, q1, k, v, o1, l1)  # the plan
    a2 = K.flash_attention_backward(g2, q2, k, v, o2, l2)  # the plan, other addresses
    monkeypatch.setattr(K, "SM90_BWD_TMA", False)
    w2 = K.flash_attention_backward(g2, q2, k, v, o2, l2)
    for x, w in zip(a2, w2):
        assert rel_err(x, np.asarray(backend.to_numpy(w), np.float64)) < 2e-3
    assert rel_err(a1[0], np.asarray(backend.to_numpy(a2[0]), np.float64)) > 0.5  # not the first call's gradients


@pytest.mark.gpu
def test_tma_forward_plan_re_encodes_the_maps_for_new_arrays(rng, monkeypatch):
    """The cached launch plan re-encodes its K / V maps when the arrays move: a second pair of inputs of the same
    shape gives their own result (not the first pair's), equal to the cp.async kernel's."""
    if not loader.arch_available("sm_90a") or not K.tma.available():
        pytest.skip("needs a compute capability 9.0 GPU and tensor maps")
    cp = backend.cupy
    q, k1, v1, k2, v2 = (cp.asarray(rng.standard_normal((1, 3, 300, 128)).astype(BF16)) for _ in range(5))
    K.flash_attention_forward(q, k1, v1)
    o1, _ = K.flash_attention_forward(q, k1, v1)  # the plan
    o2, lse2 = K.flash_attention_forward(q, k2, v2)  # the plan, other addresses
    o1b, _ = K.flash_attention_forward(q, k1, v1)  # back to the first
    monkeypatch.setattr(K, "SM90_FWD_TMA", False)
    want2, want_lse2 = K.flash_attention_forward(q, k2, v2)
    assert bool((o2 == want2).all()) and bool((lse2 == want_lse2).all())
    assert bool((o1b == o1).all()) and not bool((o1 == o2).all())


@pytest.mark.gpu
def test_keys_broadcast_over_heads_take_the_cp_async_forward(rng, monkeypatch):
    """A key / value broadcast over the heads (stride 0) is outside what a tensor map describes: the cp.async kernel
    runs it, with the dense result."""
    if not loader.arch_available("sm_90a") or not K.tma.available():
        pytest.skip("needs a compute capability 9.0 GPU and tensor maps")
    cp = backend.cupy
    hq = rng.standard_normal((1, 4, 200, 64)).astype(BF16)
    hk, hv = (rng.standard_normal((1, 1, 260, 64)).astype(BF16) for _ in range(2))
    k = cp.broadcast_to(cp.asarray(hk), (1, 4, 260, 64))
    v = cp.broadcast_to(cp.asarray(hv), (1, 4, 260, 64))
    monkeypatch.setattr(K, "_functions", {})
    monkeypatch.setattr(K, "_fwd_plans", {})
    o, _ = K.flash_attention_forward(cp.asarray(hq), k, v)
    assert _forward_kernels() == {"flash_attn_fwd_sm90"}
    want, _ = dense(hq, np.broadcast_to(hk, (1, 4, 260, 64)), np.broadcast_to(hv, (1, 4, 260, 64)))
    assert rel_err(o, want) < REL_TOL["bfloat16"]


@pytest.mark.gpu
def test_sm90_kernels_are_the_default_on_hopper(rng):
    if not loader.arch_available("sm_90a"):
        pytest.skip("needs a compute capability 9.0 GPU")
    cp = backend.cupy
    q, k, v = (cp.asarray(rng.standard_normal((1, 2, 300, e)).astype(BF16)) for e in (128, 128, 128))
    K.flash_attention_forward(q, k, v)
    o, lse = K.flash_attention_forward(q, k, v)
    K.flash_attention_backward(o, q, k, v, o, lse)
    assert any(key[0] == "flash_attention_fwd_sm90" for key in K._functions)
    assert any(key[0] == "flash_attention_bwd_sm90" for key in K._functions)
    assert K._use_sm90(64, None) and K._use_sm90(128, None) and not K._use_sm90(256, None)
    assert not K._use_sm90(64, None, Lk=77) and K._fwd_tiles(64, 2, 10, 4096, False, 77) == K.FWD_TILES[64]["small"]
    # several key blocks at both head dims: dQ through the bulk reductions and the tiled accumulator's convert
    for e in (64, 128):
        q = cp.asarray(rng.standard_normal((1, 2, 300, e)).astype(BF16))
        o, lse = K.flash_attention_forward(q, q, q)
        K.flash_attention_backward(o, q, q, q, o, lse)
    bulk = [key[1] for key in K._functions if key[0] == "flash_attention_bwd_sm90" and key[1].endswith(", 1>")]
    assert {x.split(",")[1].strip() for x in bulk} == {"64", "128"}, bulk
    assert any(key[1] == "flash_attn_convert_tiles<{T}>" for key in K._functions)



@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bias", "bool", "keypad", "half_bias"])
def test_a_masked_forward_keeps_its_plan_and_relaunches_with_new_addresses(rng, monkeypatch, kind):
    """A masked forward's launch is kept per (shapes, strides, dtypes, mask layout) like an unmasked one's (T5's
    position bias in every layer, a padding mask): later calls with new q, k, v and mask arrays of the same layout
    launch it with their addresses and get what a fresh launch gets (bit-equal); a mask the kernel takes only after
    a float32 conversion (a new array at every call) keeps no plan."""
    cp = backend.cupy
    b, h, lq, lk, e = 2, 3, 150, 210, 64
    shapes = {"bias": (1, h, lq, lk), "bool": (b, h, lq, lk), "keypad": (b, 1, 1, lk), "half_bias": (1, h, lq, lk)}

    def inputs():
        qkv = [cp.asarray(rng.standard_normal(sh).astype(BF16)) for sh in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, e))]
        m = rng.standard_normal(shapes[kind])
        if kind in ("bool", "keypad"):
            m = m > -1.0
            m[..., 0] = True  # no fully masked row
        m = cp.asarray(m.astype(np.float16) if kind == "half_bias" else m if m.dtype == np.bool_ else
                       m.astype(np.float32))
        return qkv, m

    monkeypatch.setattr(K, "_fwd_plans", {})
    (q, k, v), m = inputs()
    K.flash_attention_forward(q, k, v, m)
    assert len(K._fwd_plans) == (0 if kind == "half_bias" else 1)
    for _ in range(2):  # new arrays (new addresses), the same layout: the kept launch
        (q, k, v), m = inputs()
        o, lse = K.flash_attention_forward(q, k, v, m)
        assert len(K._fwd_plans) == (0 if kind == "half_bias" else 1)
        with monkeypatch.context() as mp:
            mp.setattr(K, "_fwd_plans", {})  # a fresh launch of the same kernel
            o_ref, lse_ref = K.flash_attention_forward(q, k, v, m)
        assert bool((o == o_ref).all()) and bool((lse == lse_ref).all())
    want_o, want_lse = dense(q, k, v, m)
    assert rel_err(o, want_o) < 1e-2
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_launch_plan_caches_stay_bounded(rng, monkeypatch):
    cp = backend.cupy
    monkeypatch.setattr(K, "MAX_PLANS", 3)
    for lq in range(60, 68):  # eight shapes
        q, k, v = (cp.asarray(rng.standard_normal((1, 1, n, 64)).astype(BF16)) for n in (lq, 70, 70))
        o, lse = K.flash_attention_forward(q, k, v)
        K.flash_attention_backward(o, q, k, v, o, lse)
    assert 0 < len(K._fwd_plans) <= 3 and 0 < len(K._bwd_plans) <= 3


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(128, 2, 3), (128, 2, 1), (64, 2, 4), (128, 64, 4, 0), (64, 64, 4, 0)])
def test_forward_tiles_at_one_key_block(rng, tiles):
    """Short key sequences (one key block) on every forward kernel, explicit tiles: the default picks the sm_80
    kernel's small tiles there, the sm_90a kernel must still be right."""
    if len(tiles) == 3 and not loader.arch_available("sm_90a"):
        pytest.skip("the sm_90a forward needs a compute capability 9.0 GPU")
    cp = backend.cupy
    host = [rng.standard_normal(s).astype(BF16) for s in ((2, 3, 200, 64), (2, 3, 77, 64), (2, 3, 77, 64))]
    q, k, v = (cp.asarray(a) for a in host)
    o, lse = K._kernel_forward(q, k, v, None, False, 64 ** -0.5, tiles=tiles)
    want_o, want_lse = dense(*host)
    assert rel_err(o, want_o) < 1e-2
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
def test_flash_kernel_fully_masked_rows(rng):
    cp = backend.cupy
    b, h, lq, lk, e = 1, 2, 70, 90, 64
    host = [rng.standard_normal(s).astype(BF16) for s in ((b, h, lq, e), (b, h, lk, e), (b, h, lk, e), (b, h, lq, e))]
    mask = rng.random((lq, lk)) > 0.5
    mask[[0, 33, 69]] = False
    mask[5, :] = False
    mask[5, 89] = True  # a row whose only key sits in the padded tail of the last key block
    q, k, v, do = (cp.asarray(a) for a in host)
    o, lse = K.flash_attention_forward(q, k, v, cp.asarray(mask))
    dq, dk, dv = K.flash_attention_backward(do, q, k, v, o, lse, cp.asarray(mask))
    o_h, dq_h = backend.to_numpy(o).astype(np.float32), backend.to_numpy(dq).astype(np.float32)
    assert np.all(o_h[:, :, [0, 33, 69]] == 0) and np.all(dq_h[:, :, [0, 33, 69]] == 0)
    assert np.all(np.isinf(backend.to_numpy(lse)[:, :, [0, 33, 69]]))
    want_o, _, grads = dense(*host[:3], mask, do=host[3])
    assert rel_err(o, want_o) < 1e-2
    for g, w in zip((dq, dk, dv), grads):
        assert rel_err(g, w) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [flame.bfloat16, flame.float16, flame.float32])
def test_sdpa_tensor_on_gpu(rng, dt):
    b, lq, lk, h, e = 2, 333, 77, 4, 64  # (B, L, H, E) activations transposed to (B, H, L, E) as models do
    host = [rng.standard_normal(s) for s in ((b, lq, h, e), (b, lk, h, e), (b, lk, h, e), (b, lq, h, e))]
    q, k, v = (flame.tensor(a, dtype=dt, device="cuda", requires_grad=True) for a in host[:3])
    out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out.backward(flame.tensor(host[3], dtype=dt, device="cuda").transpose(1, 2))
    rounded = [a.astype(dt.np).astype(np.float64).transpose(0, 2, 1, 3) for a in host]
    want_o, _, grads = dense(*rounded[:3], do=rounded[3])
    tol = {"bfloat16": 1e-2, "float16": 5e-3, "float32": 1e-5}[dt.name]
    assert out.dtype == dt and rel_err(out._data, want_o) < tol
    for t, w in zip((q, k, v), grads):
        assert rel_err(t.grad._data, w.transpose(0, 2, 1, 3)) < tol


@pytest.mark.gpu
@pytest.mark.slow
def test_no_quadratic_allocation_at_16k():
    """Forward + backward at L = 16384 through the Tensor op: the pool's peak grows by far less than one L x L matrix
    (bf16/fp16 flash kernels; float32 takes the chunked path, bounded by CHUNK_BYTES)."""
    from flame_core import memory
    n, h, e = 16384, 2, 64
    rng = np.random.default_rng(0)
    for dt, limit in ((flame.bfloat16, 64 << 20), (flame.float16, 64 << 20), (flame.float32, 8 * K.CHUNK_BYTES)):
        host = [rng.standard_normal((1, h, n, e)) for _ in range(4)]
        q, k, v = (flame.tensor(a, dtype=dt, device="cuda", requires_grad=True) for a in host[:3])
        g = flame.tensor(host[3], dtype=dt, device="cuda")
        backend.cupy.cuda.Device().synchronize()
        memory.reset_peak_memory_stats("cuda")
        base = memory.memory_allocated("cuda")
        out = sdpa(q, k, v, is_causal=True)
        out.backward(g)
        backend.cupy.cuda.Device().synchronize()
        grew = memory.max_memory_allocated("cuda") - base
        square = n * n * dt.itemsize  # one head's score matrix
        assert grew < limit < square, f"{dt}: the peak grew by {grew} bytes (one L x L matrix is {square})"
        assert np.isfinite(q.grad.float().sum().item()) and float(out.float().abs().max().item()) > 0
