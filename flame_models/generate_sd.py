"""Text-to-image with SD3 / SD3.5 and SDXL: the part of `python -m flame_models.generate` (and `generate(...)`) that
runs when the model is not a Flux one. The stages are Flux's (flame_models/generate.py): the text encoders (every
distinct prompt and the negative prompt encoded once, then freed), the denoiser (LoRAs merged, or kept beside fp8 /
streamed blocks; under --max-gpu-memory its blocks stream through the GPU, as many resident as fit), the VAE (tiled
when a whole image does not fit the budget). Every input is checked before anything is loaded.

SD3 / SD3.5: Euler on the shifted flow schedule with classifier-free guidance; defaults per release from
sd3.sampling.SAMPLING_DEFAULTS -- Large 40 steps cfg 4.5, Large Turbo 4 steps cfg 1 (recognised by "turbo" in its
file or folder name, its weights being shaped as Large's), Medium (an MMDiT-X) 50 steps cfg 5 with skip-layer
guidance on blocks 7-9 (SAI's reference; --slg-scale 0 turns it off). The negative prompt defaults to "" (diffusers);
without T5 its tokens are zeros.

SDXL: euler, euler_ancestral, dpmpp_2m or ddim on the 'normal' (diffusers' SDXL spacing) or Karras schedule,
classifier-free guidance (default 30 steps, cfg 5); the negative prompt defaults to zeros (diffusers'
force_zeros_for_empty_prompt); size conditioning from --original-size / --crop / --target-size (default: the image's
size, no crop); --max-token-length 150 / 225 encodes long captions in 75-token chunks (kohya's rule). The VAE decodes
in bfloat16 or float32 (a float16 request gives float32: the SDXL VAE overflows in float16).
"""
import json
import math
import os
import random
import sys

from flame_core import memory

from . import generate as G
from .conditioning.files import detect_family
from .flux.pipeline import free_model

# generate()'s keyword arguments that only SD3 / SDXL take
SD_OPTIONS = ("negative_prompt", "clip_g", "cfg", "sampler", "karras", "slg_scale", "slg_layers", "no_t5",
              "original_size", "crop", "target_size", "max_token_length", "configs")
SAMPLER_NAMES = {"euler": "Euler", "euler_ancestral": "Euler a", "dpmpp_2m": "DPM++ 2M", "ddim": "DDIM"}
SDXL_DEFAULTS = {"steps": 30, "cfg": 5.0, "sampler": "euler"}


def _family_files(family, model, vae, clip_l, clip_g, t5, tokenizer, configs):
    if family == "sd3":
        from .sd3.components import SD3Files, find_sd3_files
        if isinstance(model, SD3Files):
            return model
        return find_sd3_files(model, clip_l=clip_l, clip_g=clip_g, t5=t5, vae=vae, tokenizer=tokenizer,
                              configs=configs)
    from .sdxl.components import SDXLFiles, find_sdxl_files
    if isinstance(model, SDXLFiles):
        return model
    if t5 is not None:
        raise G.GenerateError(f"--t5 {t5}: SDXL has no T5 text encoder")
    return find_sdxl_files(model, vae=vae, clip_l=clip_l, clip_g=clip_g, tokenizer=tokenizer, configs=configs)


def _size(value, name):
    """'WxH' or (height, width) -> (height, width) ints."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            w, h = (int(v) for v in value.lower().split("x"))
        except ValueError:
            raise G.GenerateError(f"--{name} {value!r}: WIDTHxHEIGHT, e.g. 1024x1024") from None
    else:
        h, w = value
    if min(h, w) <= 0:
        raise G.GenerateError(f"--{name} {value!r}: sizes must be positive")
    return int(h), int(w)


def _crop(value):
    if value is None:
        return (0, 0)
    if isinstance(value, str):
        try:
            top, left = (int(v) for v in value.split(","))
        except ValueError:
            raise G.GenerateError(f"--crop {value!r}: TOP,LEFT in pixels, e.g. 0,0") from None
    else:
        top, left = value
    if top < 0 or left < 0:
        raise G.GenerateError(f"--crop {value!r}: coordinates must be >= 0")
    return int(top), int(left)


def _slg(files, slg_scale, slg_layers, log):
    """The skip-layer guidance of an SD3 run: SAMPLING_DEFAULTS' for Medium, or as the options say."""
    from .sd3.sampling import SAMPLING_DEFAULTS, SkipLayerGuidance
    depth = files.params.depth
    default = SAMPLING_DEFAULTS[files.variant].get("skip_layer_guidance")
    if slg_scale is None and slg_layers is None:
        if default is not None and max(default.layers) >= depth:
            log(f"skip-layer guidance: SD3.5 Medium's layers {list(default.layers)} are not in this {depth}-block "
                f"MMDiT-X; running without (set --slg-layers)")
            return None
        return default
    layers = default.layers if default is not None else SkipLayerGuidance().layers
    if slg_layers is not None:
        try:
            layers = tuple(int(v) for v in (slg_layers.split(",") if isinstance(slg_layers, str) else slg_layers))
        except ValueError:
            raise G.GenerateError(f"--slg-layers {slg_layers!r}: joint block indices, e.g. 7,8,9") from None
    bad = [i for i in layers if not 0 <= i < depth]
    if bad:
        raise G.GenerateError(f"--slg-layers {list(layers)}: {bad} are not joint blocks of this MMDiT "
                              f"({files.transformer}: {depth} blocks)")
    scale = SkipLayerGuidance().scale if slg_scale is None else float(slg_scale)
    if not math.isfinite(scale) or scale < 0:
        raise G.GenerateError(f"--slg-scale {slg_scale}: a finite number >= 0")
    return SkipLayerGuidance(layers=layers, scale=scale) if scale > 0 else None


