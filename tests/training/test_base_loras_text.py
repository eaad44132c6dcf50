"""model.lora_path's text-encoder part (kohya lora_te1_ / lora_te2_ / lora_te3_, diffusers text_encoder. / ...):
merged into the text encoders the run loads, so every caption is encoded as the generators encode it with the same
file (Flux's CLIP-L and T5 from a model folder or the random tiny preset; SDXL's CLIP-L / CLIP-G, trained on with
train.train_text_encoder); the file is part of the text cache's key; every problem is a ConfigError naming the file
before anything is cached or built (cpu)."""
import glob
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io
from flame_models.flux import pipeline as FP
from flame_models.pipeline import apply_text_encoder_loras
from flame_models.sdxl.conditioning import load_text_encoders as load_sdxl_text_encoders
from flame_models.training.config import ConfigError
from flame_models.training.family import get_family
from flame_models.training.trainer import Trainer

from . import test_sd_families as _families
from .conftest import draw_images, image_config, tiny_config

# that file's fixtures (bound by assignment: the tests' arguments of the same name are what pytest fills)
sdxl_model = _families.sdxl_model

F32 = flame.float32
CLIP_TARGETS = ["q_proj", "fc1"]
T5_TARGETS = ["SelfAttention.q", "DenseReluDense.wo"]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return draw_images(tmp_path_factory.mktemp("te_base") / "images", n_concept=2, n_other=1)


def _caption(images):
    return open(sorted(glob.glob(os.path.join(images, "*.txt")))[0]).read().strip().replace("[trigger]", "ohwx")


def te_lora_file(path, parts, fmt, seed):
    """Random adapters on each (encoder, targets, kohya prefix, diffusers prefix) of `parts`, written into one file
    at `path` in `fmt` under the prefixes (the adapters are removed from the encoders again)."""
    rng = np.random.default_rng(seed)
    sd = {}
    for k, (encoder, targets, kohya, diffusers) in enumerate(parts):
        A.inject_adapters(encoder, targets, rank=2, alpha=1.0)
        with flame.no_grad():
            for _, p in A.named_adapter_parameters(encoder):
                p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32), device="cpu"))
        one = A.save_adapters(encoder, f"{path}.{k}", format=fmt)
        A.remove_adapters(encoder)
        with io.safe_open(one) as f:
            for key in f.keys():   # the encoder's own module names, under the part's prefix
                if fmt == "kohya":
                    sd[kohya + key[len("lora_unet_"):]] = f.get_array(key)
                else:
                    sd[diffusers + key.split(".", 1)[1]] = f.get_array(key)
    io.save_file(sd, path)
    return path


def _flux_parts(enc):
    return [(enc.clip, CLIP_TARGETS, "lora_te1_", "text_encoder."),
            (enc.t5, T5_TARGETS, "lora_te3_", "text_encoder_2.")]


def _cached(tr, caption):
    return {k: np.asarray(v) for k, v in tr.prepared.texts.load(caption).items()}


@pytest.mark.parametrize("case", ["folder-kohya", "folder-peft", "random-kohya"])
def test_flux_captions_are_encoded_through_the_merged_encoders(tmp_path, images, tiny_model, case):
    """The cached embeddings of a caption are the generator's with the same file (FP.load_text_encoders(loras=));
    they differ from a plain run's; the file's transformer part is merged as before."""
    where, fmt = case.split("-")
    fam = get_family("flux")
    if where == "folder":
        files = FP.find_flux_files(tiny_model)
        model, drop = {}, []
        with FP.load_text_encoders(files, dtype=F32, device="cpu") as enc:
            path = te_lora_file(str(tmp_path / "te.safetensors"), _flux_parts(enc), fmt, seed=1)
    else:
        model, drop = {"size": "flux-tiny"}, ["model.name_or_path"]
    plain_cfg = image_config(tmp_path, "plain", tiny_model, images, steps=2, drop=drop, model=model)
    if where == "random":
        enc = fam.load_text_encoders(plain_cfg.model, "cpu")
        path = te_lora_file(str(tmp_path / "te.safetensors"), _flux_parts(enc), fmt, seed=1)
        enc.free()
    cfg = image_config(tmp_path, "te", tiny_model, images, steps=2, drop=drop, model={"lora_path": path, **model})
    tr = Trainer(cfg, verbose=False).setup()
    plain = Trainer(plain_cfg, verbose=False).setup()
    caption = _caption(images)
    got, base = _cached(tr, caption), _cached(plain, caption)
    if where == "folder":
        ref = FP.load_text_encoders(files, dtype=F32, device="cpu", max_length=8, loras=[(path, 1.0)])
    else:
        ref = fam.load_text_encoders(plain_cfg.model, "cpu")
        apply_text_encoder_loras([(path, 1.0)], fam.text_lora_parts(ref))
    with ref:
        want = {k: v.float().numpy()[0] for k, v in ref.encode([caption]).items()}
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
        assert np.abs(got[k] - base[k]).max() > 1e-3, k       # the file changed what the run trains on
    assert fam.text_encoder_id(cfg.model, "cpu") != fam.text_encoder_id(plain_cfg.model, "cpu")
    assert np.isfinite(tr.train()["losses"]).all()


