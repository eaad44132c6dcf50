"""joint_rms_norm: cat([rms_norm(x_p) w_p], dim=1) of strided (B, L_p, H, D) parts in one kernel each way, and with
per-row RoPE tables the rotation of the result inside the same kernels -- the reference against the composed ops,
float64 gradients, the op's paths, and the kernels against the reference on ragged, strided and misaligned shapes in
fp32 / fp16 / bf16."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, grad_mag, rand

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.autograd import gradcheck
from flame_core.errors import ShapeError
from flame_core.kernels import joint_rms_norm as K


def _qkv_views(a, H, D, which):
    """The q (which=0) or k (1) heads of a (B, L, 3 H D) projection as a strided (B, L, H, D) view."""
    B, L = a.shape[:2]
    return a[:, :, which * H * D:(which + 1) * H * D].reshape(B, L, H, D)


def _composed64(xs, ws, eps):
    out = []
    for x, w in zip(xs, ws):
        x = x.astype(np.float64)
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        out.append(y * w.astype(np.float64) if w is not None else y)
    return np.concatenate(out, axis=1)


def _tables(rng, rows, D, dtype=np.float64, rotations=True):
    """Per-row RoPE tables (rows, 1, 1, D / 2, 2, 2): rotations by random angles, or any 2 x 2 matrices."""
    if rotations:
        a = rng.uniform(-np.pi, np.pi, (rows, 1, 1, D // 2))
        c, s = np.cos(a), np.sin(a)
        t = np.stack([c, -s, s, c], axis=-1)
    else:
        t = rng.standard_normal((rows, 1, 1, D // 2, 4))
    return t.reshape(rows, 1, 1, D // 2, 2, 2).astype(dtype)


def _rotate64(y, t):
    """y (B, L, H, D) rotated pairwise by the per-row tables t (B * L, 1, 1, D / 2, 2, 2), in float64."""
    B, L, H, D = y.shape
    f = t.astype(np.float64).reshape(B, L, 1, D // 2, 2, 2)
    y2 = y.astype(np.float64).reshape(B, L, H, D // 2, 2)
    return np.einsum("blhjik,blhjk->blhji", np.broadcast_to(f, (B, L, H, D // 2, 2, 2)), y2).reshape(y.shape)


def test_reference_is_the_norms_then_the_concatenation(rng):
    a0, a1 = rng.standard_normal((2, 3, 3 * 2 * 8)), rng.standard_normal((2, 5, 3 * 2 * 8))
    xs = [_qkv_views(a0, 2, 8, 1), _qkv_views(a1, 2, 8, 1)]
    ws = [rng.standard_normal(8), None]
    y = K.joint_rms_norm_forward(xs, ws, 1e-6)
    assert y.shape == (2, 8, 2, 8) and y.flags.c_contiguous
    np.testing.assert_allclose(y, _composed64(xs, ws, 1e-6), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(K.joint_rms_norm_forward(xs[:1], ws[:1]), _composed64(xs[:1], ws[:1], 1e-6),
                               rtol=1e-13)


def test_reference_with_rope_is_the_norms_then_the_rotation(rng):
    a0, a1 = rng.standard_normal((2, 3, 3 * 2 * 8)), rng.standard_normal((2, 5, 3 * 2 * 8))
    xs = [_qkv_views(a0, 2, 8, 1), _qkv_views(a1, 2, 8, 1)]
    ws = [rng.standard_normal(8), None]
    t = _tables(rng, 2 * 8, 8, rotations=False)
    y = K.joint_rms_norm_forward(xs, ws, 1e-6, t)
    assert y.shape == (2, 8, 2, 8) and y.flags.c_contiguous
    np.testing.assert_allclose(y, _rotate64(_composed64(xs, ws, 1e-6), t), rtol=1e-12, atol=1e-13)
    # the backward: the norm's rule applied to the gradient rotated back (the transposed matrices)
    g = rng.standard_normal((2, 8, 2, 8))
    gt = np.einsum("blhjki,blhjk->blhji", np.broadcast_to(t.reshape(2, 8, 1, 4, 2, 2), (2, 8, 2, 4, 2, 2)),
                   g.reshape(2, 8, 2, 4, 2)).reshape(g.shape)
    for got, want in zip(K.joint_rms_norm_backward(g, xs, ws, 1e-6, t), K.joint_rms_norm_backward(gt, xs, ws, 1e-6)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    # (B * L, D / 2, 2, 2) tables read the same
    np.testing.assert_array_equal(K.joint_rms_norm_forward(xs, ws, 1e-6, t.reshape(16, 4, 2, 2)), y)


def test_op_with_rope_matches_the_norm_then_apply_rope(rng):
    from flame_core.ops.rope import apply_rope
    B, H, D = 2, 3, 8
    a0 = flame.tensor(rng.standard_normal((B, 4, 3 * H * D)), dtype=flame.float32, requires_grad=True)
    a1 = flame.tensor(rng.standard_normal((B, 6, 3 * H * D)), dtype=flame.float32, requires_grad=True)
    w0, w1 = (flame.tensor(rng.standard_normal(D), dtype=flame.float32) for _ in range(2))
    t = flame.tensor(_tables(rng, B * 10, D), dtype=flame.float32)
    g = flame.tensor(rng.standard_normal((B, 10, H, D)), dtype=flame.float32)

    def views():
        return [a.narrow(2, 0, H * D).reshape(B, a.shape[1], H, D) for a in (a0, a1)]

    y = F.joint_rms_norm(views(), [w0, w1], eps=1e-6, rope=t)
    assert y.grad_fn.name() == "JointRMSNormBackward"
    (y * g).sum().backward()
    fused = [a0.grad.numpy().copy(), a1.grad.numpy().copy()]
    a0.grad = a1.grad = None
    n = F.joint_rms_norm(views(), [w0, w1], eps=1e-6)
    ref = apply_rope(n.reshape(B * 10, H, 1, D), t).reshape(B, 10, H, D)
    (ref * g).sum().backward()
    np.testing.assert_allclose(y.detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for got, want in zip(fused, (a0.grad.numpy(), a1.grad.numpy())):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_trained_gains_with_rope_take_the_composed_ops(rng):
    x0 = flame.tensor(rng.standard_normal((1, 2, 2, 4)), dtype=flame.float64, requires_grad=True)
    x1 = flame.tensor(rng.standard_normal((1, 3, 2, 4)), dtype=flame.float64, requires_grad=True)
    w0 = flame.tensor(rng.standard_normal(4), dtype=flame.float64, requires_grad=True)
    w1 = flame.tensor(rng.standard_normal(4), dtype=flame.float64)
    t = flame.tensor(_tables(rng, 5, 4, rotations=False))
    y = F.joint_rms_norm([x0, x1], [w0, w1], rope=t)
    assert y.grad_fn.name() != "JointRMSNormBackward"
    with flame.no_grad():
        want = F.joint_rms_norm([x0, x1], [w0.detach(), w1], rope=t)
    np.testing.assert_allclose(y.detach().numpy(), want.numpy(), rtol=1e-12, atol=1e-13)
    assert gradcheck(lambda a, b, w: F.joint_rms_norm([a, b], [w, w1], rope=t), (x0, x1, w0))


def test_op_matches_rms_norm_and_cat_forward_and_backward(rng):
    B, H, D = 2, 3, 8
    a0 = flame.tensor(rng.standard_normal((B, 4, 3 * H * D)), dtype=flame.float32, requires_grad=True)
    a1 = flame.tensor(rng.standard_normal((B, 6, 3 * H * D)), dtype=flame.float32, requires_grad=True)
    w0, w1 = (flame.tensor(rng.standard_normal(D), dtype=flame.float32) for _ in range(2))
    g = flame.tensor(rng.standard_normal((B, 10, H, D)), dtype=flame.float32)

    def views():
        return [a.narrow(2, H * D, H * D).reshape(B, a.shape[1], H, D) for a in (a0, a1)]

    y = F.joint_rms_norm(views(), [w0, w1], eps=1e-6)
    assert y.grad_fn.name() == "JointRMSNormBackward"
    (y * g).sum().backward()
    fused = [a0.grad.numpy().copy(), a1.grad.numpy().copy()]
    a0.grad = a1.grad = None
    x0, x1 = views()
    ref = flame.cat([F.rms_norm(x0, (D,), w0, 1e-6), F.rms_norm(x1, (D,), w1, 1e-6)], dim=1)
    (ref * g).sum().backward()
    np.testing.assert_allclose(y.detach().numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for got, want in zip(fused, (a0.grad.numpy(), a1.grad.numpy())):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not fused[0][:, :, :H * D].any() and not fused[0][:, :, 2 * H * D:].any()  # only the k columns


def test_trained_gains_take_the_composed_ops(rng):
    x0 = flame.tensor(rng.standard_normal((1, 2, 2, 4)), requires_grad=True)
    x1 = flame.tensor(rng.standard_normal((1, 3, 2, 4)), requires_grad=True)
    w0 = flame.tensor(rng.standard_normal(4), requires_grad=True)
    w1 = flame.tensor(rng.standard_normal(4))
    y = F.joint_rms_norm([x0, x1], [w0, w1])
    assert y.grad_fn.name() != "JointRMSNormBackward"
    g = rng.standard_normal((1, 5, 2, 4))
    (y * flame.tensor(g)).sum().backward()
    x64 = x0.detach().numpy().astype(np.float64)
    xh = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(w0.grad.numpy(), (g[:, :2] * xh).sum((0, 1, 2)), rtol=1e-4, atol=1e-5)
    assert w1.grad is None
    with flame.no_grad():
        assert F.joint_rms_norm([x0, x1], [w0, w1]).grad_fn is None


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), l0=st.integers(1, 3), l1=st.integers(0, 3), h=st.integers(1, 2), d=st.integers(1, 5),
       weights=st.booleans(), rope=st.booleans())
def test_gradcheck(b, l0, l1, h, d, weights, rope):
    rng = np.random.default_rng(b * 10000 + l0 * 1000 + l1 * 100 + h * 10 + d)
    if rope and d % 2:
        d += 1   # RoPE rotates pairs
    parts = [l0] + ([l1] if l1 else [])
    xs = [flame.tensor(rng.standard_normal((b, n, h, d)), dtype=flame.float64, requires_grad=True) for n in parts]
    ws = [flame.tensor(rng.standard_normal(d), dtype=flame.float64) if weights else None for _ in parts]
    t = flame.tensor(_tables(rng, b * sum(parts), d, rotations=False)) if rope else None
    assert gradcheck(lambda *x: F.joint_rms_norm(list(x), ws, rope=t), tuple(xs))


def test_bad_parts_name_their_shapes():
    x = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(ShapeError, match=r"part 1 \(1, 2, 4, 8\).*part 0 \(1, 2, 3, 8\)"):
        K.joint_rms_norm_forward([x, np.zeros((1, 2, 4, 8), np.float32)], [None, None])
    with pytest.raises(ShapeError, match=r"part 0 must be \(B, L, H, D\), got \(2, 8\)"):
        K.joint_rms_norm_forward([np.zeros((2, 8), np.float32)], [None])
    with pytest.raises(ShapeError, match=r"gain 1 has shape \(7,\), expected \(8,\)"):
        K.joint_rms_norm_forward([x, x], [None, np.zeros(7, np.float32)])
    with pytest.raises(ValueError, match="one or two"):
        F.joint_rms_norm([flame.tensor(x)] * 3)
    with pytest.raises(ShapeError, match=r"gradient \(1, 3, 3, 8\), expected \(1, 4, 3, 8\)"):
        K.joint_rms_norm_backward(np.zeros((1, 3, 3, 8), np.float32), [x, x], [None, None])
    with pytest.raises(ShapeError, match=r"rope tables \(2, 1, 1, 4, 2, 2\) do not fit parts of 4 token rows"):
        K.joint_rms_norm_forward([x, x], [None, None], 1e-6, np.zeros((2, 1, 1, 4, 2, 2), np.float32))
    with pytest.raises(ShapeError, match="rope tables must be float32"):
        K.joint_rms_norm_forward([x], [None], 1e-6, np.zeros((2, 4, 2, 2), np.float16))
    with pytest.raises(ShapeError, match=r"head dim 3: expected"):
        K.joint_rms_norm_forward([np.zeros((1, 2, 1, 3), np.float32)], [None], 1e-6, np.zeros((2, 1, 2, 2)))


# (B, L0, L1, H, D, column offset of the views in elements: 16-byte aligned rows when a multiple of 8)
CASES = [(1, 3, 5, 2, 64, 64), (2, 7, 4, 3, 128, 384), (1, 1, 0, 1, 8, 0), (2, 5, 3, 2, 72, 144),
         (1, 4, 6, 3, 3, 9), (2, 3, 2, 2, 200, 1), (1, 2, 3, 1, 512, 512), (1, 333, 40, 4, 64, 256),
         (3, 1, 1, 5, 1, 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gains", ["none", "same", "f32"])
@pytest.mark.parametrize("rope", [False, True])
def test_kernels_against_the_reference(ab, rng, dt, case, gains, rope):
    B, L0, L1, H, D, off = case
    if rope and D % 2:
        D += 1  # RoPE rotates pairs: the odd head dims' cases (misaligned views: the rotation's own pass) at D + 1
    dtype = DTYPES[dt]
    width = off + 3 * H * D
    a0, a1 = rand(rng, (B, L0, width), dtype), rand(rng, (B, max(L1, 1), width), dtype, scale=3.0)
    parts = [(a0, L0)] + ([(a1, L1)] if L1 else [])
    wdt = np.float32 if gains == "f32" else dtype
    ws = [None if gains == "none" else rand(rng, (D,), wdt, loc=1.0, scale=0.3) for _ in parts]
    g = rand(rng, (B, L0 + L1, H, D), dtype)
    t = _tables(rng, B * (L0 + L1), D, np.float32) if rope else None
    tc = None if t is None else backend.cupy.asarray(t)

    def views(arrays):
        return [a[:, :n, off:off + H * D].reshape(B, n, H, D) for a, n in zip(arrays, [n for _, n in parts])]

    def fwd(*arrays):
        return K.joint_rms_norm_forward(views(arrays[:len(parts)]), list(arrays[len(parts):]) or ws, 1e-6, tc)

    def bwd(gg, *arrays):
        return np.concatenate([d.get() for d in K.joint_rms_norm_backward(gg, views(arrays[:len(parts)]),
                                                                         list(arrays[len(parts):]) or ws, 1e-6, tc)],
                              axis=1)
    arrays = [a for a, _ in parts] + ([w for w in ws] if gains != "none" else [])
    k, r = ab(fwd, *arrays)
    assert k.flags.c_contiguous and k.shape == (B, L0 + L1, H, D)
    assert_close(k, r, dt, "joint_rms_norm forward")
    xs64 = [v.astype(np.float64) for v in views([a for a, _ in parts])]
    want = _composed64(xs64, ws, 1e-6)
    assert_close(k, want if t is None else _rotate64(want, t), dt, "forward vs float64")
    k, r = ab(bwd, g, *arrays)
    # dx is formed by cancellation (D = 1: exactly rstd g w eps / (x^2 + eps)): the tolerance scales with its terms
    rstd = np.concatenate([1 / np.sqrt((x * x).mean(-1) + 1e-6) for x in xs64], axis=1)
    assert_close(k, r, dt, "joint_rms_norm backward", scale=2.0,
                 mag=grad_mag(g, rstd, None if ws[0] is None else np.concatenate([w for w in ws])))


@pytest.mark.gpu
def test_op_on_the_gpu_matches_the_composed_ops(rng):
    B, H, D = 1, 4, 64
    dev = flame.device("cuda")
    qkv = [flame.tensor(rng.standard_normal((B, n, 3 * H * D)), dtype=flame.bfloat16, device=dev,
                        requires_grad=True) for n in (77, 300)]
    ws = [flame.tensor(rng.standard_normal(D) * 0.2 + 1, dtype=flame.bfloat16, device=dev) for _ in qkv]
    g = flame.tensor(rng.standard_normal((B, 377, H, D)), dtype=flame.bfloat16, device=dev)

    def qs():
        return [a[:, :, :H * D].reshape(B, a.shape[1], H, D) for a in qkv]
    y = F.joint_rms_norm(qs(), ws)
    (y.float() * g.float()).sum().backward()
    fused = [a.grad.float().numpy() for a in qkv]
    for a in qkv:
        a.grad = None
    ref = flame.cat([F.rms_norm(x, (D,), w, 1e-6) for x, w in zip(qs(), ws)], dim=1)
    (ref.float() * g.float()).sum().backward()
    assert_close(y.detach().float().numpy(), ref.detach().float().numpy(), "bfloat16", "forward")
    for got, a in zip(fused, qkv):
        assert_close(got, a.grad.float().numpy(), "bfloat16", "dx", scale=2.0)
