"""Chroma's timestep schedules as its references use them.

Training (lodestone-rock/flow, src/trainer/train_chroma.py and train_chroma_lora.py: create_distribution,
sample_from_distribution, prepare_sot_pairings): σ is drawn from a 1000-point grid on [0, 1] with probability
proportional to 2 − 7.7(σ − 0.5)² (the inverse of its CDF at a uniform u), with no shift (the shift line is commented
out there); x_t = (1 − σ)x0 + σε, target ε − x0. FLAME: train.timestep_type 'chroma', Chroma's default.
Sampling (flow's src/models/chroma/sampling.py get_schedule; diffusers' ChromaPipeline: calculate_shift; ComfyUI's
supported_models.Chroma -> model_base ModelType.FLUX -> ModelSamplingFlux with shift 1.15): t from 1 to 0 in N equal
steps, moved by e^μ / (e^μ + 1/t − 1) with μ linear in the image's token count, 0.5 at 256 tokens and 1.15 at 4096 --
ComfyUI's fixed 1.15 is that μ at 1024² (4096 tokens)."""
import math

import numpy as np
import pytest

import flame_core as flame
from flame_models.training.config import config_from_dict
from flame_models.training.family import get_family
from flame_models.training.timesteps import TIMESTEP_TYPES, sample_sigmas

GRID = np.linspace(0.0, 1.0, 1000)
DENSITY = 2.0 - 7.7 * (GRID - 0.5) ** 2


def test_chroma_draws_lodestones_density():
    assert "chroma" in TIMESTEP_TYPES
    s = sample_sigmas("chroma", 200_000, generator=flame.Generator("cpu").manual_seed(0), dtype=flame.float64).numpy()
    idx = np.rint(s * 999).astype(int)
    np.testing.assert_allclose(s, GRID[idx], atol=1e-12)           # only grid values
    counts = np.bincount(idx // 100, minlength=10) / len(s)        # ten bins of 100 grid points
    want = np.add.reduceat(DENSITY / DENSITY.sum(), np.arange(0, 1000, 100))
    np.testing.assert_allclose(counts, want, atol=4e-3)            # (binomial sd <= 1.1e-3)
    assert counts[0] < 0.35 * counts[4]                             # the tails are thin: not uniform, not sigmoid(n)
    assert 0.0 <= s.min() and s.max() <= 1.0


def test_chroma_draw_is_the_inverse_cdf_of_a_uniform():
    """The same u gives the same σ as the reference's searchsorted(cdf, u, right=True)."""
    g1, g2 = flame.Generator("cpu").manual_seed(3), flame.Generator("cpu").manual_seed(3)
    s = sample_sigmas("chroma", 64, generator=g1, dtype=flame.float64).numpy()
    u = flame.rand(64, generator=g2, dtype=flame.float64, device="cpu").numpy()
    cdf = np.cumsum(DENSITY / DENSITY.sum())
    want = GRID[np.minimum(np.searchsorted(cdf, u, side="right"), 999)]
    np.testing.assert_array_equal(s, want)


def _cfg(arch, **train):
    return config_from_dict({"name": "x", "training_folder": "/tmp/x", "device": "cpu",
                             "model": {"arch": arch, "name_or_path": None, "size": None},
                             "synthetic": {"num_samples": 2, "height": 64, "width": 64, "text_length": 8},
                             "train": dict({"steps": 1}, **train)}, check_files=False)


@pytest.mark.parametrize("arch, want", [("chroma", "chroma"), ("flux", "sigmoid")])
def test_chroma_trains_with_its_density_by_default(arch, want):
    cfg = _cfg(arch)
    assert cfg.train.timestep_type == want
    assert get_family(arch).objective(cfg.train).timestep_type == want
    assert _cfg(arch, timestep_type="logit_normal").train.timestep_type == "logit_normal"   # the user's choice wins


@pytest.mark.parametrize("size, steps", [(64, 4), (1024, 35)])
def test_chroma_samples_on_the_resolution_shifted_schedule(monkeypatch, size, steps):
    from flame_models.bfl.sampling import get_schedule
    from flame_models.chroma import pipeline as P
    seen = {}

    def fake_denoise(net, x, img_ids, txt, txt_ids, y, timesteps, guidance, cuda_graph, callback, sampler,
                     step_noise=None, inpaint=None):
        seen["t"], seen["tokens"] = list(timesteps), x.shape[1]
        return x
    monkeypatch.setattr(P, "denoise", fake_denoise)

    class Stub:   # what sample_latents reads of the model before denoise
        img_in = type("L", (), {"weight": flame.zeros(1, device="cpu")})()
        params = None
    cond = {"prompt_embeds": np.zeros((1, 8, 16), np.float32), "prompt_mask": np.ones((1, 8), np.float32)}
    P.sample_latents(Stub(), cond, None, height=size, width=size, steps=steps, seeds=[0])
    n = (size // 16) ** 2
    assert seen["tokens"] == n
    mu = 0.5 + (1.15 - 0.5) * (n - 256) / (4096 - 256)
    want = [math.exp(mu) / (math.exp(mu) + 1 / t - 1) if t > 0 else 0.0 for t in np.linspace(1, 0, steps + 1)]
    np.testing.assert_allclose(seen["t"], want, rtol=1e-12, atol=1e-15)
    if n == 4096:   # ComfyUI's Chroma: ModelSamplingFlux(shift=1.15) at every resolution
        comfy = [math.exp(1.15) / (math.exp(1.15) + 1 / t - 1) if t > 0 else 0.0 for t in np.linspace(1, 0, steps + 1)]
        np.testing.assert_allclose(seen["t"], comfy, rtol=1e-12, atol=1e-15)
    assert seen["t"] == get_schedule(steps, n)
