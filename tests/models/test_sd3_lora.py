"""SD3 LoRA names (FLAME/SAI <-> diffusers PEFT, kohya), target presets, and a tiny LoRA forward/backward/save/load."""
import numpy as np
import pytest
from sd3_helpers import diffusers_dir, inputs, io, npy, params

import flame_core as flame
import flame_nn.adapters as A
from flame_core.io import safe_open
from flame_models.sd3 import KOHYA_METADATA, TARGET_PRESETS, load_sd3, name_map_for, sd3_params
from flame_models.sd3 import keys as K
from flame_nn.adapters import formats as F
from flame_nn.optim import AdamW


@pytest.mark.parametrize("preset", ["sd3.5-large", "sd3.5-medium", "sd3.5-tiny"])
def test_name_map_agrees_with_the_checkpoint_plan(preset):
    p = sd3_params(preset)
    nm = name_map_for(p)
    plan = K.diffusers_plan(p)
    linears = [k[:-len(".weight")] for k, s in K.sai_shapes(p).items() if k.endswith(".weight") and len(s) == 2]
    assert sorted(nm.targets) == sorted(linears)  # every Linear (not the patch conv), nothing else
    for m in linears:
        dkeys, how, sizes = plan[m + ".weight"]
        targets = nm.peft_targets(m)
        assert [n + ".weight" for n, _ in targets] == list(dkeys), m
        if how == "swap":
            H = sizes[0] // 2
            assert targets[0][1] == [(H, 2 * H), (0, H)], m
        else:
            assert [hi - lo for _, ((lo, hi),) in targets] == list(sizes), m
        for n, rg in targets:
            assert nm.module_of(n) == (m, [tuple(r) for r in rg])


def test_peft_names_are_diffusers_modules():
    """Every diffusers name of the map is a Linear of diffusers' own SD3Transformer2DModel (the fixture's keys)."""
    keys = set()
    for shard in diffusers_dir("dual").glob("*.safetensors"):
        with safe_open(shard) as f:
            keys |= set(f.keys())
    nm = name_map_for(params("dual"))
    names = {n for parts in nm.targets.values() for n, _ in parts}
    assert {n + ".weight" for n in names} <= keys
    linear_keys = {k for k in keys if k.endswith(".weight") and not k.startswith("pos_embed")
                   and ".norm_" not in k}
    assert {n + ".weight" for n in names} == linear_keys


def test_kohya_names():
    assert F.kohya_name("joint_blocks.3.x_block.attn.qkv") == "lora_unet_joint_blocks_3_x_block_attn_qkv"
    assert F.kohya_name("joint_blocks.0.context_block.mlp.fc1") == "lora_unet_joint_blocks_0_context_block_mlp_fc1"
    assert KOHYA_METADATA["ss_network_module"] == "networks.lora_sd3"


def tiny_model(device):
    return load_sd3(diffusers_dir("dual"), dtype=flame.float32, device=device)


def test_diffusers_style_targets_select_row_ranges_of_the_fused_qkv(device):
    model = tiny_model(device)
    H = model.hidden_size
    made = A.inject_adapters(model, TARGET_PRESETS["attention"], rank=2, name_map=name_map_for(model.params))
    got = {(m, r) for m, r in made}
    for i in range(2):
        b = f"joint_blocks.{i}.x_block"
        assert {(f"{b}.attn.qkv", (0, H)), (f"{b}.attn.qkv", (H, 2 * H)), (f"{b}.attn.qkv", (2 * H, 3 * H)),
                (f"{b}.attn.proj", None)} <= got
    # attn2 of the dual block (PEFT's suffix match selects it too), nothing of the context stream
    assert {("joint_blocks.0.x_block.attn2.qkv", (0, H)), ("joint_blocks.0.x_block.attn2.proj", None)} <= got
    assert not any("context_block" in m for m, _ in made) and len(made) == 2 * 4 + 4
    both = tiny_model(device)
    made = A.inject_adapters(both, TARGET_PRESETS["attention_all"], rank=2, name_map=name_map_for(both.params))
    assert {m for m, _ in made} == {f"joint_blocks.{i}.{s}.attn.{n}" for i in range(2)
                                    for s in ("x_block", "context_block") for n in ("qkv", "proj")} \
        - {"joint_blocks.1.context_block.attn.proj"}
    everything = tiny_model(device)
    made = A.inject_adapters(everything, TARGET_PRESETS["all_linear"], rank=2)
    assert all(r is None for _, r in made) and len(made) == sum(
        1 for n in name_map_for(everything.params).targets if n.startswith("joint_blocks."))


def test_tiny_lora_trains_saves_and_loads_in_both_formats(tmp_path, device):
    arrays = io("dual")
    args = inputs(arrays, flame.float32, device)
    nm = name_map_for(params("dual"))
    model = tiny_model(device)
    model.enable_gradient_checkpointing()
    with flame.no_grad():
        base = npy(model(*args))
    A.inject_adapters(model, TARGET_PRESETS["attention"], rank=4, alpha=4, name_map=nm,
                      generator=flame.Generator("cpu").manual_seed(0))
    opt = AdamW(A.adapter_parameters(model), lr=1e-2)
    target = flame.tensor(np.zeros_like(base), device=device)
    losses = []
    for _ in range(3):
        loss = ((model(*args) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[2] < losses[0]
    assert all(p.grad is None or not p.requires_grad for p in model.parameters())  # the base stays frozen
    with flame.no_grad():
        tuned = npy(model(*args))
    assert np.abs(tuned - base).max() > 1e-3

    for fmt in ("kohya", "peft"):
        path = tmp_path / f"lora_{fmt}.safetensors"
        A.save_adapters(model, path, format=fmt, name_map=nm, metadata=KOHYA_METADATA)
        with safe_open(path) as f:
            keys = set(f.keys())
            if fmt == "kohya":
                assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight" in keys
            else:
                assert "transformer.transformer_blocks.1.attn.to_q.lora_A.weight" in keys
                assert "transformer.transformer_blocks.0.attn2.to_out.0.lora_B.weight" in keys
                # to_q / to_k / to_v's LoRAs are exactly the changes of the fused qkv's row thirds
                H = model.hidden_size
                qkv = model.get_submodule("joint_blocks.1.x_block.attn.qkv")
                w0 = npy(qkv.weight).astype(np.float64)
                A.merge_adapters(model)
                merged = npy(qkv.weight).astype(np.float64)
                A.unmerge_adapters(model)
                for j, name in enumerate(("to_q", "to_k", "to_v")):
                    pre = f"transformer.transformer_blocks.1.attn.{name}"
                    delta = f.get_array(pre + ".lora_B.weight").astype(np.float64) \
                        @ f.get_array(pre + ".lora_A.weight").astype(np.float64)
                    assert np.abs(delta).max() > 1e-3
                    np.testing.assert_allclose(merged[j * H:(j + 1) * H] - w0[j * H:(j + 1) * H], delta,
                                               rtol=1e-4, atol=1e-6)
        fresh = tiny_model(device)
        A.load_adapters(fresh, path, name_map=nm)
        with flame.no_grad():
            np.testing.assert_allclose(npy(fresh(*args)), tuned, rtol=1e-5, atol=1e-5)
