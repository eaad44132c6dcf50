"""The SD3 and SDXL pipelines on a GPU: the diffusers fixtures on cuda (float32 and bfloat16: encoding, whole CFG runs,
decoding; SD3's CUDA-graph sampling), fp8 / streamed denoisers, and generate() under a memory budget."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import load_file
from flame_models.generate import generate

pytestmark = pytest.mark.gpu
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
SD3 = os.path.join(FIXTURES, "sd3_pipeline")
SDXL = os.path.join(FIXTURES, "sdxl_pipeline")


def _golden(folder, meta_name):
    with open(os.path.join(folder, meta_name), encoding="utf-8") as f:
        meta = json.load(f)
    return {k: v.numpy() for k, v in load_file(os.path.join(folder, "golden.safetensors")).items()}, meta


def _rel(a, b):
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-12))


def _sdxl_configs(meta):
    from flame_models.sdxl import UNetConfig
    from flame_models.vae import VAEConfig
    c = meta["configs"]
    return {"unet": UNetConfig.from_diffusers_config(c["unet"]),
            "vae": VAEConfig.from_diffusers_config(c["vae"]).to_dict(), "clip_l": c["text_encoder"],
            "clip_g": c["text_encoder_2"]}


@pytest.mark.parametrize("dtype, tol", [(flame.float32, 5e-4), (flame.bfloat16, 6e-2)])
def test_sd3_fixture_on_cuda(dtype, tol):
    from flame_models.sd3.pipeline import (
        SkipLayerGuidance,
        decode_latents,
        find_sd3_files,
        load_text_encoders,
        load_transformer,
        load_vae_for_sd3,
        sample_latents,
    )
    g, meta = _golden(SD3, "prompts.json")
    files = find_sd3_files(os.path.join(SD3, "pipeline"))
    with load_text_encoders(files, dtype=dtype, device="cuda") as enc:
        pe, _, pooled, _ = enc.encode_prompt(meta["prompts"])
        assert _rel(pe.float().numpy(), g["prompt_embeds"]) < tol
        assert _rel(pooled.float().numpy(), g["pooled_prompt_embeds"]) < tol
        cond, neg = enc.encode(meta["prompts"][:1]), enc.encode([meta["negative"]])
    s = meta["slg"]
    slg = SkipLayerGuidance(layers=tuple(s["skip_guidance_layers"]), scale=s["skip_layer_guidance_scale"],
                            start=s["skip_layer_guidance_start"], stop=s["skip_layer_guidance_stop"])
    model = load_transformer(files, dtype=dtype, device="cuda")
    z = sample_latents(model, cond, neg, height=meta["height"], width=meta["width"], steps=s["num_inference_steps"],
                       cfg=s["guidance_scale"], latents=g["latents"], skip_layer_guidance=slg)   # CUDA graphs
    assert _rel(z.numpy(), g["slg_latents"]) < tol
    vae = load_vae_for_sd3(files, dtype=dtype, device="cuda")
    image = ((decode_latents(vae, z) / 2 + 0.5).clamp(0, 1)).float().numpy()
    # bf16: 0.071 at most (pixels in [0, 1]) after the 3 CFG + SLG steps on an H200
    assert np.abs(image - g["slg_image"]).max() < (2e-3 if dtype == flame.float32 else 1e-1)


@pytest.mark.parametrize("dtype, tol", [(flame.float32, 5e-4), (flame.bfloat16, 6e-2)])
def test_sdxl_fixture_on_cuda(dtype, tol):
    from flame_models.sdxl.pipeline import (
        decode_latents,
        find_sdxl_files,
        load_text_encoders,
        load_unet_for_sampling,
        load_vae_for_sdxl,
        sample_latents,
    )
    g, meta = _golden(SDXL, "meta.json")
    files = find_sdxl_files(os.path.join(SDXL, "sdxl_tiny.safetensors"), tokenizer=SDXL, configs=_sdxl_configs(meta))
    with load_text_encoders(files, dtype=dtype, device="cuda") as enc:
        pe, _, pooled, _ = enc.encode_prompt(meta["prompts"])
        assert _rel(pe.float().numpy(), g["prompt_embeds"]) < tol
        assert _rel(pooled.float().numpy(), g["pooled_prompt_embeds"]) < tol
        cond = enc.encode(meta["prompts"][:1])
        neg = enc.encode_negative(meta["prompts"][:1], meta["negative"])
    unet = load_unet_for_sampling(files, dtype=dtype, device="cuda")
    s = meta["sizes"]
    z = sample_latents(unet, cond, neg, height=meta["height"], width=meta["width"], steps=meta["steps"],
                       cfg=meta["cfg"], latents=g["latents"], original_size=s["original_size"],
                       crop_coords=s["crops_coords_top_left"], target_size=s["target_size"])
    assert _rel(z.numpy(), g["euler_latents"]) < tol
    vae = load_vae_for_sdxl(files, dtype=dtype, device="cuda")
    image = ((decode_latents(vae, z) / 2 + 0.5).clamp(0, 1)).float().numpy()
    assert np.abs(image - g["euler_image"]).max() < (2e-3 if dtype == flame.float32 else 6e-2)
    # a float16 VAE decodes in float32 (the SDXL VAE overflows in float16)
    vae16 = load_vae_for_sdxl(files, dtype=flame.float32, device="cuda").to(flame.float16)
    image16 = ((decode_latents(vae16, z) / 2 + 0.5).clamp(0, 1)).float().numpy()
    assert np.isfinite(image16).all() and np.abs(image16 - g["euler_image"]).max() < 6e-2


def test_streamed_and_fp8_denoisers_on_cuda():
    """Streaming moves bytes, not numbers: fp8 resident vs fp8 streamed give the same latents (SD3 and SDXL)."""
    from flame_models.sd3 import pipeline as P3
    from flame_models.sdxl import pipeline as PX
    g3, m3 = _golden(SD3, "prompts.json")
    f3 = P3.find_sd3_files(os.path.join(SD3, "pipeline"))
    with P3.load_text_encoders(f3, dtype=flame.float32, device="cuda") as enc:
        cond, neg = enc.encode(m3["prompts"][:1]), enc.encode([""])
    kw = dict(height=48, width=64, steps=3, cfg=4.0, latents=g3["latents"])
    a = P3.sample_latents(P3.load_transformer(f3, dtype=flame.bfloat16, device="cuda", fp8=True), cond, neg, **kw)
    b = P3.sample_latents(P3.load_transformer(f3, dtype=flame.bfloat16, device="cuda", fp8=True, stream=True), cond,
                          neg, **kw)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    gx, mx = _golden(SDXL, "meta.json")
    fx = PX.find_sdxl_files(os.path.join(SDXL, "sdxl_tiny.safetensors"), tokenizer=SDXL, configs=_sdxl_configs(mx))
    with PX.load_text_encoders(fx, dtype=flame.float32, device="cuda") as enc:
        cond = enc.encode(mx["prompts"][:1])
    kw = dict(height=64, width=96, steps=3, cfg=5.0, latents=gx["latents"])
    a = PX.sample_latents(PX.load_unet_for_sampling(fx, dtype=flame.bfloat16, device="cuda", fp8=True), cond, **kw)
    b = PX.sample_latents(PX.load_unet_for_sampling(fx, dtype=flame.bfloat16, device="cuda", fp8=True, stream=True),
                          cond, **kw)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu_exclusive
def test_generate_sd3_and_sdxl_under_a_budget_on_cuda(tmp_path):
    from flame_models.sdxl import load_sdxl, save_sdxl
    _, mx = _golden(SDXL, "meta.json")
    parts = load_sdxl(os.path.join(SDXL, "sdxl_tiny.safetensors"), tokenizer=SDXL, configs=_sdxl_configs(mx),
                      device="cpu")
    save_sdxl(parts, str(tmp_path / "sdxl"), layout="diffusers")
    budget = 256 * 2 ** 20
    for name, model, size in (("sd3", os.path.join(SD3, "pipeline"), (64, 48)), ("sdxl", str(tmp_path / "sdxl"),
                                                                                  (96, 64))):
        stats, out = {}, tmp_path / f"out_{name}"
        images = generate(model, ["a photo of a cat", "a house"], width=size[0], height=size[1], steps=3, seed=1,
                          device="cuda", fp8=True, max_gpu_memory=budget, negative_prompt="blurry", output=out,
                          stats=stats, progress=False)
        assert len(images) == 2 and len(os.listdir(out)) == 2
        for stage, s in stats.items():
            assert 0 < s["peak_bytes"] <= budget, (name, stage, s)
