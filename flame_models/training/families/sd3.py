"""SD3 / SD3.5 (MMDiT, MMDiT-X) as a trainer family: rectified flow on 16-channel latents (SD3's latent format
1.5305 / 0.0609, no packing), timesteps logit-normal by default (ai-toolkit's SD3 choice; train.logit_mean /
logit_std; timestep_type 'shift' is diffusers' shifted draw with train.shift 3.0), SD3's loss weightings
(train.weighting_scheme), the model fed t = 1000·σ; conditioning = context (CLIP-L + CLIP-G penultimate states ++
T5, or zeros in T5's place) and the pooled vector (2048); previews with SD3's Euler sampler, classifier-free guidance
with a negative prompt (sample.neg, "" by default as diffusers) and, as an option, skip-layer guidance
(sample.slg_scale / slg_layers, SD3.5 Medium's reference: 2.5 on blocks 7-9). LoRA names: SAI's in kohya files
(lora_unet_joint_blocks_0_x_block_attn_qkv, networks.lora_sd3), diffusers' in PEFT files
(transformer.transformer_blocks.0.attn.to_q)."""
import os

import numpy as np

import flame_core as flame
import flame_nn

from ...conditioning.files import ModelFilesError, detect_family
from ...sd3 import MMDiT, load_sd3, sd3_params
from ...sd3 import ops as sd3_ops
from ...sd3 import pipeline as sd3_pipeline
from ...sd3 import sampling as sd3_sampling
from ...sd3.components import read_sd3_params
from ...sd3.loading import SD3CheckpointError
from ...sd3.lora_keys import TARGET_PRESETS, name_map_for
from ..family import DDPM_FIELDS, FLOW_FIELDS, ModelFamily, ModelFileError
from ..objective import FlowMatching
from ..random_init import init_random_
from ..timesteps import TIMESTEP_TYPES
from ..validation import choice
from . import sd3_parts
from .sd_parts import RANDOM_SEED

_DDPM_NOTE = "SD3 trains with flow matching (train.timestep_type, train.weighting_scheme); this is for sdxl's DDPM"


