"""flame_nn.functional losses and helpers against NumPy references; flame_nn.init formulas."""
import math

import nn_reference as ref
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F
from flame_core.autograd import gradcheck


def npa(t):
    return t.detach().numpy().astype(np.float64)


def T(a, device, grad=False, dtype=flame.float64):
    return flame.tensor(np.asarray(a), dtype=dtype, device=device, requires_grad=grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_and_l1(device, rng, reduction):
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    red = {"mean": np.mean, "sum": np.sum, "none": lambda v: v}[reduction]
    np.testing.assert_allclose(npa(F.mse_loss(T(a, device), T(b, device), reduction=reduction)), red((a - b) ** 2),
                               rtol=1e-12)
    np.testing.assert_allclose(npa(F.l1_loss(T(a, device), T(b, device), reduction=reduction)),
                               red(np.abs(a - b)), rtol=1e-12)
    x = T(a, device, grad=True)
    assert gradcheck(lambda v: F.mse_loss(v, T(b, device), reduction=reduction), (x,))
    with pytest.raises(flame.ShapeError, match=r"\(3, 4\) and target \(2, 4\) cannot be broadcast"):
        F.mse_loss(T(a, device), T(b[:2], device))


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_class_indices(device, rng, weight, smoothing, reduction):
    logits = rng.standard_normal((6, 5)) * 2
    target = np.array([0, 4, -100, 2, 2, 1])
    w = rng.uniform(0.5, 2.0, 5) if weight else None
    got = F.cross_entropy(T(logits, device), flame.tensor(target, device=device),
                          weight=T(w, device) if weight else None, reduction=reduction, label_smoothing=smoothing)
    want = ref.cross_entropy(logits, target, w, -100, reduction, smoothing)
    np.testing.assert_allclose(npa(got), want, rtol=1e-10, atol=1e-12)
    x = T(logits[:3, :4], device, grad=True)
    t = flame.tensor([1, 3, 0], device=device)
    assert gradcheck(lambda v: F.cross_entropy(v, t, reduction=reduction, label_smoothing=smoothing), (x,))


def test_cross_entropy_spatial_and_probability_targets(device, rng):
    logits = rng.standard_normal((2, 3, 4, 2))  # (N, C, H, W)
    target = rng.integers(0, 3, (2, 4, 2))
    got = F.cross_entropy(T(logits, device), flame.tensor(target, device=device))
    flat = logits.transpose(0, 2, 3, 1).reshape(-1, 3)
    np.testing.assert_allclose(npa(got), ref.cross_entropy(flat, target.reshape(-1)), rtol=1e-10)
    probs = ref.softmax(rng.standard_normal((4, 3)))
    lg = rng.standard_normal((4, 3))
    logp = np.log(ref.softmax(lg))
    got = F.cross_entropy(T(lg, device), T(probs, device), label_smoothing=0.1)
    want = -((probs * 0.9 + 0.1 / 3) * logp).sum(1).mean()
    np.testing.assert_allclose(npa(got), want, rtol=1e-10)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        F.cross_entropy(T(lg, device), flame.tensor([0, 1, 2, 3], device=device))


def test_nll_loss_and_log_softmax(device, rng):
    x = rng.standard_normal((4, 3))
    logp = F.log_softmax(T(x, device), dim=1)
    np.testing.assert_allclose(npa(logp), np.log(ref.softmax(x, 1)), rtol=1e-12)
    t = np.array([2, 0, 1, 1])
    np.testing.assert_allclose(npa(F.nll_loss(logp, flame.tensor(t, device=device))),
                               -np.log(ref.softmax(x, 1))[np.arange(4), t].mean(), rtol=1e-12)
    with pytest.raises(flame.DTypeError, match="class indices"):
        F.nll_loss(logp, T(t, device))


def test_pad_modes(device, rng):
    x = rng.standard_normal((1, 2, 3, 4))
    np.testing.assert_array_equal(npa(F.pad(T(x, device), (1, 2, 0, 1))),
                                  np.pad(x, ((0, 0), (0, 0), (0, 1), (1, 2))))
    np.testing.assert_array_equal(npa(F.pad(T(x, device), (1, 1, 1, 1), mode="reflect")),
                                  np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), mode="reflect"))


