"""flame_nn.utils.weight_norm / spectral_norm (and their removal) against PyTorch's torch.nn.utils forms (golden
fixtures, tests/fixtures/make_norm_reparam_fixtures.py): the same parameter and buffer names (PyTorch's state_dicts
load), the same output, power-iteration update of u / v in training (none in eval) and parameter gradients."""
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_nn.utils import remove_spectral_norm, remove_weight_norm, spectral_norm, weight_norm

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "norm_reparam.safetensors")

CASES = {
    "wn_linear": (lambda: weight_norm(nn.Linear(3, 4)), True),
    "wn_conv_all": (lambda: weight_norm(nn.Conv2d(2, 3, 3), dim=None), True),
    "sn_linear": (lambda: spectral_norm(nn.Linear(5, 4)), True),
    "sn_convt": (lambda: spectral_norm(nn.ConvTranspose2d(3, 2, 3)), True),
    "sn_eval": (lambda: spectral_norm(nn.Linear(5, 4), n_power_iterations=2), False),
}


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file
    return load_file(FIXTURE)


def _np(t):
    return t.detach().cpu().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_pytorch(case, golden, device):
    make, train = CASES[case]
    m = make().double().to(device)
    m.train(train)
    pre = f"{case}.sd."
    sd = {k[len(pre):]: flame.tensor(v, device=device) for k, v in golden.items() if k.startswith(pre)}
    assert set(sd) == set(m.state_dict())
    m.load_state_dict(sd)
    out = m(flame.tensor(golden[f"{case}.input"], device=device))
    np.testing.assert_allclose(_np(out), golden[f"{case}.out"], rtol=1e-10, atol=1e-12)
    for k, b in m.named_buffers():
        np.testing.assert_allclose(_np(b), golden[f"{case}.after.{k}"], rtol=1e-10, atol=1e-12, err_msg=k)
    (out * flame.tensor(golden[f"{case}.go"], device=device)).sum().backward()
    for k, p in m.named_parameters():
        np.testing.assert_allclose(_np(p.grad), golden[f"{case}.grad.{k}"], rtol=1e-9, atol=1e-11, err_msg=k)


def test_remove_folds_the_weight_back(device):
    flame.manual_seed(0)
    x = flame.randn(2, 5, device=device)
    for apply, remove in ((weight_norm, remove_weight_norm), (spectral_norm, remove_spectral_norm)):
        m = apply(nn.Linear(5, 3)).to(device).eval()
        want = _np(m(x))
        remove(m)
        assert sorted(k for k, _ in m.named_parameters()) == ["bias", "weight"] and not list(m.named_buffers())
        np.testing.assert_allclose(_np(m(x)), want, rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="not found"):
            remove(m)
    m = weight_norm(nn.Linear(5, 3))
    with pytest.raises(RuntimeError, match="two weight_norm"):
        weight_norm(m)
    with pytest.raises(ValueError, match="n_power_iterations"):
        spectral_norm(nn.Linear(5, 3), n_power_iterations=0)
