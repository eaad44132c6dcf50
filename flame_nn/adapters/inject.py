"""Putting adapters into a model, and the model-level operations on them.

    targets = ["to_q", "to_k", "to_v", "to_out.0"]             # name patterns (see `matches`)
    inject_adapters(model, targets, kind="lora", rank=16, alpha=16)  # Flux: diffusers names, its own map
    opt = AdamW(adapter_parameters(model), lr=1e-4)
    save_adapters(model, "lora.safetensors", format="kohya")  # or "peft" (diffusers)
    load_adapters(model, "style.safetensors", name="style", weight=0.8)   # a second adapter, for inference
    set_adapters(model, ["default", "style"], [1.0, 0.8]); merge_adapters(model); unmerge_adapters(model)

A pattern names a Linear or a Conv2d of the model (a Conv2d takes LoRA only: locon.py) or, through `name_map`, one
of the diffusers Linears carved out of a fused one (Flux's qkv -> to_q/to_k/to_v): the adapter then covers only those
output rows. Patterns: "re:<regex>" (full match), globs with * ? [ ] (fnmatch), or a plain name matching the whole name
or its dotted suffix ("to_q" matches "transformer_blocks.3.attn.to_q"), as PEFT's target_modules.

A model whose Linears have other names than the PEFT/diffusers files' (Flux: BFL names in the model, diffusers names
in the files) returns its NameMap from an `adapter_name_map()` method; every function here uses it when no
`name_map` is passed.
"""
import fnmatch
import re

import flame_core as flame
from flame_core import dtypes as D

from ..layers.conv import Conv2d
from ..layers.linear import Linear
from . import formats as fmt
from .dora import DoRA, row_norms
from .layer import AdaptedMixin, AdapterError, adapt, base_rows, unadapt
from .locon import LoRAConv2d
from .loha import LoHa
from .lokr import LoKr
from .lora import LoRA

KINDS = {"lora": LoRA, "locon": LoRA, "dora": DoRA, "lokr": LoKr, "loha": LoHa}


