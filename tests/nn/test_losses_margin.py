"""The ranking / margin / embedding loss modules and the Poisson / Gaussian NLL modules (their functional forms are
checked against PyTorch in tests/core/test_torch_surface_golden.py): each module is its function with its
arguments, weights are buffers, and bad arguments raise clear errors."""
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
import flame_nn.functional as F


def _np(t):
    return t.detach().cpu().numpy()


def test_modules_are_their_functions(device):
    flame.manual_seed(0)
    x, y, z = (flame.randn(4, 5, device=device) for _ in range(3))
    t = flame.tensor([[1.0, -1.0, 1.0, 1.0, -1.0]] * 4, device=device)
    rows = flame.tensor([1.0, -1.0, -1.0, 1.0], device=device)
    labels = (flame.rand(4, 5, device=device) > 0.5).float()
    cls = flame.tensor([0, 3, 4, 1], device=device)
    w = flame.rand(5, device=device) + 0.5
    cases = [
        (nn.MarginRankingLoss(0.2, reduction="sum")(x, y, t), F.margin_ranking_loss(x, y, t, 0.2, reduction="sum")),
        (nn.HingeEmbeddingLoss(0.7)(x, t), F.hinge_embedding_loss(x, t, 0.7)),
        (nn.SoftMarginLoss(reduction="none")(x, t), F.soft_margin_loss(x, t, reduction="none")),
        (nn.CosineEmbeddingLoss(0.1)(x, y, rows), F.cosine_embedding_loss(x, y, rows, 0.1)),
        (nn.MultiLabelSoftMarginLoss(weight=w)(x, labels), F.multilabel_soft_margin_loss(x, labels, weight=w)),
        (nn.MultiMarginLoss(p=2, margin=0.5, weight=w)(x, cls), F.multi_margin_loss(x, cls, 2, 0.5, w)),
        (nn.TripletMarginLoss(0.5, p=1, swap=True)(x, y, z), F.triplet_margin_loss(x, y, z, 0.5, 1, swap=True)),
        (nn.TripletMarginWithDistanceLoss(margin=0.3)(x, y, z), F.triplet_margin_with_distance_loss(x, y, z,
                                                                                                    margin=0.3)),
        (nn.PoissonNLLLoss(log_input=False, full=True)(x.abs(), labels), F.poisson_nll_loss(x.abs(), labels, False,
                                                                                           True)),
        (nn.GaussianNLLLoss(full=True)(x, y, z.abs()), F.gaussian_nll_loss(x, y, z.abs(), full=True)),
    ]
    for got, want in cases:
        np.testing.assert_array_equal(_np(got), _np(want))
    m = nn.MultiMarginLoss(weight=w)
    assert "weight" in dict(m.named_buffers())


def test_bad_arguments_raise(device):
    x = flame.randn(4, 5, device=device)
    with pytest.raises(ValueError, match="p == 1 and p == 2"):
        nn.MultiMarginLoss(p=3)
    with pytest.raises(ValueError, match="margin must be greater than 0"):
        nn.TripletMarginLoss(margin=0.0)
    with pytest.raises(ValueError, match="negative"):
        F.gaussian_nll_loss(x, x, -x.abs())
    with pytest.raises(ValueError, match="does not fit"):
        F.gaussian_nll_loss(x, x, flame.ones(3, device=device))
    with pytest.raises(flame.ShapeError, match="cosine_embedding_loss"):
        F.cosine_embedding_loss(x, x[:, :2], flame.ones(4, device=device))
    with pytest.raises(ValueError, match="reduction"):
        F.soft_margin_loss(x, x.sign(), reduction="avg")
    # the clamp at eps passes the variance's gradient through unchanged (PyTorch's in-place clamp under no_grad)
    v = flame.tensor([1e-9, 2.0], requires_grad=True, device=device)
    F.gaussian_nll_loss(flame.zeros(2, device=device), flame.ones(2, device=device), v, reduction="sum").backward()
    np.testing.assert_allclose(_np(v.grad), 0.5 * (1 / np.array([1e-6, 2.0]) - 1 / np.array([1e-6, 2.0]) ** 2),
                               rtol=1e-5)
