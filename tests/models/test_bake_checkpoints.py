"""python -m flame_models.bake (flame_models/pipeline/bake.py and the families' bake.py): LoRAs of any layout and kind
baked into a Flux, SD3 or Chroma denoiser file of either layout give the weights FLAME's own load-time merge gives
(pipeline.loras.apply_loras into a model read from the unbaked file), every other tensor copied bit for bit; the
refusals."""
import os

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models.bake import BakeError, bake, main
from flame_models.bfl.loading import save_flux
from flame_models.flux import load_flux
from flame_models.flux.tiny import tiny_flux_files
from flame_models.pipeline.loras import apply_loras
from flame_nn import adapters as A


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bake")
    files = tiny_flux_files(d / "flux", seed=1)
    (weights,) = [f for f in os.listdir(files.transformer) if f.endswith(".safetensors")]
    diffusers_file = os.path.join(files.transformer, weights)
    model = load_flux(diffusers_file, dtype=flame.float32, device="cpu")
    bfl_file = str(d / "flux_bfl.safetensors")
    save_flux(model, bfl_file, layout="bfl")
    rng = np.random.default_rng(0)
    loras = {}
    for name, kind, targets, fmt in (("kohya", "lora", ["double_blocks.*", "single_blocks.*"], "kohya"),
                                     ("peft", "lora", ["to_q", "to_k", "to_v", "to_out.0"], "peft"),
                                     ("dora", "dora", ["double_blocks.*.img_attn.qkv", "single_blocks.*.linear2"],
                                      "kohya"),
                                     ("lokr", "lokr", ["double_blocks.*.img_mlp.0"], "kohya")):
        m = load_flux(diffusers_file, dtype=flame.float32, device="cpu")
        A.inject_adapters(m, targets, kind, rank=4, alpha=2.0)
        with flame.no_grad():
            for _, p in A.named_adapter_parameters(m):
                p.copy_(flame.tensor(rng.normal(0, 0.2, tuple(p.shape)).astype(np.float32), device="cpu") + p)
        loras[name] = A.save_adapters(m, str(d / f"{name}.safetensors"), format=fmt)
    return {"diffusers": diffusers_file, "bfl": bfl_file, "loras": loras, "dir": d}


def _state(path):
    return {k: v.detach().numpy().copy() for k, v in load_flux(path, dtype=flame.float32, device="cpu")
            .state_dict().items()}


@pytest.mark.parametrize("layout", ["diffusers", "bfl"])
def test_baked_weights_are_the_load_time_merge(tiny, tmp_path, layout):
    base = tiny[layout]
    loras = [(tiny["loras"]["kohya"], 0.7), (tiny["loras"]["peft"], 0.5), (tiny["loras"]["dora"], 1.0),
             (tiny["loras"]["lokr"], -0.5)]
    out = str(tmp_path / "baked.safetensors")
    changed = bake(base, [f"{p}:{w}" for p, w in loras], out)
    assert changed
    ref = load_flux(base, dtype=flame.float32, device="cpu")
    apply_loras(ref, loras)
    want = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    got, before = _state(out), _state(base)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # every adapted FLAME module moved: both streams' qkv (kohya, peft, dora), the MLPs (kohya, lokr), ...
    moved = {k for k in want if not np.array_equal(got[k], before[k])}
    assert {"double_blocks.0.img_attn.qkv.weight", "double_blocks.0.txt_attn.qkv.weight",
            "double_blocks.0.img_mlp.0.weight", "single_blocks.0.linear1.weight",
            "single_blocks.0.linear2.weight"} <= moved
    with io.safe_open(base) as a, io.safe_open(out) as b:      # the tensors no LoRA names: bit for bit
        assert a.keys() == b.keys()
        for k in a.keys():
            if k not in changed:
                np.testing.assert_array_equal(a.get_array(k), b.get_array(k))
                assert a.dtype(k) == b.dtype(k)
        assert "flame.baked" in b.metadata()


def test_what_bake_refuses(tiny, tmp_path, capsys):
    out = str(tmp_path / "never.safetensors")
    with pytest.raises(BakeError, match="single .safetensors checkpoint"):
        bake(os.path.dirname(tiny["diffusers"]), [tiny["loras"]["peft"]], out)
    with pytest.raises(BakeError, match="no LoRA to bake"):
        bake(tiny["bfl"], [], out)
    te = {"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": np.ones((2, 4), np.float32),
          "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": np.ones((4, 2), np.float32)}
    with io.safe_open(tiny["loras"]["kohya"]) as f:
        te.update({k: f.get_array(k) for k in f.keys()})
    te_path = str(tmp_path / "te.safetensors")
    io.save_file(te, te_path)
    with pytest.raises(BakeError, match="text-encoder adapters"):
        bake(tiny["bfl"], [te_path], out)
    assert bake(tiny["bfl"], [te_path], str(tmp_path / "ok.safetensors"), skip_text_encoders=True)
    assert not os.path.exists(out)
    assert main(["--model", tiny["bfl"], "--lora", f"{tiny['loras']['peft']}:0.5", "--output",
                 str(tmp_path / "cli.safetensors")]) == 0
    assert "tensors changed; wrote" in capsys.readouterr().out
    assert main(["--model", tiny["bfl"], "--lora", str(tmp_path / "nope.safetensors"), "--output", out]) == 2
    assert "not a file" in capsys.readouterr().err


