"""The LDM AutoencoderKL against diffusers' (golden fixtures): encode, sampling, decode, tiling, dtypes, the config,
and the latent formats."""
import numpy as np
import pytest
import vae_fixtures as VF

import flame_core as flame
import flame_nn
from flame_models import registry
from flame_models.vae import AutoencoderKL, LatentFormat, VAEConfig, VAEConfigError, blend_h, blend_v, load_vae
from flame_models.vae.attention import single_head_attention


@pytest.fixture(scope="module", params=VF.NAMES)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def vae32(name, device):
    return load_vae(VF.folder(name), dtype=flame.float32, device=device)


# ----------------------------------------------------------------------------- structure and config
def test_module_names_are_the_ldm_checkpoint_keys():
    vae = AutoencoderKL(VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, use_quant_conv=True,
                                  use_post_quant_conv=True))
    shapes = {k: tuple(p.shape) for k, p in vae.named_parameters()}
    assert shapes["encoder.conv_in.weight"] == (32, 3, 3, 3)
    assert shapes["encoder.down.0.block.0.norm1.weight"] == (32,)
    assert shapes["encoder.down.0.downsample.conv.weight"] == (32, 32, 3, 3)
    assert "encoder.down.1.downsample.conv.weight" not in shapes            # no downsample after the last level
    assert shapes["encoder.down.1.block.0.nin_shortcut.weight"] == (64, 32, 1, 1)
    assert shapes["encoder.mid.attn_1.q.weight"] == (64, 64, 1, 1)
    assert shapes["encoder.mid.attn_1.proj_out.bias"] == (64,)
    assert shapes["encoder.conv_out.weight"] == (8, 64, 3, 3)              # mean and logvar
    assert shapes["quant_conv.weight"] == (8, 8, 1, 1) and shapes["post_quant_conv.weight"] == (4, 4, 1, 1)
    assert shapes["decoder.conv_in.weight"] == (64, 4, 3, 3)
    assert shapes["decoder.up.1.upsample.conv.weight"] == (64, 64, 3, 3)
    assert "decoder.up.0.upsample.conv.weight" not in shapes                # up.0 is the full-resolution level
    assert "decoder.up.0.block.1.conv1.weight" in shapes and "decoder.up.0.block.2.conv1.weight" not in shapes
    assert shapes["decoder.up.0.block.0.nin_shortcut.weight"] == (32, 64, 1, 1)
    assert shapes["decoder.conv_out.weight"] == (3, 32, 3, 3)


def test_release_configs_have_the_released_tensor_count():
    with flame_nn.empty_init():  # placeholders only: nothing allocated
        sdxl, flux = AutoencoderKL("sdxl"), AutoencoderKL("flux")
    n_sdxl, n_flux = len(list(sdxl.named_parameters())), len(list(flux.named_parameters()))
    assert (n_sdxl, n_flux) == (248, 244)  # sdxl_vae.safetensors / Flux ae.safetensors
    # the SDXL VAE's published size; Flux's differs only by 16 latent channels and no quant convs
    assert sum(p.numel() for p in sdxl.parameters()) == 83_653_863
    assert sum(p.numel() for p in flux.parameters()) == 83_653_863 - 92 + 512 * 24 * 9 + 24 + 12 * 512 * 9
    assert "decoder.up.3.upsample.conv.weight" in dict(flux.named_parameters())
    assert flux.config.latent_channels == flux.config.z_channels == 16 and sdxl.config.latent_channels == 4


def test_tiny_default_groups_runs_and_keeps_shapes(device):
    vae = AutoencoderKL(VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1), device=device)
    x = flame.rand(2, 3, 24, 16, device=device) * 2 - 1
    with flame.no_grad():
        z = vae.encode(x)
        y = vae.decode(z)
    assert tuple(z.shape) == (2, 16, 12, 8) and tuple(y.shape) == (2, 3, 24, 16)
    assert not z.requires_grad and z.grad_fn is None and y.grad_fn is None
    assert np.isfinite(y.numpy()).all()


def test_config_roundtrips_through_diffusers_config(name):
    cfg = VF.diffusers_config(name)
    c = VAEConfig.from_diffusers_config(cfg)
    assert c.block_out_channels == tuple(cfg["block_out_channels"])
    assert (c.z_channels, c.use_quant_conv, c.norm_num_groups) == (cfg["latent_channels"], cfg["use_quant_conv"],
                                                                    cfg["norm_num_groups"])
    back = c.to_diffusers_config()
    assert back == {k: cfg[k] for k in back}
    assert VAEConfig.from_diffusers_config(back) == c


@pytest.mark.parametrize("bad, msg", [
    (dict(ch_mult=()), "ch_mult"), (dict(ch=30), "norm_num_groups"), (dict(z_channels=0), "z_channels"),
])
def test_config_rejects_bad_values(bad, msg):
    with pytest.raises(VAEConfigError, match=msg):
        VAEConfig(**bad)


