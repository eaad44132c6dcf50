"""load_unet / save_unet: every layout (SAI single file with the other models' tensors, bare SAI, diffusers folder,
pipeline folder, diffusers-named file, sharded folder, index JSON), config inference, round trips, key mapping
against diffusers' (SDXL base), and errors that name what is wrong."""
import json
import os
import shutil

import numpy as np
import pytest
from sdxl_fixtures import (
    DIFFUSERS_DIR,
    SAI_FILE,
    assert_close,
    diffusers_config,
    io,
    sdxl_base_config,
    sdxl_base_keys,
    unet_inputs,
)

import flame_core as flame
from flame_core.io import load_file, safe_open, save_file
from flame_models.sdxl import (
    SDXLUNet,
    UNetCheckpointError,
    UNetConfig,
    UNetConfigError,
    configs,
    diffusers_to_sai_key,
    load_unet,
    sai_to_diffusers_key,
    save_unet,
)
from flame_models.sdxl.keys import diffusers_layout_facts


@pytest.fixture(scope="module")
def ref_state():
    """The tiny UNet's weights (SAI names, float16 as stored) read straight from the SAI fixture."""
    return {k[len("model.diffusion_model."):]: v.numpy() for k, v in load_file(SAI_FILE).items()
            if k.startswith("model.diffusion_model.")}


def _state(unet):
    return {k: p.detach().float().numpy() for k, p in unet.named_parameters()}


def _same_weights(unet, ref_state):
    got = _state(unet)
    assert set(got) == set(ref_state)
    for k, v in ref_state.items():
        np.testing.assert_array_equal(got[k], v.astype(np.float32), err_msg=k)


def _check_output(unet, rtol=5e-6):
    ref = io()
    with flame.no_grad():
        assert_close(unet(*unet_inputs(ref)), ref["out"], rtol, "output")


# ----------------------------------------------------------------------------- layouts
def test_sai_file_ignores_vae_and_text_encoders(ref_state):
    with safe_open(SAI_FILE) as f:
        assert any(k.startswith("first_stage_model.") for k in f.keys())
        assert any(k.startswith("conditioner.embedders.") for k in f.keys())
    unet = load_unet(SAI_FILE, progress=False)
    assert unet.dtype == flame.float16                 # the file's dtype by default
    assert unet.config == configs["sdxl-tiny"]         # shapes + the matching preset's head size, groups, ...
    assert not any(p.requires_grad for p in unet.parameters()) and not unet.training
    _same_weights(unet, ref_state)


def test_diffusers_layouts(tmp_path, ref_state):
    # the unet/ folder, with its config.json
    _same_weights(load_unet(DIFFUSERS_DIR, progress=False), ref_state)
    # a pipeline folder that contains unet/
    pipe = tmp_path / "pipe"
    shutil.copytree(DIFFUSERS_DIR, pipe / "unet")
    (pipe / "vae").mkdir()
    unet = load_unet(pipe, dtype=flame.float32, progress=False)
    _same_weights(unet, ref_state)
    _check_output(unet)
    # the weights file named directly (its folder's config.json applies), and a lone diffusers-named file whose
    # config comes from its shapes
    _same_weights(load_unet(os.path.join(DIFFUSERS_DIR, "diffusion_pytorch_model.safetensors"), progress=False),
                  ref_state)
    lone = tmp_path / "lone.safetensors"
    shutil.copy(os.path.join(DIFFUSERS_DIR, "diffusion_pytorch_model.safetensors"), lone)
    unet = load_unet(lone, progress=False)
    assert unet.config == configs["sdxl-tiny"]
    _same_weights(unet, ref_state)


def test_bare_and_prefixed_files(tmp_path, ref_state):
    bare = tmp_path / "bare.safetensors"
    save_file({k: v for k, v in ref_state.items()}, bare)
    _same_weights(load_unet(bare, progress=False), ref_state)
    unet_prefixed = tmp_path / "unet_prefixed.safetensors"
    nrb = configs["sdxl-tiny"].num_res_blocks
    save_file({"unet." + sai_to_diffusers_key(k, nrb): v for k, v in ref_state.items()}, unet_prefixed)
    _same_weights(load_unet(unet_prefixed, progress=False), ref_state)


