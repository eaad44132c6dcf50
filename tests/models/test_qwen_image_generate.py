"""Qwen-Image's sampler through the placements generate uses -- resident, fp8 storage, blocks streamed (every one:
the auto-fit of a tiny model keeps them all resident, so generate's own budget path never streams one), fp8 and
streamed -- from the same starting latents, on the test device (cuda with FLAME_DEVICE=cuda); `latents=` as the
other families' samplers take it, the start that is the same on every device (a seed's noise is not: the cpu draws
from PCG64, cuda from Philox)."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.bfl.sampling import get_noise
from flame_models.pipeline import load_for_sampling
from flame_models.qwen_image import sampling as S
from flame_models.qwen_image.loading import load_qwen_image

STACKS = ("transformer_blocks",)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from flame_models.qwen_image.tiny import tiny_qwen_image_folder
    return tiny_qwen_image_folder(tmp_path_factory.mktemp("qwen_gen") / "Qwen-Image-tiny", seed=1)


def _cond(seed=0):
    rng = np.random.default_rng(seed)
    pos = {"prompt_embeds": rng.normal(size=(1, 9, 48)).astype(np.float32), "prompt_mask": np.ones((1, 9), np.float32)}
    pos["prompt_mask"][0, 7:] = 0                                    # two padded tokens: the mask is used
    neg = {"prompt_embeds": rng.normal(size=(1, 5, 48)).astype(np.float32), "prompt_mask": np.ones((1, 5), np.float32)}
    return pos, neg


def _model(folder, device, **how):
    return load_for_sampling(lambda d: load_qwen_image(f"{folder}/transformer", dtype=flame.float32, device=d),
                             f"{folder}/transformer", [], STACKS, device, **how)


def test_streamed_and_fp8_blocks_sample_as_the_resident_model(folder, device):
    pos, neg = _cond()
    z0 = np.random.default_rng(3).standard_normal((1, 16, 6, 8)).astype(np.float32)
    kw = dict(height=48, width=64, steps=3, cfg=3.0, latents=z0)
    want = S.sample_latents(_model(folder, device), pos, neg, **kw).numpy()
    streamed = _model(folder, device, stream=True)
    assert "0 resident" in str(streamed.streamer) and "2 streamed" in str(streamed.streamer)
    got = S.sample_latents(streamed, pos, neg, **kw).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    fp8 = S.sample_latents(_model(folder, device, fp8=True), pos, neg, **kw).numpy()
    assert 0 < np.abs(fp8 - want).max() < 0.05 * np.abs(want).max()            # e4m3 rounding of the blocks only
    both = S.sample_latents(_model(folder, device, fp8=True, stream=True), pos, neg, **kw).numpy()
    np.testing.assert_allclose(both, fp8, rtol=1e-5, atol=1e-5)


def test_given_latents_are_the_seeds_noise_and_are_checked(folder):
    pos, _ = _cond()
    model = _model(folder, "cpu")
    kw = dict(height=48, width=64, steps=2)
    by_seed = S.sample_latents(model, pos, seeds=[5], **kw).numpy()
    noise = get_noise(1, 48, 64, seed=5, device="cpu")
    np.testing.assert_array_equal(S.sample_latents(model, pos, latents=noise, **kw).numpy(), by_seed)
    np.testing.assert_array_equal(S.sample_latents(model, pos, latents=noise.numpy(), **kw).numpy(), by_seed)
    with pytest.raises(ValueError, match="exactly one of seeds"):
        S.sample_latents(model, pos, seeds=[5], latents=noise, **kw)
    with pytest.raises(ValueError, match="do not fit a 48x64 image"):
        S.sample_latents(model, pos, latents=np.zeros((1, 16, 8, 8), np.float32), **kw)


def test_generate_runs_its_stages_one_after_another_under_a_budget(folder, monkeypatch):
    """--max-gpu-memory: the text encoder's layers streamed and fitted (auto_fit), then the transformer's (here
    every block streamed: the budget holds none resident), then the VAE; each stage's pool peak within the budget,
    the picture the unconstrained run's; --fp8 with it stores both stacks in fp8."""
    from flame_models.generate import generate
    from flame_models.text_encoders import qwen2_5_vl
    common = dict(width=64, height=48, steps=3, seed=2, negative_prompt="blurry", cfg=3.0, progress=False,
                  device="cpu")
    want = np.asarray(generate(folder, "a red square", log=lambda *a: None, **common)[0])
    lines, stats = [], {}
    budget = 5 * 2 ** 20
    got = np.asarray(generate(folder, "a red square", max_gpu_memory=f"{budget}B", stats=stats, log=lines.append,
                              **common)[0])
    np.testing.assert_array_equal(got, want)
    text = "\n".join(map(str, lines))
    assert "text encoder auto-fit for max_gpu_memory 5.00 MiB" in text
    assert "auto-fit for max_gpu_memory 5.00 MiB: 0 blocks resident (0 B), 2 streamed" in text
    assert list(stats) == ["text encoders", "transformer", "vae"]
    assert all(0 < s["peak_bytes"] <= budget for s in stats.values()), stats
    placed = []
    load = qwen2_5_vl.load_qwen2_5_vl

    def spy(*a, **kw):
        placed.append((kw.get("quantize"), kw.get("stream")))
        return load(*a, **kw)
    monkeypatch.setattr(qwen2_5_vl, "load_qwen2_5_vl", spy)
    fp8 = np.asarray(generate(folder, "a red square", fp8=True, max_gpu_memory=f"{budget}B", log=lambda *a: None,
                              **common)[0], np.float32)
    assert placed == [("fp8", True)]
    assert np.abs(fp8 - want).mean() < 2.0


