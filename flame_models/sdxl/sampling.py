"""Text-to-image latents with an SDXL UNet: classifier-free guidance (one batched 2B forward per step) around the
generic samplers of flame_models.samplers.

    z = sample(unet, context, y, neg_context, neg_y, height=1024, width=1024, steps=30, cfg=5.0, seed=0)
    images = vae.decode(SDXL.from_model(z))      # flame_models.vae: the caller applies the latent scale 0.13025
"""
import math

import flame_core as flame
from flame_models.samplers import (
    DRAWS_NOISE,
    SAMPLERS,
    STOCHASTIC,
    DDPMSchedule,
    Denoiser,
    check_prediction_type,
    ddim_sigmas,
    dpm_sigmas,
    get_sigmas,
    kdpm2_sigmas,
    lcm_sigmas,
)
from flame_models.samplers.img2img import SDXL_DEFAULT_STRENGTH, init_latents_rows, ve_start
from flame_models.samplers.inpaint import latent_mask, ve_inpaint

VAE_FACTOR = 8
# the samplers whose diffusers scheduler keeps VE samples and starts linspace / trailing tables at σ_max·ε (its
# init_noise_sigma); the others start at √(σ_max² + 1)·ε
_SIGMA_SCALED = ("euler", "euler_ancestral", "heun", "dpm_2", "dpm_2_ancestral")


def cfg_model(unet, context, y, neg_context=None, neg_y=None, cfg=1.0, guidance_rescale=0.0):
    """model(x_in, t) -> the UNet's prediction (float32) for the batch, guided: uncond + cfg·(cond − uncond) from one
    forward of [negative | positive] when cfg != 1. guidance_rescale φ (Lin et al. 2023, diffusers'): the guided
    prediction's per-sample std brought φ of the way back to the conditional one's."""
    dtype, device = unet.dtype, unet.device
    B = context.shape[0]
    guided = cfg != 1.0
    if guided:
        ctx = flame.cat([neg_context, context], dim=0).to(dtype)
        yy = flame.cat([neg_y, y], dim=0).to(dtype)
    else:
        ctx, yy = context.to(dtype), y.to(dtype)
    n = ctx.shape[0]

    def model(x_in, t):
        ts = flame.full((n,), float(t), dtype=flame.float32, device=device)
        xx = flame.cat([x_in, x_in], dim=0) if guided else x_in
        out = unet(xx.to(dtype), ts, ctx, yy).float()
        if not guided:
            return out
        uncond, cond = out[:B], out[B:]
        pred = uncond + (cond - uncond) * cfg
        if guidance_rescale:
            dims = tuple(range(1, pred.ndim))
            std_cond = cond.std(dim=dims, keepdim=True)
            std_pred = pred.std(dim=dims, keepdim=True)
            rescaled = pred * (std_cond / std_pred)
            pred = rescaled * guidance_rescale + pred * (1.0 - guidance_rescale)
        return pred
    return model


def _check(unet, context, y, neg_context, neg_y, height, width, cfg):
    c = unet.config
    if context.ndim != 3 or context.shape[2] != c.context_dim:
        raise ValueError(f"sample: context must be (B, L, {c.context_dim}), got {tuple(context.shape)}")
    B = context.shape[0]
    if y.ndim != 2 or tuple(y.shape) != (B, c.adm_in_channels):
        raise ValueError(f"sample: y must be ({B}, {c.adm_in_channels}), got {tuple(y.shape)}")
    if neg_context is not None and (neg_context.ndim != 3 or neg_context.shape[0] != B
                                    or neg_context.shape[2] != c.context_dim):
        raise ValueError(f"sample: neg_context must be ({B}, L, {c.context_dim}), got {tuple(neg_context.shape)}")
    if neg_y is not None and tuple(neg_y.shape) != (B, c.adm_in_channels):
        raise ValueError(f"sample: neg_y must be ({B}, {c.adm_in_channels}), got {tuple(neg_y.shape)}")
    f = VAE_FACTOR * c.downsample_factor
    if height <= 0 or width <= 0 or height % f or width % f:
        raise ValueError(f"sample: height and width must be positive multiples of {f}, got {height}x{width}")
    if not cfg > 0:
        raise ValueError(f"sample: cfg must be > 0, got {cfg}")


