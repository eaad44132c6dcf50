"""Chroma's sampling stages: the transformer loaded (LoRAs applied or kept beside fp8 / streamed blocks), the Euler
sampler on the shifted flow-matching schedule with true classifier-free guidance -- the prompt's and the negative
prompt's passes (each with its own padding mask) in one batch, v = v_neg + cfg (v_pos - v_neg) -- and the Flux VAE.

    files = find_chroma_files("Chroma1-HD/")
    with load_text_encoders(files, device="cuda") as enc:
        cond = enc.encode(["a photo of a cat"]); neg = enc.encode([""])
    model = load_transformer(files, device="cuda")
    latents = sample_latents(model, cond, neg, height=1024, width=1024, steps=26, cfg=4.0, seeds=[42])
"""
import numpy as np

import flame_core as flame
import flame_nn

from ..bfl.sampling import LATENT_CHANNELS, denoise, get_schedule, image_ids, pack, seeded_noise, text_ids, unpack
from ..bfl.vae import decode_latents, encode_images, load_vae_for_flux  # noqa: F401
from ..pipeline import check_loras as _check_loras
from ..pipeline import load_for_sampling
from ..samplers.flow import STOCHASTIC, check_flow_sampler, step_noise
from ..samplers.flow_schedules import check_flow_scheduler, respace
from ..samplers.img2img import flow_init
from .components import ChromaFiles, ChromaFilesError, find_chroma_files
from .loading import load_chroma
from .model import ATTN_PADDING

STACKS = ("double_blocks", "single_blocks")


def check_loras(loras, params):
    from .model import Chroma
    return _check_loras(loras, params, model_class=Chroma, error=ChromaFilesError)


def load_transformer(files, *, dtype=flame.bfloat16, device=None, loras=(), fp8=False, stream=False, slots=2):
    """The Chroma transformer of `files` with LoRAs, ready for sampling (fp8 storage, streamed blocks)."""
    files = files if isinstance(files, ChromaFiles) else find_chroma_files(files)
    loras = check_loras(loras, files.params)
    return load_for_sampling(lambda dev: load_chroma(files.transformer, dtype=dtype, device=dev), files.transformer,
                             loras, STACKS, device, fp8=fp8, stream=stream, slots=slots, error=ChromaFilesError)


def _host_rows(cond, rows):
    """(prompt_embeds (B, L, D), prompt_mask (B, L)) float32 host arrays of the prompt rows `rows` of a
    conditioning dict."""
    out = []
    for key in ("prompt_embeds", "prompt_mask"):
        t = cond[key]
        arr = t.float().cpu().numpy() if isinstance(t, flame.Tensor) else np.asarray(t, np.float32)
        out.append(arr[list(rows)])
    return tuple(out)


def _device_rows(embeds, mask, dev, dtype):
    return (flame.tensor(np.ascontiguousarray(embeds), device=dev).to(dtype),
            None if mask is None else flame.tensor(np.ascontiguousarray(mask), device=dev))


def _rows(cond, rows, dev, dtype):
    """(prompt_embeds (B, L, D), prompt_mask (B, L)) device tensors of the prompt rows `rows`."""
    return _device_rows(*_host_rows(cond, rows), dev, dtype)


def cut_text(*pairs):
    """(embeds (B, L, D), mask (B, L)) pairs cut after the longest prefix any row attends (its real tokens and the
    first padding token, Chroma.forward's rule): the tokens after it are masked from every attention, so the
    images are the same with fewer tokens (as data/text_trim.py cuts a training run's text). The masks become None
    when every row attends all that is left."""
    L = pairs[0][1].shape[1]
    prefixes = [min(L, int(row.sum()) + ATTN_PADDING) for _, m in pairs for row in m]
    n = max(prefixes)
    keep = any(p != n for p in prefixes)
    return [(e[:, :n], m[:, :n] if keep else None) for e, m in pairs]


class Guided(flame_nn.Module):
    """A Chroma called like a Flux by the Euler sampler (flame_models.bfl.sampling.denoise): each call runs the
    prompt's text (with its mask) and, with cfg > 1, the negative prompt's in the same batch, and returns
    v_neg + cfg (v_pos - v_neg)."""

    def __init__(self, model, mask, neg=None, neg_mask=None, cfg=1.0):
        super().__init__()
        self.model, self.params = model, model.params
        self.mask, self.neg, self.neg_mask, self.cfg = mask, neg, neg_mask, float(cfg)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y=None, guidance=None):
        if self.neg is None:
            return self.model(img, img_ids, txt, txt_ids, timesteps, txt_mask=self.mask)
        two = lambda a, b: flame.cat([a, b], dim=0)  # noqa: E731
        mask = None if self.mask is None else two(self.mask, self.neg_mask)   # (cut_text drops both or neither)
        v = self.model(two(img, img), two(img_ids, img_ids), two(txt, self.neg), two(txt_ids, txt_ids),
                       two(timesteps, timesteps), txt_mask=mask)
        B = img.shape[0]
        v_pos, v_neg = v[:B], v[B:]
        return v_neg + self.cfg * (v_pos - v_neg)


