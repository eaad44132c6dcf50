"""flame_models.sdxl.SDXLUNet against diffusers' UNet2DConditionModel (tiny random config, both checkpoint layouts,
float32 and bfloat16, integer and fractional timesteps, gradients of a fixed loss), the y vector, SDXL base's
layout, gradient checkpointing and block streaming."""
import math

import numpy as np
import pytest
from sdxl_fixtures import DIFFUSERS_DIR, SAI_FILE, assert_close, io, sdxl_base_keys, t, unet_inputs

import flame_core as flame
import flame_nn
from flame_models.sdxl import (
    BasicTransformerBlock,
    ResBlock,
    SDXLUNet,
    configs,
    load_unet,
    make_y,
    size_embeddings,
    timestep_embedding,
)
from flame_nn.offload import BlockStreamer


@pytest.fixture(scope="module")
def unet32():
    return load_unet(DIFFUSERS_DIR, dtype=flame.float32, progress=False)


# ----------------------------------------------------------------------------- embeddings and y
def test_timestep_embedding_is_cos_first():
    ts = flame.tensor([0.0, 3.0, 999.0])
    emb = timestep_embedding(ts, 6).numpy()
    freqs = np.exp(-math.log(10000) * np.arange(3) / 3)
    args = np.array([0.0, 3.0, 999.0])[:, None] * freqs[None]
    np.testing.assert_allclose(emb, np.concatenate([np.cos(args), np.sin(args)], axis=1), rtol=1e-5, atol=1e-5)
    assert timestep_embedding(flame.tensor([1, 2]), 5).shape == (2, 5)          # odd width: a zero column
    with pytest.raises(ValueError, match=r"\(B,\)"):
        timestep_embedding(flame.zeros(2, 2), 4)


def test_make_y_matches_diffusers_time_ids():
    ref = io()
    y = make_y(t(ref["pooled"]), ref["original_size"], ref["crop_coords"], ref["target_size"], size_embed_dim=8)
    assert_close(y, ref["y"], 1e-6, "y")
    # one pair for the whole batch broadcasts; target defaults to the original size
    a = make_y(t(ref["pooled"]), (64, 96), (0, 0), size_embed_dim=8)
    b = make_y(t(ref["pooled"]), [[64, 96], [64, 96]], [[0, 0], [0, 0]], [[64, 96], [64, 96]], size_embed_dim=8)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert size_embeddings((1024, 1024), (0, 0), (1024, 1024), 3).shape == (3, 6 * 256)
    with pytest.raises(ValueError, match="crop_coords"):
        make_y(t(ref["pooled"]), (64, 96), [[0, 0]] * 3, size_embed_dim=8)
    with pytest.raises(ValueError, match="pooled"):
        make_y(flame.zeros(4), (64, 96))


# ----------------------------------------------------------------------------- golden outputs
@pytest.mark.parametrize("source", ["diffusers", "sai"])
@pytest.mark.parametrize("frac", [False, True])
def test_forward_matches_diffusers_float32(source, frac):
    ref = io()
    unet = load_unet(DIFFUSERS_DIR if source == "diffusers" else SAI_FILE, dtype=flame.float32, progress=False)
    with flame.no_grad():
        out = unet(*unet_inputs(ref, frac=frac))
    assert out.dtype == flame.float32
    assert_close(out, ref["out_frac" if frac else "out"], 5e-6, f"{source} frac={frac}")


def test_forward_bfloat16_is_close(unet32):
    ref = io()
    unet = load_unet(SAI_FILE, dtype=flame.bfloat16, progress=False)
    with flame.no_grad():
        out = unet(*unet_inputs(ref))
    assert out.dtype == flame.bfloat16
    rel = assert_close(out, ref["out"], 5e-2, "bf16")
    assert rel > 1e-4    # it did compute in bfloat16


def test_gradients_match_torch_autograd(unet32):
    """d(sum(out * w))/dx and /d(some weights) against torch's backward through diffusers' model (float64)."""
    ref = io()
    unet32.requires_grad_(True)
    try:
        x, ts, ctx, y = unet_inputs(ref)
        x.requires_grad_(True)
        unet32.zero_grad()
        (unet32(x, ts, ctx, y) * t(ref["loss_weight"])).sum().backward()
        assert_close(x.grad, ref["grad_x"], 2e-5, "grad x")
        params = dict(unet32.named_parameters())
        keys = [k[len("grad."):] for k in ref if k.startswith("grad.")]
        assert len(keys) == 6
        for k in keys:
            assert_close(params[k].grad, ref["grad." + k], 2e-5, k)
    finally:
        unet32.zero_grad()
        unet32.requires_grad_(False)


def test_input_checks(unet32):
    ref = io()
    x, ts, ctx, y = unet_inputs(ref)
    with flame.no_grad():
        with pytest.raises(ValueError, match="multiples of 4"):
            unet32(x[:, :, :14], ts, ctx, y)
        with pytest.raises(ValueError, match=r"x must be \(B, 4"):
            unet32(x[:, :3], ts, ctx, y)
        with pytest.raises(ValueError, match="timesteps"):
            unet32(x, flame.tensor([1, 2, 3]), ctx, y)
        # one timestep for the whole batch broadcasts, as in diffusers
        one = unet32(x, flame.tensor(37), ctx, y).numpy()
        both = unet32(x, flame.tensor([37, 37]), ctx, y).numpy()
        np.testing.assert_array_equal(one, both)
        np.testing.assert_array_equal(unet32(x, flame.tensor([37]), ctx, y).numpy(), both)
        with pytest.raises(ValueError, match="context"):
            unet32(x, ts, ctx[..., :8], y)
        with pytest.raises(ValueError, match=r"y must be \(2, 64\)"):
            unet32(x, ts, ctx, y[:, :60])
        with pytest.raises(TypeError):
            unet32(ref["x"], ts, ctx, y)


