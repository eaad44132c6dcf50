"""Flux Kontext's part of `python -m flame_models.generate`: image editing with `--image ref.png` (resized to Kontext's
resolution list, encoded by the VAE, its tokens appended at every step), FLUX.1-dev's embedded guidance (default
28 steps, guidance 2.5 as BFL's Kontext examples use), the LoRAs on the transformer. The output size is --width /
--height (default 1024x1024, as diffusers')."""
import json
import math
import random
from dataclasses import dataclass

from .. import generate as G
from ..bfl import conditioning as C
from ..bfl.components import FluxFiles, find_flux_files
from ..bfl.vae import decode_latents
from ..samplers.flow import DISPLAY_NAMES
from ..samplers.flow_schedules import DISPLAY_NAMES as SCHEDULES
from . import pipeline as P


@dataclass
class KontextFiles(FluxFiles):
    """A Flux Kontext model's parts (FluxFiles: the transformer is FLUX.1-dev-shaped)."""


FILES = KontextFiles
OPTIONS = {"guidance": "Flux's embedded guidance", "max_length": None, "image": None, "keep_image_size": None,
           "sampler": None, "scheduler": None, "prompt_weights": None, "true_cfg": None, "true_cfg_start": None,
           "negative_prompt": None}
NOTES = {"cfg": "its guidance is embedded (--guidance); true classifier-free guidance: --true-cfg",
         "karras": "use --scheduler karras (its own sigmas respaced as Karras's)",
         **{name: "it edits the reference image given with --image, from noise" for name in G.IMAGE_OPTIONS}}
DEFAULTS = {"steps": 28, "guidance": 2.5}


def find_files(model, **parts):
    files = model if isinstance(model, FluxFiles) else find_flux_files(model, **parts)
    if not files.is_dev:
        raise G.GenerateError(f"{files.transformer}: Kontext is FLUX.1-dev-shaped (a guidance embedding); this "
                              f"transformer has none")
    return KontextFiles(**{k: getattr(files, k) for k in FluxFiles.__dataclass_fields__})


def generate(model, prompts, *, image=None, keep_image_size=False, vae=None, clip_l=None, t5=None, tokenizer=None,
             loras=(), width=1024, height=1024, steps=None, guidance=None, seed=None, num_images=1, batch_size=1,
             output=None, device=None, dtype=None, fp8=False, max_gpu_memory=None, max_length=None, sampler=None,
             scheduler=None, prompt_weights=False, true_cfg=None, true_cfg_start=None, negative_prompt=None,
             progress=True, stats=None, log=print):
    """Flux Kontext image editing (flame_models.generate.generate says what the arguments mean); image: the
    reference image's path (required), resized to Kontext's resolution list (diffusers' default) or, with
    keep_image_size, kept at its own size floored to 16 (diffusers' `_auto_resize=False`); sampler: "euler"
    (default), "heun", "dpmpp_2m", "dpmpp_2m_sde" or "unipc". prompt_weights: ComfyUI's "(text:1.2)" weights on
    T5's states (conditioning/prompt_weights.py). true_cfg / negative_prompt: true classifier-free guidance, as
    Flux's (diffusers' FluxKontextPipeline true_cfg_scale; bfl/true_cfg.py), from step true_cfg_start on."""
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    guided, negative = G.check_true_cfg(true_cfg, negative_prompt)
    cfg_start = G.check_true_cfg_start(true_cfg_start, guided)
    prompt_weights = G.check_prompt_weights(prompts, negative, prompt_weights, log)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed)
    if image is None:
        raise G.GenerateError("--image: Flux Kontext edits a reference image; pass --image ref.png")
    sampler = G.flow_sampler(sampler, "Flux Kontext")
    scheduler = G.flow_scheduler(scheduler, "Flux Kontext")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)
    files = find_files(model, vae=vae, clip_l=clip_l, t5=t5, tokenizer=tokenizer)
    steps = DEFAULTS["steps"] if steps is None else steps
    guidance = float(DEFAULTS["guidance"] if guidance is None else guidance)
    if not math.isfinite(guidance):
        raise G.GenerateError(f"--guidance {guidance}: not a finite number")
    pixels = P.read_reference(image, auto_resize=not keep_image_size)
    loras = P.check_loras(loras, files.params)
    output = G._check_output(output)
    clip_tok, t5_tok = C.load_tokenizers(files, max_length=max_length)
    C.check_vocabularies(files, clip_tok, t5_tok)
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]

    def encode(unique):
        with C.load_text_encoders(files, dtype=dtype, device=dev, t5_quantize="fp8" if fp8 else "auto",
                                  t5_stream=budget is not None, max_length=max_length,
                                  prompt_weights=prompt_weights, loras=loras) as enc:
            out = G.encode_prompts(enc, unique, budget, log)
            neg = G.host_arrays(enc.encode([negative])) if guided else None
        vae_model = P.load_vae_for_flux(files, dtype=dtype, device=dev)
        out.update(P.encode_reference(vae_model, pixels))
        del vae_model
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
            true_cfg=float(true_cfg) if guided else 1.0, true_cfg_start=cfg_start),
        load_vae=lambda: P.load_vae_for_flux(files, dtype=dtype, device=dev), decode=decode_latents)
    images = G.run_stages(stages, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps,
                          progress=progress, stats=stats, log=log)

    if output is not None:
        name = G.model_name(files.transformer)

        def text_of(i, s):
            info = {"prompt": prompts[i], "negative_prompt": negative, "true_cfg": float(true_cfg) if guided else None,
                    "true_cfg_start": cfg_start if guided else None,
                    "image": str(image), "reference_size": list(pixels.shape[:1:-1]),
                    "seed": s, "steps": steps, "guidance": guidance,
                    "width": width, "height": height, "model": files.transformer, "vae": files.vae,
                    "loras": [[p, w] for p, w in loras], "sampler": sampler, "scheduler": scheduler,
                    "dtype": str(dtype).replace("flame.", ""), "fp8": bool(fp8)}
            fields = [("Steps", steps), ("Sampler", DISPLAY_NAMES[sampler]), ("Schedule type", SCHEDULES[scheduler]),
                      ("CFG scale", f"{float(true_cfg):g}" if guided else 1), ("Distilled CFG Scale", f"{guidance:g}"),
                      ("Seed", s),
                      ("Size", f"{width}x{height}"), ("Model", name), *G.lora_field(loras), ("Version", "FLAME")]
            return {"parameters": G.parameters_text(prompts[i], negative, fields), "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
