"""flame_nn.functional additions of issue 31 against NumPy float64 references written here, with hypothesis
gradient checks (float64 central differences) for the differentiable ones."""
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flame_core as flame
import flame_nn.functional as F
from flame_core.autograd import gradcheck


def npa(t):
    return t.detach().numpy().astype(np.float64)


def T(a, device, grad=False, dtype=flame.float64):
    return flame.tensor(np.asarray(a), dtype=dtype, device=device, requires_grad=grad)


def away_from(a, points, gap=0.05):
    """Shift values that sit near a kink so that central differences see one side only."""
    for p in points:
        a = np.where(np.abs(a - p) < gap, a + 2 * gap, a)
    return a


small_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)


# ----------------------------------------------------------------------------- activations
ACT = {
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda a: np.where(a > 0, a, 0.2 * a), [0.0]),
    "elu": (lambda x: F.elu(x, 0.7), lambda a: np.where(a > 0, a, 0.7 * np.expm1(np.minimum(a, 0))), [0.0]),
    "softplus": (lambda x: F.softplus(x, beta=2.0, threshold=3.0),
                 lambda a: np.where(2 * a > 3.0, a, np.log1p(np.exp(2 * a)) / 2), [1.5]),
    "mish": (F.mish, lambda a: a * np.tanh(np.log1p(np.exp(a))), []),
    "hardswish": (F.hardswish, lambda a: a * np.clip(a + 3, 0, 6) / 6, [-3.0, 3.0]),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 1.0), lambda a: np.clip(a, -0.5, 1.0), [-0.5, 1.0]),
    "relu6": (F.relu6, lambda a: np.clip(a, 0, 6), [0.0, 6.0]),
    "hardsigmoid": (F.hardsigmoid, lambda a: np.clip(a / 6 + 0.5, 0, 1), [-3.0, 3.0]),
    "logsigmoid": (F.logsigmoid, lambda a: np.minimum(a, 0) - np.log1p(np.exp(-np.abs(a))), []),
    "softsign": (F.softsign, lambda a: a / (1 + np.abs(a)), []),
    "tanhshrink": (F.tanhshrink, lambda a: a - np.tanh(a), []),
    "selu": (F.selu, lambda a: 1.0507009873554804934193349852946 * np.where(
        a > 0, a, 1.6732632423543772848170429916717 * np.expm1(np.minimum(a, 0))), [0.0]),
    "celu": (lambda x: F.celu(x, 0.7), lambda a: np.where(a > 0, a, 0.7 * np.expm1(np.minimum(a, 0) / 0.7)), [0.0]),
    "threshold": (lambda x: F.threshold(x, 0.5, -2.0), lambda a: np.where(a > 0.5, a, -2.0), [0.5]),
    "hardshrink": (lambda x: F.hardshrink(x, 0.5), lambda a: np.where(np.abs(a) > 0.5, a, 0.0), [-0.5, 0.5]),
    "softshrink": (lambda x: F.softshrink(x, 0.5),
                   lambda a: np.where(a > 0.5, a - 0.5, np.where(a < -0.5, a + 0.5, 0.0)), [-0.5, 0.5]),
}


@pytest.mark.parametrize("name", sorted(ACT))
def test_activation_values(device, rng, name):
    fn, ref, _ = ACT[name]
    a = rng.uniform(-5, 5, (4, 7))
    np.testing.assert_allclose(npa(fn(T(a, device))), ref(a), rtol=1e-12, atol=1e-14)
    y32 = fn(T(a, device, dtype=flame.float32))
    assert y32.dtype == flame.float32
    np.testing.assert_allclose(npa(y32), ref(a), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", sorted(ACT))
@given(shape=small_shapes, seed=st.integers(0, 2 ** 16))
@settings(max_examples=8)
def test_activation_gradcheck(device, name, shape, seed):
    fn, _, kinks = ACT[name]
    a = away_from(np.random.default_rng(seed).uniform(-4, 4, shape), kinks)
    assert gradcheck(fn, (T(a, device, grad=True),))


_ACT_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "activations.safetensors")
_GOLDEN_1D = {"hardtanh": lambda x: F.hardtanh(x, -0.5, 1.0), "relu6": F.relu6, "hardsigmoid": F.hardsigmoid,
              "logsigmoid": F.logsigmoid, "softsign": F.softsign, "tanhshrink": F.tanhshrink, "selu": F.selu,
              "celu": lambda x: F.celu(x, 0.7), "threshold": lambda x: F.threshold(x, 0.5, -2.0),
              "hardshrink": lambda x: F.hardshrink(x, 0.5), "softshrink": lambda x: F.softshrink(x, 0.5)}


