"""Flux checkpoint layouts: BFL key shapes and parameter counts, and the BFL <-> diffusers conversion."""
import numpy as np
import pytest

import flame_core as flame
from flame_models.flux import keys as K
from flame_models.flux.params import flux_params


def test_flux_dev_and_schnell_parameter_counts_match_the_released_checkpoints():
    dev = K.bfl_shapes("flux-dev")
    assert len(dev) == 780
    assert sum(int(np.prod(s)) for s in dev.values()) == 11_901_408_320
    schnell = K.bfl_shapes("flux-schnell")
    assert sum(int(np.prod(s)) for s in schnell.values()) == 11_891_178_560
    assert not any(k.startswith("guidance_in") for k in schnell)
    block = sum(int(np.prod(s)) for k, s in dev.items() if k.startswith("double_blocks.0."))
    single = sum(int(np.prod(s)) for k, s in dev.items() if k.startswith("single_blocks.0."))
    assert round(block / 1e6, 1) == 339.8 and round(single / 1e6, 1) == 141.6
    assert dev["single_blocks.7.linear1.weight"] == (21504, 3072)
    assert dev["single_blocks.7.linear2.weight"] == (3072, 15360)
    assert dev["final_layer.adaLN_modulation.1.weight"] == (6144, 3072)


def test_diffusers_names_of_flux_dev():
    plan = K.diffusers_plan("flux-dev")
    dkeys = [k for dks, _, _ in plan.values() for k in dks]
    assert len(dkeys) == len(set(dkeys))
    # diffusers has 3 tensors per qkv (x2 for bias) and 4 per single linear1: 780 + 2*2*2*19 + 3*2*38
    assert len(dkeys) == 780 + 2 * 2 * 2 * 19 + 3 * 2 * 38
    assert plan["double_blocks.3.txt_attn.qkv.bias"][:2] == (
        ("transformer_blocks.3.attn.add_q_proj.bias", "transformer_blocks.3.attn.add_k_proj.bias",
         "transformer_blocks.3.attn.add_v_proj.bias"), "cat")
    assert plan["single_blocks.37.linear1.weight"] == (
        tuple(f"single_transformer_blocks.37.{m}.weight"
              for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")), "cat", (3072, 3072, 3072, 12288))
    assert plan["double_blocks.0.img_attn.norm.key_norm.scale"][0] == ("transformer_blocks.0.attn.norm_k.weight",)
    assert plan["double_blocks.0.txt_attn.norm.query_norm.scale"][0] == (
        "transformer_blocks.0.attn.norm_added_q.weight",)
    assert plan["double_blocks.0.img_attn.proj.weight"][0] == ("transformer_blocks.0.attn.to_out.0.weight",)
    assert plan["guidance_in.out_layer.bias"][0] == ("time_text_embed.guidance_embedder.linear_2.bias",)
    assert plan["final_layer.adaLN_modulation.1.bias"][:2] == (("norm_out.linear.bias",), "swap")
    with pytest.raises(KeyError, match="double_blocks.0.img_attn.bogus"):
        K.bfl_to_diffusers_key("double_blocks.0.img_attn.bogus.weight")


def _random_bfl_state(params, seed=0):
    rng = np.random.default_rng(seed)
    return {k: flame.tensor(rng.standard_normal(s).astype(np.float32)) for k, s in K.bfl_shapes(params).items()}


def test_conversion_splits_qkv_and_swaps_the_final_modulation():
    p = flux_params("flux-tiny")
    H, M = p.hidden_size, p.mlp_hidden_dim
    bfl = _random_bfl_state(p)
    d = K.bfl_to_diffusers(bfl, p)
    qkv = bfl["double_blocks.1.img_attn.qkv.weight"].numpy()
    np.testing.assert_array_equal(d["transformer_blocks.1.attn.to_k.weight"].numpy(), qkv[H:2 * H])
    np.testing.assert_array_equal(d["transformer_blocks.1.attn.add_v_proj.bias"].numpy(),
                                  bfl["double_blocks.1.txt_attn.qkv.bias"].numpy()[2 * H:])
    lin1 = bfl["single_blocks.0.linear1.weight"].numpy()
    np.testing.assert_array_equal(d["single_transformer_blocks.0.proj_mlp.weight"].numpy(), lin1[3 * H:])
    assert d["single_transformer_blocks.0.proj_mlp.weight"].shape == (M, H)
    ada = bfl["final_layer.adaLN_modulation.1.weight"].numpy()  # rows: shift | scale
    dn = d["norm_out.linear.weight"].numpy()                     # rows: scale | shift
    np.testing.assert_array_equal(dn[:H], ada[H:])
    np.testing.assert_array_equal(dn[H:], ada[:H])
    back = K.diffusers_to_bfl(d, p)
    assert set(back) == set(bfl)
    for k in bfl:
        np.testing.assert_array_equal(back[k].numpy(), bfl[k].numpy(), err_msg=k)


def test_layout_detection_and_prefixes():
    bfl_keys = list(K.bfl_shapes("flux-tiny"))
    assert K.detect_layout(bfl_keys) == "bfl"
    assert K.detect_layout([k for dk, _, _ in K.diffusers_plan("flux-tiny").values() for k in dk]) == "diffusers"
    prefix, stripped = K.strip_prefix(["model.diffusion_model." + k for k in bfl_keys] + ["vae.encoder.x"])
    assert prefix == "model.diffusion_model." and stripped == bfl_keys
    assert K.strip_prefix(bfl_keys) == ("", bfl_keys)
    with pytest.raises(KeyError, match="not a Flux transformer checkpoint"):
        K.detect_layout(["encoder.conv_in.weight"])
