"""Kontext's sampling stages on top of Flux's (flame_models.bfl): the reference image read, resized to Kontext's
resolution list and encoded by the VAE into packed tokens; the transformer loaded (LoRAs applied, fp8, streaming)
and run with the reference tokens."""
import numpy as np

import flame_core as flame

from ..bfl.components import FluxFilesError
from ..bfl.sampling import LATENT_CHANNELS, image_ids, pack, start_noise, text_ids, unpack
from ..bfl.transformer import STACKS, check_loras, load_transformer  # noqa: F401
from ..bfl.true_cfg import with_true_cfg
from ..bfl.vae import encode_images, load_vae_for_flux
from ..conditioning import prompt_rows
from ..samplers.flow import STOCHASTIC, check_flow_sampler, step_noise
from ..samplers.flow_schedules import check_flow_scheduler
from .reference import kontext_size, reference_ids
from .sampling import WithReference, denoise_with_reference


def read_reference(path, *, auto_resize=True):
    """The reference image at `path` as (1, 3, H, W) float32 in [-1, 1], resized (LANCZOS) to Kontext's resolution
    for its aspect ratio (auto_resize), else its own size floored to 16. An untrusted file: read as the datasets'
    images are (data.images.load_image: the pixel limit checked before decoding, alpha composited on white)."""
    from PIL import Image

    from ..data.errors import DataError
    from ..data.images import load_image
    try:
        im = load_image(path)   # (its pixel count checked from the header, before decoding; EXIF orientation)
    except DataError as e:
        raise FluxFilesError(f"--image {path}: not a readable image ({e})") from None
    w, h = kontext_size(*im.size) if auto_resize else (im.size[0] // 16 * 16, im.size[1] // 16 * 16)
    if w < 16 or h < 16:
        raise FluxFilesError(f"--image {path}: {im.size[0]}x{im.size[1]} is smaller than 16x16")
    arr = np.asarray(im.resize((w, h), Image.LANCZOS), dtype=np.float32) / 127.5 - 1.0
    return arr.transpose(2, 0, 1)[None].copy()


def encode_reference(vae, pixels):
    """Reference pixels (1, 3, H, W) in [-1, 1] -> {"ref_latents": packed (1, L_ref, 64), "ref_height", "ref_width"}
    (NumPy): the VAE posterior's mean, normalised as Flux's latents."""
    x = flame.tensor(np.ascontiguousarray(pixels, dtype=np.float32), device=vae.device)
    z = encode_images(vae, x.to(next(vae.parameters()).dtype))
    return {"ref_latents": pack(z.float()).numpy(), "ref_height": pixels.shape[2], "ref_width": pixels.shape[3]}


def _reference(cond, B, dev, dtype):
    ref = flame.tensor(np.asarray(cond["ref_latents"], dtype=np.float32), device=dev).to(dtype)
    ids = reference_ids(int(cond["ref_height"]), int(cond["ref_width"]), 1, device=dev)
    return ref, ids


def sample_latents(model, cond, *, height, width, steps, guidance, seeds=None, latents=None, rows=None,
                   callback=None, cuda_graph=None, sampler="euler", scheduler="simple", neg=None, true_cfg=1.0,
                   true_cfg_start=0):
    """Model-space latents (B, 16, H/8, W/8) float32 of the edit: Euler (or Heun / DPM++ 2M: sampler) on FLUX.1-dev's
    schedule (respaced by scheduler: samplers/flow_schedules.py) with the
    embedded guidance, the reference tokens of cond["ref_latents"] appended at every step. cond: prompt_embeds,
    pooled_prompt_embeds (one row per prompt; `rows` picks each image's), ref_latents, ref_height, ref_width.
    Noise: one seed per image, or `latents` (packed (B, L, 64) or (B, 16, H/8, W/8)). True CFG (diffusers'
    true_cfg_scale): with true_cfg > 1 and `neg` (the negative prompt's prompt_embeds / pooled_prompt_embeds) each
    step also runs the negative prompt with the same image and reference tokens (bfl/true_cfg.py), from step
    `true_cfg_start` (0-based) on."""
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    dev = model.img_in.weight.device
    dtype = model.img_in.weight.dtype
    x = start_noise(seeds, latents, height, width, sampler, dev)
    B = x.shape[0]
    rows = list(range(B)) if rows is None else list(rows)
    txt, y = prompt_rows(cond, rows, dev, dtype)
    ref, ref_ids = _reference(cond, B, dev, dtype)
    net = with_true_cfg(model, neg, rows, txt, true_cfg, dev, dtype)   # (inside the reference wrapper)
    out = denoise_with_reference(net, x, image_ids(height, width, B, device=dev), ref, ref_ids, txt,
                                 text_ids(txt.shape[1], B, device=dev), y, steps, guidance,
                                 cuda_graph=cuda_graph, callback=callback, sampler=sampler, scheduler=scheduler,
                                 step_noise=step_noise(seeds, dev) if sampler in STOCHASTIC else None,
                                 unguided=model if net is not model else None, cfg_start=true_cfg_start)
    return unpack(out, height, width)


def fit_transformer(model, cond, max_gpu_memory, *, height, width, batch_size=1, guidance=None):
    """The streamed blocks resident so that one step with the reference fits `max_gpu_memory` (auto_fit)."""
    dev = model.streamer.device
    dtype = model.img_in.weight.dtype
    txt, y = prompt_rows(cond, [0] * batch_size, dev, dtype)
    ref, ref_ids = _reference(cond, batch_size, dev, dtype)
    net = WithReference(model, ref, ref_ids)
    x = pack(flame.zeros(batch_size, LATENT_CHANNELS, height // 8, width // 8, device=dev)).to(dtype)
    ids, tids = image_ids(height, width, batch_size, device=dev), text_ids(txt.shape[1], batch_size, device=dev)
    t = flame.full((batch_size,), 1.0, dtype=dtype, device=dev)
    g = flame.full((batch_size,), float(guidance or 1.0), dtype=dtype, device=dev)

    def step():
        with flame.no_grad():
            net(x, ids, txt, tids, t, y, g)
    return model.streamer.auto_fit(max_gpu_memory, step)


__all__ = ["read_reference", "encode_reference", "check_loras", "load_transformer", "sample_latents",
           "fit_transformer", "load_vae_for_flux"]