def sample_latents(model, cond, neg=None, *, height, width, steps, cfg=1.0, seeds, rows=None, callback=None,
                   cuda_graph=None, sampler="euler", scheduler="simple", init_latents=None, strength=None,
                   mask=None):
    """Model-space latents (B, 16, H/8, W/8) float32: Euler (or Heun / DPM++ 2M: sampler) on the flow-matching schedule
    shifted for the image's token count (mu 0.5 at 256 tokens to 1.15 at 4096, as ChromaPipeline) and respaced by
    `scheduler` (samplers/flow_schedules.py), with classifier-free guidance `cfg` against `neg` (its prompt_embeds /
    prompt_mask; one row, or one per prompt) when cfg > 1. cond: {"prompt_embeds", "prompt_mask"} rows, `rows` picking
    each image's; seeds: one per image. Image-to-image: init_latents, an image's model-space latents (1 or B, 16,
    H/8, W/8; encode_images), noised to the sigma where `strength` (default 0.6) of the `steps` are left, then
    denoised over those (samplers/img2img.py).
    mask (with init_latents): inpainting -- (h, w) at the latents' size, or (1 or B, h, w), in [0, 1], 1 where the
    image is repainted; the rest stays the image (samplers/inpaint.py); strength then defaults to 1."""
    check_flow_sampler(sampler)
    check_flow_scheduler(scheduler)
    if (strength is not None or mask is not None) and init_latents is None:
        raise ValueError("strength and mask apply to image-to-image: pass init_latents= too")
    dev = model.img_in.weight.device
    dtype = model.img_in.weight.dtype
    x = seeded_noise(seeds, height, width, device=dev)
    B = x.shape[0]
    rows = list(range(B)) if rows is None else list(rows)
    pos = _host_rows(cond, rows)
    guided = cfg is not None and cfg > 1.0 and neg is not None
    if guided:
        n = np.asarray(neg["prompt_mask"]).shape[0]
        neg_rows = _host_rows(neg, [r if n > 1 else 0 for r in rows])
        if neg_rows[0].shape[1] != pos[0].shape[1]:
            raise ValueError(f"the negative prompt has {neg_rows[0].shape[1]} tokens, the prompt {pos[0].shape[1]}")
        pos, neg_rows = cut_text(pos, neg_rows)
        txt, txt_mask = _device_rows(*pos, dev, dtype)
        net = Guided(model, txt_mask, *_device_rows(*neg_rows, dev, dtype), cfg)
    else:
        (pos,) = cut_text(pos)
        txt, txt_mask = _device_rows(*pos, dev, dtype)
        net = Guided(model, txt_mask)
    timesteps = respace(get_schedule(steps, x.shape[1], shift=True), scheduler)
    inpaint = None
    if init_latents is not None:
        timesteps, x, inpaint = flow_init(timesteps, x, init_latents, strength, mask,
                                          (B, LATENT_CHANNELS, height // 8, width // 8), dev, pack)
    out = denoise(net, x, image_ids(height, width, B, device=dev), txt, text_ids(txt.shape[1], B, device=dev),
                  None, timesteps, None, cuda_graph, callback, sampler,
                  step_noise(seeds, dev) if sampler in STOCHASTIC else None, inpaint=inpaint)
    return unpack(out, height, width)


def fit_transformer(model, cond, max_gpu_memory, *, height, width, batch_size=1, guided=True):
    """The streamed blocks resident so that one (guided: doubled-batch) step fits `max_gpu_memory` (auto_fit)."""
    dev = model.streamer.device
    dtype = model.img_in.weight.dtype
    n = 2 * batch_size if guided else batch_size
    txt, mask = _rows(cond, [0] * n, dev, dtype)
    x = pack(flame.zeros(n, LATENT_CHANNELS, height // 8, width // 8, device=dev)).to(dtype)
    ids, tids = image_ids(height, width, n, device=dev), text_ids(txt.shape[1], n, device=dev)
    t = flame.full((n,), 1.0, dtype=dtype, device=dev)

    def step():
        with flame.no_grad():
            model(x, ids, txt, tids, t, txt_mask=mask)
    return model.streamer.auto_fit(max_gpu_memory, step)
