"""SD3 / SD3.5 sampling: the shifted flow-matching schedule, Euler or Heun steps (samplers/flow.py) with
classifier-free guidance (cond and uncond in one batch of 2B), and skip-layer guidance (SD3.5 Medium).

Schedule (SAI's sd3_impls ModelSamplingDiscreteFlow + get_sigmas, which diffusers' FlowMatchEulerDiscreteScheduler
with shift=3 reproduces, and FlowMatchHeunDiscreteScheduler step by step): s(u) = shift u / (1 + (shift - 1) u); the
training table is s(i / 1000), i = 1..1000; an N-step run takes t = linspace(1000 s(1), 1000 s(0.001), N),
sigma = s(t / 1000) (the low end is shifted twice, as in both references), then appends 0. The model
sees timesteps 1000 sigma and predicts the velocity v = noise - x0.
"""
from dataclasses import dataclass

import flame_core as flame
from flame_nn.offload import streamer_of

from ..samplers.flow import (
    STOCHASTIC,
    check_flow_sampler,
    check_step_noise,
    flow_step,
    multistep_state,
    step_coefficients,
    step_kind,
)
from ..samplers.flow import step_noise as seeded_step_noise
from ..samplers.flow_schedules import check_flow_scheduler, respace
from ..samplers.inpaint import flow_inpaint
from ..samplers.noise import get_noise  # noqa: F401  (16 channels at 1/8 resolution, seeded)

SHIFT = 3.0
NUM_TRAIN_TIMESTEPS = 1000
LATENT_CHANNELS = 16
# the SD3 autoencoder's latent statistics (SAI's SD3LatentFormat): decode z = latent / SCALE + SHIFT, encode
# latent = (z - SHIFT) * SCALE. Kept here until flame_models.vae provides the family's LatentFormat.
LATENT_SCALE = 1.5305
LATENT_SHIFT = 0.0609


@dataclass(frozen=True)
class SkipLayerGuidance:
    """Skip-layer guidance: on steps i with start*N < i < stop*N, one more conditional pass with the joint blocks
    `layers` left out, and v += scale * (v_cond - v_skipped). Defaults: SAI's sd3_infer for SD3.5 Medium (diffusers'
    pipeline defaults differ: scale 2.8, stop 0.2)."""
    layers: tuple = (7, 8, 9)
    scale: float = 2.5
    start: float = 0.01
    stop: float = 0.30

    def active(self, i, steps):
        return self.scale > 0 and start_stop(i, steps, self.start, self.stop)


def start_stop(i, steps, start, stop):
    return steps * start < i < steps * stop


# the references' settings per release: sample(model, ..., **SAMPLING_DEFAULTS[name])
SAMPLING_DEFAULTS = {
    "sd3.5-large": dict(steps=40, cfg=4.5),
    "sd3.5-large-turbo": dict(steps=4, cfg=1.0),
    "sd3.5-medium": dict(steps=50, cfg=5.0, skip_layer_guidance=SkipLayerGuidance()),
}


def shift_sigma(sigma, shift=SHIFT):
    """s(sigma) = shift sigma / (1 + (shift - 1) sigma) (python float)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def get_sigmas(steps, shift=SHIFT):
    """steps + 1 sigmas from 1 down to 0 (python floats, float64 arithmetic)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    t_max = NUM_TRAIN_TIMESTEPS * shift_sigma(1.0, shift)
    t_min = NUM_TRAIN_TIMESTEPS * shift_sigma(1.0 / NUM_TRAIN_TIMESTEPS, shift)
    ts = [t_max + (t_min - t_max) * i / (steps - 1) for i in range(steps)] if steps > 1 else [t_max]
    return [shift_sigma(t / NUM_TRAIN_TIMESTEPS, shift) for t in ts] + [0.0]