# ----------------------------------------------------------------------------- SDXL base
def test_sdxl_base_layout_matches_diffusers():
    """Built without weights: SAI's 2,567,463,684 parameters in 1680 tensors, every name and shape as diffusers'
    SDXL UNet (mapped back by diffusers' own converter, see the fixture script)."""
    with flame_nn.empty_init(device="cpu", dtype=flame.bfloat16):
        unet = SDXLUNet("sdxl-base")
    shapes = {k: tuple(p.shape) for k, p in unet.named_parameters()}
    assert len(shapes) == 1680
    assert sum(math.prod(s) for s in shapes.values()) == 2_567_463_684
    ref = sdxl_base_keys()
    assert set(shapes) == set(ref)
    assert {k: s for k, (_, s) in ref.items()} == shapes
    c = unet.config
    assert len(unet.input_blocks) == 9 and len(unet.output_blocks) == 9 and len(unet.middle_block) == 3
    assert sum(isinstance(m, BasicTransformerBlock) for m in unet.modules()) == 70
    assert c.heads(640) == 10 and c.heads(1280) == 20 and c.pooled_dim == 1280


# ----------------------------------------------------------------------------- checkpointing and streaming
def _grads(unet, ref, checkpointing):
    unet.enable_gradient_checkpointing(checkpointing)
    unet.zero_grad()
    calls = []
    hooks = [unet.input_blocks[1][0].register_forward_hook(lambda *a: calls.append("res")),
             unet.output_blocks[0][1].transformer_blocks[1].register_forward_hook(lambda *a: calls.append("tb"))]
    x, ts, ctx, y = unet_inputs(ref)
    x.requires_grad_(True)
    out = unet(x, ts, ctx, y)
    (out * t(ref["loss_weight"])).sum().backward()
    for h in hooks:
        h.remove()
    # a checkpointed block runs again in backward
    assert sorted(calls) == (["res", "res", "tb", "tb"] if checkpointing else ["res", "tb"])
    grads = {k: p.grad.numpy().copy() for k, p in unet.named_parameters() if p.grad is not None}
    return out.detach().numpy(), x.grad.numpy(), grads


def test_gradient_checkpointing_gives_equal_gradients():
    ref = io()
    unet = load_unet(SAI_FILE, dtype=flame.float32, progress=False).requires_grad_(True)
    n = len(unet.checkpointed_blocks())
    # 17 ResBlocks and 17 transformer blocks
    assert n == sum(isinstance(m, (ResBlock, BasicTransformerBlock)) for m in unet.modules()) == 17 + 17
    out0, gx0, g0 = _grads(unet, ref, False)
    assert not unet.gradient_checkpointing
    out1, gx1, g1 = _grads(unet, ref, True)
    assert unet.gradient_checkpointing
    # float32 rounding only (the first, no-grad run of a checkpointed block works in place)
    assert_close(out1, out0, 1e-6, "output")
    assert_close(gx1, gx0, 1e-5, "grad x")
    assert set(g0) == set(g1) == {k for k, _ in unet.named_parameters()}
    for k in g0:
        assert_close(g1[k], g0[k], 1e-5, k)
    unet.gradient_checkpointing = False
    assert not any(b.gradient_checkpointing for b in unet.checkpointed_blocks())


def test_block_streamer_runs_the_three_stacks(device):
    """BlockStreamer.for_model picks input_blocks, middle_block and output_blocks; a streamed forward (weights
    through two slots) equals the plain one, skip connections included."""
    ref = io()
    plain = load_unet(SAI_FILE, dtype=flame.float32, device=device, progress=False)
    with flame.no_grad():
        want = plain(*unet_inputs(ref, device)).numpy()
    unet = load_unet(SAI_FILE, dtype=flame.float32, device=device, progress=False)
    streamer = BlockStreamer.for_model(unet, device=device, slots=2, resident=[0, 20])
    try:
        assert streamer.names[:2] == ["input_blocks.0", "input_blocks.1"] and len(streamer.blocks) == 9 + 3 + 9
        assert "middle_block.1" in streamer.names and streamer.names[-1] == "output_blocks.8"
        with flame.no_grad():
            got = unet(*unet_inputs(ref, device)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert streamer.stats["loads"] > 0
    finally:
        streamer.close()


def test_presets_and_config_checks():
    c = configs["sdxl-tiny"]
    assert c.level_channels == (8, 16, 16) and c.transformer_depth_middle == 2 and c.downsample_factor == 4
    from flame_models.sdxl import UNetConfig, UNetConfigError
    with pytest.raises(UNetConfigError, match="norm_num_groups"):
        UNetConfig(model_channels=40)
    with pytest.raises(UNetConfigError, match="transformer_depth"):
        UNetConfig(transformer_depth=(0, 2))
    with pytest.raises(UNetConfigError, match="num_head_channels"):
        UNetConfig(num_head_channels=48)
    with pytest.raises(UNetConfigError, match="unknown UNet config"):
        SDXLUNet("sdxl-huge")
