"""The trainer from a folder of images and captions, through its stages: every image checked before any model is
loaded, latents cached through the VAE, captions and prompts through the text encoders (each freed before the
transformer is built), batches of one bucket with exact resume, decoded previews, a LoRA -- and caches reused."""
import os

import numpy as np
import pytest
from PIL import Image

from flame_core import io
from flame_models.data import DataError
from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

PROMPTS = ["[trigger] on a blue background", "a yellow square on a purple background"]


@pytest.fixture
def images(tmp_path):
    return draw_images(tmp_path / "images", wide=2)


def test_an_image_folder_trains_through_every_stage_with_decoded_previews(tmp_path, tiny_model, images):
    cfg = image_config(tmp_path, "run", tiny_model, images, steps=4,
                       sample={"sample_every": 2, "sample_steps": 2, "prompts": PROMPTS})
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    # 8 images in two buckets (6 square, 2 wide), each encoded once; every caption, the prompts, the empty caption
    assert result["encoded"]["latents"] == 8
    assert {str(b) for b in tr.dataset.buckets()} == {"64x64", "96x32"}
    assert result["encoded"]["text"] == len(set(tr.dataset.prompts([0]) + [
        "ohwx on a blue background", "a yellow square on a purple background", "", "ohwx"]))
    assert [p.label for p in tr.previews.prompts] == ["ohwx on a blue background",
                                                       "a yellow square on a purple background"]
    names = [s["stage"] for s in result["stages"]]
    assert names[:5] == ["check", "latents", "text", "build", "train"] and "samples" in names
    # the LoRA, and previews decoded through the VAE: one PNG per prompt and sampling step, and the grid
    assert any(k.endswith(".lora_down.weight") for k in io.load_file(result["lora"]))
    assert result["samples_decoded"]
    for step in (0, 2, 4):
        for i in range(2):
            with Image.open(os.path.join(tr.out, "samples", f"step_{step:06d}_{i}.png")) as im:
                assert im.size == (64, 64) and im.mode == "RGB"
    with Image.open(result["samples"]) as grid:
        w, h = grid.size
        assert w > 3 * 64 and 2 * 64 < h < 2 * 64 + 60          # 3 step columns and a label column, 2 rows
    # the decoded preview is the VAE's decode of the sampled latents (not a projection)
    lat = io.load_file(os.path.join(tr.out, "samples", "step_000004.safetensors"))["latents"].numpy()
    want = np.clip(get_family("flux").decode(_vae(tr), lat) / 2 + 0.5, 0, 1)
    got = np.asarray(Image.open(os.path.join(tr.out, "samples", "step_000004_0.png")), np.float32) / 255
    np.testing.assert_allclose(got, want[0].transpose(1, 2, 0), atol=1 / 255 + 1e-6)


def _vae(tr):
    return get_family("flux").load_vae(tr.cfg.model, tr.device)


def test_resume_is_exact_through_the_bucket_loader(tmp_path, tiny_model, images):
    def run(name, steps):
        return Trainer(image_config(tmp_path, name, tiny_model, images, steps=steps), verbose=False)
    full = run("full", 6).setup()
    want = [full.train_step()[0] for _ in range(6)]
    first = run("part", 3).setup()
    for _ in range(3):
        first.train_step()
    first.save_checkpoint()
    again = run("part", 6).setup()                          # more steps: applied from the checkpoint on
    assert again.resumed_from and again.step == 3
    assert again.loader.state_dict() == first.loader.state_dict()
    got = [again.train_step()[0] for _ in range(3)]
    np.testing.assert_allclose(got, want[3:], rtol=1e-6)
    for a, b in zip(again.params, full.params):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_batches_come_from_one_bucket(tmp_path, tiny_model, images):
    tr = Trainer(image_config(tmp_path, "buckets", tiny_model, images), verbose=False).setup()
    seen = set()
    for _ in range(8):
        b = tr.loader.next_batch()
        seen.add(b["latents"].shape)
        assert len({tuple(s) for s in b["target_size"]}) == 1
    assert seen == {(2, 16, 8, 8), (2, 16, 4, 12)}


