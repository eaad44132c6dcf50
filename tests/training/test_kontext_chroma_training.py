"""Flux Kontext and Chroma as trainer families, end to end on the CPU with tiny models: Kontext's edit pairs
(datasets' control_path: same-name control images placed, encoded and cached with their targets, appended as
reference tokens, the loss on the target's prediction), Chroma from an image folder (random preset and a diffusers
folder on disk) with CFG previews, and the LoRA files each writes -- their names, and `generate` applying them."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from flame_core import io
from flame_models.chroma.tiny import tiny_chroma_files
from flame_models.data import DatasetConfig
from flame_models.data.dataset import ImageDataset
from flame_models.data.errors import DataError
from flame_models.generate import generate
from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

PROMPTS = ["[trigger] on a blue background"]


@pytest.fixture
def pairs(tmp_path):
    """The demo's drawings as targets, their negatives as same-name control images (.jpg), one of another size."""
    images = draw_images(tmp_path / "img")
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    names = sorted(f for f in os.listdir(images) if f.endswith(".png"))
    for k, f in enumerate(names):
        im = np.asarray(Image.open(os.path.join(images, f)).convert("RGB"))
        out = Image.fromarray(255 - im)
        if k == 0:
            out = out.resize((96, 80))                      # another size: cover-resized into the target's bucket
        out.save(ctl / f.replace(".png", ".jpg"))
    return images, str(ctl), names


def _kontext_config(tmp_path, images, ctl, **top):
    top.setdefault("datasets", [{"folder_path": images, "control_path": ctl, "resolution": 64,
                                 "bucket_tolerance": 32}])
    return image_config(tmp_path, "k", None, images, steps=2,
                        model={"arch": "flux_kontext", "size": None, "name_or_path": None, "t5_max_length": 8},
                        **top)


def test_control_images_are_placed_like_their_targets(pairs):
    images, ctl, names = pairs
    ds = ImageDataset([DatasetConfig(folder_path=images, control_path=ctl, resolution=64, bucket_tolerance=32,
                                     flip_x=True)], progress=False)
    assert ds.has_controls and len(ds.latent_specs()) == 2 * len(ds)
    for i in range(len(ds)):
        t, c = ds.latent_spec(i), ds.control_spec(i)
        assert c.path.endswith(os.path.basename(t.path).replace(".png", ".jpg"))
        assert (c.bucket, c.flip_x, c.flip_y) == (t.bucket, t.flip_x, t.flip_y)
        if os.path.basename(t.path) == names[0]:
            assert c.resized != t.resized                   # 96x80 cover-resized to the 64x64 bucket
        else:
            assert (c.resized, c.crop) == (t.resized, t.crop)
        assert c.pixels().shape == t.pixels().shape
    os.remove(os.path.join(ctl, names[1].replace(".png", ".jpg")))
    with pytest.raises(DataError, match=f"{names[1]}: no control image {names[1][:-4]}.* in control_path"):
        ImageDataset([DatasetConfig(folder_path=images, control_path=ctl, resolution=64, bucket_tolerance=32)],
                     progress=False)


def test_kontext_trains_on_pairs_with_the_loss_on_the_target(tmp_path, pairs, monkeypatch):
    images, ctl, _ = pairs
    fam = get_family("flux_kontext")
    seen = []
    inputs, forward = fam.training_inputs, fam.forward

    def spy_inputs(model, batch, device, train_cfg):
        x0, cond = inputs(model, batch, device, train_cfg)
        seen.append((batch["latents"].shape, batch["control_latents"].shape, tuple(cond["ref"].shape),
                     cond["ref_ids"].numpy()[0, :, 0].tolist()))
        return x0, cond

    def spy_forward(model, x_t, t, cond):
        v = forward(model, x_t, t, cond)
        assert tuple(v.shape) == tuple(x_t.shape)          # the target tokens' prediction only
        return v
    previews = []
    sample = fam.sample

    def spy_sample(model, cond, **kw):
        previews.append(np.shape(cond.get("control_latents")))
        return sample(model, cond, **kw)
    monkeypatch.setattr(fam, "training_inputs", spy_inputs)
    monkeypatch.setattr(fam, "forward", spy_forward)
    monkeypatch.setattr(fam, "sample", spy_sample)
    # previews of the dataset's captions (no sample.prompts) edit their images' control images
    cfg = _kontext_config(tmp_path, images, ctl, sample={"sample_every": 2, "sample_steps": 2, "num_samples": 2})
    result = Trainer(cfg, verbose=False).train()
    assert result["samples_decoded"] and len(previews) >= 2 and set(previews) == {(16, 8, 8)}
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    assert result["encoded"]["latents"] == 12                # 6 targets and their 6 control images
    lat, ctl_shape, ref, index = seen[0]
    assert lat == ctl_shape == (2, 16, 8, 8) and ref == (2, 16, 64) and index == [1] * 16
    keys = set(io.load_file(result["lora"]))
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys


