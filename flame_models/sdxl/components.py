"""Finding the parts of an SDXL text-to-image model: the UNet, the VAE, CLIP-L, CLIP-G (OpenCLIP bigG) and their
tokenizers.

    files = find_sdxl_files("sd_xl_base_1.0.safetensors")                  # an SAI file that holds every part
    files = find_sdxl_files("stable-diffusion-xl-base-1.0/")                # a diffusers folder
    files = find_sdxl_files("unet.safetensors", vae="sdxl_vae.safetensors", clip_l=..., clip_g=...)

A part not named comes from the diffusers folder (unet/, vae/, text_encoder/, text_encoder_2/, tokenizer/,
tokenizer_2/) or from inside the SAI file (`first_stage_model.`, `conditioner.embedders.0.` CLIP-L in transformers'
names, `conditioner.embedders.1.` CLIP-G in OpenCLIP's). Only headers are read: every part is checked to be what it
should be and to fit the UNet (CLIP-L + CLIP-G widths = the UNet's context width, CLIP-G's projection = the pooled
part of y, VAE latent channels = the UNet's input channels) before anything is loaded; ONE error lists every problem.
"""
import json
import os
from dataclasses import dataclass, field

from ..conditioning import files as F
from .config import UNetConfig
from .loading import UNetCheckpoint, UNetCheckpointError, infer_config

SUBFOLDERS = {"unet": "unet", "vae": "vae", "clip_l": "text_encoder", "clip_g": "text_encoder_2",
              "clip_l_tokenizer": "tokenizer", "clip_g_tokenizer": "tokenizer_2"}
SPECS = {"unet": F.PartSpec("unet", "an SDXL UNet", "--model", "unet"),
         "vae": F.PartSpec("vae", "a VAE (autoencoder)", "--vae", "vae", ("first_stage_model.",)),
         "clip_l": F.PartSpec("clip", "a CLIP text encoder (CLIP-L)", "--clip-l", "text_encoder",
                              ("conditioner.embedders.0.",)),
         "clip_g": F.PartSpec("clip", "a CLIP text encoder (CLIP-G)", "--clip-g", "text_encoder_2",
                              ("conditioner.embedders.1.",))}
# FLAME's own SAI files (save_sdxl) carry the text encoders' configs here: {"clip_l": {...}, "clip_g": {...}}
TEXT_CONFIGS_METADATA_KEY = "flame.sdxl_text_encoder_configs"


class SDXLFilesError(F.ModelFilesError):
    """Parts of an SDXL model that are missing, unreadable, of the wrong kind or that do not fit together; the
    message has one line per problem, each naming the file."""


@dataclass
class SDXLFiles:
    """Where each part of an SDXL model is: a safetensors file, an index JSON or a folder (the same file for every
    part of an SAI checkpoint: `prefixes` says under which key prefix each one is). Tokenizers: folders, or None for
    the vocabulary packaged with FLAME. config: the UNet's UNetConfig. configs: {part: config} for parts whose config
    the weights do not tell (a non-released CLIP width, a VAE's group count), passed to the loaders."""
    unet: str
    vae: str
    clip_l: str
    clip_g: str
    clip_l_tokenizer: str = None
    clip_g_tokenizer: str = None
    config: UNetConfig = None
    prefixes: dict = field(default_factory=dict)
    configs: dict = field(default_factory=dict)


def find_sdxl_files(path, *, vae=None, clip_l=None, clip_g=None, tokenizer=None, configs=None):
    """SDXLFiles of an SDXL model: `path` an SAI single file, a diffusers folder or a UNet file / folder; vae, clip_l,
    clip_g name parts it lacks (or replace its own); `tokenizer` a folder holding tokenizer/ (CLIP-L) and
    tokenizer_2/ (CLIP-G) -- default the model folder's, else the vocabulary packaged with FLAME. configs: {"unet":
    UNetConfig or dict of fields, "vae": ..., "clip_l": ..., "clip_g": ...} for what the weights cannot tell. Reads
    headers only; raises SDXLFilesError listing every problem."""
    path = os.fspath(path)
    configs = dict(configs or {})
    given = {"unet": path, "vae": vae, "clip_l": clip_l, "clip_g": clip_g}
    root, found, problems = F.locate_parts(path, given, SPECS, main="unet", error=SDXLFilesError)
    config = None
    if "unet" in found:
        try:
            with UNetCheckpoint(found["unet"].path) as ckpt:
                unet_cfg = configs.get("unet")
                config = unet_cfg if isinstance(unet_cfg, UNetConfig) else infer_config(ckpt, unet_cfg)
        except (UNetCheckpointError, ValueError, OSError) as e:
            problems.append(f"unet (--model): {found['unet'].shown}: {str(e).splitlines()[0]}")
    for part in ("clip_l", "clip_g"):
        if part in found and part not in configs:
            saved = _saved_text_configs(found[part].files).get(part)
            if saved is not None:
                configs[part] = saved
    if config is not None:
        problems += _fit(found, config)
    toks = {}
    for part in ("clip_l_tokenizer", "clip_g_tokenizer"):
        toks[part] = F.tokenizer_folder(tokenizer if tokenizer is not None else root, part, "bpe",
                                        tokenizer is not None, problems, subfolder=SUBFOLDERS[part])
    F.report(problems, "SDXL model", path, SDXLFilesError)
    where = {p: loc.path for p, loc in found.items()}
    return SDXLFiles(where["unet"], where["vae"], where["clip_l"], where["clip_g"], toks["clip_l_tokenizer"],
                     toks["clip_g_tokenizer"], config, {p: loc.prefix for p, loc in found.items() if p != "unet"},
                     configs)


def _saved_text_configs(files):
    from flame_core.io import safe_open
    for f in files:
        with safe_open(f) as h:
            raw = (h.metadata() or {}).get(TEXT_CONFIGS_METADATA_KEY)
        if raw is not None:
            try:
                return json.loads(raw)
            except ValueError:
                raise SDXLFilesError(f"{f}: unreadable {TEXT_CONFIGS_METADATA_KEY} metadata") from None
    return {}


def _fit(found, c):
    """Problems with parts that do not fit the UNet of config `c` (widths from the headers)."""
    problems = []
    facts = F.found_clip_facts(found)
    if len(facts) == 2 and all(facts.values()):
        lw, gw = facts["clip_l"]["width"], facts["clip_g"]["width"]
        if lw + gw != c.context_dim:
            problems.append(f"clip_l + clip_g: widths {lw} + {gw} != the UNet's context width {c.context_dim} "
                            f"({found['clip_l'].shown}, {found['clip_g'].shown})")
    g = facts.get("clip_g")
    if g and not g["projection"]:
        problems.append(f"clip_g (--clip-g): {found['clip_g'].shown} has no text projection: SDXL's pooled vector is "
                        f"CLIP-G's projected EOS state (is this CLIP-L, or a text encoder saved without it?)")
    elif g and g["pooled"] != c.pooled_dim:
        problems.append(f"clip_g (--clip-g): {found['clip_g'].shown} projects to {g['pooled']}, but the UNet's y "
                        f"takes a pooled vector of {c.pooled_dim}")
    return problems + F.vae_channel_problems(found, c.in_channels, "UNet", "a Flux / SD3 VAE has 16")
