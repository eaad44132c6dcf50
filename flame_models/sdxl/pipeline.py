"""The SDXL text-to-image pipeline in stages, each loaded, run and freed in turn so that the peak memory is the
largest stage's: prompt encoding (conditioning.py), the UNet's denoising, the VAE's decoding.

    files = find_sdxl_files("sd_xl_base_1.0.safetensors")
    with load_text_encoders(files, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"])
        neg = enc.encode_negative(["a photo of a cat"], "blurry")
    unet = load_unet_for_sampling(files, device="cuda", loras=["style.safetensors:0.8"])
    latents = sample_latents(unet, cond, neg, height=1024, width=1024, steps=30, cfg=5.0, sampler="dpmpp_2m",
                             scheduler="karras", seeds=[42])
    free_model(unet)
    vae = load_vae_for_sdxl(files, device="cuda")            # bfloat16 by default
    images = to_pil(decode_latents(vae, latents))

Latents in "model space" are what the UNet sees: VAE latents z times 0.13025 (SDXL's latent format), (B, 4, H/8,
W/8). The SDXL VAE overflows in float16: load_vae_for_sdxl loads it in float32 when float16 is asked, and
decode_latents / encode_images run a float16 VAE in float32 (diffusers' force_upcast); bfloat16 keeps float32's
range and runs as it is.
"""
import os

import numpy as np

import flame_core as flame

from ..conditioning import prompt_rows
from ..pipeline import check_loras as _check_loras
from ..pipeline import free_model, load_for_sampling, to_pil
from ..samplers import DRAWS_NOISE
from ..samplers.img2img import SDXL_DEFAULT_STRENGTH, init_latents_rows, skipped_steps
from ..samplers.inpaint import latent_mask
from ..vae import check_latents, decode_model_latents, encode_model_latents, load_family_vae
from .about import ABOUT
from .components import SDXLFiles, SDXLFilesError, find_sdxl_files
from .conditioning import SDXLTextEncoders, encode_prompts, load_text_encoders
from .embeddings import make_y
from .loading import load_unet
from .sampling import sample

LATENT_FORMAT = ABOUT.latent_format
STACKS = ("input_blocks", "middle_block", "output_blocks")
LATENT_CHANNELS = 4
SAMPLERS = ("euler", "euler_ancestral", "heun", "dpm_2", "dpm_2_ancestral", "dpmpp_2m", "dpmpp_2m_sde", "ddim",
            "lcm", "unipc", "ddpm")
SCHEDULERS = ("normal", "karras")


# ----------------------------------------------------------------------------- the VAE
def load_vae_for_sdxl(files, *, dtype=flame.bfloat16, device=None, config=None):
    """The SDXL VAE of `files` (SDXLFiles, or a path to the VAE itself), frozen, on `device`, in `dtype` -- except
    float16, where the SDXL VAE's activations overflow: it is then loaded in float32. config: a VAEConfig or dict of
    fields for a VAE whose config the weights do not tell (default: files.configs['vae'])."""
    if isinstance(files, SDXLFiles):
        path, config = files.vae, config if config is not None else files.configs.get("vae")
    else:
        path = os.fspath(files)
    if dtype is not None and flame.dtypes.dtype(dtype) == flame.float16:
        dtype = flame.float32
    return load_family_vae(path, LATENT_CHANNELS, family="SDXL", others="a Flux / SD3", error=SDXLFilesError,
                           dtype=dtype, device=device, config=config)


def _compute_dtype(vae):
    return flame.float32 if vae.dtype == flame.float16 else vae.dtype


def decode_latents(vae, latents):
    """Model-space latents (B, 4, H/8, W/8) -> images (B, 3, H, W) in [-1, 1] (nominally; not clamped), on the VAE's
    device: z = latents / 0.13025, then the decoder in the VAE's dtype (float32 for a float16 VAE: the SDXL VAE
    overflows in float16; the VAE is cast for the call and back)."""
    check_latents(vae, latents)  # before the VAE is cast
    return _upcast_call(vae, lambda: decode_model_latents(vae, latents, LATENT_FORMAT))


def encode_images(vae, images, generator=None):
    """Images (B, 3, H, W) in [-1, 1] -> model-space latents (B, 4, H/8, W/8) float32: 0.13025 times the posterior
    mean, or a posterior sample drawn from `generator` (as diffusers' img2img and training scripts)."""
    return _upcast_call(vae, lambda: encode_model_latents(vae, images, LATENT_FORMAT, generator))


