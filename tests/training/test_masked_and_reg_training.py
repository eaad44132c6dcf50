"""Masked loss and regularisation images end to end: tiny runs through the training command (a YAML config) and
the trainer, for every family; the masks and weights reach the loss; config mistakes are named before any work;
a run with both resumes exactly."""
import os

import numpy as np
import pytest
import yaml
from PIL import Image

from flame_models import train
from flame_models.training import loss_weights
from flame_models.training.config import ConfigError, config_from_dict
from flame_models.training.resume import compare
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config

RANDOM = {"size": None, "name_or_path": None, "t5_max_length": 8}


def _half_masks(images, folder, keep="right"):
    """Same-name masks for every image of `images`: white on one half, black on the other."""
    os.makedirs(folder, exist_ok=True)
    for f in sorted(os.listdir(images)):
        if f.endswith(".png"):
            w, h = Image.open(os.path.join(images, f)).size
            a = np.zeros((h, w), np.uint8)
            a[:, w // 2:] = 255
            Image.fromarray(a if keep == "right" else 255 - a).save(os.path.join(folder, f))
    return str(folder)


def _spy_weights(monkeypatch):
    """Records, per micro-batch, the loss weights that reach the objective."""
    seen = []
    split = loss_weights.split

    def spy(cond):
        cond, w = split(cond)
        seen.append({k: None if v is None else v.numpy().copy() for k, v in w.items()})
        return cond, w
    monkeypatch.setattr(loss_weights, "split", spy)
    return seen


def _run_command(tmp_path, proc):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": proc["name"], "process": [proc]}}))
    return train.main(["--config", str(path)])


def _proc(tmp_path, name, datasets, **train_kw):
    return {"type": "sd_trainer", "name": name, "training_folder": str(tmp_path), "device": "cpu",
            "trigger_word": "ohwx", "network": {"type": "lora", "linear": 4, "linear_alpha": 4,
                                                "target": "all_linear"},
            "datasets": datasets, "model": {"size": "flux-tiny", "dtype": "fp32", "t5_max_length": 8},
            "train": {"steps": 4, "batch_size": 2, "optimizer": "adamw", "lr": 3e-3, "dtype": "fp32",
                      "gradient_checkpointing": False, "seed": 0, **train_kw},
            "sample": {"sample_every": 0}, "save": {"save_every": 4, "dtype": "fp32"}}


def test_the_command_trains_with_a_mask_folder(tmp_path, monkeypatch):
    images = draw_images(tmp_path / "img")
    masks = _half_masks(images, tmp_path / "masks")
    seen = _spy_weights(monkeypatch)
    ds = [{"folder_path": images, "mask_path": masks, "resolution": 64, "bucket_tolerance": 32,
           "mask_min_value": 0.1, "cache_latents_to_disk": True}]
    assert _run_command(tmp_path, _proc(tmp_path, "masked", ds)) == 0
    assert os.path.isfile(tmp_path / "masked" / "masked.safetensors")
    assert os.listdir(os.path.join(images, ".flame_cache", "masks"))            # cached beside the latents
    assert len(seen) == 4 and all(s["sample_weights"] is None for s in seen)
    m = seen[0]["mask"]                                                 # Flux: packed as its latents, (B, 16, 64)
    assert m.shape == (2, 16, 64)
    left = m.reshape(2, 4, 4, 16, 2, 2)[:, :, :2]                      # tokens of the left half of the 8x8 grid
    np.testing.assert_allclose(left, 0.1, rtol=1e-6)
    np.testing.assert_allclose(m.reshape(2, 4, 4, 16, 2, 2)[:, :, 2:], 1.0)


def test_the_command_trains_with_a_regularisation_dataset(tmp_path, monkeypatch, capsys):
    images = draw_images(tmp_path / "img")
    reg = draw_images(tmp_path / "reg", n_concept=0, n_other=4)
    seen = _spy_weights(monkeypatch)
    ds = [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32},
          {"folder_path": reg, "is_reg": True, "resolution": 64, "bucket_tolerance": 32}]
    proc = _proc(tmp_path, "reg", ds, steps=6, prior_loss_weight=0.3, reg_ratio=1 / 3)   # kohya's name for it
    assert _run_command(tmp_path, proc) == 0
    assert "4 of the samples regularisation images" in capsys.readouterr().out
    weights = [tuple(s["sample_weights"]) for s in seen]
    assert weights == [(0.3, 0.3) if k % 3 == 2 else (1.0, 1.0) for k in range(6)]
    assert all(s["mask"] is None for s in seen)


