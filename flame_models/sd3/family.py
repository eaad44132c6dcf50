"""SD3 / SD3.5 (MMDiT, MMDiT-X) as a trainer family: rectified flow on 16-channel latents (SD3's latent format
1.5305 / 0.0609, no packing), timesteps logit-normal by default (ai-toolkit's SD3 choice; train.logit_mean /
logit_std; timestep_type 'shift' is diffusers' shifted draw with train.shift 3.0), SD3's loss weightings
(train.weighting_scheme), the model fed t = 1000·σ; conditioning = context (CLIP-L + CLIP-G penultimate states ++
T5, or zeros in T5's place) and the pooled vector (2048); previews with SD3's Euler sampler, classifier-free guidance
with a negative prompt (sample.neg, "" by default as diffusers) and, as an option, skip-layer guidance
(sample.slg_scale / slg_layers, SD3.5 Medium's reference: 2.5 on blocks 7-9). LoRA names: SAI's in kohya files
(lora_unet_joint_blocks_0_x_block_attn_qkv, networks.lora_sd3), diffusers' in PEFT files
(transformer.transformer_blocks.0.attn.to_q)."""
import numpy as np

import flame_core as flame
import flame_nn

from .. import checkpoint_io as CIO
from ..training.family import DDPM_FIELDS, FLOW_FIELDS
from ..training.family_base import FlowMatchingFamily, FlowSamplerPreviews
from . import MMDiT, load_sd3, sd3_params
from . import family_parts as sd3_parts
from . import ops as sd3_ops
from . import pipeline as sd3_pipeline
from . import sampling as sd3_sampling
from .components import read_sd3_params
from .loading import SD3CheckpointError, save_sd3
from .lora_keys import TARGET_PRESETS, name_map_for

_DDPM_NOTE = "SD3 trains with flow matching (train.timestep_type, train.weighting_scheme); this is for sdxl's DDPM"


