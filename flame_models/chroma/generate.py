"""Chroma's part of `python -m flame_models.generate`: T5 with its padding mask, the Euler sampler with true
classifier-free guidance (--cfg, default 5.0; the negative prompt --negative-prompt, default
""), 35 steps (ChromaPipeline's defaults), the LoRAs on the transformer."""
import json
import math
import random

from .. import generate as G
from ..bfl.vae import decode_latents, encode_images, load_vae_for_flux
from ..samplers.flow import DISPLAY_NAMES
from ..samplers.flow_schedules import DISPLAY_NAMES as SCHEDULES
from ..samplers.img2img import DEFAULT_STRENGTH
from . import conditioning as C
from . import pipeline as P
from .components import ChromaFiles, find_chroma_files

FILES = ChromaFiles
OPTIONS = {"negative_prompt": None, "cfg": None, "max_length": None, "sampler": None, "scheduler": None,
           **G.IMAGE_OPTIONS}
NOTES = {"guidance": "it has no guidance embedding; use --cfg (classifier-free guidance)",
         "karras": "use --scheduler karras (its own sigmas respaced as Karras's)"}
DEFAULTS = {"steps": 35, "cfg": 5.0}     # diffusers ChromaPipeline's defaults


def generate(model, prompts, *, negative_prompt=None, cfg=None, vae=None, clip_l=None, t5=None, tokenizer=None,
             loras=(), width=1024, height=1024, steps=None, seed=None, num_images=1, batch_size=1, output=None,
             device=None, dtype=None, fp8=False, max_gpu_memory=None, max_length=None, sampler=None, scheduler=None,
             progress=True, stats=None, log=print, **image):
    """Chroma text-to-image (flame_models.generate.generate says what the arguments mean). model: a diffusers
    Chroma folder, a Chroma / ComfyUI transformer file (with vae=, t5=) or ChromaFiles. sampler: "euler" (default),
    "heun", "dpmpp_2m", "dpmpp_2m_sde" or "unipc".
    image: image-to-image and inpainting (generate.InitImage's keywords: init_image, strength, mask, ...)."""
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed, family="Chroma")
    if clip_l is not None:
        raise G.GenerateError("--clip-l: Chroma has no CLIP (T5 only)")
    sampler = G.flow_sampler(sampler, "Chroma")
    scheduler = G.flow_scheduler(scheduler, "Chroma")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)
    files = model if isinstance(model, ChromaFiles) else find_chroma_files(model, vae=vae, t5=t5,
                                                                             tokenizer=tokenizer)
    steps = DEFAULTS["steps"] if steps is None else steps
    cfg = float(DEFAULTS["cfg"] if cfg is None else cfg)
    if not math.isfinite(cfg):
        raise G.GenerateError(f"--cfg {cfg}: not a finite number")
    negative = "" if negative_prompt is None else str(negative_prompt)
    guided = cfg > 1.0
    loras = P.check_loras(loras, files.params)
    output = G._check_output(output)
    init = G.InitImage(width, height, default=DEFAULT_STRENGTH, **image)
    steps_run = init.steps_run(steps)
    C.check_vocabulary(files, C.load_tokenizer_for(files, max_length=max_length))
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]
    init.check_jobs(len(jobs))

    def encode(unique):
        with C.load_text_encoders(files, dtype=dtype, device=dev, t5_quantize="fp8" if fp8 else "auto",
                                  t5_stream=budget is not None, max_length=max_length) as enc:
            out = G.encode_prompts(enc, unique, budget, log)
            if guided:
                out.update({f"negative_{k}": v for k, v in G.host_arrays(enc.encode([negative])).items()})
        init.encode(lambda: load_vae_for_flux(files.vae, dtype=dtype, device=dev), encode_images, dev, log)
        return out

    def negative_of(cond):
        return {k: cond[f"negative_{k}"] for k in ("prompt_embeds", "prompt_mask")} if guided else None

    stages = G.Stages(
        encode=encode, denoiser="transformer",
        load=lambda: P.load_transformer(files, dtype=dtype, device=dev, loras=loras, fp8=fp8,
                                        stream=budget is not None),
        fit=lambda net, cond, n: P.fit_transformer(net, cond, budget, height=height, width=width, batch_size=n,
                                                   guided=guided),
        sample=lambda net, cond, seeds, rows, callback, jobs: P.sample_latents(
            net, cond, negative_of(cond), height=height, width=width, steps=steps, cfg=cfg, seeds=seeds, rows=rows,
            callback=callback, sampler=sampler, scheduler=scheduler, **init.sample_kwargs(jobs)),
        load_vae=lambda: load_vae_for_flux(files.vae, dtype=dtype, device=dev), decode=decode_latents)
    images = G.run_stages(stages, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps_run,
                          progress=progress, stats=stats, log=log)
    images = init.finish(images)

    if output is not None:
        name = G.model_name(files.transformer)

        def text_of(i, s):
            info = {"prompt": prompts[i], "negative_prompt": negative, "seed": s, "steps": steps, "cfg": cfg,
                    "width": width, "height": height, "model": files.transformer, "vae": files.vae, "t5": files.t5,
                    "loras": [[p, w] for p, w in loras], "sampler": sampler, "scheduler": scheduler,
                    "dtype": str(dtype).replace("flame.", ""), "fp8": bool(fp8), **init.info()}
            fields = [("Steps", steps), ("Sampler", DISPLAY_NAMES[sampler]), ("Schedule type", SCHEDULES[scheduler]),
                      ("CFG scale", f"{cfg:g}"), ("Seed", s), ("Size", f"{width}x{height}"), *init.fields(),
                      ("Model", name), *G.lora_field(loras), ("Version", "FLAME")]
            return {"parameters": G.parameters_text(prompts[i], negative if guided else None, fields),
                    "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
