"""The VAE on a GPU: the golden fixtures through each conv algorithm, and peak memory at the released size
(1024^2 against diffusers' peaks, 2048^2 tiled, the mid-block attention without its (H*W)^2 scores)."""
import numpy as np
import pytest
import vae_fixtures as VF

import flame_core as flame
from flame_core import memory as M
from flame_models.vae import AutoencoderKL, configs, load_vae
from flame_models.vae.layers import AttnBlock

pytestmark = pytest.mark.gpu
GiB = 2 ** 30
DIFFUSERS_PEAK = {"encode": 1.73 * GiB, "decode": 2.61 * GiB}  # PEERS.md, bf16, 1024^2, weights included


@pytest.mark.parametrize("name", VF.NAMES)
@pytest.mark.parametrize("algo", ["auto", "igemm", "im2col"])
@pytest.mark.parametrize("dtype, rtol", [(flame.float32, 1e-4), (flame.bfloat16, 6e-2)])
def test_fixtures_on_cuda(monkeypatch, name, algo, dtype, rtol):
    monkeypatch.setenv("FLAME_CONV_ALGO", algo)
    vae = load_vae(VF.folder(name), dtype=dtype, device="cuda")
    ref, meta = VF.io(name)
    with flame.no_grad():
        VF.assert_close(vae.encode(VF.t(ref["images"], "cuda")), ref["mean"], rtol, "encode")
        VF.assert_close(vae.decode(VF.t(ref["latents"], "cuda")), ref["decoded"], rtol, "decode")
        vae.enable_tiling(meta["tile_sample_min_size"])
        VF.assert_close(vae.encode(VF.t(ref["tiled_images"], "cuda")), ref["tiled_mean"], rtol, "tiled encode")
        VF.assert_close(vae.decode(VF.t(ref["tiled_latents"], "cuda")), ref["tiled_decoded"], rtol, "tiled decode")


@pytest.fixture(scope="module")
def flux_vae():
    vae = AutoencoderKL("flux", dtype=flame.bfloat16, device="cuda")  # random weights at the released size
    vae.requires_grad_(False)
    return vae


def _peak(fn):
    """fn()'s result and the peak bytes allocated while it ran (everything already held, weights too, counted)."""
    flame.cuda.synchronize()
    M.empty_cache("cuda")
    M.reset_peak_memory_stats("cuda")
    with flame.no_grad():
        out = fn()
    flame.cuda.synchronize()
    return out, M.max_memory_allocated("cuda")


@pytest.mark.slow
def test_1024_encode_and_decode_within_the_peers_peak(flux_vae):
    g = flame.Generator("cuda").manual_seed(0)
    x = (flame.rand(1, 3, 1024, 1024, generator=g, device="cuda") * 2 - 1).to(flame.bfloat16)
    assert not flux_vae._tiles(1024, 1024, flux_vae.tile_sample_min_size, 1024 * 1024)  # 1024^2 is not tiled
    z, enc_peak = _peak(lambda: flux_vae.encode(x))
    assert tuple(z.shape) == (1, 16, 128, 128)
    x = None  # rebound, not deleted: closures above use the names
    y, dec_peak = _peak(lambda: flux_vae.decode(z))
    assert tuple(y.shape) == (1, 3, 1024, 1024) and np.isfinite(y.float().numpy()).all()
    print(f"\nVAE 1024^2 bf16: encode peak {enc_peak / GiB:.2f} GiB, decode peak {dec_peak / GiB:.2f} GiB")
    assert enc_peak <= DIFFUSERS_PEAK["encode"], enc_peak / GiB
    assert dec_peak <= DIFFUSERS_PEAK["decode"], dec_peak / GiB


@pytest.mark.slow
def test_2048_decode_is_tiled_within_the_1024_bound(flux_vae):
    z = flame.randn(1, 16, 256, 256, generator=flame.Generator("cuda").manual_seed(1), device="cuda",
                    dtype=flame.bfloat16)
    assert flux_vae._tiles(256, 256, flux_vae.tile_latent_min_size, 2048 * 2048)      # automatic above 2 MP
    y, peak = _peak(lambda: flux_vae.decode(z))
    assert tuple(y.shape) == (1, 3, 2048, 2048)
    print(f"\nVAE 2048^2 bf16 tiled decode peak {peak / GiB:.2f} GiB")
    assert peak <= DIFFUSERS_PEAK["decode"]  # the tiles are at most 1024^2: the 1024^2 bound holds


def test_mid_attention_never_holds_the_full_scores():
    block = AttnBlock(512, configs["flux"], dtype=flame.bfloat16, device="cuda")
    x = flame.randn(1, 512, 128, 128, device="cuda", dtype=flame.bfloat16)
    base = M.memory_allocated("cuda")
    _, peak = _peak(lambda: block(x))
    # 16384 tokens: float32 scores would be 1 GiB; the chunked path holds 64 MiB of them at a time
    assert peak - base < 512 * 2 ** 20, (peak - base) / 2 ** 20