def test_kontext_previews_edit_a_sample_prompts_ctrl_img(tmp_path, pairs, monkeypatch):
    """ai-toolkit's `--ctrl_img <path>` in sample.prompts: the prompt is encoded without it and its preview edits
    that image (VAE-encoded at the previews' size, cover-resized and centred); a prompt without it samples text to
    image. The image of a dataset pair at the previews' size is the same encoding as the pair's control latent."""
    images, ctl, names = pairs
    fam = get_family("flux_kontext")
    seen = []
    sample = fam.sample

    def spy_sample(model, cond, **kw):
        seen.append(cond)
        return sample(model, cond, **kw)
    monkeypatch.setattr(fam, "sample", spy_sample)
    same = os.path.join(ctl, names[1].replace(".png", ".jpg"))     # 64x64, as the previews
    other = os.path.join(ctl, names[0].replace(".png", ".jpg"))    # 96x80: cover-resized to 64x64
    cfg = _kontext_config(tmp_path, images, ctl, sample={
        "sample_every": 2, "sample_steps": 1, "width": 64, "height": 64,
        "prompts": [f"[trigger] make it red  --ctrl_img {same}", f"make it blue --ctrl_img {other}", "a square"]})
    tr = Trainer(cfg, verbose=False)
    result = tr.train()
    assert result["samples_decoded"] and len(seen) >= 3 and len(seen) % 3 == 0     # 3 prompts per preview
    assert [p.label for p in tr.prepared.prompts] == ["ohwx make it red", "make it blue", "a square"]
    assert seen[0]["control_latents"].shape == seen[1]["control_latents"].shape == (16, 8, 8)
    assert "control_latents" not in seen[2]
    assert not np.array_equal(seen[0]["control_latents"], seen[1]["control_latents"])
    i = next(k for k in range(len(tr.dataset)) if tr.dataset.latent_spec(k).path.endswith(names[1]))
    pair = tr.prepared.latents.load(tr.dataset.control_spec(i))
    np.testing.assert_array_equal(seen[0]["control_latents"], pair)
    # the text without the flag: the caption cache holds "ohwx make it red", not the flag
    np.testing.assert_array_equal(seen[0]["prompt_embeds"],
                                  tr.prepared.texts.load("ohwx make it red")["prompt_embeds"])


def test_ctrl_img_is_checked_before_anything_loads(tmp_path, pairs):
    images, ctl, names = pairs
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: --ctrl_img: the flux family takes no control"):
        image_config(tmp_path, "x", None, images, model={"arch": "flux", "size": None, "name_or_path": None},
                     sample={"prompts": [f"a --ctrl_img {images}/{names[0]}"]})
    with pytest.raises(ConfigError, match=r"sample.prompts\[1\]: --ctrl_img: no such file: /nowhere/x.png"):
        _kontext_config(tmp_path, images, ctl, sample={"prompts": ["a", "b --ctrl_img /nowhere/x.png"]})
    with pytest.raises(ConfigError, match=r"sample.prompts\[0\]: --ctrl_img without a path"):
        _kontext_config(tmp_path, images, ctl, sample={"prompts": ["b --ctrl_img"]})


