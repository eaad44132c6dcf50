"""FLUX.1 as a trainer family: rectified flow on 2x2-packed 16-channel latents, T5 states + CLIP pooled
conditioning, a guidance embedding for flux-dev (1.0 while training), the Euler or Heun sampler for previews, BFL
names with the diffusers name map for PEFT files."""
import flame_core as flame

from .. import checkpoint_io as CIO
from ..training import prompt_options
from ..training.family import FLOW_FIELDS, ModelFileError
from ..training.family_base import FlowMatchingFamily, FlowSamplerPreviews, first_line
from ..training.model_files import describe_keys, file_keys
from . import family_parts as flux_parts
from . import sampling as flux_sampling
from . import vae as flux_pipeline
from .loading import FluxCheckpointError, checkpoint_files, load_flux, read_flux_params, save_flux
from .lora_keys import TARGET_PRESETS, name_map_for
from .model import Flux
from .params import flux_params
from .sampling import pack
from .true_cfg import with_true_cfg


class FluxFamily(FlowSamplerPreviews, FlowMatchingFamily):
    name = "flux"
    label = "Flux"
    model_words = "a Flux transformer"
    model_class = Flux
    cond_dims = ("context_in_dim", "vec_in_dim")
    parts, pipeline = flux_parts, flux_pipeline
    latent_scale, latent_shift = flux_sampling.LATENT_SCALE, flux_sampling.LATENT_SHIFT
    default_size = "flux-tiny"
    model_sizes = ("flux-dev", "flux-schnell", "flux-tiny")
    target_presets = TARGET_PRESETS
    fields = FLOW_FIELDS + ("train.guidance", "train.guidance_range", "model.t5_path", "model.t5_max_length",
                            "model.quantize_te", "sample.neg", "sample.true_cfg", "sample.true_cfg_start")
    true_cfg = True   # previews may run true CFG against a negative prompt (sample.true_cfg; --l beside --g)
    field_notes = {"model.use_t5": "Flux always encodes with T5",
                   "model.clip_g_path": "Flux has no CLIP-G (model.arch sd3 or sdxl has)"}
    spec_errors = (FluxCheckpointError, KeyError, ValueError)
    takes_text_loras = True

    # ------------------------------------------------------------------ before anything is loaded
    def preset(self, size):
        return flux_params(size)

    def check_model_file(self, path):
        """ModelFileError when the file or folder is not a Flux transformer, saying what it looks like (its keys)."""
        try:
            files = checkpoint_files(path)
        except (FluxCheckpointError, FileNotFoundError, OSError) as e:
            raise ModelFileError(first_line(e)) from None
        kind, words, key = describe_keys([k for f in files for k in file_keys(f)])
        if kind != "flux":
            shown = files[0] if len(files) == 1 else path
            raise ModelFileError(f"{shown} is not {self.model_words}: it looks like {words}"
                                 + (f" (keys such as {key})" if key else " (it holds no tensors)"))

    def read_spec(self, path):
        return read_flux_params(path)

    def spec_problems(self, cfg, spec, prefix=""):
        e = []
        if not spec.guidance_embed:
            for k in ("train.guidance", "train.guidance_range", "sample.guidance_scale"):
                if k in cfg.given:
                    e.append(f"{prefix}{k}: this Flux (schnell-like) has no guidance embedding; remove the key")
            if cfg.train.bypass_guidance_embedding:
                e.append(f"{prefix}train.bypass_guidance_embedding: this Flux (schnell-like) has no guidance "
                         f"embedding to bypass; remove the key")
        elif cfg.train.bypass_guidance_embedding:
            for k in ("train.guidance", "train.guidance_range"):
                if k in cfg.given:
                    e.append(f"{prefix}{k}: not used: train.bypass_guidance_embedding trains without the guidance "
                             f"embedding")
        return e

    # ------------------------------------------------------------------ building
    def load_model(self, path, spec, dtype, device):
        return load_flux(path, dtype=dtype, device=device, params=spec)

    def block_stacks(self, model):
        return ["double_blocks", "single_blocks"]

    def lora_name_map(self, model):
        return name_map_for(model.params)

    # ------------------------------------------------------------------ LoRAs on the text encoders
    def text_lora_parts(self, encoders):
        return [("te1", encoders.clip), (("te3", "te2"), encoders.t5)]

    def streamed_text_components(self, model_cfg, device, budget):
        return ("te3", "te2") if flux_parts.t5_storage(model_cfg, device, budget).endswith("stream") else ()

    def save_model(self, model, path, dtype, metadata=None, base=None, layout="native",
                   tokenizer=None):   # (see ModelFamily; tokenizer: an SDXL SAI base's only)
        """A full fine-tune's file: the transformer in BFL's names (as flux1-dev.safetensors; ComfyUI's
        diffusion_models and FLAME's --model read it); layout "diffusers": a folder with transformer/ (and the base
        pipeline's other parts)."""
        if layout == "diffusers":
            return CIO.write_pipeline_folder(path, "transformer", lambda d: save_flux(
                model, d, "diffusers", dtype=dtype, metadata=metadata), base)
        return save_flux(model, path, "bfl", dtype=dtype, metadata=metadata)

    def lora_metadata(self, cfg, model):
        kind = "dev" if model.params.guidance_embed else "schnell"
        return {"ss_base_model_version": "flux1", "modelspec.architecture": f"flux-1-{kind}/lora",
                "flame.base_model": self.base_model_name(cfg)}

    # ------------------------------------------------------------------ training
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
        if model.params.guidance_embed and not train_cfg.bypass_guidance_embedding:
            cond["guidance"] = flame.full((B,), train_cfg.guidance, device=device)
        return x0, cond

    def image_seq_len(self, x0):
        return x0.shape[1]

    def loss_mask(self, mask, x0):
        return flux_sampling.pack_mask(mask, self.latent_channels, x0.device)

    def forward(self, model, x_t, t, cond):
        # (a guidance-embedding model trained without a guidance in its inputs: train.bypass_guidance_embedding)
        return model(img=x_t, img_ids=cond["img_ids"], txt=cond["txt"], txt_ids=cond["txt_ids"], timesteps=t,
                     y=cond["y"], guidance=cond.get("guidance"), bypass_guidance="guidance" not in cond)

    # ------------------------------------------------------------------ previews
    def _config_problems(self, cfg, prefix):
        e = super()._config_problems(cfg, prefix)
        sm = cfg.sample
        guided = prompt_options.runs_true_cfg(sm)
        if isinstance(sm.neg, str) and sm.neg and not guided:
            e.append(f"{prefix}sample.neg: not available: Flux-dev is guidance-distilled; its previews take a "
                     f"negative prompt only with true CFG (sample.true_cfg > 1, or a prompt's --l beside --g)")
        if guided and not sm.prompts:
            e.append(f"{prefix}sample.true_cfg: true CFG runs the previews of sample.prompts (the negative prompt is "
                     f"encoded with them); this run has none")
        if sm.true_cfg_start and not guided:
            e.append(f"{prefix}sample.true_cfg_start: no preview runs true CFG (sample.true_cfg > 1, or a prompt's "
                     f"--l beside --g)")
        return e

    def negative_prompt(self, cfg):
        """sample.neg ("" when not a string) where a preview runs true CFG (sample.true_cfg > 1, or a prompt's --l
        beside --g), else None: Flux-dev is guidance-distilled, its previews need no negative prompt."""
        if not prompt_options.runs_true_cfg(cfg.sample):
            return None
        return cfg.sample.neg if isinstance(cfg.sample.neg, str) else ""

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, sampler="euler",
               scheduler="simple", true_cfg=1.0, true_cfg_start=0):
        """One prompt's latents; with true_cfg > 1, true CFG against cond's negative_prompt_embeds /
        negative_pooled_prompt_embeds from step true_cfg_start on (bfl/true_cfg.py)."""
        txt = flame.tensor(cond["prompt_embeds"][None], device=device)
        y = flame.tensor(cond["pooled_prompt_embeds"][None], device=device)
        net = self.guided(model, cond, txt, true_cfg, device)
        return flux_sampling.sample(net, txt, y, height=height, width=width, steps=steps,
                                    guidance=guidance if model.params.guidance_embed else None, seed=seed,
                                    callback=callback, sampler=sampler, scheduler=scheduler,
                                    unguided=model if net is not model else None, cfg_start=true_cfg_start)

    def guided(self, model, cond, txt, true_cfg, device):
        """`model` in a true-CFG wrapper against cond's negative_* arrays when true_cfg > 1, else `model`."""
        if true_cfg is None or float(true_cfg) <= 1.0:
            return model
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        missing = [f"negative_{k}" for k in keys if f"negative_{k}" not in cond]
        if missing:
            raise ValueError(f"true CFG (sample.true_cfg, or --l beside --g) needs the negative prompt's conditioning; "
                             f"the preview's has no {', '.join(missing)}")
        neg = {k: cond[f"negative_{k}"][None] for k in keys}
        return with_true_cfg(model, neg, [0], txt, true_cfg, device, model.img_in.weight.dtype)

