"""A tiny AutoencoderKL whose weights are set by hand: it ENCODES BY AVERAGE POOLING and DECODES BY NEAREST
UPSAMPLING, exactly up to float rounding. A random-weight VAE decodes noise, so the built-in demo and the tests use
this one to get images that mean something without training a VAE.

It is the real flame_models.vae.AutoencoderKL architecture (conv_in, ResnetBlocks, stride-2 downsamples, the mid
block with attention, GroupNorm + SiLU + conv_out) with these weights:

- Internal maps have 8 channels [R, G, B, -R, -G, -B, K, -K] (K a constant from conv_in's bias).
- Every ResnetBlock's conv2 and the attention's proj_out are zero, so those blocks are the identity (residuals).
- Each encoder downsample averages 2x2 pixels (its taps all lie inside the image, so K stays constant); each
  decoder upsample's conv is the identity (nearest x2).
- The final GroupNorm (one group) has mean exactly 0 (the +/- pairs cancel) and variance K^2/4 * (1 + e) with
  e = mean(R^2 + G^2 + B^2) / K^2 <= 5e-5 for K = 256: it scales by a constant. Its affine part moves R, G, B to
  12 + value, where SiLU(x) = x * sigmoid(x) differs from x by < 2e-4; conv_out subtracts the 12 again.
- The latent holds the pooled colour spread over all `z_channels` by a fixed orthonormal (z, 3) matrix times
  LATENT_GAIN (so the Flux-normalised latents have roughly unit spread); the decoder projects back.

So decode(encode(x)) is x averaged over 8x8 blocks (for a VAE with 4 levels), shown as 8x8 squares.
"""
import numpy as np

import flame_core as flame

K = 256.0            # the constant channel pair; dominates the final GroupNorm's variance
SILU_OFFSET = 12.0   # where SiLU is the identity to < 2e-4
LATENT_GAIN = 8.0    # latent = gain * Q @ rgb


def analytic_vae_config(z_channels=16, levels=4):
    from ..vae import VAEConfig
    return VAEConfig(ch=8, ch_mult=(1,) * levels, num_res_blocks=1, z_channels=z_channels, norm_num_groups=1,
                     mid_attention=True)


def mixing_matrix(z_channels):
    """(z, 3) with orthonormal columns, the same for every run."""
    q, _ = np.linalg.qr(np.random.default_rng(1234).standard_normal((z_channels, 3)))
    return q.astype(np.float64)


def _center(out_ch, in_ch, mat):
    w = np.zeros((out_ch, in_ch, 3, 3))
    w[:, :, 1, 1] = mat
    return w


def _signed(mat):
    """(8, n) rows [+m, -m, 0, 0] for a (3, n) map m to R, G, B."""
    out = np.zeros((8, mat.shape[1]))
    out[0:3], out[3:6] = mat, -mat
    return out


def _norm_out(weights, prefix):
    g = np.zeros(8)
    b = np.zeros(8)
    g[0:3] = K / 2.0       # the normalised channel is value / (K / 2)
    b[0:3] = SILU_OFFSET
    weights[prefix + "norm_out.weight"], weights[prefix + "norm_out.bias"] = g, b


def analytic_vae_state(config):
    """{parameter name: array} of the pooling/upsampling VAE for `config` (analytic_vae_config)."""
    from ..vae import AutoencoderKL
    z = config.z_channels
    Q = mixing_matrix(z)
    shapes = {k: tuple(v.shape) for k, v in AutoencoderKL(config, dtype=flame.float32, device="cpu")
              .state_dict().items()}
    w = {k: np.zeros(s) for k, s in shapes.items()}           # every block and attention: the identity
    consts = np.zeros(8)
    consts[6], consts[7] = K, -K

    # encoder: rgb -> [rgb, -rgb, K, -K]; 2x2 averages; GroupNorm + SiLU; latent mean = gain * Q @ rgb
    w["encoder.conv_in.weight"] = _center(8, 3, _signed(np.eye(3)))
    w["encoder.conv_in.bias"] = consts
    for name in shapes:
        if name.startswith("encoder.down.") and name.endswith("downsample.conv.weight"):
            pool = np.zeros((8, 8, 3, 3))
            for dy in (0, 1):
                for dx in (0, 1):
                    pool[:, :, dy, dx] = np.eye(8) * 0.25
            w[name] = pool
        if name.startswith("decoder.up.") and name.endswith("upsample.conv.weight"):
            w[name] = _center(8, 8, np.eye(8))
    _norm_out(w, "encoder.")
    out = np.zeros((2 * z, 8))
    out[:z, 0:3] = LATENT_GAIN * Q
    w["encoder.conv_out.weight"] = _center(2 * z, 8, out)
    bias = np.zeros(2 * z)
    bias[:z] = -SILU_OFFSET * out[:z, 0:3].sum(axis=1)
    bias[z:] = -20.0                                            # logvar: a near-deterministic posterior
    w["encoder.conv_out.bias"] = bias

    # decoder: latent -> rgb = Q^T z / gain -> [rgb, -rgb, K, -K]; nearest x2 per level; GroupNorm + SiLU; rgb
    w["decoder.conv_in.weight"] = _center(8, z, _signed(Q.T / LATENT_GAIN))
    w["decoder.conv_in.bias"] = consts
    _norm_out(w, "decoder.")
    w["decoder.conv_out.weight"] = _center(3, 8, np.eye(3, 8))
    w["decoder.conv_out.bias"] = np.full(3, -SILU_OFFSET)
    for name in shapes:  # GroupNorms inside the identity blocks: unit gain (their input is zero anyway)
        if name.endswith(("norm1.weight", "norm2.weight", "attn_1.norm.weight")):
            w[name] = np.ones(shapes[name])
    return {k: v.astype(np.float32) for k, v in w.items()}


def analytic_vae(device="cpu", z_channels=16, levels=4):
    """The pooling/upsampling AutoencoderKL (float32) on `device`: downsample factor 2^(levels-1)."""
    from ..vae import AutoencoderKL
    config = analytic_vae_config(z_channels, levels)
    vae = AutoencoderKL(config, dtype=flame.float32, device=device)
    vae.load_state_dict({k: flame.tensor(v, device=device) for k, v in analytic_vae_state(config).items()})
    vae.requires_grad_(False)
    vae.eval()
    return vae
