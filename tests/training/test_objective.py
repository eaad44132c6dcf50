"""Flow-matching objective against a float64 NumPy reference, including its gradient."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.errors import ShapeError
from flame_models.training import objective as O


def _t(a, device, requires_grad=False):
    return flame.tensor(a, dtype=flame.float64, device=device, requires_grad=requires_grad)


@pytest.mark.parametrize("shape", [(2, 5, 8), (3, 16, 4, 4), (1, 7)])
def test_noisy_latents_and_target(shape, device, rng):
    x0, eps = rng.standard_normal(shape), rng.standard_normal(shape)
    sigma = rng.uniform(size=shape[0])
    s = sigma.reshape((-1,) + (1,) * (len(shape) - 1))
    xt = O.noisy_latents(_t(x0, device), _t(eps, device), _t(sigma, device))
    np.testing.assert_allclose(xt.cpu().numpy(), (1 - s) * x0 + s * eps, rtol=1e-13, atol=1e-13)
    v = O.velocity_target(_t(x0, device), _t(eps, device))
    np.testing.assert_allclose(v.cpu().numpy(), eps - x0, rtol=0, atol=1e-14)
    # the endpoints of the path: σ = 0 gives the data, σ = 1 the noise
    for value, expect in ((0.0, x0), (1.0, eps)):
        end = O.noisy_latents(_t(x0, device), _t(eps, device), _t(np.full(shape[0], value), device))
        np.testing.assert_array_equal(end.cpu().numpy(), expect)


def test_loss_value_and_gradient(device, rng):
    pred, target = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 4))
    p = _t(pred, device, requires_grad=True)
    loss = O.flow_matching_loss(p, _t(target, device))
    assert loss.dtype == flame.float32  # computed in float32 whatever the prediction dtype
    ref = np.mean((pred.astype(np.float32) - target.astype(np.float32)) ** 2, dtype=np.float64)
    assert loss.item() == pytest.approx(ref, rel=1e-6)
    loss.backward()
    np.testing.assert_allclose(p.grad.cpu().numpy(), 2 * (pred - target) / pred.size, rtol=1e-5, atol=1e-7)


def test_bf16_prediction_upcast(device, rng):
    pred = flame.tensor(rng.standard_normal((1, 4, 64)), dtype=flame.bfloat16, device=device)
    target = flame.tensor(rng.standard_normal((1, 4, 64)), dtype=flame.bfloat16, device=device)
    loss = O.flow_matching_loss(pred, target)
    ref = np.mean((pred.float().cpu().numpy().astype(np.float64) - target.float().cpu().numpy()) ** 2)
    assert loss.item() == pytest.approx(ref, rel=1e-5)


def test_shape_errors(device):
    a = flame.zeros(2, 3, device=device)
    with pytest.raises(ShapeError, match=r"\(2, 3\).*\(2, 4\)"):
        O.flow_matching_loss(a, flame.zeros(2, 4, device=device))
    with pytest.raises(ShapeError, match=r"sigma must have shape \(2,\)"):
        O.noisy_latents(a, a, flame.zeros(3, device=device))
