"""GradScaler: scaling, unscaling, skipping the step on inf/nan, the backoff/growth rule, errors, resume."""
import math

import numpy as np
import pytest

import flame_core as flame
from flame_core import amp, grad_pool


def _model(device, rng, dtype=flame.float32):
    w = flame.tensor(rng.standard_normal((4, 3)), dtype=dtype, device=device, requires_grad=True)
    x = flame.tensor(rng.standard_normal((5, 4)), dtype=dtype, device=device)
    return w, x


def _true_grad(x, w):
    """d sum((x w)^2) / dw in float64."""
    xa, wa = x.numpy().astype(np.float64), w.detach().numpy().astype(np.float64)
    return 2 * xa.T @ (xa @ wa)


def _loss(x, w):
    return ((x @ w) ** 2).sum()


def test_scale_multiplies_and_promotes_half_losses(device):
    s = amp.GradScaler(device.type, init_scale=2.0 ** 16)
    for dt in (flame.float16, flame.bfloat16):
        loss = flame.tensor(3.0, dtype=dt, device=device)
        out = s.scale(loss)
        assert out.dtype == flame.float32 and out.item() == 3.0 * 65536   # 196608 overflows float16
    a, b = s.scale([flame.tensor(1.0, device=device), flame.tensor(2.0, device=device)])
    assert (a.item(), b.item()) == (65536.0, 131072.0)
    with pytest.raises(TypeError, match="dict"):
        s.scale({"loss": loss})


def test_injected_inf_skips_the_step_and_backs_off(device, sgd):
    rng = np.random.default_rng(0)
    w, x = _model(device, rng)
    opt = sgd([w], lr=0.01)
    s = amp.GradScaler(device.type, init_scale=1024.0, growth_interval=100)
    for bad in (float("inf"), float("nan")):
        w0 = w.detach().numpy().copy()
        s.scale(_loss(x, w)).backward()
        w.grad._data[1, 2] = bad                       # inject
        assert s.step(opt) is None                       # skipped
        np.testing.assert_array_equal(w.detach().numpy(), w0)
        scale_before = s.get_scale()
        s.update()
        assert s.get_scale() == scale_before * 0.5
        opt.zero_grad()
    assert s.get_scale() == 256.0 and opt.steps == 0
    # a clean step afterwards: the optimizer sees the unscaled gradient
    w0 = w.detach().numpy().copy()
    g = _true_grad(x, w)
    s.scale(_loss(x, w)).backward()
    assert s.step(opt) == "stepped"
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.01 * g, rtol=1e-5, atol=1e-6)
    s.update()
    assert s.get_scale() == 256.0 and s.state_dict()["_growth_tracker"] == 1


def test_growth_after_interval_and_reset_by_inf(device, sgd):
    rng = np.random.default_rng(1)
    w, x = _model(device, rng)
    opt = sgd([w], lr=1e-4)
    s = amp.GradScaler(device.type, init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    scales = []
    for k in range(8):
        s.scale(_loss(x, w)).backward()
        if k == 4:
            w.grad._data[0, 0] = -float("inf")
        s.step(opt)
        s.update()
        opt.zero_grad()
        scales.append(s.get_scale())
    # clean, clean, grow, clean, inf (x0.25, tracker reset), clean, clean, grow
    assert scales == [8.0, 8.0, 32.0, 32.0, 8.0, 8.0, 8.0, 32.0]
    assert opt.steps == 7


def test_unscale_before_clipping_is_not_repeated_by_step(device, sgd):
    rng = np.random.default_rng(2)
    w, x = _model(device, rng)
    opt = sgd([w], lr=0.1)
    s = amp.GradScaler(device.type, init_scale=2.0 ** 10)
    g = _true_grad(x, w)
    w0 = w.detach().numpy().copy()
    s.scale(_loss(x, w)).backward()
    s.unscale_(opt)
    np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-5, atol=1e-5)
    norm = float(np.linalg.norm(g))
    w.grad._data *= 1.0 / norm                         # clip to unit norm, on unscaled gradients
    s.step(opt)
    np.testing.assert_allclose(w.detach().numpy(), w0 - 0.1 * g / norm, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt)
    s.update()
    s.scale(_loss(x, w)).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        s.step(opt, closure=lambda: None)


def test_update_needs_a_recorded_check_and_new_scale(device):
    s = amp.GradScaler(device.type)
    with pytest.raises(RuntimeError, match="No inf checks"):
        s.update()
    s.update(new_scale=123.0)
    assert s.get_scale() == 123.0
    s.update(new_scale=flame.tensor([7.0], device=device))
    assert s.get_scale() == 7.0
    for bad in (dict(growth_factor=1.0), dict(backoff_factor=1.5), dict(growth_interval=0), dict(init_scale=0)):
        with pytest.raises(ValueError):
            amp.GradScaler(device.type, **bad)


