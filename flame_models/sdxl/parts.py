"""load_sdxl / save_sdxl: a whole SDXL model -- UNet, VAE, CLIP-L, CLIP-G and their tokenizers -- from and to an SAI
single file or a diffusers folder.

    parts = load_sdxl("sd_xl_base_1.0.safetensors", dtype=flame.bfloat16, device="cuda")
    parts.unet, parts.vae, parts.clip_l, parts.clip_g    # SDXLUNet, AutoencoderKL, CLIPTextModel[WithProjection]
    save_sdxl(parts, "sdxl_diffusers/", layout="diffusers")
    save_sdxl(parts, "sdxl.safetensors", layout="sai")

The SAI file holds the UNet under `model.diffusion_model.` (SAI names), the VAE under `first_stage_model.` (LDM
names), CLIP-L under `conditioner.embedders.0.transformer.` (transformers' names) and CLIP-G under
`conditioner.embedders.1.model.` (OpenCLIP's: q / k / v fused into attn.in_proj, text_projection stored (in, out)).
Configs are inferred from the shapes (or from a diffusers folder's config.json files); FLAME's own files also carry
them in their metadata, so a model whose config the weights cannot tell round-trips. Every file is written to a
temporary name and renamed; a diffusers folder is written beside its destination and renamed into place whole.

The SDXL VAE overflows in float16 (its decoder's activations pass 65504): load_sdxl gives it the dtype asked for,
and flame_models.sdxl.pipeline decodes a float16 VAE in float32 (as diffusers' force_upcast); bfloat16 (float32's
range) and float32 decode as they are.
"""
import json
import math
import os
import shutil
from dataclasses import dataclass

import flame_core as flame
from flame_core.io import save_file

from ..checkpoint_io import cast_item, check_saveable, write_json
from ..text_encoders import load_clip
from ..tokenization import load_tokenizer
from ..vae import load_vae
from ..vae.saving import CONFIG_METADATA_KEY as VAE_CONFIG_KEY
from ..vae.saving import save_vae
from .components import TEXT_CONFIGS_METADATA_KEY, SDXLFiles, find_sdxl_files
from .keys import SAI_PREFIXES
from .loading import CONFIG_METADATA_KEY as UNET_CONFIG_KEY
from .loading import load_unet
from .saving import save_unet

LAYOUTS = ("sai", "diffusers")
SAI_PREFIX = {"unet": SAI_PREFIXES[0], "vae": "first_stage_model.", "clip_l": "conditioner.embedders.0.transformer.",
              "clip_g": "conditioner.embedders.1.model."}