def _family_case(family, d):
    """(diffusers-layout file, native-layout file, loader, [(lora, weight)]) of a tiny SD3 or Chroma."""
    if family == "sd3":
        from flame_models.sd3 import load_sd3
        from flame_models.sd3.loading import save_sd3
        src = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sd3", "plain", "transformer",
                           "diffusion_pytorch_model.safetensors")
        load, save, targets = load_sd3, save_sd3, (["joint_blocks.*"], ["to_q", "to_k", "to_v", "to_out.0"])
    else:
        from flame_models.chroma.loading import load_chroma, save_chroma
        from flame_models.chroma.tiny import tiny_chroma_files
        files = tiny_chroma_files(d / "chroma", seed=1)
        (w,) = [f for f in os.listdir(files.transformer) if f.endswith(".safetensors")]
        src = os.path.join(files.transformer, w)
        load, save, targets = load_chroma, save_chroma, (["double_blocks.*", "single_blocks.*"],
                                                         ["to_q", "to_k", "to_v", "to_out.0"])
    native = str(d / f"{family}_native.safetensors")
    save(load(src, dtype=flame.float32, device="cpu"), native)
    rng = np.random.default_rng(3)
    loras = []
    for i, (fmt, tg, w) in enumerate((("kohya", targets[0], 0.6), ("peft", targets[1], 1.3))):
        m = load(src, dtype=flame.float32, device="cpu")
        A.inject_adapters(m, tg, rank=2, alpha=1.0)
        with flame.no_grad():
            for _, p in A.named_adapter_parameters(m):
                p.copy_(flame.tensor(rng.normal(0, 0.2, tuple(p.shape)).astype(np.float32), device="cpu"))
        loras.append((A.save_adapters(m, str(d / f"{family}_{fmt}.safetensors"), format=fmt), w))
    return src, native, load, loras


@pytest.mark.parametrize("family", ["sd3", "chroma"])
def test_sd3_and_chroma_across_layouts(tmp_path, family):
    src, native, load, loras = _family_case(family, tmp_path)
    for base in (src, native):
        out = str(tmp_path / f"{family}_baked_{os.path.basename(base)}")
        assert bake(base, [f"{p}:{w}" for p, w in loras], out)
        ref = load(base, dtype=flame.float32, device="cpu")
        apply_loras(ref, loras)
        # (a tiny diffusers-layout SD3 gives its head dim in the config.json beside it, which the output lacks)
        got = load(out, dtype=flame.float32, device="cpu", params=ref.params).state_dict()
        before = load(base, dtype=flame.float32, device="cpu").state_dict()
        moved = 0
        for k, v in ref.state_dict().items():
            np.testing.assert_allclose(got[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{base}: {k}")
            moved += not np.array_equal(got[k].numpy(), before[k].numpy())
        assert moved > 4


def test_sdxl_across_layouts_with_conv_adapters(tmp_path):
    """SDXL (flame_models/sdxl/bake.py): kohya files (SAI names: a LoRA on the attention Linears, a LoCon on the
    resnets' convolutions, a LoKr) and a PEFT file (diffusers names) baked together into the SAI single file -- its
    VAE and text encoders copied bit for bit -- and into a diffusers-named UNet file give apply_loras' merge."""
    from flame_models.sdxl import CONV_TARGETS, KOHYA_METADATA, TARGET_PRESETS, load_unet
    here = os.path.join(os.path.dirname(__file__), "..", "fixtures", "sdxl")
    sai, diffusers = os.path.join(here, "tiny_sai.safetensors"), os.path.join(here, "tiny",
                                                                                 "diffusion_pytorch_model.safetensors")
    rng = np.random.default_rng(5)

    def load(path):
        return load_unet(path, dtype=flame.float32, device="cpu", progress=False)
    loras = []
    for fmt, targets, kind, w in (("kohya", TARGET_PRESETS["attention"], "lora", 0.7),
                                  ("kohya", CONV_TARGETS, "lora", 1.2),          # LoCon: the resnets' convolutions
                                  ("peft", TARGET_PRESETS["attention"], "lora", 0.5),   # diffusers' names
                                  ("kohya", TARGET_PRESETS["attention"], "lokr", -0.4)):
        m = load(sai)
        A.inject_adapters(m, targets, kind, rank=2, alpha=1.0)
        with flame.no_grad():
            for _, p in A.named_adapter_parameters(m):
                p.copy_(flame.tensor(rng.normal(0, 0.2, tuple(p.shape)).astype(np.float32), device="cpu") + p)
        path = str(tmp_path / f"sdxl_{len(loras)}_{fmt}.safetensors")
        fmt_kw = {"metadata": KOHYA_METADATA} if fmt == "kohya" else {}
        loras.append((A.save_adapters(m, path, format=fmt, **fmt_kw), w))
    for base in (sai, diffusers):
        out = str(tmp_path / f"baked_{os.path.basename(base)}")
        changed = bake(base, [f"{p}:{w}" for p, w in loras], out)
        ref = load(base)
        apply_loras(ref, loras)
        got, before = load(out).state_dict(), load(base).state_dict()
        moved = 0
        for k, v in ref.state_dict().items():   # (the files are float16: the bake rounds the merge to it once)
            np.testing.assert_allclose(got[k].numpy(), v.numpy(), rtol=2.0 ** -10, atol=1e-6, err_msg=f"{base}: {k}")
            moved += not np.array_equal(got[k].numpy(), before[k].numpy())
        assert moved >= 40 and any(".in_layers.2." in k or ".conv1." in k for k in changed)
        with io.safe_open(base) as a, io.safe_open(out) as b:      # the tensors no LoRA names: bit for bit
            assert a.keys() == b.keys()
            for k in a.keys():
                if k not in changed:
                    np.testing.assert_array_equal(a.get_array(k), b.get_array(k))
