"""The SDXL text-to-image pipeline (flame_models.sdxl.components / parts / conditioning / pipeline): the parts of one
SAI file, load_sdxl / save_sdxl both ways, prompt encoding and whole runs against diffusers'
StableDiffusionXLPipeline (tests/fixtures/make_sdxl_pipeline_fixtures.py), kohya's long-caption chunks, the VAE's
float16 rule, and wrong or missing parts named."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import load_file, safe_open, save_file
from flame_models.sdxl import SDXLParts, UNetConfig, load_sdxl, save_sdxl, save_unet
from flame_models.sdxl.pipeline import (
    SDXLFilesError,
    check_loras,
    decode_latents,
    encode_images,
    find_sdxl_files,
    load_text_encoders,
    load_unet_for_sampling,
    load_vae_for_sdxl,
    sample_latents,
)
from flame_models.vae import VAEConfig
from flame_nn import adapters as A

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "sdxl_pipeline")
SAI = os.path.join(FIXTURES, "sdxl_tiny.safetensors")
F32 = flame.float32


@pytest.fixture(scope="module")
def golden():
    arrays = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "golden.safetensors")).items()}
    with open(os.path.join(FIXTURES, "meta.json"), encoding="utf-8") as f:
        return arrays, json.load(f)


def _configs():
    """The parts' configs (the tiny widths, group counts and head size are no released model's: the SAI file,
    made by diffusers, carries none)."""
    with open(os.path.join(FIXTURES, "meta.json"), encoding="utf-8") as f:
        c = json.load(f)["configs"]
    return {"unet": UNetConfig.from_diffusers_config(c["unet"]),
            "vae": VAEConfig.from_diffusers_config(c["vae"]).to_dict(), "clip_l": c["text_encoder"],
            "clip_g": c["text_encoder_2"]}


@pytest.fixture(scope="module")
def files():
    return find_sdxl_files(SAI, tokenizer=FIXTURES, configs=_configs())


@pytest.fixture(scope="module")
def parts(files):
    return load_sdxl(files, dtype=F32, device="cpu")


# ----------------------------------------------------------------------------- the SAI file
def test_sai_file_parts_and_prefixes(files):
    assert files.unet == files.vae == files.clip_l == files.clip_g == SAI
    assert files.prefixes == {"vae": "first_stage_model.", "clip_l": "conditioner.embedders.0.transformer.",
                              "clip_g": "conditioner.embedders.1.model."}
    assert (files.clip_l_tokenizer, files.clip_g_tokenizer) == (os.path.join(FIXTURES, "tokenizer"),
                                                                os.path.join(FIXTURES, "tokenizer_2"))
    c = files.config
    assert (c.context_dim, c.adm_in_channels, c.pooled_dim, c.transformer_depth) == (40, 80, 32, (0, 1, 2))


def test_without_configs_the_unet_that_shapes_cannot_describe_is_named():
    with pytest.raises(SDXLFilesError) as e:
        find_sdxl_files(SAI, tokenizer=FIXTURES)
    msg = str(e.value)
    assert f"unet (--model): {SAI}" in msg and "norm_num_groups" in msg


def test_load_sdxl_gives_every_part(parts):
    from flame_models.text_encoders import CLIPTextModel, CLIPTextModelWithProjection
    assert type(parts.unet).__name__ == "SDXLUNet" and parts.vae.config.z_channels == 4
    assert type(parts.clip_l) is CLIPTextModel and isinstance(parts.clip_g, CLIPTextModelWithProjection)
    assert parts.clip_g_tokenizer.pad_token == "!" and parts.clip_l_tokenizer.pad_token == "<|endoftext|>"
    assert parts.unet.dtype == F32 and not any(p.requires_grad for p in parts.unet.parameters())


def test_load_sdxl_reads_only_the_parts_asked(files, parts):
    vae_only = load_sdxl(files, dtype=F32, device="cpu", parts=("vae",))
    assert vae_only.unet is None and vae_only.clip_l is None and vae_only.clip_g is None
    assert vae_only.clip_l_tokenizer is not None and vae_only.clip_g_tokenizer is not None
    want = dict(parts.vae.state_dict())
    for k, v in vae_only.vae.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k].numpy(), err_msg=k)
    with pytest.raises(ValueError, match="parts must be among"):
        load_sdxl(files, parts=("vae", "t5"))


# ----------------------------------------------------------------------------- against diffusers
def test_prompt_encoding_matches_diffusers(files, golden):
    g, meta = golden
    prompts = meta["prompts"]
    tol = dict(rtol=1e-4, atol=2e-5)
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        ids_l, ids_g = enc.tokenize(prompts)
        np.testing.assert_array_equal(ids_l, g["clip_l_ids"])
        np.testing.assert_array_equal(ids_g, g["clip_g_ids"])
        pe, npe, pooled, npooled = enc.encode_prompt(prompts)
        assert tuple(pe.shape) == (4, 77, 40) and tuple(pooled.shape) == (4, 32)
        np.testing.assert_allclose(pe.numpy(), g["prompt_embeds"], **tol)
        np.testing.assert_allclose(pooled.numpy(), g["pooled_prompt_embeds"], **tol)
        assert tuple(npe.shape) == (4, 77, 40) and not npe.numpy().any() and not npooled.numpy().any()
        neg = enc.encode_negative(prompts[:2], meta["negative"])
        np.testing.assert_allclose(neg["prompt_embeds"].numpy()[1], g["neg_prompt_embeds_given"][0], **tol)
        np.testing.assert_allclose(neg["pooled_prompt_embeds"].numpy()[1], g["neg_pooled_given"][0], **tol)
    with load_text_encoders(files, dtype=F32, device="cpu", force_zeros_for_empty_prompt=False) as enc:
        neg = enc.encode_negative(prompts[:1])
        np.testing.assert_allclose(neg["prompt_embeds"].numpy(), g["neg_prompt_embeds_empty"], **tol)
        np.testing.assert_allclose(neg["pooled_prompt_embeds"].numpy(), g["neg_pooled_empty"], **tol)


def test_whole_pipeline_matches_diffusers(files, golden):
    g, meta = golden
    H, W, s = meta["height"], meta["width"], meta["sizes"]
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(meta["prompts"][:1])
        neg = enc.encode_negative(meta["prompts"][:1], meta["negative"])
    unet = load_unet_for_sampling(files, dtype=F32, device="cpu")
    kw = dict(height=H, width=W, steps=meta["steps"], cfg=meta["cfg"], latents=g["latents"])
    tol = dict(rtol=1e-4, atol=3e-4)
    z = sample_latents(unet, cond, neg, original_size=s["original_size"], crop_coords=s["crops_coords_top_left"],
                       target_size=s["target_size"], **kw)
    np.testing.assert_allclose(z.numpy(), g["euler_latents"], **tol)
    np.testing.assert_allclose(sample_latents(unet, cond, None, **kw).numpy(), g["zeros_latents"], **tol)
    np.testing.assert_allclose(sample_latents(unet, cond, neg, sampler="ddim", **kw).numpy(), g["ddim_latents"],
                               **tol)
    vae = load_vae_for_sdxl(files, dtype=F32, device="cpu")
    image = ((decode_latents(vae, z) / 2 + 0.5).clamp(0, 1)).numpy()
    np.testing.assert_allclose(image, g["euler_image"], atol=1e-4)


def test_seeds_are_per_image_for_every_sampler(files):
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(["a cat", "a dog"])
    unet = load_unet_for_sampling(files, dtype=F32, device="cpu")
    for sampler in ("euler", "euler_ancestral"):
        kw = dict(height=32, width=64, steps=2, cfg=3.0, sampler=sampler, scheduler="karras")
        both = sample_latents(unet, cond, seeds=[5, 6], **kw).numpy()
        alone = sample_latents(unet, cond, seeds=[6], rows=[1], **kw).numpy()
        np.testing.assert_allclose(both[1:], alone, rtol=1e-5, atol=1e-5)
        assert not np.allclose(both[0], both[1])
    with pytest.raises(ValueError, match="sampler 'lms'"):
        sample_latents(unet, cond, seeds=[1, 2], height=32, width=64, steps=2, cfg=3.0, sampler="lms")


def test_long_captions_in_kohya_chunks(files, golden):
    """max_token_length 150: two 77-token chunks per caption, states joined into 152; the first chunk of a long
    caption is its usual truncation, so the first 76 states and the pooled vector are the usual ones."""
    g, meta = golden
    prompts = [meta["prompts"][0], meta["prompts"][3]]
    with load_text_encoders(files, dtype=F32, device="cpu", max_token_length=150) as enc:
        ids_l, ids_g = enc.tokenize(prompts)
        assert ids_l.shape == ids_g.shape == (4, 77)
        np.testing.assert_array_equal(ids_l[[0, 2]], g["clip_l_ids"][[0, 3]])
        np.testing.assert_array_equal(ids_g[[0, 2]], g["clip_g_ids"][[0, 3]])
        bos, eos = 912, 913
        # an empty chunk: BOS then padding, with EOS after BOS where the pad is not EOS (CLIP-G's "!")
        np.testing.assert_array_equal(ids_l[1], [bos] + [eos] * 76)
        np.testing.assert_array_equal(ids_g[1], [bos, eos] + [0] * 75)
        # the long caption's second chunk: the next 75 content tokens, then EOS
        assert ids_l[3, 0] == bos and ids_l[3, -1] == eos and eos not in ids_l[3, 1:-1]
        assert ids_g[3, -1] == eos and 0 not in ids_g[3]
        out = enc.encode(prompts)
    pe = out["prompt_embeds"].numpy()
    assert pe.shape == (2, 152, 40)
    tol = dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(pe[:, :76], g["prompt_embeds"][[0, 3], :76], **tol)
    np.testing.assert_allclose(out["pooled_prompt_embeds"].numpy(), g["pooled_prompt_embeds"][[0, 3]], **tol)
    assert np.abs(pe[1, 76:] - pe[0, 76:]).max() > 1e-3     # the long caption's second chunk is not padding
    with pytest.raises(ValueError, match="multiple of 75"):
        load_text_encoders(files, dtype=F32, device="cpu", max_token_length=100)


def test_vae_latent_format_and_float16(files):
    vae32 = load_vae_for_sdxl(files, dtype=F32, device="cpu")
    x = flame.tensor(np.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32), device="cpu")
    z = vae32.encode(x).numpy()
    np.testing.assert_allclose(encode_images(vae32, x).numpy(), z * 0.13025, rtol=1e-6, atol=1e-6)
    latents = flame.tensor((z * 0.13025).astype(np.float32), device="cpu")
    want = decode_latents(vae32, latents).numpy()
    np.testing.assert_allclose(want, vae32.decode(flame.tensor(z, device="cpu")).numpy(), rtol=1e-5, atol=1e-5)
    assert load_vae_for_sdxl(files, dtype=flame.float16, device="cpu").dtype == F32
    # a float16 VAE decodes in float32 (the stored weights are float16-exact, so the numbers are the float32 VAE's)
    vae16 = vae32.to(flame.float16)
    got = decode_latents(vae16, latents)
    assert got.dtype == F32 and vae16.dtype == flame.float16
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- load_sdxl / save_sdxl
def test_sai_round_trip_equals_the_reference_file(parts, tmp_path):
    out = str(tmp_path / "sdxl.safetensors")
    assert save_sdxl(parts, out, layout="sai") == [out]
    with safe_open(SAI) as a, safe_open(out) as b:
        ka, kb = set(a.keys()), set(b.keys())
        assert ka - kb == {"conditioner.embedders.0.transformer.text_model.embeddings.position_ids"}   # a buffer
        assert kb <= ka
        for k in sorted(ka & kb - {"conditioner.embedders.1.model.logit_scale"}):   # (not a text-tower weight)
            np.testing.assert_array_equal(b.get_array(k), a.get_array(k).astype(np.float32), err_msg=k)
    # FLAME's file carries every config: it loads without them
    back = load_sdxl(out, device="cpu", tokenizer=FIXTURES)
    assert back.files.config == parts.files.config
    assert back.clip_g.config.to_dict() == parts.clip_g.config.to_dict()
    assert back.vae.config == parts.vae.config


def _same_weights(a, b):
    for name in ("unet", "vae", "clip_l", "clip_g"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert sorted(sa) == sorted(sb), name
        for k in sa:
            np.testing.assert_array_equal(sa[k].numpy(), sb[k].numpy(), err_msg=f"{name}.{k}")


def test_diffusers_round_trip(parts, tmp_path, golden):
    folder = tmp_path / "sdxl"
    assert save_sdxl(parts, str(folder), layout="diffusers") == [str(folder)]
    names = sorted(os.listdir(folder))
    assert names == ["model_index.json", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                     "unet", "vae"]
    with open(folder / "vae" / "config.json") as f:
        assert json.load(f)["scaling_factor"] == 0.13025
    back = load_sdxl(str(folder), device="cpu")
    assert isinstance(back, SDXLParts) and back.files.clip_g_tokenizer == str(folder / "tokenizer_2")
    _same_weights(parts, back)
    g, meta = golden
    with load_text_encoders(back.files, dtype=F32, device="cpu") as enc:
        np.testing.assert_allclose(enc.encode(meta["prompts"])["prompt_embeds"].numpy(), g["prompt_embeds"],
                                   rtol=1e-4, atol=2e-5)
    # nothing half-written: an existing folder is refused before any work, no temporary folder is left
    with pytest.raises(FileExistsError, match="not an empty folder"):
        save_sdxl(parts, str(folder), layout="diffusers")
    assert sorted(os.listdir(tmp_path)) == ["sdxl"]
    with pytest.raises(ValueError, match="one .safetensors file"):
        save_sdxl(parts, str(tmp_path / "x"), layout="sai")
    with pytest.raises(ValueError, match="layout must be"):
        save_sdxl(parts, str(tmp_path / "x.safetensors"), layout="comfy")


# ----------------------------------------------------------------------------- parts missing, wrong, not fitting
@pytest.fixture(scope="module")
def single(parts, tmp_path_factory):
    """The fixture's parts as separate files: a UNet, the VAE, CLIP-L, CLIP-G (OpenCLIP names)."""
    from flame_models.sdxl.parts import openclip_state
    from flame_models.vae import save_vae
    d = tmp_path_factory.mktemp("sdxl_single")
    p = {k: str(d / f"{k}.safetensors") for k in ("unet", "vae", "clip_l", "clip_g")}
    save_unet(parts.unet, p["unet"], layout="sai")
    save_vae(parts.vae, p["vae"], layout="ldm")
    save_file({k: v.numpy() for k, v in parts.clip_l.state_dict().items()}, p["clip_l"])
    save_file({k: v.numpy() for k, v in openclip_state(parts.clip_g).items()}, p["clip_g"])
    return p


