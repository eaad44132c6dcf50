"""Baking LoRAs into a checkpoint (flame_nn/adapters/bake.py, kohya's merge_lora): W + Σ w s up·down for the
weights a LoRA names (kohya stems on BFL-layout keys, PEFT modules on diffusers-layout ones, LoCon convolutions),
every other tensor copied bit for bit, the tiny Flux baked with a PEFT LoRA generating what the LoRA applied at load
generates, and the refusals (another layout, text-encoder parts, float8, overflow) with nothing written."""
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from lora_files import read as _read
from lora_files import write as _write

from flame_nn.adapters.bake import bake_file, main
from flame_nn.adapters.resize import ResizeError


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    sd = {"double_blocks.0.img_attn.qkv.weight": rng.standard_normal((12, 8)).astype(np.float32),
          "double_blocks.0.img_attn.qkv.bias": rng.standard_normal(12).astype(np.float32),
          "img_in.weight": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
          "conv_in.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
          "steps": np.arange(3, dtype=np.int64)}
    return _write(tmp_path / "base.safetensors", sd, {"modelspec.title": "tiny"}), sd


def test_kohya_loras_on_bfl_keys(checkpoint, tmp_path):
    path, sd = checkpoint
    rng = np.random.default_rng(1)
    a = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": rng.standard_normal((2, 8)).astype(np.float32),
         "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": rng.standard_normal((12, 2)).astype(np.float32),
         "lora_unet_double_blocks_0_img_attn_qkv.alpha": np.asarray(1.0, np.float32),
         "lora_unet_conv_in.lora_down.weight": rng.standard_normal((2, 3, 3, 3)).astype(np.float32),
         "lora_unet_conv_in.lora_up.weight": rng.standard_normal((4, 2, 1, 1)).astype(np.float32)}
    b = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": rng.standard_normal((3, 8)).astype(np.float32),
         "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": rng.standard_normal((12, 3)).astype(np.float32),
         "lora_unet_img_in.lora_down.weight": rng.standard_normal((2, 6)).astype(np.float32),
         "lora_unet_img_in.lora_up.weight": rng.standard_normal((8, 2)).astype(np.float32)}
    la, lb = _write(tmp_path / "a.safetensors", a), _write(tmp_path / "b.safetensors", b)
    changed = bake_file(path, [(la, 0.5), (lb, -1.0)], str(tmp_path / "baked.safetensors"))
    assert sorted(changed) == ["conv_in.weight", "double_blocks.0.img_attn.qkv.weight", "img_in.weight"]
    out, meta = _read(tmp_path / "baked.safetensors")
    assert list(out) == list(sd) and meta["modelspec.title"] == "tiny" and "a.safetensors" in meta["flame.baked"]
    qkv = "double_blocks.0.img_attn.qkv"
    want = (sd[f"{qkv}.weight"].astype(np.float64)
            + 0.5 * 0.5 * a[f"lora_unet_{qkv.replace('.', '_')}.lora_up.weight"].astype(np.float64)
            @ a[f"lora_unet_{qkv.replace('.', '_')}.lora_down.weight"]
            - b[f"lora_unet_{qkv.replace('.', '_')}.lora_up.weight"].astype(np.float64)
            @ b[f"lora_unet_{qkv.replace('.', '_')}.lora_down.weight"])
    np.testing.assert_allclose(out[f"{qkv}.weight"], want, rtol=1e-6, atol=1e-6)
    conv = sd["conv_in.weight"] + 0.5 * (a["lora_unet_conv_in.lora_up.weight"].reshape(4, 2).astype(np.float64)
                                         @ a["lora_unet_conv_in.lora_down.weight"].reshape(2, -1)).reshape(4, 3, 3, 3)
    np.testing.assert_allclose(out["conv_in.weight"], conv, rtol=1e-6, atol=1e-6)
    assert out["img_in.weight"].dtype == ml_dtypes.bfloat16          # rounded once to the weight's own dtype
    want_in = (sd["img_in.weight"].astype(np.float64) - b["lora_unet_img_in.lora_up.weight"].astype(np.float64)
               @ b["lora_unet_img_in.lora_down.weight"]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out["img_in.weight"], want_in)
    for k in ("double_blocks.0.img_attn.qkv.bias", "steps"):                # untouched: bit for bit
        np.testing.assert_array_equal(out[k], sd[k])
        assert out[k].dtype == sd[k].dtype