@pytest.mark.parametrize("name", sorted(_GOLDEN_1D))
def test_activation_values_and_gradients_match_pytorch_at_the_kinks(device, name):
    """Against PyTorch's outputs and gradients (tests/fixtures/make_activation_fixtures.py) on the kinks themselves
    (0, the bounds, the thresholds: PyTorch's gradient there, e.g. 0 at hardtanh's bounds, 0.5 for logsigmoid at 0)
    and on random and large values (logsigmoid at +-800)."""
    from safetensors.numpy import load_file
    fx = load_file(_ACT_FIXTURE)
    x = T(fx["x"], device, grad=True)
    y = _GOLDEN_1D[name](x)
    np.testing.assert_allclose(npa(y), fx[f"{name}.out"], rtol=1e-13, atol=1e-15)
    y.backward(T(fx[f"{name}.go"], device))
    # (PyTorch's celu and hardsigmoid backwards carry 1 / alpha and 1 / 6 with about float32's precision: 1.3e-7
    # and 3e-8 off the float64 derivative)
    rtol = {"celu": 1e-6, "hardsigmoid": 1e-7}.get(name, 1e-13)
    np.testing.assert_allclose(npa(x.grad), fx[f"{name}.grad"], rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("name", ["softmin", "glu", "glu0", "prelu", "prelu1"])
def test_softmin_glu_prelu_match_pytorch(device, name):
    from safetensors.numpy import load_file
    fx = load_file(_ACT_FIXTURE)
    x = T(fx["x2"], device, grad=True)
    w = T(fx[f"{name}.weight"], device, grad=True) if name.startswith("prelu") else None
    fn = {"softmin": lambda v: F.softmin(v, dim=1), "glu": lambda v: F.glu(v), "glu0": lambda v: F.glu(v, dim=0),
          "prelu": lambda v: F.prelu(v, w), "prelu1": lambda v: F.prelu(v, w)}[name]
    y = fn(x)
    np.testing.assert_allclose(npa(y), fx[f"{name}.out"], rtol=1e-13, atol=1e-15)
    y.backward(T(fx[f"{name}.go"], device))
    np.testing.assert_allclose(npa(x.grad), fx[f"{name}.grad"], rtol=1e-13, atol=1e-15)
    if w is not None:
        np.testing.assert_allclose(npa(w.grad), fx[f"{name}.wgrad"], rtol=1e-13, atol=1e-15)


@given(shape=st.sampled_from([(4, 6), (2, 4, 3), (3, 2, 2, 2)]), dim=st.integers(-1, 1), seed=st.integers(0, 999))
@settings(max_examples=10)
def test_softmin_glu_prelu_gradcheck(device, shape, dim, seed):
    rng = np.random.default_rng(seed)
    x = T(away_from(rng.uniform(-3, 3, shape), [0.0]), device, grad=True)
    assert gradcheck(lambda v: F.softmin(v, dim=dim), (x,))
    if shape[dim] % 2 == 0:
        assert gradcheck(lambda v: F.glu(v, dim=dim), (x,))
    w = T(rng.uniform(-0.5, 0.5, shape[1]), device, grad=True)
    assert gradcheck(F.prelu, (x, w))


def test_activation_refusals(device):
    x = T(np.ones((3, 5)), device)
    with pytest.raises(ValueError, match="even size"):
        F.glu(x)
    with pytest.raises(ValueError, match="one per channel"):
        F.prelu(x, T(np.ones(4), device))
    with pytest.raises(ValueError, match="min_val"):
        F.hardtanh(x, 1.0, -1.0)
    with pytest.raises(ValueError, match="alpha"):
        F.celu(x, 0.0)
    with pytest.raises(ValueError, match="lambd"):
        F.softshrink(x, -0.1)


def test_leaky_relu_gradient_at_zero_and_inplace(device):
    x = T([-1.0, 0.0, 2.0], device, grad=True)
    F.leaky_relu(x, 0.1).sum().backward()
    np.testing.assert_allclose(npa(x.grad), [0.1, 0.1, 1.0])  # PyTorch: the slope at exactly 0
    x.grad = None
    y = x * 1.0
    out = F.leaky_relu(y, 0.1, inplace=True)
    assert out is y
    np.testing.assert_allclose(npa(y), [-0.1, 0.0, 2.0])
    out.sum().backward()
    np.testing.assert_allclose(npa(x.grad), [0.1, 0.1, 1.0])
    with pytest.raises(ValueError, match="negative_slope >= 0"):
        F.leaky_relu(y, -0.5, inplace=True)


@pytest.mark.parametrize("fn", [F.elu, F.mish, F.hardswish, F.relu6, F.hardsigmoid, F.selu, F.hardtanh,
                                lambda x, inplace=False: F.celu(x, 0.7, inplace),
                                lambda x, inplace=False: F.threshold(x, 0.5, -2.0, inplace)])
def test_inplace_activations_keep_their_gradient(device, rng, fn):
    x = T(rng.uniform(-4, 4, (3, 5)), device, grad=True)
    fn(x * 1.0).sum().backward()
    want = npa(x.grad)
    x.grad = None
    y = x * 1.0
    assert fn(y, inplace=True) is y
    np.testing.assert_allclose(npa(y), npa(fn(x)), rtol=1e-15)
    y.sum().backward()
    np.testing.assert_allclose(npa(x.grad), want, rtol=1e-15)


# ----------------------------------------------------------------------------- regression losses
def _red(v, reduction):
    return {"mean": np.mean, "sum": np.sum, "none": lambda u: u}[reduction](v)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_smooth_l1_and_huber(device, rng, reduction):
    a, b = rng.standard_normal((5, 3)) * 2, rng.standard_normal((5, 3))
    d = np.abs(a - b)
    for beta in (1.0, 0.5, 0.0):
        want = d if beta == 0 else np.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
        got = F.smooth_l1_loss(T(a, device), T(b, device), reduction=reduction, beta=beta)
        np.testing.assert_allclose(npa(got), _red(want, reduction), rtol=1e-12)
    for delta in (1.0, 0.3, 2.5):
        want = np.where(d <= delta, 0.5 * d * d, delta * (d - 0.5 * delta))
        got = F.huber_loss(T(a, device), T(b, device), reduction=reduction, delta=delta)
        np.testing.assert_allclose(npa(got), _red(want, reduction), rtol=1e-12)
    # HuberLoss(delta) == delta * SmoothL1Loss(beta=delta)
    np.testing.assert_allclose(npa(F.huber_loss(T(a, device), T(b, device), delta=0.3)),
                               0.3 * npa(F.smooth_l1_loss(T(a, device), T(b, device), beta=0.3)), rtol=1e-12)
    with pytest.raises(ValueError, match="negative values for beta"):
        F.smooth_l1_loss(T(a, device), T(b, device), beta=-1.0)


@given(shape=small_shapes, seed=st.integers(0, 2 ** 16), which=st.sampled_from(["smooth", "huber", "mse", "l1"]))
@settings(max_examples=12)
def test_regression_loss_gradcheck(device, shape, seed, which):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(shape)
    a = b + away_from(rng.uniform(-2, 2, shape), [0.0, 0.7, -0.7])  # no |d| at a kink
    fn = {"smooth": lambda x, y: F.smooth_l1_loss(x, y, beta=0.7),
          "huber": lambda x, y: F.huber_loss(x, y, delta=0.7, reduction="sum"),
          "mse": lambda x, y: F.mse_loss(x, y, reduction="none"),
          "l1": F.l1_loss}[which]
    assert gradcheck(fn, (T(a, device, grad=True), T(b, device, grad=True)))


def test_mse_l1_broadcast_with_pytorch_warning(device, rng):
    a, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    with pytest.warns(UserWarning, match=r"target size \(\(4,\)\) that is different to the input size \(\(3, 4\)\)"):
        got = F.mse_loss(T(a, device), T(b, device))
    np.testing.assert_allclose(npa(got), ((a - b) ** 2).mean(), rtol=1e-12)
    with pytest.warns(UserWarning, match="different to the input size"):
        got = F.l1_loss(T(a, device), T(b, device), reduction="sum")
    np.testing.assert_allclose(npa(got), np.abs(a - b).sum(), rtol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.mse_loss(T(a, device), T(a, device))  # same size: no warning
    x = T(a, device, grad=True)
    with pytest.warns(UserWarning):
        assert gradcheck(lambda v: F.mse_loss(v, T(b, device)), (x,))
    with pytest.raises(flame.ShapeError, match=r"\(3, 4\) and target \(2, 4\) cannot be broadcast"):
        F.mse_loss(T(a, device), T(a[:2], device))


def test_weighted_and_legacy_reduction(device, rng):
    a, b, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.uniform(0.1, 2, (3, 4))
    got = F.mse_loss(T(a, device), T(b, device), weight=T(w, device))
    np.testing.assert_allclose(npa(got), (w * (a - b) ** 2).sum() / w.sum(), rtol=1e-12)
    got = F.l1_loss(T(a, device), T(b, device), weight=T(w, device), reduction="sum")
    np.testing.assert_allclose(npa(got), (w * np.abs(a - b)).sum(), rtol=1e-12)
    with pytest.raises(ValueError, match="Weights and input must have the same size"):
        F.mse_loss(T(a, device), T(b, device), weight=T(w[:1], device))
    with pytest.warns(UserWarning, match="size_average and reduce args will be deprecated"):
        got = F.mse_loss(T(a, device), T(b, device), size_average=False)
    np.testing.assert_allclose(npa(got), ((a - b) ** 2).sum(), rtol=1e-12)
    with pytest.warns(UserWarning):
        got = F.l1_loss(T(a, device), T(b, device), reduce=False)
    assert tuple(got.shape) == (3, 4)
    with pytest.raises(TypeError, match="pass reduction= by keyword"):
        F.mse_loss(T(a, device), T(b, device), "sum")


# ----------------------------------------------------------------------------- binary cross-entropy
def _bce_ref(p, t, w=None):
    loss = -(t * np.maximum(np.log(p), -100) + (1 - t) * np.maximum(np.log1p(-p), -100))
    return loss if w is None else loss * w


def _bce_logits_ref(x, t, w=None, pw=None):
    s = 1 / (1 + np.exp(-x))
    pw = 1.0 if pw is None else pw
    loss = -(pw * t * np.log(s) + (1 - t) * np.log(1 - s))
    return loss if w is None else loss * w


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy(device, rng, reduction):
    p, t, w = rng.uniform(0.02, 0.98, (4, 3)), rng.uniform(0, 1, (4, 3)), rng.uniform(0.5, 2, (4, 3))
    got = F.binary_cross_entropy(T(p, device), T(t, device), weight=T(w, device), reduction=reduction)
    np.testing.assert_allclose(npa(got), _red(_bce_ref(p, t, w), reduction), rtol=1e-12)
    edge = F.binary_cross_entropy(T([0.0, 1.0], device), T([1.0, 0.0], device), reduction="none")
    np.testing.assert_allclose(npa(edge), [100.0, 100.0])  # log clamped at -100, as PyTorch
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.binary_cross_entropy(T([1.5], device), T([1.0], device))
    with pytest.raises(ValueError, match="target size"):
        F.binary_cross_entropy(T(p, device), T(t[:, :2], device))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy_with_logits(device, rng, reduction):
    x, t = rng.standard_normal((4, 3)) * 3, rng.uniform(0, 1, (4, 3))
    w, pw = rng.uniform(0.5, 2, (4, 3)), rng.uniform(0.5, 3, 3)
    got = F.binary_cross_entropy_with_logits(T(x, device), T(t, device), weight=T(w, device),
                                             pos_weight=T(pw, device), reduction=reduction)
    np.testing.assert_allclose(npa(got), _red(_bce_logits_ref(x, t, w, pw), reduction), rtol=1e-11)
    big = F.binary_cross_entropy_with_logits(T([800.0, -800.0], device), T([0.0, 1.0], device), reduction="none")
    np.testing.assert_allclose(npa(big), [800.0, 800.0])  # the stable form: no overflow
    xs = T(x[:2], device, grad=True)
    assert gradcheck(lambda v: F.binary_cross_entropy_with_logits(v, T(t[:2], device), pos_weight=T(pw, device)),
                     (xs,))
    ps = T(rng.uniform(0.1, 0.9, (2, 3)), device, grad=True)
    assert gradcheck(lambda v: F.binary_cross_entropy(v, T(t[:2], device), reduction="sum"), (ps,))


# ----------------------------------------------------------------------------- KL divergence
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none", "mean"])
def test_kl_div(device, rng, log_target, reduction):
    logq = np.log(rng.dirichlet(np.ones(5), 3))
    p = rng.dirichlet(np.ones(5), 3)
    p[0, 1] = 0.0  # a zero target contributes 0
    pointwise = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - logq), 0.0)
    tgt = np.log(np.where(p > 0, p, 1e-300)) if log_target else p
    if log_target:
        pointwise = np.exp(tgt) * (tgt - logq)
    want = {"batchmean": pointwise.sum() / 3, "sum": pointwise.sum(), "none": pointwise,
            "mean": pointwise.mean()}[reduction]
    if reduction == "mean":
        with pytest.warns(UserWarning, match="'batchmean' divides only by the batch size"):
            got = F.kl_div(T(logq, device), T(tgt, device), reduction=reduction, log_target=log_target)
    else:
        got = F.kl_div(T(logq, device), T(tgt, device), reduction=reduction, log_target=log_target)
    np.testing.assert_allclose(npa(got), want, rtol=1e-12, atol=1e-14)
    x = T(logq, device, grad=True)
    assert gradcheck(lambda v: F.kl_div(v, T(tgt, device), reduction="batchmean", log_target=log_target), (x,))


