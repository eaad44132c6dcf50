"""The loss stage's weights: loss masks per latent pixel in each family's layout and regularisation images' weight,
exact against NumPy in float64; a mask that is zero on half the image gives that half no gradient."""
import numpy as np
import pytest

import flame_core as flame
from flame_core.errors import ShapeError
from flame_models.bfl.sampling import pack, unpack
from flame_models.training import loss_weights
from flame_models.training.ddpm_objective import DDPM
from flame_models.training.family import get_family
from flame_models.training.objective import FlowMatching


def _numpy_loss(pred, target, mask, w):
    """mean_b(w_b · mean over b's elements of m · (pred − target)²) in float64, on (B, C, h, w) latents."""
    sq = (pred.astype(np.float64) - target) ** 2 * mask
    return float(np.mean(sq.reshape(len(sq), -1).mean(axis=1) * w))


@pytest.mark.parametrize("objective", [FlowMatching(), FlowMatching(weighting_scheme="cosmap"),
                                       DDPM(min_snr_gamma=5.0), DDPM()], ids=["flow", "cosmap", "min_snr", "ddpm"])
@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl", "chroma", "flux_kontext", "qwen_image"])
def test_the_masked_and_weighted_loss_is_exact_in_each_familys_layout(arch, objective):
    fam = get_family(arch)
    rng = np.random.default_rng(0)
    B, C, h, w = 3, fam.latent_channels, 4, 6
    pred, target = (rng.standard_normal((B, C, h, w)).astype(np.float32) for _ in range(2))
    mask = rng.uniform(0, 1, (B, 1, h, w)).astype(np.float32)
    is_reg = np.array([False, True, True])
    batch = {"latents": target, "loss_mask": mask, "is_reg": is_reg}
    t = flame.tensor(np.array([0.2, 0.5, 0.9], np.float32) if isinstance(objective, FlowMatching)
                     else np.array([10.0, 500.0, 990.0], np.float32))
    packed = arch in ("flux", "chroma", "flux_kontext", "qwen_image")     # the layout training_inputs gives x0 in
    layout = (lambda a: pack(flame.tensor(a))) if packed else flame.tensor
    x0 = layout(target)
    weights = loss_weights.batch_weights(fam, batch, x0, reg_weight=0.25)
    assert tuple(weights["loss_weight"].numpy()) == (1.0, 0.25, 0.25)
    loss = objective.loss(layout(pred), x0, t, **loss_weights.split(weights)[1]).item()
    ow = objective.weights(t)
    ow = np.ones(B) if ow is None else ow.numpy().astype(np.float64)
    ref = _numpy_loss(pred, target, mask, ow * np.array([1.0, 0.25, 0.25]))
    assert loss == pytest.approx(ref, rel=2e-6)
    plain = objective.loss(layout(pred), x0, t).item()                # no weights: the plain loss as before
    assert plain == pytest.approx(_numpy_loss(pred, target, np.ones_like(mask), ow), rel=2e-6)
    assert abs(loss - plain) > 1e-3


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl"])
def test_a_mask_zero_on_half_the_image_gives_that_half_no_gradient(arch):
    fam = get_family(arch)
    rng = np.random.default_rng(1)
    B, C, h, w = 2, fam.latent_channels, 4, 8
    target = rng.standard_normal((B, C, h, w)).astype(np.float32)
    mask = np.ones((B, 1, h, w), np.float32)
    mask[..., : w // 2] = 0                                           # the left half does not count
    x0 = pack(flame.tensor(target)) if arch == "flux" else flame.tensor(target)
    pred = flame.tensor(rng.standard_normal(tuple(x0.shape)).astype(np.float32), requires_grad=True)
    w8 = loss_weights.batch_weights(fam, {"latents": target, "loss_mask": mask}, x0)
    loss = fam.objective(_train_cfg(arch)).loss(pred, x0, flame.tensor(np.array([0.5, 0.5], np.float32))
                                                if arch != "sdxl" else flame.tensor(np.array([5.0, 600.0],
                                                                                              np.float32)),
                                                **loss_weights.split(w8)[1])
    loss.backward()
    g = pred.grad
    g = (unpack(g, h * 8, w * 8) if arch == "flux" else g).numpy()    # back on the latent grid
    assert np.all(g[..., : w // 2] == 0)
    assert np.all(g[..., w // 2:] != 0)


def _train_cfg(arch):
    from flame_models.training.config import TrainSection
    t = TrainSection()
    if arch == "sdxl":
        t.noise_scheduler = "ddpm"
    return t


def test_a_mask_that_does_not_fit_the_latents_is_named():
    fam = get_family("sd3")
    lat = np.zeros((2, 16, 4, 4), np.float32)
    with pytest.raises(ShapeError, match=r"loss_mask \(2, 1, 4, 2\) does not fit latents \(2, 16, 4, 4\)"):
        loss_weights.batch_weights(fam, {"latents": lat, "loss_mask": np.ones((2, 1, 4, 2), np.float32)},
                                   flame.tensor(lat))
    assert loss_weights.batch_weights(fam, {"latents": lat}, flame.tensor(lat)) == {}   # nothing asked: nothing