def matches(pattern, name):
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if any(ch in pattern for ch in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def model_name_map(model, name_map=None):
    """`name_map` if given, else the model's own (`model.adapter_name_map()`), else names map to themselves."""
    if name_map is not None:
        return name_map
    own = getattr(model, "adapter_name_map", None)
    return own() if callable(own) else fmt.IDENTITY


def _linears(model):
    """[(name, layer)] of every layer adapters can wrap: Linears and Conv2ds (adapted or not)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear, Conv2d, AdaptedMixin))]


def find_targets(model, targets, name_map=None, only_if_contains=None, ignore_if_contains=None):
    """[(module name, module, rows or None)] that `targets` select. Whole-Linear matches win over row matches."""
    name_map = model_name_map(model, name_map)
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)

    def keep(*names):
        if only_if_contains and not any(s in n for s in only_if_contains for n in names):
            return False
        return not (ignore_if_contains and any(s in n for s in ignore_if_contains for n in names))

    found = []
    for name, mod in _linears(model):
        if any(matches(p, name) for p in targets):
            if keep(name):
                found.append((name, mod, None))
            continue
        for peft_name, ranges in name_map.peft_targets(name):
            if peft_name == name or ranges is None or len(ranges) != 1:
                continue
            if any(matches(p, peft_name) for p in targets) and keep(name, peft_name):
                rows = tuple(ranges[0])
                found.append((name, mod, None if rows == (0, mod.weight.shape[0]) else rows))
    return found


def _no_dropouts(kind, dropout, drops):
    if dropout:
        raise AdapterError(f"{kind} has no input dropout (LyCORIS's does not either); use dropout 0")
    if any(drops.values()):
        raise AdapterError(f"{kind}: rank_dropout / module_dropout are LoRA's, DoRA's and LoCon's (kohya's); use 0")


def _make(kind, mod, rows, rank, alpha, dropout, rslora, lokr_factor, lokr_full_rank, dtype, init_weights,
          generator, drops):
    if isinstance(mod, Conv2d):   # (inject_adapters checked the kind)
        return LoRAConv2d.for_conv(mod, rank, alpha, dropout, rslora, init_weights=init_weights, dtype=dtype,
                                   generator=generator, **drops)
    lo, hi = rows if rows is not None else (0, mod.weight.shape[0])
    n_in, dev = mod.weight.shape[1], mod.weight.device
    cls = KINDS[kind]
    if cls in (LoKr, LoHa):
        if rows is not None:
            raise AdapterError(f"{kind} cannot adapt rows [{lo}:{hi}] of a fused Linear (its ΔW is not separable by "
                               f"rows in the file formats); target the whole Linear instead")
        _no_dropouts(kind, dropout, drops)
        if cls is LoKr:
            return LoKr(n_in, hi - lo, rank, alpha, lokr_factor, lokr_full_rank, device=dev, dtype=dtype,
                        generator=generator)
        return LoHa(n_in, hi - lo, rank, alpha, device=dev, dtype=dtype, generator=generator)
    if cls is DoRA:
        return DoRA(n_in, hi - lo, rank, alpha, dropout, rslora, base_weight=base_rows(mod, lo, hi),
                    init_weights=init_weights, device=dev, dtype=dtype, generator=generator, **drops)
    return LoRA(n_in, hi - lo, rank, alpha, dropout, rslora, init_weights=init_weights, device=dev, dtype=dtype,
                generator=generator, **drops)


def inject_adapters(model, targets, kind="lora", *, name="default", rank=16, alpha=None, dropout=0.0, rslora=False,
                    lokr_factor=-1, lokr_full_rank=False, name_map=None, only_if_contains=None,
                    ignore_if_contains=None, dtype=flame.float32, init_weights="kaiming", generator=None,
                    freeze_base=True, skip_adapted=False, rank_dropout=0.0, module_dropout=0.0):
    """Attach a new adapter `name` of `kind` to every Linear (or row range) or Conv2d `targets` select ("locon" is
    "lora": a Conv2d gets a LoRAConv2d; dora / lokr / loha on a Conv2d is an AdapterError naming it). The base is frozen
    (requires_grad False) unless freeze_base=False. skip_adapted: layers that already have an adapter `name` are
    left as they are (else an error). rank_dropout / module_dropout: kohya's training dropouts of LoRA / DoRA /
    LoCon (lora.py). Returns [(module name, rows)] in model order."""
    if kind not in KINDS:
        raise AdapterError(f"unknown adapter kind {kind!r}; known: {', '.join(KINDS)}")
    found = find_targets(model, targets, name_map, only_if_contains, ignore_if_contains)
    if not found:
        names = [n for n, _ in _linears(model)]
        raise AdapterError(f"no Linear or Conv2d matches the targets {targets!r}"
                           + (f" (filters only_if_contains={only_if_contains}, ignore_if_contains="
                              f"{ignore_if_contains})" if only_if_contains or ignore_if_contains else "")
                           + f"; the model's Linears and Conv2ds include {names[:6]}")
    if skip_adapted:
        found = [f for f in found if not has_adapter(f[1], name)]
    for mod in {id(m): m for _, m, _ in found}.values():
        if has_adapter(mod, name):
            raise AdapterError(f"an adapter named {name!r} already exists; pick another name or remove it")
    kind = "lora" if kind == "locon" else kind
    for mod_name, mod, rows in found:     # every problem before anything changes
        if isinstance(mod, Conv2d):
            if kind != "lora":
                raise AdapterError(f"{mod_name}: a {kind} adapter cannot adapt a Conv2d ({mod!r}); convolutions "
                                   f"take LoRA (locon) adapters only: leave the convolutions out of the targets or "
                                   f"use lora")
            from .conv_layer import check_conv
            try:
                check_conv(mod)
            except AdapterError as e:
                raise AdapterError(f"{mod_name}: {e}") from None
    if freeze_base:
        model.requires_grad_(False)
    made = []
    for mod_name, mod, rows in found:
        adapt(mod)
        ad = _make(kind, mod, rows, rank, alpha, dropout, rslora, lokr_factor, lokr_full_rank, dtype, init_weights,
                   generator, dict(rank_dropout=rank_dropout, module_dropout=module_dropout))
        mod.add_adapter(name, ad, rows)
        made.append((mod_name, rows))
    return made


# ----------------------------------------------------------------------------- queries
def has_adapter(module, name="default"):
    """Whether the Linear / Conv2d `module` carries an adapter `name`."""
    return isinstance(module, AdaptedMixin) and name in module._adapters


def adapted_modules(model):
    """[(name, adapted Linear or Conv2d)] in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AdaptedMixin)]


