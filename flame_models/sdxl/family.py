"""SDXL (SAI's UNet with text_time conditioning) as a trainer family: the DDPM objective (ddpm_objective.py: ε- or
v-prediction on the scaled-linear schedule, zero-terminal SNR, min-SNR-γ, a timestep range, noise offset) on
4-channel latents scaled by 0.13025; conditioning = context (CLIP-L ‖ CLIP-G penultimate states, 77 × 2048) and y
(CLIP-G's projected pooled vector ‖ the six size embeddings of each sample's original size, crop (top, left) and
bucket size, which image folders keep per sample; precomputed samples: the latents' size, no crop); previews with the
SDXL samplers (sample.sampler: euler (default), euler_ancestral (ai-toolkit: euler_a), heun, dpm_2, dpm_2_ancestral,
dpmpp_2m, dpmpp_2m_sde, ddim, ddpm (ai-toolkit's SDXL default), unipc, lcm), classifier-free guidance with a negative
prompt (sample.neg; default zeros, diffusers' force_zeros_for_empty_prompt), size conditioning = the preview's size.
Adapters train Linear layers (attention / all_linear presets) and, with
network.conv (LoCon), kohya's convolution set: the 3x3 convolutions of the ResBlocks, downsamplers and upsamplers at
the conv rank, with the ResBlocks' emb_layers.1 and 1x1 skip convolutions at the linear rank. LoRA names: SAI's in
kohya files (lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q, networks.lora, sdxl_base_v1-0), diffusers'
in PEFT files (unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q)."""
import json
import os

import numpy as np

import flame_core as flame
import flame_nn
from flame_nn.offload import streamer_of

from .. import checkpoint_io as CIO
from ..samplers import LCM_ORIGINAL_STEPS, SAMPLERS
from ..training.ddpm_objective import DDPM
from ..training.family import DDPM_FIELDS, FLOW_FIELDS
from ..training.family_base import DiffusionFamily, element_loss
from ..training.validation import choice
from . import SDXLUNet, load_unet, make_y, size_embeddings, unet_config
from . import family_parts as sdxl_parts
from . import pipeline as sdxl_pipeline
from .about import ABOUT
from .config import UNetConfigError
from .loading import UNetCheckpoint, UNetCheckpointError, infer_config
from .lora_keys import (
    CONV_TARGETS,
    KOHYA_METADATA,
    RESNET_LINEAR_TARGETS,
    TARGET_PRESETS,
    TEXT_ENCODER_TARGETS,
    unet_name_map,
)
from .parts import load_sdxl, save_sdxl, save_sdxl_components
from .sampling import sample as sdxl_sample
from .saving import save_unet

SAMPLER_ALIASES = {"euler_a": "euler_ancestral"}  # ai-toolkit's name
_FLOW_NOTE = "SDXL trains with the DDPM objective (train.prediction_type, min_snr_gamma, min/max_timestep)"