def test_the_text_cache_key_names_the_file(tmp_path, images, tiny_model):
    """A lora_path without a text-encoder part leaves the key as it is; a changed file gives another key."""
    fam = get_family("flux")
    files = FP.find_flux_files(tiny_model)
    with FP.load_text_encoders(files, dtype=F32, device="cpu") as enc:
        path = te_lora_file(str(tmp_path / "te.safetensors"), _flux_parts(enc)[:1], "kohya", seed=2)
    plain = image_config(tmp_path, "p", tiny_model, images).model
    with_te = image_config(tmp_path, "t", tiny_model, images, model={"lora_path": path}).model
    key = fam.text_encoder_id(with_te, "cpu")
    assert key.startswith(fam.text_encoder_id(plain, "cpu")) and "te-lora:" in key and path in key
    sd = dict(io.load_file(path))
    io.save_file({k: v * 2 for k, v in sd.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)
    os.utime(path, ns=(1, 1))
    assert fam.text_encoder_id(with_te, "cpu") != key


def test_sdxl_trains_its_text_encoders_on_top_of_the_merged_part(tmp_path, images, sdxl_model):
    """A kohya file with UNet, CLIP-L and CLIP-G parts (an SDXL run's own, trained with train_text_encoder) as
    lora_path of a run that trains the text encoders: they start from the base with the file merged (the generator's
    encoders with the file), and the LoRA the run writes holds what it learned only (a plain run's keys)."""
    first = Trainer(_families.sdxl_config(tmp_path, "first", sdxl_model, images, steps=2,
                                          train={"train_text_encoder": True, "text_encoder_lr": 5e-2}),
                    verbose=False).train()["lora"]
    keys = io.load_file(first).keys()
    assert any(k.startswith("lora_te1_") for k in keys) and any(k.startswith("lora_te2_") for k in keys)
    cfg = _families.sdxl_config(tmp_path, "second", sdxl_model, images, steps=2, model={"lora_path": first},
                                train={"train_text_encoder": True})
    tr = Trainer(cfg, verbose=False).setup()
    with load_sdxl_text_encoders(sdxl_model, dtype=F32, device="cpu", loras=[(first, 1.0)]) as ref:
        for comp, encoder in tr.text_encoders.parts:
            want = {n: p.numpy() for n, p in (ref.clip_l if comp == "te1" else ref.clip_g).named_parameters()}
            got = {n: p.detach().numpy() for n, p in encoder.named_parameters() if n in want}
            assert set(got) == set(want)
            for n in want:
                np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-6, err_msg=f"{comp}/{n}")
    with load_sdxl_text_encoders(sdxl_model, dtype=F32, device="cpu") as base:
        w = "text_model.encoder.layers.0.self_attn.q_proj.weight"
        trained = dict(dict(tr.text_encoders.parts)["te1"].named_parameters())[w].detach().numpy()
        assert np.abs(trained - dict(base.clip_l.named_parameters())[w].numpy()).max() > 1e-4
    out = tr.train()["lora"]
    plain = Trainer(_families.sdxl_config(tmp_path, "plain", sdxl_model, images, steps=2,
                                          train={"train_text_encoder": True}), verbose=False).train()["lora"]
    assert sorted(io.load_file(out).keys()) == sorted(io.load_file(plain).keys())


def _misfit(path, src):
    """`src` with one down matrix twice as wide: a part for another encoder size."""
    sd = dict(io.load_file(src))
    key = next(k for k in sd if k.endswith("lora_down.weight"))
    sd[key] = np.concatenate([sd[key], sd[key]], axis=1)
    io.save_file(sd, path)
    return path


