"""Qwen-Image's latent space: the VAE's 16 channels normalised per channel, z_n = (z - mean_c) / std_c
(AutoencoderKLQwenImage's config latents_mean / latents_std), packed 2x2 into 64 features per token exactly as Flux's
(flame_models.bfl.sampling.pack: feature = channel * 4 + row parity * 2 + column parity, tokens row-major)."""
from dataclasses import dataclass

import numpy as np

import flame_core as flame

LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
               1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True)
class ChannelLatentFormat:
    """Per-channel latent normalisation (the registry's latent format for Qwen-Image): to_model(z) =
    (z - mean) / std over dim 1 of (B, C, ...) latents, from_model its inverse. NumPy arrays or flame tensors."""
    mean: tuple = LATENTS_MEAN
    std: tuple = LATENTS_STD

    def __post_init__(self):
        if len(self.mean) != len(self.std) or not all(s > 0 for s in self.std):
            raise ValueError(f"ChannelLatentFormat: {len(self.mean)} means and {len(self.std)} stds (all > 0)")

    def _vectors(self, z):
        if z.ndim < 2 or z.shape[1] != len(self.mean):
            raise ValueError(f"latents {tuple(z.shape)}: expected (B, {len(self.mean)}, ...)")
        shape = (1, len(self.mean)) + (1,) * (z.ndim - 2)
        m = np.asarray(self.mean, np.float32).reshape(shape)
        s = np.asarray(self.std, np.float32).reshape(shape)
        if isinstance(z, np.ndarray):
            return m.astype(z.dtype), s.astype(z.dtype)
        return flame.tensor(m, dtype=z.dtype, device=z.device), flame.tensor(s, dtype=z.dtype, device=z.device)

    def to_model(self, z):
        m, s = self._vectors(z)
        return (z - m) / s

    def from_model(self, z):
        m, s = self._vectors(z)
        return z * s + m


LATENT_FORMAT = ChannelLatentFormat()
