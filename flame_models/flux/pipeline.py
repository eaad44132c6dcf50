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
import gc
import os

import numpy as np

import flame_core as flame
import flame_nn
from flame_core import memory
from flame_nn import adapters as A
from flame_nn.offload import BlockStreamer, OffloadError, quantize_linear_weights_

from ..conditioning import files as _cf
from ..conditioning import prompt_rows
from ..vae import FLUX, decode_model_latents, encode_model_latents, load_family_vae
from .components import FluxFiles, FluxFilesError, find_flux_files
from .conditioning import (FluxTextEncoders, check_vocabularies, encode_prompts, load_text_encoders,
                           load_tokenizers)
from .loading import load_flux
from .sampling import LATENT_CHANNELS, denoise, get_noise, get_schedule, image_ids, pack, text_ids, unpack

STACKS = ("double_blocks", "single_blocks")


# ----------------------------------------------------------------------------- the VAE
def load_vae_for_flux(files, *, dtype=flame.bfloat16, device=None):
    """The Flux VAE of `files` (FluxFiles, or a path to the VAE itself), frozen, in `dtype` on `device`."""
    path = files.vae if isinstance(files, FluxFiles) else os.fspath(files)
    return load_family_vae(path, LATENT_CHANNELS, family="Flux", others="an SD / SDXL", error=FluxFilesError,
                           dtype=dtype, device=device)


def decode_latents(vae, latents):
    """Model-space latents (B, 16, H/8, W/8) -> images (B, 3, H, W) in [-1, 1] (nominally; not clamped), in the
    VAE's dtype, on its device: z = latents / 0.3611 + 0.1159, then the decoder."""
    return decode_model_latents(vae, latents, FLUX, hint=" (unpack packed tokens first: flux.unpack)")


def encode_images(vae, images):
    """Images (B, 3, H, W) in [-1, 1] -> model-space latents (B, 16, H/8, W/8) float32: the posterior mean z, then
    (z - 0.1159) * 0.3611."""
    return encode_model_latents(vae, images, FLUX)


