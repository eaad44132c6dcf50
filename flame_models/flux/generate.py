"""Flux's part of `python -m flame_models.generate` (flame_models/generate.py runs it for Flux files): the rectified
flow Euler (or --sampler heun / dpmpp_2m / dpmpp_2m_sde / unipc) sampler with the embedded guidance of flux-dev
(default 28 steps, guidance 3.5; schnell: 4 steps, no guidance), T5's max_length (dev 512, schnell 256), the LoRAs on
the transformer."""
import json
import math
import random

from .. import generate as G
from ..samplers.flow import DISPLAY_NAMES
from ..samplers.flow_schedules import DISPLAY_NAMES as SCHEDULES
from ..samplers.img2img import DEFAULT_STRENGTH
from . import pipeline as P
from .components import FluxFiles, find_flux_files

FILES = FluxFiles
OPTIONS = {"guidance": "Flux's embedded guidance", "max_length": None, "sampler": None, "scheduler": None,
           "prompt_weights": None, "true_cfg": "Flux's true classifier-free guidance", "true_cfg_start": None,
           "negative_prompt": None,
           **G.IMAGE_OPTIONS}
NOTES = {"cfg": "its guidance is embedded (--guidance); true classifier-free guidance: --true-cfg",
         "karras": "use --scheduler karras (its own sigmas respaced as Karras's)"}
DEV_DEFAULTS = {"steps": 28, "guidance": 3.5}   # diffusers' FluxPipeline defaults for flux-dev
SCHNELL_STEPS = 4


def generate(model, prompts, *, vae=None, clip_l=None, t5=None, tokenizer=None, loras=(), width=1024, height=1024,
             steps=None, guidance=None, seed=None, num_images=1, batch_size=1, output=None, device=None, dtype=None,
             fp8=False, max_gpu_memory=None, max_length=None, sampler=None, scheduler=None,
             prompt_weights=False, true_cfg=None, true_cfg_start=None, negative_prompt=None, progress=True,
             stats=None, log=print, **image):
    """Flux text-to-image (flame_models.generate.generate says what the arguments mean). model: a diffusers Flux
    folder, a transformer file (with vae=, clip_l=, t5=) or FluxFiles. sampler: "euler" (default), "heun" or
    "dpmpp_2m".
    image: image-to-image and inpainting (generate.InitImage's keywords: init_image, strength, mask, ...).
    prompt_weights: ComfyUI's "(text:1.2)" weights on T5's states (conditioning/prompt_weights.py). true_cfg: true
    classifier-free guidance (diffusers' true_cfg_scale, > 1) against negative_prompt (default "": diffusers needs
    one given), each step running both (bfl/true_cfg.py); from step true_cfg_start on (0-based, of the steps that run;
    the earlier ones run the prompt alone)."""
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    guided, negative = G.check_true_cfg(true_cfg, negative_prompt)
    cfg_start = G.check_true_cfg_start(true_cfg_start, guided)
    prompt_weights = G.check_prompt_weights(prompts, negative, prompt_weights, log)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed)
    sampler = G.flow_sampler(sampler, "Flux")
    scheduler = G.flow_scheduler(scheduler, "Flux")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)
    files = model if isinstance(model, FluxFiles) else find_flux_files(model, vae=vae, clip_l=clip_l, t5=t5,
                                                                         tokenizer=tokenizer)
    is_dev = files.is_dev
    if not is_dev and guidance is not None:
        raise G.GenerateError(f"--guidance: {files.transformer} is schnell-like (no guidance embedding); leave it out")
    steps = steps if steps is not None else (DEV_DEFAULTS["steps"] if is_dev else SCHNELL_STEPS)
    guidance = (float(guidance) if guidance is not None else DEV_DEFAULTS["guidance"]) if is_dev else None
    if guidance is not None and not math.isfinite(guidance):
        raise G.GenerateError(f"--guidance {guidance}: not a finite number")
    loras = P.check_loras(loras, files.params)
    output = G._check_output(output)
    init = G.InitImage(width, height, default=DEFAULT_STRENGTH, **image)
    steps_run = init.steps_run(steps)
    clip_tok, t5_tok = P.load_tokenizers(files, max_length=max_length)
    P.check_vocabularies(files, clip_tok, t5_tok)
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]     # (prompt row, seed)
    init.check_jobs(len(jobs))

    def encode(unique):
        with P.load_text_encoders(files, dtype=dtype, device=dev, t5_quantize="fp8" if fp8 else "auto",
                                  t5_stream=budget is not None, max_length=max_length,
                                  prompt_weights=prompt_weights, loras=loras) as enc:
            out = G.encode_prompts(enc, unique, budget, log)
            neg = G.host_arrays(enc.encode([negative])) if guided else None
        init.encode(lambda: P.load_vae_for_flux(files, dtype=dtype, device=dev), P.encode_images, dev, log)
        return out, neg

    stages = G.Stages(
        encode=encode, denoiser="transformer",
        load=lambda: P.load_transformer(files, dtype=dtype, device=dev, loras=loras, fp8=fp8,
                                        stream=budget is not None),
        # (under true CFG a step runs two images per image: the budget's fit counts them)
        fit=lambda net, cond, n: P.fit_transformer(net, cond[0], budget, height=height, width=width,
                                                   batch_size=n * (2 if guided else 1), guidance=guidance),
        sample=lambda net, cond, seeds, rows, callback, jobs: P.sample_latents(
            net, cond[0], height=height, width=width, steps=steps, guidance=guidance, seeds=seeds, rows=rows,
            callback=callback, sampler=sampler, scheduler=scheduler, neg=cond[1],
            true_cfg=true_cfg if guided else 1.0, true_cfg_start=cfg_start, **init.sample_kwargs(jobs)),
        load_vae=lambda: P.load_vae_for_flux(files, dtype=dtype, device=dev), decode=P.decode_latents)
    images = G.run_stages(stages, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps_run,
                          progress=progress, stats=stats, log=log)
    images = init.finish(images)

    if output is not None:
        name = G.model_name(files.transformer)

        def text_of(i, s):
            info = {"prompt": prompts[i], "negative_prompt": negative, "true_cfg": float(true_cfg) if guided else None,
                    "true_cfg_start": cfg_start if guided else None, "seed": s, "steps": steps, "guidance": guidance,
                    "width": width, "height": height, "model": files.transformer, "vae": files.vae,
                    "clip_l": files.clip_l, "t5": files.t5, "loras": [[p, w] for p, w in loras], "sampler": sampler,
                    "scheduler": scheduler, "dtype": str(dtype).replace("flame.", ""), "fp8": bool(fp8), **init.info()}
            fields = [("Steps", steps), ("Sampler", DISPLAY_NAMES[sampler]), ("Schedule type", SCHEDULES[scheduler]),
                      ("CFG scale", f"{float(true_cfg):g}" if guided else 1),
                      ("Distilled CFG Scale", None if guidance is None else f"{guidance:g}"), ("Seed", s),
                      ("Size", f"{width}x{height}"), *init.fields(), ("Model", name), *G.lora_field(loras),
                      ("Version", "FLAME")]
            return {"parameters": G.parameters_text(prompts[i], negative, fields), "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