def test_control_path_is_checked_before_anything_loads(tmp_path, pairs):
    images, ctl, _ = pairs
    with pytest.raises(ConfigError, match=r"datasets\[0\].control_path: the flux family takes no control images"):
        image_config(tmp_path, "x", None, images, model={"arch": "flux", "size": None, "name_or_path": None},
                     datasets=[{"folder_path": images, "control_path": ctl, "resolution": 64}])
    with pytest.raises(ConfigError, match=r"datasets\[1\].control_path: missing"):
        _kontext_config(tmp_path, images, ctl, datasets=[
            {"folder_path": images, "control_path": ctl, "resolution": 64, "bucket_tolerance": 32},
            {"folder_path": images, "resolution": 64, "bucket_tolerance": 32}])
    with pytest.raises(DataError, match=r"datasets\[0\].control_path: no such folder"):   # (when the folders
        ImageDataset([DatasetConfig(folder_path=images, control_path=str(tmp_path / "nowhere"))])  # are read)


def test_a_flux_pipeline_folder_is_not_a_kontext_model_as_generate_says(tmp_path, pairs):
    """model.arch flux_kontext with a diffusers FluxPipeline folder (FLUX.1-dev) is refused before anything loads,
    as `generate --arch flux_kontext` refuses it; the same folder named FluxKontextPipeline trains."""
    from flame_models.bfl.tiny import tiny_flux_files
    images, ctl, _ = pairs
    model = os.path.dirname(tiny_flux_files(tmp_path / "dev", seed=1).transformer)
    with pytest.raises(ConfigError, match=f"model.name_or_path: {model} is not a Flux Kontext transformer: it looks "
                                          f"like a diffusers FluxPipeline folder \\(model.arch: flux trains it\\)"):
        _kontext_on(tmp_path, images, ctl, model)
    with pytest.raises(ValueError, match=f"--arch flux_kontext: {model} is not a Flux Kontext transformer"):
        generate(model, "x", arch="flux_kontext", image=os.path.join(ctl, os.listdir(ctl)[0]), device="cpu")
    index = os.path.join(model, "model_index.json")
    with open(index) as f:
        meta = json.load(f)
    with open(index, "w") as f:
        json.dump({**meta, "_class_name": "FluxKontextPipeline"}, f)
    assert _kontext_on(tmp_path, images, ctl, model).model.arch == "flux_kontext"


def _kontext_on(tmp_path, images, ctl, model):
    return image_config(tmp_path, "k", model, images, steps=2, model={"arch": "flux_kontext", "t5_max_length": 8},
                        datasets=[{"folder_path": images, "control_path": ctl, "resolution": 64,
                                   "bucket_tolerance": 32}])


def test_chroma_random_preset_trains_from_an_image_folder_with_cfg_previews(tmp_path):
    images = draw_images(tmp_path / "img")
    cfg = image_config(tmp_path, "chroma", None, images, steps=2,
                       model={"arch": "chroma", "size": None, "name_or_path": None, "t5_max_length": 8},
                       sample={"sample_every": 2, "sample_steps": 2, "prompts": PROMPTS, "neg": "blurry"})
    result = Trainer(cfg, verbose=False).train()
    assert result["samples_decoded"] and np.isfinite(result["losses"]).all()
    lat = io.load_file(os.path.join(tmp_path, "chroma", "samples", "step_000002.safetensors"))["latents"].numpy()
    assert lat.shape == (1, 16, 8, 8)
    with pytest.raises(ConfigError, match="train.guidance: not available: Chroma has no guidance embedding"):
        image_config(tmp_path, "x", None, images, model={"arch": "chroma", "size": None, "name_or_path": None},
                     train={"guidance": 3.5})


