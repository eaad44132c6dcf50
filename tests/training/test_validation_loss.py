"""The validation loss (`validation:`): held-out images -- a folder, or a split of the training folders that is never
trained on -- evaluated at fixed timesteps with fixed noise: the same value twice and in a fresh run, equal to a
direct computation, untouched by (and not touching) the training's random streams, logged to validation.csv and
TensorBoard and drawn in loss.png; through the training command, across a resume, and for every family."""
import csv
import os
import shutil

import numpy as np
import pytest
import yaml
from PIL import Image

import flame_core as flame
from flame_models import train
from flame_models.data import DatasetConfig, ImageDataset, evaluation_config, split_records
from flame_models.data.errors import DataError
from flame_models.training.config import ConfigError
from flame_models.training.logging import plot_losses
from flame_models.training.trainer import Trainer
from flame_models.training.validation_loss import noise_seed, timestep_values

from .conftest import draw_images, image_config


@pytest.fixture
def images(tmp_path):
    return draw_images(tmp_path / "images", wide=2)


@pytest.fixture
def held_out(tmp_path):
    """A separate folder of 3 drawings (other names, other pictures) to validate on."""
    folder = tmp_path / "held_out"
    folder.mkdir()
    for i, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
        im = Image.new("RGB", (64, 64), (128, 128, 128))
        im.paste(colour, (16, 16, 48, 48))
        im.save(folder / f"val_{i}.png")
        (folder / f"val_{i}.txt").write_text(f"[trigger] a square of colour {i}")
    return str(folder)


def _run(tmp_path, name, model, images, steps=4, **top):
    return Trainer(image_config(tmp_path, name, model, images, steps=steps, **top), verbose=False)


# ----------------------------------------------------------------------------- the number
def test_the_validation_loss_is_the_same_twice_and_in_a_fresh_run(tmp_path, tiny_model, images, held_out):
    val = {"validation": {"folder_path": held_out, "every": 2}}
    a = _run(tmp_path, "a", tiny_model, images, **val).setup()
    first = a.validate()
    assert first["images"] == 3 and len(first["per_timestep"]) == 5
    assert a.validate()["loss"] == first["loss"]                 # the same step: the same value, bit for bit
    for _ in range(2):
        a.train_step()
    moved = a.validate()
    assert moved["loss"] != first["loss"]                        # the adapters moved: so does the loss
    b = _run(tmp_path, "b", tiny_model, images, **val).setup()   # a fresh run with the same seed
    assert b.validate()["loss"] == first["loss"]
    for _ in range(2):
        b.train_step()
    assert b.validate()["loss"] == moved["loss"]
    # the batch size of the evaluation changes nothing but the grouping (each image has its own noise)
    c = _run(tmp_path, "c", tiny_model, images, validation={"folder_path": held_out, "batch_size": 1}).setup()
    np.testing.assert_allclose(c.validate()["per_timestep"], first["per_timestep"], rtol=1e-6)


def test_the_validation_loss_equals_a_direct_computation(tmp_path, tiny_model, images, held_out):
    tr = _run(tmp_path, "direct", tiny_model, images, train={"batch_size": 2},
              validation={"folder_path": held_out, "timesteps": [100, 700], "seed": 7}).setup()
    for _ in range(2):
        tr.train_step()                                          # adapters away from their zero start
    got = tr.validate()
    data, fam, model = tr.validation.loss.data, tr.family, tr.model
    model.eval()
    want = np.zeros((len(data), 2))
    with flame.no_grad():
        for i in range(len(data)):                               # one image at a time, float64 on the host
            x0, cond = fam.training_inputs(model, data.collate([data.get(i, 0)]), tr.device, tr.cfg.train)
            key = data.dataset.samples[i].key
            for k, sigma in enumerate([0.1, 0.7]):
                eps = flame.randn(*x0.shape, generator=flame.Generator("cpu").manual_seed(noise_seed(7, key, k)),
                                  dtype=flame.float32, device="cpu").numpy().astype(np.float64)
                x = x0.numpy().astype(np.float64)
                x_t = flame.tensor(((1 - sigma) * x + sigma * eps).astype(np.float32), device=tr.device)
                pred = fam.forward(model, x_t, flame.tensor(np.full(1, sigma, np.float32), device=tr.device),
                                   cond).numpy()
                want[i, k] = np.mean((pred.astype(np.float64) - (eps - x)) ** 2)
    model.train()
    np.testing.assert_allclose(got["per_timestep"], want.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(got["loss"], want.mean(), rtol=1e-5)


def test_the_training_random_streams_neither_change_it_nor_are_changed_by_it(tmp_path, tiny_model, images, held_out):
    tr = _run(tmp_path, "rng", tiny_model, images, validation={"folder_path": held_out}).setup()
    before = tr.validate()["loss"]
    flame.randn(5, generator=tr.noise_gen, device=tr.device)     # every training stream moved on
    flame.rand(5, generator=tr.sigma_gen)
    flame.randn(5)
    np.random.seed(123)
    assert tr.validate()["loss"] == before
    # and a run that validates trains exactly as one that does not: its losses and adapters are the same
    states = (tr.noise_gen.get_state(), tr.sigma_gen.get_state(), flame.get_rng_state("cpu"))
    tr.validate()
    after = (tr.noise_gen.get_state(), tr.sigma_gen.get_state(), flame.get_rng_state("cpu"))
    for s, t in zip(states, after):
        np.testing.assert_array_equal(np.asarray(s), np.asarray(t))
    # (the second run reads the text embeddings the first cached: the held-out captions joined the encoder's batches
    # there, which moves the last float bit of an embedding)
    disk = {"datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32,
                          "cache_latents_to_disk": True}]}
    with_val = _run(tmp_path, "with", tiny_model, images, validation={"folder_path": held_out, "every": 1},
                    **disk).train()
    without = _run(tmp_path, "without", tiny_model, images, **disk).train()
    assert len(with_val["validation_losses"]) == 5
    assert with_val["losses"] == without["losses"]


