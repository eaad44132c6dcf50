"""LoCon on the SDXL UNet: the name map covers its convolutions, kohya's conv targets, a PEFT LoRA written by
diffusers on convolutions and a Linear loads and gives diffusers' output (tests/fixtures/make_locon_fixtures.py),
and kohya / PEFT files with conv adapters round-trip with equal numbers."""
import os

import numpy as np
import pytest
from sdxl_fixtures import SAI_FILE, assert_close, io, sdxl_base_keys, unet_inputs

import flame_core as flame
import flame_nn
from flame_core.io import load_file, safe_open
from flame_models.sdxl import (
    CONV_TARGETS,
    KOHYA_METADATA,
    RESNET_LINEAR_TARGETS,
    TARGET_PRESETS,
    SDXLUNet,
    kohya_diffusers_to_sai,
    load_unet,
    unet_name_map,
)
from flame_nn.adapters import (
    AdapterError,
    adapter_modules,
    adapter_parameters,
    find_targets,
    inject_adapters,
    load_adapters,
    save_adapters,
)

LOCON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "locon")


def _tiny():
    return load_unet(SAI_FILE, dtype=flame.float32, progress=False)


def test_name_map_covers_the_convolutions_of_sdxl_base():
    with flame_nn.empty_init(device="cpu", dtype=flame.bfloat16):
        unet = SDXLUNet("sdxl-base")
    nm = unet_name_map(unet)
    ref = sdxl_base_keys()
    convs = [n for n, m in unet.named_modules() if isinstance(m, flame_nn.Conv2d)]
    # conv_in, conv_out, 2 per ResBlock (17), 2 downsamplers, 2 upsamplers, and a 1x1 skip conv where the channels
    # change
    assert len(convs) == 2 + 2 * 17 + 2 + 2 + sum("skip_connection" in n for n in convs)
    for name in convs:
        (peft_name, ranges), = nm.targets[name]
        assert peft_name + ".weight" == ref[name + ".weight"][0], name
        assert ranges == [(0, ref[name + ".weight"][1][0])]
    assert nm.peft_targets("output_blocks.2.2.conv") == [("up_blocks.0.upsamplers.0.conv", [(0, 1280)])]
    assert nm.module_of("down_blocks.1.downsamplers.0.conv") == ("input_blocks.6.0.op", [(0, 640)])
    assert nm.module_of("conv_in") == ("input_blocks.0.0", [(0, 320)])
    # kohya's LoCon set: 3x3 convs of ResBlocks / downsamplers / upsamplers; emb Linear and 1x1 skip at linear rank
    conv3 = [n for n, _, _ in find_targets(unet, CONV_TARGETS)]
    assert len(conv3) == 2 * 17 + 2 + 2 and "input_blocks.0.0" not in conv3 and "out.2" not in conv3
    assert all(unet.get_submodule(n).kernel_size == (3, 3) for n in conv3)
    extra = [n for n, _, _ in find_targets(unet, RESNET_LINEAR_TARGETS)]
    assert sum("emb_layers" in n for n in extra) == 17
    assert all(unet.get_submodule(n).kernel_size == (1, 1) for n in extra if "skip" in n)
    # diffusers-named kohya keys of convolutions are renamed too
    assert kohya_diffusers_to_sai({"lora_unet_up_blocks_1_upsamplers_0_conv.alpha": 1}, unet) == {
        "lora_unet_output_blocks_5_2_conv.alpha": 1}


def test_peft_locon_file_from_diffusers_matches_its_output():
    ref = io()
    unet = _tiny()
    path = os.path.join(LOCON, "sdxl_peft_locon.safetensors")
    load_adapters(unet, path)
    mods = {m: ad for m, _, ad in adapter_modules(unet)}
    assert "input_blocks.1.0.in_layers.2" in mods and "input_blocks.3.0.op" in mods
    assert "output_blocks.2.0.skip_connection" in mods and "output_blocks.5.1.conv" in mods
    assert tuple(mods["input_blocks.1.0.in_layers.2"].lora_A.shape) == (2, 8, 3, 3)
    assert mods["input_blocks.1.0.in_layers.2"].scale == 2.0      # lora_alpha 4 / r 2 from the file's LoraConfig
    want = load_file(os.path.join(LOCON, "sdxl_locon_out.safetensors"))["out"].numpy()
    with flame.no_grad():
        got = unet(*unet_inputs(ref))
    assert np.abs(want - ref["out"]).max() > 0.1 * np.abs(ref["out"]).max()
    assert_close(got, want, 2e-5, "diffusers' PEFT LoCon")


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_locon_files_roundtrip_on_the_tiny_unet(tmp_path, fmt):
    ref = io()
    unet = _tiny()
    lin = inject_adapters(unet, TARGET_PRESETS["attention"] + RESNET_LINEAR_TARGETS, rank=2, alpha=1,
                          generator=flame.Generator().manual_seed(1))
    conv = inject_adapters(unet, CONV_TARGETS, rank=3, alpha=6, generator=flame.Generator().manual_seed(2))
    assert len(conv) == 2 * 17 + 2 + 2                     # 17 ResBlocks, 2 downsamplers, 2 upsamplers
    assert len(lin) == 17 * 2 * 4 + 17 + 10               # attention, emb_layers.1, the 10 1x1 skip convs
    assert not any(p.requires_grad for p in unet.parameters())
    for p in adapter_parameters(unet):
        with flame.no_grad():
            p.copy_(flame.randn(*p.shape, generator=flame.Generator().manual_seed(7 + p.numel())) * 0.1)
    with flame.no_grad():
        want = unet(*unet_inputs(ref)).numpy()
    assert np.abs(want - ref["out"]).max() > 1e-2
    path = tmp_path / f"{fmt}.safetensors"
    save_adapters(unet, path, format=fmt, metadata=KOHYA_METADATA if fmt == "kohya" else None)
    with safe_open(path) as f:
        shapes = {k: tuple(f.get_array(k).shape) for k in f.keys()}
    if fmt == "kohya":
        assert shapes["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"] == (3, 8, 3, 3)
        assert shapes["lora_unet_input_blocks_1_0_in_layers_2.lora_up.weight"] == (8, 3, 1, 1)
        assert shapes["lora_unet_input_blocks_4_0_skip_connection.lora_down.weight"] == (2, 8, 1, 1)
        assert shapes["lora_unet_input_blocks_1_0_in_layers_2.alpha"] == ()
    else:
        assert shapes["unet.down_blocks.0.resnets.0.conv1.lora_A.weight"] == (3, 8, 3, 3)
        assert shapes["unet.down_blocks.0.resnets.0.conv1.lora_B.weight"] == (8, 3, 1, 1)
        assert shapes["unet.up_blocks.0.upsamplers.0.conv.lora_B.weight"] == (16, 3, 1, 1)
    params = [p.detach().numpy().copy() for p in adapter_parameters(unet)]
    other = _tiny()
    load_adapters(other, path)
    for p, q in zip(adapter_parameters(other), params):      # same model order
        np.testing.assert_allclose(p.detach().numpy(), q, rtol=1e-6, atol=1e-7)
    with flame.no_grad():
        assert_close(other(*unet_inputs(ref)), want, 1e-6, fmt)


def test_other_kinds_on_sdxl_convolutions_are_refused():
    unet = _tiny()
    with pytest.raises(AdapterError, match=r"input_blocks\.1\.0\.in_layers\.2: a lokr adapter cannot adapt a Conv2d"):
        inject_adapters(unet, CONV_TARGETS, "lokr")
