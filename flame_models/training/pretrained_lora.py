"""Training on from an existing LoRA file: ai-toolkit's `network.pretrained_lora_path`, kohya's `--network_weights`
with `--dim_from_weights` (the command line's `--network-weights`).

The run's adapters start as the file's: the same layers (and row ranges of fused ones), kind, rank and scale per
layer, and values -- so its first step's model is the base with that LoRA applied, and the file it writes is that LoRA
trained on. A kohya, LyCORIS (LoCon, LoHa, LoKr, DoRA), PEFT / diffusers or FLAME file of the family's denoiser reads
(flame_nn.adapters.formats.load, the loader the generators use), with a resized file's per-layer ranks.

    pre = read(cfg, family, spec)          # before anything is cached or loaded: None without the setting
    ...                                    # (network.add_network puts pre.denoiser on the model)

What the config may say beside it (read settles the network's settings, so config.json tells what ran):
- `network.type`, `network.linear`, `network.linear_alpha`, `network.conv` (LoCon) left out: the file's kind, its
  most common rank, alpha and convolution rank; given, they must agree with every adapter of the file (a scale
  differing at any layer is an error naming it) -- these are the file's settings, not a resize (for that:
  `python -m flame_nn.adapters.resize`).
- `network.target` left out: the file's layers exactly. Given: every layer it selects trains, the file's from their
  values, the others from a fresh start (B = 0: the model's function is still the file's); a file layer outside the
  targets is an error naming it. `network.conv` given likewise adds fresh adapters on the convolutions the file
  lacks (LoCon). `network.network_kwargs` filters need `network.target`.
- `network.dropout` and `network.rslora` apply to the adapters made (rsLoRA: the alpha that keeps each layer's scale).
- Text-encoder adapters in the file (kohya lora_te1_ / lora_te2_, diffusers text_encoder. / text_encoder_2.) go on
  with `train.train_text_encoder` (SDXL): TrainedTextEncoders starts those layers from them. Without it they are
  refused: the captions' embeddings are cached from the encoders as they are, so the file's text-encoder part would
  be dropped from what the run learns and writes.
- A full fine-tune (network.type full) takes no LoRA file (validation.py says: bake it in first).

The file is someone else's: its size is checked against the host's memory before it is read, every tensor must be
finite (formats.check_part), and each adapter must fit its layer (names, shapes, kinds); each problem is a ConfigError
naming the file and the layer before any image is encoded or any weight loaded. A resumed run takes its adapters'
values from its checkpoint; the file still shapes them.
"""
import math
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np

from flame_nn import adapters as A

from ..pipeline.loras import check_lora_part, lora_keys
from .config import ConfigError, dtype_name
from .limits import fmt_bytes, host_memory

SETTING = "network.pretrained_lora_path"


@dataclass
class PretrainedLoRA:
    """A LoRA file read for training on: the denoiser's canonical adapters ({module: [AdapterPart]}), the text
    encoders' components the file holds (checked and loaded when the encoders are: TrainedTextEncoders)."""
    path: str
    denoiser: dict
    text_components: tuple = ()
    fresh_linear: bool = False   # network.target given: its layers the file lacks get fresh adapters
    fresh_conv: bool = False     # network.conv given: likewise the convolutions (LoCon)

    def text_part(self, encoder, component):
        """The file's canonical adapters for text encoder `component` ('te1' / 'te2'), checked against `encoder`
        (its layers' names and shapes); {} when the file has none for it."""
        if component not in self.text_components:
            return {}
        return check_lora_part(self.path, encoder, A.formats.IDENTITY, component, ConfigError, label=SETTING)


def _kind(kind):
    return "lora" if kind == "locon" else kind


def _scale(kind, rank, alpha, rslora):
    """The scale a configured adapter of `kind` applies (LoKr with a full w2 and LoHa's scale alpha / rank)."""
    if rank is None:
        return 1.0
    return alpha / (math.sqrt(rank) if rslora and kind in ("lora", "dora") else rank)


