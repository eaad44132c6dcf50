"""Flux LoRA names: FLAME/BFL <-> diffusers, checked against the checkpoint converter's independent plan."""
import numpy as np
import pytest

from flame_models.flux import keys as K
from flame_models.flux.lora_keys import TARGET_PRESETS, flux_name_map, name_map_for
from flame_models.flux.params import flux_params
from flame_nn.adapters import formats as F


@pytest.mark.parametrize("preset", ["flux-dev", "flux-schnell", "flux-tiny"])
def test_name_map_agrees_with_checkpoint_plan(preset):
    p = flux_params(preset)
    nm = name_map_for(p)
    plan = K.diffusers_plan(p)
    linears = [k[:-len(".weight")] for k, s in K.bfl_shapes(p).items() if k.endswith(".weight") and len(s) == 2]
    assert sorted(nm.targets) == sorted(linears)  # every Linear, nothing else
    for m in linears:
        dkeys, how, sizes = plan[m + ".weight"]
        targets = nm.peft_targets(m)
        assert [n + ".weight" for n, _ in targets] == list(dkeys), m
        if how == "swap":
            H = sizes[0] // 2
            assert targets[0][1] == [(H, 2 * H), (0, H)]
        else:  # row ranges tile the Linear in the plan's piece sizes
            assert [hi - lo for _, ((lo, hi),) in targets] == list(sizes), m
            assert targets[0][1][0][0] == 0 and all(a[1][0][1] == b[1][0][0] for a, b in zip(targets, targets[1:]))
        for n, rg in targets:
            assert nm.module_of(n) == (m, [tuple(r) for r in rg])


def test_dev_counts_and_names():
    nm = flux_name_map()
    assert len(nm.targets) == 19 * 10 + 38 * 3 + 2 + 6 + 2
    assert nm.peft_targets("single_blocks.37.linear1")[3] == ("single_transformer_blocks.37.proj_mlp",
                                                              [(9216, 21504)])
    assert F.kohya_name("double_blocks.18.txt_attn.qkv") == "lora_unet_double_blocks_18_txt_attn_qkv"
    assert F.kohya_name("single_blocks.0.modulation.lin") == "lora_unet_single_blocks_0_modulation_lin"


def test_lora_on_qkv_splits_into_diffusers_q_k_v(rng):
    """A kohya LoRA on a tiny Flux's img_attn.qkv equals, row block by row block, the diffusers to_q/to_k/to_v."""
    nm = name_map_for(flux_params("flux-tiny"))
    H = 64
    part = F.AdapterPart("lora", {"lora_down.weight": rng.standard_normal((4, H)),
                                  "lora_up.weight": rng.standard_normal((3 * H, 4))}, 8.0)
    sd, _ = F.to_peft({"double_blocks.1.img_attn.qkv": [part]}, nm)
    delta = part.delta_weight()
    for j, name in enumerate(("to_q", "to_k", "to_v")):
        a = sd[f"transformer.transformer_blocks.1.attn.{name}.lora_A.weight"]
        b = sd[f"transformer.transformer_blocks.1.attn.{name}.lora_B.weight"]
        np.testing.assert_allclose(b @ a, delta[j * H:(j + 1) * H], rtol=1e-12)


def test_presets_are_patterns():
    assert TARGET_PRESETS["attention"] == ["to_q", "to_k", "to_v", "to_out.0"]
    assert set(TARGET_PRESETS) == {"attention", "attention_all", "all_linear"}
