"""Finding the parts of an SD3 / SD3.5 text-to-image model: the MMDiT, the VAE, CLIP-L, CLIP-G, T5-XXL (optional) and
their tokenizers.

    files = find_sd3_files("stable-diffusion-3.5-large/")                 # a diffusers folder
    files = find_sd3_files("sd3.5_large.safetensors")                     # an SAI file that holds every part
    files = find_sd3_files("sd3.5_medium.safetensors", clip_l="clip_l.safetensors", clip_g="clip_g.safetensors",
                           t5="t5xxl_fp16.safetensors", vae="sd3_vae.safetensors")   # ComfyUI's separate files

A part not named comes from the diffusers folder (transformer/, vae/, text_encoder/, text_encoder_2/,
text_encoder_3/, tokenizer/, tokenizer_2/, tokenizer_3/) or from inside the SAI file (`first_stage_model.`,
`text_encoders.clip_l.`, `text_encoders.clip_g.`, `text_encoders.t5xxl.`). Without T5 the prompt's T5 tokens are
zeros, as the references allow. Only headers are read: every part is checked to be what it should be and to fit
the MMDiT (CLIP widths L + G <= context width, pooled L + G = the pooled width, T5 width = the context width, VAE
latent channels = its input channels) before anything is loaded, and ONE error lists every problem.
"""
import os
from dataclasses import dataclass, field

from ..conditioning import files as F
from .loading import SD3CheckpointError, _Checkpoint, infer_params
from .params import SD3Params

SUBFOLDERS = {"transformer": "transformer", "vae": "vae", "clip_l": "text_encoder", "clip_g": "text_encoder_2",
              "t5": "text_encoder_3", "clip_l_tokenizer": "tokenizer", "clip_g_tokenizer": "tokenizer_2",
              "t5_tokenizer": "tokenizer_3"}
SPECS = {"transformer": F.PartSpec("sd3", "an SD3 / SD3.5 MMDiT", "--model", "transformer"),
         "vae": F.PartSpec("vae", "a VAE (autoencoder)", "--vae", "vae", ("first_stage_model.",)),
         "clip_l": F.PartSpec("clip", "a CLIP text encoder (CLIP-L)", "--clip-l", "text_encoder",
                              ("text_encoders.clip_l.",)),
         "clip_g": F.PartSpec("clip", "a CLIP text encoder (CLIP-G)", "--clip-g", "text_encoder_2",
                              ("text_encoders.clip_g.",)),
         "t5": F.PartSpec("t5", "a T5 text encoder (T5-XXL)", "--t5", "text_encoder_3", ("text_encoders.t5xxl.",),
                          optional=True)}
T5_MAX_LENGTH = 256  # diffusers' StableDiffusion3Pipeline default (max_sequence_length)


class SD3FilesError(F.ModelFilesError):
    """Parts of an SD3 model that are missing, unreadable, of the wrong kind or that do not fit together; the
    message has one line per problem, each naming the file."""


@dataclass
class SD3Files:
    """Where each part of an SD3 / SD3.5 model is: a safetensors file, an index JSON or a folder (the same file for
    several parts of an SAI checkpoint: `prefixes` says under which key prefix each one is). t5 None: no T5 (zeros).
    Tokenizers: folders, or None for the vocabularies packaged with FLAME. params: the MMDiT's SD3Params (from its
    headers). configs: {part: config} for parts whose config the weights do not tell (a non-released CLIP width, a
    VAE's group count): passed to the loaders."""
    transformer: str
    vae: str
    clip_l: str
    clip_g: str
    t5: str = None
    clip_l_tokenizer: str = None
    clip_g_tokenizer: str = None
    t5_tokenizer: str = None
    params: SD3Params = None
    prefixes: dict = field(default_factory=dict)
    configs: dict = field(default_factory=dict)

    @property
    def variant(self):
        """The release whose sampling defaults apply (sd3.sampling.SAMPLING_DEFAULTS): 'sd3.5-medium' for an MMDiT-X
        (dual-attention layers), 'sd3.5-large-turbo' when the model's file or folder name says turbo (its weights
        are shaped as Large's), else 'sd3.5-large'."""
        if self.params is not None and self.params.dual_attention_layers:
            return "sd3.5-medium"
        name = os.path.normpath(self.transformer)
        if os.path.basename(name) == "transformer":
            name = os.path.dirname(name)
        return "sd3.5-large-turbo" if "turbo" in os.path.basename(name).lower() else "sd3.5-large"


