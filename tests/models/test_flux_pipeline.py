"""The Flux text-to-image pipeline (flame_models.flux.pipeline): finding the parts, prompt encoding, the whole
pipeline, against diffusers' FluxPipeline (tests/fixtures/make_flux_pipeline_fixtures.py) and against the parts run
by hand."""
import json
import os
import shutil

import numpy as np
import pytest

import flame_core as flame
from flame_core.io import load_file, safe_open, save_file
from flame_models.flux import pack
from flame_models.flux.layers import timestep_embedding
from flame_models.flux.pipeline import (
    FluxFiles,
    FluxFilesError,
    decode_latents,
    encode_images,
    find_flux_files,
    load_text_encoders,
    load_transformer,
    load_vae_for_flux,
    sample_latents,
    to_pil,
)
from flame_models.flux.tiny import tiny_flux_files
from flame_models.text_encoders import load_clip, load_t5
from flame_models.tokenization import load_tokenizer
from flame_models.vae import save_vae

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "flux_pipeline")
PIPELINE = os.path.join(FIXTURES, "pipeline")
F32 = flame.float32


@pytest.fixture(scope="module")
def golden():
    with safe_open(os.path.join(FIXTURES, "golden.safetensors")) as f:
        meta = f.metadata()
    arrays = {k: v.numpy() for k, v in load_file(os.path.join(FIXTURES, "golden.safetensors")).items()}
    with open(os.path.join(FIXTURES, "prompts.json"), encoding="utf-8") as f:
        prompts = json.load(f)
    return arrays, meta, prompts