def adapter_names(model):
    names = []
    for _, m in adapted_modules(model):
        for k in m._adapters:
            if k not in names:
                names.append(k)
    return names


def _entries(model, name):
    out = []
    for mod_name, m in adapted_modules(model):
        for rows, ad in m._adapters.get(name, []):
            out.append((mod_name, m, rows, ad))
    if not out:
        raise AdapterError(f"the model has no adapter named {name!r}; it has {adapter_names(model)}")
    return out


def adapter_modules(model, name="default"):
    """[(module name, rows, Adapter)] of adapter `name`, in model order."""
    return [(n, rows, ad) for n, _, rows, ad in _entries(model, name)]


def adapter_parameters(model, name="default"):
    """The trainable parameters of adapter `name`, in a fixed order (model order, then rows, then the adapter's)."""
    return [p for _, _, _, ad in _entries(model, name) for p in ad.parameters()]


def named_adapter_parameters(model, name="default"):
    out = []
    for mod_name, m, (lo, hi), ad in _entries(model, name):
        full = (lo, hi) == (0, m.weight.shape[0])
        prefix = mod_name + ("" if full else f"[{lo}:{hi}]")
        out += [(f"{prefix}.{k}", p) for k, p in ad.named_parameters()]
    return out


# ----------------------------------------------------------------------------- canonical state and files
def adapter_state(model, name="default"):
    """Canonical form {module: [AdapterPart]} of adapter `name` (host copies)."""
    state = {}
    for mod_name, m, (lo, hi), ad in _entries(model, name):
        rows = None if (lo, hi) == (0, m.weight.shape[0]) else (lo, hi)
        state.setdefault(mod_name, []).append(ad.to_part(rows))
    return state


def load_adapter_state(model, modules, name="default"):
    """Load canonical adapters into the existing adapter `name` (same modules; row splits are joined or split as
    needed). Missing or unexpected modules are errors that name them."""
    have = {}
    for mod_name, m, rows, ad in _entries(model, name):
        have.setdefault(mod_name, (m, []))[1].append((rows, ad))
    missing = [k for k in have if k not in modules]
    unexpected = [k for k in modules if k not in have]
    if missing or unexpected:
        raise fmt.AdapterFormatError(
            f"adapter {name!r}: " + (f"{len(missing)} module(s) missing from the file: {missing[:6]}; " if missing
                                     else "") + (f"{len(unexpected)} unexpected module(s) in the file: "
                                                 f"{unexpected[:6]}" if unexpected else ""))
    for mod_name, (m, entries) in have.items():
        out = m.weight.shape[0]
        dest = [(None if r == (0, out) else r, getattr(ad, "rank", None) or 0) for r, ad in entries]
        parts = fmt.fit_parts(modules[mod_name], dest, mod_name, out)
        for (r, ad), part in zip(entries, parts):
            try:
                ad.load_part(part)
            except fmt.AdapterFormatError as e:
                raise fmt.AdapterFormatError(f"{mod_name} rows {r}: {e}") from None


def save_adapters(model, path, format="kohya", *, name="default", name_map=None, dtype=None,
                  metadata=None, text_encoders=None):
    """Write adapter `name` to `path` (.safetensors, atomic) in kohya or PEFT layout, with metadata describing it.
    PEFT files name the diffusers Linears: for a model that declares its name map (`adapter_name_map`), every adapted
    module must have a name in the map used (else the file would carry names diffusers does not know).
    text_encoders: {'te1' | 'te2': a text encoder with adapter `name`} written into the same file (kohya
    lora_te1_ / lora_te2_, diffusers text_encoder. / text_encoder_2.: formats.save's components)."""
    components = {}
    for comp, te in (text_encoders or {}).items():
        components[comp] = adapter_state(te, name)
        if any(p.rows is not None for parts in components[comp].values() for p in parts):
            raise fmt.AdapterFormatError(f"{comp}: adapters on row ranges of a text encoder's Linears cannot be "
                                         f"written")
    state = adapter_state(model, name)
    if format == "peft":
        _check_peft_names(model, name_map, state)
    name_map = model_name_map(model, name_map)
    out_features = {k: model.get_submodule(k).weight.shape[0] for k in state}
    norms = None
    if any(p.kind == "dora" and p.rows is not None for parts in state.values() for p in parts):
        norms = {k: row_norms(model.get_submodule(k).weight.detach()).numpy() for k in state}
    kind, rank, alpha = fmt.describe(state)
    meta = {"flame.network_type": kind, "flame.rank": rank, "flame.alpha": alpha,
            "ss_network_module": "networks.lora_flux" if kind == "lora" else "lycoris.kohya",
            "ss_network_dim": rank, "ss_network_alpha": alpha}
    if kind != "lora":
        meta["ss_network_args"] = '{"algo": "%s"%s}' % ("lora" if kind == "dora" else kind,
                                                        ', "dora_wd": true' if kind == "dora" else "")
    meta.update(metadata or {})
    meta = {k: str(v) for k, v in meta.items() if v is not None}
    np_dtype = None if dtype is None else D.dtype(dtype).np
    return fmt.save(path, state, format, name_map=name_map, out_features=out_features, row_norms=norms,
                    dtype=np_dtype, metadata=meta, components=components)


