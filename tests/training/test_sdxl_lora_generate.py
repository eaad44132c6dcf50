"""SDXL LoRA files read back by `python -m flame_models.generate`: a file applies to each part it has keys for -- the
UNet-only file (the trainer's default output: no train.train_text_encoder), a text-encoder-only file, both -- and a
file with keys for no part of the model is refused, naming it (exit 2)."""
import os

import numpy as np
from PIL import Image

from flame_core import io
from flame_models.generate import main
from flame_models.training.trainer import Trainer

from .conftest import FIXTURES
from .test_sd_families import images, sdxl_config, sdxl_model  # noqa: F401 (fixtures)

TE_FILE = os.path.join(FIXTURES, "te_lora", "sdxl_te_kohya.safetensors")   # UNet + CLIP-L + CLIP-G parts


def _argv(model, out, *extra):
    return ["--model", model, "--prompt", "ohwx on a blue background", "--width", "64", "--height", "64", "--steps",
            "2", "--seed", "3", "--output", str(out), "--no-progress", "--device", "cpu", *extra]


def _generate(capsys, model, out, *extra):
    rc = main(_argv(model, out, *extra))
    err = capsys.readouterr().err
    assert rc == 0, err
    (name,) = os.listdir(out)
    return np.asarray(Image.open(out / name)).astype(np.int16)


def _part(tmp_path, prefixes, name):
    """The tensors of TE_FILE whose names start with `prefixes`, as their own file."""
    path = str(tmp_path / name)
    io.save_file({k: v for k, v in io.load_file(TE_FILE).items() if k.startswith(prefixes)}, path)
    return path


def test_the_trainers_default_sdxl_lora_generates(tmp_path, images, sdxl_model, capsys):  # noqa: F811
    cfg = sdxl_config(tmp_path, "unet_only", sdxl_model, images, steps=2)
    lora = Trainer(cfg, verbose=False).setup().train()["lora"]
    assert not any(k.startswith(("lora_te", "text_encoder")) for k in io.load_file(lora))   # the UNet's only
    plain = _generate(capsys, sdxl_model, tmp_path / "plain")
    got = _generate(capsys, sdxl_model, tmp_path / "lora", "--lora", f"{lora}:4")
    assert np.abs(got - plain).max() > 0, "the LoRA changed nothing"


def test_each_part_of_an_sdxl_lora_file_applies_alone(tmp_path, sdxl_model, capsys):  # noqa: F811
    plain = _generate(capsys, sdxl_model, tmp_path / "plain")
    both = _generate(capsys, sdxl_model, tmp_path / "both", "--lora", TE_FILE)
    unet = _generate(capsys, sdxl_model, tmp_path / "unet", "--lora", _part(tmp_path, "lora_unet_", "unet.st"))
    te = _generate(capsys, sdxl_model, tmp_path / "te", "--lora", _part(tmp_path, "lora_te", "te.st"))
    for got in (both, unet, te):
        assert np.abs(got - plain).max() > 0, "a part changed nothing"
    assert np.abs(unet - te).max() > 0 and np.abs(both - unet).max() > 0 and np.abs(both - te).max() > 0


def test_an_sdxl_lora_file_for_no_part_of_the_model_is_refused(tmp_path, sdxl_model, capsys):  # noqa: F811
    flux_lora = os.path.join(FIXTURES, "lora", "kohya_src.safetensors")
    assert main(_argv(sdxl_model, tmp_path / "out", "--lora", flux_lora)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lora ") and flux_lora in err, err
    # keys for a text encoder SDXL does not have (a third one)
    third = str(tmp_path / "te3.safetensors")
    io.save_file({k.replace("lora_te2_", "lora_te3_"): v for k, v in io.load_file(TE_FILE).items()
                  if k.startswith("lora_te2_")}, third)
    assert main(_argv(sdxl_model, tmp_path / "out", "--lora", third)) == 2
    err = capsys.readouterr().err
    assert f"--lora {third}" in err and "text encoder" in err, err
    assert not os.path.exists(tmp_path / "out")                 # refused before anything was made
