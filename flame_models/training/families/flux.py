"""FLUX.1 as a trainer family: rectified flow on 2x2-packed 16-channel latents, T5 states + CLIP pooled
conditioning, a guidance embedding for flux-dev (1.0 while training), the Euler sampler for previews, BFL names with
the diffusers name map for PEFT files."""
import os

import numpy as np

import flame_core as flame
import flame_nn

from ...flux import Flux, flux_params, load_flux, pack, read_flux_params
from ...flux import pipeline as flux_pipeline
from ...flux import sampling as flux_sampling
from ...flux.loading import FluxCheckpointError, checkpoint_files
from ...flux.lora_keys import TARGET_PRESETS, name_map_for
from ..family import FLOW_FIELDS, ModelFamily, ModelFileError
from ..model_files import describe_keys, file_keys
from ..objective import FlowMatching
from ..random_init import init_random_
from ..timesteps import TIMESTEP_TYPES
from ..validation import choice
from . import flux_parts


class FluxFamily(ModelFamily):
    name = "flux"
    latent_channels = 16
    vae_scale_factor = 8
    pixel_multiple = 16                  # 8 px per latent, 2x2 latents per token
    latent_scale, latent_shift = flux_sampling.LATENT_SCALE, flux_sampling.LATENT_SHIFT
    noise_schedulers = ("flowmatch", "flow_match")
    samplers = ("flowmatch", "flow_match", "euler")
    default_size = "flux-tiny"
    model_sizes = ("flux-dev", "flux-schnell", "flux-tiny")
    sample_keys = ("latents", "prompt_embeds", "pooled_prompt_embeds")
    target_presets = TARGET_PRESETS
    default_target = "attention"
    fields = FLOW_FIELDS + ("train.guidance", "model.t5_path", "model.t5_max_length", "model.quantize_te")
    field_notes = {"sample.neg": "Flux-dev is guidance-distilled: its previews take no negative prompt",
                   "model.use_t5": "Flux always encodes with T5",
                   "model.clip_g_path": "Flux has no CLIP-G (model.arch sd3 or sdxl has)"}

    # ------------------------------------------------------------------ before anything is loaded
    def config_problems(self, cfg, prefix=""):
        e, t, p = [], cfg.train, prefix
        if t.noise_scheduler not in self.noise_schedulers:
            e.append(f"{p}train.noise_scheduler: Flux trains with 'flowmatch', got {t.noise_scheduler!r}")
        choice(e, f"{p}train.timestep_type", t.timestep_type, TIMESTEP_TYPES)
        if cfg.sample.sampler is not None and cfg.sample.sampler not in self.samplers:
            e.append(f"{p}sample.sampler: Flux previews use the flow-matching Euler sampler ('flowmatch'), got "
                     f"{cfg.sample.sampler!r}")
        if cfg.model.name_or_path is None and cfg.model.size is not None:
            choice(e, f"{p}model.size", cfg.model.size, self.model_sizes)
        return e

    def describe_model(self, model_cfg):
        """FluxParams from the checkpoint's headers (or the size preset); ModelFileError when the file or folder is
        not a Flux transformer, saying what it looks like."""
        path = model_cfg.name_or_path
        if path is None:
            return flux_params(model_cfg.size or self.default_size)
        try:
            files = checkpoint_files(path)
        except (FluxCheckpointError, FileNotFoundError, OSError) as e:
            raise ModelFileError(_first_line(e)) from None
        keys = [k for f in files for k in file_keys(f)]
        kind, words, key = describe_keys(keys)
        if kind != "flux":
            shown = files[0] if len(files) == 1 else path
            raise ModelFileError(f"{shown} is not a Flux transformer: it looks like {words}"
                                 + (f" (keys such as {key})" if key else " (it holds no tensors)"))
        try:
            return read_flux_params(path)
        except (FluxCheckpointError, KeyError, ValueError) as e:
            raise ModelFileError(f"{path}: {_first_line(e)}") from None

    def spec_problems(self, cfg, spec, prefix=""):
        e = []
        if not spec.guidance_embed:
            for k in ("train.guidance", "sample.guidance_scale"):
                if k in cfg.given:
                    e.append(f"{prefix}{k}: this Flux (schnell-like) has no guidance embedding; remove the key")
        return e

    def check_sample(self, shapes, spec):
        """None, or what is wrong with one sample's tensor shapes (keys absent from `shapes` are not checked)."""
        ctx = spec.context_in_dim if spec is not None else None
        vec = spec.vec_in_dim if spec is not None else None
        lat, txt, pooled = (shapes.get(k) for k in self.sample_keys)
        if lat is not None and (len(lat) != 3 or lat[0] != self.latent_channels or lat[1] % 2 or lat[2] % 2):
            return f"latents {lat}: expected ({self.latent_channels}, h, w) with even h and w"
        if txt is not None and (len(txt) != 2 or (ctx is not None and txt[1] != ctx)):
            return f"prompt_embeds {txt}: expected (L, {ctx or 'context_in_dim'}) for this model"
        if pooled is not None and (len(pooled) != 1 or (vec is not None and pooled[0] != vec)):
            return f"pooled_prompt_embeds {pooled}: expected ({vec or 'vec_in_dim'},) for this model"
        return None

    def synthetic_conditioning(self, spec, text_length):
        return {"prompt_embeds": (text_length, spec.context_in_dim), "pooled_prompt_embeds": (spec.vec_in_dim,)}

    # ------------------------------------------------------------------ building
    def build_model(self, model_cfg, spec, dtype, device, stream=False):
        """The frozen transformer: loaded key by key (into host memory when its blocks will stream), or random.
        A random model larger than flux-tiny on a GPU is drawn there (random_init); with `stream`, its blocks stay
        empty until block_initializer fills each as the streamer packs it, so it is never whole on the GPU."""
        if model_cfg.name_or_path:
            return load_flux(model_cfg.name_or_path, dtype=dtype, device="cpu" if stream else device, params=spec)
        if flame.device(device).type != "cuda" or (model_cfg.size or self.default_size) == "flux-tiny":
            return Flux(spec, dtype=dtype, device=device)
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = Flux(spec)
        g = flame.Generator(device).manual_seed(flux_parts.RANDOM_SEED)
        for name, child in model.named_children():
            if not stream or name not in self.block_stacks(model):
                init_random_(child, g)
        return model

    def block_initializer(self, model):
        """For block streaming: None, or prepare(block) filling a block left empty by build_model(stream=True)."""
        if not any(p.is_meta for s in self.block_stacks(model) for p in model.get_submodule(s).parameters()):
            return None
        g = flame.Generator(model.img_in.weight.device).manual_seed(flux_parts.RANDOM_SEED + 1)
        return lambda block: init_random_(block, g)

    def spec_of(self, model):
        if not isinstance(model, Flux):
            raise TypeError(f"the flux family trains a flame_models.flux.Flux, got {type(model).__name__}")
        return model.params

    def block_stacks(self, model):
        return ["double_blocks", "single_blocks"]

    def lora_name_map(self, model):
        return name_map_for(model.params)

    def lora_metadata(self, cfg, model):
        kind = "dev" if model.params.guidance_embed else "schnell"
        return {"ss_base_model_version": "flux1", "modelspec.architecture": f"flux-1-{kind}/lora",
                "flame.base_model": (os.path.basename(cfg.model.name_or_path.rstrip("/\\")) if cfg.model.name_or_path
                                     else cfg.model.size or self.default_size)}

    # ------------------------------------------------------------------ image folders and text prompts
    def parts_problems(self, cfg, *, vae, text, prefix=""):
        return flux_parts.problems(cfg, vae=vae, text=text, prefix=prefix)

    def vae_id(self, model_cfg, device):
        return flux_parts.vae_id(model_cfg, device)

    def load_vae(self, model_cfg, device):
        return flux_parts.load_vae(model_cfg, device)

    def encode_images(self, vae, pixels):
        x = flame.tensor(np.ascontiguousarray(pixels, dtype=np.float32), device=vae.device)
        return flux_pipeline.encode_images(vae, x).numpy()

    def decode(self, vae, latents):
        x = flame.tensor(np.ascontiguousarray(latents, dtype=np.float32), device=vae.device)
        return flux_pipeline.decode_latents(vae, x).float().numpy()

    def text_encoder_id(self, model_cfg, device, budget=None):
        return flux_parts.text_id(model_cfg, device, budget)

    def describe_text_encoders(self, model_cfg, device, budget=None):
        return f"CLIP-L + T5 ({flux_parts.t5_storage(model_cfg, device, budget)})"

    def load_text_encoders(self, model_cfg, device, budget=None):
        return flux_parts.load_text_encoders_for(model_cfg, device, budget)

    def encode_prompts(self, encoders, prompts):
        out = encoders.encode(list(prompts))
        return {k: v.float().numpy() for k, v in out.items()}

    # ------------------------------------------------------------------ training
    def objective(self, train_cfg):
        t = train_cfg
        return FlowMatching(t.timestep_type, shift=t.shift, sigmoid_scale=t.sigmoid_scale, logit_mean=t.logit_mean,
                            logit_std=t.logit_std, mode_scale=t.mode_scale, weighting_scheme=t.weighting_scheme,
                            noise_offset=t.noise_offset)

    def training_inputs(self, model, batch, device, train_cfg):
        latents = batch["latents"]
        x0 = pack(flame.tensor(latents, dtype=flame.float32, device=device))           # (B, L, 64)
        B = x0.shape[0]
        height, width = latents.shape[2] * self.vae_scale_factor, latents.shape[3] * self.vae_scale_factor
        txt = flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=device)  # (B, L_txt, context)
        cond = {"txt": txt,
                "y": flame.tensor(batch["pooled_prompt_embeds"], dtype=flame.float32, device=device),
                "img_ids": flux_sampling.image_ids(height, width, B, device=device),
                "txt_ids": flux_sampling.text_ids(txt.shape[1], B, device=device)}
        if model.params.guidance_embed:
            cond["guidance"] = flame.full((B,), train_cfg.guidance, device=device)
        return x0, cond

    def image_seq_len(self, x0):
        return x0.shape[1]

    def forward(self, model, x_t, t, cond):
        return model(img=x_t, img_ids=cond["img_ids"], txt=cond["txt"], txt_ids=cond["txt_ids"], timesteps=t,
                     y=cond["y"], guidance=cond.get("guidance"))

    # ------------------------------------------------------------------ previews
    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None):
        txt = flame.tensor(cond["prompt_embeds"][None], device=device)
        y = flame.tensor(cond["pooled_prompt_embeds"][None], device=device)
        return flux_sampling.sample(model, txt, y, height=height, width=width, steps=steps,
                                    guidance=guidance if model.params.guidance_embed else None, seed=seed,
                                    callback=callback)


def _first_line(e):
    s = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return s.splitlines()[0] if s else type(e).__name__
