"""Qwen-Image as a trainer family: rectified flow on the VAE's 16 channels normalised per channel, packed 2x2 as
Flux's; conditioning = the Qwen2.5-VL language model's states of the templated caption (prompt_embeds, L x 3584 for
the release; the pipeline's 34 template tokens dropped) with their padding mask (prompt_mask: padded tokens are
masked as keys, as diffusers). Timesteps: sigma uniform by default (train.timestep_type 'uniform'), as diffusers'
train_dreambooth_lora_qwen_image draws them (weighting 'none' over the scheduler's unshifted training sigmas: its
dynamic shift applies only to sampling); the model is fed sigma. Previews: Qwen-Image's scheduler (dynamic shift for
the token count, terminal sigma 0.02), true CFG only with a negative prompt (sample.neg; QwenImagePipeline has no
default negative) with the per-token norm rescale; sample.sampler 'heun' for Heun's steps.

Data: image folders with captions (the VAE and text encoder of a QwenImagePipeline folder, or the tiny preset's
random stand-ins: family_parts.py), precomputed samples (latents normalised per channel, prompt_embeds,
prompt_mask) or synthetic ones. LoRA files: PEFT (`transformer.transformer_blocks.0.attn.to_q.lora_A.weight`) by
default, kohya (`lora_unet_transformer_blocks_0_attn_to_q`) with save.format; both are diffusers' names."""
import numpy as np

import flame_core as flame
import flame_nn

from .. import checkpoint_io as CIO
from ..bfl.sampling import pack, pack_mask
from ..data.text_trim import batch_text_mask, valid_tokens
from ..training.family import DDPM_FIELDS, FLOW_FIELDS
from ..training.family_base import FlowMatchingFamily, FlowSamplerPreviews
from . import family_parts as qwen_parts
from . import sampling as qwen_sampling
from . import stages as qwen_stages
from .loading import QwenImageCheckpointError, load_qwen_image, read_qwen_image_params, save_qwen_image
from .lora_keys import TARGET_PRESETS
from .model import QwenImageTransformer2DModel
from .params import qwen_image_params

_DDPM_NOTE = "Qwen-Image trains with flow matching (train.timestep_type, train.weighting_scheme); this is sdxl's DDPM"