class SDXLFamily(DiffusionFamily):
    name = "sdxl"
    label = "SDXL"
    takes_negative_prompt = True
    model_words = "an SDXL UNet"
    model_class = SDXLUNet
    spec_attr = "config"
    model_noun = "UNet"
    cond_dims = ("context_dim", "pooled_dim")
    parts, pipeline = sdxl_parts, sdxl_pipeline
    latent_channels = 4
    pixel_multiple = 32                  # 8 px per latent; the UNet halves the latents twice
    latent_scale, latent_shift = ABOUT.latent_format.scaling_factor, ABOUT.latent_format.shift_factor
    noise_schedulers = ("ddpm",)
    scheduler_words = "'ddpm' (epsilon or v-prediction)"
    samplers = tuple(SAMPLERS) + tuple(SAMPLER_ALIASES)
    default_size = "sdxl-tiny"
    model_sizes = ("sdxl-base", "sdxl-tiny")
    target_presets = TARGET_PRESETS
    conv_targets, conv_linear_targets = CONV_TARGETS, tuple(RESNET_LINEAR_TARGETS)   # kohya's conv_dim set
    takes_text_loras = True
    text_encoder_targets = tuple(TEXT_ENCODER_TARGETS)                                # kohya's CLIP set
    config_defaults = {"name": "sdxl_lora", "train.noise_scheduler": "ddpm", "sample.guidance_scale": 5.0}
    fields = DDPM_FIELDS + ("sample.neg", "model.clip_g_path", "sample.guidance_rescale")
    field_notes = {**{k: _FLOW_NOTE for k in FLOW_FIELDS},
                   "train.guidance": "SDXL has no guidance embedding; previews use CFG (sample.guidance_scale)",
                   "sample.slg_scale": "skip-layer guidance is for SD3.5 (model.arch sd3)",
                   "sample.slg_layers": "skip-layer guidance is for SD3.5 (model.arch sd3)",
                   **{k: "SDXL has no T5 text encoder" for k in ("model.t5_path", "model.t5_max_length",
                                                                 "model.quantize_te", "model.use_t5")}}
    spec_errors = (UNetCheckpointError, UNetConfigError, KeyError, ValueError, OSError)

    # ------------------------------------------------------------------ before anything is loaded
    def _config_problems(self, cfg, prefix):
        e, t, p, sm = [], cfg.train, prefix, cfg.sample
        if sm.sampler is not None:
            choice(e, f"{p}sample.sampler", sm.sampler, self.samplers)
        if sm.scheduler is not None:
            e.append(f"{p}sample.scheduler: a flow-matching families' option (SD3, Flux, Flux Kontext, Chroma, "
                     f"Qwen-Image); SDXL previews use the model's own sigmas, got {sm.scheduler!r}")
        if self._sampler(sm) == "lcm" and sm.sample_steps > LCM_ORIGINAL_STEPS:
            e.append(f"{p}sample.sample_steps: lcm previews take at most {LCM_ORIGINAL_STEPS} steps (a subset of LCM's "
                     f"distillation schedule), got {sm.sample_steps}")
        if t.zero_terminal_snr and self._sampler(sm) in ("ddim", "ddpm") and 1000 % sm.sample_steps:
            e.append(f"{p}sample.sample_steps: DDIM / DDPM previews of a zero-terminal-SNR model walk 'trailing' "
                     f"timesteps, which need a step count that divides 1000, got {sm.sample_steps}")
        if t.zero_terminal_snr and t.prediction_type == "epsilon":
            cfg.warnings.append("train.zero_terminal_snr with epsilon prediction: the last timestep is pure noise, "
                                "where an ε-prediction learns nothing (use prediction_type v_prediction)")
        return e

    @staticmethod
    def _sampler(sample_cfg):
        s = sample_cfg.sampler or "euler"
        return SAMPLER_ALIASES.get(s, s)

    def preset(self, size):
        return unet_config(size)

    def read_spec(self, path):
        with UNetCheckpoint(path) as ckpt:
            return infer_config(ckpt)

    def spec_problems(self, cfg, spec, prefix=""):
        e = []
        if (self.vae_scale_factor * spec.downsample_factor) > self.pixel_multiple:
            e.append(f"{prefix}model: this UNet needs image sides that are multiples of "
                     f"{self.vae_scale_factor * spec.downsample_factor} px; the trainer handles multiples of "
                     f"{self.pixel_multiple}")
        with flame_nn.empty_init(device="cpu"):
            probe = SDXLUNet(spec)
        return e + self.target_problems(probe, cfg, None, prefix)

    def latent_multiple(self, spec):
        return spec.downsample_factor if spec is not None else 4

    # ------------------------------------------------------------------ building
    def load_model(self, path, spec, dtype, device):
        return load_unet(path, dtype=dtype, device=device, config=spec)

    def block_stacks(self, model):
        return list(sdxl_pipeline.STACKS)

    def lora_name_map(self, model):
        return unet_name_map(model)

    def save_model(self, model, path, dtype, metadata=None, base=None, layout="native", tokenizer=None,
                   text_encoders=None):
        """A full fine-tune's file: the UNet in SAI's names under model.diffusion_model. (as SAI's files); when the
        run's model `base` is an SAI single file, its VAE and text encoders copied beside it bit for bit -- a whole
        checkpoint, as sd_xl_base_1.0.safetensors (A1111 / ComfyUI's checkpoint loader, FLAME's --model alone).
        layout "diffusers": a folder with unet/ and the base's other parts -- a diffusers base's linked, an SAI
        file's VAE, text encoders and tokenizers (`tokenizer`: the run's model.tokenizer_path, default FLAME's packaged
        CLIP vocabulary) converted to diffusers' layout: a whole pipeline."""
        if text_encoders is not None:   # (train.train_text_encoder) the trained CLIP-L and CLIP-G written too
            return self._save_with_text_encoders(model, path, dtype, metadata, base, layout, tokenizer, text_encoders)
        if layout == "diffusers":
            extra = None
            if base is not None and str(base).endswith(".safetensors"):
                with UNetCheckpoint(base) as ckpt:
                    prefix = ckpt.prefix
                if CIO.other_tensors(base, prefix):   # an SAI checkpoint: its VAE, encoders and tokenizers in
                    def extra(folder):                # diffusers' layout beside the UNet (a whole pipeline)
                        save_sdxl_components(load_sdxl(base, device="cpu", tokenizer=tokenizer,
                                                       parts=("vae", "clip_l", "clip_g")), folder)
            return CIO.write_pipeline_folder(path, "unet", lambda d: save_unet(
                model, d, "diffusers", dtype=dtype, metadata=metadata), base, extra=extra)
        extra = []
        if base is not None and str(base).endswith(".safetensors"):
            with UNetCheckpoint(base) as ckpt:
                prefix = ckpt.prefix
            extra = CIO.other_tensors(base, prefix)
            if extra:   # the base's metadata too (its parts' configs among it), the run's entries over it
                from flame_core.io import load_metadata
                metadata = {**(load_metadata(base) or {}), **(metadata or {})}
        return save_unet(model, path, "sai", dtype=dtype, metadata=metadata, extra=extra)

    @staticmethod
    def _save_with_text_encoders(model, path, dtype, metadata, base, layout, tokenizer, text_encoders):
        """A full fine-tune with trained text encoders ({"te1": CLIP-L, "te2": CLIP-G}): a whole checkpoint -- the
        trained UNet and encoders at `dtype`, the base's VAE (from an SAI file or a diffusers folder) -- as one SAI
        file, or a diffusers folder (the base pipeline's VAE, tokenizers and scheduler linked where it is one)."""
        te1, te2 = text_encoders["te1"], text_encoders["te2"]

        def write_unet(folder):
            save_unet(model, folder, "diffusers", dtype=dtype, metadata=metadata)
        if layout == "diffusers" and CIO.pipeline_components(base):
            def extra(folder):
                te1.save_pretrained(os.path.join(folder, "text_encoder"), dtype)
                te2.save_pretrained(os.path.join(folder, "text_encoder_2"), dtype)
            return CIO.write_pipeline_folder(path, "unet", write_unet, base, extra=extra,
                                             replace=("text_encoder", "text_encoder_2"))
        parts = load_sdxl(base, device="cpu", tokenizer=tokenizer, parts=("vae",))   # the base's VAE, tokenizers
        parts.unet, parts.clip_l, parts.clip_g = model, te1, te2
        if layout == "diffusers":
            return CIO.write_pipeline_folder(path, "unet", write_unet,
                                             extra=lambda folder: save_sdxl_components(parts, folder, dtype))
        return save_sdxl(parts, path, "sai", dtype=dtype, metadata=metadata)

    def lora_metadata(self, cfg, model):
        meta = {k: v for k, v in KOHYA_METADATA.items()
                if k != "ss_network_module" or cfg.network.type in ("lora", "locon")}  # LyCORIS kinds: lycoris.kohya
        meta["flame.base_model"] = self.base_model_name(cfg)
        n = cfg.network
        if n.conv:  # kohya's record of a LoCon's conv rank and alpha
            alpha = n.conv if n.conv_alpha is None else n.conv_alpha
            meta["ss_network_args"] = json.dumps({"conv_dim": str(n.conv), "conv_alpha": f"{alpha:g}"})
        t = cfg.train
        meta["ss_network_train_unet_only"] = str(not t.train_text_encoder)   # kohya's record of what trained
        if t.train_text_encoder:
            meta["ss_text_encoder_lr"] = str(t.lr if t.text_encoder_lr is None else t.text_encoder_lr)
        if cfg.train.prediction_type == "v_prediction":
            meta["ss_v_parameterization"] = "true"
        if cfg.train.zero_terminal_snr:
            meta["ss_zero_terminal_snr"] = "true"
        return meta

    # ------------------------------------------------------------------ previews
    def negative_prompt(self, cfg):
        """sample.neg, or None: SDXL's unconditional input is zeros (diffusers' force_zeros_for_empty_prompt)."""
        neg = cfg.sample.neg
        return neg if isinstance(neg, str) and neg else None

    def sample_options(self, cfg):
        t = cfg.train
        return {"sampler": self._sampler(cfg.sample), "prediction_type": t.prediction_type,
                "zero_terminal_snr": t.zero_terminal_snr, "guidance_rescale": cfg.sample.guidance_rescale}

    # ------------------------------------------------------------------ training
    def objective(self, train_cfg):
        t = train_cfg
        return DDPM(t.prediction_type, zero_terminal_snr=t.zero_terminal_snr, min_snr_gamma=t.min_snr_gamma,
                    min_timestep=t.min_timestep, max_timestep=t.max_timestep, noise_offset=t.noise_offset,
                    element=element_loss(t, "snr"))

    def training_inputs(self, model, batch, device, train_cfg):
        """x0 = the latents; cond = context and y, y's size embeddings from the batch's per-sample original_size,
        crop_coords and target_size (image folders), else the latents' size without a crop. With trained text
        encoders the batch holds token ids instead of embeddings: cond = the ids and y's size part
        (encode_training_text makes context and y from them)."""
        latents = batch["latents"]
        x0 = flame.tensor(latents, dtype=flame.float32, device=device)                   # (B, 4, h, w)
        B = latents.shape[0]
        size = (latents.shape[2] * self.vae_scale_factor, latents.shape[3] * self.vae_scale_factor)
        sizes = dict(original_size=batch.get("original_size", [size] * B),
                     crop_coords=batch.get("crop_coords", [(0, 0)] * B),
                     target_size=batch.get("target_size", [size] * B))
        if "clip_l_ids" in batch:
            ids = {k: flame.tensor(np.asarray(batch[k], np.int64), dtype=flame.int64, device=device)
                   for k in ("clip_l_ids", "clip_g_ids")}                             # (B, n, 77) each
            return x0, {**ids, "size_embeds": size_embeddings(batch_size=B, size_embed_dim=model.config.size_embed_dim,
                                                              device=device, **sizes)}
        pooled = flame.tensor(batch["pooled_prompt_embeds"], dtype=flame.float32, device=device)
        y = make_y(pooled, size_embed_dim=model.config.size_embed_dim, **sizes)         # (B, adm_in_channels)
        return x0, {"context": flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=device), "y": y}

    # ------------------------------------------------------------------ trained text encoders
    def trainable_text_encoders(self, encoders):
        return [("te1", encoders.clip_l), ("te2", encoders.clip_g)]

    def text_lora_parts(self, encoders):
        return self.trainable_text_encoders(encoders)

    def caption_tokens(self, encoders, captions):
        """{"clip_l_ids", "clip_g_ids": (N, n, 77) int64} (n 77-token chunks per caption)."""
        l_ids, g_ids = encoders.tokenize(list(captions))
        N = len(captions)
        return {"clip_l_ids": np.asarray(l_ids, np.int64).reshape(N, -1, l_ids.shape[-1]),
                "clip_g_ids": np.asarray(g_ids, np.int64).reshape(N, -1, g_ids.shape[-1])}

    def encode_training_text(self, encoders, cond):
        """context (CLIP-L ‖ CLIP-G penultimate states) and y (CLIP-G's projected pooled ‖ the size embeddings),
        float32 as the cached embeddings are, through the encoders with autograd (SDXLTextEncoders.encode_ids)."""
        cond = dict(cond)
        l_ids, g_ids, sizes = cond.pop("clip_l_ids"), cond.pop("clip_g_ids"), cond.pop("size_embeds")
        B = l_ids.shape[0]
        context, pooled = encoders.encode_ids(l_ids.reshape(-1, l_ids.shape[-1]), g_ids.reshape(-1, g_ids.shape[-1]),
                                              B)
        return {**cond, "context": context.float(), "y": flame.cat([pooled.float(), sizes], dim=1)}

    def image_seq_len(self, x0):
        return x0.shape[2] * x0.shape[3]

    def forward(self, model, x_t, t, cond):
        return model(x_t, t, cond["context"], cond["y"])

    # ------------------------------------------------------------------ previews
    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, sampler="euler",
               prediction_type="epsilon", zero_terminal_snr=False, guidance_rescale=0.0):
        """One prompt's latents with an SDXL sampler on the training schedule (trailing timesteps for a
        zero-terminal-SNR model, as diffusers advises); size conditioning = the preview's size, no crop; CFG
        against the negative_* arrays, or SDXL's zeros, rescaled by guidance_rescale (sample.guidance_rescale)."""
        c = model.config
        streamer = streamer_of(model)
        dev = streamer.device if streamer is not None else model.device
        sizes = dict(original_size=(height, width), crop_coords=(0, 0), target_size=(height, width),
                     size_embed_dim=c.size_embed_dim)

        def rows(prefix):
            ctx = flame.tensor(np.asarray(cond[prefix + "prompt_embeds"], np.float32)[None], device=dev)
            pooled = flame.tensor(np.asarray(cond[prefix + "pooled_prompt_embeds"], np.float32)[None], device=dev)
            return ctx, make_y(pooled, **sizes)
        context, y = rows("")
        neg_context = neg_y = None
        if guidance != 1.0 and "negative_prompt_embeds" in cond:
            neg_context, neg_y = rows("negative_")
        noise = sdxl_pipeline.get_noise(1, height, width, seed, dev)
        return sdxl_sample(model, context, y, neg_context, neg_y, height=height, width=width, steps=steps,
                           cfg=guidance, sampler=sampler, seed=seed, prediction_type=prediction_type,
                           zero_terminal_snr=zero_terminal_snr, guidance_rescale=guidance_rescale,
                           timestep_spacing="trailing" if zero_terminal_snr else "leading",
                           steps_offset=0 if zero_terminal_snr else 1, noise=noise, progress=False,
                           callback=None if callback is None else (lambda i, *a: callback(i, steps)))
