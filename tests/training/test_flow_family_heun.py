"""The flow-matching families' previews with sample.sampler 'heun', 'dpmpp_2m' or 'unipc'
(training/family_base.FlowSamplerPreviews): Flux, Flux Kontext (with and without a control image), Chroma, Qwen-Image
and SD3 accept them, pass them to their samplers, and their latents differ from Euler's while Euler's stay what they
were (the default)."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.training.config import TrainConfig
from flame_models.training.family import get_family


def _cfg(sampler):
    cfg = TrainConfig()
    cfg.sample.sampler = sampler
    return cfg


@pytest.mark.parametrize("name", ["flux", "flux_kontext", "chroma", "qwen_image", "sd3"])
def test_families_accept_heun_and_dpmpp_2m_and_pass_them_on(name):
    fam = get_family(name)
    assert "heun" in fam.samplers and "euler" in fam.samplers and "dpmpp_2m" in fam.samplers
    assert fam.sample_options(_cfg("heun"))["sampler"] == "heun"
    assert fam.sample_options(_cfg("dpmpp_2m"))["sampler"] == "dpmpp_2m"
    assert "unipc" in fam.samplers and fam.sample_options(_cfg("unipc"))["sampler"] == "unipc"
    assert fam.sample_options(_cfg("dpmpp_2m_sde"))["sampler"] == "dpmpp_2m_sde"
    assert fam.sample_options(_cfg(None))["scheduler"] == "simple"
    cfg = _cfg("heun")
    cfg.sample.scheduler = "beta"
    assert fam.sample_options(cfg) == {"sampler": "heun", "scheduler": "beta"}
    assert fam.sample_options(_cfg("flowmatch"))["sampler"] == "euler"
    assert fam.sample_options(_cfg(None))["sampler"] == "euler"


@pytest.mark.parametrize("name, size, control", [("flux", "flux-tiny", False), ("flux_kontext", "flux-tiny", False),
                                                  ("flux_kontext", "flux-tiny", True),
                                                  ("chroma", "chroma-tiny", False),
                                                  ("qwen_image", "qwen-image-tiny", False)])
def test_heun_and_dpmpp_2m_previews_run_and_differ_from_euler(name, size, control):
    fam = get_family(name)
    flame.manual_seed(0)
    model = fam.model_class(size).eval()
    spec = fam.preset(size)
    rng = np.random.default_rng(0)
    cond = {k: rng.standard_normal(shape).astype(np.float32)
            for k, shape in fam.synthetic_conditioning(spec, 6).items() if k != "prompt_mask"}
    if "prompt_mask" in fam.sample_keys:
        cond["prompt_mask"] = np.ones(6, dtype=bool)
    if control:
        cond["control_latents"] = rng.standard_normal((fam.latent_channels, 4, 4)).astype(np.float32)
    kw = dict(height=32, width=32, steps=3, guidance=1.0, seed=1, device=model.img_in.weight.device)
    with flame.no_grad():
        euler = fam.sample(model, cond, sampler="euler", **kw).numpy()
        default = fam.sample(model, cond, **kw).numpy()
        heun = fam.sample(model, cond, sampler="heun", **kw).numpy()
        # DPM++ 2M's first-order steps are Euler's (flow_step's docstring) and its first second-order term is 0 after
        # sigma 1: it departs from Euler from the third of four steps
        kw["steps"] = 4
        dpm = fam.sample(model, cond, sampler="dpmpp_2m", **kw).numpy()
        unipc = fam.sample(model, cond, sampler="unipc", **kw).numpy()    # (its corrector: apart from step 2 on)
        sde = fam.sample(model, cond, sampler="dpmpp_2m_sde", **kw).numpy()   # (noise from the preview's seed)
        np.testing.assert_array_equal(fam.sample(model, cond, sampler="dpmpp_2m_sde", **kw).numpy(), sde)
        euler4 = fam.sample(model, cond, **kw).numpy()
        karras = fam.sample(model, cond, scheduler="karras", **kw).numpy()   # Euler on the respaced sigmas
        assert np.isfinite(karras).all() and np.abs(karras - euler4).max() > 1e-6
        np.testing.assert_array_equal(fam.sample(model, cond, scheduler="simple", **kw).numpy(), euler4)
    np.testing.assert_array_equal(euler, default)
    for other, base in ((heun, euler), (dpm, euler4), (unipc, euler4), (unipc, dpm), (sde, dpm)):
        assert np.isfinite(other).all() and other.shape == base.shape
        assert np.abs(other - base).max() > 1e-6


@pytest.mark.parametrize("module, label, extra", [("flame_models.chroma.generate", "Chroma", {}),
                                                  ("flame_models.flux_kontext.generate", "Flux Kontext",
                                                   {"image": "ref.png"}),
                                                  ("flame_models.flux.generate", "Flux", {}),
                                                  ("flame_models.qwen_image.generate", "Qwen-Image", {}),
                                                  ("flame_models.sd3.generate", "SD3", {})])
def test_generate_refuses_the_sdxl_samplers_before_loading_anything(module, label, extra):
    import importlib

    from flame_models.generate import GenerateError
    gen = importlib.import_module(module)
    assert "sampler" in gen.OPTIONS
    with pytest.raises(GenerateError,
                       match=f"--sampler ddim: {label} samples with euler, heun, dpmpp_2m, dpmpp_2m_sde or unipc"):
        gen.generate("no/such/model", "a cat", sampler="ddim", **extra)
