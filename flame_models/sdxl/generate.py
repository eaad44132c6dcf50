"""SDXL's part of `python -m flame_models.generate` (flame_models/generate.py runs it for SDXL files): euler,
euler_ancestral, heun, dpm_2, dpm_2_ancestral, dpmpp_2m, dpmpp_2m_sde, ddim, unipc or lcm (with an LCM-LoRA; its
own timesteps) on the 'normal' (diffusers' SDXL spacing) or Karras schedule, classifier-free guidance (default 30 steps,
cfg 5); the negative prompt defaults to zeros (diffusers' force_zeros_for_empty_prompt); size conditioning from
--original-size / --crop / --target-size (default: the image's size, no crop);
--max-token-length 150 / 225 encodes long captions in 75-token chunks (kohya's rule). A LoRA file changes each part
it has keys for: the UNet, and CLIP-L / CLIP-G for its text-encoder keys (pipeline.check_loras). The VAE decodes in
bfloat16 or float32 (a float16 request gives float32: the SDXL VAE overflows in float16). Every input is checked
before anything is loaded."""
import json
import math
import random

from .. import generate as G
from ..conditioning.embeddings import EmbeddingError, load_embedding
from ..conditioning.encoders import check_max_token_length
from ..numbers import as_float
from ..samplers import LCM_ORIGINAL_STEPS
from ..samplers.img2img import SDXL_DEFAULT_STRENGTH
from . import pipeline as P
from .components import SDXLFiles, find_sdxl_files
from .conditioning import check_vocabularies, load_tokenizers
from .freeu import parse_freeu

FILES = SDXLFiles
OPTIONS = {"negative_prompt": None, "clip_g": None, "cfg": None, "sampler": None, "karras": None,
           "original_size": None, "crop": None, "target_size": None, "max_token_length": None, "configs": None,
           "freeu": None, "prompt_weights": None, "embeddings": None, "guidance_rescale": None, **G.IMAGE_OPTIONS}
INIT_MULTIPLE = 32   # an init image's own size is floored to it (SDXL's UNet halves the latents twice)
NOTES = {"guidance": "it uses classifier-free guidance (--cfg)", "no_t5": "it has no T5",
         "scheduler": "--karras gives Karras sigmas (the default: the model's own)"}
DEFAULTS = {"steps": 30, "cfg": 5.0, "sampler": "euler"}
SAMPLER_NAMES = {"euler": "Euler", "euler_ancestral": "Euler a", "heun": "Heun", "dpm_2": "DPM2",
                 "dpm_2_ancestral": "DPM2 a", "dpmpp_2m": "DPM++ 2M", "dpmpp_2m_sde": "DPM++ 2M SDE", "ddim": "DDIM",
                 "lcm": "LCM", "unipc": "UniPC", "ddpm": "DDPM"}


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


