"""LoRAs on the frozen base: ai-toolkit's `model.lora_path`, `model.assistant_lora_path`, `model.inference_lora_path`.

- `lora_path`: merged into the base weights as they are read (pipeline.merged_loras); training and previews see the
  base with it, and the LoRA the run writes is what it learned on top (ai-toolkit fuses it the same way).
- `assistant_lora_path`: merged for training likewise -- Flux schnell's training adapter
  (ostris/FLUX.1-schnell-training-adapter) undoes enough of the distillation for a LoRA to train on it --, and taken
  back out of every preview: previews run with the file's adapters beside the merged weights at weight -1, as
  ai-toolkit samples (its invert_assistant_lora), so they show the base with the trained LoRA alone, as it will be
  used. A LoRA, LoKr or LoHa change cancels (W + ΔW − ΔW, the merged weights' rounding aside); a DoRA's depends on
  W, so a DoRA assistant is refused.
- `inference_lora_path`: kept out of training, added to every preview at weight 1.

Each is a LoRA file of the denoiser (any layout FLAME reads: kohya, LyCORIS, PEFT / diffusers, ai-toolkit), or a
folder holding pytorch_lora_weights.safetensors (as ai-toolkit takes one), or a Hugging Face repo id found in the
local Hugging Face cache (checkpoint_io/hub_cache.py; config.py resolves it to its snapshot folder); a repo id the
cache lacks is an error saying how to fetch it. Files are someone else's: their size is checked against the host's
memory before they are read, every tensor must be finite, and every adapter must fit its layer. All of it before
anything is cached or loaded.

Text-encoder parts (kohya lora_te1_ / lora_te2_ / lora_te3_, diffusers text_encoder. / text_encoder_2. / ...):
`lora_path`'s are merged into the text encoders when they are loaded (family_base.load_text_encoders; kept as adapters
beside a T5 in fp8 storage), as ai-toolkit fuses the whole file, for the families whose generators take them (Flux,
Flux Kontext, SD3, SDXL: family.text_lora_parts), so the captions are encoded -- and, with
train.train_text_encoder, trained on -- through the changed encoders; the file is part of the text cache's key.
Checked against the encoders the run will load, built without storage (text_encoders.structure_only), before
anything is cached. Refused: a part for an encoder the model does not have or does not load (SD3 without T5), for a
T5 that streams from host memory under the budget, and in `assistant_lora_path` / `inference_lora_path` (the
previews' prompts are encoded once, by the encoders the run trains with, so neither could be taken back out of or
added to them).
"""
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from flame_core import dtypes
from flame_nn import adapters as A

from ..checkpoint_io import hub_cache
from ..pipeline.loras import check_lora_part, lora_keys
from ..pipeline.merged_loras import MergedLoRAs
from ..text_encoders import structure_only
from .config import ConfigError, dtype_name
from .family_parts import identity
from .limits import fmt_bytes, host_memory

SETTINGS = ("lora_path", "assistant_lora_path", "inference_lora_path")
FOLDER_FILE = "pytorch_lora_weights.safetensors"   # what ai-toolkit reads from a folder (diffusers' LoRA name)


def resolve(value, setting):
    """The file a `model.<setting>` value names: a file as it is, a folder's FOLDER_FILE; ConfigError otherwise
    (a repo id: which file to download)."""
    where = f"model.{setting} {value}"
    if os.path.isdir(value):
        path = os.path.join(value, FOLDER_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"{where}: a folder without {FOLDER_FILE}; give the LoRA file's path")
        return path
    if os.path.isfile(value):
        return value
    raise ConfigError(f"{where}: no such file or folder" + (
        f" ({hub_cache.fetch_hint(value)})" if hub_cache.looks_like_repo_id(value) else ""))


def file_problems(cfg, p=""):
    """The model.*lora_path values that name no file (config checks, before anything is read)."""
    e = []
    for s in SETTINGS:
        value = getattr(cfg.model, s)
        if value:
            try:
                resolve(value, s)
            except ConfigError as ex:
                e.append(f"{p}{ex}")
    return e