# ----------------------------------------------------------------------------- the split
def test_the_split_holds_out_images_that_are_never_trained_on_and_stays_the_same(tmp_path, tiny_model, images):
    cfg = image_config(tmp_path, "split", tiny_model, images, validation={"split": 0.25, "seed": 3})
    tr = Trainer(cfg, verbose=False).setup()
    trained = {r.path for r in tr.dataset.records}
    held = {r.path for r in tr.validation_images.records}
    assert len(held) == 2 and len(trained) == 6 and not trained & held
    assert trained | held == {os.path.join(images, f) for f in os.listdir(images) if f.endswith(".png")}
    for _ in range(2 * tr.loader.sampler.batches_per_epoch):    # two epochs of batches: no held-out latents
        batch = tr.loader.next_batch()
        assert not {tr.dataset.samples[i].key.split("|")[1] for i in batch["indices"]} & {
            os.path.basename(p) for p in held}
    # held-out images are read once each, without augmentation, at every resolution of their folder
    assert {s.key.split("|")[1] for s in tr.validation_images.samples} == {os.path.basename(p) for p in held}
    # the same in another run and whatever the order the folder is listed in; another training seed keeps it,
    # another validation seed changes it
    full = ImageDataset(cfg.datasets, seed=cfg.train.seed, progress=False)
    order = list(reversed(range(len(full.records))))
    full.records = [full.records[i] for i in order]
    full.raw_captions = [full.raw_captions[i] for i in order]
    full.record_config = [full.record_config[i] for i in order]
    full.controls = [full.controls[i] for i in order]
    assert {full.records[i].path for i in split_records(full, 0.25, 3)[1]} == held
    other = Trainer(image_config(tmp_path, "split2", tiny_model, images, train={"seed": 9},
                                 validation={"split": 0.25, "seed": 3}), verbose=False).setup()
    assert {r.path for r in other.validation_images.records} == held
    changed = [{full.records[i].path for i in split_records(full, 0.25, s)[1]} for s in range(4, 12)]
    assert any(c != held for c in changed)


def test_a_split_holds_out_a_share_of_each_folder_and_refuses_to_leave_none(tmp_path):
    a = draw_images(tmp_path / "a", n_concept=2, n_other=2)
    b = draw_images(tmp_path / "b", n_concept=1, n_other=1)
    ds = ImageDataset([DatasetConfig(folder_path=a, resolution=64, bucket_tolerance=32),
                       DatasetConfig(folder_path=b, resolution=64, bucket_tolerance=32, num_repeats=3,
                                     flip_x=True, caption_dropout_rate=0.5)], progress=False)
    train_idx, held = split_records(ds, 0.3, 0)
    assert sorted(ds.record_config[i] for i in held) == [0, 1]        # round(0.3 * 4) = 1 and at least 1 of 2
    val = ds.select(held, [evaluation_config(c) for c in ds.configs])
    assert len(val) == 2                                          # no repeats, no flips
    assert all(r.caption_dropout_rate == 0 for r in val.configs)
    assert len(ds.select(train_idx)) == 3 + 3 * 2                 # 3 images of a; b's other one, 3 repeats x 2 flips
    with pytest.raises(DataError, match=r"datasets\[1\]: validation split 0.75 of its 2 image\(s\) leaves none"):
        split_records(ds, 0.75, 0)


