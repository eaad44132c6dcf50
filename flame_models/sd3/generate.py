"""SD3 / SD3.5's part of `python -m flame_models.generate` (flame_models/generate.py runs it for SD3 files): Euler (or
--sampler heun / dpmpp_2m / dpmpp_2m_sde / unipc) on the shifted flow schedule with classifier-free guidance; defaults
per release from sampling.SAMPLING_DEFAULTS -- Large 40 steps cfg 4.5, Large Turbo 4 steps cfg 1 (recognised by "turbo"
in its file or folder name, its weights being shaped as Large's), Medium (an MMDiT-X) 50 steps cfg 5 with skip-layer
guidance on blocks 7-9 (SAI's reference; --slg-scale 0 turns it off). The negative prompt defaults to "" (diffusers);
without T5 its tokens are zeros. Every input is checked before anything is loaded."""
import json
import math
import random

from .. import generate as G
from ..samplers.flow import DISPLAY_NAMES
from ..samplers.flow_schedules import DISPLAY_NAMES as SCHEDULES
from ..samplers.img2img import DEFAULT_STRENGTH
from . import pipeline as P
from .components import SD3Files, find_sd3_files
from .conditioning import check_vocabularies, load_tokenizers
from .sampling import SAMPLING_DEFAULTS, SkipLayerGuidance

FILES = SD3Files
OPTIONS = {"negative_prompt": None, "clip_g": None, "cfg": None, "slg_scale": None, "slg_layers": None,
           "no_t5": None, "max_length": None, "configs": None, "sampler": None, "scheduler": None,
           "prompt_weights": None, **G.IMAGE_OPTIONS}
NOTES = {name: "it samples on its flow schedule, without size conditioning"
         for name in ("original_size", "crop", "target_size", "max_token_length")}
NOTES.update(karras="use --scheduler karras (its own sigmas respaced as Karras's)",
             guidance="it uses classifier-free guidance (--cfg)")


def _slg(files, slg_scale, slg_layers, log):
    """The skip-layer guidance of an SD3 run: SAMPLING_DEFAULTS' for Medium, or as the options say."""
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


