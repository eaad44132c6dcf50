"""Qwen-Image's VAE (flame_models/qwen_image/vae.py) on the CPU: a diffusers-layout folder (3-D causal kernels,
(C, 1, 1, 1) gains, the video-only time_conv tensors, config.json) loads into the 2-D single-frame model as the last
temporal tap of each kernel; shapes, clamping and tiling switches; bad files named. The parity against diffusers
0.42.1's AutoencoderKLQwenImage is in tests/models/test_qwen_image_parity.py."""
import json

import numpy as np
import pytest

import flame_core as flame
from flame_core import io
from flame_models.qwen_image.latents import LATENT_FORMAT
from flame_models.qwen_image.vae import (
    AutoencoderKLQwenImage,
    QwenImageVAECheckpointError,
    QwenImageVAEConfig,
    Resample,
    load_vae,
    save_vae,
)

TINY = QwenImageVAEConfig(base_dim=8, num_res_blocks=1)
TWO_D = (".resample.1.", ".to_qkv.", ".proj.")          # diffusers' own Conv2d layers


def _model(seed=0):
    flame.manual_seed(seed)
    m = AutoencoderKLQwenImage(TINY, dtype=flame.float32, device="cpu")
    rng = np.random.default_rng(seed)
    with flame.no_grad():
        for _, p in m.named_parameters():
            if p.numel() == p.shape[0]:
                p.copy_(flame.tensor((p.detach().numpy() + 0.1 * rng.normal(size=p.shape)).astype(np.float32)))
    return m


def _diffusers_state(model, rng):
    """The state dict diffusers' AutoencoderKLQwenImage would hold for this model: 3-D kernels whose last temporal
    tap is FLAME's (the others random: a single frame never meets them), (C, 1, 1, 1) gains outside the attention
    blocks, time_conv tensors in the 3-D resamplers."""
    out = {}
    for k, p in model.named_parameters():
        a = p.detach().numpy()
        if a.ndim == 4 and not any(s in k for s in TWO_D):
            t = a.shape[2]                                       # 3x3 -> 3x3x3, 1x1 -> 1x1x1
            full = rng.normal(size=(a.shape[0], a.shape[1], t, *a.shape[2:])).astype(np.float32)
            full[:, :, -1] = a
            a = full
        elif a.ndim == 3 and ".attentions." not in k:
            a = a.reshape(*a.shape, 1)
        out[k] = a
    for name, mod in model.named_modules():                      # the 3-D resamplers' temporal convolutions
        if isinstance(mod, Resample) and mod.mode.endswith("3d"):
            C = mod.resample[1].weight.shape[1]
            n = 2 * C if mod.mode.startswith("up") else C
            out[f"{name}.time_conv.weight"] = rng.normal(size=(n, C, 3, 1, 1)).astype(np.float32)
            out[f"{name}.time_conv.bias"] = np.zeros(n, np.float32)
    return out


def _images(seed=1, shape=(2, 3, 32, 40)):
    return flame.tensor(np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32))


def test_a_diffusers_vae_folder_loads_as_the_last_temporal_tap(tmp_path):
    model = _model()
    state = _diffusers_state(model, np.random.default_rng(5))
    assert state["encoder.conv_in.weight"].shape == (8, 3, 3, 3, 3)
    assert state["quant_conv.weight"].shape == (32, 32, 1, 1, 1)
    assert state["decoder.mid_block.attentions.0.norm.gamma"].shape == (32, 1, 1)
    assert state["encoder.down_blocks.0.norm1.gamma"].shape == (8, 1, 1, 1)
    assert sorted(k for k in state if k.endswith("time_conv.weight")) == [
        "decoder.up_blocks.0.upsamplers.0.time_conv.weight", "decoder.up_blocks.1.upsamplers.0.time_conv.weight",
        "encoder.down_blocks.3.time_conv.weight", "encoder.down_blocks.5.time_conv.weight"]
    folder = tmp_path / "pipe" / "vae"
    folder.mkdir(parents=True)
    io.save_file({k: flame.tensor(np.ascontiguousarray(v)) for k, v in state.items()},
                 str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLQwenImage", "base_dim": 8,
                                                    "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
                                                    "attn_scales": [], "temperal_downsample": [False, True, True],
                                                    "dropout": 0.0}))
    x = _images()
    with flame.no_grad():
        want_z, want_x = model.encode(x).numpy(), model.decode(model.encode(x)).numpy()
    for where in (folder, tmp_path / "pipe"):
        loaded = load_vae(str(where), device="cpu")
        assert loaded.config == TINY
        with flame.no_grad():
            z = loaded.encode(x)
            assert np.array_equal(z.numpy(), want_z)
            assert np.array_equal(loaded.decode(z).numpy(), want_x)


def test_shapes_clamping_and_the_latent_format():
    model = _model()
    x = _images()
    with flame.no_grad():
        dist = model.encode_dist(x)
        assert tuple(dist.mean.shape) == (2, 16, 4, 5) and tuple(dist.logvar.shape) == (2, 16, 4, 5)
        y = model.decode(dist.mean * 50)
    assert tuple(y.shape) == (2, 3, 32, 40) and float(y.abs().max()) <= 1.0
    z = np.random.default_rng(2).normal(size=(2, 16, 4, 5)).astype(np.float32)
    zn = LATENT_FORMAT.to_model(z)
    assert np.allclose(zn[:, 7], (z[:, 7] - 1.5508) / 2.0743)
    assert np.allclose(LATENT_FORMAT.from_model(zn), z, atol=1e-6)
    assert np.allclose(LATENT_FORMAT.to_model(flame.tensor(z)).numpy(), zn)


def test_tiling_switches_and_input_checks():
    model = _model()
    x = _images(shape=(1, 3, 48, 56))
    with flame.no_grad():
        whole = model.encode(x).numpy()
        model.enable_tiling(32, 24)
        tiled = model.encode(x).numpy()
        assert tiled.shape == whole.shape == (1, 16, 6, 7)
        assert not np.allclose(tiled, whole)                       # the tiles' seams are blended, not identical
        model.disable_tiling()
        assert np.array_equal(model.encode(x).numpy(), whole)
    with pytest.raises(ValueError, match="multiples of 8"):
        model.enable_tiling(30, 24)
    with pytest.raises(ValueError, match=r"expected a \(B, 3, H, W\) tensor \(one frame\)"):
        model.encode(flame.zeros(1, 3, 1, 32, 32))
    with pytest.raises(ValueError, match="H and W must be multiples of 8"):
        model.encode(flame.zeros(1, 3, 30, 32))


def test_bad_vae_files_are_named(tmp_path):
    model = _model()
    path = str(tmp_path / "vae.safetensors")
    save_vae(model, path)
    assert load_vae(path, device="cpu").config == TINY                # FLAME's own file, config in the metadata
    state = {k: v.detach() for k, v in model.named_parameters() if "decoder.conv_out" not in k}
    bad = str(tmp_path / "bad.safetensors")
    io.save_file(state, bad)
    with pytest.raises(QwenImageVAECheckpointError, match=r"missing keys \(2\): decoder\.conv_out\.weight"):
        load_vae(bad, device="cpu", config=TINY)
    wan = str(tmp_path / "wan.safetensors")
    io.save_file({"encoder.downsamples.0.residual.0.gamma": flame.ones(8, 1, 1, 1)}, wan)
    with pytest.raises(QwenImageVAECheckpointError, match="Wan's own VAE layout is not read yet"):
        load_vae(wan, device="cpu", config=TINY)
