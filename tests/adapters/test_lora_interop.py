"""Flux LoRA files from the other tools, loaded into FLAME's Flux and checked against the reference output.

The fixtures (tests/fixtures/make_lora_fixtures.py) were written by diffusers + PEFT: a tiny random
FluxTransformer2DModel, LoRAs saved by FluxPipeline.save_lora_weights with their LoraConfig as metadata
(lora_alpha != r, rank/alpha patterns, rsLoRA, DoRA), and the diffusers model's output with each LoRA applied.
The kohya and ai-toolkit files are the same LoRAs rewritten here in those tools' layouts."""
import json
import pathlib

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import flame_core as flame
import flame_nn.adapters as A
from flame_models.flux import flux_params_from_config, image_ids, load_flux
from flame_models.flux.lora_keys import name_map_for
from flame_nn.adapters import AdapterFormatError, NameMap

FIX = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "lora"
PEFT_CASES = ["alpha", "patterns", "rslora", "dora"]


def _read(path):
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


@pytest.fixture(scope="module")
def params():
    return flux_params_from_config(json.loads((FIX / "flux_config.json").read_text()))


@pytest.fixture(scope="module")
def reference():
    return _read(FIX / "inputs.safetensors")[0], _read(FIX / "outputs.safetensors")[0]


def _model(params, device):
    return load_flux(FIX / "flux_base.safetensors", dtype=flame.float32, device=device, params=params)


def _run(model, inputs, device):
    t = {k: flame.tensor(v, device=device) for k, v in inputs.items()}
    with flame.no_grad():
        return model(img=t["hidden_states"], img_ids=t["img_ids"], txt=t["encoder_hidden_states"],
                     txt_ids=t["txt_ids"], timesteps=t["timestep"], y=t["pooled_projections"],
                     guidance=t["guidance"]).numpy()


def _close(out, ref):
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5 * np.abs(ref).max())


def test_the_base_model_matches_diffusers(params, reference, device):
    inputs, outputs = reference
    assert inputs["img_ids"].shape == (12, 3)
    np.testing.assert_array_equal(inputs["img_ids"], image_ids(64, 48).numpy()[0])  # 4 x 3 patches of 16 px
    _close(_run(_model(params, device), inputs, device), outputs["base"])


@pytest.mark.parametrize("case", PEFT_CASES)
def test_diffusers_lora_with_its_metadata_matches_diffusers(params, reference, device, case):
    inputs, outputs = reference
    model = _model(params, device)
    A.load_adapters(model, FIX / f"{case}.safetensors", name_map=name_map_for(params))
    out = _run(model, inputs, device)
    assert np.abs(outputs[case] - outputs["base"]).max() > 1e-2  # the LoRA matters
    _close(out, outputs[case])


def test_the_metadata_is_what_sets_the_scale(params, reference, device, tmp_path):
    """The same tensors without diffusers' metadata load at scale 1, as diffusers itself would load them."""
    inputs, outputs = reference
    sd, meta = _read(FIX / "alpha.safetensors")
    assert json.loads(meta["lora_adapter_metadata"])["transformer.lora_alpha"] == 6
    save_file(sd, str(tmp_path / "bare.safetensors"), metadata={"format": "pt"})
    model = _model(params, device)
    A.load_adapters(model, tmp_path / "bare.safetensors")
    assert np.abs(_run(model, inputs, device) - outputs["alpha"]).max() > 1e-3


def test_ai_toolkit_flux_lora(params, reference, device, tmp_path):
    """ai-toolkit saves Flux LoRAs as transformer.<diffusers name>.lora_A/B with alpha forced to the rank (scale 1)
    and no alpha keys or PEFT metadata."""
    inputs, outputs = reference
    sd, _ = _read(FIX / "alpha.safetensors")
    sd = {k: (v * (6 / 4) if k.endswith("lora_B.weight") else v).astype(np.float32) for k, v in sd.items()}
    meta = {"format": "pt", "name": "my_first_flux_lora", "version": "1.0",
            "software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit"})}
    save_file(sd, str(tmp_path / "aitk.safetensors"), metadata=meta)
    model = _model(params, device)
    A.load_adapters(model, tmp_path / "aitk.safetensors")
    _close(_run(model, inputs, device), outputs["alpha"])


# kohya's fused Flux Linears, each made of the diffusers Linears of the fixture (whose lora_A are tied)
KOHYA = {"lora_unet_double_blocks_0_img_attn_qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                                    "transformer_blocks.0.attn.to_v"],
         "lora_unet_double_blocks_0_img_attn_proj": ["transformer_blocks.0.attn.to_out.0"],
         "lora_unet_double_blocks_0_img_mlp_2": ["transformer_blocks.0.ff.net.2"],
         "lora_unet_double_blocks_0_img_mod_lin": ["transformer_blocks.0.norm1.linear"],
         "lora_unet_single_blocks_0_linear1": ["single_transformer_blocks.0.attn.to_q",
                                               "single_transformer_blocks.0.attn.to_k",
                                               "single_transformer_blocks.0.attn.to_v",
                                               "single_transformer_blocks.0.proj_mlp"],
         "lora_unet_single_blocks_0_linear2": ["single_transformer_blocks.0.proj_out"],
         "lora_unet_final_layer_linear": ["proj_out"]}


