"""bf16 parameters with float32 master weights in the optimizer: small updates accumulate, exact resume."""
import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
from flame_core import amp

BF16 = ml_dtypes.bfloat16


def _params(device, rng):
    w = flame.tensor(rng.uniform(0.55, 2.0, (6, 3)), dtype=flame.bfloat16, device=device, requires_grad=True)
    b = flame.tensor(rng.standard_normal(3), dtype=flame.float32, device=device, requires_grad=True)
    return w, b


def test_updates_below_bf16_resolution_accumulate_in_the_master(device, sgd):
    rng = np.random.default_rng(0)
    w, b = _params(device, rng)
    w_plain = w.detach().clone().requires_grad_(True)
    opt = amp.MasterWeightOptimizer([w, b], sgd, lr=1e-3)
    plain = sgd([w_plain], lr=1e-3)
    (m,) = opt.master_params()
    assert m.dtype == flame.float32 and opt.param_groups[0]["params"][1] is b   # fp32 params are not copied
    ref = w.detach().float().numpy().copy()                                      # float32 SGD, by hand
    for _ in range(60):
        for p in (w, w_plain):
            p.grad = flame.ones(6, 3, dtype=flame.bfloat16, device=device)
        opt.step()
        plain.step()
        ref = ref - np.float32(1e-3) * np.float32(1.0)
    np.testing.assert_array_equal(m.detach().numpy(), ref)                         # the master is exact fp32 SGD
    np.testing.assert_array_equal(w.detach().numpy(), ref.astype(BF16))            # the model holds its rounding
    start = w_plain.detach().float().numpy()
    assert np.abs(w.detach().float().numpy() - start).max() > 0.03                 # moved by 60 * 1e-3
    # plain bf16 SGD: 1e-3 is below half a bf16 step at these magnitudes (2**-9 for |w| > 0.5): no movement
    np.testing.assert_array_equal(w_plain.detach().float().numpy(), start)


def test_gradients_are_copied_as_float32_and_zero_grad_clears(device, sgd):
    rng = np.random.default_rng(1)
    w, b = _params(device, rng)
    opt = amp.MasterWeightOptimizer([{"params": [w], "lr": 0.5}, {"params": [b]}], sgd, lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    x = flame.tensor(rng.standard_normal((4, 6)), dtype=flame.bfloat16, device=device)
    ((x @ w).float().sum() + b.sum()).backward()
    opt.sync_grads()
    (m,) = opt.master_params()
    assert m.grad.dtype == flame.float32
    np.testing.assert_array_equal(m.grad.numpy(), w.grad.float().numpy())
    buf = m.grad
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert w.grad is not None and np.all(w.grad.float().numpy() == 0) and np.all(b.grad.numpy() == 0)
    ((x @ w).float().sum()).backward()
    opt.sync_grads()
    assert m.grad is buf                                   # the float32 gradient buffer is reused
    opt.zero_grad()
    assert w.grad is None and m.grad is None and b.grad is None


def test_state_dict_gives_an_exact_resume(device, sgd):
    rng = np.random.default_rng(2)
    x = flame.tensor(rng.standard_normal((8, 6)), dtype=flame.bfloat16, device=device)

    def train(opt, w, steps):
        for _ in range(steps):
            ((x @ w).float() ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

    w, _ = _params(device, np.random.default_rng(3))
    opt = amp.MasterWeightOptimizer([w], sgd, lr=1e-3, momentum=0.9)
    train(opt, w, 3)
    sd = opt.state_dict()
    train(opt, w, 4)
    final = (w.detach().numpy().copy(), opt.master_params()[0].detach().numpy().copy())

    w2, _ = _params(device, np.random.default_rng(99))           # different start: everything comes from sd
    opt2 = amp.MasterWeightOptimizer([w2], sgd, lr=1e-3, momentum=0.9)
    opt2.load_state_dict(sd)
    np.testing.assert_array_equal(w2.detach().numpy(), sd["master"][0].astype(BF16))
    train(opt2, w2, 4)
    np.testing.assert_array_equal(w2.detach().numpy(), final[0])
    np.testing.assert_array_equal(opt2.master_params()[0].detach().numpy(), final[1])

    with pytest.raises(ValueError, match="1 master weights in the state dict, 2"):
        w3, w4 = _params(device, rng)[0], _params(device, rng)[0]
        amp.MasterWeightOptimizer([w3, w4], sgd, lr=1e-3).load_state_dict(sd)
    with pytest.raises(TypeError, match="iterable"):
        amp.MasterWeightOptimizer(w, sgd, lr=1.0)