def _check_peft_names(model, name_map, state):
    if getattr(model, "adapter_name_map", None) is None:
        return  # the model's Linears have the files' names (those a NameMap does not list map to themselves)
    unmapped = [k for k in state if k not in model_name_map(model, name_map).targets]
    if unmapped:
        raise fmt.AdapterFormatError(
            f"format='peft' writes diffusers names, but the name map has none for {len(unmapped)} adapted "
            f"module(s): {unmapped[:6]}{' ...' if len(unmapped) > 6 else ''}"
            + ("" if name_map is None else " (leave name_map unset to use the model's own map)")
            + "; format='kohya' keeps the model's names")


def load_adapters(model, path, *, name="default", weight=1.0, name_map=None, dtype=flame.float32,
                  component="denoiser"):
    """Load a LoRA file into adapter `name`: into the existing one if the model has it, else a new adapter shaped
    by the file (kind, rank and rows from its tensors) is injected first. Returns the file's metadata.
    component: which part of the file (formats.load): 'denoiser', or a text encoder's 'te1' / 'te2' / 'te3' when
    `model` is that encoder."""
    module_names = [n for n, _ in _linears(model)]
    modules, meta = fmt.load(path, module_names, name_map=model_name_map(model, name_map), component=component)
    if name not in adapter_names(model):
        inject_from_state(model, modules, name=name, dtype=dtype, freeze_base=False)
    else:
        load_adapter_state(model, modules, name)
    set_adapter_weight(model, name, weight)
    return meta


def inject_from_state(model, modules, *, name="default", dropout=0.0, rslora=False, dtype=flame.float32,
                      freeze_base=True, rank_dropout=0.0, module_dropout=0.0):
    """Attach a new adapter `name` shaped by canonical adapters `modules` ({module name: [AdapterPart]}, as
    formats.load returns them: each part's kind, rank, rows and factors) and holding their values, scales kept
    (rslora: the alpha that gives the part's scale under alpha/sqrt(rank)); dropout / rslora / rank_dropout /
    module_dropout apply to the LoRA and DoRA adapters made (PEFT's is_trainable load, kohya's --network_weights).
    The base is frozen unless freeze_base=False. Every module is checked before anything changes. Returns [(module
    name, rows)]."""
    if name in adapter_names(model):
        raise AdapterError(f"an adapter named {name!r} already exists; pick another name or remove it")
    names = {n for n, _ in _linears(model)}
    unknown = [k for k in modules if k not in names]
    if unknown:
        raise fmt.AdapterFormatError(f"{len(unknown)} module(s) are not Linears or Conv2ds of the model: "
                                     f"{unknown[:6]}")
    made = []
    for mod_name, parts in modules.items():  # (the adapters are built before any is attached)
        mod = model.get_submodule(mod_name)
        for part in parts:
            try:
                ad = _from_part(mod, part, dtype, dropout, rslora,
                                dict(rank_dropout=rank_dropout, module_dropout=module_dropout))
                ad.load_part(part)
            except (AdapterError, fmt.AdapterFormatError) as e:
                raise type(e)(f"{mod_name}{'' if part.rows is None else f' rows {part.rows}'}: {e}") from None
            made.append((mod_name, mod, part.rows, ad))
    if freeze_base:
        model.requires_grad_(False)
    for mod_name, mod, rows, ad in made:
        adapt(mod).add_adapter(name, ad, rows)
    return [(mod_name, rows) for mod_name, _, rows, _ in made]