def _guided(model, pos, neg, device):
    """c(x, s): the guided, rescaled velocity (cfg 3) of a 48 x 64 image at sigma s, at the pipeline's timestep."""
    txt = flame.tensor(pos["prompt_embeds"], device=device)
    mask = flame.tensor(pos["prompt_mask"], device=device)
    ntxt = flame.tensor(neg["prompt_embeds"], device=device)     # (its mask: all ones, passed as None as the pipeline)
    shapes = [[(1, 3, 4)]]

    def c(x, s):
        t = flame.full((1,), float(np.float32(s * 1000)) / 1000, device=device)
        return S.guided_velocity(model(x, txt, mask, t, shapes), model(x, ntxt, None, t, shapes), 3.0).float()
    return c


def test_heun_steps_with_the_guided_velocity_at_both_sigmas(folder, device):
    """sampler="heun": each step x + ds (c(x, s) + c(x + ds c(x, s), s')) / 2 of the guided, rescaled velocity c at the
    pipeline's sigmas and timesteps, the last step Euler's -- written out here with the model; Euler unchanged."""
    from flame_models.bfl.sampling import pack, unpack
    pos, neg = _cond()
    model = _model(folder, device)
    z0 = np.random.default_rng(4).standard_normal((1, 16, 6, 8)).astype(np.float32)
    kw = dict(height=48, width=64, steps=3, cfg=3.0, latents=z0)
    got = S.sample_latents(model, pos, neg, sampler="heun", **kw).numpy()
    c = _guided(model, pos, neg, device)
    sig = S.sigmas(3, 12)
    x = pack(flame.tensor(z0, device=device))
    with flame.no_grad():
        for i in range(3):
            ds = sig[i + 1] - sig[i]
            v = c(x, sig[i])
            x = x + ds * v if i == 2 else x + ds * (0.5 * (v + c(x + ds * v, sig[i + 1])))
    want = unpack(x, 48, 64).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    euler = S.sample_latents(model, pos, neg, **kw).numpy()
    np.testing.assert_array_equal(S.sample_latents(model, pos, neg, sampler="euler", **kw).numpy(), euler)
    assert np.abs(got - euler).max() > 1e-4
    with pytest.raises(ValueError, match="unknown flow-matching sampler 'ddim'"):
        S.sample_latents(model, pos, neg, sampler="ddim", **kw)


def test_dpmpp_2m_steps_with_the_guided_velocity(folder, device):
    """sampler="dpmpp_2m": DPM-Solver++(2M) on the data prediction x - s c(x, s) of the guided, rescaled velocity at
    the pipeline's sigmas -- written out here in diffusers' form (lambda = log((1 - s) / s), D1 = (m0 - m1) / r0),
    first order at the first and last steps; 5 steps, so the second-order term acts."""
    from flame_models.bfl.sampling import pack, unpack
    pos, neg = _cond()
    model = _model(folder, device)
    z0 = np.random.default_rng(5).standard_normal((1, 16, 6, 8)).astype(np.float32)
    kw = dict(height=48, width=64, steps=5, cfg=3.0, latents=z0)
    got = S.sample_latents(model, pos, neg, sampler="dpmpp_2m", **kw).numpy()
    c = _guided(model, pos, neg, device)

    def lam(s):
        return np.log(1 - s) - np.log(s) if s < 1 else -np.inf
    sig = [float(v) for v in S.sigmas(5, 12)]
    assert sig[0] == 1.0 and sig[-1] == 0.0
    x = pack(flame.tensor(z0, device=device))
    prev = None
    with flame.no_grad():
        for i in range(5):
            s, s2 = sig[i], sig[i + 1]
            m0 = x - s * c(x, s)
            if s2 == 0.0:
                x = m0
            else:
                h = lam(s2) - lam(s)
                a = (1 - s2) * (np.exp(-h) - 1.0)
                x = (s2 / s) * x - a * m0
                if prev is not None and np.isfinite(lam(sig[i - 1])):
                    r0 = (lam(s) - lam(sig[i - 1])) / h
                    x = x - 0.5 * a * ((m0 - prev) * (1.0 / r0))
            prev = m0
    want = unpack(x, 48, 64).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    euler = S.sample_latents(model, pos, neg, **kw).numpy()
    assert np.abs(got - euler).max() > 1e-4
