"""Chroma as a trainer family: rectified flow on Flux's 2x2-packed 16-channel latents, T5 states with their padding
mask (prompt_mask; the transformer attends the real tokens and the first padding token), no CLIP and no guidance
embedding; previews with the Euler sampler and true classifier-free guidance against sample.neg ("" by default, as
ChromaPipeline). LoRA names: Chroma's (BFL's) in kohya files (lora_unet_double_blocks_0_img_attn_qkv), diffusers' in
PEFT files (transformer.transformer_blocks.0.attn.to_q); both are read by ComfyUI and diffusers' FluxLoraLoaderMixin,
and kohya is the default as for Flux."""
import numpy as np

import flame_core as flame
import flame_nn

from .. import checkpoint_io as CIO
from ..bfl import vae as flux_vae
from ..bfl.sampling import LATENT_SCALE, LATENT_SHIFT, image_ids, pack, pack_mask, text_ids
from ..data.text_trim import batch_text_mask, valid_tokens
from ..training.family import DDPM_FIELDS, FLOW_FIELDS
from ..training.family_base import FlowMatchingFamily, FlowSamplerPreviews
from . import family_parts as chroma_parts
from . import pipeline as chroma_pipeline
from .loading import ChromaCheckpointError, load_chroma, read_chroma_params, save_chroma
from .lora_keys import TARGET_PRESETS, name_map_for
from .model import ATTN_PADDING, Chroma
from .params import chroma_params

_DDPM_NOTE = "Chroma trains with flow matching (train.timestep_type, train.weighting_scheme); this is for sdxl's DDPM"


class ChromaFamily(FlowSamplerPreviews, FlowMatchingFamily):
    name = "chroma"
    label = "Chroma"
    takes_negative_prompt = True
    model_words = "a Chroma transformer"
    model_class = Chroma
    parts, pipeline = chroma_parts, flux_vae
    latent_scale, latent_shift = LATENT_SCALE, LATENT_SHIFT
    sample_keys = ("latents", "prompt_embeds", "prompt_mask")
    cond_dims = ("context_in_dim", None)  # T5's width; no pooled vector
    default_size = "chroma-tiny"
    model_sizes = ("chroma", "chroma-tiny")
    target_presets = TARGET_PRESETS
    # its reference trainer's timestep density (training/timesteps.py 'chroma'); ChromaPipeline's CFG 5
    config_defaults = {"name": "chroma_lora", "train.timestep_type": "chroma", "sample.guidance_scale": 5.0}
    fields = FLOW_FIELDS + ("sample.neg", "model.t5_path", "model.t5_max_length", "model.quantize_te")
    field_notes = {**{k: _DDPM_NOTE for k in DDPM_FIELDS},
                   "train.guidance": "Chroma has no guidance embedding; previews use CFG (sample.guidance_scale)",
                   "model.use_t5": "Chroma always encodes with T5",
                   "model.clip_g_path": "Chroma has no CLIP (model.arch sd3 or sdxl has CLIP-G)"}
    spec_errors = (ChromaCheckpointError, KeyError, ValueError, OSError)

    # ------------------------------------------------------------------ before anything is loaded
    def preset(self, size):
        return chroma_params(size)

    def read_spec(self, path):
        return read_chroma_params(path)

    def spec_problems(self, cfg, spec, prefix=""):
        with flame_nn.empty_init(device="cpu"):
            probe = Chroma(spec)
        return self.target_problems(probe, cfg, name_map_for(spec), prefix)

    # ------------------------------------------------------------------ building
    def load_model(self, path, spec, dtype, device):
        return load_chroma(path, dtype=dtype, device=device, params=spec)

    def block_stacks(self, model):
        return ["double_blocks", "single_blocks"]

    def lora_name_map(self, model):
        return name_map_for(model.params)

    def save_model(self, model, path, dtype, metadata=None, base=None, layout="native",
                   tokenizer=None):   # (see ModelFamily; tokenizer: an SDXL SAI base's only)
        """A full fine-tune's file: the transformer in Chroma's own names (as its released files); layout
        "diffusers": a folder with transformer/ (and the base pipeline's other parts)."""
        if layout == "diffusers":
            return CIO.write_pipeline_folder(path, "transformer", lambda d: save_chroma(
                model, d, "diffusers", dtype=dtype, metadata=metadata), base)
        return save_chroma(model, path, "bfl", dtype=dtype, metadata=metadata)

    def lora_metadata(self, cfg, model):
        return {"ss_base_model_version": "chroma", "modelspec.architecture": "chroma/lora",
                "flame.base_model": self.base_model_name(cfg)}

    # ------------------------------------------------------------------ training
    def training_inputs(self, model, batch, device, train_cfg):
        latents = batch["latents"]
        x0 = pack(flame.tensor(latents, dtype=flame.float32, device=device))
        B = x0.shape[0]
        height, width = latents.shape[2] * self.vae_scale_factor, latents.shape[3] * self.vae_scale_factor
        txt = flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=device)
        cond = {"txt": txt, "img_ids": image_ids(height, width, B, device=device),
                "txt_ids": text_ids(txt.shape[1], B, device=device)}
        mask = batch_text_mask(batch)
        if mask is not None:
            cond["txt_mask"] = flame.tensor(mask, device=device)
        return x0, cond

    def attended_text_length(self, prompt_mask):
        """The real tokens and the first padding token (Chroma.forward's attn_padding)."""
        m = valid_tokens(prompt_mask)
        return min(m.shape[0], int(m.sum()) + ATTN_PADDING)

    def image_seq_len(self, x0):
        return x0.shape[1]

    def loss_mask(self, mask, x0):
        return pack_mask(mask, self.latent_channels, x0.device)

    def forward(self, model, x_t, t, cond):
        return model(x_t, cond["img_ids"], cond["txt"], cond["txt_ids"], t, txt_mask=cond.get("txt_mask"),
                     attn_padding=ATTN_PADDING)

    # ------------------------------------------------------------------ previews
    def negative_prompt(self, cfg):
        """sample.neg, else "" (ChromaPipeline's default negative)."""
        neg = cfg.sample.neg
        return neg if isinstance(neg, str) else ""

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, sampler="euler",
               scheduler="simple"):
        pos = {k: np.asarray(cond[k])[None] for k in self.sample_keys[1:]}
        neg = None
        if guidance is not None and guidance > 1.0 and "negative_prompt_embeds" in cond:
            neg = {k: np.asarray(cond[f"negative_{k}"])[None] for k in self.sample_keys[1:]}
        return chroma_pipeline.sample_latents(model, pos, neg, height=height, width=width, steps=steps,
                                              cfg=guidance if neg is not None else 1.0, seeds=[seed],
                                              callback=callback, sampler=sampler, scheduler=scheduler)