@pytest.fixture(scope="module")
def ref_files():
    return find_flux_files(PIPELINE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_flux_files(tmp_path_factory.mktemp("tiny") / "flux", seed=3)


# ----------------------------------------------------------------------------- against diffusers
def test_diffusers_folder_is_found_part_by_part(ref_files):
    f = ref_files
    assert f.transformer == os.path.join(PIPELINE, "transformer")
    assert (f.vae, f.clip_l, f.t5) == tuple(os.path.join(PIPELINE, s) for s in ("vae", "text_encoder",
                                                                                  "text_encoder_2"))
    assert (f.clip_tokenizer, f.t5_tokenizer) == (os.path.join(PIPELINE, "tokenizer"),
                                                  os.path.join(PIPELINE, "tokenizer_2"))
    assert f.params.guidance_embed and f.params.depth == 1 and f.params.context_in_dim == 32
    assert f.t5_max_length == 512


def test_prompt_encoding_matches_diffusers(ref_files, golden):
    g, _, prompts = golden
    with load_text_encoders(ref_files, dtype=F32, device="cpu") as enc:
        clip_ids, t5_ids = enc.tokenize(prompts)
        np.testing.assert_array_equal(clip_ids, g["clip_ids"])
        np.testing.assert_array_equal(t5_ids, g["t5_ids_512"])
        out = enc.encode(prompts, batch_size=3)
        assert out["prompt_embeds"].dtype == F32
        assert tuple(out["prompt_embeds"].shape) == (len(prompts), 512, 32)
        np.testing.assert_allclose(out["prompt_embeds"].numpy(), g["prompt_embeds_512"], rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(out["pooled_prompt_embeds"].numpy(), g["pooled_prompt_embeds"], rtol=1e-4,
                                   atol=2e-5)
    with load_text_encoders(ref_files, dtype=F32, device="cpu", max_length=256) as enc:
        two = [prompts[0], prompts[-1]]
        np.testing.assert_array_equal(enc.tokenize(two)[1], g["t5_ids_256"])
        np.testing.assert_allclose(enc.encode(two)["prompt_embeds"].numpy(), g["prompt_embeds_256"], rtol=1e-4,
                                   atol=2e-5)


def test_whole_pipeline_matches_diffusers(ref_files, golden):
    g, meta, prompts = golden
    H, W, steps, guidance = int(meta["height"]), int(meta["width"]), int(meta["steps"]), float(meta["guidance"])
    with load_text_encoders(ref_files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(prompts[:1])
    model = load_transformer(ref_files, dtype=F32, device="cpu")
    z = sample_latents(model, cond, height=H, width=W, steps=steps, guidance=guidance, latents=g["latents"])
    assert tuple(z.shape) == (1, 16, H // 8, W // 8)
    np.testing.assert_allclose(pack(z).numpy(), g["out_latents"], rtol=1e-4, atol=1e-4)
    vae = load_vae_for_flux(ref_files, dtype=F32, device="cpu")
    images = decode_latents(vae, z)
    np.testing.assert_allclose(((images / 2 + 0.5).clamp(0, 1)).numpy(), g["out_image"], atol=2e-4)
    pil = to_pil(images)
    got = np.stack([np.asarray(p) for p in pil]).astype(int)
    assert pil[0].size == (W, H) and pil[0].mode == "RGB"
    diff = np.abs(got - g["out_pil"].astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01   # rounding at .5 boundaries only


def test_seeded_noise_is_per_image(ref_files, golden):
    """Image i starts from get_noise(seed_i) whatever the batch: a batch of two equals the two alone."""
    g, _, prompts = golden
    with load_text_encoders(ref_files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(prompts[:2])
    model = load_transformer(ref_files, dtype=F32, device="cpu")
    kw = dict(height=32, width=48, steps=2, guidance=2.0)
    both = sample_latents(model, cond, seeds=[5, 6], **kw).numpy()
    alone = sample_latents(model, cond, seeds=[6], rows=[1], **kw).numpy()
    np.testing.assert_allclose(both[1:], alone, rtol=1e-5, atol=1e-6)
    assert not np.allclose(both[0], both[1])
    with pytest.raises(ValueError, match="exactly one of seeds"):
        sample_latents(model, cond, **kw)
    with pytest.raises(ValueError, match="guidance"):
        sample_latents(model, cond, seeds=[1], height=32, width=48, steps=1)


# ----------------------------------------------------------------------------- against the parts run by hand
def test_encoding_equals_the_parts_by_hand(tiny):
    prompts = ["a red square", "an ohwx toy on a wooden table, close up"]
    clip = load_clip(tiny.clip_l, dtype=F32, device="cpu")
    t5 = load_t5(tiny.t5, dtype=F32, device="cpu")
    ctok = load_tokenizer("clip_l", tiny.clip_tokenizer)
    ttok = load_tokenizer("t5", tiny.t5_tokenizer, max_length=512)
    want_pooled = clip(ctok(prompts).input_ids).pooler_output.numpy()
    want_txt = t5(ttok(prompts).input_ids).last_hidden_state.numpy()
    enc = load_text_encoders(tiny, dtype=F32, device="cpu")
    out = enc.encode(prompts)
    np.testing.assert_array_equal(out["pooled_prompt_embeds"].numpy(), want_pooled)
    np.testing.assert_array_equal(out["prompt_embeds"].numpy(), want_txt)
    enc.free()
    with pytest.raises(RuntimeError, match="freed"):
        enc.encode(prompts)
    enc.free()  # twice is harmless


def test_schnell_like_model_uses_256_tokens(tmp_path):
    files = tiny_flux_files(tmp_path / "schnell", guidance_embed=False)
    assert not files.is_dev and files.t5_max_length == 256
    with load_text_encoders(files, dtype=F32, device="cpu") as enc:
        assert tuple(enc.encode(["a cat"])["prompt_embeds"].shape) == (1, 256, 32)


def test_vae_round_trip_uses_flux_latent_format(tiny):
    vae = load_vae_for_flux(tiny, dtype=F32, device="cpu")
    x = flame.tensor(np.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 48)).astype(np.float32), device="cpu")
    z = vae.encode(x).numpy()
    model_space = encode_images(vae, x).numpy()
    np.testing.assert_allclose(model_space, (z - 0.1159) * 0.3611, rtol=1e-6, atol=1e-6)
    # latents on the default device (cuda under FLAME_DEVICE=cuda): decode_latents brings them to the VAE
    decoded = decode_latents(vae, flame.tensor(model_space)).numpy()
    np.testing.assert_allclose(decoded, vae.decode(flame.tensor(z, device="cpu")).numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unpack"):
        decode_latents(vae, flame.zeros(1, 12, 64))


def test_to_pil_rounds_like_diffusers():
    x = np.array([-1.5, -1.0, -0.5, 0.0, 0.2, 0.999, 1.0, 2.0], dtype=np.float32)
    images = np.broadcast_to(x, (1, 3, 1, 8)).copy()
    got = np.asarray(to_pil(flame.tensor(images))[0])[0, :, 0]
    want = (np.clip(x / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8)   # VaeImageProcessor.postprocess
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(to_pil(images)[0])[0, :, 0], want)


# ----------------------------------------------------------------------------- finding the parts
@pytest.fixture(scope="module")
def single_files(tiny, tmp_path_factory):
    """ComfyUI-style single files of the tiny model, plus some wrong ones."""
    d = tmp_path_factory.mktemp("single")
    from flame_models.flux import load_flux, save_flux
    from flame_models.vae import load_vae
    model = load_flux(tiny.transformer, dtype=F32, device="cpu")
    paths = {"transformer": str(d / "flux1-tiny.safetensors"), "vae": str(d / "ae.safetensors"),
             "clip_l": str(d / "clip_l.safetensors"), "t5": str(d / "t5xxl_fp16.safetensors")}
    save_flux(model, paths["transformer"], layout="bfl")
    save_vae(load_vae(tiny.vae, device="cpu"), paths["vae"], layout="ldm")
    shutil.copy(os.path.join(tiny.clip_l, "model.safetensors"), paths["clip_l"])
    shutil.copy(os.path.join(tiny.t5, "model.safetensors"), paths["t5"])
    # wrong parts: a LoRA, an SD-like VAE with 4 latent channels, a CLIP too wide, a broken file, a pickle
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": np.zeros((4, 64), np.float32),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": np.zeros((192, 4), np.float32)},
              str(d / "lora.safetensors"))
    save_file({"decoder.conv_in.weight": np.zeros((16, 4, 3, 3), np.float32),
               "encoder.conv_in.weight": np.zeros((8, 3, 3, 3), np.float32)}, str(d / "sd_vae.safetensors"))
    save_file({"text_model.embeddings.token_embedding.weight": np.zeros((600, 48), np.float32)},
              str(d / "clip_g.safetensors"))
    (d / "broken.safetensors").write_bytes(b"<html>404 Not Found</html>")
    (d / "model.ckpt").write_bytes(b"\x80\x02}q\x00.")
    paths.update(lora=str(d / "lora.safetensors"), sd_vae=str(d / "sd_vae.safetensors"),
                 clip_g=str(d / "clip_g.safetensors"), broken=str(d / "broken.safetensors"),
                 ckpt=str(d / "model.ckpt"))
    return paths


def test_single_files_are_found_and_run(single_files, tiny):
    p = single_files
    files = find_flux_files(p["transformer"], vae=p["vae"], clip_l=p["clip_l"], t5=p["t5"], tokenizer=str(
        os.path.dirname(tiny.clip_tokenizer)))
    assert files == FluxFiles(p["transformer"], p["vae"], p["clip_l"], p["t5"], tiny.clip_tokenizer,
                              tiny.t5_tokenizer, tiny.params)
    # the single files give the same conditioning and latents as the diffusers folder they came from
    prompts = ["a red square"]
    with load_text_encoders(files, dtype=F32, device="cpu") as a, load_text_encoders(tiny, dtype=F32,
                                                                                       device="cpu") as b:
        ca, cb = a.encode(prompts), b.encode(prompts)
        for k in ca:
            np.testing.assert_array_equal(ca[k].numpy(), cb[k].numpy())
    za = sample_latents(load_transformer(files, dtype=F32, device="cpu"), ca, height=32, width=32, steps=2,
                        guidance=3.0, seeds=[0]).numpy()
    zb = sample_latents(load_transformer(tiny, dtype=F32, device="cpu"), cb, height=32, width=32, steps=2,
                        guidance=3.0, seeds=[0]).numpy()
    np.testing.assert_allclose(za, zb, rtol=1e-6, atol=1e-6)


def test_single_file_without_its_parts_lists_every_missing_one(single_files):
    with pytest.raises(FluxFilesError) as e:
        find_flux_files(single_files["transformer"])
    msg = str(e.value)
    for part, option in (("vae", "--vae"), ("clip_l", "--clip-l"), ("t5", "--t5")):
        assert f"{part}: missing" in msg and option in msg
    assert "3 problems" in msg and single_files["transformer"] in msg


def test_wrong_parts_are_named_with_what_they_look_like(single_files):
    p = single_files
    with pytest.raises(FluxFilesError) as e:
        find_flux_files(p["vae"], vae=p["transformer"], clip_l=p["t5"], t5=p["lora"])
    msg = str(e.value)
    assert f"{p['vae']} is not a Flux transformer: it looks like a VAE" in msg
    assert f"{p['transformer']} is not a VAE (autoencoder): it looks like a Flux transformer" in msg
    assert f"{p['t5']} is not a CLIP text encoder (CLIP-L): it looks like a T5 text encoder" in msg
    assert f"{p['lora']} is not a T5 text encoder (T5-XXL): it looks like a LoRA" in msg
    assert "4 problems" in msg


def test_parts_that_do_not_fit_the_transformer(single_files):
    p = single_files
    with pytest.raises(FluxFilesError) as e:
        find_flux_files(p["transformer"], vae=p["sd_vae"], clip_l=p["clip_g"], t5=p["t5"])
    msg = str(e.value)
    assert f"{p['sd_vae']} has VAE latent channels 4, but the transformer {p['transformer']} expects 16" in msg
    assert f"{p['clip_g']} has CLIP width 48, but the transformer {p['transformer']} expects 32" in msg


def test_unreadable_and_absent_files(single_files, tmp_path):
    p = single_files
    with pytest.raises(FluxFilesError) as e:
        find_flux_files(p["transformer"], vae=p["broken"], clip_l=p["ckpt"], t5=str(tmp_path / "nope.safetensors"))
    msg = str(e.value)
    assert f"{p['broken']}: not a readable .safetensors file" in msg
    assert f"{p['ckpt']}: a pickle checkpoint" in msg
    assert f"{tmp_path / 'nope.safetensors'} does not exist" in msg


def test_diffusers_folder_with_a_missing_and_a_wrong_subfolder(tiny, tmp_path):
    root = tmp_path / "flux"
    shutil.copytree(os.path.dirname(tiny.transformer), root)
    shutil.rmtree(root / "text_encoder_2")
    shutil.rmtree(root / "vae")
    shutil.copytree(os.path.join(os.path.dirname(tiny.transformer), "text_encoder"), root / "vae")
    with pytest.raises(FluxFilesError) as e:
        find_flux_files(str(root))
    msg = str(e.value)
    assert f"t5: missing -- {root} has no text_encoder_2/ folder; pass --t5" in msg
    assert f"{root / 'vae' / 'model.safetensors'} is not a VAE (autoencoder): it looks like a CLIP" in msg
    # the missing part given by hand completes it
    files = find_flux_files(str(root), t5=tiny.t5, vae=tiny.vae)
    assert files.t5 == tiny.t5 and files.clip_l == str(root / "text_encoder")


def test_tokenizer_checks(tiny, single_files, tmp_path):
    p = single_files
    # a tokenizer folder of the wrong kind
    bad = tmp_path / "toks"
    shutil.copytree(tiny.t5_tokenizer, bad / "tokenizer")
    shutil.copytree(tiny.clip_tokenizer, bad / "tokenizer_2")
    with pytest.raises(FluxFilesError, match="holds unigram tokenizer files, not a CLIP tokenizer"):
        find_flux_files(p["transformer"], vae=p["vae"], clip_l=p["clip_l"], t5=p["t5"], tokenizer=str(bad))
    # single files without --tokenizer: the packaged vocabularies, which the tiny encoders cannot embed
    files = find_flux_files(p["transformer"], vae=p["vae"], clip_l=p["clip_l"], t5=p["t5"])
    assert files.clip_tokenizer is None and files.t5_tokenizer is None
    with pytest.raises(FluxFilesError, match=r"clip_l: the tokenizer \(packaged:clip_merges.txt.gz\) has 49408 "
                                             r"tokens but the encoder .*clip_l.safetensors embeds only"):
        load_text_encoders(files, dtype=F32, device="cpu")


@pytest.mark.parametrize("stream", [False, True], ids=["merged", "adapters-streamed"])
def test_diffusers_lora_matches_diffusers(ref_files, golden, stream):
    """A LoRA saved by diffusers (lora_alpha 8 != r 4, in lora_adapter_metadata) at weights 1 and 0.5, merged into
    the weights or run beside streamed blocks, gives diffusers' latents at joint_attention_kwargs scale 1 / 0.5."""
    g, meta, prompts = golden
    H, W, steps, guidance = int(meta["height"]), int(meta["width"]), int(meta["steps"]), float(meta["guidance"])
    lora = os.path.join(FIXTURES, "lora", "pytorch_lora_weights.safetensors")
    with load_text_encoders(ref_files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(prompts[:1])
    for weight, key in ((1.0, "lora_latents_1"), (0.5, "lora_latents_05")):
        model = load_transformer(ref_files, dtype=F32, device="cpu", loras=[f"{lora}:{weight}"], stream=stream)
        z = sample_latents(model, cond, height=H, width=W, steps=steps, guidance=guidance, latents=g["latents"])
        np.testing.assert_allclose(pack(z).numpy(), g[key], rtol=1e-4, atol=2e-4)
    assert np.abs(g["lora_latents_1"] - g["out_latents"]).max() > 1e-2   # the LoRA matters


def test_bf16_lora_beside_fp8_blocks_equals_it_merged(ref_files, golden):
    """In bfloat16 the LoRA beside fp8 blocks (as adapters, streamed) gives the latents of the bf16 model with it
    merged, and both sit far from diffusers' float32 ones: Flux takes t * 1000 and guidance * 1000 in the model's
    dtype, as BFL and diffusers do (guidance 3.5 -> 3504 in bf16), which this fixture's LoRA, large on the
    modulation Linears, carries to the latents. (The model without the LoRA stays near: its modulation weights are
    small.)"""
    g, meta, prompts = golden
    H, W, steps, guidance = int(meta["height"]), int(meta["width"]), int(meta["steps"]), float(meta["guidance"])
    lora = os.path.join(FIXTURES, "lora", "pytorch_lora_weights.safetensors")
    with load_text_encoders(ref_files, dtype=F32, device="cpu") as enc:
        cond = enc.encode(prompts[:1])
    kw = dict(height=H, width=W, steps=steps, guidance=guidance, latents=g["latents"])

    def latents(**how):
        model = load_transformer(ref_files, dtype=flame.bfloat16, device="cpu", **how)
        return pack(sample_latents(model, cond, **kw)).numpy()

    def rel(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())
    beside, merged = latents(loras=[lora], fp8=True, stream=True), latents(loras=[lora])
    assert rel(beside, merged) < 0.05
    assert rel(beside, latents(fp8=True)) > 20 * rel(beside, merged)        # the LoRA acts
    assert rel(merged, g["lora_latents_1"]) > 0.3 and rel(latents(), g["out_latents"]) < 0.05
    in_bf16 = timestep_embedding(flame.tensor([3.5], dtype=flame.bfloat16), 256)
    at_3504 = timestep_embedding(flame.tensor([3504.0]), 256, time_factor=1.0).to(flame.bfloat16)
    np.testing.assert_array_equal(in_bf16.float().numpy(), at_3504.float().numpy())
