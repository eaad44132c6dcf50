"""load_vae: every layout (diffusers folder / file, BFL / LDM file, SAI `first_stage_model.` and ComfyUI `vae.`
prefixes, older diffusers attention names) against the golden fixtures; config inference; errors."""
import json
import os
import shutil

import numpy as np
import pytest
import vae_fixtures as VF

import flame_core as flame
from flame_core.io import safe_open, save_file
from flame_models.vae import (
    AutoencoderKL,
    VAECheckpoint,
    VAECheckpointError,
    VAEConfig,
    infer_config,
    load_vae,
    save_vae,
)


def tensors(path):
    with safe_open(path) as f:
        return {k: f.get_array(k) for k in f.keys()}


def write(path, state, metadata=None):
    save_file(state, path, metadata=metadata)
    return path


def ldm_with_prefix(tmp_path, name, prefix, extra=True):
    """The LDM fixture inside a full checkpoint: prefixed VAE keys beside other models' tensors."""
    state = {prefix + k: v for k, v in tensors(VF.ldm_file(name)).items()}
    if extra:
        state["model.diffusion_model.input_blocks.0.0.weight"] = np.zeros((2, 4, 3, 3), np.float16)
        state["conditioner.embedders.0.transformer.text_model.final_layer_norm.weight"] = np.ones(2, np.float16)
    return write(tmp_path / f"{name}_{prefix.strip('.')}_full.safetensors", state)


# ----------------------------------------------------------------------------- every layout against diffusers
@pytest.mark.parametrize("name", VF.NAMES)
@pytest.mark.parametrize("layout", ["diffusers_folder", "pipeline_folder", "diffusers_file_in_folder",
                                    "diffusers_file_alone", "ldm_file", "first_stage_model", "vae_prefix",
                                    "old_attention_names"])
def test_every_layout_matches_diffusers(tmp_path, name, layout, device):
    groups = None
    if layout == "diffusers_folder":
        path = VF.folder(name)
    elif layout == "pipeline_folder":                     # model root with vae/, transformer/, ...
        path = tmp_path / "pipeline"
        shutil.copytree(VF.folder(name), path / "vae")
        os.makedirs(path / "transformer")
    elif layout == "diffusers_file_in_folder":            # the file named directly: config.json beside it is used
        path = VF.diffusers_file(name)
    elif layout == "diffusers_file_alone":                # diffusers names, no config: inferred from the shapes
        path = tmp_path / "vae_diffusers.safetensors"
        shutil.copy(VF.diffusers_file(name), path)
        groups = VF.GROUPS
    elif layout == "ldm_file":                            # BFL ae.safetensors / SAI sdxl_vae.safetensors naming
        path, groups = VF.ldm_file(name), VF.GROUPS
    elif layout in ("first_stage_model", "vae_prefix"):
        path = ldm_with_prefix(tmp_path, name, "first_stage_model." if layout == "first_stage_model" else "vae.")
        groups = VF.GROUPS
    else:                                                 # diffusers < 0.15 names for the mid-block attention
        old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
        state = {}
        for k, v in tensors(VF.diffusers_file(name)).items():
            for new, was in old.items():
                k = k.replace(f"attentions.0.{new}.", f"attentions.0.{was}.")
            state[k] = v
        assert any(".query.weight" in k for k in state)
        os.makedirs(tmp_path / "old")
        write(tmp_path / "old" / "diffusion_pytorch_model.safetensors", state)
        shutil.copy(os.path.join(VF.folder(name), "config.json"), tmp_path / "old" / "config.json")
        path = tmp_path / "old"
    vae = load_vae(path, dtype=flame.float32, device=device,
                   config=None if groups is None else {"norm_num_groups": groups})
    want = VAEConfig.from_diffusers_config(VF.diffusers_config(name))
    if groups is not None:                                # no config.json: tile size is the default
        want = want.replace(sample_size=1024)
    assert vae.config == want
    VF.check_against_fixture(vae, name, device)