def generate(model, prompts, *, negative_prompt=None, vae=None, clip_l=None, clip_g=None, t5=None, tokenizer=None,
             loras=(), width=1024, height=1024, steps=None, cfg=None, slg_scale=None, slg_layers=None, no_t5=False,
             seed=None, num_images=1, batch_size=1, output=None, device=None, dtype=None, fp8=False,
             max_gpu_memory=None, max_length=None, configs=None, sampler=None, scheduler=None,
             prompt_weights=False, progress=True, stats=None, log=print, **image):
    """SD3 / SD3.5 text-to-image (flame_models.generate.generate says what the shared arguments mean). model: an
    SAI file holding every part, a diffusers folder, an MMDiT file with the other parts given, or SD3Files.
    sampler: "euler" (default), "heun", "dpmpp_2m" or "unipc".
    image: image-to-image and inpainting (generate.InitImage's keywords: init_image, strength, mask, ...).
    prompt_weights: ComfyUI's "(text:1.2)" weights on CLIP-L, CLIP-G and T5 (conditioning/prompt_weights.py)."""
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    prompt_weights = G.check_prompt_weights(prompts, negative_prompt, prompt_weights, log)
    sampler = G.flow_sampler(sampler, "SD3")
    scheduler = G.flow_scheduler(scheduler, "SD3")
    files = model if isinstance(model, SD3Files) else find_sd3_files(
        model, clip_l=clip_l, clip_g=clip_g, t5=t5, vae=vae, tokenizer=tokenizer, configs=configs)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed, multiple=16, family="SD3")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)

    # settings, checked before anything is loaded
    defaults = SAMPLING_DEFAULTS[files.variant]
    slg = _slg(files, slg_scale, slg_layers, log)
    use_t5 = files.t5 is not None and not no_t5
    if no_t5 and files.t5 is None:
        raise G.GenerateError(f"--no-t5: {files.transformer} comes without T5 already")
    if files.t5 is None:
        log("no T5 in this model: its tokens are zeros (as the SD3 reference allows)")
    loras = P.check_loras(loras, files.params)
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
    init = G.InitImage(width, height, default=DEFAULT_STRENGTH, **image)
    steps_run = init.steps_run(steps)
    if slg is not None and not any(slg.active(i, steps) for i in range(steps - steps_run, steps)):
        log(f"skip-layer guidance: no step of {steps} that runs falls in its window ({slg.start:g} to {slg.stop:g} "
            f"of the steps); running without")
        slg = None
    output = G._check_output(output)
    toks = load_tokenizers(files, max_length=max_length)
    check_vocabularies(files, *toks[:2], toks[2] if use_t5 else None)
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]     # (prompt row, seed)
    init.check_jobs(len(jobs))
    guided = cfg != 1.0

    def encode(unique):
        """(cond, neg): the prompts' conditioning and, under CFG, the negative prompt's, as host arrays."""
        with P.load_text_encoders(files, dtype=dtype, device=dev, t5=use_t5, t5_quantize="fp8" if fp8 else "auto",
                                  t5_stream=budget is not None and use_t5, max_length=max_length,
                                  prompt_weights=prompt_weights, loras=loras) as enc:
            cond = G.encode_prompts(enc, unique, budget, log)
            neg = G.host_arrays(enc.encode(["" if negative_prompt is None else negative_prompt])) if guided else None
        init.encode(lambda: P.load_vae_for_sd3(files, dtype=dtype, device=dev), P.encode_images, dev, log)
        return cond, neg

    stages = G.Stages(
        encode=encode, denoiser="transformer",
        load=lambda: P.load_transformer(files, dtype=dtype, device=dev, loras=loras, fp8=fp8,
                                        stream=budget is not None),
        fit=lambda net, cond, n: P.fit_transformer(net, cond[0], budget, height=height, width=width, batch_size=n,
                                                   cfg=cfg),
        sample=lambda net, cond, seeds, rows, callback, jobs: P.sample_latents(
            net, *cond, height=height, width=width, steps=steps, cfg=cfg, seeds=seeds, rows=rows, callback=callback,
            skip_layer_guidance=slg, sampler=sampler, scheduler=scheduler, **init.sample_kwargs(jobs)),
        load_vae=lambda: P.load_vae_for_sd3(files, dtype=dtype, device=dev), decode=P.decode_latents)
    images = G.run_stages(stages, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps_run,
                          progress=progress, stats=stats, log=log)
    images = init.finish(images)

    if output is not None:
        neg = negative_prompt if guided else None
        name = G.model_name(files.transformer)

        def text_of(i, s):
            fields = [("Steps", steps), ("Sampler", DISPLAY_NAMES[sampler]), ("Schedule type", SCHEDULES[scheduler]),
                      ("CFG scale", f"{cfg:g}"), ("Seed", s), ("Size", f"{width}x{height}"), *init.fields(),
                      ("Model", name), ("Shift", 3)]
            if slg is not None:
                fields.append(("SLG", f"layers {','.join(map(str, slg.layers))} scale {slg.scale:g}"))
            fields += [*G.lora_field(loras), ("Version", "FLAME")]
            info = {"family": "sd3", "prompt": prompts[i], "negative_prompt": neg, "seed": s, "steps": steps,
                    "cfg": cfg, "width": width, "height": height, "sampler": sampler, "scheduler": scheduler,
                    "model": files.transformer, "vae": files.vae, "clip_l": files.clip_l, "clip_g": files.clip_g,
                    "loras": [[p, w] for p, w in loras], "dtype": str(dtype).replace("flame.", ""), "fp8": bool(fp8),
                    "t5": files.t5 if use_t5 else None, "variant": files.variant,
                    "skip_layer_guidance": None if slg is None else {"layers": list(slg.layers), "scale": slg.scale},
                    **init.info()}
            return {"parameters": G.parameters_text(prompts[i], neg, fields), "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