def _upcast_call(vae, fn):
    """fn() with a float16 VAE cast to float32 for the call and back."""
    dtype = vae.dtype
    compute = _compute_dtype(vae)
    if compute == dtype:
        return fn()
    vae.to(compute)
    try:
        return fn()
    finally:
        vae.to(dtype)


# ----------------------------------------------------------------------------- the UNet
def check_loras(loras, config):
    """Read each LoRA file and check it against a UNet of `config` (SAI / kohya or diffusers PEFT names, shapes)
    before anything big is loaded; text-encoder parts (kohya lora_te1_ / lora_te2_, diffusers text_encoder. /
    text_encoder_2.) are accepted for CLIP-L / CLIP-G. Returns [(path, weight)]; SDXLFilesError names the file."""
    from .model import SDXLUNet
    # the text-encoder parts are checked against the encoders when they load (conditioning.load_text_encoders),
    # which the generator does before the UNet
    return _check_loras(loras, config, model_class=SDXLUNet, error=SDXLFilesError,
                        text_encoders={"te1": None, "te2": None})


def load_unet_for_sampling(files, *, dtype=flame.bfloat16, device=None, loras=(), fp8=False, stream=False,
                           slots=2, freeu=None):
    """The UNet of `files` (SDXLFiles or a path) with LoRAs applied, ready for sampling. fp8: the blocks' Linear
    weights in fp8 storage (the convolutions keep `dtype`; LoRAs kept as adapters beside them); stream: the input,
    middle and output blocks in pinned host memory, streamed through `slots` device buffers (`unet.streamer`;
    resident blocks chosen by fit_unet). Without either, LoRAs are merged into the weights. freeu: {s1, s2, b1, b2}
    for unet.enable_freeu (freeu.py), or None."""
    files = files if isinstance(files, SDXLFiles) else find_sdxl_files(files)
    loras = check_loras(loras, files.config)
    unet = load_for_sampling(lambda dev: load_unet(files.unet, dtype=dtype, device=dev, config=files.config),
                             files.unet, loras, STACKS, device, fp8=fp8, stream=stream, slots=slots,
                             error=SDXLFilesError)
    return unet if freeu is None else unet.enable_freeu(**freeu)


def _device(unet):
    streamer = getattr(unet, "streamer", None)
    return streamer.device if streamer is not None else unet.device


def get_noise(batch, height, width, seed, device=None):
    """Unit-variance latent noise (batch, 4, height/8, width/8) float32 drawn from `seed` on `device` (the sampler
    scales it by its initial sigma)."""
    g = flame.Generator(device if device is not None else flame.default_device()).manual_seed(int(seed))
    return flame.randn(batch, LATENT_CHANNELS, height // 8, width // 8, generator=g, dtype=flame.float32,
                       device=device)


