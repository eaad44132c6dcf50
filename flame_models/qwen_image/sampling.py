"""Sampling Qwen-Image as QwenImagePipeline does: FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler_config
(dynamic shifting, mu linear in the image tokens from 0.5 at 256 to 0.9 at 8192, the exponential time shift, the last
sigma stretched to 0.02), Euler steps x <- x + (s_next - s) v, and true CFG (only with a negative prompt) followed by
the per-token norm rescale v = c * |v_pos| / |c|. sampler="heun" takes Heun's steps (samplers/flow.py, as the other
flow-matching families) along the same sigmas: two model calls a step (the guided velocity at each), Euler's last;
sampler="dpmpp_2m" DPM-Solver++(2M) on the guided velocity's data prediction, one call a step."""
import math

import numpy as np

import flame_core as flame

from ..bfl.sampling import get_noise, pack, unpack
from ..samplers.flow import (
    STOCHASTIC,
    check_flow_sampler,
    flow_step,
    multistep_state,
    step_coefficients,
    step_kind,
    step_noise,
)
from ..samplers.flow_schedules import check_flow_scheduler, respace
from ..samplers.img2img import flow_init
from ..samplers.inpaint import flow_inpaint

NUM_TRAIN_TIMESTEPS = 1000
BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 8192
BASE_SHIFT, MAX_SHIFT = 0.5, 0.9
SHIFT_TERMINAL = 0.02
DEFAULT_STEPS = 50
DEFAULT_CFG = 4.0           # QwenImagePipeline's true_cfg_scale (used only with a negative prompt)


def shift_mu(image_seq_len):
    """mu for `image_seq_len` packed image tokens (not clamped): 0.6935 at 1024^2 (4096 tokens)."""
    m = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ_LEN - BASE_SEQ_LEN)
    return image_seq_len * m + (BASE_SHIFT - m * BASE_SEQ_LEN)


