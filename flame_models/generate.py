"""Text-to-image with Flux, SD3 / SD3.5 and SDXL: `python -m flame_models.generate` and the `generate(...)` function it
wraps. The model's family comes from its files (a diffusers folder's model_index.json, else the transformer / UNet
header; flame_models.registry.detect_family) or --arch, and the family's generate part runs: flame_models/flux/
generate.py (embedded guidance), sd3/generate.py (CFG with a negative prompt, skip-layer guidance), sdxl/generate.py
(CFG, samplers, size conditioning). This module holds what they share: the checks of common arguments, the stages
(run_stages), the PNG files, and the command line.

A family's generate part provides
    FILES            its Files class (a model argument already found)
    OPTIONS          {keyword: words or None}: generate()'s keywords that only it (and maybe other families) takes;
                     words name the option when another family refuses it (None: "an <owners> option")
    NOTES            {keyword of another family: what this family does instead} (optional; in the refusal)
    generate(model, prompts, *, vae, clip_l, t5, tokenizer, loras, width, height, steps, seed, num_images,
             batch_size, output, device, dtype, fp8, max_gpu_memory, progress, stats, log, **its OPTIONS)

    python -m flame_models.generate --model FLUX.1-dev/ --prompt "a photo of a cat" --lora my_lora.safetensors:0.8 \\
        --width 1024 --height 1024 --steps 28 --guidance 3.5 --seed 42 --output out/
    python -m flame_models.generate --model flux1-dev.safetensors --vae ae.safetensors --clip-l clip_l.safetensors \\
        --t5 t5xxl_fp8_e4m3fn.safetensors --prompts-file prompts.txt --max-gpu-memory 12GiB --fp8
    python -m flame_models.generate --model sd3.5_large.safetensors --prompt "a cat" --negative-prompt "blurry"
    python -m flame_models.generate --model sd_xl_base_1.0.safetensors --prompt "a cat" --sampler dpmpp_2m --karras \\
        --cfg 7 --steps 30
    python -m flame_models.generate --model FLUX.1-dev/ --init-image sketch.png --strength 0.65 --prompt "a watercolour"

Image-to-image (--init-image, --strength; Flux, SD3, SDXL, Chroma, Qwen-Image): the image is read and scaled before
anything is loaded (`InitImage`), encoded by the family's VAE in the text encoders' stage, then noised to where
`strength` of the steps are left and denoised over those (flame_models/samplers/img2img.py).

Stages run one after the other, each freed before the next, so the peak is the largest stage's: the text encoders
(every prompt encoded once), the transformer or UNet (LoRAs merged into the weights, or kept beside fp8 / streamed
weights), the VAE. Under --max-gpu-memory the denoiser's (and T5's) blocks live in pinned host memory and stream
through the GPU; as many as fit the budget stay resident (measured, flame_nn.offload.auto_fit). Every input is checked
before anything is loaded: a bad one ends the command with one message naming the file, exit status 2.

Each PNG is written atomically and carries the parameters: an A1111-style `parameters` text chunk (prompt, steps,
guidance, seed, size, model, LoRAs with weights) and the same as JSON under `flame`.
"""
import argparse
import functools
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

import flame_core as flame
from flame_core import memory
from flame_core.errors import FlameError
from flame_core.io import atomic_write
from flame_core.memory.stats import fmt_bytes, parse_budget

from .numbers import as_float
from .pipeline import free_model, to_pil
from .samplers import SAMPLERS
from .samplers.flow import FLOW_SAMPLERS
from .samplers.flow_schedules import FLOW_SCHEDULERS
from .training.limits import image_problem

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32",
          "float32": "float32"}


class GenerateError(FlameError, ValueError):
    """A bad argument to generate (the message names it)."""


# ----------------------------------------------------------------------------- checks before any work
def flow_sampler(sampler, family):
    """--sampler of a flow-matching family: "euler" (None: the default), "heun", "dpmpp_2m", "dpmpp_2m_sde" or "unipc"
    (samplers/flow.py)."""
    sampler = "euler" if sampler is None else sampler
    if sampler not in FLOW_SAMPLERS:
        raise GenerateError(f"--sampler {sampler}: {family} samples with {', '.join(FLOW_SAMPLERS[:-1])} or "
                            f"{FLOW_SAMPLERS[-1]} (the others are SDXL's)")
    return sampler


def flow_scheduler(scheduler, family):
    """--scheduler of a flow-matching family: "simple" (None: the default, the family's own sigmas), "karras",
    "exponential" or "beta" (samplers/flow_schedules.py)."""
    scheduler = "simple" if scheduler is None else scheduler
    if scheduler not in FLOW_SCHEDULERS:
        raise GenerateError(f"--scheduler {scheduler}: {family} samples with {', '.join(FLOW_SCHEDULERS[:-1])} or "
                            f"{FLOW_SCHEDULERS[-1]}")
    return scheduler


