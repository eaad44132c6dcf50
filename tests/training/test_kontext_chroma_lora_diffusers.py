"""diffusers reads FLAME's Flux Kontext and Chroma LoRA files as FLAME means them. The files of
tests/fixtures/make_kontext_chroma_lora_flame_files.py (written by flame_nn.adapters.save_adapters, PEFT and kohya
layouts) were loaded by diffusers 0.42.1 in tests/fixtures/make_kontext_chroma_lora_diffusers.py
(FluxKontextPipeline / ChromaPipeline.load_lora_weights; every converted key landed, equal, in a LoRA layer of the
transformer, and no key warning was logged) and run in float64; FLAME, loading the same files, computes the same
outputs (float32, relative error <= 1e-4). The real-width kohya file checks diffusers' split of linear1 / qkv, which
its converter does with FLUX.1's sizes written in."""
import json
import os

import numpy as np
import pytest

import flame_core as flame
import flame_nn.adapters as A
from flame_core import io
from flame_models.bfl.lora_keys import flux_name_map
from flame_nn.adapters import formats as F

from .conftest import FIXTURES, fixture_script

OUT = os.path.join(FIXTURES, "kontext_chroma_lora")
IO = os.path.join(FIXTURES, "kontext_chroma")
RTOL = 1e-4


def _report():
    with open(os.path.join(OUT, "diffusers_outputs.json")) as f:
        return json.load(f)


def _golden():
    return {k: v.numpy() for k, v in io.load_file(os.path.join(OUT, "diffusers_outputs.safetensors")).items()}


def _t(a):
    return flame.tensor(np.ascontiguousarray(a, dtype=np.float32), device="cpu")


def _run(arch, model):
    x = {k: v.numpy() for k, v in io.load_file(os.path.join(IO, f"{arch}_io.safetensors")).items()}
    B = x["hidden_states"].shape[0]
    ids = np.broadcast_to(x["img_ids"], (B,) + x["img_ids"].shape)
    tids = np.broadcast_to(x["txt_ids"], (B,) + x["txt_ids"].shape)
    with flame.no_grad():
        if arch == "kontext":
            return model(img=_t(x["hidden_states"]), img_ids=_t(ids), txt=_t(x["txt"]), txt_ids=_t(tids),
                         timesteps=_t(x["timestep"]), y=_t(x["pooled"]), guidance=_t(x["guidance"])).numpy()
        return model(_t(x["hidden_states"]), _t(ids), _t(x["encoder_hidden_states"]), _t(tids),
                     _t(x["timestep"])).numpy()


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_diffusers_reads_every_layout_flame_writes():
    report = _report()
    assert report["diffusers"] == "0.42.1", report["diffusers"]
    for name in ("kontext_peft", "kontext_kohya", "chroma_peft", "chroma_kohya"):
        assert report[name]["status"].startswith("loaded"), (name, report[name])
        assert "load_lora_weights" in report[name]["how"], report[name]["how"]
    # what diffusers 0.42 does not read (ComfyUI does: test_kontext_chroma_comfy_keys.py), as documented
    assert report["kontext_kohya_outer"]["status"].startswith("not loaded: "), report["kontext_kohya_outer"]
    assert "not a transformer key" in report["kontext_kohya_outer"]["status"]
    assert report["chroma_kohya_approximator"]["status"].startswith("not loaded: "), report["chroma_kohya_approximator"]


@pytest.mark.parametrize("name", ["kontext_peft", "kontext_kohya", "chroma_peft", "chroma_kohya"])
def test_flame_computes_diffusers_outputs_with_the_same_file(name):
    arch = name.split("_")[0]
    maker = fixture_script("make_kontext_chroma_lora_flame_files")
    golden = _golden()
    base = golden[f"{arch}_base"]
    assert _rel(_run(arch, maker.base_model(arch)), base) <= RTOL
    model = maker.base_model(arch)
    A.load_adapters(model, os.path.join(OUT, f"{name}.safetensors"))
    got = _run(arch, model)
    assert _rel(got, base) > 1e-2                       # the LoRA changes the output
    assert _rel(got, golden[name]) <= RTOL, _rel(got, golden[name])


def test_diffusers_splits_real_width_kohya_files_as_flame_joins_them():
    """diffusers' conversion of a kohya linear1 (q | k | v | mlp rows, FLUX.1's sizes) and img_attn.qkv gives, for
    each diffusers Linear, the ΔW = B·A that FLAME's own PEFT form of the same file has."""
    maker = fixture_script("make_kontext_chroma_lora_flame_files")
    converted = {k: v.numpy().astype(np.float64)
                 for k, v in io.load_file(os.path.join(OUT, "realwidth_converted.safetensors")).items()}
    kohya = {k: v.numpy() for k, v in io.load_file(os.path.join(OUT, "realwidth_kohya.safetensors")).items()}
    modules = F.from_kohya(kohya, ["single_blocks.0.linear1", "single_blocks.1.linear1",
                                   "double_blocks.0.img_attn.qkv"])
    ours, _ = F.to_peft(modules, flux_name_map(1, 2, maker.REAL_H, maker.REAL_MLP))
    names = sorted(k[:-len(".lora_A.weight")] for k in ours if k.endswith(".lora_A.weight"))
    assert names == sorted(k[:-len(".lora_A.weight")] for k in converted if k.endswith(".lora_A.weight"))
    assert len(names) == 11                    # to_q, to_k, to_v, proj_mlp of two single blocks; to_q, to_k, to_v
    for n in names:
        want = ours[n + ".lora_B.weight"].astype(np.float64) @ ours[n + ".lora_A.weight"].astype(np.float64)
        got = converted[n + ".lora_B.weight"] @ converted[n + ".lora_A.weight"]
        if n.endswith("single_transformer_blocks.1.proj_mlp"):   # the default targets leave the MLP rows alone
            assert not want.any() and not got.any(), n
        else:
            assert _rel(got, want) <= 1e-6, n


@pytest.mark.parametrize("arch", ["kontext", "chroma"])
def test_the_fixture_files_are_what_flame_writes(arch, tmp_path):
    """The committed LoRA files are FLAME's output for the generator's seeds (so the checks above are about FLAME's
    files, not stale ones)."""
    maker = fixture_script("make_kontext_chroma_lora_flame_files")
    for fmt in ("peft", "kohya"):
        path = str(tmp_path / f"{fmt}.safetensors")
        A.save_adapters(maker.with_lora(arch, fmt), path, fmt)
        now, saved = io.load_file(path), io.load_file(os.path.join(OUT, f"{arch}_{fmt}.safetensors"))
        assert sorted(now) == sorted(saved)
        for k in now:
            np.testing.assert_array_equal(now[k].numpy(), saved[k].numpy(), err_msg=k)
    for name, (a, _) in maker.EXTRA_KOHYA.items():
        if a == arch:
            path = str(tmp_path / f"{name}.safetensors")
            A.save_adapters(maker.with_lora(arch, name[len(arch) + 1:]), path, "kohya")
            now, saved = io.load_file(path), io.load_file(os.path.join(OUT, f"{name}.safetensors"))
            assert sorted(now) == sorted(saved) and all(np.array_equal(now[k].numpy(), saved[k].numpy()) for k in now)
    real = io.load_file(os.path.join(OUT, "realwidth_kohya.safetensors"))
    assert sorted(real) == sorted(maker.realwidth_kohya())
