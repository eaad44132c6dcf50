"""LoRA files at sampling time: each file read and checked against the model it will change (names, shapes,
kinds) before anything big is loaded, then loaded as adapters and merged.

A file applies to each part of the model it has keys for (flame_nn.adapters.formats.component_of: the denoiser --
transformer or UNet --, and the text encoders 'te1' / 'te2' / 'te3': SDXL's CLIP-L / CLIP-G, SD3's CLIP-L / CLIP-G /
T5, Flux's CLIP-L and its T5 as kohya's te3 or diffusers' te2): a UNet-only SDXL file (the trainer's default)
changes the UNet and leaves CLIP-L / CLIP-G as they are; a text-encoder-only file changes only them. A file with
keys for no part of the model is refused, naming it."""
import os

import numpy as np

import flame_core as flame
import flame_nn
from flame_nn import adapters as A
from flame_nn.adapters.resize import parse_source

from ..conditioning import files as _cf
from ..conditioning.files import ModelFilesError


def parse_lora(spec):
    """"path[:weight]" -> (path, weight); weight 1.0 when absent. A colon whose tail is not a number belongs to
    the path (C:\\loras\\a.safetensors)."""
    if isinstance(spec, (tuple, list)):
        path, weight = spec
        return os.fspath(path), float(weight)
    return parse_source(os.fspath(spec))


def check_loras(loras, params, *, probe=None, model_class=None, error=ModelFilesError, text_encoders=None):
    """Read each LoRA file and check it against the model it will change (names, shapes, kind) before anything big
    is loaded. Returns [(path, weight)]. `error` (the family's files error) names the file. model_class: the model
    to check against, built from `params` under flame_nn.empty_init (its adapter_name_map() maps diffusers'
    names), e.g. a Flux, an SD3 MMDiT or an SDXL UNet; probe: such a model already built. text_encoders: {'te1':
    model or None, 'te2': ...} when the generator applies the text encoders' parts of the files too (SDXL's CLIP-L /
    CLIP-G): each part is checked against its model (built under empty_init), or, for None, when the encoder is
    loaded (check_lora_part); without it a file with text-encoder weights is refused."""
    out = []
    if not loras:
        return out
    if probe is None:
        if model_class is None:
            raise TypeError("check_loras: give the model to check against (model_class or probe)")
        with flame_nn.empty_init(device="cpu"):
            probe = model_class(params)
    targets = {"denoiser": (probe, probe.adapter_name_map()),
               **{c: (m, A.formats.IDENTITY) for c, m in (text_encoders or {}).items()}}
    for spec in loras:
        path, weight = parse_lora(spec)
        if not os.path.isfile(path):
            raise error(f"--lora {path}: no such file")
        if not np.isfinite(weight):
            raise error(f"--lora {path}: the weight {weight} is not a finite number")
        keys = lora_keys(path, error)
        te = [k for k in keys if k.startswith(("lora_te", "text_encoder", "te_"))
              or A.formats.component_of(k) != "denoiser"]
        if te and not text_encoders:
            raise error(f"--lora {path}: holds text-encoder LoRA weights ({len(te)} tensors such as "
                        f"{te[0]}); this generator applies transformer LoRAs only")
        other = sorted({A.formats.component_of(k) for k in te} - set(targets))
        if other or any(A.formats.component_of(k) == "denoiser" for k in te):
            raise error(f"--lora {path}: holds weights for a text encoder this model does not have (keys such as "
                        f"{te[0]}); its text encoders take lora_te1_ / lora_te2_ (kohya) or text_encoder. / "
                        f"text_encoder_2. (diffusers) keys")
        parts = lora_parts(keys)
        if not parts & set(targets):
            raise error(f"--lora {path}: holds no adapter weights for any part of this model (keys such as "
                        f"{keys[0]})")
        for component in sorted(parts):
            model, name_map = targets[component]
            if model is not None:
                check_lora_part(path, model, name_map, component, error)
        out.append((path, weight))
    return out


