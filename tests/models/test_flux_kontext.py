"""Flux Kontext (flame_models/flux_kontext): the reference image's size and ids, the joint sequence through the Flux
transformer (only the target's velocity kept), the trainer plug-in with control latents, file detection through the
registry, and `generate --image` end to end on the tiny model."""
import json
import os

import numpy as np
import pytest
from PIL import Image

import flame_core as flame
from flame_models import registry
from flame_models.bfl import Flux, image_ids, text_ids
from flame_models.bfl.tiny import tiny_flux_files
from flame_models.flux_kontext import (
    PREFERRED_KONTEXT_RESOLUTIONS,
    kontext_size,
    reference_ids,
    target_velocity,
    with_reference,
)
from flame_models.flux_kontext.sampling import WithReference
from flame_models.generate import family_of, generate
from flame_models.training.family import get_family


def test_kontext_size_picks_the_closest_aspect_ratio_of_the_list():
    assert len(PREFERRED_KONTEXT_RESOLUTIONS) == 17 and (1024, 1024) in PREFERRED_KONTEXT_RESOLUTIONS
    assert kontext_size(1024, 1024) == (1024, 1024) == kontext_size(37, 37)
    assert kontext_size(1920, 1080) == (1392, 752)      # ar 1.78: 1392/752 = 1.85 is closer than 1328/800 = 1.66
    assert kontext_size(500, 1500) == (672, 1568)       # beyond the list's tallest: its tallest
    with pytest.raises(ValueError, match="positive size"):
        kontext_size(0, 10)


def test_reference_ids_are_the_image_grid_with_index_one():
    ids = reference_ids(32, 48, 2).numpy()              # 2 x 3 packed tokens
    assert ids.shape == (2, 6, 3)
    assert ids[0].tolist() == [[1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 0], [1, 1, 1], [1, 1, 2]]
    assert (image_ids(32, 48).numpy()[0, :, 1:] == ids[0, :, 1:]).all()