@pytest.fixture(scope="module")
def chroma_folder(tmp_path_factory):
    return tiny_chroma_files(tmp_path_factory.mktemp("chroma") / "Chroma-tiny", seed=4)


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_chroma_loras_from_files_have_comfyui_and_diffusers_names_and_generate_applies_them(tmp_path, chroma_folder,
                                                                                          fmt):
    images = draw_images(tmp_path / "img")
    folder = os.path.dirname(chroma_folder.transformer)
    cfg = image_config(tmp_path, "c", folder, images, steps=2, model={"arch": "chroma", "t5_max_length": 8},
                       save={"format": fmt}, network={"target": "all_linear"}, train={"lr": 0.05})
    result = Trainer(cfg, verbose=False).train()
    keys = set(io.load_file(result["lora"]))
    if fmt == "kohya":         # ComfyUI's lora_unet_<BFL name>; diffusers' FluxLoraLoaderMixin converts them too
        assert {"lora_unet_double_blocks_1_txt_attn_qkv.lora_down.weight",
                "lora_unet_single_blocks_0_linear1.lora_up.weight", "lora_unet_single_blocks_1_linear2.alpha"} <= keys
    else:                      # diffusers' / PEFT names, split like ChromaTransformer2DModel's Linears
        assert {"transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight",
                "transformer.single_transformer_blocks.1.proj_mlp.lora_B.weight",
                "transformer.single_transformer_blocks.0.proj_out.lora_A.weight"} <= keys
    assert not any("_mod" in k or "modulation" in k or "norm1" in k for k in keys)
    kw = dict(width=32, height=32, steps=2, seed=3, device="cpu", progress=False, log=lambda *a: None)
    base = np.asarray(generate(folder, "a red square", **kw)[0], np.int16)
    tuned = np.asarray(generate(folder, "a red square", loras=[result["lora"]], **kw)[0], np.int16)
    assert np.abs(base - tuned).max() > 0


def test_chroma_generate_uses_the_negative_prompt_and_refuses_flux_options(chroma_folder):
    kw = dict(width=32, height=32, steps=2, seed=3, device="cpu", progress=False, log=lambda *a: None)
    folder = os.path.dirname(chroma_folder.transformer)
    plain = np.asarray(generate(folder, "a red square", **kw)[0], np.int16)
    neg = np.asarray(generate(folder, "a red square", negative_prompt="blue", **kw)[0], np.int16)
    nocfg = np.asarray(generate(folder, "a red square", cfg=1.0, negative_prompt="blue", **kw)[0], np.int16)
    assert np.abs(plain - neg).max() > 0 and np.abs(plain - nocfg).max() > 0
    with pytest.raises(ValueError, match="--guidance: .*this model is Chroma: it has no guidance embedding"):
        generate(folder, "a red square", guidance=3.5, **kw)
    with pytest.raises(ValueError, match="--image: a Flux Kontext option; this model is Chroma"):
        generate(folder, "a red square", image="x.png", **kw)


def test_the_training_command_takes_kontext_control_images(pairs):
    from flame_models import train as example
    images, ctl, _ = pairs
    cfg, demo, _ = example.build_config(example.parser().parse_args(
        ["--arch", "flux_kontext", "--data", images, "--control", ctl, "--resolution", "64", "--device", "cpu"]))
    assert not demo and cfg.model.arch == "flux_kontext" and cfg.name == "flux_kontext_lora"
    assert cfg.datasets[0].control_path == ctl and cfg.model.name_or_path is None
    with pytest.raises(ConfigError, match="--control: give the target images' folder too"):
        example.build_config(example.parser().parse_args(["--arch", "flux_kontext", "--control", ctl,
                                                          "--model", images]))


@pytest.mark.parametrize("arch", ["chroma", "flux_kontext"])
def test_each_family_end_to_end_through_the_training_command_and_generate(tmp_path, pairs, chroma_folder, arch,
                                                                         capsys):
    """`python -m flame_models.train --arch <family> --model <tiny folder> ...` writes a LoRA, and
    `python -m flame_models.generate` applies it (Chroma with a negative prompt and CFG, Kontext editing --image):
    the LoRA changes the image, each command exits 0."""
    from flame_models import generate as gen
    from flame_models import train
    from flame_models.bfl.tiny import tiny_flux_files
    images, ctl, names = pairs
    if arch == "chroma":
        model = os.path.dirname(chroma_folder.transformer)
        extra, sample = [], ["--negative-prompt", "blurry", "--cfg", "3"]
    else:
        model = os.path.dirname(tiny_flux_files(tmp_path / "kontext", seed=5).transformer)
        index = os.path.join(model, "model_index.json")       # a FluxKontextPipeline folder: Flux-dev's tensors
        with open(index) as f:
            meta = json.load(f)
        with open(index, "w") as f:
            json.dump({**meta, "_class_name": "FluxKontextPipeline"}, f)
        extra, sample = ["--control", ctl], ["--image", os.path.join(ctl, names[0].replace(".png", ".jpg")),
                                             "--keep-image-size"]              # 96x80: a small reference
    out = tmp_path / "runs"
    assert train.main(["--arch", arch, "--model", model, "--data", images, *extra, "--resolution", "64", "--output",
                       str(out), "--name", "e2e", "--steps", "2", "--rank", "4", "--lr", "0.05", "--device", "cpu",
                       "--sample-every", "0", "--save-every", "2"]) == 0
    lora = os.path.join(out, "e2e", "e2e.safetensors")
    assert os.path.isfile(lora), os.listdir(os.path.join(out, "e2e"))
    base = ["--model", model, "--arch", arch, "--prompt", "a red square", "--width", "32", "--height", "32",
            "--steps", "2", "--seed", "3", "--device", "cpu", *sample]
    for name, more in (("plain", []), ("lora", ["--lora", lora])):
        assert gen.main(base + more + ["--output", str(tmp_path / name)]) == 0
    capsys.readouterr()
    plain, tuned = (np.asarray(Image.open(os.path.join(tmp_path, n, sorted(os.listdir(tmp_path / n))[0])))
                    for n in ("plain", "lora"))
    assert plain.shape == tuned.shape == (32, 32, 3) and not np.array_equal(plain, tuned)


