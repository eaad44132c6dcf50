"""The SD3 text-to-image pipeline (flame_models.sd3.components / conditioning / pipeline): finding the parts (diffusers
folder, one SAI file, separate files), prompt encoding and whole CFG / skip-layer-guidance runs against diffusers'
StableDiffusion3Pipeline (tests/fixtures/make_sd3_pipeline_fixtures.py), LoRAs, and wrong parts named."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import load_file, safe_open, save_file
from flame_models.sd3 import load_sd3, save_sd3
from flame_models.sd3.pipeline import (
    SD3Files,
    SD3FilesError,
    SkipLayerGuidance,
    decode_latents,
    encode_images,
    find_sd3_files,
    load_text_encoders,
    load_transformer,
    load_vae_for_sd3,
    sample_latents,
)
from flame_models.text_encoders import load_clip, load_t5
from flame_models.vae import VAEConfig, load_vae, save_vae
from flame_nn import adapters as A

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "sd3_pipeline")
PIPELINE = os.path.join(FIXTURES, "pipeline")
F32 = flame.float32


@pytest.fixture(scope="module")
def golden():
    arrays = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "golden.safetensors")).items()}
    with open(os.path.join(FIXTURES, "prompts.json"), encoding="utf-8") as f:
        return arrays, json.load(f)


@pytest.fixture(scope="module")
def files():
    return find_sd3_files(PIPELINE)


def _config(sub):
    with open(os.path.join(PIPELINE, sub, "config.json")) as f:
        return json.load(f)


# the parts' configs, which a single file does not carry (the tiny widths are no released model's)
CONFIGS = {"clip_l": _config("text_encoder"), "clip_g": _config("text_encoder_2"), "t5": _config("text_encoder_3"),
           "vae": VAEConfig.from_diffusers_config(_config("vae")).to_dict()}


def _state(model, prefix):
    return {prefix + k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sai(tmp_path_factory):
    """The fixture's parts written as SAI's sd3.5 single file (and as separate ComfyUI-style files)."""
    d = tmp_path_factory.mktemp("sd3_sai")
    model = load_sd3(os.path.join(PIPELINE, "transformer"), dtype=F32, device="cpu")
    transformer = str(d / "mmdit.safetensors")
    save_sd3(model, transformer, layout="sai")
    with safe_open(transformer) as f:
        state = {k: f.get_array(k) for k in f.keys()}
    vae = str(d / "vae.safetensors")
    save_vae(load_vae(os.path.join(PIPELINE, "vae"), dtype=F32, device="cpu"), vae, layout="ldm")
    with safe_open(vae) as f:
        state.update({"first_stage_model." + k: f.get_array(k) for k in f.keys()})
    encoders = {"clip_l": load_clip(os.path.join(PIPELINE, "text_encoder"), device="cpu"),
                "clip_g": load_clip(os.path.join(PIPELINE, "text_encoder_2"), device="cpu"),
                "t5": load_t5(os.path.join(PIPELINE, "text_encoder_3"), device="cpu")}
    roots = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
             "t5": "text_encoders.t5xxl.transformer."}
    paths = {"vae": vae, "transformer": transformer}
    for part, m in encoders.items():
        state.update(_state(m, roots[part]))
        paths[part] = str(d / f"{part}.safetensors")
        save_file(_state(m, ""), paths[part])
    full = str(d / "sd3.5_tiny.safetensors")
    save_file(state, full)
    no_t5 = str(d / "sd3.5_tiny_no_t5.safetensors")
    save_file({k: v for k, v in state.items() if not k.startswith(roots["t5"])}, no_t5)
    paths.update(full=full, no_t5=no_t5)
    return paths


# ----------------------------------------------------------------------------- against diffusers
def test_diffusers_folder_is_found_part_by_part(files):
    f = files
    assert f.transformer == os.path.join(PIPELINE, "transformer")
    assert (f.vae, f.clip_l, f.clip_g, f.t5) == tuple(os.path.join(PIPELINE, s) for s in (
        "vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
    assert (f.clip_l_tokenizer, f.clip_g_tokenizer, f.t5_tokenizer) == tuple(os.path.join(PIPELINE, s) for s in (
        "tokenizer", "tokenizer_2", "tokenizer_3"))
    assert f.params.dual_attention_layers == (0,) and f.params.context_in_dim == 48 and f.params.pooled_in_dim == 40
    assert f.variant == "sd3.5-medium"


def test_prompt_encoding_matches_diffusers(files, golden):
    g, meta = golden
    prompts = meta["prompts"]
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        ids = enc.tokenize(prompts)
        for got, key in zip(ids, ("clip_l_ids", "clip_g_ids", "t5_ids")):
            np.testing.assert_array_equal(got, g[key])
        pe, npe, pooled, npooled = enc.encode_prompt(prompts)
        assert tuple(pe.shape) == (4, 77 + 256, 48) and tuple(pooled.shape) == (4, 40)
        tol = dict(rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(pe.numpy(), g["prompt_embeds"], **tol)
        np.testing.assert_allclose(pooled.numpy(), g["pooled_prompt_embeds"], **tol)
        for i in range(len(prompts)):   # negative_prompt None: "" for every prompt, as diffusers
            np.testing.assert_allclose(npe[i].numpy(), g["negative_prompt_embeds"][0], **tol)
            np.testing.assert_allclose(npooled[i].numpy(), g["negative_pooled_prompt_embeds"][0], **tol)
        _, npe, _, npooled = enc.encode_prompt(prompts[:2], negative_prompt=meta["negative"])
        np.testing.assert_allclose(npe[1].numpy(), g["neg_prompt_embeds_given"][0], **tol)
        np.testing.assert_allclose(npooled[1].numpy(), g["neg_pooled_given"][0], **tol)
        assert enc.encode_prompt(prompts[0], do_classifier_free_guidance=False)[1] is None
    with load_text_encoders(files, dtype=F32, device="cpu", max_length=77) as enc:
        np.testing.assert_allclose(enc.encode(prompts[:1])["prompt_embeds"].numpy(), g["prompt_embeds_77"], **tol)


def test_without_t5_the_t5_tokens_are_zeros(files, golden):
    g, meta = golden
    with load_text_encoders(files, dtype=F32, device="cpu", t5=False) as enc:
        assert enc.t5 is None and enc.tokenize("a cat")[2] is None
        out = enc.encode(meta["prompts"])
    pe = out["prompt_embeds"].numpy()
    assert pe.shape == (4, 333, 48) and not pe[:, 77:].any()
    np.testing.assert_allclose(pe[:, :77], g["no_t5_clip_embeds"], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(out["pooled_prompt_embeds"].numpy(), g["no_t5_pooled"], rtol=1e-4, atol=2e-5)
    assert enc.clip_l is None and enc.clip_g_tokenizer is None             # freed when the block was left
    with pytest.raises(RuntimeError, match="these SD3TextEncoders were freed"):
        enc.encode("a cat")
    enc.free()                                                             # twice is harmless


def _slg(meta):
    s = meta["slg"]
    return SkipLayerGuidance(layers=tuple(s["skip_guidance_layers"]), scale=s["skip_layer_guidance_scale"],
                             start=s["skip_layer_guidance_start"], stop=s["skip_layer_guidance_stop"])


def test_whole_pipeline_matches_diffusers(files, golden):
    g, meta = golden
    H, W, s = meta["height"], meta["width"], meta["slg"]
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        cond, neg = enc.encode(meta["prompts"][:1]), enc.encode([meta["negative"]])
    model = load_transformer(files, dtype=F32, device="cpu")
    kw = dict(height=H, width=W, steps=s["num_inference_steps"], cfg=s["guidance_scale"], latents=g["latents"])
    tol = dict(rtol=1e-4, atol=1e-3)   # float32 accumulation, cfg 4 amplifying the difference of two predictions
    z = sample_latents(model, cond, neg, skip_layer_guidance=_slg(meta), **kw)
    np.testing.assert_allclose(z.numpy(), g["slg_latents"], **tol)
    np.testing.assert_allclose(sample_latents(model, cond, neg, **kw).numpy(), g["cfg_latents"], **tol)
    nocfg = sample_latents(model, cond, height=H, width=W, steps=meta["nocfg"]["num_inference_steps"], cfg=1.0,
                           latents=g["latents"])
    np.testing.assert_allclose(nocfg.numpy(), g["nocfg_latents"], **tol)
    vae = load_vae_for_sd3(files, dtype=F32, device="cpu")
    image = ((decode_latents(vae, z) / 2 + 0.5).clamp(0, 1)).numpy()
    np.testing.assert_allclose(image, g["slg_image"], atol=3e-4)
    with pytest.raises(ValueError, match="needs the negative prompt"):
        sample_latents(model, cond, **kw)
    with pytest.raises(ValueError, match="not all joint blocks"):
        sample_latents(model, cond, neg, skip_layer_guidance=SkipLayerGuidance(), **kw)


def test_seeded_noise_is_per_image(files):
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        cond, neg = enc.encode(["a cat", "a dog"]), enc.encode([""])
    model = load_transformer(files, dtype=F32, device="cpu")
    kw = dict(height=32, width=48, steps=2, cfg=3.0)
    both = sample_latents(model, cond, neg, seeds=[5, 6], **kw).numpy()
    alone = sample_latents(model, cond, neg, seeds=[6], rows=[1], **kw).numpy()
    np.testing.assert_allclose(both[1:], alone, rtol=1e-5, atol=1e-6)
    assert not np.allclose(both[0], both[1])


def test_vae_uses_sd3_latent_format(files):
    vae = load_vae_for_sd3(files, dtype=F32, device="cpu")
    x = flame.tensor(np.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 48)).astype(np.float32), device="cpu")
    z = vae.encode(x).numpy()
    np.testing.assert_allclose(encode_images(vae, x).numpy(), (z - 0.0609) * 1.5305, rtol=1e-6, atol=1e-6)
    z_model = flame.tensor(((z - 0.0609) * 1.5305).astype(np.float32), device="cpu")
    want = vae.decode(flame.tensor(z, device="cpu")).numpy()
    np.testing.assert_allclose(decode_latents(vae, z_model).numpy(), want, rtol=1e-5, atol=1e-5)
    sampled = encode_images(vae, x, generator=flame.Generator("cpu").manual_seed(0)).numpy()
    assert 0 < np.abs(sampled - (z - 0.0609) * 1.5305).max()


# ----------------------------------------------------------------------------- single files
def test_sai_single_file_holds_every_part(sai, files, golden):
    g, meta = golden
    f = find_sd3_files(sai["full"], tokenizer=PIPELINE, configs=CONFIGS)
    assert f.transformer == f.vae == f.clip_l == f.clip_g == f.t5 == sai["full"]
    assert f.prefixes == {"vae": "first_stage_model.", "clip_l": "text_encoders.clip_l.transformer.",
                          "clip_g": "text_encoders.clip_g.transformer.", "t5": "text_encoders.t5xxl.transformer."}
    assert f.params.replace(sample_size=8) == files.params     # (sample_size: only a config.json tells it)
    with load_text_encoders(f, dtype=F32, device="cpu") as a, load_text_encoders(files, dtype=F32,
                                                                                   device="cpu") as b:
        ca, cb = a.encode(meta["prompts"][:2]), b.encode(meta["prompts"][:2])
    for k in ca:
        np.testing.assert_array_equal(ca[k].numpy(), cb[k].numpy())
    kw = dict(height=32, width=32, steps=2, cfg=2.0, seeds=[0])
    za = sample_latents(load_transformer(f, dtype=F32, device="cpu"), ca, ca, **kw).numpy()
    zb = sample_latents(load_transformer(files, dtype=F32, device="cpu"), cb, cb, **kw).numpy()
    np.testing.assert_array_equal(za, zb)
    vae = load_vae_for_sd3(f, dtype=F32, device="cpu")
    np.testing.assert_array_equal(decode_latents(vae, flame.tensor(za, device="cpu")).numpy(),
                                  decode_latents(load_vae_for_sd3(files, dtype=F32, device="cpu"),
                                                 flame.tensor(za, device="cpu")).numpy())


def test_sai_file_without_t5_and_separate_files(sai, golden):
    g, meta = golden
    f = find_sd3_files(sai["no_t5"], tokenizer=PIPELINE, configs=CONFIGS)
    assert f.t5 is None and f.t5_tokenizer is None
    with load_text_encoders(f, dtype=F32, device="cpu") as enc:
        out = enc.encode(meta["prompts"])
    np.testing.assert_allclose(out["prompt_embeds"].numpy()[:, :77], g["no_t5_clip_embeds"], rtol=1e-4, atol=2e-5)
    assert not out["prompt_embeds"].numpy()[:, 77:].any()
    # ComfyUI's separate files beside a transformer-only file; a T5 named adds it to the T5-less file
    sep = find_sd3_files(sai["transformer"], clip_l=sai["clip_l"], clip_g=sai["clip_g"], t5=sai["t5"],
                         vae=sai["vae"], tokenizer=PIPELINE, configs=CONFIGS)
    assert (sep.clip_l, sep.clip_g, sep.t5, sep.vae) == (sai["clip_l"], sai["clip_g"], sai["t5"], sai["vae"])
    assert find_sd3_files(sai["no_t5"], t5=sai["t5"], configs=CONFIGS).t5 == sai["t5"]


def test_missing_and_wrong_parts_are_listed(sai, tmp_path):
    with pytest.raises(SD3FilesError) as e:
        find_sd3_files(sai["transformer"])
    msg = str(e.value)
    for part, option in (("vae", "--vae"), ("clip_l", "--clip-l"), ("clip_g", "--clip-g")):
        assert f"{part}: missing -- {sai['transformer']} does not hold one; pass {option}" in msg
    assert "t5" not in msg and "3 problems" in msg           # T5 is optional
    with pytest.raises(SD3FilesError) as e:
        find_sd3_files(sai["transformer"], clip_l=sai["clip_l"], clip_g=sai["t5"], vae=sai["clip_l"],
                       t5=sai["vae"])
    msg = str(e.value)
    assert f"clip_g (--clip-g): {sai['t5']} is not a CLIP text encoder (CLIP-G): it looks like a T5" in msg
    assert f"vae (--vae): {sai['clip_l']} is not a VAE (autoencoder): it looks like a CLIP" in msg
    assert f"t5 (--t5): {sai['vae']} is not a T5 text encoder (T5-XXL): it looks like a VAE" in msg
    # parts of the right kind that do not fit: CLIP-L given twice (pooled 16 + 16 != 40), an SD-like VAE
    save_file({"decoder.conv_in.weight": np.zeros((16, 4, 3, 3), np.float32),
               "encoder.conv_in.weight": np.zeros((8, 3, 3, 3), np.float32)}, str(tmp_path / "sd_vae.safetensors"))
    with pytest.raises(SD3FilesError) as e:
        find_sd3_files(sai["transformer"], clip_l=sai["clip_l"], clip_g=sai["clip_l"],
                       vae=str(tmp_path / "sd_vae.safetensors"))
    msg = str(e.value)
    assert "pooled widths 16 + 16 != the MMDiT's pooled width 40" in msg
    assert "has 4 latent channels, but the MMDiT expects 16" in msg
    with pytest.raises(SD3FilesError, match="is not an SD3 / SD3.5 MMDiT: it looks like a CLIP"):
        find_sd3_files(sai["clip_l"])


def test_packaged_vocabulary_too_big_for_a_tiny_encoder_is_named(sai):
    f = find_sd3_files(sai["full"], configs=CONFIGS)
    assert f.clip_l_tokenizer is None
    with pytest.raises(SD3FilesError, match=r"clip_l: the tokenizer \(packaged:clip_merges.txt.gz\) has 49408 "
                                            r"tokens but the encoder .* embeds only 914"):
        load_text_encoders(f, dtype=F32, device="cpu")


# ----------------------------------------------------------------------------- LoRAs
@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    model = load_sd3(os.path.join(PIPELINE, "transformer"), dtype=F32, device="cpu")
    A.inject_adapters(model, ["joint_blocks.*"], rank=2, alpha=2.0)
    rng = np.random.default_rng(0)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(model):
            p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32), device="cpu"))
    d = tmp_path_factory.mktemp("sd3_lora")
    return {fmt: A.save_adapters(model, str(d / f"{fmt}.safetensors"), format=fmt) for fmt in ("kohya", "peft")}


def test_loras_merged_streamed_and_in_both_formats(files, lora):
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        cond, neg = enc.encode(["a cat"]), enc.encode([""])
    kw = dict(height=32, width=32, steps=2, cfg=3.0, seeds=[1])
    run = (lambda **m: sample_latents(load_transformer(files, dtype=F32, device="cpu", **m), cond, neg,
                                      **kw).numpy())
    base = run()
    np.testing.assert_allclose(run(loras=[f"{lora['kohya']}:0"]), base, rtol=1e-6, atol=1e-6)
    full = run(loras=[lora["kohya"]])
    assert np.abs(full - base).max() > 1e-2
    np.testing.assert_allclose(run(loras=[lora["peft"]]), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(loras=[lora["kohya"]], stream=True), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(SD3FilesError, match="not a LoRA file"):
        load_transformer(files, dtype=F32, device="cpu", loras=[os.path.join(PIPELINE, "vae",
                                                                             "diffusion_pytorch_model.safetensors")])
    assert isinstance(files, SD3Files)