def sd_parameters(prompt, negative, fields):
    """The A1111-style `parameters` text: the prompt, the negative prompt, then 'Key: value' pairs."""
    text = prompt + ("" if negative is None else f"\nNegative prompt: {negative}")
    return text + "\n" + ", ".join(f"{k}: {v}" for k, v in fields if v is not None)


def generate_sd(family, model, prompts, *, negative_prompt=None, vae=None, clip_l=None, clip_g=None, t5=None,
                tokenizer=None, loras=(), width=1024, height=1024, steps=None, cfg=None, sampler=None, karras=False,
                slg_scale=None, slg_layers=None, no_t5=False, original_size=None, crop=None, target_size=None,
                max_token_length=None, seed=None, num_images=1, batch_size=1, output=None, device=None, dtype=None,
                fp8=False, max_gpu_memory=None, max_length=None, configs=None, progress=True, stats=None, log=None):
    """SD3 / SD3.5 (family "sd3") or SDXL ("sdxl") text-to-image: a list of PIL images, prompt by prompt,
    `num_images` each (image j of a prompt starts from seed + j). See flame_models.generate.generate for the shared
    arguments and this module's docstring for the families' defaults."""
    log = log or (lambda *a: print(*a, file=sys.stderr))
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sd3 = family == "sd3"
    if not sd3:
        for name, v in (("--slg-scale", slg_scale), ("--slg-layers", slg_layers), ("--max-length", max_length)):
            if v is not None:
                raise G.GenerateError(f"{name}: an SD3 option; this model is SDXL")
        if no_t5:
            raise G.GenerateError("--no-t5: an SD3 option; SDXL has no T5")
    else:
        for name, v in (("--sampler", sampler), ("--original-size", original_size), ("--crop", crop),
                        ("--target-size", target_size), ("--max-token-length", max_token_length)):
            if v is not None:
                raise G.GenerateError(f"{name}: an SDXL option; SD3 samples with Euler on its flow schedule, "
                                      f"without size conditioning")
        if karras:
            raise G.GenerateError("--karras: an SDXL option; SD3 samples on its shifted flow schedule")
    files = _family_files(family, model, vae, clip_l, clip_g, t5, tokenizer, configs)
    multiple = 16 if sd3 else 8 * files.config.downsample_factor
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed, multiple=multiple,
                  family="SD3" if sd3 else "SDXL")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)
    G._check_size(width, height, batch_size, dev, budget)

    # settings, checked before anything is loaded
    if sd3:
        from .sd3 import pipeline as P
        from .sd3.sampling import SAMPLING_DEFAULTS
        defaults = SAMPLING_DEFAULTS[files.variant]
        slg = _slg(files, slg_scale, slg_layers, log)
        use_t5 = files.t5 is not None and not no_t5
        if no_t5 and files.t5 is None:
            raise G.GenerateError(f"--no-t5: {files.transformer} comes without T5 already")
        if files.t5 is None:
            log("no T5 in this model: its tokens are zeros (as the SD3 reference allows)")
        loras = P.check_loras(loras, files.params)
    else:
        from .sdxl import pipeline as P
        from .conditioning.encoders import check_max_token_length
        defaults = SDXL_DEFAULTS
        slg, use_t5 = None, False
        sampler = sampler or SDXL_DEFAULTS["sampler"]
        if sampler not in P.SAMPLERS:
            raise G.GenerateError(f"--sampler {sampler}: one of {', '.join(P.SAMPLERS)}")
        if karras and sampler == "ddim":
            raise G.GenerateError("--karras: ddim walks DDIM's own timesteps; use another sampler")
        try:
            check_max_token_length(max_token_length)
        except ValueError as e:
            raise G.GenerateError(f"--max-token-length: {e}") from None
        original_size, target_size, crop = _size(original_size, "original-size"), _size(target_size,
                                                                                          "target-size"), _crop(crop)
        loras = P.check_loras(loras, files.config)
    steps = steps if steps is not None else defaults["steps"]
    cfg = float(cfg) if cfg is not None else float(defaults["cfg"])
    if not math.isfinite(cfg) or cfg <= 0:
        raise G.GenerateError(f"--cfg {cfg}: a finite number > 0")
    if negative_prompt is not None and cfg == 1.0:
        raise G.GenerateError("--negative-prompt: without classifier-free guidance (--cfg 1) it has no effect")
    if slg is not None and cfg == 1.0:
        if slg_scale is not None or slg_layers is not None:
            raise G.GenerateError("skip-layer guidance needs classifier-free guidance: set --cfg > 1 or --slg-scale 0")
        log("skip-layer guidance (SD3.5 Medium's default) needs classifier-free guidance: running without at --cfg 1")
        slg = None
    if slg is not None and not any(slg.active(i, steps) for i in range(steps)):
        log(f"skip-layer guidance: no step of {steps} falls in its window ({slg.start:g} to {slg.stop:g} of the "
            f"steps); running without")
        slg = None
    output = G._check_output(output)
    if sd3:
        from .sd3.conditioning import check_vocabularies, load_tokenizers
        toks = load_tokenizers(files, max_length=max_length)
        check_vocabularies(files, *toks[:2], toks[2] if use_t5 else None)
    else:
        from .sdxl.conditioning import check_vocabularies, load_tokenizers
        check_vocabularies(files, *load_tokenizers(files))
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]     # (prompt row, seed)

    # 1. the text encoders: every distinct prompt and the negative once, then freed
    unique = list(dict.fromkeys(prompts))
    guided = cfg != 1.0
    prev = G._limited(dev, budget)
    try:
        with G._Stage("text encoders", dev, stats, log):
            if sd3:
                enc = P.load_text_encoders(files, dtype=dtype, device=dev, t5=use_t5,
                                           t5_quantize="fp8" if fp8 else "auto",
                                           t5_stream=budget is not None and use_t5, max_length=max_length)
            else:
                enc = P.load_text_encoders(files, dtype=dtype, device=dev, max_token_length=max_token_length,
                                           loras=loras)
            with enc:
                if budget is not None and getattr(enc, "t5", None) is not None:
                    log("T5 " + str(enc.t5.streamer.auto_fit(budget, lambda: enc.encode(unique[:1]))))
                host = (lambda d: {k: v.float().cpu().numpy() for k, v in d.items()})
                cond = host(enc.encode(unique))
                neg = None
                if guided:
                    neg = host(enc.encode(["" if negative_prompt is None else negative_prompt]) if sd3
                               else enc.encode_negative(unique[:1], negative_prompt))
    finally:
        memory.set_memory_limit(prev, dev)
    rows = [unique.index(p) for p in prompts]

    # 2. the denoiser: every image's latents, kept on the host
    latents = []
    prev = G._limited(dev, budget)
    try:
        with G._Stage("transformer" if sd3 else "unet", dev, stats, log):
            stream = budget is not None
            if sd3:
                net = P.load_transformer(files, dtype=dtype, device=dev, loras=loras, fp8=fp8, stream=stream)
                fit = P.fit_transformer
            else:
                net = P.load_unet_for_sampling(files, dtype=dtype, device=dev, loras=loras, fp8=fp8, stream=stream)
                fit = P.fit_unet
            if stream:
                log(str(fit(net, cond, budget, height=height, width=width, batch_size=min(batch_size, len(jobs)),
                            cfg=cfg)))
            bar = G._bar(len(jobs) * steps, progress, "denoising")
            try:
                for lo in range(0, len(jobs), batch_size):
                    batch = jobs[lo:lo + batch_size]
                    kw = dict(height=height, width=width, steps=steps, cfg=cfg, seeds=[s for _, s in batch],
                              rows=[rows[i] for i, _ in batch],
                              callback=lambda i, n, k=len(batch): bar.update(k) if bar else None)
                    if sd3:
                        z = P.sample_latents(net, cond, neg, skip_layer_guidance=slg, **kw)
                    else:
                        z = P.sample_latents(net, cond, neg, sampler=sampler, scheduler="karras" if karras
                                             else "normal", original_size=original_size, crop_coords=crop,
                                             target_size=target_size, **kw)
                    latents.extend(z.cpu().numpy())
            finally:
                if bar:
                    bar.close()
            free_model(net, dev)
            del net
    finally:
        memory.set_memory_limit(prev, dev)

    # 3. the VAE: one image at a time (tiled when a whole one does not fit the budget)
    prev = G._limited(dev, budget)
    try:
        with G._Stage("vae", dev, stats, log):
            vae_model = (P.load_vae_for_sd3 if sd3 else P.load_vae_for_sdxl)(files, dtype=dtype, device=dev)
            images = G._decode_images(vae_model, latents, P.decode_latents, dev, log)
            del vae_model
            memory.empty_cache(dev)
    finally:
        memory.set_memory_limit(prev, dev)

    if output is not None:
        _write(output, files, family, jobs, images, prompts, locals_=dict(
            negative=negative_prompt, steps=steps, cfg=cfg, width=width, height=height, loras=loras, dtype=dtype,
            fp8=fp8, sampler=sampler, karras=karras, slg=slg, use_t5=use_t5, original_size=original_size,
            crop=crop, target_size=target_size, max_token_length=max_token_length), log=log)
    return images