# ----------------------------------------------------------------------------- normalize, cosine_similarity
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=3).map(tuple), seed=st.integers(0, 2 ** 16),
       p=st.sampled_from([1.0, 2.0, 3.0]))
@settings(max_examples=10)
def test_normalize(device, shape, seed, p):
    a = np.random.default_rng(seed).standard_normal(shape)
    n = np.maximum((np.abs(a) ** p).sum(1, keepdims=True) ** (1 / p), 1e-12)
    np.testing.assert_allclose(npa(F.normalize(T(a, device), p=p, dim=1)), a / n, rtol=1e-12)
    assert gradcheck(lambda v: F.normalize(v, p=p, dim=-1), (T(a, device, grad=True),))


def test_normalize_zero_vector_and_out(device):
    z = T(np.zeros((2, 3)), device, grad=True)
    y = F.normalize(z, dim=1)
    np.testing.assert_array_equal(npa(y), 0.0)
    y.sum().backward()
    assert np.isfinite(npa(z.grad)).all()
    out = flame.empty(2, 2, dtype=flame.float64, device=z.device)
    r = F.normalize(T([[3.0, 4.0], [0.0, 2.0]], z.device), out=out)
    assert r is out
    np.testing.assert_allclose(npa(out), [[0.6, 0.8], [0.0, 1.0]])