@pytest.mark.parametrize("case, words", [
    ("misfit", r"model.lora_path .*misfit.safetensors: the adapter on text_model.encoder.layers.0.\S+ is \d+x\d+ but "
               r"this CLIPTextModel's Linear"),
    ("assistant", r"model.assistant_lora_path .*: holds text-encoder adapters .*applies to the flux denoiser only"),
    ("precomputed", r"model.lora_path .*: holds text-encoder adapters .*this run trains on precomputed samples"),
    ("streamed", r"model.lora_path .*: holds T5EncoderModel adapters \(te3: keys such as lora_te3_.*streams from "
                 r"host memory under max_gpu_memory"),
    ("sdxl te3", r"model.lora_path .*: holds adapters for a text encoder this sdxl model does not have \(te3: keys "
                 r"such as lora_te3_"),
    ("chroma", r"model.lora_path .*: holds text-encoder adapters .*the chroma family applies LoRAs to its denoiser "
               r"only"),
])
def test_problems_are_config_errors_before_anything_is_cached(tmp_path, images, tiny_model, case, words,
                                                              monkeypatch):
    files = FP.find_flux_files(tiny_model)
    with FP.load_text_encoders(files, dtype=F32, device="cpu") as enc:
        te = te_lora_file(str(tmp_path / "te.safetensors"), _flux_parts(enc), "kohya", seed=3)
    model = {"lora_path": te}
    if case == "misfit":
        model = {"lora_path": _misfit(str(tmp_path / "misfit.safetensors"), te)}
    elif case == "assistant":
        model = {"assistant_lora_path": te}
    elif case == "streamed":
        monkeypatch.setattr(get_family("flux").__class__, "streamed_text_components",
                            lambda self, model_cfg, device, budget: ("te3", "te2"))
    if case == "precomputed":
        cfg = tiny_config(tmp_path, "bad", model={"lora_path": te})
    elif case == "sdxl te3":
        cfg = image_config(tmp_path, "bad", None, images, drop=["model.name_or_path", "model.t5_max_length"],
                           model={"arch": "sdxl", "size": "sdxl-tiny", "lora_path": te})
    elif case == "chroma":
        cfg = image_config(tmp_path, "bad", None, images, drop=["model.name_or_path"],
                           model={"arch": "chroma", "size": "chroma-tiny", "lora_path": te})
    else:
        cfg = image_config(tmp_path, "bad", tiny_model, images, model=model)
    tr = Trainer(cfg, verbose=False)
    with pytest.raises(ConfigError, match=words):
        tr.setup()
    assert tr.prepared is None and not hasattr(tr, "model")   # nothing cached or built


def test_sd3_without_t5_refuses_a_t5_part_and_merges_the_clip_parts_with_it(tmp_path, images):
    """SD3 with model.use_t5 false: a file with a T5 part is refused (the part would be dropped); with T5 on the
    same file's three parts reach the captions (CLIP-L, CLIP-G and T5: the generator's encodings)."""
    from flame_models.sd3 import pipeline as SP
    files = SP.find_sd3_files(_families.SD3_MODEL)
    with SP.load_text_encoders(files, dtype=F32, device="cpu") as enc:
        path = te_lora_file(str(tmp_path / "sd3.safetensors"),
                            [(enc.clip_l, CLIP_TARGETS, "lora_te1_", "text_encoder."),
                             (enc.clip_g, CLIP_TARGETS, "lora_te2_", "text_encoder_2."),
                             (enc.t5, T5_TARGETS, "lora_te3_", "text_encoder_3.")], "kohya", seed=4)
    cfg = _families.sd3_config(tmp_path, "no_t5", images, steps=2, model={"use_t5": False, "lora_path": path})
    tr = Trainer(cfg, verbose=False)
    with pytest.raises(ConfigError, match=r"model.lora_path .*: holds adapters for a text encoder this run does not "
                                          r"load \(te3: keys such as lora_te3_.*model.use_t5 is false"):
        tr.setup()
    assert tr.prepared is None
    tr = Trainer(_families.sd3_config(tmp_path, "t5", images, steps=2, model={"lora_path": path}),
                 verbose=False).setup()
    caption = _caption(images)
    with SP.load_text_encoders(files, dtype=F32, device="cpu", max_length=8, loras=[(path, 1.0)]) as ref:
        want = {k: v.float().numpy()[0] for k, v in ref.encode([caption]).items()}
    got = _cached(tr, caption)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_structure_only_builds_the_encoders_without_reading_a_tensor(tiny_model):
    from flame_models.text_encoders import load_clip, load_t5, structure_only
    files = FP.find_flux_files(tiny_model)
    with structure_only():
        clip, t5 = load_clip(files.clip_l, device="cpu"), load_t5(files.t5, device="cpu", quantize="fp8",
                                                                  stream=True)
    loaded = load_clip(files.clip_l, device="cpu")
    assert all(p.is_meta for p in clip.parameters()) and all(p.is_meta for p in t5.parameters())
    assert getattr(t5, "streamer", None) is None                      # nothing packed or streamed
    assert {n: tuple(p.shape) for n, p in clip.named_parameters()} == \
        {n: tuple(p.shape) for n, p in loaded.named_parameters()}
    assert not any(p.is_meta for p in loaded.parameters())            # (the flag is off after the block)