def _agree(parts, setting, given, value, scale_of=None):
    """An error naming the first part of `parts` ([(module, AdapterPart)]) whose rank (with scale_of: scale)
    differs from the configured one, or None when the setting was not given."""
    if not given:
        return None
    for mod, p in parts:
        r = p.rank
        if r is None:
            continue
        if scale_of is None and r != value:
            return (f"{setting} {value}: the file's adapter on {mod} has rank {r} (leave {setting} out to train "
                    f"at the file's ranks; python -m flame_nn.adapters.resize changes a file's rank)")
        if scale_of is not None and not math.isclose(scale_of(p), p.scale, rel_tol=1e-5):
            return (f"{setting} {value:g}: gives the adapter on {mod} the scale {scale_of(p):.6g}, the file's is "
                    f"{p.scale:.6g} (alpha {p.alpha if p.alpha is not None else r} at rank {r}); leave {setting} "
                    f"out to keep the file's")
    return None


def _most_common(values):
    return Counter(values).most_common(1)[0][0] if values else None


def read(cfg, family, spec, model=None):
    """The PretrainedLoRA of cfg.network.pretrained_lora_path, checked against the family's model of `spec` (built
    without storage; or `model`, a ready-made one) and the config, or None when the setting is absent. Settles the
    network settings the config left out from the file (module docstring). ConfigError for every problem."""
    n, t = cfg.network, cfg.train
    path = n.pretrained_lora_path
    if path is None:
        return None
    where = f"{SETTING} {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    size, host = os.path.getsize(path), host_memory()
    if host is not None and size > host // 2:
        raise ConfigError(f"{where}: {fmt_bytes(size)}, more than half the host's {fmt_bytes(host)} of memory: not "
                          f"a LoRA of this model?")
    keys = lora_keys(path, ConfigError, label=SETTING)
    components = sorted({A.formats.component_of(k) for k in keys} - {"denoiser"})
    if components and not t.train_text_encoder:
        te = next(k for k in keys if A.formats.component_of(k) != "denoiser")
        raise ConfigError(f"{where}: holds text-encoder adapters (keys such as {te}); the run caches the captions' "
                          f"embeddings from the encoders as they are, so that part would be lost: "
                          + ("set train.train_text_encoder: true to train it on" if family.text_encoder_targets
                             is not None else f"the {family.name} family trains its denoiser's adapters only")
                          + ", or start from a file without it")
    if model is None:
        from flame_core import dtypes
        model = family.empty_model(spec, dtypes.dtype(dtype_name(cfg.model.dtype)), "cpu")
    name_map = family.lora_name_map(model)
    modules = unjoin_rows(check_lora_part(path, model, name_map, "denoiser", ConfigError, label=SETTING), name_map)
    if not modules and not components:
        raise ConfigError(f"{where}: holds no adapter for this {family.name} model (keys such as {keys[0]})")
    _settle(cfg, family, model, name_map, modules, where)
    return PretrainedLoRA(path, modules, tuple(components), fresh_linear="network.target" in cfg.given,
                          fresh_conv="network.conv" in cfg.given and bool(n.conv))


def unjoin_rows(modules, name_map):
    """`modules` with each whole-module LoRA whose up matrix is block diagonal over the rows of the diffusers
    Linears carved out of that module (name_map: Flux's qkv -> to_q / to_k / to_v) split back into one adapter per
    row range: how a kohya file holds separate to_q / to_k / to_v adapters (formats.join_block_diagonal), so a run
    that trained those continues them at their own rank, not as one adapter of their summed rank on the fused
    Linear. A dense up (kohya's own fused-qkv LoRA), an all-zero column (its block is not known) or a DoRA stays
    whole."""
    out = {}
    for mod, parts in modules.items():
        out[mod] = parts
        subs = [ranges for _, ranges in name_map.targets.get(mod, ())]
        if len(parts) != 1 or parts[0].rows is not None or parts[0].kind != "lora" or len(subs) < 2 \
                or any(len(r) != 1 for r in subs):
            continue
        up = np.asarray(parts[0].tensors["lora_up.weight"])
        if up.ndim != 2:
            continue
        subs = sorted(tuple(r[0]) for r in subs)
        owners = []
        for c in range(up.shape[1]):
            rows = np.flatnonzero(up[:, c])
            owner = next((k for k, (lo, hi) in enumerate(subs) if len(rows) and lo <= rows[0] and rows[-1] < hi),
                         None)
            if owner is None:
                break
            owners.append(owner)
        else:
            runs = [k for i, k in enumerate(owners) if i == 0 or owners[i - 1] != k]
            if len(runs) == len(set(runs)):
                out[mod] = A.formats.split_block_diagonal(parts[0], [subs[k] for k in runs],
                                                          [owners.count(k) for k in runs], mod)
    return out


