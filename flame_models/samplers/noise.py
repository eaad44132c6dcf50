"""Seeded Gaussian latents: the same seed gives the same noise on a device, whatever else was drawn before."""
import flame_core as flame


def get_noise(batch_size, height, width, *, seed, channels=16, multiple=16, device=None, dtype=flame.float32):
    """Gaussian latents (B, channels, H/8, W/8) from a seeded generator on `device`: same seed, same noise. The
    image's height and width must be positive multiples of `multiple`."""
    if height % multiple or width % multiple or height <= 0 or width <= 0:
        raise ValueError(f"images need a height and width that are positive multiples of {multiple}, "
                         f"got {height}x{width}")
    dev = flame.device(device)
    g = flame.Generator(dev).manual_seed(seed)
    z = flame.randn(batch_size, channels, height // 8, width // 8, generator=g, dtype=flame.float32, device=dev)
    return z.to(dtype)
