"""Image-to-image: denoising that starts from an image's latents with noise added, part of the way down the sigma
table (diffusers' *Img2ImgPipeline `strength`, ComfyUI's KSampler `denoise`, A1111's "Denoising strength").

`strength` in (0, 1] is the fraction of the `steps`-step table that runs: the first steps are skipped and the image's
latents x0 are noised to the sigma the remaining table starts at --

    flow families (SD3, Flux, Chroma, Qwen-Image)  x = s·ε + (1 − s)·x0  (FlowMatchEulerDiscreteScheduler.scale_noise)
                                                   the first int(steps − steps·strength) steps skipped
    SDXL (sigmas of x = x0 + σ·ε)                  x = x0 + σ·ε          (the schedulers' add_noise, in that space)
                                                   the first steps − int(steps·strength) steps skipped

(each as its diffusers pipeline rounds: Flux's / SD3's img2img run ceil-like, SDXL's floor). The remaining table is
then sampled as a table of its own: the multistep samplers start their history fresh at its first step and step down
to lower order at its last, as diffusers' schedulers do after `set_begin_index`. strength 1 starts from pure noise at
the top of the table (the text-to-image start for tables that begin at s = 1).
"""
import math

import numpy as np

import flame_core as flame

DEFAULT_STRENGTH = 0.6       # diffusers' FluxImg2ImgPipeline / StableDiffusion3Img2ImgPipeline default
SDXL_DEFAULT_STRENGTH = 0.3  # diffusers' StableDiffusionXLImg2ImgPipeline default


def check_strength(strength):
    """`strength` as a float in (0, 1], else a ValueError."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)):
        raise ValueError(f"strength must be a number in (0, 1], got {strength!r}")
    s = float(strength)
    if not (0.0 < s <= 1.0):
        raise ValueError(f"strength must be in (0, 1] (the fraction of the steps that run), got {strength!r}")
    return s


def skipped_steps(steps, strength, rounding="flow"):
    """How many of the `steps` steps image-to-image skips at `strength`: "flow" as diffusers' flow pipelines
    (int(steps - min(steps·strength, steps))), "sdxl" as its SDXL img2img pipeline (steps - int(steps·strength)).
    A ValueError when no step would be left."""
    strength = check_strength(strength)
    if rounding == "flow":
        skip = int(max(steps - min(steps * strength, steps), 0))
    elif rounding == "sdxl":
        skip = max(steps - min(int(steps * strength), steps), 0)
    else:
        raise ValueError(f"rounding must be 'flow' or 'sdxl', got {rounding!r}")
    if skip >= steps:
        raise ValueError(f"strength {strength:g} of {steps} steps runs no step: raise strength or steps (at least "
                         f"{math.ceil(1 / strength)} steps at this strength)")
    return skip


def flow_start(sigmas, init, noise, strength):
    """(the remaining sigma table, the starting sample) of a flow family's image-to-image: `sigmas` the whole table
    (high to 0, steps + 1 values), `init` the image's model-space latents, `noise` unit Gaussian noise of the
    sample's shape (init broadcasts to it)."""
    skip = skipped_steps(len(sigmas) - 1, strength, "flow")
    rest = sigmas[skip:]
    s = float(rest[0])
    return rest, noise * s + init * (1.0 - s)


def ve_start(sigmas, init, noise, strength, timesteps=None):
    """(the remaining sigma table, its timesteps (None when none given), the starting sample) of an SDXL
    image-to-image: x = init + σ·noise at the remaining table's first sigma (the sample space of FLAME's SDXL
    samplers, x0 + σ·ε, whatever the scheduler: a VP scheduler's add_noise is that sample times √ᾱ)."""
    skip = skipped_steps(len(sigmas) - 1, strength, "sdxl")
    rest = sigmas[skip:]
    return rest, None if timesteps is None else timesteps[skip:], init + noise * float(rest[0])


def init_latents_rows(init, batch, shape, device):
    """The image latents `init` (a Tensor or array of shape (1 or batch,) + shape: model-space latents, as the
    family's VAE encoding gives them) as float32 rows of the batch on `device`; a ValueError naming the shapes."""
    x = init if isinstance(init, flame.Tensor) else flame.tensor(np.asarray(init, dtype=np.float32))
    got = tuple(x.shape)
    if len(got) != 1 + len(shape) or got[1:] != tuple(shape) or got[0] not in (1, batch):
        raise ValueError(f"init_latents of shape {got} do not fit {batch} image(s) of latents {tuple(shape)}: "
                         f"(1, {', '.join(map(str, shape))}) or ({batch}, {', '.join(map(str, shape))})")
    if not bool(flame.isfinite(x).all()):   # (checked where they are: host latents before they are sent)
        raise ValueError("init_latents hold values that are not finite")
    x = x.to(device).float()
    return x.expand(batch, *shape) if got[0] != batch else x


def flow_init(sigmas, noise, init_latents, strength, mask, shape, device, layout=None):
    """The start of a flow family's image-to-image or inpainting run: (the remaining sigma table, the starting
    sample, the inpainting wrapper's (mask, init, noise) or None). noise: the run's starting noise, in the sample's
    layout; shape: the latents' (B, C, h, w); layout: latents -> the sample's layout (Flux's pack; default: the
    latents themselves); strength None: DEFAULT_STRENGTH, or 1 with a mask."""
    from .inpaint import latent_mask
    lay = layout or (lambda t: t)
    init = lay(init_latents_rows(init_latents, shape[0], shape[1:], device))
    if strength is None:
        strength = DEFAULT_STRENGTH if mask is None else 1.0
    rest, x = flow_start(sigmas, init, noise, strength)
    return rest, x, None if mask is None else (lay(latent_mask(mask, shape, device)), init, noise)