class SD3Family(ModelFamily):
    name = "sd3"
    latent_channels = 16
    vae_scale_factor = 8
    pixel_multiple = 16                  # 8 px per latent, 2x2 latents per patch
    latent_scale, latent_shift = sd3_sampling.LATENT_SCALE, sd3_sampling.LATENT_SHIFT
    noise_schedulers = ("flowmatch", "flow_match")
    samplers = ("flowmatch", "flow_match", "euler")
    default_size = "sd3.5-tiny"
    model_sizes = ("sd3.5-large", "sd3.5-large-turbo", "sd3.5-medium", "sd3.5-tiny")
    sample_keys = ("latents", "prompt_embeds", "pooled_prompt_embeds")
    target_presets = TARGET_PRESETS
    default_target = "attention"
    config_defaults = {"name": "sd3_lora", "train.timestep_type": "logit_normal", "sample.guidance_scale": 4.5}
    fields = FLOW_FIELDS + ("sample.neg", "sample.slg_scale", "sample.slg_layers", "model.clip_g_path",
                            "model.t5_path", "model.t5_max_length", "model.quantize_te", "model.use_t5")
    field_notes = {**{k: _DDPM_NOTE for k in DDPM_FIELDS},
                   "train.guidance": "SD3 has no guidance embedding; previews use CFG (sample.guidance_scale)"}

    # ------------------------------------------------------------------ before anything is loaded
    def config_problems(self, cfg, prefix=""):
        e, t, p = [], cfg.train, prefix
        if t.noise_scheduler not in self.noise_schedulers:
            e.append(f"{p}train.noise_scheduler: SD3 trains with 'flowmatch', got {t.noise_scheduler!r}")
        choice(e, f"{p}train.timestep_type", t.timestep_type, TIMESTEP_TYPES)
        if cfg.sample.sampler is not None and cfg.sample.sampler not in self.samplers:
            e.append(f"{p}sample.sampler: SD3 previews use its flow-matching Euler sampler ('flowmatch'), got "
                     f"{cfg.sample.sampler!r}")
        if cfg.model.name_or_path is None and cfg.model.size is not None:
            choice(e, f"{p}model.size", cfg.model.size, self.model_sizes)
        return e

    def describe_model(self, model_cfg):
        """SD3Params from the checkpoint's headers (or the size preset); ModelFileError when the file or folder is
        not an SD3 MMDiT, saying what it looks like."""
        path = model_cfg.name_or_path
        if path is None:
            return sd3_params(model_cfg.size or self.default_size)
        try:
            family, words = detect_family(path, error=ModelFileError, default="other")
        except ModelFilesError as e:
            raise ModelFileError(str(e).splitlines()[0]) from None
        if family != "sd3":
            raise ModelFileError(f"{path} is not an SD3 / SD3.5 MMDiT: it looks like {words}"
                                 + (f" (model.arch: {family} trains it)" if family in ("flux", "sdxl") else ""))
        try:
            return read_sd3_params(path)
        except (SD3CheckpointError, KeyError, ValueError, OSError) as e:
            raise ModelFileError(f"{path}: {str(e).splitlines()[0]}") from None

    def spec_problems(self, cfg, spec, prefix=""):
        e, sm = [], cfg.sample
        if sm.slg_scale > 0 and any(i >= spec.depth for i in sm.slg_layers if isinstance(i, int)):
            e.append(f"{prefix}sample.slg_layers: {sm.slg_layers} are not all joint blocks of this MMDiT (depth "
                     f"{spec.depth})")
        with flame_nn.empty_init(device="cpu"):
            probe = MMDiT(spec)
        return e + self.target_problems(probe, cfg, name_map_for(spec), prefix)

    def check_sample(self, shapes, spec):
        """None, or what is wrong with one sample's tensor shapes (keys absent from `shapes` are not checked)."""
        ctx = spec.context_in_dim if spec is not None else None
        pooled_dim = spec.pooled_in_dim if spec is not None else None
        lat, txt, pooled = (shapes.get(k) for k in self.sample_keys)
        if lat is not None and (len(lat) != 3 or lat[0] != self.latent_channels or lat[1] % 2 or lat[2] % 2):
            return f"latents {lat}: expected ({self.latent_channels}, h, w) with even h and w"
        if txt is not None and (len(txt) != 2 or (ctx is not None and txt[1] != ctx)):
            return f"prompt_embeds {txt}: expected (L, {ctx or 'context_in_dim'}) for this model"
        if pooled is not None and (len(pooled) != 1 or (pooled_dim is not None and pooled[0] != pooled_dim)):
            return f"pooled_prompt_embeds {pooled}: expected ({pooled_dim or 'pooled_in_dim'},) for this model"
        return None

    def synthetic_conditioning(self, spec, text_length):
        return {"prompt_embeds": (text_length, spec.context_in_dim), "pooled_prompt_embeds": (spec.pooled_in_dim,)}

    # ------------------------------------------------------------------ building
    def build_model(self, model_cfg, spec, dtype, device, stream=False):
        """The frozen MMDiT: loaded key by key (into host memory when its blocks will stream), or random. A random
        model larger than sd3.5-tiny on a GPU is drawn there; with `stream`, its joint blocks stay empty until
        block_initializer fills each as the streamer packs it."""
        if model_cfg.name_or_path:
            return load_sd3(model_cfg.name_or_path, dtype=dtype, device="cpu" if stream else device, params=spec)
        if flame.device(device).type != "cuda" or (model_cfg.size or self.default_size) == self.default_size:
            return MMDiT(spec, dtype=dtype, device=device)
        with flame_nn.empty_init(device=device, dtype=dtype):
            model = MMDiT(spec)
        model.register_buffer("pos_embed", sd3_ops.pos_embed_tensor(spec, dtype, device))
        g = flame.Generator(device).manual_seed(RANDOM_SEED)
        for name, child in model.named_children():
            if not stream or name not in self.block_stacks(model):
                init_random_(child, g)
        return model

    def block_initializer(self, model):
        if not any(p.is_meta for p in model.joint_blocks.parameters()):
            return None
        g = flame.Generator(model.x_embedder.proj.weight.device).manual_seed(RANDOM_SEED + 1)
        return lambda block: init_random_(block, g)

    def spec_of(self, model):
        if not isinstance(model, MMDiT):
            raise TypeError(f"the sd3 family trains a flame_models.sd3.MMDiT, got {type(model).__name__}")
        return model.params

    def block_stacks(self, model):
        return ["joint_blocks"]

    def lora_name_map(self, model):
        return name_map_for(model.params)

    def lora_metadata(self, cfg, model):
        p = model.params
        kind = "m" if p.qk_norm is None else ("5-m" if p.dual_attention_layers else "5-l")  # kohya's model types
        meta = {"modelspec.architecture": f"stable-diffusion-3-{kind}/lora",
                "flame.base_model": (os.path.basename(cfg.model.name_or_path.rstrip("/\\"))
                                     if cfg.model.name_or_path else cfg.model.size or self.default_size)}
        if cfg.network.type in ("lora", "locon"):  # (LyCORIS kinds keep save_adapters' lycoris.kohya)
            meta["ss_network_module"] = "networks.lora_sd3"
        return meta

    # ------------------------------------------------------------------ image folders and text prompts
    def parts_problems(self, cfg, *, vae, text, prefix=""):
        return sd3_parts.problems(cfg, vae=vae, text=text, prefix=prefix)

    def vae_id(self, model_cfg, device):
        return sd3_parts.vae_id(model_cfg, device)

    def load_vae(self, model_cfg, device):
        return sd3_parts.load_vae(model_cfg, device)

    def encode_images(self, vae, pixels):
        x = flame.tensor(np.ascontiguousarray(pixels, dtype=np.float32), device=vae.device)
        return sd3_pipeline.encode_images(vae, x).numpy()

    def decode(self, vae, latents):
        x = flame.tensor(np.ascontiguousarray(latents, dtype=np.float32), device=vae.device)
        return sd3_pipeline.decode_latents(vae, x).float().numpy()

    def text_encoder_id(self, model_cfg, device, budget=None):
        return sd3_parts.text_id(model_cfg, device, budget)

    def describe_text_encoders(self, model_cfg, device, budget=None):
        return sd3_parts.describe(model_cfg, device, budget)

    def load_text_encoders(self, model_cfg, device, budget=None):
        return sd3_parts.load_text_encoders_for(model_cfg, device, budget)

    def encode_prompts(self, encoders, prompts):
        out = encoders.encode(list(prompts))
        return {k: v.float().numpy() for k, v in out.items()}

    def negative_prompt(self, cfg):
        """sample.neg, else "" (diffusers' default negative for SD3)."""
        neg = cfg.sample.neg
        return neg if isinstance(neg, str) else ""

    def sample_options(self, cfg):
        """Skip-layer guidance when sample.slg_scale > 0 (SAI's window: steps 1% to 30%)."""
        sm = cfg.sample
        if not sm.slg_scale:
            return {}
        return {"slg": sd3_sampling.SkipLayerGuidance(layers=tuple(sm.slg_layers), scale=sm.slg_scale)}

    # ------------------------------------------------------------------ training
    def objective(self, train_cfg):
        t = train_cfg
        return FlowMatching(t.timestep_type, shift=t.shift, sigmoid_scale=t.sigmoid_scale, logit_mean=t.logit_mean,
                            logit_std=t.logit_std, mode_scale=t.mode_scale, weighting_scheme=t.weighting_scheme,
                            noise_offset=t.noise_offset)

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
    def sample(self, model, cond, *, height, width, steps, guidance, seed, device, callback=None, slg=None):
        """One prompt's latents with SD3's Euler sampler; CFG against cond's negative_* arrays (zeros when the run
        encoded no negative: precomputed samples without text encoders)."""
        pos = {k: np.asarray(cond[k])[None] for k in self.sample_keys[1:]}
        neg = None
        if guidance != 1.0:
            neg = {k: np.asarray(cond[f"negative_{k}"])[None] if f"negative_{k}" in cond else np.zeros_like(pos[k])
                   for k in self.sample_keys[1:]}
            if neg["prompt_embeds"].shape != pos["prompt_embeds"].shape:
                raise ValueError(f"the negative prompt's embeddings {neg['prompt_embeds'].shape[1:]} and the "
                                 f"prompt's {pos['prompt_embeds'].shape[1:]} differ in shape")
        return sd3_pipeline.sample_latents(model, pos, neg, height=height, width=width, steps=steps, cfg=guidance,
                                           seeds=[seed], skip_layer_guidance=slg, callback=callback)
