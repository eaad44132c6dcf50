"""The documented autocast policy across the layers: flame_nn.functional's ops return the documented
dtype inside a region, and their inputs' dtype outside it."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn.functional as F
from flame_core import amp


def _t(rng, *shape, dtype=flame.float32, device="cpu"):
    return flame.tensor(rng.standard_normal(shape), dtype=dtype, device=device)


def _cases(device):
    rng = np.random.default_rng(0)
    x32 = _t(rng, 2, 5, 8, device=device)
    w32, b32 = _t(rng, 6, 8, device=device), _t(rng, 6, device=device)
    img, k = _t(rng, 1, 3, 6, 6, device=device), _t(rng, 4, 3, 3, 3, device=device)
    h = _t(rng, 2, 4, 8, dtype=flame.bfloat16, device=device)
    hg = _t(rng, 2, 4, 3, 3, dtype=flame.bfloat16, device=device)
    tgt = flame.tensor(rng.integers(0, 8, (2, 4)), device=device)
    return {
        # name: (callable, category)
        "linear": (lambda: F.linear(x32, w32, b32), "lower"),
        "conv2d": (lambda: F.conv2d(img, k, padding=1), "lower"),
        "layer_norm": (lambda: F.layer_norm(h, (8,)), "native"),
        "rms_norm": (lambda: F.rms_norm(h, (8,)), "native"),
        "joint_rms_norm": (lambda: F.joint_rms_norm([h[:, None], h[:, None]]), "native"),
        "group_norm": (lambda: F.group_norm(hg, 2), "native"),
        "group_norm_silu": (lambda: F.group_norm_silu(hg, 2), "native"),
        "softmax": (lambda: F.softmax(h, -1), "fp32"),
        "log_softmax": (lambda: F.log_softmax(h, -1), "fp32"),
        "mse_loss": (lambda: F.mse_loss(h, h * 0.5), "fp32"),
        "l1_loss": (lambda: F.l1_loss(h, h * 0.5), "fp32"),
        "cross_entropy": (lambda: F.cross_entropy(h.reshape(8, 8), tgt.reshape(8)), "fp32"),
    }


NAMES = ["linear", "conv2d", "layer_norm", "rms_norm", "joint_rms_norm", "group_norm", "group_norm_silu", "softmax",
         "log_softmax", "mse_loss", "l1_loss", "cross_entropy"]


@pytest.mark.parametrize("name", NAMES)
def test_nn_ops_follow_the_documented_policy(device, name):
    fn, cat = _cases(device)[name]
    assert amp.category_of(name) == cat
    with amp.autocast(device.type, dtype=flame.bfloat16):
        y = fn()
    inside = {"lower": flame.bfloat16, "fp32": flame.float32, "native": flame.bfloat16}[cat]  # h is bf16
    assert y.dtype == inside, name
    if not name.endswith(("_loss", "cross_entropy")):  # flame_nn's losses compute half inputs in fp32 always
        assert fn().dtype == (flame.float32 if cat == "lower" else flame.bfloat16), name


def test_linear_value_is_the_bf16_rounded_product(device):
    import ml_dtypes
    rng = np.random.default_rng(1)
    x, w, b = _t(rng, 4, 8, device=device), _t(rng, 3, 8, device=device), _t(rng, 3, device=device)
    with amp.autocast(device.type, dtype=flame.bfloat16):
        y = F.linear(x, w, b)

    def r(t):
        return t.numpy().astype(ml_dtypes.bfloat16).astype(np.float64)
    ref = r(x) @ r(w).T + r(b)
    np.testing.assert_allclose(y.float().numpy(), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
