"""The Flux text-to-image pipeline in stages, each loaded, run and freed in turn so that the peak memory is the
largest stage's, not the sum: prompt encoding (conditioning.py), the transformer's denoising, the VAE's decoding.

    files = find_flux_files("FLUX.1-dev/")
    with load_text_encoders(files, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"])
    model = load_transformer(files, device="cuda", loras=[("style.safetensors", 0.8)])
    latents = sample_latents(model, cond, height=1024, width=1024, steps=28, guidance=3.5, seeds=[42])
    del model
    vae = load_vae_for_flux(files, device="cuda")
    images = to_pil(decode_latents(vae, latents))

Latents in "model space" are what the transformer sees (VAE latents z as (z - 0.1159) * 0.3611, unpacked to
(B, 16, H/8, W/8)); decode_latents / encode_images convert to and from images in [-1, 1].
"""

import flame_core as flame

from ..bfl.transformer import STACKS, check_loras, load_transformer  # noqa: F401
from ..bfl.true_cfg import with_true_cfg
from ..bfl.vae import LATENT_FORMAT, decode_latents, encode_images, load_vae_for_flux  # noqa: F401
from ..conditioning import prompt_rows
from ..pipeline import (  # noqa: F401
    apply_loras,
    check_lora_part,
    free_model,
    load_for_sampling,
    parse_lora,
    place_for_inference,
    to_pil,
)
from ..samplers.flow import STOCHASTIC, check_flow_sampler, step_noise
from ..samplers.flow_schedules import check_flow_scheduler, respace
from ..samplers.img2img import flow_init
from .components import FluxFiles, FluxFilesError, find_flux_files  # noqa: F401
from .conditioning import FluxTextEncoders, check_vocabularies, encode_prompts, load_text_encoders, load_tokenizers
from .loading import load_flux  # noqa: F401
from .sampling import LATENT_CHANNELS, denoise, get_schedule, image_ids, pack, start_noise, text_ids, unpack


def _model_dtype(model):
    return model.img_in.weight.dtype