def test_loads_in_the_stored_dtype_frozen(device):
    vae = load_vae(VF.ldm_file("flux_tiny"), device=device, config={"norm_num_groups": VF.GROUPS})
    params = dict(vae.named_parameters())
    assert all(p.dtype == flame.float16 for p in params.values())      # the fixtures store float16
    assert all(not p.requires_grad and not p.is_meta for p in params.values())
    assert all(p.device == flame.device(device) for p in params.values())
    assert not vae.training
    bf = load_vae(VF.ldm_file("flux_tiny"), dtype="bfloat16", device=device, config={"norm_num_groups": VF.GROUPS})
    assert bf.dtype == flame.bfloat16
    # the values are the file's, converted
    ref = tensors(VF.ldm_file("flux_tiny"))
    np.testing.assert_array_equal(params["decoder.up.2.upsample.conv.weight"].numpy(),
                                  ref["decoder.up.2.upsample.conv.weight"])
    np.testing.assert_array_equal(params["encoder.mid.attn_1.q.weight"].numpy(), ref["encoder.mid.attn_1.q.weight"])


@pytest.mark.parametrize("cfg", [
    VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_quant_conv=True, use_post_quant_conv=True),
    VAEConfig(ch=32, ch_mult=(1, 1, 2), num_res_blocks=2, z_channels=16, mid_attention=False),
])
def test_config_inferred_from_ldm_weights(tmp_path, cfg):
    """A VAE saved under its LDM names (no config anywhere) comes back with the same config and outputs."""
    vae = AutoencoderKL(cfg)
    path = write(tmp_path / "ae.safetensors", {k: p.detach() for k, p in vae.named_parameters()})
    with VAECheckpoint(path) as ckpt:
        assert (ckpt.layout, ckpt.prefix) == ("ldm", "")
        assert infer_config(ckpt) == cfg
    back = load_vae(path)
    x = (flame.rand(1, 3, 16, 16, generator=flame.Generator().manual_seed(0)) * 2 - 1).to(vae.device)
    with flame.no_grad():
        np.testing.assert_array_equal(back.encode(x).numpy(), vae.encode(x).numpy())
        z = flame.randn(1, cfg.z_channels, 4, 4, generator=flame.Generator().manual_seed(1)).to(vae.device)
        np.testing.assert_array_equal(back.decode(z).numpy(), vae.decode(z).numpy())


def test_explicit_config_replaces_the_inferred_one(tmp_path):
    cfg = VAEConfig.from_diffusers_config(VF.diffusers_config("sdxl_tiny")).replace(sample_size=64)
    vae = load_vae(VF.ldm_file("sdxl_tiny"), dtype=flame.float32, config=cfg)
    assert vae.config is cfg and vae.tile_sample_min_size == 64
    with pytest.raises(VAECheckpointError, match="unknown VAEConfig field"):
        load_vae(VF.ldm_file("sdxl_tiny"), config={"groups": 2})
    with pytest.raises(TypeError, match="config must be"):
        load_vae(VF.ldm_file("sdxl_tiny"), config=3)
    # the inferred config needs a group count the channels allow: the error says how to give one
    with pytest.raises(VAECheckpointError, match=r"norm_num_groups=32.*pass config=\{'norm_num_groups'"):
        load_vae(VF.ldm_file("sdxl_tiny"))


# ----------------------------------------------------------------------------- files that are not VAEs
NOT_VAES = {
    "flux_bfl": ({"model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (6, 2),
                  "model.diffusion_model.single_blocks.0.linear1.weight": (4, 2)}, "a Flux transformer"),
    "flux_diffusers": ({"transformer_blocks.0.attn.to_q.weight": (2, 2),
                        "single_transformer_blocks.0.attn.to_q.weight": (2, 2)}, "a Flux transformer"),
    "lora_kohya": ({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 2),
                    "lora_unet_double_blocks_0_img_attn_qkv.alpha": ()}, "LoRA"),
    "lora_peft": ({"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": (4, 2)}, "LoRA"),
    "clip_l": ({"text_model.embeddings.token_embedding.weight": (8, 2),
                "text_model.encoder.layers.0.self_attn.q_proj.weight": (2, 2)}, "CLIP text encoder"),
    "t5": ({"shared.weight": (8, 2), "encoder.block.0.layer.0.SelfAttention.q.weight": (2, 2),
            "encoder.final_layer_norm.weight": (2,)}, "T5 text encoder"),
    "sdxl_unet": ({"model.diffusion_model.input_blocks.0.0.weight": (2, 4, 3, 3)}, "UNet"),
}