def test_cosine_similarity(device, rng):
    a, b = rng.standard_normal((4, 1, 5)), rng.standard_normal((3, 5))
    aa, bb = np.broadcast_arrays(a, b)
    dot = (aa * bb).sum(-1)
    want = dot / (np.maximum(np.linalg.norm(aa, axis=-1), 1e-8) * np.maximum(np.linalg.norm(bb, axis=-1), 1e-8))
    got = F.cosine_similarity(T(a, device), T(b, device), dim=-1)
    assert tuple(got.shape) == (4, 3)
    np.testing.assert_allclose(npa(got), want, rtol=1e-12)
    zero = F.cosine_similarity(T(np.zeros((1, 3)), device), T(np.ones((1, 3)), device))
    np.testing.assert_allclose(npa(zero), [0.0])
    assert gradcheck(lambda u, v: F.cosine_similarity(u, v, dim=-1),
                     (T(a[:2], device, grad=True), T(b[:2], device, grad=True)))
    with pytest.raises(flame.ShapeError, match="cannot be broadcast"):
        F.cosine_similarity(T(a, device), T(rng.standard_normal((3, 4)), device))


# ----------------------------------------------------------------------------- conv1d, conv_transpose2d
def conv1d_ref(x, w, b, stride, pad, dil, groups):
    N, C, L = x.shape
    O, Cg, K = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad)))
    Lo = (L + 2 * pad - dil * (K - 1) - 1) // stride + 1
    y = np.zeros((N, O, Lo))
    og = O // groups
    for o in range(O):
        gi = o // og
        for i in range(Lo):
            seg = xp[:, gi * Cg:(gi + 1) * Cg, i * stride:i * stride + dil * (K - 1) + 1:dil]
            y[:, o, i] = (seg * w[o]).sum((1, 2))
    return y + (0 if b is None else b[None, :, None])