def lora_keys(path, error, label="--lora"):
    """The tensor names of LoRA file `path` (its header; nothing loaded), or `error` naming the file after `label`
    (the option that gave it) when it is not a LoRA file."""
    from ..checkpoint_io import describe_keys
    try:
        keys = list(_cf.read_headers(_cf.part_files(path, "lora", error=error), error=error))
    except error as e:
        raise error(f"{label} {e}") from None
    kind, words, example = describe_keys(keys)
    if kind != "lora":
        raise error(f"{label} {path}: not a LoRA file: it looks like {words}"
                    + (f" (keys such as {example})" if example else " (no tensors)"))
    return keys


def lora_parts(keys):
    """The parts of a model ('denoiser', 'te1', 'te2'; formats.component_of) that a LoRA file's tensor names have
    adapters for; `keys` may be the file's path (its header is read)."""
    if isinstance(keys, (str, os.PathLike)):
        keys = _cf.read_headers([os.fspath(keys)])
    return {A.formats.component_of(k) for k in keys}


def loras_for(loras, component):
    """The [(path, weight)] of `loras` whose files have adapters for `component` (lora_parts)."""
    return [(path, weight) for path, weight in loras if component in lora_parts(path)]


def check_lora_part(path, model, name_map, component, error, label="--lora"):
    """The adapters of one part of a LoRA file (formats.load's component) fit `model`'s layers (names, shapes,
    kinds); `error` names the file (after `label`, the option that gave it). Returns the part's canonical adapters
    ({module: [AdapterPart]})."""
    layers = (flame_nn.Linear, flame_nn.Conv2d)   # (SDXL's LoCon files adapt its convolutions)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, layers)}
    try:
        modules, _ = A.formats.load(path, set(shapes), name_map=name_map, component=component)
    except A.AdapterFormatError as e:
        raise error(f"{label} {path}: {_reason(e, path)}") from None
    for mod, parts in modules.items():
        out_f, in_f, kernel = shapes[mod][0], shapes[mod][1], shapes[mod][2:]
        for p in parts:
            lo, hi = p.rows if p.rows is not None else (0, out_f)
            if p.shape != (hi - lo, in_f):
                raise error(f"{label} {path}: the adapter on {mod} is {p.shape[0]}x{p.shape[1]} but "
                            f"this {type(model).__name__}'s {'Conv2d' if kernel else 'Linear'} (rows {lo}:{hi}) "
                            f"is {hi - lo}x{in_f}: a LoRA for another model size?")
            down = p.tensors.get("lora_down.weight")
            if kernel and p.kind != "lora":
                raise error(f"{label} {path}: a {p.kind} adapter on the convolution {mod}; convolutions take "
                            f"LoRA only")
            if kernel and down is not None and tuple(down.shape[2:]) not in (kernel, () if kernel == (1, 1)
                                                                              else kernel):
                raise error(f"{label} {path}: the adapter on {mod} has a {tuple(down.shape[2:])} kernel, the "
                            f"convolution's is {kernel}")
    return modules


def _reason(e, path):
    """The first line of a LoRA file error, without the file name that the --lora message already gives."""
    line = str(e).splitlines()[0]
    return line[len(f"{path}: "):] if line.startswith(f"{path}: ") else line