def _model_name(path):
    name = os.path.basename(os.path.normpath(path))
    if name in ("transformer", "unet"):  # a diffusers folder: its name
        name = os.path.basename(os.path.dirname(os.path.normpath(path)))
    return name[:-len(".safetensors")] if name.endswith(".safetensors") else name


def _write(output, files, family, jobs, images, prompts, locals_, log):
    v = locals_
    sd3 = family == "sd3"
    main = files.transformer if sd3 else files.unet
    n0 = G._next_index(output)
    for k, ((i, s), img) in enumerate(zip(jobs, images)):
        sampler = "euler" if sd3 else v["sampler"]
        schedule = "Simple" if sd3 else ("Karras" if v["karras"] else "Normal")
        neg = v["negative"] if v["cfg"] != 1.0 else None
        fields = [("Steps", v["steps"]), ("Sampler", SAMPLER_NAMES[sampler]), ("Schedule type", schedule),
                  ("CFG scale", f"{v['cfg']:g}"), ("Seed", s), ("Size", f"{v['width']}x{v['height']}"),
                  ("Model", _model_name(main))]
        if sd3:
            fields.append(("Shift", 3))
            if v["slg"] is not None:
                fields.append(("SLG", f"layers {','.join(map(str, v['slg'].layers))} scale {v['slg'].scale:g}"))
        if v["loras"]:
            fields.append(("Loras", ", ".join(f"{os.path.basename(p)}:{w:g}" for p, w in v["loras"])))
        fields.append(("Version", "FLAME"))
        info = {"family": family, "prompt": prompts[i], "negative_prompt": neg, "seed": s, "steps": v["steps"],
                "cfg": v["cfg"], "width": v["width"], "height": v["height"], "sampler": sampler,
                "scheduler": schedule.lower(), "model": main, "vae": files.vae, "clip_l": files.clip_l,
                "clip_g": files.clip_g, "loras": [[p, w] for p, w in v["loras"]],
                "dtype": str(v["dtype"]).replace("flame.", ""), "fp8": bool(v["fp8"])}
        if sd3:
            info.update(t5=files.t5 if v["use_t5"] else None, variant=files.variant,
                        skip_layer_guidance=None if v["slg"] is None else {"layers": list(v["slg"].layers),
                                                                           "scale": v["slg"].scale})
        else:
            h, w = v["original_size"] or (v["height"], v["width"])
            th, tw = v["target_size"] or (v["height"], v["width"])
            info.update(original_size=[h, w], crop_coords=list(v["crop"]), target_size=[th, tw],
                        max_token_length=v["max_token_length"])
        text = {"parameters": sd_parameters(prompts[i], neg, fields), "flame": json.dumps(info)}
        path = G.save_png(img, os.path.join(output, f"{n0 + k:05d}-{s}.png"), text)
        log(f"wrote {path}")


def family_of(model, arch=None):
    """The family ("flux", "sd3", "sdxl") of a model argument: a path, or FluxFiles / SD3Files / SDXLFiles."""
    from .flux.components import FluxFiles
    from .sd3.components import SD3Files
    from .sdxl.components import SDXLFiles
    for cls, fam in ((FluxFiles, "flux"), (SD3Files, "sd3"), (SDXLFiles, "sdxl")):
        if isinstance(model, cls):
            if arch is not None and arch != fam:
                raise G.GenerateError(f"--arch {arch}: the model given is {fam}")
            return fam
    # files of no family go to Flux's checks, which say what they are instead
    return detect_family(model, arch, error=G.GenerateError, default="flux")[0]


__all__ = ["generate_sd", "family_of", "sd_parameters", "SD_OPTIONS", "SAMPLER_NAMES", "SDXL_DEFAULTS"]
