"""The encoder's posterior: a diagonal Gaussian over the latents, diffusers' DiagonalGaussianDistribution."""
import flame_core as flame


class DiagonalGaussianDistribution:
    """moments (B, 2*z, h, w) = (mean | logvar) along channels; logvar clamped to [-30, 20] as LDM and diffusers."""

    def __init__(self, moments):
        if moments.ndim != 4 or moments.shape[1] % 2:
            raise ValueError(f"DiagonalGaussianDistribution: moments must be (B, 2*z, h, w), got "
                             f"{tuple(moments.shape)}")
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)

    @property
    def std(self):
        return (0.5 * self.logvar).exp()

    @property
    def var(self):
        return self.logvar.exp()

    def mode(self):
        return self.mean

    def sample(self, generator=None, noise=None):
        """mean + std * eps, eps ~ N(0, 1) drawn from `generator` (or given as `noise`, shaped like the mean)."""
        if noise is None:
            noise = flame.randn(*self.mean.shape, generator=generator, dtype=self.mean.dtype,
                                device=self.mean.device)
        elif tuple(noise.shape) != tuple(self.mean.shape):
            raise ValueError(f"DiagonalGaussianDistribution.sample: noise of shape {tuple(noise.shape)} for latents "
                             f"of shape {tuple(self.mean.shape)}")
        return self.mean + self.std * noise.to(self.mean.dtype)