# ----------------------------------------------------------------------------- the logs
def test_the_log_tensorboard_and_plot_hold_the_validation_loss(tmp_path, tiny_model, images):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tr = _run(tmp_path, "logs", tiny_model, images, steps=5,
              validation={"split": 0.25, "every": 2, "timesteps": 2}, logging={"use_tensorboard": True})
    result = tr.train()
    with open(result["validation_csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "loss_t250", "loss_t750", "seconds"]
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 5]             # before the first step, every 2, the last
    for r in rows:
        assert float(r["loss"]) == pytest.approx((float(r["loss_t250"]) + float(r["loss_t750"])) / 2, rel=1e-6)
    assert [s for s, _ in result["validation_losses"]] == [0, 2, 4, 5]
    acc = ea.EventAccumulator(str(tmp_path / "logs" / "tensorboard" / "logs"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"validation/loss", "validation/loss_t250", "validation/loss_t750"} <= set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("validation/loss")]
    np.testing.assert_allclose(got, [(int(r["step"]), float(r["loss"])) for r in rows], rtol=1e-6)
    # the plot draws it: orange (validation) next to blue (training)
    px = np.asarray(Image.open(result["loss_plot"]).convert("RGB")).astype(int)
    assert (np.abs(px - [255, 127, 14]).sum(axis=-1) < 30).sum() > 50


@pytest.mark.parametrize("matplotlib", [True, False])
def test_the_plot_draws_the_validation_rows(tmp_path, monkeypatch, matplotlib):
    if not matplotlib:
        import builtins
        real = builtins.__import__

        def no_matplotlib(name, *a, **k):
            if name.startswith("matplotlib"):
                raise ImportError(name)
            return real(name, *a, **k)
        monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    else:
        pytest.importorskip("matplotlib")
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 20)]

    def orange(path):
        px = np.asarray(Image.open(path).convert("RGB")).astype(int)
        return (np.abs(px - [255, 127, 14]).sum(axis=-1) < 30).sum()
    assert orange(plot_losses(rows, str(tmp_path / "a.png"))) == 0
    assert orange(plot_losses(rows, str(tmp_path / "b.png"), validation=[{"step": 0, "loss": 0.9},
                                                                          {"step": 10, "loss": 0.5}])) > 20


def test_a_resumed_run_continues_the_validation_log_with_the_same_values(tmp_path, tiny_model, images):
    val = {"validation": {"split": 0.25, "every": 2}}
    full = _run(tmp_path, "full", tiny_model, images, steps=4, **val).train()
    part = _run(tmp_path, "part", tiny_model, images, steps=3, **val)
    part.train()                                                   # checkpoints at 2 and 3 (the end)
    shutil.rmtree(os.path.join(part.out, "checkpoints", "step_000003"), ignore_errors=True)
    for f in os.listdir(os.path.join(part.out, "checkpoints")):
        if f.startswith("step_000003"):
            shutil.rmtree(os.path.join(part.out, "checkpoints", f))
    again = _run(tmp_path, "part", tiny_model, images, steps=4, **val)
    result = again.train()
    assert again.resumed_from and "step_000002" in again.resumed_from
    assert [s for s, _ in result["validation_losses"]] == [0, 2, 4]  # step 3's row (after the checkpoint) is gone
    np.testing.assert_allclose([v for _, v in result["validation_losses"]],
                               [v for _, v in full["validation_losses"]], rtol=1e-6)


# ----------------------------------------------------------------------------- the config
def test_timesteps_are_a_list_or_a_count():
    assert timestep_values(4) == [125.0, 375.0, 625.0, 875.0]
    assert timestep_values([10, 350.5]) == [10.0, 350.5]
    assert timestep_values([10, 350.5], integer=True) == [10.0, 350.0]


