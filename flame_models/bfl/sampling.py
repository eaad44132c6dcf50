"""Flux sampling: latent packing, position ids, the rectified-flow schedule and the Euler / Heun / DPM++ 2M samplers
(samplers/flow.py)."""
import math

import numpy as np

import flame_core as flame
from flame_nn.offload import streamer_of

from ..samplers import noise
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

LATENT_CHANNELS = 16
# the autoencoder's latent statistics: decode z = latent / SCALE + SHIFT
LATENT_SCALE = 0.3611
LATENT_SHIFT = 0.1159


def _check_size(height, width):
    if height % 16 or width % 16 or height <= 0 or width <= 0:
        raise ValueError(f"Flux images need a height and width that are positive multiples of 16, "
                         f"got {height}x{width}")


def pack(z):
    """VAE latents (B, C, H/8, W/8) -> tokens (B, H/16 * W/16, 4C); token r*(W/16)+c, feature ch*4 + ph*2 + pw."""
    if z.ndim != 4 or z.shape[2] % 2 or z.shape[3] % 2:
        raise ValueError(f"pack expects latents (B, C, h, w) with even h and w, got shape {tuple(z.shape)}")
    B, C, h2, w2 = z.shape
    h, w = h2 // 2, w2 // 2
    x = z.reshape(B, C, h, 2, w, 2).permute(0, 2, 4, 1, 3, 5)     # (B, h, w, C, ph, pw)
    return x.reshape(B, h * w, C * 4)


def pack_mask(mask, channels, device):
    """Loss masks (B, 1, h, w) on the latent grid (numpy) -> (B, h/2 * w/2, 4·channels) in `pack`'s layout: each
    latent element's weight is its pixel's."""
    import numpy as np
    B, _, h, w = mask.shape
    full = np.ascontiguousarray(np.broadcast_to(np.asarray(mask, np.float32), (B, channels, h, w)))
    return pack(flame.tensor(full, device=device))


def unpack(x, height, width):
    """Inverse of `pack`: tokens (B, L, 4C) of an image of height x width pixels -> latents (B, C, H/8, W/8)."""
    _check_size(height, width)
    h, w = height // 16, width // 16
    if x.ndim != 3 or x.shape[1] != h * w or x.shape[2] % 4:
        raise ValueError(f"unpack of a {height}x{width} image expects tokens (B, {h * w}, 4C), "
                         f"got shape {tuple(x.shape)}")
    B, _, F = x.shape
    C = F // 4
    z = x.reshape(B, h, w, C, 2, 2).permute(0, 3, 1, 4, 2, 5)      # (B, C, h, ph, w, pw)
    return z.reshape(B, C, 2 * h, 2 * w)


def image_ids(height, width, batch_size=1, *, device=None, dtype=flame.float32):
    """(B, h*w, 3) position ids of the packed image tokens: (0, row, col), row-major."""
    _check_size(height, width)
    h, w = height // 16, width // 16
    rows = flame.arange(h, dtype=dtype, device=device).reshape(h, 1).expand(h, w)
    cols = flame.arange(w, dtype=dtype, device=device).reshape(1, w).expand(h, w)
    ids = flame.stack([flame.zeros(h, w, dtype=dtype, device=device), rows, cols], dim=-1)  # (h, w, 3)
    return ids.reshape(1, h * w, 3).expand(batch_size, h * w, 3).contiguous()


def text_ids(length, batch_size=1, *, device=None, dtype=flame.float32):
    """(B, L_txt, 3) zeros: text tokens are not rotated."""
    return flame.zeros(batch_size, length, 3, dtype=dtype, device=device)


def time_shift(mu, t, sigma=1.0):
    """BFL's resolution-dependent shift of a time t in [0, 1]: e^mu / (e^mu + (1/t - 1)^sigma)."""
    if t <= 0.0:
        return 0.0
    if t >= 1.0:
        return 1.0
    return math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0) ** sigma)


def shift_mu(image_seq_len, base_shift=0.5, max_shift=1.15, x1=256, x2=4096):
    """mu linear in the image token count: base_shift at x1 tokens, max_shift at x2."""
    m = (max_shift - base_shift) / (x2 - x1)
    return m * image_seq_len + (base_shift - m * x1)