def to_pil(images):
    """Images (B, 3, H, W) (a Tensor or NumPy array) in [-1, 1] -> list of RGB PIL images, as diffusers'
    VaeImageProcessor.postprocess: (x / 2 + 0.5) clamped to [0, 1] in the images' dtype, then x * 255 rounded."""
    from PIL import Image
    if isinstance(images, flame.Tensor):
        with flame.no_grad():
            x = (images / 2 + 0.5).clamp(0, 1)
            arr = x.float().cpu().numpy()
    else:
        arr = np.clip(np.asarray(images) / 2 + 0.5, 0, 1).astype(np.float32)
    if arr.ndim != 4 or arr.shape[1] not in (1, 3):
        raise ValueError(f"to_pil expects images (B, 3, H, W), got shape {arr.shape}")
    arr = (arr.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L") for a in arr]
    return [Image.fromarray(a, mode="RGB") for a in arr]


# ----------------------------------------------------------------------------- LoRA files
def parse_lora(spec):
    """"path[:weight]" -> (path, weight); weight 1.0 when absent. A colon whose tail is not a number belongs to
    the path (C:\\loras\\a.safetensors)."""
    if isinstance(spec, (tuple, list)):
        path, weight = spec
        return os.fspath(path), float(weight)
    spec = os.fspath(spec)
    head, sep, tail = spec.rpartition(":")
    if sep and head:
        try:
            return head, float(tail)
        except ValueError:
            pass
    return spec, 1.0


def check_loras(loras, params, *, probe=None, model_class=None, error=FluxFilesError, text_encoders=None):
    """Read each LoRA file and check it against a Flux of `params` (names, shapes, kind) before anything big is
    loaded. Returns [(path, weight)]. `error` (FluxFilesError) names the file. model_class: another model to
    check against instead, built from `params` under flame_nn.empty_init (its adapter_name_map() maps diffusers'
    names), e.g. an SD3 MMDiT or an SDXL UNet; probe: such a model already built. text_encoders: {'te1': model or
    None, 'te2': ...} when the generator applies the text encoders' parts of the files too (SDXL's CLIP-L /
    CLIP-G): each part is checked against its model (built under empty_init), or, for None, when the encoder is
    loaded (check_lora_part); without it a file with text-encoder weights is refused."""
    from ..training.model_files import describe_keys
    out = []
    if not loras:
        return out
    if probe is None:
        if model_class is None:
            from .model import Flux as model_class
        with flame_nn.empty_init(device="cpu"):
            probe = model_class(params)
    targets = {"denoiser": (probe, probe.adapter_name_map()),
               **{c: (m, A.formats.IDENTITY) for c, m in (text_encoders or {}).items()}}
    for spec in loras:
        path, weight = parse_lora(spec)
        if not os.path.isfile(path):
            raise error(f"--lora {path}: no such file")
        if not np.isfinite(weight):
            raise error(f"--lora {path}: the weight {weight} is not a finite number")
        try:
            keys = list(_cf.read_headers(_cf.part_files(path, "lora", error=error), error=error))
        except error as e:
            raise error(f"--lora {e}") from None
        kind, words, example = describe_keys(keys)
        if kind != "lora":
            raise error(f"--lora {path}: not a LoRA file: it looks like {words}"
                        + (f" (keys such as {example})" if example else " (no tensors)"))
        te = [k for k in keys if k.startswith(("lora_te", "text_encoder", "te_"))
              or A.formats.component_of(k) != "denoiser"]
        if te and not text_encoders:
            raise error(f"--lora {path}: holds text-encoder LoRA weights ({len(te)} tensors such as "
                        f"{te[0]}); this generator applies transformer LoRAs only")
        other = sorted({A.formats.component_of(k) for k in te} - set(targets))
        if other or any(A.formats.component_of(k) == "denoiser" for k in te):
            raise error(f"--lora {path}: holds weights for a text encoder this model does not have (keys such as "
                        f"{te[0]}); its text encoders take lora_te1_ / lora_te2_ (kohya) or text_encoder. / "
                        f"text_encoder_2. (diffusers) keys")
        for component, (model, name_map) in targets.items():
            if model is not None:
                check_lora_part(path, model, name_map, component, error)
        out.append((path, weight))
    return out


def check_lora_part(path, model, name_map, component, error):
    """The adapters of one part of a LoRA file (formats.load's component) fit `model`'s layers (names, shapes,
    kinds); `error` names the file."""
    layers = (flame_nn.Linear, flame_nn.Conv2d)   # (SDXL's LoCon files adapt its convolutions)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, layers)}
    try:
        modules, _ = A.formats.load(path, set(shapes), name_map=name_map, component=component)
    except A.AdapterFormatError as e:
        raise error(f"--lora {path}: {_reason(e, path)}") from None
    for mod, parts in modules.items():
        out_f, in_f, kernel = shapes[mod][0], shapes[mod][1], shapes[mod][2:]
        for p in parts:
            lo, hi = p.rows if p.rows is not None else (0, out_f)
            if p.shape != (hi - lo, in_f):
                raise error(f"--lora {path}: the adapter on {mod} is {p.shape[0]}x{p.shape[1]} but "
                            f"this {type(model).__name__}'s {'Conv2d' if kernel else 'Linear'} (rows {lo}:{hi}) "
                            f"is {hi - lo}x{in_f}: a LoRA for another model size?")
            down = p.tensors.get("lora_down.weight")
            if kernel and p.kind != "lora":
                raise error(f"--lora {path}: a {p.kind} adapter on the convolution {mod}; convolutions take "
                            f"LoRA only")
            if kernel and down is not None and tuple(down.shape[2:]) not in (kernel, () if kernel == (1, 1)
                                                                              else kernel):
                raise error(f"--lora {path}: the adapter on {mod} has a {tuple(down.shape[2:])} kernel, the "
                            f"convolution's is {kernel}")


def _reason(e, path):
    """The first line of a LoRA file error, without the file name that the --lora message already gives."""
    line = str(e).splitlines()[0]
    return line[len(f"{path}: "):] if line.startswith(f"{path}: ") else line


def apply_loras(model, loras, *, merge=True, dtype=flame.float32, error=FluxFilesError, component="denoiser"):
    """Load each (path, weight) into `model` as its own adapter ("lora_0", "lora_1", ...), scaled by its weight;
    the changes add up. merge=True folds them into the base weights (summed, rounded once) and drops the adapters
    (no cost per step, and no copy of the original weights kept: inference never unmerges); merge=False keeps them
    as adapters beside the weights (fp8 storage and streamed blocks need that). `error` names the file. component:
    the part of each file to apply ('denoiser'; 'te1' / 'te2' when `model` is that text encoder)."""
    for i, (path, weight) in enumerate(loras):
        try:
            A.load_adapters(model, path, name=f"lora_{i}", weight=weight, dtype=dtype, component=component)
        except A.AdapterFormatError as e:
            raise error(f"--lora {path}: {_reason(e, path)}") from None
    if loras and merge:
        # Linear by Linear: the LoRAs' changes (each times its weight, each against the base weight, as the adapters
        # compute them unmerged) summed in float32, then added and rounded to the weight's dtype once. Merging one
        # LoRA after the other would round a bf16 weight once per LoRA: two LoRAs at 0.5 would not be one at 1.
        changes = {}
        for i, (_, weight) in enumerate(loras):
            for module, rows, ad in A.adapter_modules(model, f"lora_{i}"):
                changes.setdefault(module, []).append((rows, ad, weight))
        with flame.no_grad():
            for module, entries in changes.items():
                w = model.get_submodule(module).weight
                w0 = w.to(flame.float64 if w.dtype == flame.float64 else flame.float32)
                delta = flame.zeros_like(w0)
                for rows, ad, weight in entries:
                    lo, hi = rows if rows is not None else (0, w.shape[0])
                    new = ad.merged_weight(w[lo:hi]).to(w0.dtype)   # W + ΔW (DoRA: renormalised rows)
                    delta[lo:hi].add_((new - w0[lo:hi]) * weight)
                w.copy_((w0 + delta).to(w.dtype))
        A.remove_adapters(model)
    return model


# ----------------------------------------------------------------------------- the transformer
def load_transformer(files, *, dtype=flame.bfloat16, device=None, loras=(), fp8=False, stream=False,
                     slots=2):
    """The Flux transformer of `files` with LoRAs applied, ready for sampling.

    fp8: the blocks' Linear weights in fp8 storage (e4m3, a scale per row), LoRAs kept as adapters beside them.
    stream: the blocks' weights in pinned host memory, streamed through `slots` device buffers
    (flame_nn.offload.BlockStreamer, `model.streamer`; choose resident blocks with `fit_transformer`); the model is
    read into host memory first. Without either, LoRAs are merged into the weights."""
    files = files if isinstance(files, FluxFiles) else find_flux_files(files)
    loras = check_loras(loras, files.params)
    return load_for_sampling(lambda dev: load_flux(files.transformer, dtype=dtype, device=dev), files.transformer,
                             loras, STACKS, device, fp8=fp8, stream=stream, slots=slots, error=FluxFilesError)


def load_for_sampling(load, path, loras, stacks, device=None, *, fp8=False, stream=False, slots=2,
                      error=FluxFilesError):
    """The model `load(device)` reads from `path`, frozen, in eval mode, with the checked `loras` (check_loras)
    applied -- merged into the weights unless fp8 or stream keep them as adapters -- and placed on `device` for
    sampling (place_for_inference). With fp8 or stream the model is read into host memory and moved block by block,
    so that it is never whole on the device in its dtype. A placement that cannot be done is `error` naming
    `path`."""
    dev = flame.device(device) if device is not None else flame.default_device()
    model = load("cpu" if (stream or fp8) else dev)
    model.requires_grad_(False)
    model.eval()
    apply_loras(model, loras, merge=not (fp8 or stream), error=error)
    try:
        place_for_inference(model, stacks, dev, fp8=fp8, stream=stream, slots=slots)
    except OffloadError as e:
        raise error(f"{path}: {str(e).splitlines()[0]}") from None
    return model


def place_for_inference(model, stacks, device, *, fp8=False, stream=False, slots=2):
    """Put a model read into host memory (for fp8 or streaming) on `device`: stream: the blocks of the ModuleLists
    `stacks` in pinned host memory through `slots` device buffers (`model.streamer`, in fp8 with fp8); fp8 alone:
    each block moved and its Linear weights quantised in turn (the whole model is never on the device in its
    dtype); adapters follow. Neither: nothing to do (the model was loaded on the device)."""
    if stream:
        model.streamer = BlockStreamer.for_model(model, stacks, device=device, quantize="fp8" if fp8 else None,
                                                 slots=slots)
    elif fp8:
        dev = flame.device(device)
        for t in (*model.parameters(recurse=False), *model.buffers(recurse=False)):  # the model's own (SD3's
            if t.device != dev:                                                       # position table)
                t.data = t.data.to(dev)
        for name, child in model.named_children():
            if name not in stacks:
                child.to(device)
        for s in stacks:
            for block in model.get_submodule(s):
                block.to(device)
                quantize_linear_weights_(block)
        for name in A.adapter_names(model):  # adapters sit beside the module tree
            for _, _, ad in A.adapter_modules(model, name):
                ad.to(device)
    return model


def free_model(model, device=None):
    """Release a model now (its streamer too): device pool and pinned host buffers."""
    streamer = getattr(model, "streamer", None)
    if streamer is not None:
        streamer.synchronize()
        model.streamer = None
    del streamer, model
    gc.collect()
    memory.empty_cache(device)
    memory.empty_pinned_cache()


def _model_dtype(model):
    return model.img_in.weight.dtype


def sample_latents(model, cond, *, height, width, steps, guidance=None, seeds=None, latents=None, rows=None,
                   callback=None, cuda_graph=None):
    """Denoise with the Euler sampler on Flux's (shifted, for dev) schedule; returns model-space latents
    (B, 16, H/8, W/8) float32.

    cond: {"prompt_embeds": (P, L, C), "pooled_prompt_embeds": (P, C)} (Tensors or NumPy arrays); `rows` picks
    the prompt of each image (default: image i uses prompt i). Noise: one seed per image (`seeds`: image i starts
    from get_noise(seed=seeds[i]), the same whatever the batch), or `latents` given, packed (B, L, 64) or
    unpacked (B, 16, H/8, W/8). guidance: the embedded guidance of flux-dev (ignored by nothing: schnell takes
    None). callback(i, n) after each step."""
    p = model.params
    dev = model.img_in.weight.device
    if p.guidance_embed and guidance is None:
        raise ValueError("this Flux model (dev) embeds a guidance strength: pass guidance= (e.g. 3.5)")
    if not p.guidance_embed and guidance is not None:
        raise ValueError("this Flux model (schnell-like) has no guidance embedding: pass guidance=None")
    if (seeds is None) == (latents is None):
        raise ValueError("pass exactly one of seeds= (one per image) and latents=")
    if latents is None:
        noise = [get_noise(1, height, width, seed=int(s), device=dev) for s in seeds]
        x = pack(noise[0] if len(noise) == 1 else flame.cat(noise, dim=0))
    else:
        x = latents if isinstance(latents, flame.Tensor) else flame.tensor(np.asarray(latents))
        x = x.to(dev).float()
        x = pack(x) if x.ndim == 4 else x
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
    timesteps = get_schedule(steps, x.shape[1], shift=p.guidance_embed)
    out = denoise(model, x, img_pos, txt, txt_pos, y, timesteps, guidance, cuda_graph, callback)
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
           "load_tokenizers", "check_vocabularies", "encode_prompts", "load_vae_for_flux", "decode_latents", "encode_images", "to_pil",
           "parse_lora", "check_loras", "check_lora_part", "apply_loras", "load_transformer", "load_for_sampling", "place_for_inference", "free_model",
           "sample_latents", "fit_transformer"]