def _inputs(B=2, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: flame.tensor(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return dict(img=f(B, 4, 64), ref=f(B, 6, 64), txt=f(B, 5, 32), y=f(B, 16),
                t=flame.tensor(np.array([0.7, 0.3][:B], np.float32)), g=flame.full((B,), 2.5))


def test_the_reference_tokens_follow_the_target_tokens_and_only_the_target_velocity_is_kept():
    flame.manual_seed(0)
    model = Flux("flux-tiny").eval()
    x = _inputs()
    ids, rids, tids = image_ids(32, 32, 2), reference_ids(32, 48, 2), text_ids(5, 2)
    with flame.no_grad():
        joint, jids = with_reference(x["img"], ids, x["ref"], rids)
        assert tuple(joint.shape) == (2, 10, 64) and jids.numpy()[0, 4:, 0].tolist() == [1] * 6
        full = model(img=joint, img_ids=jids, txt=x["txt"], txt_ids=tids, timesteps=x["t"], y=x["y"],
                     guidance=x["g"])
        net = WithReference(model, x["ref"], rids)
        v = net(x["img"], ids, x["txt"], tids, x["t"], x["y"], x["g"])
        assert np.array_equal(v.numpy(), target_velocity(full, 4).numpy())
        plain = model(img=x["img"], img_ids=ids, txt=x["txt"], txt_ids=tids, timesteps=x["t"], y=x["y"],
                      guidance=x["g"])
        assert np.abs(v.numpy() - plain.numpy()).max() > 1e-3         # the reference changes the prediction
        shifted = WithReference(model, x["ref"], reference_ids(32, 48, 2) * 0)(
            x["img"], ids, x["txt"], tids, x["t"], x["y"], x["g"])
        assert np.abs(v.numpy() - shifted.numpy()).max() > 1e-4       # and so do its ids (index 1, not 0)


def test_the_trainer_plugin_appends_the_control_latents_and_predicts_the_target_only():
    fam = get_family("flux_kontext")
    assert fam.name == "flux_kontext" and registry.about("flux_kontext").refines == "flux"
    flame.manual_seed(0)
    model = Flux("flux-tiny").eval()
    rng = np.random.default_rng(1)
    batch = {"latents": rng.normal(size=(2, 16, 4, 6)).astype(np.float32),
             "control_latents": rng.normal(size=(2, 16, 4, 4)).astype(np.float32),
             "prompt_embeds": rng.normal(size=(2, 5, 32)).astype(np.float32),
             "pooled_prompt_embeds": rng.normal(size=(2, 16)).astype(np.float32)}

    class Train:
        guidance = 1.0
        bypass_guidance_embedding = False
    dev = next(model.parameters()).device   # the test device (cuda under FLAME_DEVICE=cuda)
    x0, cond = fam.training_inputs(model, batch, dev, Train)
    assert tuple(x0.shape) == (2, 6, 64) and tuple(cond["ref"].shape) == (2, 4, 64)
    assert cond["ref_ids"].numpy()[0, :, 0].tolist() == [1] * 4
    t = flame.tensor(np.array([0.5, 0.2], np.float32), device=dev)
    with flame.no_grad():
        v = fam.forward(model, x0, t, cond)
        assert tuple(v.shape) == (2, 6, 64)
        del batch["control_latents"]
        x0, plain = fam.training_inputs(model, batch, dev, Train)
        assert "ref" not in plain and np.abs(fam.forward(model, x0, t, plain).numpy() - v.numpy()).max() > 1e-3


@pytest.fixture(scope="module")
def tiny_kontext(tmp_path_factory):
    """The tiny random Flux-dev folder written as a FluxKontextPipeline (the same tensors as Flux-dev)."""
    files = tiny_flux_files(tmp_path_factory.mktemp("kontext") / "kontext", seed=2)
    folder = os.path.dirname(files.transformer)
    index = os.path.join(folder, "model_index.json")
    with open(index) as f:
        meta = json.load(f)
    meta["_class_name"] = "FluxKontextPipeline"
    with open(index, "w") as f:
        json.dump(meta, f)
    return folder, files


def test_the_registry_tells_a_kontext_folder_from_a_flux_one(tiny_kontext, tmp_path):
    folder, files = tiny_kontext
    assert registry.detect_family(folder)[0] == "flux_kontext"
    # a transformer file is Flux-dev's: Flux by default, Kontext when --arch says so
    assert registry.detect_family(files.transformer)[0] == "flux"
    assert registry.detect_family(files.transformer, arch="flux_kontext")[0] == "flux_kontext"
    with pytest.raises(ValueError, match="is not a Flux transformer"):
        registry.detect_family(folder, arch="flux")


def test_generate_edits_a_reference_image_end_to_end(tiny_kontext, tmp_path):
    folder, _ = tiny_kontext
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save(ref)
    kw = dict(width=32, height=32, steps=2, seed=5, device="cpu", progress=False, log=lambda *a: None,
              keep_image_size=True)                           # (Kontext's list would make it 1392x752: slow here)
    out = tmp_path / "out"
    a = generate(folder, "make it red", image=str(ref), output=str(out), **kw)
    assert len(a) == 1 and a[0].size == (32, 32)
    pngs = sorted(os.listdir(out))
    info = json.loads(Image.open(out / pngs[0]).info["flame"])
    assert len(pngs) == 1 and info["image"] == str(ref) and info["reference_size"] == [32, 16]
    other = tmp_path / "other.png"
    Image.fromarray(np.zeros((24, 40, 3), np.uint8)).save(other)
    b = generate(folder, "make it red", image=str(other), **kw)
    assert (np.asarray(a[0]) != np.asarray(b[0])).any()                # the reference is used
    with pytest.raises(ValueError, match="--image"):
        generate(folder, "make it red", **kw)
    assert family_of(folder) == "flux_kontext"
    with pytest.raises(ValueError, match="--keep-image-size: .*Flux Kontext"):
        generate(tiny_kontext[1].transformer, "x", vae=tiny_kontext[1].vae, clip_l=tiny_kontext[1].clip_l,
                 t5=tiny_kontext[1].t5, width=32, height=32, steps=1, device="cpu", keep_image_size=True,
                 progress=False)                                       # a single file: Flux by default


def test_the_reference_image_is_read_as_an_untrusted_file(tmp_path):
    """read_reference goes through data.images.load_image: a file that is no image, or one that is too small, is
    refused naming it; an RGBA image is composited on white."""
    from flame_models.flux.components import FluxFilesError
    from flame_models.flux_kontext.pipeline import read_reference
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(FluxFilesError, match=r"--image .*bad.png: not a readable image"):
        read_reference(str(bad))
    small = tmp_path / "small.png"
    Image.new("RGB", (12, 40)).save(small)
    with pytest.raises(FluxFilesError, match="12x40 is smaller than 16x16"):
        read_reference(str(small), auto_resize=False)
    clear = tmp_path / "clear.png"
    Image.new("RGBA", (40, 24), (0, 0, 0, 0)).save(clear)
    x = read_reference(str(clear), auto_resize=False)
    assert x.shape == (1, 3, 16, 32) and np.allclose(x, 1.0)   # transparent: white