@pytest.mark.parametrize("kind", NOT_VAES)
def test_not_a_vae_is_named_before_reading_tensors(tmp_path, monkeypatch, kind):
    shapes, what = NOT_VAES[kind]
    path = write(tmp_path / f"{kind}.safetensors", {k: np.zeros(s, np.float16) for k, s in shapes.items()})

    def no_reads(*a, **k):
        raise AssertionError("a tensor was read")
    monkeypatch.setattr(safe_open, "read", no_reads)
    with pytest.raises(VAECheckpointError) as e:
        load_vae(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "not a VAE" in msg and what in msg, msg


def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        load_vae(tmp_path / "nothing_here.safetensors")
    (tmp_path / "model.ckpt").write_bytes(b"x")
    with pytest.raises(VAECheckpointError, match=r"model\.ckpt.*only safetensors"):
        load_vae(tmp_path / "model.ckpt")
    shutil.copy(VF.ldm_file("flux_tiny"), tmp_path / "ae.sft")      # BFL's first Flux release named it ae.sft
    assert load_vae(tmp_path / "ae.sft", config={"norm_num_groups": VF.GROUPS}).config.z_channels == 16
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(ValueError, match="junk.safetensors"):
        load_vae(tmp_path / "junk.safetensors")
    tr = tmp_path / "transformer"
    os.makedirs(tr)
    (tr / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(VAECheckpointError, match="FluxTransformer2DModel"):
        load_vae(tr)
    two = tmp_path / "two"
    os.makedirs(two)
    for n in ("a.safetensors", "b.safetensors"):
        shutil.copy(VF.ldm_file("sdxl_tiny"), two / n)
    with pytest.raises(VAECheckpointError, match="several .safetensors"):
        load_vae(two)
    empty = tmp_path / "empty"
    os.makedirs(empty)
    with pytest.raises(VAECheckpointError, match="no .safetensors"):
        load_vae(empty)


# ----------------------------------------------------------------------------- missing / unexpected / misshaped
def _edited(tmp_path, source, edit, name="edited.safetensors"):
    state = tensors(source)
    edit(state)
    return write(tmp_path / name, state)


def test_missing_key_named_in_the_files_own_names(tmp_path, monkeypatch):
    path = _edited(tmp_path, VF.ldm_file("flux_tiny"), lambda s: s.pop("decoder.up.1.block.2.conv2.bias"))
    monkeypatch.setattr(safe_open, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(VAECheckpointError, match=r"missing keys \(1\): decoder\.up\.1\.block\.2\.conv2\.bias"):
        load_vae(path, config={"norm_num_groups": VF.GROUPS})
    monkeypatch.undo()
    # diffusers naming (up.1 of 3 levels is up_blocks.1), prefixed naming
    os.makedirs(tmp_path / "d")
    shutil.copy(os.path.join(VF.folder("flux_tiny"), "config.json"), tmp_path / "d")
    _edited(tmp_path, VF.diffusers_file("flux_tiny"), lambda s: s.pop("decoder.up_blocks.0.resnets.2.conv2.bias"),
            "d/diffusion_pytorch_model.safetensors")
    with pytest.raises(VAECheckpointError, match=r"missing keys \(1\): decoder\.up_blocks\.0\.resnets\.2\.conv2"):
        load_vae(tmp_path / "d")
    full = ldm_with_prefix(tmp_path, "sdxl_tiny", "first_stage_model.")
    path = _edited(tmp_path, full, lambda s: s.pop("first_stage_model.post_quant_conv.bias"), "full2.safetensors")
    with pytest.raises(VAECheckpointError, match=r"missing keys \(1\): first_stage_model\.post_quant_conv\.bias"):
        load_vae(path, config={"norm_num_groups": VF.GROUPS})


def test_unexpected_and_misshaped_keys_named(tmp_path, monkeypatch):
    def edit(s):
        s["encoder.down.0.block.0.extra.weight"] = np.zeros(3, np.float16)
        s["encoder.conv_out.bias"] = np.zeros(5, np.float16)
    path = _edited(tmp_path, VF.ldm_file("sdxl_tiny"), edit)
    monkeypatch.setattr(safe_open, "read", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(VAECheckpointError) as e:
        load_vae(path, config={"norm_num_groups": VF.GROUPS})
    msg = str(e.value)
    assert str(path) in msg
    assert "unexpected keys (1): encoder.down.0.block.0.extra.weight" in msg
    assert "misshaped (1): encoder.conv_out.bias: (5,) in the file, (8,) in the model" in msg
    monkeypatch.undo()
    # strict=False tolerates the unexpected tensor, never a misshaped one
    with pytest.raises(VAECheckpointError, match="misshaped"):
        load_vae(path, config={"norm_num_groups": VF.GROUPS}, strict=False)
    ok = _edited(tmp_path, VF.ldm_file("sdxl_tiny"), lambda s: s.update({"extra.weight": np.zeros(3, np.float16)}),
                 "extra.safetensors")
    with pytest.raises(VAECheckpointError, match="unexpected keys"):
        load_vae(ok, config={"norm_num_groups": VF.GROUPS})
    vae = load_vae(ok, dtype=flame.float32, config={"norm_num_groups": VF.GROUPS}, strict=False)
    VF.check_against_fixture(vae, "sdxl_tiny")


def test_config_json_disagreeing_with_the_weights(tmp_path):
    os.makedirs(tmp_path / "v")
    shutil.copy(VF.diffusers_file("sdxl_tiny"), tmp_path / "v")
    cfg = VF.diffusers_config("sdxl_tiny")
    cfg["latent_channels"] = 8
    (tmp_path / "v" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VAECheckpointError, match=r"misshaped.*decoder\.conv_in\.weight: \(8, 4, 3, 3\) in the file"):
        load_vae(tmp_path / "v")


def test_inconsistent_block_counts(tmp_path):
    path = _edited(tmp_path, VF.ldm_file("sdxl_tiny"),
                   lambda s: [s.pop(k) for k in list(s) if k.startswith("decoder.up.0.block.1.")])
    with pytest.raises(VAECheckpointError, match="1 ResnetBlocks per encoder level but 1 per decoder level"):
        load_vae(path, config={"norm_num_groups": VF.GROUPS})


# ----------------------------------------------------------------------------- saving
@pytest.mark.parametrize("name", VF.NAMES)
def test_save_vae_writes_the_reference_layouts(tmp_path, name):
    """Saved LDM / diffusers files hold exactly the fixtures' tensors under exactly their names and shapes."""
    vae = load_vae(VF.folder(name))                                    # float16, as stored
    ldm = save_vae(vae, tmp_path / "ae.safetensors")[0]
    folder_files = save_vae(vae, tmp_path / "vae", layout="diffusers")
    for written, reference in ((ldm, VF.ldm_file(name)), (folder_files[0], VF.diffusers_file(name))):
        got, want = tensors(written), tensors(reference)
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    with open(folder_files[1]) as f:
        cfg = json.load(f)
    assert VAEConfig.from_diffusers_config(cfg) == vae.config


@pytest.mark.parametrize("layout", ["ldm", "diffusers"])
def test_save_then_load_keeps_the_config_the_weights_cannot_tell(tmp_path, layout):
    cfg = VAEConfig(ch=8, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, norm_num_groups=4, use_quant_conv=True,
                    use_post_quant_conv=False, sample_size=64)
    vae = AutoencoderKL(cfg)
    target = tmp_path / ("ae.safetensors" if layout == "ldm" else "vae")
    save_vae(vae, target, layout=layout)
    back = load_vae(target)                                            # no config= needed
    assert back.config == cfg
    x = (flame.rand(1, 3, 16, 16, generator=flame.Generator().manual_seed(0)) * 2 - 1).to(vae.device)
    with flame.no_grad():
        np.testing.assert_array_equal(back.encode(x).numpy(), vae.encode(x).numpy())
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with pytest.raises(ValueError, match="layout"):
        save_vae(vae, tmp_path / "x", layout="bfl")
    with pytest.raises(ValueError, match=".safetensors"):
        save_vae(vae, tmp_path / "x")