def sample_latents(model, cond, *, height, width, steps, guidance=None, seeds=None, latents=None, rows=None,
                   callback=None, cuda_graph=None, sampler="euler", scheduler="simple", init_latents=None,
                   strength=None, mask=None, neg=None, true_cfg=1.0, true_cfg_start=0):
    """Denoise with the Euler (or sampler="heun" / "dpmpp_2m" / "dpmpp_2m_sde" / "unipc") sampler on Flux's
    (shifted, for dev) schedule; returns model-space latents (B, 16, H/8, W/8) float32; dpmpp_2m_sde draws image i's
    step noise from seeds[i] + 1 (samplers.flow.step_noise).

    cond: {"prompt_embeds": (P, L, C), "pooled_prompt_embeds": (P, C)} (Tensors or NumPy arrays); `rows` picks
    the prompt of each image (default: image i uses prompt i). Noise: one seed per image (`seeds`: image i starts
    from get_noise(seed=seeds[i]), the same whatever the batch), or `latents` given, packed (B, L, 64) or
    unpacked (B, 16, H/8, W/8). guidance: the embedded guidance of flux-dev (ignored by nothing: schnell takes
    None). callback(i, n) after each step. scheduler: "simple" (Flux's own sigmas), "karras", "exponential" or
    "beta" (samplers/flow_schedules.py).
    Image-to-image: init_latents, an image's model-space latents (1 or B, 16, H/8, W/8; encode_images), noised to
    the sigma where `strength` (default 0.6, diffusers') of the `steps` are left, then denoised over those
    (samplers/img2img.py); the seeds' noise (or `latents`) is what is added.
    mask (with init_latents): inpainting -- (h, w) at the latents' size, or (1 or B, h, w), in [0, 1], 1 where the
    image is repainted; the rest stays the image (samplers/inpaint.py); strength then defaults to 1.
    True CFG (diffusers' true_cfg_scale): with true_cfg > 1 and `neg` (the negative prompt's conditioning, one row
    or one per prompt) each step also runs the negative prompt and takes v_neg + true_cfg (v_pos - v_neg)
    (bfl/true_cfg.py); from step `true_cfg_start` (0-based) on -- the earlier steps run the prompt alone, as
    SimpleTuner's validation_no_cfg_until_timestep."""
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    if (strength is not None or mask is not None) and init_latents is None:
        raise ValueError("strength and mask apply to image-to-image: pass init_latents= too")
    p = model.params
    dev = model.img_in.weight.device
    if p.guidance_embed and guidance is None:
        raise ValueError("this Flux model (dev) embeds a guidance strength: pass guidance= (e.g. 3.5)")
    if not p.guidance_embed and guidance is not None:
        raise ValueError("this Flux model (schnell-like) has no guidance embedding: pass guidance=None")
    x = start_noise(seeds, latents, height, width, sampler, dev)
    B = x.shape[0]
    rows = list(range(B)) if rows is None else list(rows)
    if len(rows) != B:
        raise ValueError(f"{len(rows)} prompt rows for {B} images")
    dtype = _model_dtype(model)
    txt, y = prompt_rows(cond, rows, dev, dtype)
    img_pos = image_ids(height, width, B, device=dev)
    if x.shape[1] != img_pos.shape[1]:
        raise ValueError(f"latents of {x.shape[1]} tokens do not fit a {height}x{width} image "
                         f"({img_pos.shape[1]} tokens)")
    txt_pos = text_ids(txt.shape[1], B, device=dev)
    net = with_true_cfg(model, neg, rows, txt, true_cfg, dev, dtype)
    timesteps = respace(get_schedule(steps, x.shape[1], shift=p.guidance_embed), scheduler)
    inpaint = None
    if init_latents is not None:
        timesteps, x, inpaint = flow_init(timesteps, x, init_latents, strength, mask,
                                          (B, LATENT_CHANNELS, height // 8, width // 8), dev, pack)
    out = denoise(net, x, img_pos, txt, txt_pos, y, timesteps, guidance, cuda_graph, callback, sampler,
                  step_noise(seeds, dev) if sampler in STOCHASTIC else None, inpaint=inpaint,
                  unguided=model if net is not model else None, cfg_start=true_cfg_start)
    return unpack(out, height, width)


def fit_transformer(model, cond, max_gpu_memory, *, height, width, batch_size=1, guidance=None):
    """Choose which streamed blocks stay resident so that one denoising step at this size fits `max_gpu_memory`
    (flame_nn.offload.auto_fit, measured); the budget is then the pool's limit. Returns the FitReport."""
    p = model.params
    dev = model.streamer.device
    dtype = _model_dtype(model)
    txt, y = prompt_rows(cond, [0] * batch_size, dev, dtype)
    x = pack(flame.zeros(batch_size, LATENT_CHANNELS, height // 8, width // 8, device=dev)).to(dtype)
    img_pos, txt_pos = image_ids(height, width, batch_size, device=dev), text_ids(txt.shape[1], batch_size,
                                                                                 device=dev)
    t = flame.full((batch_size,), 1.0, dtype=dtype, device=dev)
    g = flame.full((batch_size,), float(guidance or 1.0), dtype=dtype, device=dev) if p.guidance_embed else None

    def step():
        with flame.no_grad():
            model(img=x, img_ids=img_pos, txt=txt, txt_ids=txt_pos, timesteps=t, y=y, guidance=g)
    return model.streamer.auto_fit(max_gpu_memory, step)


__all__ = ["FluxFiles", "FluxFilesError", "find_flux_files", "FluxTextEncoders", "load_text_encoders",
           "load_tokenizers", "check_vocabularies", "encode_prompts", "load_vae_for_flux", "decode_latents",
           "encode_images", "to_pil", "parse_lora", "check_loras", "check_lora_part", "apply_loras",
           "load_transformer", "load_for_sampling", "place_for_inference", "free_model", "sample_latents",
           "fit_transformer"]