def test_kohya_flux_lora_with_alpha_keys(params, reference, device, tmp_path):
    inputs, outputs = reference
    sd, meta = _read(FIX / "kohya_src.safetensors")
    alpha = json.loads(meta["lora_adapter_metadata"])["transformer.lora_alpha"]
    kohya = {}
    for name, parts in KOHYA.items():
        downs = [sd[f"transformer.{p}.lora_A.weight"] for p in parts]
        assert all(np.array_equal(d, downs[0]) for d in downs)
        kohya[f"{name}.lora_down.weight"] = downs[0]
        kohya[f"{name}.lora_up.weight"] = np.concatenate([sd[f"transformer.{p}.lora_B.weight"] for p in parts])
        kohya[f"{name}.alpha"] = np.array(alpha, dtype=np.float32)
    assert {k.rsplit(".", 2)[0] for k in sd} == {f"transformer.{p}" for ps in KOHYA.values() for p in ps}
    save_file(kohya, str(tmp_path / "kohya.safetensors"), metadata={"ss_network_module": "networks.lora_flux"})
    model = _model(params, device)
    A.load_adapters(model, tmp_path / "kohya.safetensors")
    _close(_run(model, inputs, device), outputs["kohya_src"])


def test_peft_layout_with_per_module_alpha_keys(params, reference, device, tmp_path):
    """ComfyUI-style files: diffusers names, lora_A/lora_B, and a kohya `.alpha` per module (s = alpha / rank)."""
    inputs, outputs = reference
    sd, meta = _read(FIX / "kohya_src.safetensors")
    alpha = json.loads(meta["lora_adapter_metadata"])["transformer.lora_alpha"]
    bases = {k.rsplit(".", 2)[0] for k in sd}
    sd.update({f"{b}.alpha": np.array(alpha, dtype=np.float32) for b in bases})
    save_file(sd, str(tmp_path / "comfy.safetensors"), metadata={"format": "pt"})
    model = _model(params, device)
    A.load_adapters(model, tmp_path / "comfy.safetensors")
    _close(_run(model, inputs, device), outputs["kohya_src"])


def test_flame_rewrites_a_diffusers_lora_that_it_reads_back_the_same(params, reference, device, tmp_path):
    inputs, outputs = reference
    model = _model(params, device)
    A.load_adapters(model, FIX / "alpha.safetensors")
    A.save_adapters(model, tmp_path / "again.safetensors", format="peft")
    theirs, _ = _read(FIX / "alpha.safetensors")
    ours, _ = _read(tmp_path / "again.safetensors")
    assert sorted(ours) == sorted(theirs)  # diffusers' own names, no BFL ones
    again = _model(params, device)
    A.load_adapters(again, tmp_path / "again.safetensors")
    _close(_run(again, inputs, device), outputs["alpha"])


# ----------------------------------------------------------------------------- the model's own name map
def test_flux_takes_diffusers_targets_and_writes_diffusers_names_by_default(params, device, tmp_path):
    model = _model(params, device)
    made = A.inject_adapters(model, ["to_q", "to_k", "to_v", "to_out.0"], "lora", rank=2, init_weights="gaussian")
    assert ("double_blocks.0.img_attn.qkv", (0, 32)) in made and ("double_blocks.0.img_attn.proj", None) in made
    A.save_adapters(model, tmp_path / "peft.safetensors", format="peft")
    keys, _ = _read(tmp_path / "peft.safetensors")
    assert "transformer.transformer_blocks.0.attn.to_k.lora_A.weight" in keys
    assert "transformer.single_transformer_blocks.0.attn.to_v.lora_B.weight" in keys
    assert not [k for k in keys if "double_blocks" in k or "single_blocks" in k]


def test_a_peft_save_without_a_usable_name_map_is_an_error(params, device, tmp_path):
    model = _model(params, device)
    A.inject_adapters(model, ["to_out.0", "proj_out"], "lora", rank=2)
    with pytest.raises(AdapterFormatError, match=r"name map has none for 3 adapted module\(s\).*img_attn.proj"):
        A.save_adapters(model, tmp_path / "x.safetensors", format="peft", name_map=NameMap())
    partial = NameMap({k: v for k, v in name_map_for(params).targets.items() if k != "final_layer.linear"})
    with pytest.raises(AdapterFormatError, match=r"none for 1 adapted module\(s\): \['final_layer.linear'\]"):
        A.save_adapters(model, tmp_path / "x.safetensors", format="peft", name_map=partial)
    assert not (tmp_path / "x.safetensors").exists()
    A.save_adapters(model, tmp_path / "x.safetensors", format="kohya")  # the model's own names: fine


# ----------------------------------------------------------------------------- metadata that disagrees with the file
def _with_config(tmp_path, **changes):
    sd, meta = _read(FIX / "patterns.safetensors")
    config = json.loads(meta["lora_adapter_metadata"])
    config.update({f"transformer.{k}": v for k, v in changes.items()})
    path = tmp_path / "edited.safetensors"
    save_file(sd, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return path


def test_metadata_that_disagrees_with_the_tensors_is_an_error(params, device, tmp_path):
    model = _model(params, device)
    with pytest.raises(AdapterFormatError, match=r"attn.to_k: lora_A has rank 2 but the file's LoraConfig gives "
                                                 r".*to_k rank 4"):
        A.load_adapters(model, _with_config(tmp_path, rank_pattern={"proj_mlp": 6}))
    with pytest.raises(AdapterFormatError, match="use_dora=True but this module has no lora_magnitude_vector"):
        A.load_adapters(model, _with_config(tmp_path, use_dora=True))
    with pytest.raises(AdapterFormatError, match="lora_bias=True"):
        A.load_adapters(model, _with_config(tmp_path, lora_bias=True))