SCALING_FACTOR = 0.13025
# diffusers' SDXL base scheduler (scheduler/scheduler_config.json)
SCHEDULER_CONFIG = {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                    "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
                    "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0,
                    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
                    "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}


@dataclass
class SDXLParts:
    """The parts of an SDXL model: unet (SDXLUNet), vae (AutoencoderKL), clip_l (CLIPTextModel), clip_g
    (CLIPTextModelWithProjection), their CLIP tokenizers, and the SDXLFiles they came from (None when built)."""
    unet: object
    vae: object
    clip_l: object
    clip_g: object
    clip_l_tokenizer: object = None
    clip_g_tokenizer: object = None
    files: SDXLFiles = None


PARTS = ("unet", "vae", "clip_l", "clip_g")


def load_sdxl(path, dtype=None, device=None, *, vae=None, clip_l=None, clip_g=None, tokenizer=None, configs=None,
              parts=PARTS):
    """Every part of an SDXL model (SDXLParts) from an SAI single file or a diffusers folder (or a UNet with the
    other parts named: vae=, clip_l=, clip_g=, tokenizer=; see find_sdxl_files), in `dtype` (default: each part's
    stored dtype) on `device`, frozen, in eval mode. configs: {"unet" | "vae" | "clip_l" | "clip_g": config or dict
    of fields} for what the weights cannot tell. parts: which of PARTS to read (the others None; the tokenizers
    always). Every part is checked (headers) before any weight is read."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"load_sdxl: parts must be among {PARTS}, got {sorted(unknown)}")
    files = path if isinstance(path, SDXLFiles) else find_sdxl_files(path, vae=vae, clip_l=clip_l, clip_g=clip_g,
                                                                    tokenizer=tokenizer, configs=configs)
    c = files.configs
    text = dict(dtype=dtype, device=device, quantize=None)
    got = {
        "unet": lambda: load_unet(files.unet, dtype=dtype, device=device, config=files.config),
        "vae": lambda: load_vae(files.vae, dtype=dtype, device=device, config=c.get("vae")),
        "clip_l": lambda: load_clip(files.clip_l, prefix=files.prefixes.get("clip_l"), config=c.get("clip_l"),
                                    projection=False, **text),
        "clip_g": lambda: load_clip(files.clip_g, prefix=files.prefixes.get("clip_g"), config=c.get("clip_g"),
                                    projection=True, **text)}
    loaded = {k: got[k]() if k in parts else None for k in PARTS}
    return SDXLParts(**loaded, clip_l_tokenizer=load_tokenizer("clip_l", files.clip_l_tokenizer),
                     clip_g_tokenizer=load_tokenizer("clip_g", files.clip_g_tokenizer), files=files)


# ----------------------------------------------------------------------------- saving
def openclip_state(clip_g, prefix=""):
    """CLIP-G's state dict (a CLIPTextModelWithProjection) in OpenCLIP's names, as SAI checkpoints store it: q, k, v
    fused into attn.in_proj_weight / in_proj_bias, text_projection (in, out), logit_scale ln(100)."""
    sd = {k: v.detach() for k, v in clip_g.state_dict().items()}
    top = {"text_model.embeddings.token_embedding.weight": "token_embedding.weight",
           "text_model.embeddings.position_embedding.weight": "positional_embedding",
           "text_model.final_layer_norm.weight": "ln_final.weight",
           "text_model.final_layer_norm.bias": "ln_final.bias"}
    sub = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
           "self_attn.out_proj": "attn.out_proj"}
    out = {}
    for k, v in sd.items():
        if k in top:
            out[prefix + top[k]] = v
        elif k == "text_projection.weight":
            out[prefix + "text_projection"] = v.T.contiguous()
        elif k.startswith("text_model.encoder.layers."):
            i, rest = k[len("text_model.encoder.layers."):].split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            if module in sub:
                out[f"{prefix}transformer.resblocks.{i}.{sub[module]}.{leaf}"] = v
            elif module == "self_attn.q_proj":
                qkv = [sd[f"text_model.encoder.layers.{i}.self_attn.{p}_proj.{leaf}"] for p in "qkv"]
                out[f"{prefix}transformer.resblocks.{i}.attn.in_proj_{leaf}"] = flame.cat(qkv, dim=0)
            elif module not in ("self_attn.k_proj", "self_attn.v_proj"):
                raise ValueError(f"openclip_state: no OpenCLIP name for {k}")
        else:
            raise ValueError(f"openclip_state: no OpenCLIP name for {k}")
    out[prefix + "logit_scale"] = flame.tensor(math.log(100.0), dtype=flame.float32)
    return out


def _check_parts(parts):
    from ..text_encoders import CLIPTextModel, CLIPTextModelWithProjection
    if not isinstance(parts, SDXLParts):
        raise TypeError(f"save_sdxl expects SDXLParts (as load_sdxl returns), got {type(parts).__name__}")
    if not isinstance(parts.clip_g, CLIPTextModelWithProjection):
        raise ValueError("save_sdxl: clip_g must be a CLIPTextModelWithProjection (SDXL's pooled vector is its "
                         "projection)")
    if not isinstance(parts.clip_l, CLIPTextModel):
        raise ValueError(f"save_sdxl: clip_l must be a CLIPTextModel, got {type(parts.clip_l).__name__}")
    for name in ("unet", "clip_l", "clip_g"):
        if getattr(getattr(parts, name), "streamer", None) is not None:
            raise ValueError(f"save_sdxl: {name}'s blocks are streamed; save a model loaded without streaming")


def save_sdxl(parts, path, layout="sai", *, dtype=None, metadata=None):
    """Write SDXLParts as an SAI single file (`path` ending in .safetensors; the tokenizers are not part of that
    format) or a diffusers folder (`path` a new folder: model_index.json, unet/, vae/, text_encoder/,
    text_encoder_2/, tokenizer/, tokenizer_2/, scheduler/). dtype: the UNet's and text encoders' floating weights
    written in it (None: their own; the VAE keeps its own); metadata: more entries of the SAI file's (or the UNet
    file's) metadata. Nothing half-written is left: the file is renamed into place once complete, the folder is
    written beside its destination and renamed whole. Returns the paths written (the file, or the folder)."""
    if layout not in LAYOUTS:
        raise ValueError(f"save_sdxl: layout must be 'sai' or 'diffusers', got {layout!r}")
    _check_parts(parts)
    check_saveable(parts.unet, "save_sdxl")
    path = os.fspath(path)
    if layout == "sai":
        if not path.endswith(".safetensors"):
            raise ValueError(f"save_sdxl: an SAI checkpoint is one .safetensors file, got {path!r}")
        return [_save_sai(parts, path, dtype, metadata)]
    if path.endswith(".safetensors"):
        raise ValueError(f"save_sdxl: a diffusers model is a folder, got {path!r}")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"save_sdxl: {path} exists and is not an empty folder; choose a new folder")
    tmp = f"{path.rstrip(os.sep)}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _save_diffusers(parts, tmp, dtype, metadata)
        if os.path.isdir(path):
            os.rmdir(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [path]


def _save_sai(parts, path, dtype=None, metadata=None):
    with flame.no_grad():
        state = {}
        state.update({SAI_PREFIX["unet"] + k: cast_item(p.detach(), dtype) for k, p in parts.unet.named_parameters()})
        state.update({SAI_PREFIX["vae"] + k: p.detach() for k, p in parts.vae.named_parameters()})
        state.update({SAI_PREFIX["clip_l"] + k: cast_item(v.detach(), dtype)
                      for k, v in parts.clip_l.state_dict().items()})
        state.update({k: cast_item(v, dtype) for k, v in openclip_state(parts.clip_g, SAI_PREFIX["clip_g"]).items()})
    texts = {"clip_l": parts.clip_l.config.to_dict(), "clip_g": parts.clip_g.config.to_dict()}
    metadata = {**(metadata or {}), "format": "pt",
                UNET_CONFIG_KEY: json.dumps(parts.unet.config.to_dict(), sort_keys=True),
                VAE_CONFIG_KEY: json.dumps(parts.vae.config.to_dict(), sort_keys=True),
                TEXT_CONFIGS_METADATA_KEY: json.dumps(texts, sort_keys=True)}
    save_file(state, path, metadata=metadata)
    return path


def _save_diffusers(parts, folder, dtype=None, metadata=None):
    os.makedirs(folder)
    save_unet(parts.unet, os.path.join(folder, "unet"), layout="diffusers", dtype=dtype, metadata=metadata)
    save_sdxl_components(parts, folder, dtype)


def save_sdxl_components(parts, folder, dtype=None):
    """Every part of `parts` but the UNet into the diffusers folder `folder` (existing or not): vae/, text_encoder/,
    text_encoder_2/, tokenizer/, tokenizer_2/, scheduler/ and model_index.json (which lists unet/: the caller writes
    it -- save_sdxl, or a full fine-tune's trained UNet). dtype: the text encoders' floating weights as written."""
    os.makedirs(folder, exist_ok=True)
    vae_dir = os.path.join(folder, "vae")
    save_vae(parts.vae, vae_dir, layout="diffusers")
    with open(os.path.join(vae_dir, "config.json")) as f:
        vae_cfg = json.load(f)
    vae_cfg.update(scaling_factor=SCALING_FACTOR, force_upcast=True)  # what diffusers' SDXL pipeline reads
    write_json(os.path.join(vae_dir, "config.json"), vae_cfg, sort_keys=True)
    parts.clip_l.save_pretrained(os.path.join(folder, "text_encoder"), dtype)
    parts.clip_g.save_pretrained(os.path.join(folder, "text_encoder_2"), dtype)
    toks = {"tokenizer": parts.clip_l_tokenizer, "tokenizer_2": parts.clip_g_tokenizer}
    for sub, tok in toks.items():
        if tok is not None:
            tok.save_pretrained(os.path.join(folder, sub))
    os.makedirs(os.path.join(folder, "scheduler"))
    write_json(os.path.join(folder, "scheduler", "scheduler_config.json"), SCHEDULER_CONFIG, sort_keys=True)
    index = {"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
             "scheduler": ["diffusers", "EulerDiscreteScheduler"],
             "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    for sub, tok in toks.items():
        index[sub] = ["transformers", "CLIPTokenizer"] if tok is not None else [None, None]
    write_json(os.path.join(folder, "model_index.json"), index, sort_keys=True)
