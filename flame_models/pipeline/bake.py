"""Baking LoRAs into a denoiser checkpoint of either of its family's layouts, from a LoRA of any layout FLAME reads
(kohya / LyCORIS with the native names, PEFT / diffusers and ai-toolkit with diffusers names; LoRA, DoRA, LoKr, LoHa,
fused-Linear row splits): W' = the LoRAs merged into W as `generate --lora` merges them at load
(pipeline.loras.apply_loras: each file's change AdapterPart.merged_weight(W) − W -- DoRA's renormalised rows included
-- times its weight, against the base weight, summed), rounded once to W's dtype; every other tensor -- a ComfyUI
full checkpoint's VAE and text encoders included -- copied bit for bit, the file written one tensor at a time
(io.Deferred), atomically.

A module of FLAME's model (the native layout's names: BFL for Flux and Chroma, SAI for SD3 and SDXL) is one tensor
of a native-layout file (`double_blocks.0.img_attn.qkv.weight`, under the file's prefix) and one or more of a
diffusers-layout file, each a range of its rows (`transformer_blocks.0.attn.to_q` / `to_k` / `to_v`: the model's
adapter_name_map): those are put together, merged, and split back. The family's part (flame_models/<family>/bake.py)
gives its checkpoint reader, its params and its model class. A single .safetensors file only (a sharded folder is
refused); float8 weights are refused. With fp8 the block stacks' Linear weights are written as ComfyUI's scaled fp8
instead (checkpoint_io/scaled_fp8.py), quantised from the merged float64 value.
"""
import json
import os

import numpy as np

import flame_nn
from flame_core import io as _io
from flame_nn.adapters import formats as AF
from flame_nn.adapters.bake import check_target, rounded, write_baked

from ..bake import BakeError
from ..checkpoint_io import scaled_fp8 as SF


def _pieces(module, layout, name_map, out_features):
    """[(the file's module name, [(lo, hi) rows of the FLAME module])] making up FLAME module `module`."""
    if layout != "diffusers":
        return [(module, [(0, out_features)])]
    return name_map.peft_targets(module, out_features)