def read_sd3_params(path):
    """SD3Params of an MMDiT checkpoint (file, folder or index), from its headers (and config.json)."""
    with _Checkpoint(path) as ckpt:
        return infer_params(ckpt)


def find_sd3_files(path, *, clip_l=None, clip_g=None, t5=None, vae=None, tokenizer=None, configs=None):
    """SD3Files of an SD3 / SD3.5 model: `path` a diffusers folder, an SAI single file (the parts it holds are used)
    or an MMDiT file / folder; clip_l, clip_g, t5, vae name parts it lacks (or replace its own); `tokenizer` a folder
    holding tokenizer/ (CLIP-L), tokenizer_2/ (CLIP-G) and tokenizer_3/ (T5) -- default the model folder's, else the
    vocabularies packaged with FLAME. configs: {part: config or dict} for the loaders (see SD3Files). Reads headers
    only; raises SD3FilesError listing every problem."""
    path = os.fspath(path)
    given = {"transformer": path, "vae": vae, "clip_l": clip_l, "clip_g": clip_g, "t5": t5}
    root, found, problems = F.locate_parts(path, given, SPECS, main="transformer", error=SD3FilesError)
    params = None
    if "transformer" in found:
        try:
            params = read_sd3_params(found["transformer"].path)
        except (SD3CheckpointError, KeyError, ValueError, OSError) as e:
            problems.append(f"transformer (--model): {found['transformer'].shown}: {str(e).splitlines()[0]}")
    if params is not None:
        problems += _fit(found, params)
    toks = {"t5_tokenizer": None}
    for part, want in (("clip_l_tokenizer", "bpe"), ("clip_g_tokenizer", "bpe"), ("t5_tokenizer", "unigram")):
        if part == "t5_tokenizer" and "t5" not in found:
            continue  # no T5: its tokenizer is not needed
        toks[part] = F.tokenizer_folder(tokenizer if tokenizer is not None else root, part, want,
                                        tokenizer is not None, problems, subfolder=SUBFOLDERS[part])
    F.report(problems, "SD3 model", path, SD3FilesError)
    where = {p: loc.path for p, loc in found.items()}
    return SD3Files(where["transformer"], where["vae"], where["clip_l"], where["clip_g"], where.get("t5"),
                    toks["clip_l_tokenizer"], toks["clip_g_tokenizer"], toks["t5_tokenizer"], params,
                    {p: loc.prefix for p, loc in found.items() if p != "transformer"}, dict(configs or {}))


def _fit(found, p):
    """Problems with parts that do not fit the MMDiT of params `p` (widths from the headers)."""
    problems = []
    facts = F.found_clip_facts(found)
    if len(facts) == 2 and all(facts.values()):
        lw, gw = facts["clip_l"]["width"], facts["clip_g"]["width"]
        if lw + gw > p.context_in_dim:
            problems.append(f"clip_l + clip_g: widths {lw} + {gw} exceed the MMDiT's context width {p.context_in_dim} "
                            f"({found['clip_l'].shown}, {found['clip_g'].shown})")
        lp, gp = facts["clip_l"]["pooled"], facts["clip_g"]["pooled"]
        if lp + gp != p.pooled_in_dim:
            problems.append(f"clip_l + clip_g: pooled widths {lp} + {gp} != the MMDiT's pooled width "
                            f"{p.pooled_in_dim} ({found['clip_l'].shown}, {found['clip_g'].shown})")
    if "t5" in found:
        w = F.t5_facts(found["t5"].shapes, found["t5"].prefix).get("width")
        if w is not None and w != p.context_in_dim:
            problems.append(f"t5 (--t5): {found['t5'].shown} has width {w}, but the MMDiT expects {p.context_in_dim}")
    return problems + F.vae_channel_problems(found, p.in_channels, "MMDiT", "an SD / SDXL VAE has 4")
