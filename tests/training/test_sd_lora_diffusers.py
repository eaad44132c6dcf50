"""diffusers reads FLAME's SD3 and SDXL LoRA files as FLAME means them: the fixtures of
tests/fixtures/make_sd_lora_flame_files.py (LoRAs written by flame_nn.adapters.save_adapters) were loaded by diffusers
in tests/fixtures/make_sd_lora_diffusers.py (StableDiffusion3Pipeline / StableDiffusionXLPipeline's lora_state_dict
and load_lora_into_*), and FLAME, loading the same files, computes the same outputs. Which layouts diffusers reads
is recorded there: SD3 PEFT, SDXL PEFT and SDXL kohya (SAI names); SD3's kohya names (lora_unet_joint_blocks_...)
are ComfyUI's and kohya's, which diffusers 0.42 does not convert."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io

from .conftest import FIXTURES, fixture_script

OUT = os.path.join(FIXTURES, "sd_lora")


def _run(arch, model, x):
    t = {k: flame.tensor(v, device="cpu") for k, v in x.items()}
    with flame.no_grad():
        if arch == "sd3":
            return model(t["x"], t["t"], t["y"], t["context"]).numpy()
        return model(t["x"], t["t"], t["context"], t["y"]).numpy()


def _close(got, want, what):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, f"{what}: max error {err:.3g} of the output's scale"


@pytest.mark.parametrize("arch", ["sd3", "sdxl"])
def test_diffusers_computes_flames_lora_outputs(arch):
    with open(os.path.join(OUT, "diffusers_outputs.json")) as f:
        report = json.load(f)
    golden = {k: v.numpy() for k, v in io.load_file(os.path.join(OUT, "diffusers_outputs.safetensors")).items()}
    x = {k: v.numpy() for k, v in io.load_file(os.path.join(OUT, f"{arch}_inputs.safetensors")).items()}
    maker = fixture_script("make_sd_lora_flame_files")
    _close(_run(arch, maker.base_model(arch), x), golden[f"{arch}_base"], f"{arch} base")
    read = [fmt for fmt in ("peft", "kohya") if report[f"{arch}_{fmt}"].startswith("loaded")]
    assert read == (["peft"] if arch == "sd3" else ["peft", "kohya"]), report
    for fmt in read:
        model = maker.base_model(arch)
        A.load_adapters(model, os.path.join(OUT, f"{arch}_{fmt}.safetensors"))
        got = _run(arch, model, x)
        assert np.abs(got - golden[f"{arch}_base"]).max() > 1e-2 * np.abs(golden[f"{arch}_base"]).max()
        _close(got, golden[f"{arch}_{fmt}"], f"{arch} {fmt}")


@pytest.mark.parametrize("arch", ["sd3", "sdxl"])
def test_the_fixture_files_are_what_flame_writes(arch, tmp_path):
    """The committed LoRA files are FLAME's output for the generator's seed (so the check above is about FLAME's
    files, not stale ones)."""
    maker = fixture_script("make_sd_lora_flame_files")
    model = maker.with_lora(arch, {"sd3": 1, "sdxl": 2}[arch])
    for fmt in ("peft", "kohya"):
        path = str(tmp_path / f"{fmt}.safetensors")
        A.save_adapters(model, path, fmt)
        now, saved = io.load_file(path), io.load_file(os.path.join(OUT, f"{arch}_{fmt}.safetensors"))
        assert sorted(now) == sorted(saved)
        for k in now:
            np.testing.assert_array_equal(now[k].numpy(), saved[k].numpy(), err_msg=k)