def sigmas(steps, image_seq_len):
    """The steps + 1 sigmas (float64, ending in 0) the pipeline denoises along."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    s = np.linspace(1.0, 1.0 / steps, steps)
    e = math.exp(shift_mu(image_seq_len))
    s = e / (e + (1.0 / s - 1.0))
    one_minus = 1.0 - s
    if one_minus[-1] > 0:       # one step: the stretch is 0 / 0 (diffusers' sigmas are NaN); the one sigma is 1
        s = 1.0 - one_minus / (one_minus[-1] / (1.0 - SHIFT_TERMINAL))
    return np.concatenate([s, [0.0]])


def guided_velocity(v_pos, v_neg, cfg):
    """c = v_neg + cfg (v_pos - v_neg), rescaled per token to the norm of v_pos (over the last dim), in float32."""
    v_pos, v_neg = v_pos.float(), v_neg.float()
    c = v_neg + cfg * (v_pos - v_neg)
    pos_norm = (v_pos * v_pos).sum(dim=-1, keepdim=True).sqrt()
    c_norm = (c * c).sum(dim=-1, keepdim=True).sqrt()
    return c * (pos_norm / c_norm)


def _rows(cond, rows, device, dtype):
    txt = flame.tensor(np.ascontiguousarray(np.asarray(cond["prompt_embeds"])[rows]), device=device).to(dtype)
    mask = np.asarray(cond["prompt_mask"])[rows] > 0.5
    mask = None if mask.all() else flame.tensor(mask.astype(np.float32), device=device)   # as the pipeline
    return txt, mask


def sample_latents(model, cond, neg=None, *, height, width, steps=DEFAULT_STEPS, cfg=DEFAULT_CFG, seeds=None,
                   latents=None, rows=None, callback=None, sampler="euler", scheduler="simple", init_latents=None,
                   strength=None, mask=None):
    """Model-space latents (B, 16, H/8, W/8) float32 (normalised per channel). cond: {"prompt_embeds" (N, L, J),
    "prompt_mask" (N, L)}, `rows` picking each image's row (default: one per image in order); neg: the negative
    prompt's arrays (one row, or one per prompt) -- CFG runs only when it is given and cfg > 1, as the pipeline.
    Noise: one seed per image (`seeds`: get_noise(seed) drawn on the model's device -- the cpu's generator and
    cuda's are different streams, so one seed gives another picture on each device), or `latents` given, packed
    (B, L, 64) or unpacked (B, 16, H/8, W/8): the same start on any device. sampler: "euler" (the pipeline's),
    "heun", "dpmpp_2m", "dpmpp_2m_sde" (its step noise from seeds[j] + 1) or "unipc"; scheduler: "simple" (the
    pipeline's sigmas), "karras", "exponential" or "beta" (samplers/flow_schedules.py).
    Image-to-image: init_latents, an image's model-space latents (1 or B, 16, H/8, W/8; encode_images), noised to
    the sigma where `strength` (default 0.6, diffusers') of the `steps` are left, then denoised over those
    (samplers/img2img.py); the seeds' noise (or `latents`) is what is added.
    mask (with init_latents): inpainting -- (h, w) at the latents' size, or (1 or B, h, w), in [0, 1], 1 where the
    image is repainted; the rest stays the image (samplers/inpaint.py); strength then defaults to 1."""
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    if (strength is not None or mask is not None) and init_latents is None:
        raise ValueError("strength and mask apply to image-to-image: pass init_latents= too")
    dev = model.img_in.weight.device
    dtype = model.img_in.weight.dtype
    if (seeds is None) == (latents is None):
        raise ValueError("pass exactly one of seeds= (one per image) and latents=")
    if sampler in STOCHASTIC and seeds is None:
        raise ValueError(f"{sampler} draws its step noise from the images' seeds: pass seeds=, not latents=")
    z_noise = step_noise(seeds, dev) if sampler in STOCHASTIC else None
    if latents is None:
        noise = [get_noise(1, height, width, seed=int(s), device=dev) for s in seeds]
        x = pack(noise[0] if len(noise) == 1 else flame.cat(noise, dim=0))              # (B, L, 64) float32
    else:
        x = latents if isinstance(latents, flame.Tensor) else flame.tensor(np.asarray(latents))
        x = x.to(dev).float()
        x = pack(x) if x.ndim == 4 else x
        if x.ndim != 3 or x.shape[1] != (height // 16) * (width // 16):
            raise ValueError(f"latents {tuple(x.shape)} do not fit a {height}x{width} image: (B, 16, {height // 8}, "
                             f"{width // 8}) or packed (B, {(height // 16) * (width // 16)}, 64)")
    B, n_img = x.shape[:2]
    rows = list(range(B)) if rows is None else list(rows)
    if len(rows) != B:
        raise ValueError(f"{len(rows)} prompt rows for {B} images")
    txt, txt_mask = _rows(cond, rows, dev, dtype)
    guided = neg is not None and cfg is not None and cfg > 1.0
    if guided:
        n = np.asarray(neg["prompt_embeds"]).shape[0]
        neg_txt, neg_mask = _rows(neg, [r if n > 1 else 0 for r in rows], dev, dtype)
    shapes = [[(1, height // 16, width // 16)]] * B
    sig = respace(sigmas(steps, n_img), scheduler)
    inpaint = None
    if init_latents is not None:
        sig, x, inpaint = flow_init(sig, x, init_latents, strength, mask, (B, 16, height // 8, width // 8), dev, pack)
    steps = len(sig) - 1

    def velocity(x, t):
        v = model(x.to(dtype), txt, txt_mask, t, shapes)
        if guided:
            v = guided_velocity(v, model(x.to(dtype), neg_txt, neg_mask, t, shapes), cfg)
        return v.float()

    def timestep(s):   # the pipeline's: sigma * 1000 rounded to float32, over 1000
        return flame.full((B,), float(np.float32(s * NUM_TRAIN_TIMESTEPS)) / NUM_TRAIN_TIMESTEPS, device=dev)
    if inpaint is not None:
        velocity = flow_inpaint(velocity, *inpaint, lambda t: t)
    runs = {kind: flow_step(velocity, kind) for kind in {"euler", sampler}}
    state = multistep_state(sampler, x)   # a multistep sampler's history (its first step's: zeros)
    with flame.no_grad():
        for i in range(steps):
            run = runs[step_kind(sampler, i, steps)]
            if not state:
                x = run(x, timestep(sig[i]), timestep(sig[i + 1]), sig[i + 1] - sig[i])
            else:
                c = flame.tensor(step_coefficients(sampler, sig, i), dtype=flame.float32, device=dev)
                z = (z_noise(i, x),) if sampler in STOCHASTIC else ()
                x, *state = run(x, timestep(sig[i]), timestep(sig[i + 1]), sig[i + 1] - sig[i], *state, *z, c)
            if callback is not None:
                callback(i + 1, steps)
    return unpack(x, height, width)