def text_loras(model_cfg):
    """[(path, 1.0)]: model.lora_path when its file holds text-encoder adapters (read() checked them), else []."""
    value = model_cfg.lora_path
    if not value:
        return []
    path = resolve(value, "lora_path")
    keys = lora_keys(path, ConfigError, label="model.lora_path")
    return [(path, 1.0)] if any(A.formats.component_of(k) != "denoiser" for k in keys) else []


def text_identity(model_cfg):
    """What the text cache's key adds for model.lora_path's text-encoder part: its file's path, size and
    modification time ("" without one)."""
    return "".join(f"|te-lora:{identity(path, 'lora', error=ConfigError)}" for path, _ in text_loras(model_cfg))


def text_description(model_cfg):
    """What describe_text_encoders adds for it (the log's line)."""
    return "".join(f", model.lora_path's text-encoder part {p} merged in" for p, _ in text_loras(model_cfg))


@dataclass
class BaseLoRAs:
    """The files read and checked: `merged` [(setting, path, modules)] go into the base weights; `previews`
    [(setting, weight, modules)] run beside them in previews only (modules: {module: [AdapterPart]})."""
    merged: list = field(default_factory=list)
    previews: list = field(default_factory=list)
    text: list = field(default_factory=list)     # lora_path's file when it has a text-encoder part

    def merger(self, device):
        """The MergedLoRAs of `merged` (computed on `device`), or None."""
        if not self.merged:
            return None
        label = " and ".join(f"model.{s} {p}" for s, p, _ in self.merged)
        return MergedLoRAs([(1.0, m) for _, _, m in self.merged], device, label=label, error=ConfigError)

    def describe(self):
        out = [f"model.{s}: {p} merged into the base weights" for s, p, _ in self.merged]
        out += [f"model.lora_path: {p}'s text-encoder part merged into the text encoders" for p in self.text]
        out += [f"model.{s}: in previews at weight {w:+g}" for s, w, _ in self.previews]
        return out

    @contextmanager
    def previewing(self, model, device):
        """`model` with the preview adapters attached (each its own adapter, frozen, at its weight, in the trained
        adapters' dtype, on `device`), and without them again after."""
        names = []
        trained = A.adapter_parameters(model)
        dtype = trained[0].dtype if trained else dtypes.float32
        try:
            for i, (_, weight, modules) in enumerate(self.previews):
                name = f"base_lora_{i}"
                A.inject_from_state(model, modules, name=name, dtype=dtype, freeze_base=False)
                names.append(name)
                for _, _, ad in A.adapter_modules(model, name):
                    ad.to(device)
                    ad.requires_grad_(False)
                A.set_adapter_weight(model, name, weight)
            yield model
        finally:
            for name in names:
                A.remove_adapters(model, name)