def test_a_second_run_reuses_the_caches_without_loading_an_encoder(tmp_path, tiny_model, images, monkeypatch):
    disk = {"datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32,
                          "cache_latents_to_disk": True}]}
    first = Trainer(image_config(tmp_path, "one", tiny_model, images, steps=1, **disk), verbose=False).setup()
    assert first.prepared.encoded["latents"] == 8 and first.prepared.encoded["text"] > 0
    assert os.listdir(os.path.join(images, ".flame_cache", "latents"))
    fam = get_family("flux")

    def loaded(*a, **k):
        raise AssertionError("an encoder was loaded although every entry was cached")
    monkeypatch.setattr(fam, "load_vae", loaded)
    monkeypatch.setattr(fam, "load_text_encoders", loaded)
    second = Trainer(image_config(tmp_path, "two", tiny_model, images, steps=1, **disk), verbose=False).setup()
    assert second.prepared.encoded == {"latents": 0, "text": 0}
    b1, b2 = first.loader.next_batch(), second.loader.next_batch()
    np.testing.assert_array_equal(b1["latents"], b2["latents"])
    np.testing.assert_array_equal(b1["prompt_embeds"], b2["prompt_embeds"])
    # a changed caption: exactly its text embedding is encoded again (with the encoders), nothing else
    monkeypatch.undo()
    path = os.path.join(images, "shape_00.txt")
    with open(path, "w") as f:
        f.write("a white circle on a teal background")
    third = Trainer(image_config(tmp_path, "three", tiny_model, images, steps=1, **disk), verbose=False).setup()
    assert third.prepared.encoded == {"latents": 0, "text": 1}


def test_rerunning_a_finished_run_encodes_nothing_and_keeps_its_files(tmp_path, tiny_model, images, monkeypatch,
                                                                      capsys):
    # before: the rerun of a finished run loaded the VAE and the text encoders and encoded every latent and caption
    # again (caches in host memory), decoded the previews' data column, only to find no step left
    cfg = lambda steps: image_config(tmp_path, "done", tiny_model, images, steps=steps,  # noqa: E731
                                     sample={"sample_every": 2, "sample_steps": 1, "prompts": PROMPTS},
                                     validation={"split": 0.25, "every": 2})
    first_tr = Trainer(cfg(2), verbose=False)
    first = first_tr.train()
    files = {k: open(first[k], "rb").read() for k in ("lora", "samples")}
    fam = get_family("flux")

    def called(name):
        def fail(*a, **k):
            raise AssertionError(f"{name} was called on a finished run's rerun")
        return fail
    for name in ("load_vae", "load_text_encoders", "encode_images", "encode_prompts", "decode"):
        monkeypatch.setattr(fam, name, called(name))  # no encoder loaded, nothing encoded or decoded
    tr = Trainer(cfg(2), verbose=True)
    again = tr.train()
    assert "this run already finished: step 2 of 2" in capsys.readouterr().out
    assert again["finished_before"] and again["steps"] == 2 and again["lora"] == first["lora"]
    assert again["losses"] == first["losses"] and again["samples"] == first["samples"]
    assert again["samples_decoded"] and again["loss_plot"] == first["loss_plot"]
    assert again["validation_losses"] == first["validation_losses"] and len(first["validation_losses"]) == 2
    assert not {"latents", "text", "train"} & {s["stage"] for s in again["stages"]}
    assert {k: open(again[k], "rb").read() for k in files} == files  # the LoRA and the grid as the run left them
    # still built and restored: the model's adapters and the optimizer are the finished run's
    got, want = dict(tr.named_adapter_parameters()), dict(first_tr.named_adapter_parameters())
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k].detach().numpy(), want[k].detach().numpy())
    assert tr.step == 2 and tr.optimizer.state_dict()["state"]
    # a larger train.steps continues the run: the caches are needed (host memory: encoded again)
    monkeypatch.undo()
    more = Trainer(cfg(4), verbose=False).train()
    assert more["steps"] == 4 and not more.get("finished_before") and more["encoded"]["latents"] == 8


def _before_any_model(monkeypatch):
    """Make loading any model part fail loudly: a check that should fire first must not get there."""
    fam = get_family("flux")

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the bad input was found")
    for name in ("load_vae", "load_text_encoders", "build_model"):
        monkeypatch.setattr(fam, name, loaded)


