"""SDXL adapters: the SAI <-> diffusers name map (checked on SDXL base), the target presets, a tiny LoRA forward /
backward (also with checkpointing and through a BlockStreamer), and kohya / PEFT files with the names real SDXL LoRA
files use."""
import numpy as np
import pytest
from sdxl_fixtures import SAI_FILE, assert_close, io, sdxl_base_keys, t, unet_inputs

import flame_core as flame
import flame_nn
from flame_core.io import safe_open
from flame_models.sdxl import (
    KOHYA_METADATA,
    PEFT_PREFIX,
    TARGET_PRESETS,
    SDXLUNet,
    kohya_diffusers_to_sai,
    load_unet,
    unet_name_map,
)
from flame_nn.adapters import adapter_parameters, find_targets, inject_adapters, load_adapters, save_adapters
from flame_nn.offload import BlockStreamer


def _tiny():
    return load_unet(SAI_FILE, dtype=flame.float32, progress=False)


def test_name_map_matches_diffusers_on_sdxl_base():
    with flame_nn.empty_init(device="cpu", dtype=flame.bfloat16):
        unet = SDXLUNet("sdxl-base")
    nm = unet_name_map(unet)
    ref = sdxl_base_keys()
    linears = [n for n, m in unet.named_modules() if isinstance(m, flame_nn.Linear)]
    # 70 transformer blocks x 10, proj_in / proj_out of 11 SpatialTransformers, 17 ResBlocks' emb_layers.1, and the
    # time / label embedding MLPs
    assert len(linears) == 700 + 22 + 17 + 4
    convs = [n for n, m in unet.named_modules() if isinstance(m, flame_nn.Conv2d)]   # (test_sdxl_locon.py)
    assert set(nm.targets) == set(linears) | set(convs)
    for name in linears:
        (peft_name, ranges), = nm.targets[name]
        assert peft_name + ".weight" == ref[name + ".weight"][0]
        assert ranges == [(0, ref[name + ".weight"][1][0])]
    assert nm.peft_targets("input_blocks.4.1.transformer_blocks.0.attn1.to_q") == [
        ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", [(0, 640)])]
    assert nm.module_of("up_blocks.0.resnets.2.time_emb_proj") == ("output_blocks.2.0.emb_layers.1", [(0, 1280)])
    assert nm.peft_prefix == PEFT_PREFIX == "unet."


def test_target_presets_select_the_expected_linears():
    with flame_nn.empty_init(device="cpu", dtype=flame.bfloat16):
        unet = SDXLUNet("sdxl-base")
    count = {k: len(find_targets(unet, v)) for k, v in TARGET_PRESETS.items()}
    # 70 transformer blocks x 2 attentions x 4 projections; + 2 FF Linears per block and proj_in/out of the 11 +
    # 11 + 1 SpatialTransformers; + one emb_layers Linear per ResBlock (6 + 2 + 9)
    assert count["attention"] == 560
    assert count["all_linear"] == 560 + 140 + 2 * (4 + 6 + 1)
    assert count["all_linear_resnet"] == count["all_linear"] + 17
    names = [n for n, _, _ in find_targets(unet, TARGET_PRESETS["all_linear"])]
    assert "middle_block.1.proj_in" in names and "output_blocks.0.1.transformer_blocks.9.ff.net.2" in names
    assert not any("emb_layers" in n or "time_embed" in n or "label_emb" in n for n in names)


def _loss(unet, ref):
    x, ts, ctx, y = unet_inputs(ref)
    return (unet(x, ts, ctx, y) * t(ref["loss_weight"])).sum()


def test_lora_forward_backward_checkpointing_and_streaming(device):
    ref = io()
    grads = {}
    for mode in ("plain", "checkpointing", "streamed", "streamed+checkpointing"):
        unet = _tiny()
        made = inject_adapters(unet, TARGET_PRESETS["attention"], rank=2, alpha=2,
                               generator=flame.Generator().manual_seed(0))
        assert len(made) == 17 * 2 * 4                   # 17 transformer blocks, 2 attentions, 4 projections
        params = dict((n, p) for n, p in unet.named_parameters() if p.requires_grad)
        assert not params                                # the base is frozen; adapters live outside the tree
        lora = adapter_parameters(unet)
        assert len(lora) == 2 * len(made)
        for p in lora:                                   # lora_up starts at 0: give it values so grads flow
            with flame.no_grad():
                p.copy_(flame.randn(*p.shape, generator=flame.Generator().manual_seed(p.numel())) * 0.1)
        streamer = None
        if "checkpointing" in mode:       # streamed: the per-block checkpoints nest in the streamer's
            unet.enable_gradient_checkpointing()
        if "streamed" in mode:
            streamer = BlockStreamer.for_model(unet, device=device, slots=2)
        try:
            loss = _loss(unet, ref)
            loss.backward()
        finally:
            if streamer is not None:
                streamer.close()
        grads[mode] = [p.grad.numpy().copy() for p in lora]
        assert all(np.abs(g).max() > 0 for g in grads[mode])
    for mode in ("checkpointing", "streamed", "streamed+checkpointing"):
        for a, b in zip(grads[mode], grads["plain"]):
            assert_close(a, b, 1e-5, mode)


def test_lora_with_zero_up_changes_nothing():
    ref = io()
    unet = _tiny()
    inject_adapters(unet, TARGET_PRESETS["all_linear"], rank=4, alpha=4)
    with flame.no_grad():
        assert_close(unet(*unet_inputs(ref)), ref["out"], 5e-6, "fresh LoRA")


def test_kohya_and_peft_files(tmp_path):
    ref = io()
    unet = _tiny()
    inject_adapters(unet, TARGET_PRESETS["all_linear_resnet"], rank=2, alpha=1,
                    generator=flame.Generator().manual_seed(1))
    for p in adapter_parameters(unet):
        with flame.no_grad():
            p.copy_(flame.randn(*p.shape, generator=flame.Generator().manual_seed(7 + p.numel())) * 0.1)
    with flame.no_grad():
        want = unet(*unet_inputs(ref)).numpy()
    nm = unet_name_map(unet)

    kohya = tmp_path / "kohya.safetensors"
    save_adapters(unet, kohya, format="kohya", name_map=nm, metadata=KOHYA_METADATA)
    with safe_open(kohya) as f:
        keys = set(f.keys())
        assert f.metadata()["ss_network_module"] == "networks.lora"
    assert "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_unet_output_blocks_0_0_emb_layers_1.alpha" in keys
    assert "lora_unet_middle_block_1_proj_in.lora_up.weight" in keys

    peft = tmp_path / "peft.safetensors"
    save_adapters(unet, peft, format="peft", name_map=nm)
    with safe_open(peft) as f:
        pkeys = set(f.keys())
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight" in pkeys
    assert "unet.up_blocks.0.resnets.0.time_emb_proj.lora_B.weight" in pkeys
    assert all(k.startswith("unet.") for k in pkeys)

    for path in (kohya, peft):
        other = _tiny()
        load_adapters(other, path, name_map=nm)
        with flame.no_grad():
            assert_close(other(*unet_inputs(ref)), want, 1e-5, str(path.name))


def test_kohya_names_from_diffusers_are_renamed():
    unet = _tiny()
    sd = {"lora_unet_down_blocks_0_attentions_1_transformer_blocks_0_attn2_to_k.lora_down.weight": 1,
          "lora_unet_up_blocks_1_resnets_2_time_emb_proj.alpha": 2,
          "lora_unet_input_blocks_8_1_proj_out.lora_up.weight": 3}
    assert kohya_diffusers_to_sai(sd, unet) == {
        "lora_unet_input_blocks_2_1_transformer_blocks_0_attn2_to_k.lora_down.weight": 1,
        "lora_unet_output_blocks_5_0_emb_layers_1.alpha": 2,
        "lora_unet_input_blocks_8_1_proj_out.lora_up.weight": 3}
    with pytest.raises(KeyError, match="lora_unet_down_blocks_9"):
        kohya_diffusers_to_sai({"lora_unet_down_blocks_9_x.alpha": 0}, unet)