def test_separate_files_and_a_missing_clip_g(single, parts, golden):
    c = {k: v for k, v in _configs().items() if k != "unet"}
    f = find_sdxl_files(single["unet"], vae=single["vae"], clip_l=single["clip_l"], clip_g=single["clip_g"],
                        tokenizer=FIXTURES, configs=c)
    assert f.config == parts.files.config and f.prefixes == {"vae": "", "clip_l": "", "clip_g": ""}
    g, meta = golden
    with load_text_encoders(f, dtype=F32, device="cpu") as enc:
        np.testing.assert_allclose(enc.encode(meta["prompts"][:1])["pooled_prompt_embeds"].numpy(),
                                   g["pooled_prompt_embeds"][:1], rtol=1e-4, atol=2e-5)
    with pytest.raises(SDXLFilesError) as e:
        find_sdxl_files(single["unet"], vae=single["vae"], clip_l=single["clip_l"], tokenizer=FIXTURES, configs=c)
    msg = str(e.value)
    assert f"clip_g: missing -- {single['unet']} does not hold one; pass --clip-g (a CLIP text encoder (CLIP-G))" \
        in msg
    assert "clip_l" not in msg and "vae" not in msg


def test_wrong_parts_are_named(single, tmp_path):
    c = {k: v for k, v in _configs().items() if k != "unet"}
    with pytest.raises(SDXLFilesError) as e:   # CLIP-L given as CLIP-G (no projection, widths 16 + 16 != 40)
        find_sdxl_files(single["unet"], vae=single["clip_g"], clip_l=single["clip_l"], clip_g=single["clip_l"],
                        configs=c)
    msg = str(e.value)
    assert f"vae (--vae): {single['clip_g']} is not a VAE (autoencoder): it looks like a CLIP" in msg
    assert "widths 16 + 16 != the UNet's context width 40" in msg
    assert f"clip_g (--clip-g): {single['clip_l']} has no text projection" in msg
    flux_vae = str(tmp_path / "ae.safetensors")
    save_file({"decoder.conv_in.weight": np.zeros((16, 16, 3, 3), np.float32),
               "encoder.conv_in.weight": np.zeros((8, 3, 3, 3), np.float32)}, flux_vae)
    with pytest.raises(SDXLFilesError, match="has 16 latent channels, but the UNet expects 4"):
        find_sdxl_files(SAI, vae=flux_vae, configs=_configs())
    with pytest.raises(SDXLFilesError, match="is not an SDXL UNet: it looks like a VAE"):
        find_sdxl_files(single["vae"])