def generate(model, prompts, *, negative_prompt=None, vae=None, clip_l=None, clip_g=None, t5=None, tokenizer=None,
             loras=(), width=1024, height=1024, steps=None, cfg=None, sampler=None, karras=False, original_size=None,
             crop=None, target_size=None, max_token_length=None, seed=None, num_images=1, batch_size=1, output=None,
             device=None, dtype=None, fp8=False, max_gpu_memory=None, configs=None, freeu=None,
             prompt_weights=False, embeddings=(), guidance_rescale=None, progress=True, stats=None, log=print,
             **image):
    """SDXL text-to-image (flame_models.generate.generate says what the shared arguments mean). model: an SAI file
    (sd_xl_base_1.0.safetensors), a diffusers folder, a UNet file with the other parts given, or SDXLFiles.
    image: image-to-image and inpainting (generate.InitImage's keywords: init_image, strength, mask, ...). freeu: FreeU
    on the UNet's decoder -- True (SDXL's published factors), or a dict / "b1=1.3,s2=0.2" of some of s1, s2, b1, b2
    (the rest SDXL's; flame_models/sdxl/freeu.py). prompt_weights: read ComfyUI's "(text:1.2)" weights in the
    prompts and the negative prompt (flame_models/conditioning/prompt_weights.py); without it parentheses are text, as
    in diffusers. embeddings: textual inversions, ["path.safetensors[:token]"] (SDXL embedding files: clip_l and
    clip_g vectors), named in the prompts by their token or ComfyUI's embedding:token
    (flame_models/conditioning/embeddings.py). guidance_rescale: diffusers' (0 to 1; 0.7 for v-prediction models with
    zero terminal SNR), with cfg != 1."""
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if isinstance(model, SDXLFiles):
        files = model
    else:
        if t5 is not None:
            raise G.GenerateError(f"--t5 {t5}: SDXL has no T5 text encoder")
        files = find_sdxl_files(model, vae=vae, clip_l=clip_l, clip_g=clip_g, tokenizer=tokenizer, configs=configs)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed,
                  multiple=8 * files.config.downsample_factor, family="SDXL")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)

    # settings, checked before anything is loaded
    sampler = sampler or DEFAULTS["sampler"]
    if sampler not in P.SAMPLERS:
        raise G.GenerateError(f"--sampler {sampler}: one of {', '.join(P.SAMPLERS)}")
    if karras and sampler in ("ddim", "ddpm", "lcm"):
        raise G.GenerateError(f"--karras: {sampler} walks its own timesteps; use another sampler")
    if sampler == "lcm" and steps is not None and steps > LCM_ORIGINAL_STEPS:
        raise G.GenerateError(f"--steps {steps}: lcm takes at most {LCM_ORIGINAL_STEPS} (its timesteps are a subset of "
                              f"LCM's distillation schedule; 4-8 is usual)")
    try:
        check_max_token_length(max_token_length)
    except ValueError as e:
        raise G.GenerateError(f"--max-token-length: {e}") from None
    original_size, target_size = _size(original_size, "original-size"), _size(target_size, "target-size")
    crop = _crop(crop)
    loras = P.check_loras(loras, files.config)
    steps = steps if steps is not None else DEFAULTS["steps"]
    cfg = float(cfg) if cfg is not None else float(DEFAULTS["cfg"])
    if not math.isfinite(cfg) or cfg <= 0:
        raise G.GenerateError(f"--cfg {cfg}: a finite number > 0")
    if negative_prompt is not None and cfg == 1.0:
        raise G.GenerateError("--negative-prompt: without classifier-free guidance (--cfg 1) it has no effect")
    rescale = 0.0 if guidance_rescale is None else as_float(guidance_rescale)
    if not 0.0 <= rescale <= 1.0:
        raise G.GenerateError(f"--guidance-rescale {guidance_rescale!r}: a number in [0, 1]")
    if rescale and cfg == 1.0:
        raise G.GenerateError("--guidance-rescale: rescales classifier-free guidance; without it (--cfg 1) it has no "
                              "effect")
    if image.get("init_image") is not None and sampler == "lcm":
        raise G.GenerateError("--init-image: image-to-image with --sampler lcm is not supported (LCM's timesteps "
                              "depend on the strength); use another sampler")
    try:
        freeu = parse_freeu(freeu)
    except ValueError as e:
        raise G.GenerateError(f"--freeu: {e}") from None
    prompt_weights = G.check_prompt_weights(prompts, negative_prompt, prompt_weights, log)
    try:
        embeddings = [load_embedding(e) for e in (embeddings or ())]
    except EmbeddingError as e:
        raise G.GenerateError(f"--embedding: {e}") from None
    known = {e.token for e in embeddings}
    for text in prompts + ([negative_prompt] if isinstance(negative_prompt, str) else []):
        for word in text.replace("\n", " ").split(" "):
            name = word[len("embedding:"):].rstrip(",") if word.startswith("embedding:") else None
            if name is not None and name not in known:
                raise G.GenerateError(f"{word!r} in {text[:60]!r}: no such embedding; load it with --embedding "
                                      f"PATH (its token: the file's name, or PATH:token)")
    init = G.InitImage(width, height, default=SDXL_DEFAULT_STRENGTH, rounding="sdxl", **image)
    steps_run = init.steps_run(steps)
    output = G._check_output(output)
    check_vocabularies(files, *load_tokenizers(files))
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]     # (prompt row, seed)
    init.check_jobs(len(jobs))
    guided = cfg != 1.0

    def encode(unique):
        """(cond, neg): the prompts' conditioning and, under CFG, the negative prompt's, as host arrays."""
        def host(d):
            return {k: v.float().cpu().numpy() for k, v in d.items()}
        with P.load_text_encoders(files, dtype=dtype, device=dev, max_token_length=max_token_length,
                                  loras=loras, prompt_weights=prompt_weights, embeddings=embeddings) as enc:
            cond = host(enc.encode(unique))
            neg = host(enc.encode_negative(unique[:1], negative_prompt)) if guided else None
        init.encode(lambda: P.load_vae_for_sdxl(files, dtype=dtype, device=dev), P.encode_images, dev, log)
        return cond, neg

    stages = G.Stages(
        encode=encode, denoiser="unet",
        load=lambda: P.load_unet_for_sampling(files, dtype=dtype, device=dev, loras=loras, fp8=fp8,
                                              stream=budget is not None, freeu=freeu),
        fit=lambda net, cond, n: P.fit_unet(net, cond[0], budget, height=height, width=width, batch_size=n,
                                            cfg=cfg),
        sample=lambda net, cond, seeds, rows, callback, jobs: P.sample_latents(
            net, *cond, height=height, width=width, steps=steps, cfg=cfg, seeds=seeds, rows=rows, callback=callback,
            sampler=sampler, scheduler="karras" if karras else "normal", original_size=original_size,
            crop_coords=crop, target_size=target_size, guidance_rescale=rescale, **init.sample_kwargs(jobs)),
        load_vae=lambda: P.load_vae_for_sdxl(files, dtype=dtype, device=dev), decode=P.decode_latents)
    images = G.run_stages(stages, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps_run,
                          progress=progress, stats=stats, log=log)
    images = init.finish(images)

    if output is not None:
        neg = negative_prompt if guided else None
        name = G.model_name(files.unet)
        schedule = "Karras" if karras else "Normal"
        oh, ow = original_size or (height, width)
        th, tw = target_size or (height, width)

        def text_of(i, s):
            fields = [("Steps", steps), ("Sampler", SAMPLER_NAMES[sampler]), ("Schedule type", schedule),
                      ("CFG scale", f"{cfg:g}"), ("CFG rescale", f"{rescale:g}" if rescale else None), ("Seed", s),
                      ("Size", f"{width}x{height}"), *init.fields(), ("Model", name), *G.lora_field(loras),
                      ("Version", "FLAME")]
            info = {"family": "sdxl", "prompt": prompts[i], "negative_prompt": neg, "seed": s, "steps": steps,
                    "cfg": cfg, "guidance_rescale": rescale, "width": width, "height": height, "sampler": sampler,
                    "scheduler": schedule.lower(),
                    "model": files.unet, "vae": files.vae, "clip_l": files.clip_l, "clip_g": files.clip_g,
                    "loras": [[p, w] for p, w in loras], "dtype": str(dtype).replace("flame.", ""), "fp8": bool(fp8),
                    "original_size": [oh, ow], "crop_coords": list(crop), "target_size": [th, tw],
                    "max_token_length": max_token_length, "freeu": freeu, "prompt_weights": prompt_weights,
                    "embeddings": [[e.path, e.token] for e in embeddings], **init.info()}
            return {"parameters": G.parameters_text(prompts[i], neg, fields), "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