def test_dtype_and_device_on_load():
    unet = load_unet(SAI_FILE, dtype=flame.bfloat16, device="cpu", progress=False)
    assert {p.dtype for p in unet.parameters()} == {flame.bfloat16}
    assert unet.device == flame.device("cpu")


# ----------------------------------------------------------------------------- saving
@pytest.mark.parametrize("layout", ["sai", "diffusers"])
def test_round_trips(tmp_path, layout, ref_state):
    unet = load_unet(SAI_FILE, dtype=flame.float32, progress=False)
    path = tmp_path / ("unet.safetensors" if layout == "sai" else "unet")
    written = save_unet(unet, path, layout=layout)
    assert all(os.path.exists(p) for p in written)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    back = load_unet(path, progress=False)
    assert back.config == unet.config and back.dtype == flame.float32
    _same_weights(back, ref_state)
    if layout == "diffusers":
        with open(path / "config.json") as f:
            cfg = json.load(f)
        # the diffusers config FLAME writes describes the same model diffusers' own does
        assert UNetConfig.from_diffusers_config(cfg) == UNetConfig.from_diffusers_config(diffusers_config())
        with safe_open(written[0]) as f:
            assert set(f.keys()) == set(safe_open(os.path.join(DIFFUSERS_DIR,
                                                               "diffusion_pytorch_model.safetensors")).keys())
    else:
        with safe_open(path) as f:
            assert all(k.startswith("model.diffusion_model.") for k in f.keys())
            assert "flame.unet_config" in f.metadata()


def test_sai_to_diffusers_to_sai_and_sharding(tmp_path, ref_state):
    unet = load_unet(SAI_FILE, progress=False)
    save_unet(unet, tmp_path / "a", layout="diffusers", max_shard_size=60_000)
    shards = sorted(n for n in os.listdir(tmp_path / "a") if n.endswith(".safetensors"))
    assert len(shards) > 3 and (tmp_path / "a" / "diffusion_pytorch_model.safetensors.index.json").exists()
    mid = load_unet(tmp_path / "a", progress=False)
    _same_weights(mid, ref_state)
    _same_weights(load_unet(tmp_path / "a" / "diffusion_pytorch_model.safetensors.index.json", progress=False),
                  ref_state)
    save_unet(mid, tmp_path / "b.safetensors", layout="sai", prefix="")
    with safe_open(tmp_path / "b.safetensors") as f:
        assert "input_blocks.0.0.weight" in f.keys()
    _same_weights(load_unet(tmp_path / "b.safetensors", progress=False), ref_state)
    save_unet(mid, tmp_path / "c.safetensors", layout="diffusers")      # one diffusers-named file
    _same_weights(load_unet(tmp_path / "c.safetensors", progress=False), ref_state)
    with pytest.raises(ValueError, match="layout"):
        save_unet(mid, tmp_path / "d.safetensors", layout="comfy")
    with pytest.raises(ValueError, match="one .safetensors file"):
        save_unet(mid, tmp_path / "e", layout="sai")
    with pytest.raises(ValueError, match="max_shard_size"):
        save_unet(mid, tmp_path / "f.safetensors", max_shard_size=10)


# ----------------------------------------------------------------------------- key layouts and configs
def test_key_mapping_matches_diffusers_sdxl_base():
    ref = sdxl_base_keys()
    for sai, (diffusers, _) in ref.items():
        assert sai_to_diffusers_key(sai, 2) == diffusers
    nrb, up_attn = diffusers_layout_facts([d for d, _ in ref.values()])
    assert (nrb, up_attn) == (2, {0, 1})
    for sai, (diffusers, _) in ref.items():
        assert diffusers_to_sai_key(diffusers, nrb, up_attn) == sai
    with pytest.raises(KeyError, match="no diffusers name"):
        sai_to_diffusers_key("input_blocks.1.3.weight", 2)
    with pytest.raises(KeyError, match="no SAI name"):
        diffusers_to_sai_key("down_blocks.0.resnets.2.conv1.weight", 2, set())