class SD3Family(FlowSamplerPreviews, FlowMatchingFamily):
    name = "sd3"
    label = "SD3"
    takes_negative_prompt = True
    model_words = "an SD3 / SD3.5 MMDiT"
    model_class = MMDiT
    parts, pipeline = sd3_parts, sd3_pipeline
    latent_scale, latent_shift = sd3_sampling.LATENT_SCALE, sd3_sampling.LATENT_SHIFT
    default_size = "sd3.5-tiny"
    model_sizes = ("sd3.5-large", "sd3.5-large-turbo", "sd3.5-medium", "sd3.5-tiny")
    target_presets = TARGET_PRESETS
    config_defaults = {"name": "sd3_lora", "train.timestep_type": "logit_normal", "sample.guidance_scale": 4.5}
    fields = FLOW_FIELDS + ("sample.neg", "sample.slg_scale", "sample.slg_layers", "model.clip_g_path",
                            "model.t5_path", "model.t5_max_length", "model.quantize_te", "model.use_t5")
    field_notes = {**{k: _DDPM_NOTE for k in DDPM_FIELDS},
                   "train.guidance": "SD3 has no guidance embedding; previews use CFG (sample.guidance_scale)"}
    spec_errors = (SD3CheckpointError, KeyError, ValueError, OSError)
    takes_text_loras = True

    # ------------------------------------------------------------------ before anything is loaded
    def apply_defaults(self, cfg):
        """The family's defaults, and the LoRA file's layout: PEFT unless save.format is given (diffusers 0.42 loads
        nothing from SD3 kohya files, lora_unet_joint_blocks_...; ComfyUI reads both), kohya for LoKr / LoHa, which
        PEFT files cannot hold."""
        super().apply_defaults(cfg)
        if "save.format" not in cfg.given and cfg.network.type not in ("lokr", "loha"):
            cfg.save.format = "peft"

    def preset(self, size):
        return sd3_params(size)

    def read_spec(self, path):
        return read_sd3_params(path)

    def spec_problems(self, cfg, spec, prefix=""):
        e, sm = [], cfg.sample
        if sm.slg_scale > 0 and any(i >= spec.depth for i in sm.slg_layers if isinstance(i, int)):
            e.append(f"{prefix}sample.slg_layers: {sm.slg_layers} are not all joint blocks of this MMDiT (depth "
                     f"{spec.depth})")
        with flame_nn.empty_init(device="cpu"):
            probe = MMDiT(spec)
        return e + self.target_problems(probe, cfg, name_map_for(spec), prefix)

    def image_size_limit(self, spec):
        # the stored position table has pos_embed_max_size patches a side, cropped to the latent grid
        side = spec.pos_embed_max_size * spec.patch_size * self.vae_scale_factor
        return side, (f"its position table holds {spec.pos_embed_max_size}x{spec.pos_embed_max_size} patches "
                      f"(pos_embed_max_size) of {spec.patch_size * self.vae_scale_factor} px")

    # ------------------------------------------------------------------ building
    def load_model(self, path, spec, dtype, device):
        return load_sd3(path, dtype=dtype, device=device, params=spec)

    def empty_model(self, spec, dtype, device):
        model = super().empty_model(spec, dtype, device)
        model.register_buffer("pos_embed", sd3_ops.pos_embed_tensor(spec, dtype, device))
        return model

    def block_stacks(self, model):
        return ["joint_blocks"]

    def lora_name_map(self, model):
        return name_map_for(model.params)

    # ------------------------------------------------------------------ LoRAs on the text encoders
    def text_lora_parts(self, encoders):
        return [("te1", encoders.clip_l), ("te2", encoders.clip_g), ("te3", encoders.t5)]   # (t5 None: no T5)

    def streamed_text_components(self, model_cfg, device, budget):
        return ("te3",) if sd3_parts.t5_storage(model_cfg, device, budget).endswith("stream") else ()

    def save_model(self, model, path, dtype, metadata=None, base=None, layout="native",
                   tokenizer=None):   # (see ModelFamily; tokenizer: an SDXL SAI base's only)
        """A full fine-tune's file: the MMDiT in SAI's names under model.diffusion_model. (as SAI's files; ComfyUI
        and FLAME's --model with --clip-l / --clip-g / --t5 / --vae read it); layout "diffusers": a folder with
        transformer/ (and the base pipeline's other parts)."""
        if layout == "diffusers":
            return CIO.write_pipeline_folder(path, "transformer", lambda d: save_sd3(
                model, d, "diffusers", dtype=dtype, metadata=metadata), base)
        return save_sd3(model, path, "sai", dtype=dtype, metadata=metadata)

    def lora_metadata(self, cfg, model):
        p = model.params
        kind = "m" if p.qk_norm is None else ("5-m" if p.dual_attention_layers else "5-l")  # kohya's model types
        meta = {"modelspec.architecture": f"stable-diffusion-3-{kind}/lora",
                "flame.base_model": self.base_model_name(cfg)}
        if cfg.network.type in ("lora", "locon"):  # (LyCORIS kinds keep save_adapters' lycoris.kohya)
            meta["ss_network_module"] = "networks.lora_sd3"
        return meta

    # ------------------------------------------------------------------ training
    def training_inputs(self, model, batch, device, train_cfg):
        x0 = flame.tensor(batch["latents"], dtype=flame.float32, device=device)          # (B, 16, h, w)
        cond = {"context": flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=device),
                "y": flame.tensor(batch["pooled_prompt_embeds"], dtype=flame.float32, device=device)}
        return x0, cond

    def image_seq_len(self, x0):
        return (x0.shape[2] // 2) * (x0.shape[3] // 2)

    def forward(self, model, x_t, t, cond):
        return model(x_t, t * sd3_sampling.NUM_TRAIN_TIMESTEPS, cond["y"], cond["context"])

    # ------------------------------------------------------------------ previews
    def negative_prompt(self, cfg):
        """sample.neg, else "" (diffusers' default negative for SD3)."""
        neg = cfg.sample.neg
        return neg if isinstance(neg, str) else ""

    def sample_options(self, cfg):
        """The sampler (sample.sampler 'heun', else Euler) and skip-layer guidance when sample.slg_scale > 0 (SAI's
        window: steps 1% to 30%)."""
        sm = cfg.sample
        options = super().sample_options(cfg)
        if sm.slg_scale:
            options["slg"] = sd3_sampling.SkipLayerGuidance(layers=tuple(sm.slg_layers), scale=sm.slg_scale)
        return options

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, slg=None,
               sampler="euler", scheduler="simple"):
        """One prompt's latents with SD3's Euler, Heun or DPM++ 2M sampler on its sigmas as `scheduler` spaces them; CFG
        against cond's negative_* arrays (zeros when the run encoded no negative: precomputed samples without text
        encoders)."""
        pos = {k: np.asarray(cond[k])[None] for k in self.sample_keys[1:]}
        neg = None
        if guidance != 1.0:
            neg = {k: np.asarray(cond[f"negative_{k}"])[None] if f"negative_{k}" in cond else np.zeros_like(pos[k])
                   for k in self.sample_keys[1:]}
            if neg["prompt_embeds"].shape != pos["prompt_embeds"].shape:
                raise ValueError(f"the negative prompt's embeddings {neg['prompt_embeds'].shape[1:]} and the "
                                 f"prompt's {pos['prompt_embeds'].shape[1:]} differ in shape")
        return sd3_pipeline.sample_latents(model, pos, neg, height=height, width=width, steps=steps, cfg=guidance,
                                           seeds=[seed], skip_layer_guidance=slg, callback=callback,
                                           sampler=sampler, scheduler=scheduler)