def apply_loras(model, loras, *, merge=True, dtype=flame.float32, error=ModelFilesError, component="denoiser"):
    """Load each (path, weight) into `model` as its own adapter ("lora_0", "lora_1", ...), scaled by its weight;
    the changes add up. merge=True folds them into the base weights (summed, rounded once) and drops the adapters
    (no cost per step, and no copy of the original weights kept: inference never unmerges); merge=False keeps them
    as adapters beside the weights (fp8 storage and streamed blocks need that). `error` names the file. component:
    the part of each file to apply ('denoiser'; 'te1' / 'te2' / 'te3' when `model` is that text encoder; a tuple of
    them when the files name one model in several ways: Flux's T5 is kohya's te3 and diffusers' te2): files without
    adapters for it leave `model` as it is (lora_parts)."""
    comps = (component,) if isinstance(component, str) else tuple(component)
    loras = [(path, weight, c) for c in comps for path, weight in loras_for(loras, c)]
    for i, (path, weight, comp) in enumerate(loras):
        try:
            A.load_adapters(model, path, name=f"lora_{i}", weight=weight, dtype=dtype, component=comp)
        except (A.AdapterFormatError, A.AdapterError) as e:
            raise error(f"--lora {path}: {_reason(e, path)}") from None
    if loras and merge:
        # Linear by Linear: the LoRAs' changes (each times its weight, each against the base weight, as the adapters
        # compute them unmerged) summed in float32, then added and rounded to the weight's dtype once. Merging one
        # LoRA after the other would round a bf16 weight once per LoRA: two LoRAs at 0.5 would not be one at 1.
        changes = {}
        for i, (_, weight, _) in enumerate(loras):
            for module, rows, ad in A.adapter_modules(model, f"lora_{i}"):
                changes.setdefault(module, []).append((rows, ad, weight))
        with flame.no_grad():
            for module, entries in changes.items():
                w = model.get_submodule(module).weight
                w0 = w.to(flame.float64 if w.dtype == flame.float64 else flame.float32)
                delta = flame.zeros_like(w0)
                for rows, ad, weight in entries:
                    lo, hi = rows if rows is not None else (0, w.shape[0])
                    new = ad.merged_weight(w[lo:hi]).to(w0.dtype)   # W + ΔW (DoRA: renormalised rows)
                    delta[lo:hi].add_((new - w0[lo:hi]) * weight)
                w.copy_((w0 + delta).to(w.dtype))
        A.remove_adapters(model)
    return model


def refuse_streamed_encoder_loras(loras, components, encoder, error=ModelFilesError):
    """`error` naming the first of `loras` with a part for `components` (an encoder named `encoder` that will stream
    from host memory under a memory budget: its LoRA part cannot be applied there); nothing when none has one. The
    loaders call it before loading anything."""
    for comp in components:
        mine = loras_for(loras, comp)
        if mine:
            raise _streamed(mine[0][0], comp, encoder, error)


def _streamed(path, comp, encoder, error):
    return error(f"--lora {path}: holds {encoder} weights ({comp} keys), which cannot be applied while that encoder "
                 f"streams from host memory (a memory budget); run without the budget, or with a file without them")


def apply_text_encoder_loras(loras, encoders, error=ModelFilesError):
    """The text-encoder parts of checked `loras` (check_loras with `text_encoders`) applied to the loaded encoders
    [(component or tuple of components, encoder)]: each part checked against its encoder's layers (names, shapes,
    kinds; `error` names the file) and merged into its weights (summed, rounded once), or kept as adapters beside
    weights in fp8 storage (T5 from an fp8 file). An encoder whose blocks stream from host memory (a memory budget's
    T5) cannot take one: refused, naming the file. Files without a part for an encoder leave it as it is."""
    from flame_nn.offload import Float8LinearMixin
    for component, encoder in encoders:
        comps = (component,) if isinstance(component, str) else tuple(component)
        mine = [(path, comp) for comp in comps for path, _ in loras_for(loras, comp)]
        if not mine or encoder is None:
            continue
        if getattr(encoder, "streamer", None) is not None:
            raise _streamed(mine[0][0], mine[0][1], type(encoder).__name__, error)
        for path, comp in mine:
            check_lora_part(path, encoder, A.formats.IDENTITY, comp, error)
        fp8 = any(isinstance(m, Float8LinearMixin) for m in encoder.modules())
        apply_loras(encoder, loras, merge=not fp8, error=error, component=comps)