def test_tiny_mapping_matches_the_fixture_files():
    with safe_open(os.path.join(DIFFUSERS_DIR, "diffusion_pytorch_model.safetensors")) as f:
        diffusers_keys = set(f.keys())
    with safe_open(SAI_FILE) as f:
        sai_keys = {k[len("model.diffusion_model."):] for k in f.keys() if k.startswith("model.diffusion_model.")}
    assert {sai_to_diffusers_key(k, 2) for k in sai_keys} == diffusers_keys
    assert "output_blocks.5.1.conv.weight" in sai_keys          # the upsampler of the level without attention
    assert "output_blocks.2.2.conv.weight" in sai_keys


def test_diffusers_configs():
    assert UNetConfig.from_diffusers_config(sdxl_base_config()) == configs["sdxl-base"]
    assert UNetConfig.from_diffusers_config(diffusers_config()) == configs["sdxl-tiny"]
    for name in ("sdxl-base", "sdxl-tiny"):
        c = configs[name]
        assert UNetConfig.from_diffusers_config(c.to_diffusers_config()) == c
    base = sdxl_base_config()
    for change, match in ((dict(use_linear_projection=False), "use_linear_projection"),
                          (dict(addition_embed_type=None), "addition_embed_type"),
                          (dict(attention_head_dim=[5, 10, 10]), "head size"),
                          (dict(time_cond_proj_dim=256), "time_cond_proj_dim"),
                          (dict(up_block_types=["UpBlock2D"] * 3), "mirror"),
                          (dict(_class_name="AutoencoderKL"), "UNet2DConditionModel")):
        with pytest.raises(UNetConfigError, match=match):
            UNetConfig.from_diffusers_config(dict(base, **change))
    odd = configs["sdxl-base"].replace(transformer_depth=(0, 2, 4), transformer_depth_middle=10)
    with pytest.raises(UNetConfigError, match="transformer_depth_middle"):
        odd.to_diffusers_config()


def test_config_from_metadata_and_overrides(tmp_path):
    unet = load_unet(SAI_FILE, progress=False)
    # a UNet the presets do not know: its head size is not in the weights, FLAME's metadata carries it
    odd = unet.config.replace(num_head_channels=4)
    with flame.no_grad():
        other = SDXLUNet(odd, dtype=flame.float16)
    save_unet(other, tmp_path / "odd.safetensors")
    assert load_unet(tmp_path / "odd.safetensors", progress=False).config == odd
    stripped = tmp_path / "stripped.safetensors"
    save_file(load_file(tmp_path / "odd.safetensors"), stripped)          # the same tensors, no metadata
    assert load_unet(stripped, progress=False).config == configs["sdxl-tiny"]
    assert load_unet(stripped, config={"num_head_channels": 4}, progress=False).config == odd
    assert load_unet(stripped, config=odd, progress=False).config == odd
    with pytest.raises(UNetCheckpointError, match="unknown UNetConfig field"):
        load_unet(stripped, config={"heads": 4})
    with pytest.raises(TypeError, match="config must be"):
        load_unet(stripped, config="sdxl-tiny")


# ----------------------------------------------------------------------------- errors
def test_not_a_unet(tmp_path):
    vae = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": np.zeros((8, 3, 3, 3), np.float16),
               "decoder.up.0.block.0.conv1.weight": np.zeros((8, 8, 3, 3), np.float16)}, vae)
    with pytest.raises(UNetCheckpointError, match="looks like a VAE") as e:
        load_unet(vae)
    assert "\n" not in str(e.value)
    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": np.zeros((4, 8), np.float32)}, lora)
    with pytest.raises(UNetCheckpointError, match="LoRA"):
        load_unet(lora)
    pickle = tmp_path / "model.ckpt"
    pickle.write_bytes(b"not read")
    with pytest.raises(UNetCheckpointError, match="only safetensors"):
        load_unet(pickle)
    with pytest.raises(FileNotFoundError):
        load_unet(tmp_path / "nothing.safetensors")
    folder = tmp_path / "vae_folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(UNetCheckpointError, match="not a UNet folder"):
        load_unet(folder)