def test_config_rejects_foreign_diffusers_configs():
    with pytest.raises(VAEConfigError, match="not an AutoencoderKL"):
        VAEConfig.from_diffusers_config({"_class_name": "AutoencoderTiny"})
    with pytest.raises(VAEConfigError, match="act_fn"):
        VAEConfig.from_diffusers_config({"act_fn": "gelu"})
    with pytest.raises(VAEConfigError, match="down_block_types"):
        VAEConfig.from_diffusers_config({"block_out_channels": [32, 64], "down_block_types": ["DownEncoderBlock2D"]})


# ----------------------------------------------------------------------------- against diffusers
def test_matches_diffusers(vae32, name, device):
    VF.check_against_fixture(vae32, name, device)


def test_encode_returns_the_mean_or_a_generator_sample(vae32, name, device):
    ref, _ = VF.io(name)
    x = VF.t(ref["images"], device)
    with flame.no_grad():
        VF.assert_close(vae32.encode(x), ref["mean"], what="encode")
        dist = vae32.encode_dist(x)
        drawn = vae32.encode(x, generator=flame.Generator(device).manual_seed(5))
        eps = flame.randn(*dist.mean.shape, generator=flame.Generator(device).manual_seed(5), device=device)
        VF.assert_close(drawn, (dist.mean + dist.std * eps).numpy(), 1e-6, "sample")
        assert not np.allclose(drawn.numpy(), dist.mean.numpy())
    # the clamp: the fixture pushed one logvar channel above 20 and one below -30
    assert ref["logvar"].max() == 20.0 and ref["logvar"].min() == -30.0


def test_tiled_encode_and_decode_match_diffusers(vae32, name, device):
    ref, meta = VF.io(name)
    vae32.enable_tiling(meta["tile_sample_min_size"], meta["tile_overlap_factor"])
    try:
        with flame.no_grad():
            dist = vae32.encode_dist(VF.t(ref["tiled_images"], device))
            VF.assert_close(dist.mean, ref["tiled_mean"], what="tiled mean")
            VF.assert_close(dist.logvar, ref["tiled_logvar"], what="tiled logvar")
            VF.assert_close(vae32.decode(VF.t(ref["tiled_latents"], device)), ref["tiled_decoded"], what="tiled dec")
            if "tiled_decoded_extra" in ref:
                vae32.enable_tiling(tile_overlap_factor=meta["extra_overlap"])
                VF.assert_close(vae32.decode(VF.t(ref["tiled_latents"], device)), ref["tiled_decoded_extra"],
                                what="tiled decode, other overlap")
    finally:
        vae32.enable_auto_tiling()
        vae32.tile_sample_min_size, vae32.tile_overlap_factor = vae32.config.sample_size, 0.25


def test_automatic_tiling_switch(device):
    vae = load_vae(VF.folder("sdxl_tiny"), dtype=flame.float32, device=device)   # tiles of 16 px
    ref, _ = VF.io("sdxl_tiny")
    x, z = VF.t(ref["tiled_images"], device), VF.t(ref["tiled_latents"], device)  # 40 x 56 px
    with flame.no_grad():
        assert vae.use_tiling is None                            # default: automatic, above 2 MP
        plain_enc, plain_dec = vae.encode(x).numpy(), vae.decode(z).numpy()
        vae.enable_auto_tiling(max_pixels=40 * 56)               # exactly at the threshold: not tiled
        np.testing.assert_array_equal(vae.encode(x).numpy(), plain_enc)
        vae.enable_auto_tiling(max_pixels=40 * 56 - 1)           # above it: tiled, as diffusers' tiled path
        VF.assert_close(vae.encode(x), ref["tiled_mean"], what="auto-tiled encode")
        VF.assert_close(vae.decode(z), ref["tiled_decoded"], what="auto-tiled decode")
        vae.disable_tiling()                                     # never, whatever the size
        np.testing.assert_array_equal(vae.decode(z).numpy(), plain_dec)
        assert not np.allclose(plain_dec, ref["tiled_decoded"], atol=1e-3)


def test_blend_matches_a_row_by_row_reference():
    rng = np.random.default_rng(0)
    above, left, b = (rng.standard_normal(s) for s in ((1, 2, 5, 6), (1, 2, 4, 7), (1, 2, 4, 6)))
    want_v, want_h = b.copy(), b.copy()
    for y in range(3):  # diffusers' loops
        want_v[:, :, y] = above[:, :, -3 + y] * (1 - y / 3) + b[:, :, y] * (y / 3)
        want_h[:, :, :, y] = left[:, :, :, -3 + y] * (1 - y / 3) + b[:, :, :, y] * (y / 3)
    np.testing.assert_allclose(blend_v(VF.t(above), VF.t(b), 3).numpy(), want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(blend_h(VF.t(left), VF.t(b), 3).numpy(), want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(blend_v(VF.t(above), VF.t(b), 0).numpy(), b.astype(np.float32))
    # an extent beyond a tile is cut to the shorter of the two (diffusers' min)
    want = b.copy()
    for y in range(4):
        want[:, :, y] = above[:, :, -4 + y] * (1 - y / 4) + b[:, :, y] * (y / 4)
    np.testing.assert_allclose(blend_v(VF.t(above), VF.t(b), 10).numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 3 * 40 * 4, 1])  # one block of rows, blocks of 3, single rows
def test_mid_attention_in_row_blocks_equals_sdpa(chunk_bytes, device):
    rng = np.random.default_rng(2)
    q, k, v = (VF.t(3 * rng.standard_normal((1, 40, 16)), device, flame.float64) for _ in range(3))
    want = flame_nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0].numpy()
    with flame.no_grad():
        got = single_head_attention(q, k, v, chunk_bytes=chunk_bytes)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
        # half precision: float32 scores, P rounded like a flash kernel's
        half = single_head_attention(*(t.to(flame.bfloat16) for t in (q, k, v)), chunk_bytes=chunk_bytes)
    assert half.dtype == flame.bfloat16
    VF.assert_close(half, want, 3e-2, "bf16 attention")