def bake_checkpoint(base, loras, dst, *, checkpoint_class, infer_params, model_class, stacks=(),
                    skip_text_encoders=False, fp8=False, progress=False):
    """Write the checkpoint `base` with `loras` ([(path, weight)]) merged in to `dst`; checkpoint_class (the family's
    reader: its `layout` and `prefix`), infer_params(checkpoint) and model_class(params) (its adapter_name_map) are
    the family's. fp8: the weights of the Linears under `stacks` (the family's block stacks: what FLAME's fp8
    storage quantises) written as ComfyUI's scaled fp8 (checkpoint_io.scaled_fp8.quantize, from the merged value:
    one rounding), each with its scale_weight, and the scaled_fp8 marker. Returns the sorted keys of the tensors
    changed."""
    base = os.fspath(base)
    if not os.path.isfile(base) or not base.endswith(".safetensors"):
        raise BakeError(f"{base}: bake takes a single .safetensors checkpoint (not a sharded folder)")
    with checkpoint_class(base) as ckpt:
        params = infer_params(ckpt)
        layout, prefix = ckpt.layout, ckpt.prefix
    with flame_nn.empty_init(device="cpu"):
        probe = model_class(params)
    name_map = probe.adapter_name_map()
    out_features = {n: m.weight.shape[0] for n, m in probe.named_modules()
                    if isinstance(m, (flame_nn.Linear, flame_nn.Conv2d))}   # (SDXL's LoCon convolutions)
    parts = {}
    for path, weight in loras:
        with _io.safe_open(path) as f:
            te = [k for k in f.keys() if AF.component_of(k) != "denoiser"]
        if te and not skip_text_encoders:
            raise BakeError(f"{path}: text-encoder adapters ({te[0]}, ... {len(te)} keys) are not baked into a "
                            f"transformer checkpoint; apply the file at load (generate --lora) or pass "
                            f"skip_text_encoders (--skip-text-encoders)")
        mods, _ = AF.load(path, list(out_features), name_map=name_map)
        for module, ps in mods.items():
            parts.setdefault(module, []).extend((weight, p) for p in ps)
    with _io.safe_open(base) as f:
        keys = f.keys()
        key_of = {}                      # the file's key of each (FLAME module, piece name)
        for module in parts:
            for name, _ in _pieces(module, layout, name_map, out_features[module]):
                key = prefix + name + ".weight"
                if key not in keys:
                    raise BakeError(f"{base}: no tensor {key!r} for the adapters on {module}")
                check_target(f, key, base)
                key_of[key] = module
        quantised = _fp8_keys(f, base, probe, stacks, layout, prefix, name_map, out_features) if fp8 else set()
        merged = {}                       # module -> {key: merged rows}, held until its pieces are written

        def merge(module):
            pieces = _pieces(module, layout, name_map, out_features[module])
            rows = []
            for name, ranges in pieces:
                w = f.get_array(prefix + name + ".weight")
                off = 0
                for lo, hi in ranges:
                    rows.append((lo, hi, name, off, w))
                    off += hi - lo
            w0 = rows[0][4]
            full = np.empty((out_features[module],) + w0.shape[1:], dtype=np.float64)
            for lo, hi, _, off, w in rows:
                full[lo:hi] = w[off:off + hi - lo]
            base_rows = full.copy()
            for weight, p in parts[module]:   # each against the base weight, its change times its weight (as
                lo, hi = p.rows or (0, full.shape[0])   # pipeline.loras.apply_loras merges), summed, rounded once
                full[lo:hi] += weight * (p.merged_weight(base_rows[lo:hi]) - base_rows[lo:hi])
            out = {}
            for lo, hi, name, off, w in rows:
                key = prefix + name + ".weight"
                piece = out.setdefault(key, np.empty(w.shape, np.float64))
                piece[off:off + hi - lo] = full[lo:hi]
            return out

        bar = None
        if progress:
            from tqdm.auto import tqdm
            # the modules merged, then (fp8) each weight quantised: a whole model's conversion takes minutes
            bar = tqdm(total=len(parts) + len(quantised), desc="baking" if parts else "quantising", unit="tensor")

        def baked(key):
            def make():
                module = key_of[key]
                if module not in merged:
                    merged[module] = merge(module)
                    if bar is not None:
                        bar.update(1)
                value = merged[module].pop(key)
                if not merged[module]:
                    del merged[module]
                return finish(key, value)
            return make

        scales = {}   # a quantised weight's scale, from its writing to its scale_weight's (written right after it)

        def finish(key, value):
            if key not in quantised:
                return rounded(value, f.dtype(key), key)
            try:
                q, scales[key] = SF.quantize(value, key)
            except ValueError as e:
                raise BakeError(f"{base}: {e}") from None
            if bar is not None:
                bar.update(1)
            return q

        def read_and_quantise(key):
            return lambda: finish(key, f.get_array(key))

        makers = {k: baked(k) for k in key_of}
        extra = {}
        for k in sorted(quantised):
            makers[k] = _io.Deferred(SF.E4M3, f.shape(k), makers.get(k) or read_and_quantise(k))
            extra[k] = [(k[:-len(".weight")] + ".scale_weight",
                         _io.Deferred(np.float32, (), lambda k=k: scales.pop(k)))]
        metadata = {}
        if quantised:
            extra[None] = [(prefix + SF.MARKER, _io.Deferred(SF.E4M3, (2,), lambda: np.zeros(2, SF.E4M3)))]
            metadata["flame.fp8"] = json.dumps({"format": "scaled_fp8", "dtype": "float8_e4m3fn",
                                                "scale": "per tensor", "weights": len(quantised)})
        write_baked(f, dst, makers, loras, bar, extra=extra, metadata=metadata)
    return sorted(set(key_of) | quantised)


def _fp8_keys(f, base, probe, stacks, layout, prefix, name_map, out_features):
    """The file keys of the weights of the probe model's Linears under `stacks` (each piece of a diffusers-layout
    file's), checked: 2-D floating weights of a file not already holding float8 ones or a scaled_fp8 marker."""
    if not stacks:
        raise BakeError(f"{base}: fp8: this family names no block stacks to quantise")
    keys = f.keys()
    for k in keys:
        dt = f.dtype(k)
        if k.endswith(SF.MARKER) or (dt.itemsize == 1 and dt.kind not in "iub"):   # (ml_dtypes' float8s)
            raise BakeError(f"{base}: already holds float8 tensors ({k}); fp8 takes a float16 / bfloat16 / "
                            f"float32 checkpoint")
    under = tuple(s + "." for s in stacks)
    out = set()
    for module, m in probe.named_modules():
        if not isinstance(m, flame_nn.Linear) or not module.startswith(under):
            continue
        for name, _ in _pieces(module, layout, name_map, out_features[module]):
            key = prefix + name + ".weight"
            if key not in keys:
                raise BakeError(f"{base}: no tensor {key!r} for the Linear {module}")
            if len(f.shape(key)) != 2:
                raise BakeError(f"{base}: {key} has shape {tuple(f.shape(key))}; a Linear's weight is 2-D")
            check_target(f, key, base)
            out.add(key)
    if not out:
        raise BakeError(f"{base}: fp8: no Linear weight under {', '.join(stacks)}")
    return out