def _check_args(prompts, width, height, steps, num_images, batch_size, seed, multiple=16, family="Flux"):
    if not prompts:
        raise GenerateError("no prompt: pass --prompt (repeatable) or --prompts-file")
    for name, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % multiple:
            raise GenerateError(f"--{name} {v}: {family} needs a positive multiple of {multiple}")
    for name, v in (("steps", steps), ("num-images", num_images), ("batch-size", batch_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise GenerateError(f"--{name} {v}: must be a whole number >= 1")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise GenerateError(f"--seed {seed}: must be a whole number in [0, 2^63)")


# ----------------------------------------------------------------------------- image-to-image (--init-image)
def init_size(init_image, width, height, multiple=16):
    """(width, height) of an image-to-image run: those given; a missing one from the init image's size (its header
    only, the pixel limit checked), floored to `multiple` (the family part's INIT_MULTIPLE) -- both missing: the
    image's size, one: the other side at the image's aspect ratio. Without an init image a missing one is 1024."""
    if init_image is None or (width is not None and height is not None):
        return (1024 if width is None else width), (1024 if height is None else height)
    if isinstance(init_image, (list, tuple)) and init_image:   # one per job: the first one's size
        init_image = init_image[0]
    from .data.errors import DataError
    from .data.images import is_image, open_image, read_bytes
    try:
        if is_image(init_image):
            iw, ih = init_image.size
        else:
            with open_image(read_bytes(init_image), init_image) as im:
                iw, ih = im.size
    except (DataError, OSError) as e:
        raise GenerateError(f"--init-image {init_image}: {e}") from None
    if width is None and height is None:
        width, height = iw, ih
    elif width is None:
        width = round(iw * height / ih)
    else:
        height = round(ih * width / iw)
    return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)


def read_init_image(path, width, height):
    """(1, 3, height, width) float32 in [-1, 1]: the image at `path` -- or a PIL image given -- (decoded with its
    size checked first, EXIF orientation applied, alpha on white) scaled to cover width x height and centre-cropped
    (LANCZOS)."""
    from PIL import Image, ImageOps

    from .data.errors import DataError
    from .data.images import as_rgb, image_array, is_image, load_image
    try:
        im = as_rgb(path, "init_image") if is_image(path) else load_image(path)
    except DataError as e:
        raise GenerateError(f"--init-image {path}: {e}") from None
    im = ImageOps.fit(im, (width, height), Image.LANCZOS)
    return image_array(im)[None]


def encode_init_image(pixels, load_vae, encode, dev, log):
    """The init images' model-space latents (N, C, h, w) as a host array, of pixels (N, 3, H, W): the family's VAE
    loaded once (load_vae()), `encode(vae, images)` run one image at a time -- in tiles when a whole image does not
    fit the memory budget, as decoding does --, the VAE freed."""
    t0 = time.perf_counter()
    vae = load_vae()
    try:
        out = []
        for k in range(pixels.shape[0]):
            x = flame.tensor(pixels[k:k + 1], device=dev).to(next(vae.parameters()).dtype)
            with flame.no_grad():
                z = _tiled_if_short(encode, vae, x, log, "init image: the whole image does not fit the budget; "
                                                         "encoding in tiles")
            out.append(z.float().cpu().numpy())
        out = np.concatenate(out)
    finally:
        del vae
        memory.empty_cache(dev)
    log(f"init image: encoded to latents {tuple(out.shape)} in {time.perf_counter() - t0:.1f} s")
    return out


def check_true_cfg(true_cfg, negative_prompt):
    """(guided, the negative prompt) of Flux's / Kontext's true classifier-free guidance, checked before anything is
    loaded: a scale > 1 guides against negative_prompt (default "": diffusers needs one given and would ignore the
    scale without it); a negative prompt without a scale is refused rather than ignored."""
    scale = None if true_cfg is None else as_float(true_cfg)
    if scale is not None and not (math.isfinite(scale) and scale >= 1.0):
        raise GenerateError(f"--true-cfg {true_cfg!r}: a finite number >= 1 (1: off)")
    guided = scale is not None and scale > 1.0
    if negative_prompt is not None and not guided:
        raise GenerateError("--negative-prompt: Flux reads it under true classifier-free guidance; pass --true-cfg > 1 "
                            "too")
    return guided, (("" if negative_prompt is None else negative_prompt) if guided else None)


def check_true_cfg_start(true_cfg_start, guided):
    """The first step (0-based) of true classifier-free guidance, checked before anything is loaded: an int >= 0
    (default 0: every step); the steps before it run the prompt alone (SimpleTuner's validation_no_cfg_until_timestep).
    Refused without a true-CFG scale > 1 rather than ignored."""
    if true_cfg_start is None:
        return 0
    if isinstance(true_cfg_start, bool) or not isinstance(true_cfg_start, int) or true_cfg_start < 0:
        raise GenerateError(f"--true-cfg-start {true_cfg_start!r}: the first step of true CFG, an integer >= 0")
    if not guided:
        raise GenerateError("--true-cfg-start: the first step of true classifier-free guidance; pass --true-cfg > 1 "
                            "too")
    return true_cfg_start


def check_prompt_weights(prompts, negative_prompt, prompt_weights, log):
    """Before anything is loaded: with prompt_weights, every prompt's weights parsed (a bad one is a GenerateError);
    without, a note when a prompt holds "(text:weight)" weights (read as text then)."""
    from .conditioning import prompt_weights as PW
    texts = list(prompts) + ([negative_prompt] if isinstance(negative_prompt, str) else [])
    try:
        for text in texts:
            if prompt_weights:
                PW.parse(text)
            elif PW.WEIGHT_PATTERN.search(text):
                log(f"note: {text[:60]!r} holds \"(text:weight)\" weights, read as text; --prompt-weights applies "
                    f"them (ComfyUI's syntax)")
                return bool(prompt_weights)
    except ValueError as e:
        raise GenerateError(f"--prompt-weights: {e}") from None
    return bool(prompt_weights)


def _source(src):
    """How the PNG's parameters name an init image or mask: its path, or "<image WxH>" for one given in memory."""
    from .data.images import is_image
    return f"<image {src.width}x{src.height}>" if is_image(src) else str(src)


HIRES_STRENGTH = 0.5   # the hires pass's default denoising strength (ComfyUI's usual; A1111's default is 0.7)

# the image-to-image options of every family but Kontext (its generate part's OPTIONS take them in; InitImage's
# keyword arguments)
IMAGE_OPTIONS = {"init_image": None, "strength": None, "mask": None, "paste_back": None, "mask_grow": None,
                 "mask_blur": None}


class InitImage:
    """A family generate part's image-to-image input: made before anything is loaded (the strength checked, the
    image read and scaled: bad input fails first; a path or a PIL image), encoded in the encode stage (`encode`),
    handed to the sampler (`sample_kwargs`) and recorded in the PNGs (`info`, `fields`). init_image None: a
    text-to-image run (every method then adds nothing; a strength or mask given is refused, it would be ignored).
    rounding: "flow" or "sdxl" (whose pipeline rounds the steps run down: samplers/img2img.py). mask: inpainting --
    an image (a path or a PIL image), white where the init image is repainted, grown by mask_grow pixels and blurred
    by mask_blur (at its own size), scaled and cropped as the image is, then averaged to the latents' size
    (samplers/inpaint.read_mask, pool_mask); the strength then defaults to 1."""

    def __init__(self, width, height, *, default, rounding="flow", init_image=None, strength=None, mask=None,
                 paste_back=False, mask_grow=None, mask_blur=None, hires=None):
        from .samplers.img2img import check_strength
        path = init_image
        # a list: one init image per job (jobs in generate's order: prompt by prompt, num_images each), the hires
        # pass's (generate(hires_scale=...); `hires` then describes it for the PNGs)
        self.per_job = isinstance(path, (list, tuple))
        if self.per_job and (not path or mask is not None):
            raise GenerateError("init_image: a list holds one image per job, at least one, and takes no mask")
        self.hires, self.steps = hires, None
        self.path, self.rounding, self.latents, self.mask_path = path, rounding, None, mask
        self.paste, self.pixel_mask = bool(paste_back), None
        self.grow, self.blur = mask_grow, mask_blur
        for name, given in (("paste-back", paste_back or None), ("mask-grow", mask_grow), ("mask-blur", mask_blur)):
            if given is not None and mask is None:
                raise GenerateError(f"--{name}: applies to inpainting; pass --init-image and --mask too")
        if path is None:
            for name, given in (("strength", strength), ("mask", mask)):
                if given is not None:
                    raise GenerateError(f"--{name}: applies to image-to-image; pass --init-image too")
            self.strength, self.pixels, self.mask = None, None, None
            return
        try:
            self.strength = check_strength((default if mask is None else 1.0) if strength is None else strength)
        except ValueError as e:
            raise GenerateError(f"--strength: {e}") from None
        self.mask = None
        if mask is not None:
            from .samplers.inpaint import check_blur, check_grow
            try:
                self.grow = check_grow(0 if mask_grow is None else mask_grow)
            except ValueError as e:
                raise GenerateError(f"--mask-grow: {e}") from None
            try:
                self.blur = check_blur(0 if mask_blur is None else mask_blur)
            except ValueError as e:
                raise GenerateError(f"--mask-blur: {e}") from None
        self.pixels = (np.concatenate([read_init_image(p, width, height) for p in path]) if self.per_job
                       else read_init_image(path, width, height))
        if mask is not None:
            from .data.errors import DataError
            from .samplers.inpaint import pool_mask, read_mask
            try:
                pixel_mask = read_mask(mask, width, height, grow=self.grow, blur=self.blur)
            except DataError as e:
                raise GenerateError(f"--mask {mask}: {e}") from None
            self.mask = pool_mask(pixel_mask)
            self.pixel_mask = pixel_mask if self.paste else None

    def steps_run(self, steps):
        """How many of `steps` run (all in text-to-image); GenerateError when the strength leaves none."""
        self.steps = steps   # (the family's, its default resolved: a hires pass's PNG fields name them)
        if self.path is None:
            return steps
        from .samplers.img2img import skipped_steps
        try:
            return steps - skipped_steps(steps, self.strength, self.rounding)
        except ValueError as e:
            raise GenerateError(f"--strength: {e}") from None

    def encode(self, load_vae, encode, dev, log):
        """Encode the image (encode_init_image) when there is one."""
        if self.pixels is not None:
            self.latents = encode_init_image(self.pixels, load_vae, encode, dev, log)

    def finish(self, images):
        """The generated PIL images; with paste_back, the init image's own pixels put back where the mask keeps them
        (blended by its grey levels), so that outside the mask the picture is the original, not its VAE round
        trip."""
        if not self.paste:
            return images
        from PIL import Image
        orig = np.round((self.pixels[0].transpose(1, 2, 0) + 1.0) * 127.5)
        m = self.pixel_mask[..., None]
        out = []
        for im in images:
            a = np.asarray(im.convert("RGB"), dtype=np.float32)
            out.append(Image.fromarray(np.clip(np.round(a * m + orig * (1.0 - m)), 0, 255).astype(np.uint8), "RGB"))
        return out

    def check_jobs(self, n):
        """GenerateError unless a list of init images has one image per job (`n` jobs)."""
        if self.per_job and len(self.path) != n:
            raise GenerateError(f"init_image: {len(self.path)} images for {n} jobs (prompts x num_images): one each")

    def sample_kwargs(self, jobs=None):
        """The sampler's image-to-image arguments for a batch of `jobs` (their indices in the run's job list)."""
        if self.path is None:
            return {}
        latents = self.latents[list(jobs)] if self.per_job else self.latents
        return {"init_latents": latents, "strength": self.strength,
                **({} if self.mask is None else {"mask": self.mask})}

    def info(self):
        if self.path is None:
            return {}
        if self.hires is not None:
            return {"hires": dict(self.hires, steps=self.steps, strength=self.strength)}
        source = f"<{len(self.path)} images>" if self.per_job else _source(self.path)
        return {"init_image": source, "strength": self.strength,
                **({} if self.mask_path is None else {"mask": _source(self.mask_path), "paste_back": self.paste,
                                                       "mask_grow": self.grow, "mask_blur": self.blur})}

    def fields(self):
        """The A1111 parameters fields of the strength, the mask blur and a hires pass (its steps, and the first
        pass's size: "Size" is this pass's)."""
        if self.path is None:
            return []
        blur = [("Mask blur", f"{self.blur:g}")] if self.blur else []
        hires = [] if self.hires is None else [("Hires steps", self.steps),
                                               ("Hires base size", "{}x{}".format(*self.hires["base_size"]))]
        return [("Denoising strength", f"{self.strength:g}")] + blur + hires


def _check_size(width, height, batch_size, dev, budget):
    """GenerateError for an image larger than the stated limit or than the device's memory (before any loading)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (width, height)):
        return  # the family's _check_args names a bad value
    batch = batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0 else 1
    problem = image_problem(width, height, batch, dev, budget)
    if problem:
        raise GenerateError(problem)


def _check_output(output):
    if output is None:
        return None
    output = os.fspath(output)
    if os.path.exists(output) and not os.path.isdir(output):
        raise GenerateError(f"--output {output}: exists and is not a folder")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as e:
        raise GenerateError(f"--output {output}: cannot create the folder ({e.strerror})") from None
    if not os.access(output, os.W_OK):
        raise GenerateError(f"--output {output}: the folder is not writable")
    return output


def _device(device):
    if device is None:
        return flame.device("cuda" if flame.cuda_is_available() else "cpu")
    dev = flame.device(device)
    if dev.type == "cuda" and not flame.cuda_is_available():
        raise GenerateError(f"--device {device}: no CUDA GPU is available here")
    return dev


def _dtype(dtype, dev):
    if dtype is None:  # bfloat16 matmuls have no fast path on the cpu
        return flame.bfloat16 if dev.type == "cuda" else flame.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise GenerateError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    return flame.dtypes.dtype(dtype)


def _budget(max_gpu_memory):
    """Bytes of --max-gpu-memory (flame_core.memory.stats.parse_budget: a bare number is GiB, as in the trainer's
    config)."""
    try:
        return parse_budget(max_gpu_memory, "--max-gpu-memory")
    except ValueError as e:
        raise GenerateError(str(e)) from None


# ----------------------------------------------------------------------------- the text stage
def host_arrays(tensors):
    """{name: float32 NumPy array} of {name: Tensor}: a stage's output, off the device."""
    return {k: v.float().cpu().numpy() for k, v in tensors.items()}


def encode_prompts(enc, prompts, budget, log):
    """The conditioning of `prompts` as host arrays through the open text encoders `enc` (a family's bundle: encode,
    and t5 when it has one); under a budget T5's streamed blocks are fitted first on one prompt (logged)."""
    if budget is not None and getattr(enc, "t5", None) is not None:
        log("T5 " + str(enc.t5.streamer.auto_fit(budget, lambda: enc.encode(prompts[:1]))))
    return host_arrays(enc.encode(prompts))


# ----------------------------------------------------------------------------- PNG files
def parameters_text(prompt, negative, fields):
    """The A1111-style `parameters` text: the prompt, the negative prompt (when there is one), then 'Key: value'
    pairs (those whose value is None left out)."""
    text = prompt + ("" if negative is None else f"\nNegative prompt: {negative}")
    return text + "\n" + ", ".join(f"{k}: {v}" for k, v in fields if v is not None)


def lora_field(loras):
    """The `Loras` field of the parameters text: [("Loras", "name:weight, ...")], or [] without LoRAs."""
    return [("Loras", ", ".join(f"{os.path.basename(p)}:{w:g}" for p, w in loras))] if loras else []


def save_png(image, path, info):
    """Write `image` to `path` atomically (temporary file, fsync, rename) with text chunks {key: str}."""
    from PIL.PngImagePlugin import PngInfo
    meta = PngInfo()
    for k, v in info.items():
        meta.add_text(k, v)
    with atomic_write(path) as f:
        image.save(f, format="PNG", pnginfo=meta)
    return path


def _next_index(folder):
    n = -1
    for name in os.listdir(folder):
        head = name.split("-", 1)[0]
        if name.endswith(".png") and head.isdigit():
            n = max(n, int(head))
    return n + 1


# ----------------------------------------------------------------------------- the stages
@dataclass
class Stages:
    """What a family's generate part hands run_stages (closures over its files and settings).

    encode(unique prompts)           the conditioning, as host arrays (the encoders loaded and freed inside)
    denoiser                         the denoising stage's name ("transformer", "unet")
    load()                           the denoiser on the device, LoRAs applied
    fit(net, cond, batch_size)       under a memory budget: the streamed blocks fitted to it; a report to log
    sample(net, cond, seeds, rows, callback, jobs)   the model-space latents (B, C, h, w) of one batch (jobs: the
                                     batch's indices in the job list)
    load_vae(), decode(vae, z)       the VAE, and model-space latents (1, C, h, w) -> images in [-1, 1]
    """
    encode: Callable
    denoiser: str
    load: Callable
    fit: Callable
    sample: Callable
    load_vae: Callable
    decode: Callable


class _Stage:
    """Times a stage and records its device peak (FLAME's pool) into stats[name]."""

    def __init__(self, name, dev, stats, log):
        self.name, self.dev, self.stats, self.log = name, dev, stats, log

    def __enter__(self):
        memory.reset_peak_memory_stats(self.dev)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.t0
        peak = memory.max_memory_reserved(self.dev)
        self.stats[self.name] = {"seconds": round(seconds, 3), "peak_bytes": int(peak)}
        if exc[0] is None:
            self.log(f"{self.name}: {seconds:.1f} s, peak {fmt_bytes(peak)} on {self.dev}")


def _outside_pool(dev):
    """Device bytes in use outside FLAME's pool (the CUDA context, libraries' code and workspaces, other users of
    the GPU): a budget counts them, as flame_nn.offload.auto_fit does. 0 on the cpu."""
    if dev.type != "cuda":
        return 0
    free, total = flame.cuda.mem_get_info(dev)
    return max(0, total - free - memory.memory_reserved(dev))


def _limited(dev, budget):
    """Set the pool's limit to what `budget` leaves it (None: leave the limit alone); returns the previous limit.
    GenerateError when the device already holds the whole budget outside the pool."""
    prev = memory.get_memory_limit(dev)
    if budget is not None:
        outside = _outside_pool(dev)
        if outside >= budget:
            raise GenerateError(f"--max-gpu-memory {fmt_bytes(budget)}: {dev} already holds {fmt_bytes(outside)} "
                                f"outside FLAME's pool (CUDA context, libraries, other processes), which the budget "
                                f"counts; raise it")
        memory.set_memory_limit(budget - outside, dev)
    return prev


def generate(model, prompts, *, vae=None, clip_l=None, t5=None, tokenizer=None, loras=(), width=None, height=None,
             steps=None, guidance=None, seed=None, num_images=1, batch_size=1, output=None, device=None, dtype=None,
             fp8=False, max_gpu_memory=None, max_length=None, progress=True, stats=None, log=None, arch=None,
             hires_scale=None, hires_strength=None, hires_steps=None, **options):
    """Text-to-image: a list of PIL images, prompt by prompt, `num_images` each (image j of a prompt starts from
    seed + j, so one seed gives the same picture whatever the batch: exactly on the cpu; on cuda up to the rounding
    of GEMMs, whose kernels cuBLAS picks by shape, so more in bfloat16 than in float32). The family comes from the
    files (registry.detect_family), a family's Files object, or `arch` ("flux" | "sd3" | "sdxl"); its generate part
    (flame_models/<family>/generate.py) runs with the family's own `options` -- Flux: guidance, max_length, sampler,
    scheduler, prompt_weights, true_cfg, true_cfg_start, negative_prompt; SD3: negative_prompt, clip_g, cfg, sampler,
    scheduler, slg_scale, slg_layers, no_t5, max_length, configs, prompt_weights; SDXL: negative_prompt, clip_g, cfg,
    sampler, karras, original_size, crop, target_size, max_token_length, configs, freeu, prompt_weights, embeddings,
    guidance_rescale; Flux Kontext: image, keep_image_size, prompt_weights, true_cfg, true_cfg_start,
    negative_prompt; every family but Kontext: init_image, strength, mask, mask_grow, mask_blur, paste_back (below).
    An option of another family is refused, naming it.

    model: a diffusers folder, a transformer / UNet / SAI single file (with vae=, clip_l=, t5= where it does not
    hold them) or a family's Files. loras: ["path", "path:weight", (path, weight)], added together. steps, guidance
    / cfg: the family's defaults (Flux-dev 28 / 3.5, schnell 4 / none; see the families' modules). seed: default a
    random one (written into each PNG). output: a folder to write the PNGs into. dtype: default bfloat16 on cuda,
    float32 on cpu. fp8: fp8 storage of the denoiser's blocks and T5's layers; fp8="compute": the blocks' matmuls
    in fp8 too (e4m3 tensor cores; activations quantised per tensor). max_gpu_memory ('12GiB'): stream
    blocks through the device within this budget (the device's whole use: what the CUDA context and libraries hold
    outside FLAME's pool counts). max_length: T5 tokens (Flux-dev 512, schnell 256, SD3 256). stats: a dict filled
    with each stage's seconds and device peak. log: a print function.

    Image-to-image (Flux, SD3, SDXL, Chroma, Qwen-Image): init_image, an image file or a PIL image, scaled to cover
    width x height and centre-cropped, encoded by the family's VAE, noised and denoised over `strength` of the steps
    (default 0.6; SDXL 0.3: diffusers'; flame_models/samplers/img2img.py). width / height: default 1024, or with an
    init image its own size floored to 16 (one given: the other at the image's aspect ratio). mask: inpainting -- an
    image (file or PIL), white where the init image is repainted, the rest kept (strength then defaults to 1;
    flame_models/samplers/inpaint.py); mask_grow: pixels it grows by (negative: shrinks; ComfyUI's GrowMask),
    mask_blur: the standard deviation in pixels of a Gaussian blur of it (diffusers' mask_processor.blur), both at
    the mask's own size; paste_back: the init image's pixels put back outside the mask.

    Hires pass (A1111's "Hires. fix"; every family but Kontext): hires_scale X -- the images made at width x height,
    upscaled X times (Lanczos; in (1, 4], floored to the family's multiple of 16 / SDXL 32), encoded and denoised
    again over hires_strength (default 0.5) of hires_steps (default: steps), each from its own first-pass image and
    seed. The models load once per pass; the PNGs are the second pass's ("Hires steps", "Hires base size")."""
    from . import registry
    if fp8 not in (False, True, "compute"):
        raise GenerateError(f"fp8: False, True (fp8 storage) or 'compute' (fp8 storage and fp8 matmuls), got {fp8!r}")
    options = dict(options, guidance=guidance, max_length=max_length)
    parts = {name: registry.module(name, "generate") for name in registry.names()}
    known = {k for part in parts.values() for k in part.OPTIONS}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s) {unknown}")
    family = family_of(model, arch, parts)
    part = parts[family]
    # (identity, not ==: a 0 given, --cfg 0 or --strength 0, is an option given, to check and refuse)
    for name in sorted(k for k, v in options.items() if v is not None and v is not False and k not in part.OPTIONS):
        raise GenerateError(_refusal(name, family, parts))
    mine = {k: v for k, v in options.items() if k in part.OPTIONS}
    multiple = getattr(part, "INIT_MULTIPLE", 16)
    width, height = init_size(mine.get("init_image"), width, height, multiple)
    _check_size(width, height, batch_size, _device(device), _budget(max_gpu_memory))  # before any file is read
    log = log or (lambda *a: print(*a, file=sys.stderr))
    run = functools.partial(part.generate, model, prompts, vae=vae, clip_l=clip_l, t5=t5, tokenizer=tokenizer,
                            loras=loras, num_images=num_images, batch_size=batch_size, device=device, dtype=dtype,
                            fp8=fp8, max_gpu_memory=max_gpu_memory, progress=progress, stats=stats, log=log, **mine)
    if hires_scale is None:
        for name, v in (("hires-strength", hires_strength), ("hires-steps", hires_steps)):
            if v is not None:
                raise GenerateError(f"--{name}: applies to a hires pass; pass --hires-scale too")
        return run(width=width, height=height, steps=steps, seed=seed, output=output)
    big, hires_scale, hires_strength = _check_hires(family, part, mine, width, height, hires_scale, hires_strength,
                                                    hires_steps, multiple)
    _check_size(*big, batch_size, _device(device), _budget(max_gpu_memory))
    seed = random.randrange(2 ** 32) if seed is None else seed   # (one seed for both passes)
    log(f"hires: the first pass at {width}x{height}")
    first = run(width=width, height=height, steps=steps, seed=seed, output=None)
    from PIL import Image
    upscaled = [im.resize(big, Image.LANCZOS) for im in first]
    log(f"hires: the second pass at {big[0]}x{big[1]} (Lanczos upscale x{hires_scale:g}, strength {hires_strength:g})")
    info = {"scale": hires_scale, "base_size": [width, height], "upscaler": "lanczos"}
    return run(width=big[0], height=big[1], steps=hires_steps if hires_steps is not None else steps, seed=seed,
               output=output, init_image=upscaled, strength=hires_strength, hires=info)