@pytest.mark.parametrize("dtype, rtol", [(flame.bfloat16, 6e-2), (flame.float16, 1e-2)])
def test_half_precision_runs_and_stays_close(name, dtype, rtol, device):
    vae = load_vae(VF.folder(name), dtype=dtype, device=device)
    assert vae.dtype == dtype
    ref, _ = VF.io(name)
    with flame.no_grad():
        z = vae.encode(VF.t(ref["images"], device))                    # float32 images: cast to the weights' dtype
        y = vae.decode(VF.t(ref["latents"], device))
    assert z.dtype == dtype and y.dtype == dtype
    VF.assert_close(z, ref["mean"], rtol, "half encode")
    VF.assert_close(y, ref["decoded"], rtol, "half decode")


def test_gradients_flow_to_the_latents():
    """With gradients recorded, the residual sums run out of place: d(sum(w * decode(z)))/dz matches central
    differences (float64)."""
    rng = np.random.default_rng(1)
    vae = AutoencoderKL(VAEConfig(ch=8, ch_mult=(1, 2), num_res_blocks=1, z_channels=2, norm_num_groups=4),
                        dtype=flame.float64)
    z0 = rng.standard_normal((1, 2, 3, 3))
    w = VF.t(rng.standard_normal((1, 3, 6, 6)), dtype=flame.float64)
    z = VF.t(z0, dtype=flame.float64).requires_grad_(True)
    (vae.decode(z) * w).sum().backward()
    grad = z.grad.numpy()

    def f(zz):
        with flame.no_grad():
            return float((vae.decode(VF.t(zz, dtype=flame.float64)) * w).sum().item())
    for idx in [(0, 0, 0, 0), (0, 1, 2, 1), (0, 0, 1, 2)]:
        e = np.zeros_like(z0)
        e[idx] = 1e-5
        fd = (f(z0 + e) - f(z0 - e)) / 2e-5
        assert abs(fd - grad[idx]) <= 1e-6 * max(1.0, abs(fd)), (idx, fd, grad[idx])


def test_bad_inputs_are_named():
    vae = AutoencoderKL(VAEConfig(ch=8, ch_mult=(1, 2), num_res_blocks=1, z_channels=4, norm_num_groups=4))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\).*\(1, 4, 8, 8\)"):
        vae.encode(flame.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 4, H, W\).*\(4, 8, 8\)"):
        vae.decode(flame.zeros(4, 8, 8))
    with pytest.raises(TypeError, match="floating"):
        vae.decode(flame.zeros(1, 4, 8, 8, dtype=flame.int64))
    with pytest.raises(ValueError, match="multiple"):
        vae.enable_tiling(tile_sample_min_size=3)


# ----------------------------------------------------------------------------- latent formats
def test_latent_formats():
    FLUX, SD3, SDXL = (registry.latent_format(name) for name in ("flux", "sd3", "sdxl"))
    assert (FLUX.scaling_factor, FLUX.shift_factor) == (0.3611, 0.1159)
    assert (SD3.scaling_factor, SD3.shift_factor) == (1.5305, 0.0609)
    assert (SDXL.scaling_factor, SDXL.shift_factor) == (0.13025, 0.0)
    assert registry.about("flux").latent_format is FLUX
    z = flame.tensor([[-1.0, 0.5, 2.0]])
    np.testing.assert_allclose(FLUX.to_model(z).numpy(), (np.array([[-1.0, 0.5, 2.0]]) - 0.1159) * 0.3611,
                               rtol=1e-6)
    for fmt in (FLUX, SD3, SDXL):
        np.testing.assert_allclose(fmt.from_model(fmt.to_model(z)).numpy(), z.numpy(), rtol=1e-6, atol=1e-7)
    assert LatentFormat.from_diffusers_config(VF.folder("sdxl_tiny")) == LatentFormat(0.18215, 0.0)
    assert LatentFormat.from_diffusers_config({"scaling_factor": 0.3611, "shift_factor": 0.1159}) == FLUX
    with pytest.raises(ValueError):
        LatentFormat(0.0)