def test_an_unreadable_image_fails_before_any_model_naming_the_file(tmp_path, tiny_model, images, monkeypatch):
    bad = os.path.join(images, "broken.png")
    with open(bad, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n this is not an image")
    with open(os.path.join(images, "broken.txt"), "w") as f:
        f.write("a broken file")
    _before_any_model(monkeypatch)
    with pytest.raises(DataError, match="broken.png"):
        Trainer(image_config(tmp_path, "bad", tiny_model, images), verbose=False).setup()
    assert not os.path.exists(os.path.join(tmp_path, "bad", "checkpoints"))


def test_an_image_smaller_than_every_bucket_fails_before_any_model(tmp_path, tiny_model, images, monkeypatch):
    Image.new("RGB", (24, 24), (10, 20, 30)).save(os.path.join(images, "tiny.png"))
    with open(os.path.join(images, "tiny.txt"), "w") as f:
        f.write("a dot")
    _before_any_model(monkeypatch)
    with pytest.raises(DataError, match=r"tiny\.png: 24x24 is smaller than its 64x64 bucket"):
        Trainer(image_config(tmp_path, "small", tiny_model, images), verbose=False).setup()


def test_missing_tokenizer_files_fail_in_the_config_check_naming_the_folder(tmp_path, tiny_model, images):
    empty = tmp_path / "tokenizers"
    (empty / "tokenizer").mkdir(parents=True)
    (empty / "tokenizer_2").mkdir()
    with pytest.raises(ConfigError) as ei:
        image_config(tmp_path, "tok", tiny_model, images, model={"tokenizer_path": str(empty)})
    msg = str(ei.value)
    assert f"model: clip_tokenizer (model.tokenizer_path): no CLIP tokenizer in {empty}" in msg, msg
    assert "t5_tokenizer (model.tokenizer_path): no T5 tokenizer" in msg, msg
    # a model folder whose own T5 tokenizer is gone: FLAME's packaged vocabulary does not fit its T5
    import shutil
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    shutil.rmtree(broken / "tokenizer_2")
    with pytest.raises(ConfigError, match=r"model: t5: the tokenizer .* has \d+ tokens but the encoder .*"
                                          r"text_encoder_2 embeds only \d+"):
        image_config(tmp_path, "tok2", str(broken), images)


def test_a_vae_file_given_as_the_transformer_fails_in_the_config_check(tmp_path, tiny_model, images):
    vae = os.path.join(tiny_model, "vae", "diffusion_pytorch_model.safetensors")
    with pytest.raises(ConfigError, match=r"model.name_or_path: .*diffusion_pytorch_model.safetensors is not a Flux "
                                          r"transformer: it looks like a VAE"):
        image_config(tmp_path, "vae", vae, images, model={"vae_path": vae})


def test_sample_prompts_get_the_trigger_word(tmp_path, tiny_model, images):
    cfg = image_config(tmp_path, "trig", tiny_model, images, trigger_word="zkx",
                       sample={"prompts": ["a photo of [trigger]", "[trigger] and [trigger]", "no word here"]})
    tr = Trainer(cfg, verbose=False).setup()
    assert [p.label for p in tr.previews.prompts] == ["a photo of zkx", "zkx and zkx", "no word here"]
    # the captions got it prepended (ai-toolkit), the prompts only where [trigger] stood
    assert all(c.startswith("zkx") or "zkx" in c for c in tr.dataset.prompts([0]) if c)
    assert tr.prepared.texts.missing(["a photo of zkx", "zkx and zkx", "no word here"]) == []


def test_each_encoder_is_freed_before_the_transformer_is_built(tmp_path, tiny_model, images, monkeypatch):
    import gc
    import weakref
    fam = get_family("flux")
    refs = {}
    real_vae, real_te, real_build = fam.load_vae, fam.load_text_encoders, fam.build_model

    def load_vae(*a, **k):
        vae = real_vae(*a, **k)
        refs["vae"] = weakref.ref(vae)
        return vae

    def load_text_encoders(*a, **k):
        enc = real_te(*a, **k)
        refs["clip"], refs["t5"] = weakref.ref(enc.clip), weakref.ref(enc.t5)
        return enc

    def build_model(*a, **k):
        gc.collect()
        refs["alive_at_build"] = [k for k in ("vae", "clip", "t5") if refs[k]() is not None]
        return real_build(*a, **k)
    monkeypatch.setattr(fam, "load_vae", load_vae)
    monkeypatch.setattr(fam, "load_text_encoders", load_text_encoders)
    monkeypatch.setattr(fam, "build_model", build_model)
    Trainer(image_config(tmp_path, "free", tiny_model, images), verbose=False).setup()     # no previews: no VAE kept
    assert refs["alive_at_build"] == []
    refs.clear()
    tr = Trainer(image_config(tmp_path, "keep", tiny_model, images, sample={"sample_every": 2, "sample_steps": 1}),
                 verbose=False).setup()
    assert refs["alive_at_build"] == ["vae"]        # kept (in host memory on a GPU) to decode the previews
    assert tr.prepared.decode is not None and tr.prepared.decode_bytes > 0


def test_without_prompts_the_first_images_captions_are_sampled_beside_their_decoded_image(tmp_path, tiny_model,
                                                                                          images):
    tr = Trainer(image_config(tmp_path, "data", tiny_model, images, steps=2,
                              sample={"sample_every": 2, "sample_steps": 1, "num_samples": 2}), verbose=False)
    tr.train()
    assert [p.label for p in tr.previews.prompts] == [tr.dataset.base_caption(i) for i in range(2)]
    assert tr.previews.grid_columns == ["data", "step 0", "step 2"]
    ref = tr.previews.refs[0]                      # the first image through the pooling VAE: its 8x8 block means
    want = np.asarray(Image.open(tr.dataset.record(0).path).convert("RGB"), np.float32)
    want = want.reshape(8, 8, 8, 8, 3).mean(axis=(1, 3)).repeat(8, 0).repeat(8, 1)
    assert np.abs(ref.astype(np.float32) - want).max() <= 2.0


def test_random_parts_of_a_size_preset_train_from_an_image_folder_without_files(tmp_path, images):
    cfg = image_config(tmp_path, "preset", None, images, steps=2, model={"name_or_path": None, "size": "flux-tiny"},
                       sample={"sample_every": 2, "sample_steps": 1, "prompts": ["[trigger]"]})
    result = Trainer(cfg, verbose=False).train()
    assert result["encoded"]["latents"] == 8 and result["samples_decoded"]
    with pytest.raises(ConfigError, match="model.vae_path: model.size flux-tiny builds random parts"):
        image_config(tmp_path, "x", None, images, model={"name_or_path": None, "size": "flux-tiny",
                                                          "vae_path": "ae.safetensors"})


def test_random_init_fills_empty_parameters_on_their_device(tmp_path):
    import flame_core as flame
    import flame_nn
    from flame_models.flux import Flux
    from flame_models.training.random_init import init_random_
    with flame_nn.empty_init(device="cpu", dtype=flame.float32):
        model = Flux("flux-tiny")
    fam = get_family("flux")
    fill = fam.block_initializer(model)
    assert fill is not None
    for block in model.double_blocks:
        fill(block)
    assert fam.block_initializer(model) is not None               # single blocks are still empty
    assert init_random_(model, flame.Generator("cpu").manual_seed(0)) > 0
    assert fam.block_initializer(model) is None and not any(p.is_meta for p in model.parameters())
    q = model.double_blocks[0].img_attn.norm.query_norm.scale.detach().numpy()
    w = model.double_blocks[0].img_attn.qkv.weight.detach().numpy()
    np.testing.assert_array_equal(q, 1.0)                         # norm gains 1, other weights N(0, 0.02^2)
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002


@pytest.mark.parametrize("budget, quantize_te, want", [
    (None, False, "bf16"), (None, True, "fp8"), ("24GiB", False, "bf16"), ("12GiB", False, "bf16"),
    ("10GiB", False, "fp8"), ("12GiB", True, "fp8"), ("6GiB", False, "fp8+stream")])
def test_t5_is_stored_in_fp8_or_streamed_when_the_budget_asks_for_it(budget, quantize_te, want):
    # T5-XXL: 4.76e9 parameters, 9.5 GB in bfloat16, 4.8 GB in fp8, plus 2 GiB for CLIP-L and the activations
    from flame_core.memory.stats import parse_budget as max_gpu_memory_bytes
    from flame_models.flux import family_parts as flux_parts
    from flame_models.training.config import ModelConfig
    m = ModelConfig(size="flux-dev", quantize_te=quantize_te)
    b = None if budget is None else max_gpu_memory_bytes(budget)
    assert flux_parts.t5_storage(m, "cuda", b) == want
    assert flux_parts.t5_storage(m, "cpu", b) == ("fp8" if quantize_te else "float32")


@pytest.mark.parametrize("budget, quantize_te, want", [
    ("14GiB", False, "bf16"), ("12GiB", False, "fp8"), ("8GiB", True, "fp8"), ("7.5GiB", True, "fp8+stream")])
def test_sd3_counts_clip_g_and_clip_l_beside_t5(budget, quantize_te, want):
    # SD3 holds CLIP-L + CLIP-G (818e6 parameters, 1.6 GB in bfloat16) beside T5 while captions are encoded: 7.5 GiB
    # holds T5 in fp8 beside a CLIP-L (Flux) but not beside both
    from flame_core.memory.stats import parse_budget as max_gpu_memory_bytes
    from flame_models.flux import family_parts as flux_parts
    from flame_models.sd3 import family_parts as sd3_parts
    from flame_models.training.config import ModelConfig
    m = ModelConfig(arch="sd3", size="sd3.5-large", quantize_te=quantize_te)
    assert sd3_parts._clip_params(m) == 818_310_144
    assert sd3_parts.t5_storage(m, "cuda", max_gpu_memory_bytes(budget)) == want
    flux = ModelConfig(size="flux-dev", quantize_te=True)
    assert flux_parts.t5_storage(flux, "cuda", max_gpu_memory_bytes("7.5GiB")) == "fp8"


def test_a_resumed_run_keeps_the_decoded_preview_columns(tmp_path, tiny_model, images):
    def c(steps):
        return image_config(tmp_path, "cols", tiny_model, images, steps=steps, save={"save_every": 2},
                            sample={"sample_every": 2, "sample_steps": 1, "prompts": PROMPTS})
    first = Trainer(c(2), verbose=False)
    first.train()
    before = np.asarray(Image.open(os.path.join(first.out, "samples", "step_000002_1.png")))
    again = Trainer(c(4), verbose=False)
    again.setup()
    assert [s for s, _ in again.previews.history] == [0, 2]
    np.testing.assert_array_equal(again.previews.history[1][1][1], before)     # read back, not sampled again
    again.train()
    assert again.previews.grid_columns == ["step 0", "step 2", "step 4"]


def test_the_example_names_a_bad_image_and_exits_2_before_training(tmp_path, tiny_model, images, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_flux_lora", os.path.join(
        os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with open(os.path.join(images, "cut.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 a truncated download")
    with open(os.path.join(images, "cut.txt"), "w") as f:
        f.write("a cut file")
    argv = ["--model", tiny_model, "--data", images, "--resolution", "64", "--trigger", "ohwx", "--output",
            str(tmp_path), "--name", "cli", "--steps", "2"]
    assert example.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: 1 unusable file(s) in the datasets:" in err and "cut.jpg: cannot read the image" in err, err
    assert not os.path.exists(os.path.join(tmp_path, "cli", "checkpoints"))


def test_precomputed_samples_with_text_prompts_and_an_optional_vae_for_previews(tmp_path, tiny_model):
    from .conftest import make_samples
    data = make_samples(tmp_path / "latents", n=4, txt=(8, 32), pooled=32)
    base = {"name": "pre", "training_folder": str(tmp_path), "device": "cpu",
            "datasets": [{"folder_path": data}], "model": {"name_or_path": tiny_model, "dtype": "fp32",
                                                           "t5_max_length": 8},
            "network": {"linear": 4, "linear_alpha": 4}, "save": {"save_every": 100},
            "train": {"steps": 2, "batch_size": 2, "optimizer": "adamw", "dtype": "fp32"},
            "sample": {"sample_every": 2, "sample_steps": 1, "prompts": ["a red square", "a blue circle"]}}
    from flame_models.training.config import config_from_dict
    tr = Trainer(config_from_dict(base), verbose=False)
    result = tr.train()
    assert [p.label for p in tr.previews.prompts] == ["a red square", "a blue circle"]
    assert not result["samples_decoded"] and tr.previews.prompts[0].cond["prompt_embeds"].shape == (8, 32)
    base.update(name="pre_vae")
    base["model"] = {**base["model"], "vae_path": os.path.join(tiny_model, "vae")}
    result = Trainer(config_from_dict(base), verbose=False).train()
    assert result["samples_decoded"] and result["encoded"] == {"latents": 0, "text": 2}


def test_random_text_encoders_of_a_released_size_use_the_packaged_tokenizers(monkeypatch):
    # flux-schnell's widths (CLIP 768, T5 4096) with one small layer each instead of the released depths
    from flame_models.flux import family_parts as flux_parts
    from flame_models.text_encoders import configs as C
    from flame_models.training.config import ModelConfig
    monkeypatch.setitem(C.CLIP_PRESETS, "clip-l", C.CLIP_PRESETS["clip-l"].__class__(**{
        **C.CLIP_PRESETS["clip-l"].to_dict(), "num_hidden_layers": 1, "intermediate_size": 64}))
    monkeypatch.setitem(C.T5_PRESETS, "t5-xxl", C.T5Config(vocab_size=32128, d_model=4096, d_kv=8, d_ff=32,
                                                           num_layers=1, num_heads=2))
    enc = flux_parts.load_text_encoders_for(ModelConfig(size="flux-schnell", t5_max_length=16), "cpu")
    assert enc.clip_tokenizer.eos_token_id == enc.clip.config.eos_token_id == 49407     # CLIP-L's real vocabulary
    out = get_family("flux").encode_prompts(enc, ["a photo of a cat", "a dog"])
    assert out["prompt_embeds"].shape == (2, 16, 4096) and out["pooled_prompt_embeds"].shape == (2, 768)
    assert np.isfinite(out["prompt_embeds"]).all() and not np.allclose(out["pooled_prompt_embeds"][0],
                                                                       out["pooled_prompt_embeds"][1])
    enc.free()