def test_missing_unexpected_and_misshaped_are_named(tmp_path, ref_state):
    state = dict(ref_state)
    del state["middle_block.1.transformer_blocks.1.attn2.to_v.weight"]
    state["output_blocks.3.0.extra.weight"] = np.zeros(3, np.float16)
    state["out.2.bias"] = np.zeros(5, np.float16)
    path = tmp_path / "broken.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, path)
    with pytest.raises(UNetCheckpointError) as e:
        load_unet(path)
    msg = str(e.value)
    assert "missing keys (1): model.diffusion_model.middle_block.1.transformer_blocks.1.attn2.to_v.weight" in msg
    assert "unexpected keys (1): model.diffusion_model.output_blocks.3.0.extra.weight" in msg
    assert "model.diffusion_model.out.2.bias: (5,) in the file, (4,) in the model" in msg
    # the same in a diffusers-named file: the file's own names are reported
    nrb = 2
    diff = {sai_to_diffusers_key(k, nrb): v for k, v in ref_state.items()
            if k != "middle_block.1.transformer_blocks.1.attn2.to_v.weight"}
    diff["down_blocks.0.mystery.weight"] = np.zeros(2, np.float16)
    dpath = tmp_path / "broken_diffusers.safetensors"
    save_file(diff, dpath)
    with pytest.raises(UNetCheckpointError) as e:
        load_unet(dpath)
    msg = str(e.value)
    assert "mid_block.attentions.0.transformer_blocks.1.attn2.to_v.weight" in msg
    assert "down_blocks.0.mystery.weight" in msg
    # strict=False loads what is there (missing stays unloaded, unexpected ignored)
    partial = tmp_path / "partial.safetensors"
    state = dict(ref_state)
    state["output_blocks.3.0.extra.weight"] = np.zeros(3, np.float16)
    save_file(state, partial)
    with pytest.raises(UNetCheckpointError, match="unexpected"):
        load_unet(partial)
    _same_weights(load_unet(partial, strict=False, progress=False), ref_state)


def test_conv_projection_unets_are_refused(tmp_path, ref_state):
    state = dict(ref_state)
    for k in [k for k in state if k.endswith(("proj_in.weight", "proj_out.weight"))]:
        state[k] = state[k][:, :, None, None]
    path = tmp_path / "sd1.safetensors"
    save_file(state, path)
    with pytest.raises(UNetCheckpointError, match="1x1 convs"):
        load_unet(path)


def test_refiner_like_layout_round_trips(tmp_path):
    """A last level without attention and a middle depth of its own (SDXL refiner's shape, at toy size): both
    layouts give back the same weights and outputs; a bare SAI file of it needs the fields the weights cannot tell."""
    cfg = UNetConfig(model_channels=8, channel_mult=(1, 2, 2, 2), num_res_blocks=1, transformer_depth=(0, 1, 1, 0),
                     transformer_depth_middle=2, num_head_channels=8, context_dim=16, adm_in_channels=40,
                     size_embed_dim=4, norm_num_groups=4)
    flame.manual_seed(3)
    unet = SDXLUNet(cfg, dtype=flame.float32)
    names = {k for k, _ in unet.named_parameters()}
    assert "output_blocks.1.1.conv.weight" in names and "middle_block.1.transformer_blocks.1.ff.net.2.bias" in names
    x = flame.randn(1, 4, 16, 16)
    inputs = (x, flame.tensor([10]), flame.randn(1, 5, 16), flame.randn(1, 40))
    with flame.no_grad():
        want = unet(*inputs).numpy()
    save_unet(unet, tmp_path / "d", layout="diffusers")
    save_unet(unet, tmp_path / "s.safetensors")
    for path in (tmp_path / "d", tmp_path / "s.safetensors"):
        back = load_unet(path, progress=False)
        assert back.config == cfg
        with flame.no_grad():
            np.testing.assert_array_equal(back(*inputs).numpy(), want)
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(tmp_path / "s.safetensors"), bare)
    with pytest.raises(UNetCheckpointError, match="num_head_channels"):
        load_unet(bare)
    assert load_unet(bare, config={"num_head_channels": 8, "norm_num_groups": 4, "size_embed_dim": 4},
                     progress=False).config == cfg