class QwenImageFamily(FlowSamplerPreviews, FlowMatchingFamily):
    name = "qwen_image"
    label = "Qwen-Image"
    takes_negative_prompt = True
    model_words = "a Qwen-Image transformer"
    model_class = QwenImageTransformer2DModel
    parts, pipeline = qwen_parts, qwen_stages
    sample_keys = ("latents", "prompt_embeds", "prompt_mask")
    cond_dims = ("joint_attention_dim", None)  # Qwen2.5-VL's width; no pooled vector
    default_size = "qwen-image-tiny"
    model_sizes = ("qwen-image", "qwen-image-tiny")
    target_presets = TARGET_PRESETS
    config_defaults = {"name": "qwen_image_lora", "train.timestep_type": "uniform",
                       "sample.guidance_scale": qwen_sampling.DEFAULT_CFG}
    fields = FLOW_FIELDS + ("sample.neg", "model.quantize_te")   # (quantize_te: Qwen2.5-VL's Linears in fp8)
    field_notes = {**{k: _DDPM_NOTE for k in DDPM_FIELDS},
                   "train.guidance": "Qwen-Image has no guidance embedding; previews use CFG with sample.neg",
                   "model.t5_path": "Qwen-Image's text encoder is Qwen2.5-VL (its pipeline folder's text_encoder/)",
                   "model.clip_g_path": "Qwen-Image has no CLIP"}
    spec_errors = (QwenImageCheckpointError, KeyError, ValueError, OSError)

    # ------------------------------------------------------------------ before anything is loaded
    def apply_defaults(self, cfg):
        """The family's defaults, and PEFT LoRA files unless save.format is given (diffusers loads them as they are;
        kohya for LoKr / LoHa, which PEFT files cannot hold)."""
        super().apply_defaults(cfg)
        if "save.format" not in cfg.given and cfg.network.type not in ("lokr", "loha"):
            cfg.save.format = "peft"

    def preset(self, size):
        return qwen_image_params(size)

    def read_spec(self, path):
        return read_qwen_image_params(path)

    def spec_problems(self, cfg, spec, prefix=""):
        with flame_nn.empty_init(device="cpu"):
            probe = QwenImageTransformer2DModel(spec)
        return self.target_problems(probe, cfg, probe.adapter_name_map(), prefix)

    # ------------------------------------------------------------------ building
    def load_model(self, path, spec, dtype, device):
        return load_qwen_image(path, dtype=dtype, device=device, params=spec)

    def block_stacks(self, model):
        return ["transformer_blocks"]

    def lora_name_map(self, model):
        return model.adapter_name_map()

    def save_model(self, model, path, dtype, metadata=None, base=None, layout="native",
                   tokenizer=None):   # (see ModelFamily; tokenizer: an SDXL SAI base's only)
        """A full fine-tune's file: the transformer in diffusers' (= the release's) names; layout "diffusers": a
        folder with transformer/ (and the base pipeline's other parts)."""
        if layout == "diffusers":
            return CIO.write_pipeline_folder(path, "transformer", lambda d: save_qwen_image(
                model, d, dtype=dtype, metadata=metadata), base)
        return save_qwen_image(model, path, dtype=dtype, metadata=metadata)

    def lora_metadata(self, cfg, model):
        return {"modelspec.architecture": "qwen-image/lora", "flame.base_model": self.base_model_name(cfg)}

    # ------------------------------------------------------------------ training
    def training_inputs(self, model, batch, device, train_cfg):
        latents = batch["latents"]                                      # (B, 16, h, w), normalised per channel
        x0 = pack(flame.tensor(latents, dtype=flame.float32, device=device))
        txt = flame.tensor(batch["prompt_embeds"], dtype=flame.float32, device=device)
        # the token grid travels as a tensor's shape (cond holds tensors only; a shape needs no host sync)
        grid = flame.zeros(latents.shape[2] // 2, latents.shape[3] // 2, device=device)
        cond = {"txt": txt, "grid": grid}
        mask = batch_text_mask(batch)
        if mask is not None:
            cond["txt_mask"] = flame.tensor(mask, device=device)
        return x0, cond

    def attended_text_length(self, prompt_mask):
        """The valid tokens when they lead (the pipeline's padding trails them); None for a mask with holes."""
        m = valid_tokens(prompt_mask)
        n = int(m.sum())
        return n if m[:n].all() else None

    def image_seq_len(self, x0):
        return x0.shape[1]

    def loss_mask(self, mask, x0):
        return pack_mask(mask, self.latent_channels, x0.device)

    def forward(self, model, x_t, t, cond):
        rows, cols = cond["grid"].shape
        return model(x_t, cond["txt"], cond.get("txt_mask"), t, [[(1, rows, cols)]] * x_t.shape[0])

    # ------------------------------------------------------------------ previews
    def negative_prompt(self, cfg):
        """sample.neg, else None: QwenImagePipeline runs CFG only when a negative prompt is given."""
        neg = cfg.sample.neg
        return neg if isinstance(neg, str) else None

    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, sampler="euler",
               scheduler="simple"):
        pos = {k: np.asarray(cond[k])[None] for k in self.sample_keys[1:]}
        neg = None
        if "negative_prompt_embeds" in cond:
            neg = {k: np.asarray(cond[f"negative_{k}"])[None] for k in self.sample_keys[1:]}
        return qwen_sampling.sample_latents(model, pos, neg, height=height, width=width, steps=steps,
                                            cfg=guidance, seeds=[seed], callback=callback, sampler=sampler,
                                            scheduler=scheduler)