def denoise(model, x, sigmas, context, y, neg_context=None, neg_y=None, cfg=1.0, skip_layer_guidance=None,
            cuda_graph=None, progress=False, callback=None, sampler="euler", step_noise=None, first=0, inpaint=None):
    """`sampler` ("euler", "heun", "dpmpp_2m", "dpmpp_2m_sde" or "unipc", samplers/flow.py) steps along `sigmas` over
    the velocity v guided by classifier-free guidance uncond + cfg (cond - uncond) when cfg != 1 (cond and uncond as
    one batch of 2B) and optionally skip-layer guidance (on both of Heun's evaluations in its steps' window). The
    state stays in float32; the model sees its own dtype. Returns float32 latents.

    cuda_graph (default: on for cuda tensors): each kind of step (sampler, with and without the skip-layer pass)
    runs once eagerly, then is captured as a CUDA graph (flame_core.cuda.graphed) and replayed; the numbers are the
    same. callback(i, steps) after each step. step_noise(i, x): dpmpp_2m_sde's fresh noise of step i
    (samplers.flow.step_noise), drawn before the step (outside its graph). first: how many steps of a longer table
    `sigmas` leaves out at its start (image-to-image): skip-layer guidance's window stays on the whole table's.
    inpaint: (mask, init, noise) of x's shape: only the mask's region is denoised (samplers/inpaint.py)."""
    check_flow_sampler(sampler)
    check_step_noise(sampler, step_noise)
    dtype = _model_dtype(model)
    B = x.shape[0]
    guided = cfg != 1.0
    if guided:
        if neg_context is None or neg_y is None:
            raise ValueError(f"cfg={cfg} needs the negative prompt's neg_context and neg_y (e.g. the empty prompt "
                             f"encoded); cfg=1.0 runs without them")
        if tuple(neg_context.shape) != tuple(context.shape) or tuple(neg_y.shape) != tuple(y.shape):
            raise ValueError(f"negative conditioning {tuple(neg_context.shape)} / {tuple(neg_y.shape)} must match the "
                             f"positive {tuple(context.shape)} / {tuple(y.shape)} (pad the token sequences alike)")
        ctx_in = flame.cat((context, neg_context), dim=0).to(dtype)             # cond first, as SAI's CFGDenoiser
        y_in = flame.cat((y, neg_y), dim=0).to(dtype)
    else:
        ctx_in, y_in = context.to(dtype), y.to(dtype)
    cond_ctx, cond_y = context.to(dtype), y.to(dtype)
    slg = skip_layer_guidance

    def guided_velocity(x, t_vec):
        """(v, v_cond): the CFG velocity and the conditional one (None without CFG)."""
        if not guided:
            return model(x.to(dtype), t_vec, y_in, ctx_in).to(flame.float32), None
        xx = flame.cat((x, x), dim=0).to(dtype)
        v = model(xx, flame.cat((t_vec, t_vec), dim=0), y_in, ctx_in).to(flame.float32)
        v_cond, v_uncond = v[:B], v[B:]
        return v_uncond + cfg * (v_cond - v_uncond), v_cond

    def velocity(x, t_vec):
        return guided_velocity(x, t_vec)[0]

    def velocity_slg(x, t_vec):
        v, v_cond = guided_velocity(x, t_vec)
        if v_cond is None:
            v_cond = v
        v_skip = model(x.to(dtype), t_vec, cond_y, cond_ctx, skip_layers=slg.layers).to(flame.float32)
        return v + slg.scale * (v_cond - v_skip)
    if inpaint is not None:
        velocity = flow_inpaint(velocity, *inpaint, lambda t: t * (1.0 / NUM_TRAIN_TIMESTEPS))
        velocity_slg = flow_inpaint(velocity_slg, *inpaint, lambda t: t * (1.0 / NUM_TRAIN_TIMESTEPS))

    # a streamed inference forward is not capturable: its prefetch window wraps around from call to call
    use_graph = (x.device.type == "cuda" and streamer_of(model) is None) if cuda_graph is None else bool(cuda_graph)
    runs = {(kind, with_slg): flame.cuda.graphed(flow_step(velocity_slg if with_slg else velocity, kind), warmup=1,
                                                 enabled=use_graph)
            for kind in {"euler", sampler} for with_slg in (False, True)}
    steps = len(sigmas) - 1
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="sampling", unit="step")
    x = x.to(flame.float32)

    def timestep(sigma):
        return flame.full((B,), NUM_TRAIN_TIMESTEPS * float(sigma), dtype=flame.float32, device=x.device)
    state = multistep_state(sampler, x)   # a multistep sampler's history (its first step's: zeros)
    with flame.no_grad():
        for i in it:
            dt = flame.full((1,), float(sigmas[i + 1]) - float(sigmas[i]), dtype=flame.float32, device=x.device)
            run = runs[step_kind(sampler, i, steps), slg is not None and slg.active(i + first, steps + first)]
            if not state:
                x = run(x, timestep(sigmas[i]), timestep(sigmas[i + 1]), dt)
            else:
                c = flame.tensor(step_coefficients(sampler, sigmas, i), dtype=flame.float32, device=x.device)
                z = (step_noise(i, x),) if sampler in STOCHASTIC else ()
                x, *state = run(x, timestep(sigmas[i]), timestep(sigmas[i + 1]), dt, *state, *z, c)
            if callback is not None:
                callback(i, steps)
    if any(r.graph is not None for r in runs.values()):
        x = x.clone()  # a graph's output buffer dies with the graph
    for r in runs.values():
        r.reset()
    return x


