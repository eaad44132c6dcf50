"""`python -m flame_models.train` as a new user meets it: the resume command it prints, the random model it warns
about, --allow-upscale, the SD3 position-table limit checked before any work, the loss summary's wording, and the
demo's pretraining step on the graph path."""
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from flame_models import train
from flame_models.training.family import available_families, get_family

from .conftest import draw_images, tiny_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# ----------------------------------------------------------------------------- the command
def test_the_module_runs_as_a_command_with_the_examples_flags():
    r = subprocess.run([sys.executable, "-m", "flame_models.train", "--help"], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": REPO, "OPENBLAS_NUM_THREADS": "1"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m flame_models.train")
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_flux_lora", os.path.join(REPO, "examples",
                                                                                "train_flux_lora.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main is train.main and example.parser is train.parser    # the demo entry is the command


def test_the_resume_command_never_repeats_fresh(monkeypatch):
    cfg = type("Cfg", (), {"name": "run"})()
    monkeypatch.setattr(sys, "argv", ["examples/train_flux_lora.py"])
    for flag in ("--fresh", "--fre", "--fr"):
        cmd = train.resume_command(["--config", "my.yaml", flag, "--steps", "9"], cfg, demo=False)
        assert cmd.endswith("examples/train_flux_lora.py --config my.yaml --steps 9"), cmd
    monkeypatch.setattr(sys, "argv", [train.__file__])                 # python -m flame_models.train
    assert train.resume_command(["--fresh"], cfg, demo=True).endswith(" -m flame_models.train --name run")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flame-train"])        # the console script
    assert train.resume_command(["--data", "d", "--fresh"], cfg, demo=False) == "/venv/bin/flame-train --data d"


@pytest.mark.parametrize("first, last, words", [(1.0, 0.5, "2.00x lower"), (0.5, 0.52, "1.04x higher"),
                                                (0.3, 0.3, "unchanged")])
def test_the_loss_summary_says_lower_or_higher_as_it_went(first, last, words):
    assert train.loss_change(first, last) == words


# ----------------------------------------------------------------------------- a random model, said loudly
def test_help_says_which_random_model_each_arch_trains_without_model(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a tiny RANDOM model per --arch" in text
    for arch in available_families():
        assert f"{get_family(arch).default_size} ({arch})" in text


def test_training_without_a_model_file_warns_at_start(tmp_path, capsys):
    from flame_models.training.trainer import Trainer
    Trainer(tiny_config(tmp_path, "random", steps=1, train={"lr_warmup_steps": 0})).setup()
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("WARNING: no model file given") and "RANDOM flux-tiny (flux)" in first


# ----------------------------------------------------------------------------- --allow-upscale
def test_allow_upscale_flag_trains_images_smaller_than_their_bucket(tmp_path):
    from flame_models.training.image_data import image_dataset
    images = draw_images(tmp_path / "small", n_concept=2, n_other=2, size=48)   # smaller than the 64 buckets
    common = ["--data", images, "--resolution", "64", "--output", str(tmp_path), "--device", "cpu"]
    cfg, _, _ = train.build_config(train.parser().parse_args(common))
    assert not cfg.datasets[0].allow_upscale
    with pytest.raises(Exception, match="smaller than its 64x64 bucket.*--allow-upscale"):
        image_dataset(cfg, verbose=False)
    cfg, _, _ = train.build_config(train.parser().parse_args(common + ["--allow-upscale"]))
    assert cfg.datasets[0].allow_upscale
    assert len(image_dataset(cfg, verbose=False)) == 4


def test_allow_upscale_without_image_data_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"training_folder: {tmp_path}\nmodel: {{size: flux-tiny}}\n"
                    f"synthetic: {{num_samples: 4, height: 32, width: 32}}\n")
    assert train.main(["--config", str(path), "--allow-upscale"]) == 2
    assert capsys.readouterr().err == "error: --allow-upscale: needs an image dataset (--data or the config's " \
                                      "datasets)\n"


# ----------------------------------------------------------------------------- a finished run, run again
def test_running_a_finished_run_again_says_so_without_encoding(tmp_path, capsys):
    images = draw_images(tmp_path / "images", n_concept=2, n_other=2, size=64)
    argv = ["--data", images, "--resolution", "64", "--output", str(tmp_path), "--device", "cpu", "--steps", "1",
            "--name", "done", "--rank", "2", "--sample-every", "0"]
    assert train.main(argv) == 0
    assert "latents: encoding 4 of 4" in capsys.readouterr().out
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "this run already finished: step 1 of 1" in out and "already finished before this run; its files:" in out
    assert "encoding" not in out and "text encoders:" not in out and "\nwrote:" not in out