def test_chroma_and_kontext_blocks_stream_and_store_in_fp8_as_fluxs(chroma_folder, tmp_path):
    import flame_core as flame
    from flame_core import memory
    from flame_models.bfl.tiny import tiny_flux_files
    from flame_models.chroma import conditioning as CC
    from flame_models.chroma import pipeline as CP
    from flame_models.flux_kontext import pipeline as KP
    with CC.load_text_encoders(chroma_folder, dtype=flame.float32, device="cpu", max_length=8) as enc:
        cond = {k: v.numpy() for k, v in enc.encode(["a red square"]).items()}
        neg = {k: v.numpy() for k, v in enc.encode([""]).items()}
    kw = dict(height=32, width=32, steps=2, seeds=[1])
    want = CP.sample_latents(CP.load_transformer(chroma_folder, dtype=flame.float32, device="cpu"), cond, neg,
                             cfg=4.0, **kw).numpy()
    streamed = CP.load_transformer(chroma_folder, dtype=flame.float32, device="cpu", stream=True)
    assert "4 streamed" in str(streamed.streamer)
    try:
        report = CP.fit_transformer(streamed, cond, 64 * 2 ** 20, height=32, width=32)
    finally:
        memory.set_memory_limit(None, "cpu")
    assert "auto-fit" in str(report)
    np.testing.assert_array_equal(CP.sample_latents(streamed, cond, neg, cfg=4.0, **kw).numpy(), want)
    fp8 = CP.sample_latents(CP.load_transformer(chroma_folder, dtype=flame.float32, device="cpu", fp8=True,
                                                stream=True), cond, neg, cfg=4.0, **kw).numpy()
    assert 0 < np.abs(fp8 - want).max() < 0.2 * np.abs(want).max()
    # Kontext: the same transformer loading, the reference tokens through streamed blocks
    files = tiny_flux_files(tmp_path / "flux", seed=5)
    rng = np.random.default_rng(0)
    kcond = {"prompt_embeds": rng.normal(size=(1, 8, 32)).astype(np.float32),
             "pooled_prompt_embeds": rng.normal(size=(1, 32)).astype(np.float32),
             "ref_latents": rng.normal(size=(1, 6, 64)).astype(np.float32), "ref_height": 32, "ref_width": 48}
    want = KP.sample_latents(KP.load_transformer(files, dtype=flame.float32, device="cpu"), kcond, guidance=2.5,
                             **kw).numpy()
    streamed = KP.load_transformer(files, dtype=flame.float32, device="cpu", stream=True)
    try:
        KP.fit_transformer(streamed, kcond, 64 * 2 ** 20, height=32, width=32, guidance=2.5)
    finally:
        memory.set_memory_limit(None, "cpu")
    np.testing.assert_array_equal(KP.sample_latents(streamed, kcond, guidance=2.5, **kw).numpy(), want)