def get_schedule(num_steps, image_seq_len, base_shift=0.5, max_shift=1.15, shift=True):
    """num_steps + 1 times from 1 to 0 (python floats); shifted towards 1 for flux-dev, linear for schnell."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, got {num_steps}")
    ts = [1.0 - i / num_steps for i in range(num_steps + 1)]
    if shift:
        mu = shift_mu(image_seq_len, base_shift, max_shift)
        ts = [time_shift(mu, t) for t in ts]
    return ts


def get_noise(batch_size, height, width, *, seed, device=None, dtype=flame.float32):
    """Gaussian latents (B, 16, H/8, W/8) from a seeded generator on `device`: same seed, same noise."""
    _check_size(height, width)
    return noise.get_noise(batch_size, height, width, seed=seed, channels=LATENT_CHANNELS, device=device, dtype=dtype)


def seeded_noise(seeds, height, width, *, device=None):
    """Packed noise (B, h*w, 64) float32 for one image per seed: image i is get_noise(seed=seeds[i]), the same
    whatever the batch it is drawn in."""
    noise = [get_noise(1, height, width, seed=int(s), device=device) for s in seeds]
    return pack(noise[0] if len(noise) == 1 else flame.cat(noise, dim=0))


def start_noise(seeds, latents, height, width, sampler, device):
    """The packed starting noise (B, h*w, 64) float32 of a run: one image per seed (seeded_noise), or `latents`
    given (packed (B, L, 64) or (B, 16, H/8, W/8), a Tensor or an array) -- exactly one of the two; a stochastic
    sampler draws its step noise from the seeds, so it needs them."""
    if (seeds is None) == (latents is None):
        raise ValueError("pass exactly one of seeds= (one per image) and latents=")
    if sampler in STOCHASTIC and seeds is None:
        raise ValueError(f"{sampler} draws its step noise from the images' seeds: pass seeds=, not latents=")
    if latents is None:
        return seeded_noise(seeds, height, width, device=device)
    x = latents if isinstance(latents, flame.Tensor) else flame.tensor(np.asarray(latents))
    x = x.to(device).float()
    return pack(x) if x.ndim == 4 else x


def denoise(model, img, img_ids, txt, txt_ids, y, timesteps, guidance=None, cuda_graph=None, callback=None,
            sampler="euler", step_noise=None, inpaint=None, unguided=None, cfg_start=0):
    """`sampler` ("euler": x <- x + (t_next - t) * v(x, t), "heun", "dpmpp_2m" or "unipc", samplers/flow.py) steps along
    `timesteps`.
    The state stays in float32; the model sees its own dtype. Returns the final packed latents (float32).

    cuda_graph (default: on for cuda tensors): the first step runs eagerly, the second is captured as a CUDA graph
    (flame_core.cuda.graphed) and the rest replay it -- the same kernels on the same buffers, without the host cost
    of issuing ~2000 ops per step. The numbers are the same either way.
    callback(i, n): called after each step i = 1..n (a progress bar; it must not touch the state).
    step_noise(i, x): a stochastic sampler's fresh noise for step i (samplers.flow.step_noise), drawn before the step
    (outside its graph). inpaint: (mask, init, noise) of img's layout: only the mask's region is denoised
    (samplers/inpaint.py; the timesteps then go in as float32, cast to the model's dtype for it).
    unguided, cfg_start: with `model` a true-CFG wrapper (bfl/true_cfg.py), `unguided` the same model without the
    negative prompt, run by the steps before `cfg_start` (0-based; SimpleTuner's validation_no_cfg_until_timestep);
    the sampler's state carries on across the switch."""
    check_flow_sampler(sampler)
    check_step_noise(sampler, step_noise)
    if isinstance(cfg_start, bool) or not isinstance(cfg_start, int) or cfg_start < 0:
        raise ValueError(f"cfg_start is the first step (0-based) of true CFG, an int >= 0; got {cfg_start!r}")
    n = len(timesteps) - 1
    cfg_from = cfg_start if unguided is not None else 0   # the first step that runs `model`
    nets = {guided: net for guided, net in ((False, unguided), (True, model))
            if (cfg_from < n if guided else cfg_from > 0)}   # guided -> the net its steps run
    dtype = _model_dtype(model)
    B = img.shape[0]
    x = img.to(flame.float32)
    g = None if guidance is None else flame.full((B,), float(guidance), dtype=dtype, device=img.device)
    t_dtype = flame.float32 if inpaint is not None else dtype   # (inpaint reads its sigma from the timestep)

    def velocity_of(net):
        def velocity(x, t_vec):
            v = net(img=x.to(dtype), img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=t_vec.to(dtype), y=y,
                    guidance=g)
            return v.to(flame.float32)
        return velocity if inpaint is None else flow_inpaint(velocity, *inpaint, lambda t: t)
    # a streamed inference forward is not capturable: its prefetch window wraps around from call to call
    use_graph = (img.device.type == "cuda" and streamer_of(model) is None) if cuda_graph is None else bool(cuda_graph)
    runs = {(kind, guided): flame.cuda.graphed(flow_step(velocity_of(net), kind), warmup=1,
                                               enabled=use_graph and n > 1)
            for kind in {"euler", sampler} for guided, net in nets.items()}

    def timestep(t):
        return flame.full((B,), float(t), dtype=t_dtype, device=img.device)
    state = multistep_state(sampler, x)   # a multistep sampler's history (its first step's: zeros)
    with flame.no_grad():
        for i, (t_cur, t_next) in enumerate(zip(timesteps[:-1], timesteps[1:]), 1):
            dt = flame.full((1,), t_next - t_cur, dtype=flame.float32, device=img.device)
            run = runs[(step_kind(sampler, i - 1, n), i - 1 >= cfg_from)]
            if not state:
                x = run(x, timestep(t_cur), timestep(t_next), dt)
            else:
                c = flame.tensor(step_coefficients(sampler, timesteps, i - 1), dtype=flame.float32,
                                 device=img.device)
                z = (step_noise(i - 1, x),) if sampler in STOCHASTIC else ()
                x, *state = run(x, timestep(t_cur), timestep(t_next), dt, *state, *z, c)
            if callback is not None:
                callback(i, n)
    if any(r.graph is not None for r in runs.values()):
        x = x.clone()  # a graph's output buffer dies with the graph
    for r in runs.values():
        r.reset()
    return x


def sample(model, txt, y, height=1024, width=1024, steps=None, guidance=None, seed=0, *, txt_ids=None,
           shift=None, cuda_graph=None, callback=None, sampler="euler", scheduler="simple", unguided=None,
           cfg_start=0):
    """Text-to-image latents with a Flux model: T5 hidden states `txt` (B, L, context_in_dim) and CLIP pooled `y`
    (B, vec_in_dim) -> VAE-space latents (B, 16, H/8, W/8), float32, before the `/SCALE + SHIFT` of decoding.

    Defaults follow BFL: flux-dev 50 steps, guidance 2.5, shifted schedule; schnell 4 steps, no guidance, no shift.
    cuda_graph, callback: see `denoise` (graphs are on by default on cuda). sampler: "euler" (BFL's), "heun" or
    "dpmpp_2m"; scheduler: "simple" (BFL's sigmas), "karras", "exponential" or "beta" (samplers/flow_schedules.py).
    unguided, cfg_start: with `model` a true-CFG wrapper, the steps before cfg_start run `unguided` (see `denoise`).
    """
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    dev_model = model.params.guidance_embed
    steps = (50 if dev_model else 4) if steps is None else steps
    guidance = (2.5 if dev_model else None) if guidance is None else guidance
    shift = dev_model if shift is None else shift
    _check_size(height, width)
    if txt.ndim != 3 or y.ndim != 2 or txt.shape[0] != y.shape[0]:
        raise ValueError(f"sample expects txt (B, L, C) and y (B, C) with the same B, got {tuple(txt.shape)} "
                         f"and {tuple(y.shape)}")
    B, L = txt.shape[0], txt.shape[1]
    device, dtype = txt.device, _model_dtype(model)
    noise = get_noise(B, height, width, seed=seed, device=device)
    img = pack(noise)
    img_pos = image_ids(height, width, B, device=device)
    txt_pos = text_ids(L, B, device=device) if txt_ids is None else txt_ids
    timesteps = respace(get_schedule(steps, img.shape[1], shift=shift), scheduler)
    z = seeded_step_noise(seed, device) if sampler in STOCHASTIC else None   # (one stream for the batch)
    x = denoise(model, img, img_pos, txt.to(dtype), txt_pos, y.to(dtype), timesteps, guidance, cuda_graph, callback,
                sampler, z, unguided=unguided, cfg_start=cfg_start)
    return unpack(x, height, width)


def _model_dtype(model):
    for p in model.parameters():
        return p.dtype
    return flame.float32