def test_state_dict_resumes_mid_interval(device, sgd):
    rng = np.random.default_rng(3)
    w, x = _model(device, rng)

    def run(scaler, opt, n):
        out = []
        for _ in range(n):
            scaler.scale(_loss(x, w)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(scaler.get_scale())
        return out
    opt = sgd([w], lr=1e-5)
    a = amp.GradScaler(device.type, init_scale=4.0, growth_interval=4)
    run(a, opt, 2)
    sd = a.state_dict()
    assert sd == {"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4,
                  "_growth_tracker": 2}
    b = amp.GradScaler(device.type)
    b.load_state_dict(sd)
    assert run(b, opt, 3) == [4.0, 8.0, 8.0]           # grows after the 4th clean step overall, not the 6th
    with pytest.raises(RuntimeError, match="empty"):
        b.load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        b.load_state_dict({k: v for k, v in sd.items() if k != "_growth_tracker"})


def test_disabled_scaler_is_a_pass_through(device, sgd):
    rng = np.random.default_rng(4)
    w, x = _model(device, rng)
    opt = sgd([w], lr=0.01)
    s = amp.GradScaler(device.type, enabled=False)
    loss = _loss(x, w)
    assert s.scale(loss) is loss and s.get_scale() == 1.0 and s.state_dict() == {}
    loss.backward()
    assert s.step(opt) == "stepped"
    s.update()


def test_scaling_rescues_gradients_that_underflow_in_float16(device, sgd):
    """A loss whose fp16 gradients underflow (1e-8 < fp16's smallest subnormal 6e-8): zero without scaling,
    the float64 reference with it."""
    rng = np.random.default_rng(5)
    w, x = _model(device, rng)
    x = x + 2.0
    ref = 1e-8 * np.tile(x.numpy().astype(np.float16).astype(np.float64).sum(0)[:, None], (1, 3))

    def backward(scaler):
        w.grad = None
        with amp.autocast(device.type, dtype=flame.float16):
            y = x @ w                                   # float16
        loss = y.float().sum() * 1e-8
        (scaler.scale(loss) if scaler else loss).backward()
    backward(None)
    assert np.all(w.grad.numpy() == 0.0)
    s = amp.GradScaler(device.type)
    backward(s)
    s.unscale_(sgd([w], lr=0.0))
    np.testing.assert_allclose(w.grad.numpy(), ref, rtol=2e-3)


def test_fp16_parameters_need_master_weights(device, sgd):
    rng = np.random.default_rng(6)
    w, x = _model(device, rng, dtype=flame.float16)
    s = amp.GradScaler(device.type, init_scale=2.0 ** 4)
    s.scale(_loss(x, w)).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        s.unscale_(sgd([w], lr=0.01))

    # with fp32 masters: the scaler unscales the masters' gradients and skips on inf like before
    w.grad = None
    opt = amp.MasterWeightOptimizer([w], sgd, lr=0.01)
    (m,) = opt.master_params()
    g = _true_grad(x, w)
    m0 = m.detach().numpy().copy()
    s.scale(_loss(x, w)).backward()
    assert s.step(opt) == "stepped"
    np.testing.assert_allclose(m.detach().numpy(), m0 - 0.01 * g, rtol=1e-2, atol=2e-3)
    np.testing.assert_array_equal(w.detach().numpy(), m.detach().numpy().astype(np.float16))
    s.update()
    opt.zero_grad()
    s.scale(_loss(x, w)).backward()
    w.grad._data[0, 0] = np.float16("inf")
    m1 = m.detach().numpy().copy()
    assert s.step(opt) is None
    np.testing.assert_array_equal(m.detach().numpy(), m1)
    s.update()
    assert s.get_scale() == 8.0
    assert math.isinf(float(w.grad.numpy()[0, 0]))


def test_unscale_handles_broadcast_gradients(device, sgd):
    """d sum(b) / db is a broadcast of one value: unscaling must still give every element its own value."""
    b = flame.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    s = amp.GradScaler(device.type, init_scale=64.0)
    s.scale(b.sum()).backward()
    opt = sgd([b], lr=0.5)
    s.step(opt)
    np.testing.assert_array_equal(b.grad.numpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(b.detach().numpy(), [0.5, 1.5, 2.5])


def test_pooled_gradients_are_unscaled_through_the_flat_buffer(device, sgd):
    rng = np.random.default_rng(7)
    w, x = _model(device, rng)
    v = flame.tensor(rng.standard_normal(3), device=device, requires_grad=True)
    grad_pool.register([w, v])
    try:
        opt = sgd([w, v], lr=0.01)
        s = amp.GradScaler(device.type, init_scale=512.0)
        g = _true_grad(x, w)
        w0, v0 = w.detach().numpy().copy(), v.detach().numpy().copy()
        s.scale(_loss(x, w) + (v * 3.0).sum()).backward()
        s.step(opt)
        np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v.grad.numpy(), [3.0, 3.0, 3.0], rtol=1e-6)
        np.testing.assert_allclose(w.detach().numpy(), w0 - 0.01 * g, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(v.detach().numpy(), v0 - 0.03, rtol=1e-6, atol=1e-6)
        s.update()
        grad_pool.zero_grad([w, v])
        s.scale(_loss(x, w)).backward()              # v gets no gradient: its zeroed view stays in the buffer
        v.grad._data[1] = float("nan")
        w1 = w.detach().numpy().copy()
        assert s.step(opt) is None
        np.testing.assert_array_equal(w.detach().numpy(), w1)
        s.update()
        assert s.get_scale() == 256.0
    finally:
        grad_pool.unregister([w, v])