@pytest.mark.parametrize("name, arch", [("flux_kontext", "flux_kontext"), ("chroma", "chroma")])
def test_the_example_configs_read(name, arch):
    from flame_models.training.config import config_from_dict, read_yaml
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs", f"{name}.yaml")
    cfg = config_from_dict(read_yaml(path), check_files=False)
    assert cfg.model.arch == arch and (cfg.datasets[0].control_path is not None) == (arch == "flux_kontext")


@pytest.mark.parametrize("arch", ["flux_kontext", "chroma"])
def test_ai_toolkits_is_flux_beside_a_flux_derived_arch_reads(arch):
    """ai-toolkit takes model.arch over its flags: a Flux config's is_flux: true (or false) beside arch: flux_kontext
    / chroma trains that family; the flag of an unrelated family still contradicts it."""
    from flame_models.training.config import config_from_dict
    base = {"name": "x", "training_folder": "/tmp/unused", "device": "cpu",
            "synthetic": {"num_samples": 2, "height": 64, "width": 64}, "train": {"steps": 1}}
    for flag in (True, False):
        cfg = config_from_dict({**base, "model": {"arch": arch, "is_flux": flag}}, check_files=False)
        assert cfg.model.arch == arch
    with pytest.raises(ConfigError, match=f"model.is_v3: true contradicts model.arch '{arch}'"):
        config_from_dict({**base, "model": {"arch": arch, "is_v3": True}}, check_files=False)
    with pytest.raises(ConfigError, match="model.is_flux: false contradicts model.arch 'flux'"):
        config_from_dict({**base, "model": {"arch": "flux", "is_flux": False}}, check_files=False)


def test_chroma_t5_sees_the_real_tokens_and_one_padding_token(chroma_folder):
    from flame_models.chroma import conditioning as CC
    out = {}
    for n in (8, 16):
        with CC.load_text_encoders(chroma_folder, dtype=CC.flame.float32, device="cpu", max_length=n) as enc:
            ids, mask = enc.tokenize(["a red square"])
            out[n] = {k: v.numpy() for k, v in enc.encode(["a red square"]).items()}
            real = int(mask.sum())
            with CC.flame.no_grad():     # T5 on the real tokens and the first padding token alone, no mask
                alone = enc.t5(ids[:, :real + 1]).last_hidden_state.numpy()
    assert 1 < real < 8 and out[16]["prompt_mask"].tolist() == [[1.0] * real + [0.0] * (16 - real)]
    # the states of the real tokens and the first padding token do not depend on how much padding follows
    np.testing.assert_allclose(out[8]["prompt_embeds"][:, :real + 1], out[16]["prompt_embeds"][:, :real + 1],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[16]["prompt_embeds"][:, :real + 1], alone, rtol=1e-5, atol=1e-6)


def test_synthetic_kontext_samples_carry_a_control_latent(tmp_path, monkeypatch):
    """A synthetic Kontext run (the benches' 12 GiB runs) trains with reference tokens, as a paired dataset does:
    each sample has a control latent of its target's size."""
    from flame_models.training.config import config_from_dict
    fam = get_family("flux_kontext")
    seen = []
    inputs = fam.training_inputs

    def spy(model, batch, device, train_cfg):
        x0, cond = inputs(model, batch, device, train_cfg)
        seen.append((batch["latents"].shape, tuple(cond["ref"].shape)))
        return x0, cond
    monkeypatch.setattr(fam, "training_inputs", spy)
    cfg = config_from_dict({
        "name": "ks", "training_folder": str(tmp_path), "device": "cpu",
        "model": {"arch": "flux_kontext", "name_or_path": None, "size": None},
        "synthetic": {"num_samples": 2, "height": 64, "width": 64, "text_length": 8},
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4},
        "train": {"steps": 1, "batch_size": 1, "lr": 1e-4, "optimizer": "adamw", "disable_sampling": True},
        "sample": {"sample_every": 0}, "save": {"save_every": 10 ** 6}}, check_files=False)
    result = Trainer(cfg, verbose=False).train()
    assert np.isfinite(result["losses"]).all()
    assert seen[0] == ((1, 16, 8, 8), (1, 16, 64))