def _check_hires(family, part, mine, width, height, scale, strength, steps, multiple):
    """((width, height) of the second pass, its strength) of a hires run, checked before anything is loaded."""
    from .samplers.img2img import check_strength
    if "init_image" not in part.OPTIONS:
        raise GenerateError(f"--hires-scale: its second pass is image-to-image, which {family} does not take")
    for name in ("init_image", "mask"):
        if mine.get(name) is not None:
            raise GenerateError(f"--hires-scale: starts from text; leave --{name.replace('_', '-')} out")
    given, scale = scale, as_float(scale)
    if not 1.0 < scale <= 4.0:
        raise GenerateError(f"--hires-scale {given}: a factor in (1, 4]")
    big = (max(multiple, int(width * scale) // multiple * multiple),
           max(multiple, int(height * scale) // multiple * multiple))
    try:
        strength = check_strength(HIRES_STRENGTH if strength is None else strength)
    except ValueError as e:
        raise GenerateError(f"--hires-strength: {e}") from None
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise GenerateError(f"--hires-steps {steps}: must be a whole number >= 1")
    return big, scale, strength


def family_of(model, arch=None, parts=None):
    """The family ("flux", "sd3", "sdxl") of a model argument: a path (registry.detect_family), or a family's Files
    object (its generate part's FILES)."""
    from . import registry
    parts = parts or {name: registry.module(name, "generate") for name in registry.names()}
    # the family whose FILES is the object's own class first (Kontext's files are a kind of Flux's)
    matches = sorted((name for name, part in parts.items() if isinstance(model, part.FILES)),
                     key=lambda name: type(model) is not parts[name].FILES)
    for name in matches[:1]:
        if arch is not None and arch != name:
            raise GenerateError(f"--arch {arch}: the model given is {name}")
        return name
    # files of no family go to Flux's checks, which say what they are instead
    return registry.detect_family(model, arch, error=GenerateError, default="flux")[0]


def _refusal(option, family, parts):
    """The message for `option` given to a model of `family`: whose option it is, and what this family does
    instead (its generate part's NOTES)."""
    from . import registry
    owners = [name for name, part in parts.items() if option in part.OPTIONS]
    words = next((parts[o].OPTIONS[option] for o in owners if parts[o].OPTIONS[option]), None)
    if words is None:
        labels = " / ".join(registry.about(o).label for o in owners)
        # "an SD3", "an SDXL" (an acronym read letter by letter), "a Flux"
        vowel = labels[0] in "AEIOU" or (labels[:2].isupper() and labels[0] in "FHLMNRSX")
        words = f"{'an' if vowel else 'a'} {labels} option"
    note = getattr(parts[family], "NOTES", {}).get(option)
    flag = {"embeddings": "embedding"}.get(option, option).replace("_", "-")   # (the command line's name)
    return (f"--{flag}: {words}; this model is {registry.about(family).label}"
            + (f": {note}" if note else ""))


def run_stages(stages, prompts, jobs, *, dev, budget, batch_size, steps, progress, stats, log):
    """The three stages of text-to-image, each loaded, run and freed before the next (each under the memory budget,
    timed into stats): the text encoders -- every distinct prompt once --, the denoiser -- every job's latents,
    kept on the host --, the VAE -- one image at a time, tiled when a whole one does not fit the budget. `jobs`:
    [(prompt index, seed)]; `stages`: the family's Stages. Returns PIL images, one per job."""
    unique = list(dict.fromkeys(prompts))
    prev = _limited(dev, budget)
    try:
        with _Stage("text encoders", dev, stats, log):
            cond = stages.encode(unique)
    finally:
        memory.set_memory_limit(prev, dev)
    rows = [unique.index(p) for p in prompts]

    latents = []
    prev = _limited(dev, budget)
    try:
        with _Stage(stages.denoiser, dev, stats, log):
            net = stages.load()
            if budget is not None:
                log(str(stages.fit(net, cond, min(batch_size, len(jobs)))))
            bar = _bar(len(jobs) * steps, progress, "denoising")
            try:
                for lo in range(0, len(jobs), batch_size):
                    batch = jobs[lo:lo + batch_size]
                    z = stages.sample(net, cond, [s for _, s in batch], [rows[i] for i, _ in batch],
                                      lambda i, n, k=len(batch): bar.update(k) if bar else None,
                                      range(lo, lo + len(batch)))
                    latents.extend(z.cpu().numpy())
            finally:
                if bar:
                    bar.close()
            free_model(net, dev)
            del net
    finally:
        memory.set_memory_limit(prev, dev)

    prev = _limited(dev, budget)
    try:
        with _Stage("vae", dev, stats, log):
            vae_model = stages.load_vae()
            images = _decode_images(vae_model, latents, stages.decode, dev, log)
            del vae_model
            memory.empty_cache(dev)
    finally:
        memory.set_memory_limit(prev, dev)
    return images


def write_pngs(output, jobs, images, text_of, log):
    """Each job's image as <index>-<seed>.png in `output`, numbered after the PNGs already there, with the text
    chunks text_of(prompt index, seed) {key: str}."""
    n0 = _next_index(output)
    for k, ((i, s), img) in enumerate(zip(jobs, images)):
        path = save_png(img, os.path.join(output, f"{n0 + k:05d}-{s}.png"), text_of(i, s))
        log(f"wrote {path}")


def model_name(path):
    """A model's name for the PNG's parameters: its file's name without .safetensors, or its diffusers folder's."""
    name = os.path.basename(os.path.normpath(path))
    if name in ("transformer", "unet"):  # a diffusers folder: its name
        name = os.path.basename(os.path.dirname(os.path.normpath(path)))
    return name[:-len(".safetensors")] if name.endswith(".safetensors") else name


def _decode_images(vae, latents, decode, dev, log):
    """PIL images of the model-space latents (host arrays (C, h, w)), decoded one at a time by `decode(vae, z)` on
    `dev`; from the first that does not fit the memory budget whole, in tiles."""
    images = []
    for z in latents:
        zt = flame.tensor(z[None], device=dev)
        x = _tiled_if_short(decode, vae, zt, log, "vae: the whole image does not fit the budget; decoding in tiles")
        images.extend(to_pil(x))
    return images


def _tiled_if_short(fn, vae, x, log, message):
    """fn(vae, x) (a VAE's encode or decode); when it runs out of the memory budget with tiling not forced on, once
    more with the VAE's tiling on (logging `message`)."""
    try:
        return fn(vae, x)
    except flame.OutOfMemoryError:
        if vae.use_tiling is True:
            raise
        log(message)
        vae.enable_tiling()
        return fn(vae, x)


def _bar(total, progress, desc):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=False)


# ----------------------------------------------------------------------------- the command
def build_parser():
    from . import registry
    p = argparse.ArgumentParser(prog="python -m flame_models.generate", description=(
        "Generate images with a Flux, SD3 / SD3.5 or SDXL model (diffusers folder, SAI / BFL / ComfyUI single files) "
        "and optional LoRAs."))
    m = p.add_argument_group("model")
    m.add_argument("--model", required=True, help="a diffusers folder, or a transformer / UNet / SAI .safetensors file")
    m.add_argument("--arch", choices=registry.names(), help="the model family (default: from the files)")
    m.add_argument("--vae", help="the VAE (ae.safetensors) when --model is a single file")
    m.add_argument("--clip-l", help="CLIP-L (clip_l.safetensors) when --model is a single file")
    m.add_argument("--clip-g", help="CLIP-G (clip_g.safetensors; SD3 / SDXL) when --model does not hold it")
    m.add_argument("--t5", help="T5-XXL (t5xxl_fp16 / t5xxl_fp8_e4m3fn.safetensors) when --model is a single file")
    m.add_argument("--tokenizer", help="a folder with tokenizer/ and tokenizer_2/ (SD3: and tokenizer_3/) (default: "
                                       "the model folder's, else the vocabularies packaged with FLAME)")
    m.add_argument("--lora", action="append", default=[], metavar="PATH[:WEIGHT]",
                   help="a LoRA for the model (FLAME, diffusers, kohya, ai-toolkit; an SDXL file's text-encoder "
                        "parts go into CLIP-L / CLIP-G); repeatable, weights add up")
    g = p.add_argument_group("what to generate")
    g.add_argument("--prompt", action="append", default=[], help="repeatable")
    g.add_argument("--prompts-file", help="a text file, one prompt per non-empty line")
    g.add_argument("--width", type=int, help="default 1024; with --init-image its width (floored to 16)")
    g.add_argument("--height", type=int, help="default 1024; with --init-image its height (floored to 16)")
    g.add_argument("--steps", type=int, help="default 28 (dev), 4 (schnell)")
    g.add_argument("--guidance", type=float, help="embedded guidance, default 3.5 (Flux-dev only)")
    g.add_argument("--image", help="Flux Kontext: the reference image to edit (resized to Kontext's resolution "
                                   "list)")
    g.add_argument("--keep-image-size", action="store_true", help="Flux Kontext: keep the reference image's size "
                                                                  "(floored to 16) instead of Kontext's list")
    g.add_argument("--init-image", help="image-to-image: start from this image (scaled to cover the size, "
                                        "centre-cropped), noised to --strength (Flux, SD3, SDXL, Chroma, Qwen-Image)")
    g.add_argument("--strength", type=float, help="with --init-image: the fraction of the steps run, in (0, 1] "
                                                  "(default 0.6; SDXL 0.3: diffusers'; with --mask 1); 1 ignores "
                                                  "the image (outside a mask)")
    g.add_argument("--mask", help="with --init-image: inpainting; an image, white where the init image is "
                                  "repainted (grey blends), scaled and cropped as it is; the rest stays the image")
    g.add_argument("--mask-grow", type=int, metavar="PX", help="with --mask: grow it by PX pixels of its own size "
                                                               "(negative shrinks; ComfyUI's GrowMask, tapered "
                                                               "corners), before --mask-blur")
    g.add_argument("--mask-blur", type=float, metavar="PX", help="with --mask: blur it by a Gaussian of standard "
                                                                 "deviation PX pixels of its own size (diffusers' "
                                                                 "mask_processor.blur; A1111's \"Mask blur\")")
    g.add_argument("--paste-back", action="store_true", help="with --mask: put the init image's own pixels back "
                                                             "where the mask keeps them (else the VAE's round trip)")
    g.add_argument("--hires-scale", type=float, metavar="X", help="a hires pass (A1111's Hires. fix): the images "
                                                                  "made at --width x --height, upscaled X times "
                                                                  "(Lanczos) and denoised again from "
                                                                  "--hires-strength (Flux, SD3, SDXL, Chroma, "
                                                                  "Qwen-Image)")
    g.add_argument("--hires-strength", type=float, help="the hires pass's denoising strength (default 0.5)")
    g.add_argument("--hires-steps", type=int, help="the hires pass's steps (default --steps'), of which "
                                                   "--hires-strength run")
    g.add_argument("--negative-prompt", help="SD3 / SDXL / Chroma / Qwen-Image: the negative prompt of "
                                             "classifier-free guidance (Flux / Flux Kontext: with --true-cfg)")
    g.add_argument("--cfg", type=float, help="SD3 / SDXL / Chroma / Qwen-Image: classifier-free guidance scale "
                                             "(default: SD3.5 Large 4.5, Medium 5, Large Turbo 1; SDXL 5; Chroma 5; "
                                             "Qwen-Image 4)")
    g.add_argument("--true-cfg", type=float, metavar="S",
                   help="Flux / Flux Kontext: true classifier-free guidance (diffusers' true_cfg_scale) against "
                        "--negative-prompt (default \"\"); each step runs both prompts")
    g.add_argument("--guidance-rescale", type=float, metavar="R",
                   help="SDXL: rescale classifier-free guidance toward the prompt's prediction's spread (diffusers' "
                        "guidance_rescale, 0-1; 0.7 for v-prediction models with zero terminal SNR)")
    g.add_argument("--true-cfg-start", type=int, metavar="N",
                   help="Flux / Flux Kontext: the first step (0-based) of --true-cfg; the steps before it run the "
                        "prompt alone (SimpleTuner's validation_no_cfg_until_timestep; default 0)")
    g.add_argument("--seed", type=int, help="image j of each prompt uses seed + j (default: random)")
    g.add_argument("--num-images", type=int, default=1, help="images per prompt")
    g.add_argument("--batch-size", type=int, default=1, help="images per transformer call")
    g.add_argument("--output", default="outputs", help="folder for the PNGs (default: outputs)")
    x = p.add_argument_group("SD3 / SDXL sampling")
    x.add_argument("--sampler", choices=tuple(SAMPLERS), help="default euler; SDXL: any of these; SD3 / Flux / Flux "
                                                              "Kontext / Chroma / Qwen-Image: euler, heun, "
                                                              "dpmpp_2m, dpmpp_2m_sde or unipc")
    x.add_argument("--karras", action="store_true", help="SDXL: Karras sigmas instead of the model's")
    x.add_argument("--scheduler", choices=FLOW_SCHEDULERS,
                   help="SD3 / Flux / Flux Kontext / Chroma / Qwen-Image: the sigma spacing (default simple: the "
                        "model's own; karras, exponential, beta keep its end points)")
    x.add_argument("--original-size", metavar="WxH", help="SDXL size conditioning (default: the image's size)")
    x.add_argument("--crop", metavar="TOP,LEFT", help="SDXL crop conditioning (default 0,0)")
    x.add_argument("--target-size", metavar="WxH", help="SDXL size conditioning (default: the image's size)")
    x.add_argument("--max-token-length", type=int, choices=(75, 150, 225),
                   help="SDXL: CLIP tokens per caption in 75-token chunks (kohya's rule; default 77 tokens)")
    x.add_argument("--freeu", nargs="?", const="default", metavar="b1=X,b2=X,s1=X,s2=X",
                   help="SDXL: FreeU on the UNet's decoder (backbone b1 / b2, skip s1 / s2; alone or for the factors "
                        "not named: SDXL's published b1=1.3,b2=1.4,s1=0.9,s2=0.2)")
    x.add_argument("--prompt-weights", action="store_true",
                   help="SDXL / SD3 / Flux / Flux Kontext: read ComfyUI's prompt weights, (text:1.2) and (text) = 1.1 "
                        "(else parentheses are text, as in diffusers)")
    x.add_argument("--embedding", action="append", dest="embeddings", metavar="PATH[:TOKEN]",
                   help="SDXL: a textual-inversion embedding (.safetensors with clip_l / clip_g), repeatable; a "
                        "prompt names it by TOKEN (default: the file's name) or embedding:TOKEN")
    x.add_argument("--slg-scale", type=float, help="SD3: skip-layer guidance scale (0 off; default 2.5 for "
                                                   "Medium, off otherwise)")
    x.add_argument("--slg-layers", metavar="I,J,K", help="SD3: joint blocks left out (default 7,8,9)")
    x.add_argument("--no-t5", action="store_true", help="SD3: run without T5 (its tokens are zeros)")
    r = p.add_argument_group("how to run")
    r.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    r.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    r.add_argument("--fp8", action="store_true", help="fp8 (e4m3) storage of the transformer blocks and T5")
    r.add_argument("--fp8-compute", action="store_true", help="--fp8, and the blocks' matmuls on the fp8 tensor cores "
                                                              "(activations quantised per tensor)")
    r.add_argument("--max-gpu-memory", help="a budget such as 12GiB (a bare number is GiB): stream blocks through "
                                            "the GPU within it")
    r.add_argument("--max-length", type=int, help="T5 tokens per prompt (default Flux-dev 512, schnell 256, SD3 256)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _read_prompts(args):
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerateError(f"--prompts-file {args.prompts_file}: cannot read it ({e})") from None
    return prompts


def _family_options(args):
    """The options only some families take, given on the command line (left out when not given, so a family
    refuses another's only when it is given)."""
    opts = dict(image=args.image, keep_image_size=args.keep_image_size, init_image=args.init_image,
                strength=args.strength, mask=args.mask, paste_back=args.paste_back, mask_grow=args.mask_grow,
                mask_blur=args.mask_blur,
                negative_prompt=args.negative_prompt,
                clip_g=args.clip_g, cfg=args.cfg, sampler=args.sampler, scheduler=args.scheduler,
                karras=args.karras, original_size=args.original_size, crop=args.crop, target_size=args.target_size,
                max_token_length=args.max_token_length, slg_scale=args.slg_scale, slg_layers=args.slg_layers,
                no_t5=args.no_t5, freeu=args.freeu, prompt_weights=args.prompt_weights, true_cfg=args.true_cfg,
                true_cfg_start=args.true_cfg_start, guidance_rescale=args.guidance_rescale,
                embeddings=args.embeddings)
    return {k: v for k, v in opts.items() if v is not None and v is not False}   # (a 0 given is given)


# what a user's mistake looks like: a message, not a traceback
_USER_ERRORS = (FlameError, ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def _from_hub_cache(value, option):
    """`value` (a command-line path), or, for a Hugging Face repo id, its snapshot in the local Hugging Face cache
    (said on stderr); GenerateError when the cache lacks it (FLAME never downloads) or holds it ambiguously."""
    from .checkpoint_io import hub_cache
    try:
        path = hub_cache.resolve(value)
    except hub_cache.HubCacheError as e:
        raise GenerateError(f"{option} {value}: {e}") from None
    if path is not None:
        print(f"{option} {value}: read from the Hugging Face cache: {path}", file=sys.stderr)
        return path
    if hub_cache.looks_like_repo_id(value):
        raise GenerateError(f"{option} {value}: no such file or folder ({hub_cache.fetch_hint(value)})")
    return value


def main(argv=None):
    args = build_parser().parse_args(argv)
    stats = {}
    try:
        args.model, args.vae = _from_hub_cache(args.model, "--model"), args.vae and _from_hub_cache(args.vae, "--vae")
        images = generate(args.model, _read_prompts(args), vae=args.vae, clip_l=args.clip_l, t5=args.t5,
                          tokenizer=args.tokenizer, loras=args.lora, width=args.width, height=args.height,
                          steps=args.steps, guidance=args.guidance, seed=args.seed, num_images=args.num_images,
                          batch_size=args.batch_size, output=args.output, device=args.device, dtype=args.dtype,
                          fp8="compute" if args.fp8_compute else args.fp8, max_gpu_memory=args.max_gpu_memory,
                          max_length=args.max_length, hires_scale=args.hires_scale,
                          hires_strength=args.hires_strength, hires_steps=args.hires_steps,
                          progress=not args.no_progress, stats=stats, arch=args.arch, **_family_options(args))
    except _USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial image was written", file=sys.stderr)
        return 130
    peak = max(s["peak_bytes"] for s in stats.values())
    print(f"{len(images)} image(s) in {args.output}; peak device memory {fmt_bytes(peak)} ("
          + ", ".join(f"{k} {fmt_bytes(v['peak_bytes'])}" for k, v in stats.items()) + ")", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
