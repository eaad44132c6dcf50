"""Baking LoRAs into a checkpoint (kohya's merge_lora, ComfyUI's save-after-LoRA): every weight a LoRA names becomes
W + Σ w_i s_i up_i down_i (computed in float64, rounded once to W's dtype); every other tensor is copied as it is,
and the file is written one tensor at a time (io.Deferred), atomically.

Names: a LoRA and the checkpoint must share a layout. A checkpoint weight `<name>.weight` (a leading
`model.diffusion_model.` / `diffusion_model.` left out) is what a kohya stem `lora_unet_<name with . -> _>` (or
`lora_transformer_`) names, and what a PEFT module `transformer.<name>` (or `unet.` / `diffusion_model.` / ...)
names: FLAME's and ComfyUI's kohya files on BFL-layout Flux or SAI-layout SDXL UNets, diffusers / ai-toolkit PEFT
files on diffusers-layout transformers. A LoRA adapter that names no weight of the checkpoint is an error listing
them (a LoRA of another layout is applied at load instead: `generate --lora`, which maps between layouts).
Text-encoder parts (lora_te1_ / text_encoder.) are refused unless `skip_text_encoders`. LoRA / LoCon only, as the
other LoRA tools; float8 weights are refused (rounding a sum to e4m3 is not what a user baking a LoRA wants), and a
result that is not finite stops the write.

Run: python -m flame_nn.adapters.bake BASE.safetensors OUT.safetensors LORA[:WEIGHT] [LORA[:WEIGHT] ...]
     [--skip-text-encoders]
"""
import argparse
import json
import os
import sys

import numpy as np

from flame_core import io as _io

from . import formats as F
from .resize import ResizeError, check_weights, parse_source, progress_bar, read_pairs, run_command

CHECKPOINT_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _names(key):
    """The module names a checkpoint weight key may go by (without a wrapper's prefix)."""
    name = key[:-len(".weight")]
    return [name] + [name[len(p):] for p in CHECKPOINT_PREFIXES if name.startswith(p)]


def _stems(name):
    return [p + name.replace(".", "_") for p in F.KOHYA_PREFIXES] + [p + name for p in F.PEFT_PREFIXES]


def bake_file(base, loras, dst, *, skip_text_encoders=False, progress=False):
    """Write `base` with `loras` ([(path, weight)] or paths) baked in to `dst`. Returns {checkpoint key: [LoRA
    stems]} of the weights changed."""
    loras = [(s, 1.0) if isinstance(s, (str, os.PathLike)) else tuple(s) for s in loras]
    if not loras:
        raise ResizeError("no LoRA files to bake")
    base = os.fspath(base)
    if not os.path.isfile(base):
        raise ResizeError(f"{base}: not a file (bake takes a single .safetensors checkpoint)")
    check_weights(loras)
    adapters = []   # (path, weight, stem, Pair)
    for path, w in loras:
        _, _, pairs = read_pairs(path)
        te = sorted(s for s in pairs if F.component_of(s) != "denoiser")
        if te and not skip_text_encoders:
            raise ResizeError(f"{path}: text-encoder adapters ({te[0]}, ... {len(te)} in all) are not baked into a "
                              f"denoiser checkpoint; apply the file at load (generate --lora) or pass "
                              f"skip_text_encoders (--skip-text-encoders) to bake the rest")
        adapters += [(path, w, s, p) for s, p in pairs.items() if F.component_of(s) == "denoiser"]
    with _io.safe_open(base) as f:
        by_stem, ambiguous = {}, {}
        for key in f.keys():
            if key.endswith(".weight"):
                for name in _names(key):
                    for stem in _stems(name):
                        if by_stem.setdefault(stem, key) != key:
                            ambiguous.setdefault(stem, {by_stem[stem]}).add(key)
        targets, unmatched = {}, []
        for path, w, stem, p in adapters:
            key = by_stem.get(stem)
            if stem in ambiguous:
                raise ResizeError(f"{stem} in {path} may name any of {sorted(ambiguous[stem])} in {base}")
            if key is None:
                unmatched.append(f"{stem} ({os.path.basename(path)})")
                continue
            shape = tuple(f.shape(key))
            want = (p.up.shape[0],) + p.down.shape[1:]
            if shape != want:
                raise ResizeError(f"{stem} in {path}: ΔW {want}, the checkpoint's {key} {shape}")
            check_target(f, key, base)
            targets.setdefault(key, []).append((w, stem, p))
        if unmatched:
            raise ResizeError(f"{len(unmatched)} LoRA adapter(s) name no weight of {base}: "
                              f"{', '.join(unmatched[:6])}{' ...' if len(unmatched) > 6 else ''} (another layout? "
                              f"generate --lora applies a LoRA of any layout at load)")
        bar = progress_bar(range(len(targets)), "baking") if progress else None

        def baked(key):
            def make():
                w0 = f.get_array(key)
                acc = w0.astype(np.float64)
                for w, _, p in targets[key]:
                    up = np.asarray(p.up, np.float64).reshape(p.up.shape[0], -1)
                    down = np.asarray(p.down, np.float64).reshape(p.down.shape[0], -1)
                    acc += (w * p.scale) * (up @ down).reshape(acc.shape)
                out = rounded(acc, w0.dtype, key)
                if bar is not None:
                    bar.update(1)
                return out
            return make

        write_baked(f, dst, {k: baked(k) for k in targets}, loras, bar)
    return {k: [s for _, s, _ in v] for k, v in targets.items()}