def _from_part(mod, part, dtype, dropout=0.0, rslora=False, drops=None):
    drops = drops or {}
    if isinstance(mod, Conv2d):
        if part.kind != "lora":
            raise fmt.AdapterFormatError(f"the file has a {part.kind} adapter on the Conv2d {mod!r}; convolutions "
                                         f"take LoRA adapters only")
        return LoRAConv2d.for_conv(mod, part.rank, dropout=dropout, rslora=rslora, dtype=dtype, **drops)
    lo, hi = part.rows if part.rows is not None else (0, mod.weight.shape[0])
    n_in, dev = mod.weight.shape[1], mod.weight.device
    if part.kind in ("lora", "dora"):
        if part.kind == "dora":
            return DoRA(n_in, hi - lo, part.rank, dropout=dropout, rslora=rslora, base_weight=base_rows(mod, lo, hi),
                        device=dev, dtype=dtype, **drops)
        return LoRA(n_in, hi - lo, part.rank, dropout=dropout, rslora=rslora, device=dev, dtype=dtype, **drops)
    _no_dropouts(part.kind, dropout, drops)
    if part.kind == "loha":
        return LoHa(n_in, hi - lo, part.rank, device=dev, dtype=dtype)
    w1 = part.tensors["lokr_w1"]
    full = "lokr_w2" in part.tensors
    w2_shape = part.tensors["lokr_w2"].shape if full else (part.tensors["lokr_w2_a"].shape[0],
                                                            part.tensors["lokr_w2_b"].shape[1])
    factors = (w1.shape[0], w2_shape[0], w1.shape[1], w2_shape[1])  # the file's split, whatever factor made it
    return LoKr(n_in, hi - lo, part.rank or max(w2_shape), full_rank=full, factors=factors, device=dev, dtype=dtype)


# ----------------------------------------------------------------------------- switching, weighting, merging
def set_adapter_weight(model, name, weight):
    for _, m in adapted_modules(model):
        if name in m._adapters:
            m._weights[name] = float(weight)


def set_adapters(model, names, weights=None):
    """Activate exactly `names` (others stay attached but inactive), each with its weight (default 1)."""
    names = [names] if isinstance(names, str) else list(names)
    weights = [1.0] * len(names) if weights is None else ([weights] if isinstance(weights, (int, float))
                                                          else list(weights))
    if len(weights) != len(names):
        raise AdapterError(f"{len(names)} adapter names but {len(weights)} weights")
    unknown = [n for n in names if n not in adapter_names(model)]
    if unknown:
        raise AdapterError(f"unknown adapter(s) {unknown}; the model has {adapter_names(model)}")
    for _, m in adapted_modules(model):
        if any(n in m._merged for n in m._adapters if n not in names):
            raise AdapterError("unmerge adapters before deactivating a merged one")
        m._weights.clear()
        m._weights.update({n: float(w) for n, w in zip(names, weights) if n in m._adapters})


def enable_adapters(model):
    for _, m in adapted_modules(model):
        m.adapters_enabled = True


def disable_adapters(model):
    """The base model's output (merged adapters must be unmerged first)."""
    for _, m in adapted_modules(model):
        if m._merged:
            raise AdapterError(f"adapters {list(m._merged)} are merged into the weights; unmerge them first")
        m.adapters_enabled = False


def merge_adapters(model, names=None):
    """Fold the active adapters (or `names`) into the base weights, each times its weight."""
    for _, m in adapted_modules(model):
        for n in (list(m._weights) if names is None else names):
            if n in m._adapters:
                m.merge(n)


def unmerge_adapters(model, names=None):
    for _, m in adapted_modules(model):
        if names is None:
            m.unmerge()
        else:
            for n in names:
                m.unmerge(n)


def remove_adapters(model, name=None):
    """Detach adapter `name` (every adapter when None); layers without adapters get their own class back."""
    for _, m in adapted_modules(model):
        if name is None:
            unadapt(m)
        else:
            m.remove_adapter(name)
            if not m._adapters:
                unadapt(m)
