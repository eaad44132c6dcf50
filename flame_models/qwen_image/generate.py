"""Qwen-Image's part of `python -m flame_models.generate`, as QwenImagePipeline: the Qwen2.5-VL states of the templated
prompt (--max-length tokens at most, default 512), the pipeline's scheduler (dynamic shift, terminal sigma 0.02; 50
steps; --sampler heun for Heun's steps, dpmpp_2m for DPM++ 2M, dpmpp_2m_sde for its SDE, unipc for UniPC), true CFG
(--cfg, default 4.0) only when a --negative-prompt is given, with the per-token norm rescale, the VAE; the LoRAs on the
transformer. Files: a diffusers QwenImagePipeline folder (transformer/, vae/, text_encoder/, tokenizer/); --vae may name
another VAE folder, --tokenizer another tokenizer folder. --fp8 stores the Qwen2.5-VL layers' and the transformer
blocks' Linear weights in fp8; --max-gpu-memory streams both stacks and fits each stage (text encoder, transformer, VAE
-- one after another) to the budget with auto_fit."""
import json
import math
import os
import random
from dataclasses import dataclass

from .. import generate as G
from ..conditioning.files import ModelFilesError
from ..pipeline import check_loras, load_for_sampling
from ..samplers.flow import DISPLAY_NAMES
from ..samplers.flow_schedules import DISPLAY_NAMES as SCHEDULES
from ..samplers.img2img import DEFAULT_STRENGTH
from . import sampling as S
from . import stages
from .loading import QwenImageCheckpointError, load_qwen_image, read_qwen_image_params
from .params import QwenImageParams

OPTIONS = {"negative_prompt": None, "cfg": None, "max_length": None, "sampler": None, "scheduler": None,
           **G.IMAGE_OPTIONS}
NOTES = {"guidance": "it has no guidance embedding; use --cfg with a --negative-prompt (classifier-free guidance)",
         "karras": "use --scheduler karras (its own sigmas respaced as Karras's)"}
DEFAULTS = {"steps": S.DEFAULT_STEPS, "cfg": S.DEFAULT_CFG, "max_length": 512}
STACKS = ("transformer_blocks",)


class QwenImageFilesError(ModelFilesError):
    """Parts of a Qwen-Image model that are missing or unreadable; the message names each."""


@dataclass
class QwenImageFiles:
    """Where each part of a Qwen-Image model is; params: the transformer's QwenImageParams."""
    transformer: str
    vae: str = None
    text_encoder: str = None
    tokenizer: str = None
    params: QwenImageParams = None


FILES = QwenImageFiles


def find_qwen_image_files(path, *, vae=None, tokenizer=None):
    """QwenImageFiles of a QwenImagePipeline folder (or a transformer file / folder with `vae`; the text encoder
    and tokenizer come from a pipeline folder only). One QwenImageFilesError lists every problem."""
    path = os.fspath(path)
    root = path if os.path.isdir(os.path.join(path, "transformer")) else None
    transformer = os.path.join(root, "transformer") if root else path
    problems = []
    try:
        params = read_qwen_image_params(transformer)
    except (QwenImageCheckpointError, KeyError, ValueError, OSError) as e:
        params, msg = None, str(e).splitlines()[0] if str(e) else type(e).__name__
        problems.append(f"transformer (--model): {msg}")
    parts = {"vae": vae or (os.path.join(root, "vae") if root else None),
             "text_encoder": os.path.join(root, "text_encoder") if root else None,
             "tokenizer": tokenizer or (os.path.join(root, "tokenizer") if root else None)}
    for part, where in parts.items():
        if where is None or not os.path.exists(where):
            how = {"vae": "pass --vae (a diffusers AutoencoderKLQwenImage folder)",
                   "tokenizer": "pass --tokenizer (a Qwen2 tokenizer folder)",
                   "text_encoder": "give a QwenImagePipeline folder (its text_encoder/)"}[part]
            problems.append(f"{part}: missing -- " + (f"{where} does not exist; " if where else
                                                       f"{path} is not a QwenImagePipeline folder; ") + how)
    if problems:
        raise QwenImageFilesError(f"the Qwen-Image model {path}: " + ("\n  ".join([""] + problems) if len(problems) > 1
                                                                        else problems[0]))
    return QwenImageFiles(transformer, parts["vae"], parts["text_encoder"], parts["tokenizer"], params)