def test_a_tiny_flux_baked_with_a_peft_lora(tmp_path):
    """FLAME's PEFT file (diffusers names) baked into the tiny Flux's diffusers-layout transformer: the baked model
    generates the image the base does with the LoRA applied at load."""
    import flame_core as flame
    from flame_models.flux import load_flux
    from flame_models.flux.tiny import tiny_flux_files
    from flame_models.generate import generate
    from flame_nn import adapters as A
    files = tiny_flux_files(tmp_path / "base", seed=1)
    model = load_flux(files.transformer, dtype=flame.float32, device="cpu")
    A.inject_adapters(model, ["double_blocks.*"], rank=4, alpha=2.0)
    rng = np.random.default_rng(0)
    with flame.no_grad():
        for _, p in A.named_adapter_parameters(model):
            p.copy_(flame.tensor(rng.normal(0, 0.3, tuple(p.shape)).astype(np.float32)))
    lora = A.save_adapters(model, str(tmp_path / "peft.safetensors"), format="peft")
    root = os.path.dirname(files.transformer)
    baked_root = tmp_path / "baked"
    shutil.copytree(root, baked_root)
    rel = os.path.relpath(files.transformer, root)
    (weights,) = [f for f in os.listdir(files.transformer) if f.endswith(".safetensors")]
    target = os.path.join(baked_root, rel, weights)
    changed = bake_file(os.path.join(files.transformer, weights), [(lora, 0.8)], target)
    assert changed and all(k.startswith("transformer_blocks.") for k in changed)   # the double blocks' Linears
    kw = dict(width=48, height=32, steps=2, seed=3, dtype="float32", progress=False, log=lambda *a: None)
    baked = np.asarray(generate(str(baked_root), "a cat", **kw)[0]).astype(int)
    applied = np.asarray(generate(root, "a cat", loras=[f"{lora}:0.8"], **kw)[0]).astype(int)
    plain = np.asarray(generate(root, "a cat", **kw)[0]).astype(int)
    assert np.abs(baked - applied).max() <= 1 and np.abs(baked - plain).max() > 1


def test_what_bake_refuses(checkpoint, tmp_path, capsys):
    path, sd = checkpoint
    dst = tmp_path / "never.safetensors"
    peft = _write(tmp_path / "p.safetensors", {"transformer.blocks.0.to_q.lora_A.weight": np.ones((2, 8), np.float32),
                                               "transformer.blocks.0.to_q.lora_B.weight": np.ones((4, 2), np.float32)})
    with pytest.raises(ResizeError, match=r"1 LoRA adapter\(s\) name no weight of .*transformer.blocks.0.to_q "
                                          r"\(p.safetensors\) \(another layout\?"):
        bake_file(path, [peft], str(dst))
    te = {"lora_te1_q.lora_down.weight": np.ones((2, 4), np.float32),
          "lora_te1_q.lora_up.weight": np.ones((4, 2), np.float32),
          "lora_unet_img_in.lora_down.weight": np.ones((1, 6), np.float32),
          "lora_unet_img_in.lora_up.weight": np.ones((8, 1), np.float32)}
    te_path = _write(tmp_path / "te.safetensors", te)
    with pytest.raises(ResizeError, match="text-encoder adapters"):
        bake_file(path, [te_path], str(dst))
    assert sorted(bake_file(path, [te_path], str(tmp_path / "ok.safetensors"), skip_text_encoders=True)) == [
        "img_in.weight"]
    shape = {"lora_unet_img_in.lora_down.weight": np.ones((1, 7), np.float32),
             "lora_unet_img_in.lora_up.weight": np.ones((8, 1), np.float32)}
    with pytest.raises(ResizeError, match=r"lora_unet_img_in in .*: ΔW \(8, 7\), the checkpoint's img_in.weight "
                                          r"\(8, 6\)"):
        bake_file(path, [_write(tmp_path / "s.safetensors", shape)], str(dst))
    fp8 = dict(sd, **{"img_in.weight": np.ones((8, 6), ml_dtypes.float8_e4m3fn)})
    with pytest.raises(ResizeError, match="img_in.weight: float8_e4m3fn"):
        bake_file(_write(tmp_path / "f8.safetensors", fp8), [te_path], str(dst), skip_text_encoders=True)
    half = dict(sd, **{"img_in.weight": np.ones((8, 6), np.float16)})
    huge = {"lora_unet_img_in.lora_down.weight": np.full((1, 6), 1e3, np.float32),
            "lora_unet_img_in.lora_up.weight": np.full((8, 1), 1e3, np.float32)}
    with pytest.raises(ResizeError, match=r"img_in.weight: 48 of 48 values are not finite after baking"):
        bake_file(_write(tmp_path / "h.safetensors", half), [_write(tmp_path / "huge.safetensors", huge)], str(dst))
    assert not dst.exists() and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert main([path, str(tmp_path / "cli.safetensors"), f"{te_path}:0.5", "--skip-text-encoders"]) == 0
    assert "1 weights changed" in capsys.readouterr().out
    assert main([path, str(tmp_path / "cli.safetensors"), peft]) == 2
