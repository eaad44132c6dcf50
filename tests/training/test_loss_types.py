"""kohya's loss types (training/loss_types.py, train.loss_type): l1 / huber / smooth_l1 element losses against
kohya's formulas written here in NumPy, the thresholds' schedules (constant, exponential over 1000·σ or the DDPM
step, snr from ᾱ_t), through both objectives with masks and per-sample weights, a float64 gradient check, a tiny
run, and the config's refusals."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.autograd.gradcheck import gradcheck
from flame_models.samplers import DDPMSchedule
from flame_models.training.config import ConfigError
from flame_models.training.ddpm_objective import DDPM
from flame_models.training.loss_types import ElementLoss
from flame_models.training.objective import FlowMatching
from flame_models.training.trainer import Trainer

from .conftest import tiny_config


def _kohya(kind, d, c):
    c = np.asarray(c, np.float64).reshape((-1,) + (1,) * (d.ndim - 1)) if np.ndim(c) else c
    if kind == "l2":
        return d * d
    if kind == "l1":
        return np.abs(d)
    root = np.sqrt(d * d + c * c) - c
    return 2 * c * root if kind == "huber" else 2 * root


@pytest.mark.parametrize("kind", ["l2", "l1", "huber", "smooth_l1"])
def test_element_losses_are_kohyas(kind):
    rng = np.random.default_rng(0)
    d = rng.standard_normal((3, 4, 5)) * 0.5
    el = ElementLoss(kind, huber_c=0.2, huber_schedule="exponential")
    t = flame.tensor(np.array([0.0, 500.0, 1000.0], np.float32))
    c = el.threshold(t)
    if kind in ("huber", "smooth_l1"):
        np.testing.assert_allclose(c.numpy(), [1.0, 0.2 ** 0.5, 0.2], rtol=1e-6)
    else:
        assert c is None
    got = el(flame.tensor(d.astype(np.float32)), c).numpy()
    want = _kohya(kind, d, None if c is None else c.numpy())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_thresholds():
    t = flame.tensor(np.array([0.0, 250.0, 999.0], np.float32))
    assert ElementLoss("huber", huber_c=0.3, huber_scale=2.0).threshold(t) == pytest.approx(0.6)
    np.testing.assert_allclose(ElementLoss("smooth_l1", huber_c=0.1, huber_schedule="exponential",
                                           huber_scale=2.0).threshold(t).numpy(),
                               2.0 * 0.1 ** (np.array([0.0, 250.0, 999.0]) / 1000), rtol=1e-6)
    sched = DDPMSchedule(1000)
    steps = np.array([0, 250, 999])
    abar = np.asarray(sched.alphas_cumprod)[steps]
    sigma = np.sqrt((1 - abar) / abar)
    obj = DDPM(element=ElementLoss("huber", huber_c=0.1, huber_schedule="snr"))
    c = ElementLoss("huber", huber_c=0.1, huber_schedule="snr").threshold(t, obj._sigmas(t))
    np.testing.assert_allclose(c.numpy(), 0.9 / (1 + sigma) ** 2 + 0.1, rtol=1e-5)
    assert ElementLoss("l1").threshold(t) is None
    for bad in (dict(loss_type="l3"), dict(huber_schedule="cosine"), dict(huber_c=0.0), dict(huber_scale=-1)):
        with pytest.raises(ValueError):
            ElementLoss(**{"loss_type": "huber", **bad})
    with pytest.raises(ValueError, match="snr huber schedule is the DDPM objective's"):
        FlowMatching(element=ElementLoss("huber", huber_schedule="snr"))


def test_through_the_objectives_with_masks_and_weights():
    rng = np.random.default_rng(1)
    pred, target = (rng.standard_normal((2, 4, 3, 3)).astype(np.float32) for _ in range(2))
    mask = rng.uniform(0, 1, (2, 1, 3, 3)).astype(np.float32)
    sw = np.array([1.0, 0.5], np.float32)
    sigma = np.array([0.2, 0.9], np.float32)
    fm = FlowMatching("uniform", weighting_scheme="cosmap",
                      element=ElementLoss("huber", huber_c=0.1, huber_schedule="exponential"))
    got = fm.loss(flame.tensor(pred), flame.tensor(target), flame.tensor(sigma), mask=flame.tensor(mask),
                  sample_weights=flame.tensor(sw)).item()
    c = 0.1 ** sigma.astype(np.float64)
    w = 2 / (np.pi * (1 - 2 * sigma + 2 * sigma ** 2)) * sw
    per = (_kohya("huber", pred.astype(np.float64) - target, c) * mask).reshape(2, -1).mean(1)
    assert got == pytest.approx(float((per * w).mean()), rel=1e-5)
    dd = DDPM(element=ElementLoss("smooth_l1", huber_c=0.1, huber_schedule="snr"))
    t = np.array([10.0, 700.0], np.float32)
    got = dd.loss(flame.tensor(pred), flame.tensor(target), flame.tensor(t)).item()
    abar = np.asarray(dd.schedule.alphas_cumprod)[t.astype(int)]
    c = 0.9 / (1 + np.sqrt((1 - abar) / abar)) ** 2 + 0.1
    assert got == pytest.approx(float(_kohya("smooth_l1", pred.astype(np.float64) - target, c).mean()), rel=1e-5)
    l2 = FlowMatching("uniform", element=ElementLoss("l2"))          # l2 is the plain MSE, bit for bit
    assert l2.loss(flame.tensor(pred), flame.tensor(target), flame.tensor(sigma)).item() == \
        FlowMatching("uniform").loss(flame.tensor(pred), flame.tensor(target), flame.tensor(sigma)).item()


def test_the_huber_loss_gradient():
    rng = np.random.default_rng(2)
    pred = flame.tensor(rng.standard_normal((2, 3)), dtype=flame.float64, requires_grad=True)
    target = flame.tensor(rng.standard_normal((2, 3)), dtype=flame.float64)
    c = flame.tensor(np.array([0.1, 0.7]), dtype=flame.float64)
    el = ElementLoss("huber")
    assert gradcheck(lambda p: el(p - target, c).sum(), (pred,))
    assert gradcheck(lambda p: ElementLoss("smooth_l1")(p - target, 0.3).sum(), (pred,))


def test_a_run_with_the_huber_loss_and_the_refusals(tmp_path):
    runs = {}
    for kind in ("l2", "huber"):
        c = tiny_config(tmp_path, f"run_{kind}", steps=3, train={"loss_type": kind})
        runs[kind] = Trainer(c, verbose=False).setup().train()["losses"]
    assert np.isfinite(runs["huber"]).all() and runs["huber"][0] < runs["l2"][0]   # pseudo-Huber < MSE here
    for change, msg in (({"loss_type": "l4"}, "train.loss_type"),
                        ({"loss_type": "huber", "huber_c": 2}, r"train.huber_c: must be in \(0, 1\]"),
                        ({"huber_c": 0.2}, "train.huber_c: only used by loss_type huber / smooth_l1"),
                        ({"loss_type": "huber", "huber_schedule": "snr"}, "train.huber_schedule: snr is the DDPM"),
                        ({"loss_type": "smooth_l1", "huber_scale": 0}, "train.huber_scale: must be > 0")):
        with pytest.raises(ConfigError, match=msg):
            tiny_config(tmp_path, "bad", train=change)


def test_input_perturbation_noise(tmp_path, monkeypatch):
    """train.ip_noise_gamma (kohya's): the model's input is made with ε + γ·ξ, the target keeps ε; ξ is drawn after
    ε (a run without it draws what it drew before); a random strength stays in [0, γ)."""
    base = Trainer(tiny_config(tmp_path, "ip0", steps=3), verbose=False).setup()
    args0, _ = base._prepare(base.loader.next_batch())
    tr = Trainer(tiny_config(tmp_path, "ip", steps=3, train={"ip_noise_gamma": 0.1}), verbose=False).setup()
    args, t = tr._prepare(tr.loader.next_batch())
    assert len(args) == len(args0) + 1
    np.testing.assert_array_equal(args[1].numpy(), args0[1].numpy())           # ε: the same draw as without
    xi = (args[3].numpy() - args[1].numpy()) / 0.1
    assert abs(xi.std() - 1) < 0.1 and abs(np.corrcoef(xi.ravel(), args[1].numpy().ravel())[0, 1]) < 0.1
    seen = {}
    forward = tr.family.forward

    def spy(model, x_t, t_, cond):
        seen["x_t"] = x_t.detach().numpy().copy()
        return forward(model, x_t, t_, cond)
    # (monkeypatch: the family is the registry's one instance, shared by every later trainer in this process -- a
    # spy left on it read the model's input back to the host inside their CUDA graph captures, which then failed)
    monkeypatch.setattr(tr.family, "forward", spy)
    tr._forward_backward(*args)
    s = t.numpy().reshape((-1,) + (1,) * (args[0].ndim - 1))
    np.testing.assert_allclose(seen["x_t"], (1 - s) * args[0].numpy() + s * args[3].numpy(), rtol=1e-5, atol=1e-6)
    assert np.isfinite(tr.train()["losses"]).all()
    rnd = Trainer(tiny_config(tmp_path, "ipr", steps=3, train={"ip_noise_gamma": 0.5,
                                                                "ip_noise_gamma_random_strength": True}),
                  verbose=False).setup()
    a, _ = rnd._prepare(rnd.loader.next_batch())
    g = np.std(a[3].numpy() - a[1].numpy())
    assert 0 <= g < 0.5 * 1.2
    with pytest.raises(ConfigError, match="ip_noise_gamma_random_strength: only used with"):
        tiny_config(tmp_path, "bad", train={"ip_noise_gamma_random_strength": True})
    with pytest.raises(ConfigError, match="train.ip_noise_gamma: must be >= 0"):
        tiny_config(tmp_path, "bad", train={"ip_noise_gamma": -0.1})


@pytest.mark.parametrize("name, same", [("mse", "l2"), ("mae", "l1")])
def test_ai_toolkits_loss_type_names_are_kohyas_losses(tmp_path, name, same):
    from flame_models.training.config import config_from_dict
    c = config_from_dict({"name": "x", "training_folder": str(tmp_path), "synthetic": {"num_samples": 2},
                          "model": {"size": "flux-tiny"}, "train": {"loss_type": name}})
    assert c.train.loss_type == same
