"""Sizes are checked against the model and the device before anything is allocated: a step count beyond the stated
bound, an adapter rank above its layers' min(in, out) or beyond the device's memory, and a generated image beyond the
stated side or the device's memory are one-line errors (exit 2), not a traceback or an out-of-memory machine."""
import importlib.util
import os

import pytest

from flame_models import generate as G
from flame_models.training import limits
from flame_models.training.config import ConfigError, load_config
from flame_models.training.trainer import Trainer

from .conftest import make_samples, tiny_config

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_flux_lora", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("steps", ["1e12", 1e12, 10 ** 6 + 1])
def test_a_step_count_beyond_the_bound_is_a_config_error(tmp_path, steps):
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  steps: {steps}\nsynthetic:\n  num_samples: 4\n")
    with pytest.raises(ConfigError, match=r"train\.steps: at most 1,000,000 optimizer steps, got "):
        load_config(str(path))


def test_micro_batches_are_bounded_too(tmp_path):
    with pytest.raises(ConfigError, match=r"steps x gradient_accumulation_steps: at most 10,000,000 micro-batches"):
        tiny_config(tmp_path, "m", steps=10 ** 6, train={"gradient_accumulation_steps": 11})


def test_the_example_exits_2_on_steps_1e12(example, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"training_folder: {tmp_path}\ntrain:\n  steps: 1e12\nsynthetic:\n  num_samples: 4\n")
    assert example.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.steps: at most 1,000,000 optimizer steps, got 1,000,000,000,000" in err and "Traceback" not in err


def test_a_rank_above_the_layers_dimensions_is_refused_before_adapters_are_made(tmp_path):
    c = tiny_config(tmp_path, "r", steps=4, network={"linear": 1000000})
    tr = Trainer(c, verbose=False)
    with pytest.raises(ConfigError, match=r"network\.linear: rank 1,000,000 exceeds min\(in, out\) of 26 of the 26 "
                                          r"targeted layers \(e\.g\. .*: 64 in, \d+ out\); at most 64"):
        tr.setup()
    assert not [n for n, p in tr.model.named_parameters() if "lora" in n]   # nothing was allocated
    Trainer(tiny_config(tmp_path, "ok", steps=4, network={"linear": 64}), verbose=False).setup()  # the largest


def test_the_example_exits_2_on_rank_1000000(example, tmp_path, capsys, flux_file):
    args = ["--model", flux_file, "--data", make_samples(tmp_path / "d", n=2), "--output", str(tmp_path), "--rank",
            "1000000", "--steps", "2"]
    assert example.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: network.linear: rank 1,000,000 exceeds min(in, out)") and "Traceback" not in err


def test_adapters_that_do_not_fit_the_device_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(limits, "host_memory", lambda: 100_000)    # a machine of 100 kB
    c = tiny_config(tmp_path, "mem", steps=4, network={"linear": 16})
    with pytest.raises(ConfigError, match=r"network\.linear: rank 16 makes [\d,]+ adapter parameters on 26 layers, .* "
                                          r"with their gradients and optimizer moments: more than the 97.66 KiB of "
                                          r"host memory"):
        Trainer(c, verbose=False).setup()


def test_generate_refuses_a_side_beyond_the_limit_before_loading_anything(flux_file, capsys):
    args = ["--model", flux_file, "--prompt", "a cat", "--device", "cpu"]
    assert G.main(args + ["--width", "100000", "--height", "100000"]) == 2
    assert capsys.readouterr().err.strip() == "error: --width 100000: at most 16384 pixels per side"


def test_generate_refuses_an_image_that_does_not_fit_the_device(flux_file, capsys, monkeypatch):
    monkeypatch.setattr(limits, "host_memory", lambda: 4 * 2 ** 30)  # 4 GiB
    args = ["--model", flux_file, "--prompt", "a cat", "--device", "cpu"]
    assert G.main(args + ["--width", "4096", "--height", "4096"]) == 2
    assert "error: --width 4096 --height 4096: 1 image(s) of 17 MP need about 10.00 GiB for their latents and " \
           "activations, more than the 4.00 GiB of host memory" in capsys.readouterr().err
    assert limits.image_problem(1024, 1024, 2, "cpu") is None
    assert "max_gpu_memory" in limits.image_problem(4096, 4096, 1, "cuda", budget=2 ** 30)