def test_interpolate_argument_errors(device):
    x = flame.zeros(1, 1, 2, 2, device=device)
    with pytest.raises(ValueError, match="exactly one"):
        F.interpolate(x)
    with pytest.raises(ValueError, match="mode must be one of"):
        F.interpolate(x, scale_factor=2, mode="lanczos")
    with pytest.raises(flame.ShapeError):
        F.interpolate(flame.zeros(2, 2, device=device), scale_factor=2)
    with pytest.raises(flame.ShapeError, match="'trilinear' needs a 5-D input"):
        F.interpolate(x, scale_factor=2, mode="trilinear")
    with pytest.raises(ValueError, match="align_corners only applies"):
        F.interpolate(x, scale_factor=2, mode="nearest", align_corners=False)
    with pytest.raises(ValueError, match="antialias only applies"):
        F.interpolate(x, scale_factor=2, mode="area", antialias=True)
    with pytest.raises(ValueError, match="must have 2 elements"):
        F.interpolate(x, size=(2, 2, 2))
    with pytest.raises(ValueError, match="output would have size"):
        F.interpolate(x, scale_factor=0.2)


def test_functional_reexports_sdpa(device):
    from flame_core.ops.attention import scaled_dot_product_attention
    assert F.scaled_dot_product_attention is scaled_dot_product_attention


# ----------------------------------------------------------------------------- init
def test_fan_and_gain():
    w = flame.empty(6, 4, 3, 3)
    assert nn.init._calculate_fan_in_and_fan_out(w) == (36, 54)
    assert nn.init.calculate_gain("relu") == math.sqrt(2)
    assert nn.init.calculate_gain("leaky_relu", math.sqrt(5)) == pytest.approx(math.sqrt(1 / 3))
    assert nn.init.calculate_gain("tanh") == pytest.approx(5 / 3)
    with pytest.raises(ValueError, match="fewer than 2"):
        nn.init.xavier_uniform_(flame.empty(3))


def test_init_distributions(device):
    flame.manual_seed(0)
    w = flame.empty(256, 512, device=device)
    nn.init.kaiming_uniform_(w, nonlinearity="relu")
    bound = math.sqrt(2) * math.sqrt(3 / 512)
    a = npa(w)
    assert np.abs(a).max() <= bound and a.std() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    nn.init.xavier_uniform_(w, gain=2.0)
    bound = 2.0 * math.sqrt(6 / (512 + 256))
    assert np.abs(npa(w)).max() <= bound and npa(w).std() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    nn.init.normal_(w, 1.0, 0.5)
    assert npa(w).mean() == pytest.approx(1.0, abs=0.01) and npa(w).std() == pytest.approx(0.5, rel=0.02)
    nn.init.kaiming_normal_(w, mode="fan_out")
    assert npa(w).std() == pytest.approx(math.sqrt(2 / 256), rel=0.02)
    nn.init.trunc_normal_(w, std=1.0, a=-0.5, b=0.5)
    assert np.abs(npa(w)).max() <= 0.5
    nn.init.constant_(w, 3.0)
    assert np.all(npa(w) == 3.0)
    nn.init.zeros_(w)
    assert not npa(w).any()
    nn.init.ones_(w)
    assert np.all(npa(w) == 1.0)
    p = nn.Parameter(flame.empty(3, 3, device=device))
    nn.init.uniform_(p, -1, 1)  # works on leaves that require grad (no_grad inside)
    assert p.requires_grad and np.abs(npa(p)).max() <= 1


def test_init_generator_reproducible(device):
    g1, g2 = flame.Generator(device), flame.Generator(device)
    g1.manual_seed(7)
    g2.manual_seed(7)
    a, b = flame.empty(5, 5, device=device), flame.empty(5, 5, device=device)
    nn.init.normal_(a, generator=g1)
    nn.init.normal_(b, generator=g2)
    np.testing.assert_array_equal(npa(a), npa(b))