def generate(model, prompts, *, negative_prompt=None, cfg=None, max_length=None, vae=None, clip_l=None, t5=None,
             tokenizer=None, loras=(), width=1024, height=1024, steps=None, seed=None, num_images=1, batch_size=1,
             output=None, device=None, dtype=None, fp8=False, max_gpu_memory=None, sampler=None, scheduler=None,
             progress=True, stats=None, log=print, **image):
    """Qwen-Image text-to-image (flame_models.generate.generate says what the arguments mean). model: a
    QwenImagePipeline folder or QwenImageFiles. sampler: "euler" (default, the pipeline's), "heun",
    "dpmpp_2m", "dpmpp_2m_sde" or "unipc".
    image: image-to-image and inpainting (generate.InitImage's keywords: init_image, strength, mask, ...)."""
    from .family_parts import QwenImageTextEncoders
    from .model import QwenImageTransformer2DModel
    from .vae import load_vae
    stats = {} if stats is None else stats
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    G._check_args(prompts, width, height, steps, num_images, batch_size, seed, family="Qwen-Image")
    for name, given in (("--clip-l", clip_l), ("--t5", t5)):
        if given is not None:
            raise G.GenerateError(f"{name}: Qwen-Image has no CLIP / T5 (its text encoder is Qwen2.5-VL)")
    sampler = G.flow_sampler(sampler, "Qwen-Image")
    scheduler = G.flow_scheduler(scheduler, "Qwen-Image")
    dev = G._device(device)
    dtype = G._dtype(dtype, dev)
    budget = G._budget(max_gpu_memory)
    files = model if isinstance(model, QwenImageFiles) else find_qwen_image_files(model, vae=vae,
                                                                                   tokenizer=tokenizer)
    steps = DEFAULTS["steps"] if steps is None else steps
    cfg = float(DEFAULTS["cfg"] if cfg is None else cfg)
    if not math.isfinite(cfg):
        raise G.GenerateError(f"--cfg {cfg}: not a finite number")
    max_length = DEFAULTS["max_length"] if max_length is None else int(max_length)
    if not 1 <= max_length <= 1024:
        raise G.GenerateError(f"--max-length {max_length}: Qwen-Image takes 1 to 1024 text tokens")
    guided = negative_prompt is not None and cfg > 1.0            # as QwenImagePipeline: CFG needs a negative
    loras = check_loras(loras, files.params, model_class=QwenImageTransformer2DModel, error=QwenImageFilesError)
    output = G._check_output(output)
    init = G.InitImage(width, height, default=DEFAULT_STRENGTH, **image)
    steps_run = init.steps_run(steps)
    seed = random.randrange(2 ** 32) if seed is None else seed
    jobs = [(i, seed + j) for i in range(len(prompts)) for j in range(num_images)]
    init.check_jobs(len(jobs))

    def encode(unique):
        out = _encode_prompts(unique)
        init.encode(lambda: load_vae(files.vae, dtype=dtype, device=dev), stages.encode_images, dev, log)
        return out

    def _encode_prompts(unique):
        from ..text_encoders.qwen2_5_vl import load_qwen2_5_vl
        from ..tokenization.qwen2 import Qwen2Tokenizer
        # as T5 in Flux's generate: the layers in fp8 with --fp8, streamed under a budget (auto_fit keeps as many
        # resident as it allows)
        te = load_qwen2_5_vl(files.text_encoder, dtype=dtype, device=dev, quantize="fp8" if fp8 else None,
                             stream=budget is not None).eval()
        enc = QwenImageTextEncoders(te, Qwen2Tokenizer.from_folder(files.tokenizer), max_length=max_length)
        try:
            if budget is not None:
                log("text encoder " + str(te.streamer.auto_fit(budget, lambda: enc.encode(unique[:1]))))
            out = {k: v.float().cpu().numpy() for k, v in enc.encode(unique).items()}
            if guided:
                out.update({f"negative_{k}": v.float().cpu().numpy()
                            for k, v in enc.encode([str(negative_prompt)]).items()})
            return out
        finally:
            enc.free()

    def negative_of(cond):
        return {k: cond[f"negative_{k}"] for k in ("prompt_embeds", "prompt_mask")} if guided else None

    def fit(net, cond, n):
        import numpy as np

        import flame_core as flame
        d = net.streamer.device
        m = 2 if guided else 1
        txt = flame.tensor(np.repeat(np.asarray(cond["prompt_embeds"])[:1], m * n, 0), device=d).to(dtype)
        x = flame.zeros(m * n, (height // 16) * (width // 16), net.params.in_channels, device=d).to(dtype)
        t = flame.full((m * n,), 1.0, device=d)

        def step():
            with flame.no_grad():
                net(x, txt, None, t, [[(1, height // 16, width // 16)]] * (m * n))
        return net.streamer.auto_fit(budget, step)

    stages_ = G.Stages(
        encode=encode, denoiser="transformer",
        load=lambda: load_for_sampling(lambda d: load_qwen_image(files.transformer, dtype=dtype, device=d),
                                       files.transformer, loras, STACKS, dev, fp8=fp8, stream=budget is not None,
                                       error=QwenImageFilesError),
        fit=fit,
        sample=lambda net, cond, seeds, rows, callback, jobs: S.sample_latents(
            net, cond, negative_of(cond), height=height, width=width, steps=steps, cfg=cfg, seeds=seeds, rows=rows,
            callback=callback, sampler=sampler, scheduler=scheduler, **init.sample_kwargs(jobs)),
        load_vae=lambda: load_vae(files.vae, dtype=dtype, device=dev), decode=stages.decode_latents)
    images = G.run_stages(stages_, prompts, jobs, dev=dev, budget=budget, batch_size=batch_size, steps=steps_run,
                          progress=progress, stats=stats, log=log)
    images = init.finish(images)

    if output is not None:
        name = G.model_name(files.transformer)

        def text_of(i, s):
            info = {"prompt": prompts[i], "negative_prompt": negative_prompt, "seed": s, "steps": steps,
                    "cfg": cfg if guided else None, "width": width, "height": height, "model": files.transformer,
                    "vae": files.vae, "text_encoder": files.text_encoder, "loras": [[p, w] for p, w in loras],
                    "sampler": sampler, "scheduler": scheduler, "dtype": str(dtype).replace("flame.", ""),
                    "fp8": bool(fp8), **init.info()}
            fields = [("Steps", steps), ("Sampler", DISPLAY_NAMES[sampler]), ("Schedule type", SCHEDULES[scheduler]),
                      *([("CFG scale", f"{cfg:g}")] if guided else []),
                      ("Seed", s), ("Size", f"{width}x{height}"), *init.fields(), ("Model", name),
                      *G.lora_field(loras), ("Version", "FLAME")]
            return {"parameters": G.parameters_text(prompts[i], negative_prompt if guided else None, fields),
                    "flame": json.dumps(info)}

        G.write_pngs(output, jobs, images, text_of, log)
    return images