@pytest.mark.parametrize("arch", ["sd3", "sdxl", "chroma", "flux_kontext", "qwen_image"])
def test_every_family_trains_with_masks_and_regularisation_images(tmp_path, monkeypatch, arch):
    images = draw_images(tmp_path / "img", n_concept=2, n_other=2)
    masks = _half_masks(images, tmp_path / "masks", keep="left")
    reg = draw_images(tmp_path / "reg", n_concept=0, n_other=2)
    kontext = arch == "flux_kontext"
    extra = {"control_path": images} if kontext else {}                 # Kontext: edit pairs (itself as source)
    ds = [{"folder_path": images, "mask_path": masks, "resolution": 64, "bucket_tolerance": 32, **extra},
          {"folder_path": reg, "is_reg": True, "resolution": 64, "bucket_tolerance": 32, **extra}]
    seen = _spy_weights(monkeypatch)
    cfg = image_config(tmp_path, arch, None, images, steps=2, datasets=ds, train={"reg_weight": 0.5},
                       model={"arch": arch, **RANDOM, "t5_max_length": None if arch in ("sdxl", "qwen_image")
                              else 8})
    result = Trainer(cfg, verbose=False).train()
    assert np.isfinite(result["losses"]).all() and result["encoded"]["masks"] == 1    # one mask entry: all alike
    train_mask, reg_mask = seen[0]["mask"], seen[1]["mask"]
    assert tuple(seen[0]["sample_weights"]) == (1.0, 1.0) and tuple(seen[1]["sample_weights"]) == (0.5, 0.5)
    if arch in ("sd3", "sdxl"):
        assert train_mask.shape == (2, 1, 8, 8)
        np.testing.assert_array_equal(train_mask[..., :4], 1)
        np.testing.assert_array_equal(train_mask[..., 4:], 0)
    else:
        assert train_mask.shape == (2, 16, 64)
        np.testing.assert_array_equal(np.unique(train_mask), [0.0, 1.0])
    np.testing.assert_array_equal(reg_mask, 1)                          # regularisation images have no masks


def test_a_run_with_masks_and_regularisation_images_resumes_exactly(tmp_path):
    images = draw_images(tmp_path / "img")
    masks = _half_masks(images, tmp_path / "masks")
    reg = draw_images(tmp_path / "reg", n_concept=0, n_other=4)
    ds = [{"folder_path": images, "mask_path": masks, "resolution": 64, "bucket_tolerance": 32},
          {"folder_path": reg, "is_reg": True, "resolution": 64, "bucket_tolerance": 32}]

    def cfg(name, steps):
        return image_config(tmp_path, name, None, images, steps=steps, datasets=ds, model=RANDOM,
                            train={"reg_weight": 0.5, "reg_ratio": 0.4}, save={"save_every": 3})
    straight = Trainer(cfg("a", 6), verbose=False).train()["losses"]
    Trainer(cfg("b", 3), verbose=False).train()
    resumed = Trainer(cfg("b", 6), verbose=False)
    result = resumed.train()
    assert resumed.resumed_from is not None
    np.testing.assert_array_equal(result["losses"], straight)