# ----------------------------------------------------------------------------- LoRAs
def test_loras_kohya_and_peft_merged_or_streamed(files, parts, tmp_path):
    unet = load_unet_for_sampling(files, dtype=F32, device="cpu")
    A.inject_adapters(unet, ["to_q", "to_k", "to_v", "to_out.0"], rank=2, alpha=2.0)
    rng = np.random.default_rng(0)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(unet):
            p.copy_(flame.tensor(rng.normal(0, 0.5, tuple(p.shape)).astype(np.float32), device="cpu"))
    kohya = A.save_adapters(unet, str(tmp_path / "kohya.safetensors"), format="kohya")
    peft = A.save_adapters(unet, str(tmp_path / "peft.safetensors"), format="peft")
    with safe_open(peft) as f:
        assert all(k.startswith("unet.") for k in f.keys())
    cond = {"prompt_embeds": np.ones((1, 77, 40), np.float32) * 0.1,
            "pooled_prompt_embeds": np.ones((1, 32), np.float32) * 0.1}
    kw = dict(height=32, width=32, steps=2, cfg=1.0, seeds=[1])
    run = (lambda **m: sample_latents(load_unet_for_sampling(files, dtype=F32, device="cpu", **m), cond,
                                      **kw).numpy())
    base = run()
    np.testing.assert_allclose(run(loras=[f"{kohya}:0"]), base, rtol=1e-6, atol=1e-6)
    full = run(loras=[kohya])
    assert np.abs(full - base).max() > 1e-2
    np.testing.assert_allclose(run(loras=[peft]), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(loras=[kohya], stream=True), full, rtol=1e-5, atol=1e-5)
    te = str(tmp_path / "te.safetensors")
    with safe_open(kohya) as f:
        sd = {k: f.get_array(k) for k in f.keys()}
    sd["lora_te3_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = np.zeros((2, 16), np.float32)
    save_file(sd, te)
    with pytest.raises(SDXLFilesError, match="text encoder this model does not have"):   # SD3's T5 part
        load_unet_for_sampling(files, dtype=F32, device="cpu", loras=[te])


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_text_encoder_loras_are_merged_into_clip_l_and_clip_g(files, tmp_path, fmt):
    """kohya lora_te1_ / lora_te2_ and diffusers text_encoder. / text_encoder_2. parts of an SDXL LoRA file change
    CLIP-L / CLIP-G as the adapters do; the UNet part loads beside them; a TE part that fits no layer is named."""
    from flame_core.io import save_file as save
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        base = {k: v.numpy() for k, v in enc.encode(["a red cube"]).items()}
        rng = np.random.default_rng(3)
        sd = {}
        for comp, clip in (("te1", enc.clip_l), ("te2", enc.clip_g)):
            A.inject_adapters(clip, ["q_proj", "fc1"], rank=2, alpha=1.0)
            with flame.no_grad():
                for _, p in A.named_adapter_parameters(clip):
                    p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32)))
            one = A.save_adapters(clip, str(tmp_path / f"{comp}.safetensors"), format=fmt)
            with safe_open(one) as f:
                for k in f.keys():   # the encoder's own names, under the component's prefix
                    if fmt == "kohya":
                        sd[("lora_te1_" if comp == "te1" else "lora_te2_") + k[len("lora_unet_"):]] = f.get_array(k)
                    else:
                        body = k.split(".", 1)[1]
                        sd[("text_encoder." if comp == "te1" else "text_encoder_2.") + body] = f.get_array(k)
        want = {k: v.numpy() for k, v in enc.encode(["a red cube"]).items()}
    assert all(np.abs(want[k] - base[k]).max() > 1e-3 for k in want)
    unet = load_unet_for_sampling(files, dtype=F32, device="cpu")
    A.inject_adapters(unet, ["to_q"], rank=2, alpha=2.0)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(unet):
            p.copy_(flame.tensor(rng.normal(0, 0.5, tuple(p.shape)).astype(np.float32)))
    unet_file = A.save_adapters(unet, str(tmp_path / "unet.safetensors"), format=fmt)
    with safe_open(unet_file) as f:
        sd.update({k: f.get_array(k) for k in f.keys()})
    path = str(tmp_path / f"all_{fmt}.safetensors")
    save(sd, path)
    loras = check_loras([path], files.config)
    with load_text_encoders(files, dtype=F32, device="cpu", loras=loras) as enc:
        got = {k: v.numpy() for k, v in enc.encode(["a red cube"]).items()}
        assert not A.adapter_names(enc.clip_l)                           # merged into the weights
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
    with load_text_encoders(files, dtype=F32, device="cpu", loras=[(path, 0.0)]) as enc:
        for k, v in enc.encode(["a red cube"]).items():
            np.testing.assert_allclose(v.numpy(), base[k], rtol=1e-6, atol=1e-6)
    load_unet_for_sampling(files, dtype=F32, device="cpu", loras=[path])   # the UNet part, the TE parts left out
    bad = dict(sd)
    key = next(k for k in sd if ("te2" in k or "text_encoder_2" in k) and ("lora_down" in k or "lora_A" in k))
    bad[key] = np.concatenate([sd[key], sd[key]], axis=1)
    save(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(SDXLFilesError, match="bad.safetensors"):
        load_text_encoders(files, dtype=F32, device="cpu", loras=[(str(tmp_path / "bad.safetensors"), 1.0)])


def test_locon_loras_apply_merged_or_streamed(files, tmp_path):
    """A LoRA with convolution adapters (LoCon) is applied by the SDXL generator: merged into the conv weights, or
    kept as adapters beside streamed blocks, both giving the adapted model's numbers; a wrong kernel is refused."""
    from flame_models.sdxl import CONV_TARGETS
    unet = load_unet_for_sampling(files, dtype=F32, device="cpu")
    A.inject_adapters(unet, ["to_q"], rank=2, alpha=2.0)
    A.inject_adapters(unet, CONV_TARGETS + ["re:.*skip_connection", "input_blocks.0.0"], rank=2, alpha=1.0,
                      name="default2")
    rng = np.random.default_rng(1)
    with flame.no_grad():
        for name in ("default", "default2"):
            for _, p in A.named_adapter_parameters(unet, name):
                p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32), device="cpu"))
    path = A.save_adapters(unet, str(tmp_path / "locon.safetensors"), format="kohya", name="default2")
    with safe_open(path) as f:
        keys = list(f.keys())
        assert f.get_array("lora_unet_input_blocks_0_0.lora_down.weight").shape[2:] == (3, 3)
    A.remove_adapters(unet, "default")
    cond = {"prompt_embeds": np.ones((1, 77, 40), np.float32) * 0.1,
            "pooled_prompt_embeds": np.ones((1, 32), np.float32) * 0.1}
    kw = dict(height=32, width=32, steps=2, cfg=1.0, seeds=[1])
    want = sample_latents(unet, cond, **kw).numpy()
    A.disable_adapters(unet)
    base = sample_latents(unet, cond, **kw).numpy()
    assert np.abs(want - base).max() > 1e-2
    run = (lambda **m: sample_latents(load_unet_for_sampling(files, dtype=F32, device="cpu", **m), cond,
                                      **kw).numpy())
    np.testing.assert_allclose(run(loras=[path]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(loras=[path], stream=True), want, rtol=1e-5, atol=1e-5)
    with safe_open(path) as f:
        sd = {k: f.get_array(k) for k in keys}
    sd["lora_unet_input_blocks_0_0.lora_down.weight"] = sd["lora_unet_input_blocks_0_0.lora_down.weight"][:, :, :1, :1]
    bad = str(tmp_path / "bad.safetensors")
    save_file(sd, bad)
    with pytest.raises(SDXLFilesError, match=r"input_blocks.0.0 has a \(1, 1\) kernel, the convolution's is \(3, 3\)"):
        load_unet_for_sampling(files, dtype=F32, device="cpu", loras=[bad])