def sample(unet, context, y, neg_context=None, neg_y=None, *, height=1024, width=1024, steps=30, cfg=5.0,
           sampler="euler", scheduler="normal", seed=0, prediction_type="epsilon", zero_terminal_snr=False,
           timestep_spacing="leading", steps_offset=1, eta=None, guidance_rescale=0.0, noise=None, callback=None,
           progress=True, init_latents=None, strength=None, mask=None):
    """Latents (B, 4, height/8, width/8) float32 in the UNet's space (decode `SDXL.from_model(z)`).

    context (B, 77, 2048) and y (B, 2816) condition the image (`make_y` builds y); neg_context / neg_y the negative
    prompt of classifier-free guidance. When they are None and cfg != 1, SDXL's unconditional input is used: zero
    context and y with its pooled part zeroed (its size conditioning kept), as diffusers' SDXL pipeline does.

    sampler: one of SAMPLERS ('euler', 'euler_ancestral', 'heun', 'dpm_2', 'dpm_2_ancestral', 'dpmpp_2m',
    'dpmpp_2m_sde', 'ddim', 'lcm', 'unipc'); scheduler: 'normal' or 'karras' (not for ddim or lcm). The sigma table is
    the sampler's diffusers scheduler's with SDXL's config (leading spacing, steps_offset 1): EulerDiscreteScheduler's
    (euler, euler_ancestral; heun: HeunDiscreteScheduler's, the same), the KDPM2 schedulers' (dpm_2, dpm_2_ancestral),
    DPMSolverMultistepScheduler's (dpmpp_2m, dpmpp_2m_sde; unipc: UniPCMultistepScheduler's, the same),
    DDIMScheduler's (ddim), LCMScheduler's (lcm: a latent
    consistency model such as an SDXL with an LCM-LoRA; 4-8 steps, cfg 1-2); zero_terminal_snr rescales the
    schedule (use with v_prediction and timestep_spacing='trailing'). eta: the step noise of the stochastic samplers
    (STOCHASTIC), drawn from seed + 1: default 1 (what diffusers' schedulers do) for euler_ancestral, dpm_2_ancestral
    and dpmpp_2m_sde, 0 for ddim; lcm draws its noise from seed + 1 too (it takes no eta).
    noise: the initial Gaussian latents (else drawn from `seed` on the UNet's device), scaled as the sampler's
    diffusers scheduler does (init_noise_sigma): by σ_max for euler, euler_ancestral, heun, dpm_2 and
    dpm_2_ancestral with linspace or trailing spacing, else by √(σ_max² + 1) (the x0 + σ·ε of unit-variance
    latents).
    Image-to-image: init_latents, an image's latents in the UNet's space (1 or B, 4, height/8, width/8;
    `SDXL.to_model` of the VAE's), noised to the sigma where `strength` (default 0.3, diffusers') of the `steps` are
    left -- x0 + σ·noise -- then denoised over those (samplers/img2img.py; not lcm, whose table depends on the
    strength itself). mask (with init_latents): inpainting -- (h, w) at the latents' size, or (1 or B, h, w), in
    [0, 1], 1 where the image is repainted; the rest stays the image (samplers/inpaint.py); strength then defaults
    to 1."""
    check_prediction_type(prediction_type)
    if (strength is not None or mask is not None) and init_latents is None:
        raise ValueError("sample: strength and mask apply to image-to-image: pass init_latents= too")
    if init_latents is not None and sampler == "lcm":
        raise ValueError("sample: image-to-image with lcm is not supported (LCM's timesteps depend on the strength); "
                         "use another sampler")
    if sampler not in SAMPLERS:
        raise ValueError(f"sample: unknown sampler {sampler!r}; known: {', '.join(SAMPLERS)}")
    if sampler in ("ddim", "ddpm", "lcm") and scheduler != "normal":
        raise ValueError(f"sample: {sampler} walks its own timesteps; scheduler must be 'normal'")
    if sampler not in STOCHASTIC and eta is not None:
        raise ValueError(f"sample: eta applies to {', '.join(STOCHASTIC)}, not {sampler}")
    _check(unet, context, y, neg_context, neg_y, height, width, cfg)
    c = unet.config
    B, device = context.shape[0], unet.device
    if cfg != 1.0:
        if neg_context is None:
            neg_context = flame.zeros_like(context)
        if neg_y is None:
            neg_y = flame.cat([flame.zeros_like(y[:, :c.pooled_dim]), y[:, c.pooled_dim:]], dim=1)
    context, y = context.to(device=device), y.to(device=device)
    if neg_context is not None:
        neg_context, neg_y = neg_context.to(device=device), neg_y.to(device=device)

    schedule = DDPMSchedule(zero_terminal_snr=zero_terminal_snr)
    if sampler in ("ddim", "ddpm"):   # (DDPMScheduler's table: DDIM's, its last step to ᾱ = 1)
        sigmas, timesteps = ddim_sigmas(schedule, steps, timestep_spacing, steps_offset,
                                        set_alpha_to_one=sampler == "ddpm")
    elif sampler == "lcm":   # LCMScheduler's table (its own spacing: timestep_spacing and steps_offset do not apply)
        sigmas, timesteps = lcm_sigmas(schedule, steps)
    elif sampler in ("dpmpp_2m", "dpmpp_2m_sde", "unipc"):   # DPMSolverMultistepScheduler's (UniPC's the same)
        sigmas, timesteps = dpm_sigmas(schedule, steps, scheduler, timestep_spacing, steps_offset)
    elif sampler in ("dpm_2", "dpm_2_ancestral"):
        sigmas, timesteps = kdpm2_sigmas(schedule, steps, scheduler, timestep_spacing, steps_offset)
    else:
        sigmas, timesteps = get_sigmas(schedule, steps, scheduler, timestep_spacing, steps_offset)

    shape = (B, c.in_channels, height // VAE_FACTOR, width // VAE_FACTOR)
    if noise is None:
        g = flame.Generator(device).manual_seed(seed)
        noise = flame.randn(*shape, generator=g, dtype=flame.float32, device=device)
    elif tuple(noise.shape) != shape:
        raise ValueError(f"sample: noise must be {shape}, got {tuple(noise.shape)}")
    if init_latents is None:
        s0 = float(sigmas[0])
        by_sigma = sampler in _SIGMA_SCALED and timestep_spacing != "leading"
        x = noise.to(device=device, dtype=flame.float32) * (s0 if by_sigma else math.sqrt(s0 * s0 + 1.0))
    else:
        init = init_latents_rows(init_latents, B, shape[1:], device)
        noise = noise.to(device=device, dtype=flame.float32)
        if strength is None:
            strength = SDXL_DEFAULT_STRENGTH if mask is None else 1.0
        sigmas, timesteps, x = ve_start(sigmas, init, noise, strength, timesteps)

    denoiser = Denoiser(cfg_model(unet, context, y, neg_context, neg_y, cfg, guidance_rescale), schedule,
                        prediction_type)
    if mask is not None:
        denoiser = ve_inpaint(denoiser, latent_mask(mask, shape, device), init, noise)
    kwargs = {} if eta is None else {"eta": float(eta)}
    if sampler in DRAWS_NOISE:
        kwargs["generator"] = flame.Generator(device).manual_seed(seed + 1)
    with flame.no_grad():
        x = SAMPLERS[sampler](denoiser, x, sigmas, timesteps, callback=callback, progress=progress, **kwargs)
    # DDIM ends at ᾱ_0, not at σ = 0: back to the model's (VP) scale, as the scheduler leaves it
    s_last = float(sigmas[-1])
    return x if s_last == 0.0 else x * (1.0 / math.sqrt(s_last * s_last + 1.0))