def test_mask_and_regularisation_settings_are_checked_before_anything_loads(tmp_path):
    images = draw_images(tmp_path / "img", n_concept=1, n_other=1)
    one = [{"folder_path": images, "resolution": 64}]
    cases = [
        ({"datasets": [{**one[0], "mask_path": str(tmp_path / "none")}]},
         r"datasets\[0\].mask_path: no such folder"),
        ({"datasets": [{**one[0], "mask_min_value": 2}]}, r"datasets\[0\].mask_min_value: a weight in \[0, 1\)"),
        ({"datasets": one, "train": {"reg_weight": 0.5}}, r"train.reg_weight: no dataset has is_reg: true"),
        ({"datasets": one, "train": {"prior_loss_weight": 0.5}}, r"train.reg_weight: no dataset has is_reg"),
        ({"datasets": [{**one[0], "is_reg": True}]}, r"datasets: every dataset is is_reg: true"),
        ({"datasets": [one[0], {**one[0], "is_reg": True}], "train": {"reg_ratio": 1}},
         r"train.reg_ratio: .* in \(0, 1\), got 1"),
        ({"datasets": [one[0], {**one[0], "is_reg": True}], "train": {"reg_weight": -1}},
         r"train.reg_weight: .* >= 0, got -1"),
    ]
    for top, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            image_config(tmp_path, "x", None, images, model=RANDOM, **top)
    assert not os.path.exists(tmp_path / "x")


def test_checkpoints_written_before_the_new_dataset_fields_still_resume():
    images = {"folder_path": "img", "resolution": 64}
    new = config_from_dict({"datasets": [images], "model": {"size": "flux-tiny"}}, check_files=False)
    from flame_models.training.config import config_dict
    cur = config_dict(new)
    old = {**cur, "datasets": [{k: v for k, v in d.items() if k not in ("mask_path", "alpha_mask", "invert_mask",
                                                                         "mask_min_value", "is_reg")}
                               for d in cur["datasets"]]}
    old["train"] = {k: v for k, v in cur["train"].items() if k not in ("reg_weight", "reg_ratio")}
    assert compare(old, cur) == ([], [])
    changed = {**cur, "datasets": [{**cur["datasets"][0], "resolution": 128}]}
    assert [p for p, _, _ in compare(old, changed)[0]] == ["datasets"]


def test_the_mask_flag_gives_the_data_folder_its_masks(tmp_path, capsys):
    images = draw_images(tmp_path / "img", n_concept=1, n_other=1)
    masks = _half_masks(images, tmp_path / "masks")
    args = ["--data", images, "--resolution", "64", "--output", str(tmp_path), "--device", "cpu"]
    cfg, _, _ = train.build_config(train.parser().parse_args(args + ["--mask", masks]))
    assert cfg.datasets[0].mask_path == masks
    assert train.main(["--mask", masks, "--output", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --mask: give the images' folder too (--data)\n"


def test_a_validation_split_keeps_each_image_its_own_mask_and_leaves_regularisation_folders_whole(tmp_path):
    from flame_models.training.image_data import image_datasets
    images = draw_images(tmp_path / "img")
    masks = tmp_path / "masks"
    masks.mkdir()
    names = sorted(f for f in os.listdir(images) if f.endswith(".png"))
    for k, f in enumerate(names):                                     # each mask its own gray level
        Image.fromarray(np.full((64, 64), 20 * k, np.uint8)).save(masks / f)
    reg = draw_images(tmp_path / "reg", n_concept=0, n_other=4)
    ds = [{"folder_path": images, "mask_path": str(masks), "resolution": 64, "bucket_tolerance": 32},
          {"folder_path": reg, "is_reg": True, "resolution": 64, "bucket_tolerance": 32}]
    cfg = image_config(tmp_path, "v", None, images, datasets=ds, model=RANDOM, validation={"split": 0.34})
    train_ds, held = image_datasets(cfg, verbose=False)
    assert len(held.records) == 2 and all(r.path.startswith(images) for r in held.records)   # none from reg/
    assert sum(train_ds.is_reg(i) for i in range(len(train_ds))) == 4                       # reg/ stays whole
    for i in range(len(train_ds)):                                    # the selected records keep their own masks
        spec = train_ds.mask_spec(i)
        if not train_ds.is_reg(i):
            k = names.index(os.path.basename(train_ds.record(i).path))
            assert os.path.basename(spec.path) == names[k]
            np.testing.assert_allclose(spec.weights(), 20 * k / 255, rtol=1e-6)
    assert not held.has_masks and not held.has_reg                    # the validation loss is the plain loss