def conv_transpose2d_ref(x, w, b, stride, pad, out_pad, groups, dil):
    """Scatter form: every input pixel adds weight * value to the output window it spreads over."""
    N, Cin, H, W = x.shape
    _, Cog, KH, KW = w.shape
    (sh, sw), (ph, pw), (oph, opw), (dh, dw) = stride, pad, out_pad, dil
    OH = (H - 1) * sh - 2 * ph + dh * (KH - 1) + oph + 1
    OW = (W - 1) * sw - 2 * pw + dw * (KW - 1) + opw + 1
    full = np.zeros((N, Cog * groups, (H - 1) * sh + dh * (KH - 1) + 1 + oph + ph,
                     (W - 1) * sw + dw * (KW - 1) + 1 + opw + pw))
    cg = Cin // groups
    for c in range(Cin):
        g = c // cg
        for i in range(H):
            for j in range(W):
                for kh in range(KH):
                    for kw in range(KW):
                        full[:, g * Cog:(g + 1) * Cog, i * sh + kh * dh, j * sw + kw * dw] += \
                            x[:, c, i, j][:, None] * w[c, :, kh, kw][None, :]
    y = full[:, :, ph:ph + OH, pw:pw + OW]
    return y + (0 if b is None else b[None, :, None, None])


@pytest.mark.parametrize("stride,pad,dil,groups", [(1, 0, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (3, 1, 2, 3)])
def test_conv1d(device, rng, stride, pad, dil, groups):
    x, w, b = rng.standard_normal((2, 6, 11)), rng.standard_normal((3 * groups, 6 // groups, 3)), \
        rng.standard_normal(3 * groups)
    got = F.conv1d(T(x, device), T(w, device), T(b, device), stride, pad, dil, groups)
    np.testing.assert_allclose(npa(got), conv1d_ref(x, w, b, stride, pad, dil, groups), rtol=1e-10, atol=1e-12)
    xs, ws = T(x[:1, :, :7], device, grad=True), T(w, device, grad=True)
    assert gradcheck(lambda u, v: F.conv1d(u, v, None, stride, pad, dil, groups), (xs, ws))


def test_conv1d_same_and_unbatched(device, rng):
    x, w = rng.standard_normal((3, 9)), rng.standard_normal((2, 3, 4))
    got = F.conv1d(T(x, device), T(w, device), padding="same")
    assert tuple(got.shape) == (2, 9)
    full = conv1d_ref(np.pad(x[None], ((0, 0), (0, 0), (1, 2))), w, None, 1, 0, 1, 1)[0]
    np.testing.assert_allclose(npa(got), full, rtol=1e-10)
    with pytest.raises(flame.ShapeError, match="conv1d expects"):
        F.conv1d(T(x, device), T(w[0], device))


CONVT = [((2, 2), (1, 1), (1, 1), 1, (1, 1)), ((1, 1), (0, 0), (0, 0), 1, (1, 1)),
         ((2, 1), (1, 1), (1, 0), 2, (1, 1)), ((2, 2), (0, 1), (1, 1), 1, (2, 2)), ((3, 2), (2, 0), (2, 1), 2, (1, 3)),
         ((1, 2), (0, 1), (1, 2), 1, (2, 3))]  # the last: output_padding >= stride (under dilation)


@pytest.mark.parametrize("stride,pad,out_pad,groups,dil", CONVT)
def test_conv_transpose2d(device, rng, stride, pad, out_pad, groups, dil):
    x = rng.standard_normal((2, 4, 4, 3))
    w, b = rng.standard_normal((4, 3, 3, 2)), rng.standard_normal(3 * groups)
    got = F.conv_transpose2d(T(x, device), T(w, device), T(b, device), stride, pad, out_pad, groups, dil)
    np.testing.assert_allclose(npa(got), conv_transpose2d_ref(x, w, b, stride, pad, out_pad, groups, dil),
                               rtol=1e-10, atol=1e-12)


@given(stride=st.integers(1, 3), pad=st.integers(0, 1), dil=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       seed=st.integers(0, 2 ** 16))
@settings(max_examples=8)
def test_conv_transpose2d_gradcheck(device, stride, pad, dil, groups, seed):
    rng = np.random.default_rng(seed)
    x = T(rng.standard_normal((1, 2, 3, 2)), device, grad=True)
    w = T(rng.standard_normal((2, 2 // groups, 2, 2)), device, grad=True)
    b = T(rng.standard_normal(2), device, grad=True)
    op = max(stride, dil) - 1  # up to the largest allowed, also >= stride where dilation allows it
    assert gradcheck(lambda u, v, c: F.conv_transpose2d(u, v, c, stride, pad, op, groups, dil), (x, w, b))


def test_conv_transpose2d_errors(device, rng):
    x, w = T(rng.standard_normal((1, 4, 3, 3)), device), T(rng.standard_normal((4, 2, 3, 3)), device)
    with pytest.raises(ValueError, match="output padding"):
        F.conv_transpose2d(x, w, stride=2, output_padding=2)
    with pytest.raises(flame.ShapeError, match="expects 3 input channels"):
        F.conv_transpose2d(x, T(rng.standard_normal((3, 2, 3, 3)), x.device))
    with pytest.raises(flame.DTypeError, match="same dtype"):
        F.conv_transpose2d(x, w.float())
    assert tuple(F.conv_transpose2d(x[0], w).shape) == (2, 5, 5)  # unbatched


# ----------------------------------------------------------------------------- batch_norm, pixel shuffle, bilinear
def test_batch_norm_functional(device, rng):
    x = rng.standard_normal((4, 3, 5)) * 2 + 1
    w, b = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    trm, trv = T(rm, device), T(rv, device)
    y = F.batch_norm(T(x, device), trm, trv, T(w, device), T(b, device), training=True, momentum=0.25, eps=1e-3)
    mean, var = x.mean((0, 2)), x.var((0, 2))
    want = (x - mean[None, :, None]) / np.sqrt(var[None, :, None] + 1e-3) * w[None, :, None] + b[None, :, None]
    np.testing.assert_allclose(npa(y), want, rtol=1e-12)
    np.testing.assert_allclose(npa(trm), 0.75 * rm + 0.25 * mean, rtol=1e-12)
    np.testing.assert_allclose(npa(trv), 0.75 * rv + 0.25 * x.var((0, 2), ddof=1), rtol=1e-12)
    y = F.batch_norm(T(x, device), T(rm, device), T(rv, device), training=False)
    np.testing.assert_allclose(npa(y), (x - rm[None, :, None]) / np.sqrt(rv[None, :, None] + 1e-5), rtol=1e-12)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(T(x[:1, :, :1], device), None, None, training=True)
    xs = T(x[:2, :, :3], device, grad=True)
    assert gradcheck(lambda v, ww, bb: F.batch_norm(v, None, None, ww, bb, training=True),
                     (xs, T(w, device, grad=True), T(b, device, grad=True)))


@pytest.mark.parametrize("r", [1, 2, 3])
def test_pixel_shuffle_roundtrip(device, rng, r):
    x = rng.standard_normal((2, 2 * r * r, 3, 4))
    y = F.pixel_shuffle(T(x, device), r)
    want = np.zeros((2, 2, 3 * r, 4 * r))
    for c in range(2):
        for i in range(r):
            for j in range(r):
                want[:, c, i::r, j::r] = x[:, c * r * r + i * r + j]
    np.testing.assert_array_equal(npa(y), want)
    np.testing.assert_array_equal(npa(F.pixel_unshuffle(y, r)), x)
    np.testing.assert_array_equal(npa(F.pixel_shuffle(T(x[0], device), r)), want[0])  # no batch dim
    assert gradcheck(lambda v: F.pixel_shuffle(v, r), (T(x[:1, :r * r], device, grad=True),))
    with pytest.raises(flame.ShapeError, match="divisible"):
        F.pixel_shuffle(T(np.zeros((1, 3, 2, 2)), device), 2)


def test_bilinear_functional(device, rng):
    a, b, w, bias = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 5)), \
        rng.standard_normal((6, 4, 5)), rng.standard_normal(6)
    got = F.bilinear(T(a, device), T(b, device), T(w, device), T(bias, device))
    np.testing.assert_allclose(npa(got), np.einsum("...i,kij,...j->...k", a, w, b) + bias, rtol=1e-12)
    assert gradcheck(F.bilinear, (T(a[0, :2], device, grad=True), T(b[0, :2], device, grad=True),
                                  T(w, device, grad=True), T(bias, device, grad=True)))
    with pytest.raises(flame.ShapeError, match="do not fit weight"):
        F.bilinear(T(a, device), T(a, device), T(w, device))


def test_one_hot_is_flame_cores(device):
    y = F.one_hot(flame.tensor([0, 2, 1], device=device), 4)
    assert y.dtype == flame.int64
    np.testing.assert_array_equal(y.numpy(), np.eye(4, dtype=np.int64)[[0, 2, 1]])
    assert F.one_hot is flame.one_hot


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(flame.float32, 2e-5), (flame.float16, 3e-3), (flame.bfloat16, 2e-2)])
@pytest.mark.parametrize("stride,dil", [(1, 1), (2, 1), (1, 2)])
def test_conv_transpose2d_cuda_dtypes(rng, dtype, tol, stride, dil):
    """The cuda paths (implicit GEMM for stride 1 in half types, col2im otherwise) against the float64 reference,
    forward and all three gradients."""
    x = rng.standard_normal((2, 16, 9, 7))
    w = rng.standard_normal((16, 8, 3, 3)) / 12
    b = rng.standard_normal(8)
    op = max(stride, dil) - 1
    want = conv_transpose2d_ref(x, w, b, (stride, stride), (1, 1), (op, op), 1, (dil, dil))
    xs, ws, bs = (T(a, "cuda", grad=True, dtype=dtype) for a in (x, w, b))
    y = F.conv_transpose2d(xs, ws, bs, stride, 1, op, 1, dil)
    assert y.dtype == dtype and y.device.type == "cuda"
    scale = np.abs(want).max()
    np.testing.assert_allclose(npa(y), want, atol=tol * scale)
    gy = rng.standard_normal(want.shape)
    (y * T(gy, "cuda", dtype=dtype)).sum().backward()
    x64, w64, b64 = (T(a, "cpu", grad=True) for a in (x, w, b))
    (F.conv_transpose2d(x64, w64, b64, stride, 1, op, 1, dil) * T(gy, "cpu")).sum().backward()
    for got, ref in ((xs, x64), (ws, w64), (bs, b64)):
        r = npa(ref.grad)
        np.testing.assert_allclose(npa(got.grad), r, atol=tol * 4 * np.abs(r).max())


def test_one_hot_follows_pytorchs_rules():
    import flame_nn.functional as F
    x = flame.tensor([[0, 2], [1, 0]], dtype=flame.int64)
    np.testing.assert_array_equal(F.one_hot(x).numpy(), np.eye(3, dtype=np.int64)[[[0, 2], [1, 0]]])
    assert tuple(F.one_hot(x, num_classes=5).shape) == (2, 2, 5) and F.one_hot(x).dtype == flame.int64
    with pytest.raises(flame.DTypeError, match="int64"):
        F.one_hot(x.float())
    with pytest.raises(RuntimeError, match="non-negative"):
        F.one_hot(flame.tensor([1, -1], dtype=flame.int64))
    with pytest.raises(RuntimeError, match="out of range for num_classes 2"):
        F.one_hot(x, num_classes=2)
    with pytest.raises(RuntimeError, match="empty tensor"):
        F.one_hot(flame.zeros(0, dtype=flame.int64))
    assert tuple(F.one_hot(flame.zeros(0, dtype=flame.int64), num_classes=3).shape) == (0, 3)


# ----------------------------------------------------------------------------- affine_grid / grid_sample
_GS_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "grid_sample.safetensors")
_GS_CASES = [f"{m}.{p}.{a}" for m in ("bilinear", "nearest", "bicubic") for p in ("zeros", "border", "reflection")
             for a in (0, 1)]


@pytest.mark.parametrize("name", _GS_CASES)
def test_grid_sample_matches_pytorch(device, name):
    """Every mode x padding mode x align_corners against PyTorch (tests/fixtures/make_grid_sample_fixtures.py) on a
    grid reaching past the image: the output, the input's gradient and the grid's (none for nearest, as PyTorch's
    zeros)."""
    from safetensors.numpy import load_file
    fx = load_file(_GS_FIXTURE)
    mode, pad, align = name.split(".")
    x, g = T(fx["x"], device, grad=True), T(fx["grid"], device, grad=True)
    y = F.grid_sample(x, g, mode=mode, padding_mode=pad, align_corners=bool(int(align)))
    np.testing.assert_allclose(npa(y), fx[f"{name}.out"], rtol=1e-12, atol=1e-13)
    y.backward(T(fx[f"{name}.go"], device))
    np.testing.assert_allclose(npa(x.grad), fx[f"{name}.gx"], rtol=1e-12, atol=1e-13)
    gg = np.zeros_like(fx["grid"]) if g.grad is None else npa(g.grad)
    np.testing.assert_allclose(gg, fx[f"{name}.ggrid"], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("case", ["0", "1", "3d"])
def test_affine_grid_matches_pytorch(device, case):
    from safetensors.numpy import load_file
    fx = load_file(_GS_FIXTURE)
    if case == "3d":
        th, size, key, align = T(fx["theta3"], device, grad=True), (2, 1, 3, 4, 5), "affine3d", False
    else:
        th, size, key, align = T(fx["theta"], device, grad=True), (2, 3, 4, 6), f"affine.{case}", bool(int(case))
    grid = F.affine_grid(th, size, align_corners=align)
    np.testing.assert_allclose(npa(grid), fx[f"{key}.grid"], rtol=1e-13, atol=1e-14)
    grid.backward(T(fx[f"{key}.go"], device))
    np.testing.assert_allclose(npa(th.grad), fx[f"{key}.gtheta"], rtol=1e-12, atol=1e-13)


@given(mode=st.sampled_from(["bilinear", "bicubic"]), pad=st.sampled_from(["zeros", "border", "reflection"]),
       align=st.booleans(), seed=st.integers(0, 999))
@settings(max_examples=10, deadline=None)
def test_grid_sample_gradcheck(device, mode, pad, align, seed):
    """float64 gradient checks of the input and of the grid (grid points kept off integer pixel coordinates and the
    reflection folds, where the sampling has kinks)."""
    rng = np.random.default_rng(seed)
    x = T(rng.standard_normal((1, 2, 4, 5)), device, grad=True)
    g = rng.uniform(-0.9, 0.9, (1, 3, 2, 2))
    g = g + 0.013  # off the pixel lattice's exact points
    gt = T(g, device, grad=True)
    assert gradcheck(lambda a, b: F.grid_sample(a, b, mode=mode, padding_mode=pad, align_corners=align), (x, gt),
                     eps=1e-7, atol=1e-5)


def test_grid_sample_refusals(device):
    x, g = T(np.ones((1, 1, 3, 3)), device), T(np.zeros((1, 2, 2, 2)), device)
    with pytest.raises(ValueError, match="mode must be"):
        F.grid_sample(x, g, mode="area")
    with pytest.raises(ValueError, match="padding_mode"):
        F.grid_sample(x, g, padding_mode="circular")
    with pytest.raises(flame.errors.ShapeError, match="5-D volumes"):
        F.grid_sample(T(np.ones((1, 1, 2, 2, 2)), device), g)
    with pytest.raises(flame.errors.ShapeError, match="grid"):
        F.grid_sample(x, T(np.zeros((1, 2, 2, 3)), device))
    with pytest.raises(flame.errors.ShapeError, match="theta"):
        F.affine_grid(T(np.zeros((1, 2, 3)), device), (2, 1, 3, 3))
