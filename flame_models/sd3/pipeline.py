"""The SD3 / SD3.5 text-to-image pipeline in stages, each loaded, run and freed in turn so that the peak memory is the
largest stage's: prompt encoding (conditioning.py), the MMDiT's denoising, the VAE's decoding.

    files = find_sd3_files("sd3.5_large.safetensors")          # or a diffusers folder, or separate ComfyUI files
    with load_text_encoders(files, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"])
        neg = enc.encode([""])
    model = load_transformer(files, device="cuda", loras=[("style.safetensors", 0.8)])
    latents = sample_latents(model, cond, neg, height=1024, width=1024, steps=40, cfg=4.5, seeds=[42])
    free_model(model)
    vae = load_vae_for_sd3(files, device="cuda")
    images = to_pil(decode_latents(vae, latents))

Latents in "model space" are what the MMDiT sees: VAE latents z as (z - 0.0609) * 1.5305 (SD3's latent format),
(B, 16, H/8, W/8); decode_latents / encode_images convert to and from images in [-1, 1].
"""
import os

import numpy as np

import flame_core as flame

from ..conditioning import prompt_rows
from ..pipeline import check_loras as _check_loras
from ..pipeline import free_model, load_for_sampling, to_pil
from ..samplers.flow import STOCHASTIC, check_flow_sampler, step_noise
from ..samplers.flow_schedules import check_flow_scheduler, respace
from ..samplers.img2img import flow_init
from ..vae import decode_model_latents, encode_model_latents, load_family_vae
from .about import ABOUT
from .components import SD3Files, SD3FilesError, find_sd3_files
from .conditioning import SD3TextEncoders, encode_prompts, load_text_encoders
from .loading import load_sd3
from .sampling import LATENT_CHANNELS, SHIFT, SkipLayerGuidance, denoise, get_noise, get_sigmas

STACKS = ("joint_blocks",)

LATENT_FORMAT = ABOUT.latent_format


# ----------------------------------------------------------------------------- the VAE
def load_vae_for_sd3(files, *, dtype=flame.bfloat16, device=None, config=None):
    """The SD3 VAE of `files` (SD3Files, or a path to the VAE itself), frozen, in `dtype` on `device`. config: a
    VAEConfig or dict of fields for a VAE whose config the weights do not tell (default: files.configs['vae'])."""
    if isinstance(files, SD3Files):
        path, config = files.vae, config if config is not None else files.configs.get("vae")
    else:
        path = os.fspath(files)
    return load_family_vae(path, LATENT_CHANNELS, family="SD3", others="an SD / SDXL", error=SD3FilesError,
                           dtype=dtype, device=device, config=config)


def decode_latents(vae, latents):
    """Model-space latents (B, 16, H/8, W/8) -> images (B, 3, H, W) in [-1, 1] (nominally; not clamped), in the
    VAE's dtype, on its device: z = latents / 1.5305 + 0.0609, then the decoder."""
    return decode_model_latents(vae, latents, LATENT_FORMAT)


def encode_images(vae, images, generator=None):
    """Images (B, 3, H, W) in [-1, 1] -> model-space latents (B, 16, H/8, W/8) float32: (z - 0.0609) * 1.5305 of
    the posterior mean, or of a posterior sample drawn from `generator` (what SAI's reference and diffusers'
    img2img do)."""
    return encode_model_latents(vae, images, LATENT_FORMAT, generator)


# ----------------------------------------------------------------------------- the MMDiT
def check_loras(loras, params):
    """Read each LoRA file and check it against an MMDiT of `params` (SAI, kohya or diffusers PEFT names, shapes)
    before anything big is loaded. Returns [(path, weight)]; SD3FilesError names the file. Text-encoder parts
    (CLIP-L, CLIP-G, T5: kohya lora_te1_ / lora_te2_ / lora_te3_, diffusers text_encoder. / text_encoder_2. /
    text_encoder_3.) are accepted here and checked against the encoders when they load
    (conditioning.load_text_encoders, which a generator runs before the MMDiT)."""
    from .model import MMDiT
    return _check_loras(loras, params, model_class=MMDiT, error=SD3FilesError,
                        text_encoders={"te1": None, "te2": None, "te3": None})


def load_transformer(files, *, dtype=flame.bfloat16, device=None, loras=(), fp8=False, stream=False, slots=2):
    """The MMDiT of `files` (SD3Files or a path) with LoRAs applied, ready for sampling. fp8: the joint blocks'
    Linear weights in fp8 storage (LoRAs kept as adapters beside them); stream: the joint blocks in pinned host
    memory, streamed through `slots` device buffers (`model.streamer`; choose resident blocks with
    fit_transformer). Without either, LoRAs are merged into the weights."""
    files = files if isinstance(files, SD3Files) else find_sd3_files(files)
    loras = check_loras(loras, files.params)
    return load_for_sampling(lambda dev: load_sd3(files.transformer, dtype=dtype, device=dev), files.transformer,
                             loras, STACKS, device, fp8=fp8, stream=stream, slots=slots, error=SD3FilesError)


def _model_dtype(model):
    return model.x_embedder.proj.weight.dtype


def _device(model):
    streamer = getattr(model, "streamer", None)
    return streamer.device if streamer is not None else model.x_embedder.proj.weight.device