def test_the_validation_section_is_checked_with_its_peers_names(tmp_path, images, held_out):
    base = {"datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32}]}
    from flame_models.training.config import config_from_dict
    c = config_from_dict({**base, "validation": {"validation_split": 0.1, "validate_every_n_steps": 5,
                                                 "eval_timesteps": 3, "validation_seed": 1,
                                                 "max_validation_steps": 2}})
    v = c.validation
    assert (v.split, v.every, v.timesteps, v.seed, v.max_batches) == (0.1, 5, 3, 1, 2)
    assert config_from_dict({**base, "validation": {"folder_path": held_out, "eval_steps_interval": 7}}
                            ).validation.every == 7
    cases = [({}, "validation: give folder_path"),
             ({"split": 0.1, "folder_path": held_out}, "validation.split: given together with folder_path"),
             ({"split": 1.5}, r"validation.split: a fraction .* in \(0, 1\), got 1.5"),
             ({"split": 0.1, "every": 0}, "validation.every: must be >= 1"),
             ({"split": 0.1, "timesteps": [10, 1000]}, r"validation.timesteps\[1\]: a timestep in \[0, 1000\)"),
             ({"split": 0.1, "timesteps": 0}, "validation.timesteps: a count is an integer from 1"),
             ({"split": 0.1, "timesteps": []}, "validation.timesteps: an empty list"),
             ({"split": 0.1, "timesteps": True}, "validation.timesteps: a count"),
             ({"folder_path": images}, "validation.folder_path: .* overlaps datasets\\[0\\].folder_path"),
             ({"folder_path": os.path.dirname(images)}, "overlaps datasets\\[0\\].folder_path"),
             ({"folder_path": str(tmp_path / "nope")}, "validation.folder_path: no such folder"),
             ({"folder_path": held_out, "control_path": held_out}, "validation.control_path: the flux family "
                                                                   "takes no control images"),
             ({"split": 0.1, "control_path": held_out}, "validation.control_path: only with folder_path"),
             ({"split": 0.1, "batch_size": 0}, "validation.batch_size: must be >= 1"),
             ({"split": 0.1, "every_n": 3}, "validation.every_n: unknown field; did you mean 'every'")]
    for v, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            config_from_dict({**base, "validation": v})
    with pytest.raises(ConfigError, match="validation: needs image folders"):
        config_from_dict({"synthetic": {}, "validation": {"split": 0.1}})


# ----------------------------------------------------------------------------- the command
@pytest.mark.parametrize("how", ["folder", "split"])
def test_the_training_command_runs_with_a_validation_loss(tmp_path, tiny_model, images, held_out, capsys, how):
    val = {"folder_path": held_out, "every": 2} if how == "folder" else {"validation_split": 0.25,
                                                                          "validate_every_n_steps": 2}
    cfg = {"job": "extension", "config": {"name": f"cmd_{how}", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"), "device": "cpu", "trigger_word": "ohwx",
        "network": {"type": "lora", "linear": 4, "linear_alpha": 4, "target": "all_linear"},
        "datasets": [{"folder_path": images, "resolution": 64, "bucket_tolerance": 32}],
        "train": {"steps": 3, "batch_size": 2, "optimizer": "adamw", "lr": 3e-3, "dtype": "fp32",
                  "gradient_checkpointing": False},
        "model": {"name_or_path": tiny_model, "dtype": "fp32", "t5_max_length": 8},
        "sample": {"sample_every": 0}, "save": {"save_every": 10, "dtype": "fp32"},
        "validation": val}]}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert train.main(["--config", str(path)]) == 0
    got = capsys.readouterr()
    out = got.out
    run = tmp_path / "out" / f"cmd_{how}"
    assert f"validation {run / 'validation.csv'}" in " ".join(out.split())
    said = got.out + got.err                                               # (the progress bar's writes)
    assert "validation loss" in said and "at step 2" in said               # each evaluation said as it comes
    with open(run / "validation.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [0, 2, 3]
    assert (run / "loss.png").is_file()


# ----------------------------------------------------------------------------- every family
FAMILIES = {"sdxl": {"arch": "sdxl", "t5_max_length": None}, "sd3": {"arch": "sd3"}, "chroma": {"arch": "chroma"},
            "qwen_image": {"arch": "qwen_image", "t5_max_length": None}}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_family_validates_through_the_one_trainer(tmp_path, images, arch):
    model = {"size": None, "name_or_path": None, "t5_max_length": 8, **FAMILIES[arch]}
    tr = Trainer(image_config(tmp_path, arch, None, images, steps=2, model=model,
                              validation={"split": 0.25, "timesteps": [100, 900]}), verbose=False)
    result = tr.train()
    losses = [v for _, v in result["validation_losses"]]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert tr.validate()["loss"] == losses[-1]                      # the same adapters: the same value
    if arch == "sdxl":                                              # DDPM: integer timesteps, the ε target
        assert tr.validation.loss.values == [100.0, 900.0]


def test_kontext_validates_held_out_pairs_with_their_control_images(tmp_path):
    images = draw_images(tmp_path / "img")
    held = draw_images(tmp_path / "held", n_concept=1, n_other=1)
    controls = {}
    for name, folder in (("ctl", images), ("held_ctl", held)):
        out = tmp_path / name
        out.mkdir()
        for f in os.listdir(folder):
            if f.endswith(".png"):
                Image.fromarray(255 - np.asarray(Image.open(os.path.join(folder, f)).convert("RGB"))).save(out / f)
        controls[name] = str(out)
    model = {"arch": "flux_kontext", "size": None, "name_or_path": None, "t5_max_length": 8}
    ds = [{"folder_path": images, "control_path": controls["ctl"], "resolution": 64, "bucket_tolerance": 32}]
    with pytest.raises(ConfigError, match="validation.control_path: missing"):
        image_config(tmp_path, "k", None, images, model=model, datasets=ds, validation={"folder_path": held})
    cfg = image_config(tmp_path, "k", None, images, steps=2, model=model, datasets=ds,
                       validation={"folder_path": held, "control_path": controls["held_ctl"]})
    tr = Trainer(cfg, verbose=False).setup()
    data = tr.validation.loss.data
    assert data.dataset.has_controls and "control_latents" in data.get(0, 0)
    first = tr.validate()
    assert first["images"] == 2 and np.isfinite(first["loss"]) and tr.validate()["loss"] == first["loss"]


def test_with_trained_text_encoders_the_held_out_captions_go_through_them(tmp_path, images, monkeypatch):
    from flame_models.training.family import get_family
    model = {"size": None, "name_or_path": None, "arch": "sdxl", "t5_max_length": None}
    tr = Trainer(image_config(tmp_path, "te", None, images, steps=1, model=model,
                              train={"train_text_encoder": True}, validation={"split": 0.25}), verbose=False)
    tr.setup()
    fam = get_family("sdxl")
    encoded = []
    real = fam.encode_training_text

    def spy(encoders, cond):
        encoded.append(sorted(cond))
        return real(encoders, cond)
    monkeypatch.setattr(fam, "encode_training_text", spy)
    first = tr.validate()
    assert encoded and np.isfinite(first["loss"])                 # token ids -> the encoders, as in training
    for p in tr.text_encoders.params:                              # only the text encoders' adapters move
        p.data = p.data + 0.05
    assert tr.validate()["loss"] != first["loss"]


def test_the_commands_flags_set_the_validation_section(tmp_path, images, held_out):
    a = train.parser().parse_args(["--data", images, "--resolution", "64", "--validation-split", "0.25"])
    cfg, _, _ = train.build_config(a)
    assert (cfg.validation.split, cfg.validation.folder_path) == (0.25, None)
    a = train.parser().parse_args(["--data", images, "--resolution", "64", "--validation", held_out])
    assert train.build_config(a)[0].validation.folder_path == held_out
    a = train.parser().parse_args(["--data", images, "--resolution", "64", "--validation", held_out,
                                   "--validation-split", "0.1"])
    with pytest.raises(ConfigError, match="validation.split: given together with folder_path"):
        train.build_config(a)


def test_held_out_buckets_larger_than_the_model_takes_are_refused_before_any_model(tmp_path, monkeypatch):
    from flame_models.training.family import get_family
    images = draw_images(tmp_path / "img", n_concept=2, n_other=2)    # squares: 256x256 buckets, within sd3-tiny's
    wide = tmp_path / "wide"
    wide.mkdir()
    Image.new("RGB", (768, 256), (30, 90, 200)).save(wide / "band.png")
    (wide / "band.txt").write_text("a wide blue band")
    fam = get_family("sd3")

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the bad input was found")
    monkeypatch.setattr(fam, "load_vae", loaded)
    ds = [{"folder_path": images, "resolution": 256, "bucket_tolerance": 32, "allow_upscale": True}]
    cfg = image_config(tmp_path, "wide", None, images, datasets=ds, validation={"folder_path": str(wide)},
                       model={"arch": "sd3", "size": None, "name_or_path": None, "t5_max_length": 8})
    with pytest.raises(ConfigError, match=r"validation.folder_path at resolution 256: the \d+x\d+ bucket exceeds "
                                          r"256 px a side"):
        Trainer(cfg, verbose=False).setup()