def read(cfg, family, spec, model=None, device="cpu", budget=None, captions=True):
    """The BaseLoRAs of cfg.model's LoRA settings, each file checked against the family's model of `spec` (built
    without storage; or `model`, a ready-made one) and, for lora_path's text-encoder part, against the encoders the
    run will load on `device` under `budget` (max_gpu_memory in bytes, or None), or None when none is set.
    captions: whether the run encodes its captions (image folders); without, a text-encoder part is refused (the
    samples' conditioning is precomputed). ConfigError for every problem."""
    given = [(s, getattr(cfg.model, s)) for s in SETTINGS if getattr(cfg.model, s)]
    if not given:
        return None
    if model is None:
        model = family.empty_model(spec, dtypes.dtype(dtype_name(cfg.model.dtype)), "cpu")
    name_map = family.lora_name_map(model)
    out = BaseLoRAs()
    host = host_memory()
    for setting, value in given:
        label = f"model.{setting}"
        path = resolve(value, setting)
        where = f"{label} {path}"
        size = os.path.getsize(path)
        if host is not None and size > host // 2:
            raise ConfigError(f"{where}: {fmt_bytes(size)}, more than half the host's {fmt_bytes(host)} of memory: "
                              f"not a LoRA of this model?")
        keys = lora_keys(path, ConfigError, label=label)
        te = [k for k in keys if A.formats.component_of(k) != "denoiser"]
        if te:
            _check_text_part(cfg, family, setting, path, te, device, budget, captions)
        modules = check_lora_part(path, model, name_map, "denoiser", ConfigError, label=label)
        if not modules and not te:
            raise ConfigError(f"{where}: holds no adapter for this {family.name} model (keys such as {keys[0]})")
        if setting == "assistant_lora_path":
            dora = next((m for m, parts in modules.items() if any(p.kind == "dora" for p in parts)), None)
            if dora is not None:
                raise ConfigError(f"{where}: a DoRA adapter (on {dora}); the assistant is taken back out of the "
                                  f"previews at weight -1, which cancels a LoRA, LoKr or LoHa change but not a "
                                  f"DoRA's (it depends on the weight it changes)")
        if te:
            out.text.append(path)
        if not modules:   # (a text-encoder-only lora_path)
            continue
        if setting != "inference_lora_path":
            out.merged.append((setting, path, modules))
        if setting != "lora_path":
            out.previews.append((setting, -1.0 if setting == "assistant_lora_path" else 1.0, modules))
    return out


def _check_text_part(cfg, family, setting, path, te_keys, device, budget, captions):
    """model.<setting>'s text-encoder adapters (te_keys) against the encoders the run loads, built without storage:
    ConfigError naming the file for each problem (module docstring)."""
    label = f"model.{setting}"
    where = f"{label} {path}"
    if setting != "lora_path":
        raise ConfigError(f"{where}: holds text-encoder adapters (keys such as {te_keys[0]}); the previews' prompts "
                          f"are encoded once, by the encoders the run trains with, so {label} applies to the "
                          f"{family.name} denoiser only (model.lora_path merges a text-encoder part into the "
                          f"encoders): give a file without them")
    if not captions:
        raise ConfigError(f"{where}: holds text-encoder adapters (keys such as {te_keys[0]}), but this run trains on "
                          f"precomputed samples, whose text conditioning was encoded without them: train from image "
                          f"folders, or give a file without them")
    if not family.takes_text_loras:   # (before any encoder is built)
        raise ConfigError(f"{where}: holds text-encoder adapters (keys such as {te_keys[0]}); the {family.name} "
                          f"family applies LoRAs to its denoiser only: give a file without them")
    with structure_only():
        encoders = family.load_text_encoders(cfg.model, "cpu")
    parts = family.text_lora_parts(encoders)
    have = {}
    for comps, encoder in parts:
        for c in (comps,) if isinstance(comps, str) else comps:
            have[c] = encoder
    streamed = set(family.streamed_text_components(cfg.model, device, budget))
    comps = sorted({A.formats.component_of(k) for k in te_keys})
    for comp in comps:   # which encoders, then (below) their layers
        key = next(k for k in te_keys if A.formats.component_of(k) == comp)
        if comp not in have:
            raise ConfigError(f"{where}: holds adapters for a text encoder this {family.name} model does not have "
                              f"({comp}: keys such as {key})")
        encoder = have[comp]
        if encoder is None:
            raise ConfigError(f"{where}: holds adapters for a text encoder this run does not load ({comp}: keys "
                              f"such as {key}; model.use_t5 is false or the model has no T5), so they would be "
                              f"dropped: give a file without them")
        if comp in streamed:
            raise ConfigError(f"{where}: holds {type(encoder).__name__} adapters ({comp}: keys such as {key}), which "
                              f"cannot be applied while that encoder streams from host memory under max_gpu_memory; "
                              f"raise the budget, or give a file without them")
    for comp in comps:
        check_lora_part(path, have[comp], A.formats.IDENTITY, comp, ConfigError, label=label)