def sample_latents(model, cond, neg_cond=None, *, height, width, steps, cfg, seeds=None, latents=None, rows=None,
                   neg_rows=None, skip_layer_guidance=None, shift=SHIFT, callback=None, cuda_graph=None,
                   sampler="euler", scheduler="simple", init_latents=None, strength=None, mask=None):
    """Denoise with SD3's Euler (or sampler="heun" / "dpmpp_2m" / "dpmpp_2m_sde" / "unipc") sampler on the shifted
    flow schedule; returns model-space latents (B, 16, H/8, W/8) float32; dpmpp_2m_sde draws image i's step noise
    from seeds[i] + 1 (samplers.flow.step_noise).

    cond / neg_cond: {"prompt_embeds": (P, L, D), "pooled_prompt_embeds": (P, C)} of the prompts and negative
    prompts (Tensors or NumPy arrays); `rows` / `neg_rows` pick each image's (default: image i uses row i; one
    negative row is used for every image). neg_cond is needed when cfg != 1. Noise: one seed per image (image i
    starts from get_noise(seed=seeds[i]), the same whatever the batch), or `latents` (B, 16, H/8, W/8).
    skip_layer_guidance: an sd3.SkipLayerGuidance (SD3.5 Medium's reference uses it). callback(i, n) per step.
    scheduler: "simple" (SD3's shifted sigmas), "karras", "exponential" or "beta" (samplers/flow_schedules.py).
    Image-to-image: init_latents, an image's model-space latents (1 or B, 16, H/8, W/8; encode_images), noised to
    the sigma where `strength` (default 0.6, diffusers') of the `steps` are left, then denoised over those
    (samplers/img2img.py); the seeds' noise (or `latents`) is what is added. Skip-layer guidance keeps its window
    on the whole table's steps.
    mask (with init_latents): inpainting -- (h, w) at the latents' size, or (1 or B, h, w), in [0, 1], 1 where the
    image is repainted; the rest stays the image (samplers/inpaint.py); strength then defaults to 1."""
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    if (strength is not None or mask is not None) and init_latents is None:
        raise ValueError("strength and mask apply to image-to-image: pass init_latents= too")
    if (seeds is None) == (latents is None):
        raise ValueError("pass exactly one of seeds= (one per image) and latents=")
    if sampler in STOCHASTIC and seeds is None:
        raise ValueError(f"{sampler} draws its step noise from the images' seeds: pass seeds=, not latents=")
    if height % 16 or width % 16 or height <= 0 or width <= 0:
        raise ValueError(f"SD3 images need a height and width that are positive multiples of 16, got "
                         f"{height}x{width}")
    dev, dtype = _device(model), _model_dtype(model)
    if latents is None:
        noise = [get_noise(1, height, width, seed=int(s), device=dev) for s in seeds]
        x = noise[0] if len(noise) == 1 else flame.cat(noise, dim=0)
    else:
        x = latents if isinstance(latents, flame.Tensor) else flame.tensor(np.asarray(latents, dtype=np.float32))
        x = x.to(dev).float()
    B = x.shape[0]
    if tuple(x.shape[1:]) != (LATENT_CHANNELS, height // 8, width // 8):
        raise ValueError(f"latents of shape {tuple(x.shape)} do not fit a {height}x{width} image "
                         f"(B, {LATENT_CHANNELS}, {height // 8}, {width // 8})")
    rows = list(range(B)) if rows is None else list(rows)
    if len(rows) != B:
        raise ValueError(f"{len(rows)} prompt rows for {B} images")
    context, y = prompt_rows(cond, rows, dev, dtype)
    neg_context = neg_y = None
    if cfg != 1.0:
        if neg_cond is None:
            raise ValueError(f"cfg={cfg} needs the negative prompt's conditioning (neg_cond; the empty prompt "
                             f"encoded by default in diffusers)")
        neg_rows = [0] * B if neg_rows is None else list(neg_rows)
        neg_context, neg_y = prompt_rows(neg_cond, neg_rows, dev, dtype)
    slg = skip_layer_guidance
    if slg is not None and any(i < 0 or i >= model.params.depth for i in slg.layers):
        raise ValueError(f"skip-layer guidance layers {list(slg.layers)} are not all joint blocks of this MMDiT "
                         f"(depth {model.params.depth})")
    if cuda_graph is None and getattr(model, "streamer", None) is not None:
        cuda_graph = False  # a streamed forward is not capturable (its prefetch window wraps around)
    sigmas = respace(get_sigmas(steps, shift), scheduler)
    first, inpaint = 0, None
    if init_latents is not None:
        rest, x, inpaint = flow_init(sigmas, x, init_latents, strength, mask,
                                     (B, LATENT_CHANNELS, height // 8, width // 8), dev)
        first, sigmas = len(sigmas) - len(rest), rest
    return denoise(model, x, sigmas, context, y, neg_context, neg_y, cfg, slg,
                   cuda_graph, callback=callback, sampler=sampler,
                   step_noise=step_noise(seeds, dev) if sampler in STOCHASTIC else None, first=first, inpaint=inpaint)


def fit_transformer(model, cond, max_gpu_memory, *, height, width, batch_size=1, cfg=1.0):
    """Choose which streamed joint blocks stay resident so that one denoising step (a batch of 2B with CFG) at this
    size fits `max_gpu_memory` (flame_nn.offload.auto_fit, measured). Returns the FitReport."""
    dev, dtype = model.streamer.device, _model_dtype(model)
    n = batch_size * (2 if cfg != 1.0 else 1)
    context, y = prompt_rows(cond, [0] * n, dev, dtype)
    x = flame.zeros(n, LATENT_CHANNELS, height // 8, width // 8, device=dev).to(dtype)
    t = flame.full((n,), 1000.0, dtype=flame.float32, device=dev)

    def step():
        with flame.no_grad():
            model(x, t, y, context)
    return model.streamer.auto_fit(max_gpu_memory, step)


__all__ = ["SD3Files", "SD3FilesError", "find_sd3_files", "SD3TextEncoders", "load_text_encoders", "encode_prompts",
           "load_vae_for_sd3", "decode_latents", "encode_images", "to_pil", "check_loras", "load_transformer",
           "free_model", "sample_latents", "fit_transformer", "SkipLayerGuidance"]