def sample_latents(unet, cond, neg_cond=None, *, height, width, steps, cfg, sampler="euler", scheduler="normal",
                   seeds=None, latents=None, rows=None, neg_rows=None, original_size=None, crop_coords=(0, 0),
                   target_size=None, eta=None, callback=None, init_latents=None, strength=None, mask=None,
                   guidance_rescale=0.0):
    """Denoise with one of SAMPLERS (euler, euler_ancestral, heun, dpm_2, dpm_2_ancestral, dpmpp_2m, dpmpp_2m_sde,
    ddim, lcm, unipc) on the scaled-linear schedule's sigmas ('normal', diffusers' SDXL spacing) or Karras'
    ('karras'); returns model-space latents (B, 4, H/8, W/8) float32.

    cond / neg_cond: {"prompt_embeds": (P, L, 2048), "pooled_prompt_embeds": (P, 1280)} (Tensors or NumPy arrays);
    `rows` / `neg_rows` pick each image's (default: image i uses row i; one negative row for every image); neg_cond
    None with cfg != 1: diffusers' zeros. Size conditioning: original_size and target_size (height, width; default
    the image's) and crop_coords (top, left), the same for the negative. Noise: one seed per image (image i starts
    from get_noise(seed=seeds[i]) and, for the stochastic samplers, draws its step noise from seeds[i] + 1: the same
    picture whatever the batch), or `latents` (B, 4, H/8, W/8), unit variance (the stochastic samplers then draw
    from seed 1). callback(i, n) per step. Image-to-image: init_latents (1 or B, 4, H/8, W/8), an image's latents
    in the UNet's space (encode_images), strength (default 0.3) and, for inpainting, mask (then strength defaults
    to 1): sampling.sample says how. guidance_rescale φ in [0, 1] (diffusers' guidance_rescale, Lin et al. 2023: the
    guided prediction rescaled toward the positive one's standard deviation; 0.7 for v-prediction models with zero
    terminal SNR)."""
    if (seeds is None) == (latents is None):
        raise ValueError("pass exactly one of seeds= (one per image) and latents=")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: one of {', '.join(SAMPLERS)}")
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler {scheduler!r}: one of {', '.join(SCHEDULERS)}")
    c = unet.config
    dev = _device(unet)
    if latents is None:
        noise = [get_noise(1, height, width, s, dev) for s in seeds]
    else:
        x = latents if isinstance(latents, flame.Tensor) else flame.tensor(np.asarray(latents, dtype=np.float32))
        noise = [x.to(dev).float()]
    B = sum(n.shape[0] for n in noise)
    rows = list(range(B)) if rows is None else list(rows)
    if len(rows) != B:
        raise ValueError(f"{len(rows)} prompt rows for {B} images")
    sizes = dict(original_size=(height, width) if original_size is None else tuple(original_size),
                 crop_coords=tuple(crop_coords), target_size=(height, width) if target_size is None
                 else tuple(target_size))
    context, pooled = prompt_rows(cond, rows, dev, flame.float32)
    y = make_y(pooled, size_embed_dim=c.size_embed_dim, **sizes)
    neg_context = neg_y = None
    if cfg != 1.0 and neg_cond is not None:
        neg_rows = [0] * B if neg_rows is None else list(neg_rows)
        neg_context, neg_pooled = prompt_rows(neg_cond, neg_rows, dev, flame.float32)
        neg_y = make_y(neg_pooled, size_embed_dim=c.size_embed_dim, **sizes)
    n_run = steps
    if init_latents is not None:
        shape = (B, c.in_channels, height // 8, width // 8)
        init_latents = init_latents_rows(init_latents, B, shape[1:], dev)
        if strength is None:
            strength = SDXL_DEFAULT_STRENGTH if mask is None else 1.0
        n_run = steps - skipped_steps(steps, strength, "sdxl")
        if mask is not None:
            mask = latent_mask(mask, shape, dev)
    elif strength is not None or mask is not None:
        raise ValueError("strength and mask apply to image-to-image: pass init_latents= too")
    kw = dict(height=height, width=width, steps=steps, cfg=cfg, sampler=sampler, scheduler=scheduler, eta=eta,
              guidance_rescale=guidance_rescale, progress=False,
              callback=None if callback is None else (lambda i, *a: callback(i, n_run)), strength=strength)
    # the stochastic samplers draw step noise for the whole batch from one generator: image by image, each image's
    # draws depend on its own seed only
    if latents is None and sampler in DRAWS_NOISE and len(seeds) > 1:
        out = []
        for i, s in enumerate(seeds):
            sl = slice(i, i + 1)
            out.append(sample(unet, context[sl], y[sl], None if neg_context is None else neg_context[sl],
                              None if neg_y is None else neg_y[sl], seed=int(s), noise=noise[i],
                              init_latents=None if init_latents is None else init_latents[sl],
                              mask=None if mask is None else mask[sl], **kw))
        return flame.cat(out, dim=0)
    seed = int(seeds[0]) if latents is None else 0
    x0 = noise[0] if len(noise) == 1 else flame.cat(noise, dim=0)
    return sample(unet, context, y, neg_context, neg_y, seed=seed, noise=x0, init_latents=init_latents, mask=mask,
                  **kw)


def fit_unet(unet, cond, max_gpu_memory, *, height, width, batch_size=1, cfg=1.0):
    """Choose which streamed UNet blocks stay resident so that one denoising step (a batch of 2B with CFG) at this
    size fits `max_gpu_memory` (flame_nn.offload.auto_fit, measured). Returns the FitReport."""
    c = unet.config
    dev, dtype = unet.streamer.device, unet.dtype
    n = batch_size * (2 if cfg != 1.0 else 1)
    context, pooled = prompt_rows(cond, [0] * n, dev, dtype)
    y = make_y(pooled, original_size=(height, width), size_embed_dim=c.size_embed_dim)
    x = flame.zeros(n, c.in_channels, height // 8, width // 8, device=dev).to(dtype)
    t = flame.full((n,), 999.0, dtype=flame.float32, device=dev)

    def step():
        with flame.no_grad():
            unet(x, t, context, y)
    return unet.streamer.auto_fit(max_gpu_memory, step)


__all__ = ["SDXLFiles", "SDXLFilesError", "find_sdxl_files", "SDXLTextEncoders", "load_text_encoders",
           "encode_prompts", "load_vae_for_sdxl", "decode_latents", "encode_images", "to_pil", "check_loras",
           "load_unet_for_sampling", "free_model", "get_noise", "sample_latents", "fit_unet", "SAMPLERS",
           "SCHEDULERS"]