def test_chroma_trains_on_the_text_its_attention_sees(tmp_path, monkeypatch):
    """The run's T5 tokens are cut after the longest caption's real tokens + the first padding token (the rest are
    masked from every attention): the same losses as the masked full text, with fewer tokens."""
    from flame_models.chroma.family import ChromaFamily
    images = draw_images(tmp_path / "img")
    model = {"arch": "chroma", "size": None, "name_or_path": None, "t5_max_length": 32}

    def run(name):
        trainer = Trainer(image_config(tmp_path, name, None, images, steps=2, model=model), verbose=False)
        return trainer, trainer.train()

    cut, cut_result = run("cut")
    width = cut.loader.next_batch()["prompt_embeds"].shape[1]
    assert 1 < width < 32
    monkeypatch.setattr(ChromaFamily, "attended_text_length", lambda self, mask: None)   # no cut: masked 32 tokens
    full, full_result = run("full")
    assert full.loader.next_batch()["prompt_embeds"].shape[1] == 32
    np.testing.assert_allclose(cut_result["losses"], full_result["losses"], rtol=1e-6)   # (a cut 1 short: 5e-6)


def test_chroma_sampling_cuts_the_text_no_attention_sees(chroma_folder, monkeypatch):
    """The prompt's and the negative prompt's T5 tokens are cut after the longer attended prefix (real tokens + one
    padding token): the same latents as the full masked text; equal prefixes leave no mask."""
    import flame_core as flame
    from flame_models.chroma import conditioning as CC
    from flame_models.chroma import pipeline as CP
    with CC.load_text_encoders(chroma_folder, dtype=flame.float32, device="cpu", max_length=24) as enc:
        cond = {k: v.numpy() for k, v in enc.encode(["a red square on a blue ground"]).items()}
        neg = {k: v.numpy() for k, v in enc.encode([""]).items()}
    n_pos, n_neg = int(cond["prompt_mask"].sum()), int(neg["prompt_mask"].sum())
    assert n_neg < n_pos < 23
    (p, q) = CP.cut_text((cond["prompt_embeds"], cond["prompt_mask"]), (neg["prompt_embeds"], neg["prompt_mask"]))
    assert p[0].shape[1] == q[0].shape[1] == n_pos + 1 and p[1].shape == (1, n_pos + 1)
    ((e, m),) = CP.cut_text((cond["prompt_embeds"], cond["prompt_mask"]))
    assert e.shape[1] == n_pos + 1 and m is None                      # one prompt: nothing left to mask
    model = CP.load_transformer(chroma_folder, dtype=flame.float32, device="cpu")
    kw = dict(height=32, width=32, steps=2, seeds=[1])
    cut = {c: CP.sample_latents(model, cond, neg, cfg=c, **kw).numpy() for c in (1.0, 4.0)}
    monkeypatch.setattr(CP, "cut_text", lambda *pairs: list(pairs))   # the full 24 tokens, masked
    for c, want in cut.items():
        full = CP.sample_latents(model, cond, neg, cfg=c, **kw).numpy()
        assert np.abs(full - want).max() <= 1e-5 * np.abs(want).max()


def test_kontext_previews_run_true_cfg_with_the_reference(tmp_path, pairs):
    """sample.true_cfg on a Kontext edit preview: the negative prompt's pass sees the same reference tokens; the
    steps before sample.true_cfg_start run the prompt alone."""
    images, ctl, names = pairs
    ref = os.path.join(ctl, names[1].replace(".png", ".jpg"))
    cfg = _kontext_config(tmp_path, images, ctl, sample={
        "sample_every": 2, "sample_steps": 3, "width": 64, "height": 64, "true_cfg": 3.0, "true_cfg_start": 1,
        "neg": "blurry", "prompts": [f"make it red --ctrl_img {ref}"]})
    tr = Trainer(cfg, verbose=False).setup()
    cond, args = tr.previews.prompts[0].cond, tr.previews._settings(0)
    assert (args["true_cfg"], args["true_cfg_start"]) == (3.0, 1) and "control_latents" in cond
    tr.model.eval()

    def run(**kw):
        return tr.family.sample(tr.model, cond, device=tr.device, **{**args, **kw})[0].float().cpu().numpy()
    plain, later, everywhere = run(true_cfg=1.0), run(), run(true_cfg_start=0)
    np.testing.assert_array_equal(run(true_cfg_start=3), plain)
    assert np.abs(later - plain).max() > 0 and np.abs(later - everywhere).max() > 0
