"""Inpainting by masked denoising (ComfyUI's KSampler with a noise mask, `KSamplerX0Inpaint`): image-to-image
(samplers/img2img.py) whose model is wrapped so that only the mask's region is denoised. At every model call at
noise level s, with `mask` 1 where the image is repainted and 0 where it is kept (soft values blend), `init` the
image's latents and `noise` the run's starting noise:

    the model sees        x_in = mask·x + (1 − mask)·(the image noised to s)
    its clean estimate    x0   = mask·x0_model + (1 − mask)·init

-- the kept region is the image at every step (its clean estimate is the image itself), the masked one is denoised
in its context, and the last step lands on the image's latents outside the mask whatever the sampler (the
stochastic ones too). No model trained for inpainting is needed; the decoded image outside the mask is the VAE's
reconstruction of the original (nothing is pasted back).

    flow families (velocity v, x0 = x − s·v):  noised image s·noise + (1 − s)·init;
                                              v_out = mask·v + (1 − mask)·(x − init) / s
    SDXL (denoiser D(x, σ) -> x0, x = x0 + σ·ε):  noised image init + σ·noise; x0 as above

Both are pure functions of the step's inputs (the mask, image and noise fixed for the run), so they run inside the
samplers' CUDA step graphs.
"""
import numpy as np

import flame_core as flame

from ..numbers import as_float


def latent_mask(mask, shape, device):
    """A mask as float32 rows of latents: `mask` (Tensor or array; (h, w), (1 or B, h, w) or (1 or B, 1, h, w), in
    [0, 1], 1 = repaint) broadcast to `shape` (B, C, h, w) on `device`; a ValueError naming the shapes or values."""
    m = mask if isinstance(mask, flame.Tensor) else flame.tensor(np.asarray(mask, dtype=np.float32))
    m = m.to(device).float()
    given = tuple(m.shape)
    B, C, h, w = shape
    if m.ndim == 2:
        m = m.reshape(1, 1, *m.shape)
    elif m.ndim == 3:
        m = m.reshape(m.shape[0], 1, m.shape[1], m.shape[2])
    if m.ndim != 4 or tuple(m.shape[2:]) != (h, w) or m.shape[0] not in (1, B) or m.shape[1] not in (1, C):
        raise ValueError(f"mask of shape {given} does not fit latents {tuple(shape)}: (h, w) = {(h, w)}, "
                         f"one per image or one for all")
    lo, hi = float(m.min()), float(m.max())
    if not (0.0 <= lo and hi <= 1.0):
        raise ValueError(f"mask values must be in [0, 1] (1 = repaint), got [{lo:g}, {hi:g}]")
    return m.expand(B, C, h, w)


def flow_inpaint(velocity, mask, init, noise, sigma_of):
    """velocity(x, t) wrapped for inpainting (the module docstring's flow form): mask, init, noise of x's layout
    (packed tokens or latents), sigma_of(t) the noise level of the model's timestep tensor t (B,) as a tensor."""
    keep = 1.0 - mask

    def inpainted(x, t):
        s = sigma_of(t).reshape(-1, *([1] * (x.ndim - 1)))
        x_in = x * mask + (noise * s + init * (1.0 - s)) * keep
        return velocity(x_in, t) * mask + ((x - init) / s) * keep
    return inpainted


def ve_inpaint(denoiser, mask, init, noise):
    """An SDXL denoiser D(x, sigma, timestep) wrapped for inpainting (the module docstring's x0 form)."""
    keep = 1.0 - mask

    def inpainted(x, sigma, timestep=None):
        x_in = x * mask + (init + noise * float(sigma)) * keep
        return denoiser(x_in, sigma, timestep) * mask + init * keep
    return inpainted


MAX_GROW = 256  # --mask-grow's bound, in pixels: one pass of the 3 x 3 kernel per pixel
MAX_BLUR = 256.0  # --mask-blur's bound, in pixels


def grow_mask(mask, pixels, tapered_corners=True):
    """A mask (H, W) grown by `pixels` (shrunk when negative) as ComfyUI's GrowMask: `|pixels|` grey dilations
    (erosions) by a 3 x 3 kernel -- a cross with tapered_corners (the default; the region grows as a diamond), the
    full square without -- each pixel's neighbours outside the image left out (scipy's grey_dilation in its default
    mode, which ComfyUI calls). Soft values grow as they are; any dtype; a new array."""
    n = check_grow(pixels)
    out = np.array(mask, copy=True)
    if out.ndim != 2:
        raise ValueError(f"grow: a mask of shape (H, W), got {out.shape}")
    op = np.maximum if n > 0 else np.minimum
    for _ in range(min(abs(n), sum(out.shape))):   # (beyond H + W passes nothing changes)
        # each pixel against its neighbours in the image: up / down, then left / right -- from one copy (the cross),
        # or from a copy after the rows' pass (the square: rows then columns, separable)
        a = out.copy()
        op(out[1:], a[:-1], out=out[1:])
        op(out[:-1], a[1:], out=out[:-1])
        if not tapered_corners:
            a = out.copy()
        op(out[:, 1:], a[:, :-1], out=out[:, 1:])
        op(out[:, :-1], a[:, 1:], out=out[:, :-1])
    return out


def check_grow(pixels):
    """A mask grow checked: whole pixels in [-MAX_GROW, MAX_GROW] (negative shrinks)."""
    try:
        n = int(pixels)
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or n != pixels or isinstance(pixels, bool) or not -MAX_GROW <= n <= MAX_GROW:
        raise ValueError(f"grow: whole pixels in [-{MAX_GROW}, {MAX_GROW}] (negative shrinks), got {pixels!r}")
    return n


def check_blur(radius):
    """A mask blur radius checked: a finite number of pixels in [0, MAX_BLUR]."""
    r = as_float(radius)
    if not 0.0 <= r <= MAX_BLUR:
        raise ValueError(f"blur: a radius in pixels in [0, {MAX_BLUR:g}], got {radius!r}")
    return r


def read_mask(path, width, height, *, grow=0, blur=0.0):
    """The mask image at `path` -- or a PIL image given -- as (height, width) float32 in [0, 1] (1 = repaint:
    white): read as an untrusted image (data.images.load_image) into 8-bit grey, at its own size grown by `grow`
    pixels (grow_mask: ComfyUI's GrowMask) then blurred by a Gaussian of standard deviation `blur` pixels (Pillow's
    GaussianBlur: diffusers' `VaeImageProcessor.blur`, which also blurs the mask at its own size), then scaled to
    cover width x height and centre-cropped as the init image is (generate.read_init_image)."""
    from PIL import Image, ImageFilter, ImageOps

    from ..data.images import as_rgb, is_image, load_image
    grow, blur = check_grow(grow), check_blur(blur)   # (before the image is read)
    im = as_rgb(path, "mask") if is_image(path) else load_image(path)
    im = im.convert("L")
    if grow:
        im = Image.fromarray(grow_mask(np.asarray(im), grow), "L")
    if blur:
        im = im.filter(ImageFilter.GaussianBlur(blur))
    im = ImageOps.fit(im, (width, height), Image.LANCZOS)
    return np.asarray(im, dtype=np.float32) / 255.0


def pool_mask(mask, factor=8):
    """A pixel mask (H, W) as (1, H // factor, W // factor): the mean of each factor x factor box (the latent pixel
    it encodes; a soft edge where the box straddles the mask's)."""
    h, w = mask.shape[0] // factor, mask.shape[1] // factor
    return mask[:h * factor, :w * factor].reshape(h, factor, w, factor).mean(axis=(1, 3))[None]