# ----------------------------------------------------------------------------- SD3's position table
def test_an_sd3_bucket_beyond_the_position_table_is_refused_before_any_work(tmp_path, capsys):
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1, size=256)
    Image.new("RGB", (768, 256), (30, 90, 200)).save(tmp_path / "images" / "wide.png")   # a 3:1 bucket
    (tmp_path / "images" / "wide.txt").write_text("a wide blue band")
    args = ["--arch", "sd3", "--data", images, "--resolution", "256", "--steps", "1", "--output", str(tmp_path),
            "--device", "cpu", "--sample-every", "0"]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("error:"))
    assert line.startswith("error: datasets[0].resolution 256: the 384x128 bucket exceeds 256 px a side, the most "
                           "this SD3 model takes (its position table holds 16x16 patches (pos_embed_max_size)")
    assert not os.path.exists(tmp_path / "sd3_lora")                     # nothing written: no --fresh needed next
    assert not os.path.exists(tmp_path / "images" / ".flame_cache" / "latents")   # nothing encoded
    os.remove(tmp_path / "images" / "wide.png")
    assert train.main(args) == 0                                           # the same command, its buckets within


def test_sd3_previews_larger_than_the_position_table_are_refused(tmp_path):
    from flame_models.training.config import ConfigError
    from flame_models.training.trainer import Trainer

    from .conftest import make_samples
    samples = make_samples(tmp_path / "samples", txt=(8, 32), pooled=16)
    cfg = tiny_config(tmp_path, "sd3", model={"arch": "sd3", "size": "sd3.5-tiny"}, synthetic=None,
                      datasets=[{"folder_path": samples}], sample={"sample_every": 1, "width": 512, "height": 256})
    with pytest.raises(ConfigError, match="sample.width x height 512x256: exceeds 256 px a side"):
        Trainer(cfg, verbose=False).setup()


# ----------------------------------------------------------------------------- the demo's pretraining
def test_the_demo_pretraining_takes_the_graph_path_with_the_same_losses(tmp_path, monkeypatch):
    """On cuda the pretraining step goes through StepGraphs (graphs.py) as the trainer's does; on the cpu its
    graphs run eagerly, so the path (StepGraphs, gradients zeroed in place) must give the eager losses exactly."""
    from flame_models.flux import demo
    from flame_models.flux.tiny import tiny_flux_parts
    from flame_models.training import graphs
    from flame_models.training.analytic_vae import analytic_vae
    images = draw_images(tmp_path / "images", n_concept=1, n_other=4, size=32)

    def losses():
        parts = tiny_flux_parts(0, corpus=demo.corpus())
        parts["vae"] = analytic_vae()
        return demo.pretrain_base(parts, images, steps=4, batch_size=2, max_length=8, progress=False)

    eager = losses()
    used = []
    real = graphs.StepGraphs

    class Recorded(real):
        def for_args(self, args):
            used.append(len(args))
            return super().for_args(args)

    monkeypatch.setattr(graphs, "graph_plan", lambda *a: (True, None))
    monkeypatch.setattr(graphs, "StepGraphs", Recorded)
    assert losses() == eager and used == [5] * 4
    assert np.isfinite(eager).all()


def test_the_demo_bullseye_keeps_its_three_rings_as_the_vae_sees_it(tmp_path):
    """The analytic VAE averages 8x8 pixels (analytic_vae.py): each concept image, pooled so, must still read red
    centre, white ring, red ring along every ray from its centre -- rings narrower than that pooling leave the
    samples only the bullseye's colours."""
    import itertools

    from flame_models.flux.demo import DEMO_SIZE, draw_dataset
    folder = draw_dataset(str(tmp_path / "images"), n_concept=12, n_other=0, size=DEMO_SIZE)
    n = DEMO_SIZE // 8
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".png")):
        px = np.asarray(Image.open(os.path.join(folder, name)), dtype=np.float64)
        lat = px.reshape(n, 8, n, 8, 3).mean(axis=(1, 3))
        red = (lat[..., 0] > 170) & (lat[..., 1] < 90) & (lat[..., 2] < 90)
        label = np.where(lat.min(axis=-1) > 200, "W", np.where(red, "R", "."))
        c = n // 2
        for ray in (label[c, c:], label[c, c - 1::-1], label[c:, c], label[c - 1::-1, c]):
            bands = [k for k, _ in itertools.groupby(x for x in ray if x != ".")]
            assert bands[:3] == ["R", "W", "R"], (name, "".join(ray))