def check_target(f, key, base):
    """Refuse to bake into `key` of the open checkpoint `f` unless it is float16 / bfloat16 / float32 / float64."""
    dt = f.dtype(key)
    if dt.kind not in "fV" or dt.itemsize < 2:
        raise ResizeError(f"{key}: {dt} in {base}; bake into a float32 / float16 / bfloat16 checkpoint")


def rounded(acc, dtype, key):
    """The baked float64 weight `acc` rounded once to `dtype`; a value that is not finite after it (an overflow)
    stops the write, naming `key` (the atomic write leaves nothing)."""
    with np.errstate(over="ignore", invalid="ignore"):   # (an overflow is reported below)
        out = acc.astype(dtype)
    bad = out.size - int(np.count_nonzero(np.isfinite(out)))
    if bad:
        raise ResizeError(f"{key}: {bad} of {out.size} values are not finite after baking ({dtype} overflow?); "
                          f"nothing was written")
    return out


def write_baked(f, dst, makers, loras, bar=None, *, extra=None, metadata=None):
    """Write every tensor of the open checkpoint `f` to `dst` (atomically, one at a time): those in `makers` (key ->
    a function making the new array of the same dtype and shape, or an io.Deferred of another) made, the others
    copied as they are; `extra` {key: [(new key, io.Deferred)]} written right after `key` (None: at the end); the
    metadata kept, `metadata` added, the LoRAs (if any) recorded under flame.baked. `bar` (a progress bar) is closed
    at the end."""
    def copied(key):
        return lambda: f.get_array(key)
    extra = extra or {}
    tensors = {}
    for k in f.keys():
        m = makers.get(k)
        tensors[k] = m if isinstance(m, _io.Deferred) else _io.Deferred(f.dtype(k), f.shape(k), m or copied(k))
        tensors.update(extra.get(k, ()))
    tensors.update(extra.get(None, ()))
    meta = dict(f.metadata() or {})
    meta.update(metadata or {})
    if loras:
        meta["flame.baked"] = json.dumps([[os.path.basename(os.fspath(p)), w] for p, w in loras])
    try:
        _io.save_file(tensors, dst, metadata=meta)
    finally:
        if bar is not None:
            bar.close()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flame_nn.adapters.bake",
                                 description="Bake LoRAs into a checkpoint (W + weight·ΔW for the weights they name).")
    ap.add_argument("base", help="the checkpoint (.safetensors; its layout the LoRAs')")
    ap.add_argument("dst", help="the checkpoint to write (.safetensors)")
    ap.add_argument("loras", nargs="+", metavar="LORA[:WEIGHT]", help="the LoRA files, each with its weight")
    ap.add_argument("--skip-text-encoders", action="store_true",
                    help="bake the denoiser's adapters and leave a file's text-encoder ones out")
    args = ap.parse_args(argv)
    changed = run_command(ap, args.dst, lambda: bake_file(
        args.base, [parse_source(s) for s in args.loras], args.dst, skip_text_encoders=args.skip_text_encoders,
        progress=True))
    if changed is None:
        return 2
    print(f"{len(changed)} weights changed; wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