def _split(model, modules, family, name_map):
    """([(module, part)] at the linear rank, [(module, part)] at the convolutions' rank): as add_network makes them,
    the family's conv_targets but those that come with the linear rank (conv_linear_targets) are the latter."""
    conv_rank = set()
    if family.conv_targets:
        conv_rank = ({m for m, _, _ in A.find_targets(model, family.conv_targets, name_map)}
                     - {m for m, _, _ in A.find_targets(model, list(family.conv_linear_targets), name_map)})
    linear, conv = [], []
    for mod, parts in modules.items():
        (conv if mod in conv_rank else linear).extend((mod, p) for p in parts)
    return linear, conv


def _settle(cfg, family, model, name_map, modules, where):
    """The network settings from the file where the config left them out; errors where they disagree."""
    n, given = cfg.network, cfg.given
    linear, conv = _split(model, modules, family, name_map)
    kinds = sorted({p.kind for _, p in linear + conv})
    if len(kinds) > 1:
        raise ConfigError(f"{where}: holds adapters of several kinds ({', '.join(kinds)}); a run trains one kind")
    kind = kinds[0] if kinds else _kind(n.type)
    if "network.type" in given and _kind(n.type) != kind:
        raise ConfigError(f"{SETTING}: network.type {n.type} but the file holds {kind} adapters (leave network.type "
                          f"out to train the file's kind)")
    if "network.type" not in given:
        n.type = kind
    problems = [
        _agree(linear, "network.linear", "network.linear" in given, n.linear),
        _agree(linear, "network.linear_alpha", "network.linear_alpha" in given, n.linear_alpha,
               lambda p: _scale(kind, p.rank, n.linear_alpha, n.rslora)),
        _agree(conv, "network.conv", "network.conv" in given and n.conv, n.conv),
        _agree(conv, "network.conv_alpha", "network.conv_alpha" in given, n.conv_alpha,
               lambda p: _scale(kind, p.rank, n.conv_alpha, n.rslora)),
    ]
    problems = [f"{SETTING}: {p}" for p in problems if p]
    if "network.conv" in given and not n.conv and conv:
        problems.append(f"{SETTING}: network.conv {n.conv} asks for no convolution adapters, but the file has "
                        f"{len(conv)} (on {conv[0][0]}, ...)")
    if problems:
        raise ConfigError("; ".join(problems))
    # the file's most common rank and alpha (kohya's: alpha = scale x rank) for what the config left out: the
    # fresh layers' settings, and what config.json records
    r = _most_common([p.rank for _, p in linear if p.rank is not None])
    if r is not None and "network.linear" not in given:
        n.linear = r
        if "network.linear_alpha" not in given:
            s = _most_common([p.scale for _, p in linear if p.rank == r])
            n.linear_alpha = s * (math.sqrt(r) if n.rslora and kind in ("lora", "dora") else r)
    rc = _most_common([p.rank for _, p in conv])
    if rc is not None and "network.conv" not in given:
        n.conv = rc
        if "network.conv_alpha" not in given:
            n.conv_alpha = _most_common([p.scale for _, p in conv if p.rank == rc]) * (
                math.sqrt(rc) if n.rslora else rc)
    if n.network_kwargs and "network.target" not in given:
        raise ConfigError(f"{SETTING}: network.network_kwargs filters pick among network.target's layers; the "
                          f"layers here are the file's -- give network.target too, or leave the filters out")
    if "network.target" in given:
        targets = family.target_presets.get(n.target, n.target) if isinstance(n.target, str) else n.target
        targets = [targets] if isinstance(targets, str) else list(targets)
        if n.conv:
            targets += list(family.conv_linear_targets) + list(family.conv_targets)
        chosen = {m for m, _, _ in A.find_targets(
            model, targets, name_map, only_if_contains=n.network_kwargs.get("only_if_contains"),
            ignore_if_contains=n.network_kwargs.get("ignore_if_contains"))}
        outside = [m for m in modules if m not in chosen]
        if outside:
            raise ConfigError(f"{SETTING}: {len(outside)} of the file's adapted layers are outside network.target "
                              f"{n.target!r} (e.g. {outside[:4]}); widen the targets or leave network.target out "
                              f"to train the file's layers")
