"""gumbel_softmax's distribution and straight-through gradient, and the ChannelShuffle / LPPool / LocalResponseNorm
modules (their functional forms are checked against PyTorch in tests/core/test_torch_surface_golden.py)."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F


def test_gumbel_softmax_samples_the_softmax_and_passes_the_soft_gradient(device):
    flame.manual_seed(0)
    logits = flame.tensor([[0.0, 1.0, 2.0, -1.0]], dtype=flame.float64, device=device).expand(20000, 4)
    soft = F.gumbel_softmax(logits, tau=0.5)
    np.testing.assert_allclose(soft.sum(-1).cpu().numpy(), 1.0, rtol=1e-12)
    hard = F.gumbel_softmax(logits, hard=True).detach().cpu().numpy()
    assert set(np.unique(hard)) == {0.0, 1.0} and np.all(hard.sum(-1) == 1)
    p = np.exp([0.0, 1.0, 2.0, -1.0])
    np.testing.assert_allclose(hard.mean(0), p / p.sum(), atol=0.015)   # argmax of logits + Gumbel ~ softmax
    x = flame.tensor([[0.3, -0.2, 1.1]], dtype=flame.float64, device=device, requires_grad=True)
    g = flame.Generator(device=device).manual_seed(3)
    y = F.gumbel_softmax(x, tau=0.7, hard=True, generator=g)
    (y * flame.tensor([[1.0, 2.0, 3.0]], dtype=flame.float64, device=device)).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = F.gumbel_softmax(x2, tau=0.7, hard=False, generator=flame.Generator(device=device).manual_seed(3))
    (y2 * flame.tensor([[1.0, 2.0, 3.0]], dtype=flame.float64, device=device)).sum().backward()
    np.testing.assert_allclose(x.grad.cpu().numpy(), x2.grad.cpu().numpy(), rtol=1e-12)   # straight-through
    assert np.argmax(y.detach().cpu().numpy()) == np.argmax(y2.detach().cpu().numpy())


def test_modules_are_their_functions(device):
    x = flame.randn(2, 6, 5, 7, device=device)
    for m, fn in [(nn.ChannelShuffle(3), lambda t: F.channel_shuffle(t, 3)),
                  (nn.LPPool2d(2, (2, 3), stride=1), lambda t: F.lp_pool2d(t, 2.0, (2, 3), 1)),
                  (nn.LPPool1d(3, 2), lambda t: F.lp_pool1d(t[:, :, 0], 3.0, 2)),
                  (nn.LocalResponseNorm(3, k=2.0), lambda t: F.local_response_norm(t, 3, k=2.0))]:
        inp = x[:, :, 0] if isinstance(m, nn.LPPool1d) else x
        np.testing.assert_array_equal(m(inp).detach().cpu().numpy(), fn(x).detach().cpu().numpy())
    assert repr(nn.ChannelShuffle(3)) == "ChannelShuffle(groups=3)"
    with pytest.raises(ValueError, match="divide"):
        F.channel_shuffle(x, 4)
    with pytest.raises(flame.ShapeError, match="pdist"):
        F.pdist(x)