def sample(model, context, y, neg_context=None, neg_y=None, height=1024, width=1024, steps=40, cfg=4.5, seed=0, *,
           shift=SHIFT, latents=None, skip_layer_guidance=None, cuda_graph=None, progress=False, sampler="euler",
           scheduler="simple"):
    """Text-to-image latents with an SD3 MMDiT: context (B, L, 4096) and pooled y (B, 2048) of the prompt, and of the
    negative prompt when cfg != 1 -> latents (B, 16, H/8, W/8), float32, in the model's space (decode with
    z / LATENT_SCALE + LATENT_SHIFT before the VAE).

    Defaults are SD3.5 Large's (40 steps, cfg 4.5); see SAMPLING_DEFAULTS for Large Turbo (4 steps, cfg 1) and Medium
    (50 steps, cfg 5, skip-layer guidance). `latents`: the starting noise (B, 16, H/8, W/8) instead of the seeded one.
    sampler: "euler" (the references'), "heun" (diffusers' FlowMatchHeunDiscreteScheduler: 2 model calls a step),
    "dpmpp_2m" (DPM-Solver++(2M) on the flow sigmas, samplers/flow.py: 1 call a step), "dpmpp_2m_sde" (its step
    noise from seed + 1) or "unipc". scheduler: "simple" (the
    shifted sigmas), "karras", "exponential" or "beta" (samplers/flow_schedules.py).
    """
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    if height % 16 or width % 16 or height <= 0 or width <= 0:
        raise ValueError(f"SD3 images need a height and width that are positive multiples of 16, got "
                         f"{height}x{width}")
    if context.ndim != 3 or y.ndim != 2 or context.shape[0] != y.shape[0]:
        raise ValueError(f"sample expects context (B, L, C) and y (B, C) with the same B, got "
                         f"{tuple(context.shape)} and {tuple(y.shape)}")
    B = context.shape[0]
    shape = (B, LATENT_CHANNELS, height // 8, width // 8)
    if latents is None:
        latents = get_noise(B, height, width, seed=seed, device=context.device)
    elif tuple(latents.shape) != shape:
        raise ValueError(f"latents must have shape {shape} for {B} prompts at {height}x{width}, got "
                         f"{tuple(latents.shape)}")
    z = seeded_step_noise(seed, context.device) if sampler in STOCHASTIC else None   # (one stream for the batch)
    return denoise(model, latents, respace(get_sigmas(steps, shift), scheduler), context, y, neg_context, neg_y, cfg,
                   skip_layer_guidance, cuda_graph, progress, sampler=sampler, step_noise=z)


def _model_dtype(model):
    for p in model.parameters():
        return p.dtype
    return flame.float32
