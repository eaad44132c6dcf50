"""load_clip / load_t5: a text encoder from any of its checkpoint layouts, built under `flame_nn.empty_init` (no
random initialisation) and filled one tensor at a time, each converted straight to its dtype and device.

    clip_l = load_clip("FLUX.1-dev/", dtype=flame.bfloat16, device="cuda")             # diffusers text_encoder/
    clip_g = load_clip("sd_xl_base_1.0.safetensors", prefix="conditioner.embedders.1.model.")
    t5 = load_t5("t5xxl_fp8_e4m3fn.safetensors", device="cuda")                         # stays fp8 (quantize="auto")
    t5 = load_t5("FLUX.1-dev/", device="cuda", quantize="fp8", stream=True)             # ~1/2 the bytes, streamed

quantize: "auto" keeps the Linear weights of the layers that a file stores as float8_e4m3fn in fp8 storage
(flame_nn.offload: per-row float32 scales, dequantised right before each matmul; ComfyUI's per-tensor scales become
those rows' scales, nothing is re-rounded), "fp8" stores every Linear weight of the layers in fp8 (quantised on the
device, one tensor at a time), None dequantises everything to `dtype`. Embeddings and norms keep `dtype`.

The models come back frozen (requires_grad False) and in eval mode: call `requires_grad_(True)` to train them.
"""
import json
import re

from tqdm import tqdm

import flame_core as flame
import flame_nn
from flame_core.dtypes import dtype_of
from flame_core.ops.fp8 import quantize_fp8
from flame_nn.offload import BlockStreamer, set_fp8_weight_

from .. import checkpoint_io as CIO
from . import layouts as LY
from .clip import CLIPTextModel, CLIPTextModelWithProjection
from .configs import CLIPTextConfig, T5Config, infer_clip_config, infer_t5_config
from .files import NAMES, Checkpoint, TextEncoderCheckpointError, resolve
from .saving import CONFIG_METADATA_KEY
from .storage import Packed, fuse_fp8_projections_, fuse_projections_
from .structure import is_structure_only
from .t5 import T5EncoderModel

QUANTIZE = ("auto", "fp8", None)
_FP8_LINEARS = {"clip": re.compile(r"text_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"
                                   r"\.weight$"),
                "t5": re.compile(r"encoder\.block\.\d+\.layer\.[01]\.(SelfAttention\.[qkvo]|"
                                 r"DenseReluDense\.(wi_0|wi_1|wo))\.weight$")}
_EMBEDDING_KEY = {"clip": "text_model.embeddings.token_embedding.weight", "t5": "shared.weight"}


# ----------------------------------------------------------------------------- public entry points
def load_clip(path, dtype=None, device=None, *, prefix=None, subfolder=None, config=None, projection=None,
              quantize="auto", strict=True):
    """A CLIPTextModel, or a CLIPTextModelWithProjection when the checkpoint has a text projection, from a
    transformers / diffusers folder (text_encoder/; SDXL's CLIP-G: subfolder="text_encoder_2"), a sharded index,
    a single file (ComfyUI clip_l / clip_g, OpenCLIP) or a checkpoint holding several models (SDXL: prefix=
    "conditioner.embedders.0.transformer." for CLIP-L, "conditioner.embedders.1.model." for CLIP-G; SD3:
    "text_encoders.clip_l.transformer.", "text_encoders.clip_g.transformer."; found by itself when the file holds
    one CLIP). dtype: default the file's (bfloat16 for fp8 files); device: default the default device.
    config: a CLIPTextConfig, dict or config.json path (default: the folder's config.json, else the one
    save_pretrained wrote into the file, else inferred from the weights). projection: None = as the checkpoint, True =
    require text_projection, False = leave it out."""
    if projection not in (None, True, False):
        raise ValueError(f"load_clip: projection must be None, True or False, got {projection!r}")
    return _load("clip", path, dtype, device, prefix, subfolder, config, quantize, strict, projection=projection)


def load_t5(path, dtype=None, device=None, *, prefix=None, subfolder=None, config=None, quantize="auto",
            stream=False, strict=True):
    """A T5EncoderModel from a transformers / diffusers folder (Flux: text_encoder_2/, SD3: text_encoder_3/, found
    by itself in a diffusers model folder), a sharded index, a single file (ComfyUI t5xxl_fp16 / t5xxl_fp8_e4m3fn
    [_scaled]) or a checkpoint holding several models (SD3: prefix "text_encoders.t5xxl.transformer."). dtype:
    default the file's (bfloat16 for fp8 files; in float16 the `wo` weights are kept in float32, as transformers).
    config: as load_clip's (inferred from the weights: every field but relative_attention_max_distance, which is
    128 in every T5 release). stream=True: the blocks' weights go to pinned host memory and stream through 2 GPU slots
    (flame_nn.offload.BlockStreamer, `model.streamer`; `model.streamer.set_resident(...)` / `.auto_fit(...)` keep
    some on the GPU); each block is loaded on `device` and packed in turn, so the model is never whole on the GPU."""
    if stream not in (True, False):
        raise ValueError(f"load_t5: stream must be True or False, got {stream!r}")
    return _load("t5", path, dtype, device, prefix, subfolder, config, quantize, strict, stream=stream)


# ----------------------------------------------------------------------------- the steps
def _load(kind, path, dtype, device, prefix, subfolder, config, quantize, strict, projection=None, stream=False):
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    files, file_config = resolve(path, kind, subfolder)
    label = str(path) if len(files) > 1 or str(path) == files[0] else f"{path} ({files[0]})"
    with Checkpoint(files, label) as ckpt:
        cand = _pick(kind, ckpt, prefix, label)
        keymap = LY.map_keys(cand, ckpt.keys())
        if kind == "clip" and projection is False and "text_projection.weight" in keymap.sources:
            keymap.known.add(keymap.sources.pop("text_projection.weight").key)
        cfg = _config(kind, config, file_config, keymap, ckpt, label)
        dtype = _default_dtype(kind, dtype, keymap, ckpt)
        if kind == "clip":
            with_proj = projection if projection is not None else "text_projection.weight" in keymap.sources
            cls = CLIPTextModelWithProjection if with_proj else CLIPTextModel
        else:
            cls = T5EncoderModel
        structure = is_structure_only()   # (the layers and their shapes only: structure.py)
        with flame_nn.empty_init(device="cpu" if structure else device, dtype=dtype):
            model = cls(cfg)
        plan = _plan(kind, model, keymap, ckpt, dtype, quantize)
        _check(model, keymap, ckpt, cand, strict, label)
        if structure:
            return model.requires_grad_(False).eval()
        nbytes = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
        with flame.no_grad(), tqdm(total=len(plan), desc=f"loading {type(model).__name__}", unit="tensor",
                                   disable=nbytes < CIO.PROGRESS_BYTES, leave=False) as bar:
            if stream:
                _load_streamed(model, plan, keymap, ckpt, bar)
            else:
                _fill(model, plan, keymap, ckpt, "", bar)
    model.requires_grad_(False)
    model.eval()
    return model


def _pick(kind, ckpt, prefix, label):
    found = LY.find_encoders(ckpt.keys())
    mine = [c for c in found if c.kind == kind]
    if prefix is not None:
        match = [c for c in mine if c.prefix == prefix]
        if not match:
            raise TextEncoderCheckpointError(f"{label}: no {NAMES[kind]} under prefix {prefix!r}; it holds "
                                             f"{LY.looks_like(ckpt.keys())}")
        return match[0]
    if not mine:
        other = "load_t5" if kind == "clip" else "load_clip"
        hint = f" (use {other})" if any(c.kind != kind for c in found) else ""
        raise TextEncoderCheckpointError(f"{label} holds no {NAMES[kind]}: it looks like "
                                         f"{LY.looks_like(ckpt.keys())}{hint}")
    if len(mine) > 1:
        raise TextEncoderCheckpointError(f"{label} holds {len(mine)} {NAMES[kind]}s: "
                                         + "; ".join(c.describe() for c in mine) + ". Pass prefix=")
    return mine[0]


def _config(kind, config, file_config, keymap, ckpt, label):
    cls = CLIPTextConfig if kind == "clip" else T5Config
    if isinstance(config, cls):
        return config
    if config is not None:
        return cls.from_pretrained(config)
    if file_config is not None:
        return cls.from_dict(file_config)
    saved = ckpt.metadata(CONFIG_METADATA_KEY)  # written by save_pretrained
    if saved is not None:
        return cls.from_dict(json.loads(saved))
    shapes = {k: s.shape(ckpt.shape(s.key)) for k, s in keymap.sources.items()}
    infer = infer_clip_config if kind == "clip" else infer_t5_config
    return infer(shapes, source=label)


def _default_dtype(kind, dtype, keymap, ckpt):
    """`dtype`, else the file's: bfloat16 when its layers' Linear weights are fp8, else the token embedding's."""
    if dtype is not None:
        dt = flame.dtypes.dtype(dtype)
        if not dt.is_floating_point or dt.itemsize == 1:
            raise ValueError(f"dtype must be float32, bfloat16, float16 or float64, got {dt} (fp8 storage of the "
                             f"Linear weights: quantize='fp8')")
        return dt
    stored = [ckpt.dtype(s.key) for k, s in keymap.sources.items() if _FP8_LINEARS[kind].match(k)]
    if any(_is_fp8(d) for d in stored):
        return flame.bfloat16
    src = keymap.sources.get(_EMBEDDING_KEY[kind])
    if src is None:
        return flame.get_default_dtype()
    return flame.bfloat16 if _is_fp8(ckpt.dtype(src.key)) else dtype_of(ckpt.dtype(src.key))


def _plan(kind, model, keymap, ckpt, dtype, quantize):
    """{model key: how to load it}: ("fp8", compute dtype) for weights going to fp8 storage, else the dtype."""
    fp8_stored = flame.float8_e4m3fn
    plan = {}
    for name, p in model.named_parameters():
        target = dtype if p.dtype.is_floating_point else p.dtype
        if kind == "t5" and dtype == flame.float16 and name.endswith(".DenseReluDense.wo.weight"):
            target = flame.float32  # transformers' _keep_in_fp32_modules for T5 in float16
        src = keymap.sources.get(name)
        if src is not None and _FP8_LINEARS[kind].match(name):
            stored_fp8 = ckpt.dtype(src.key) == fp8_stored.np
            if quantize == "fp8" or (quantize == "auto" and stored_fp8):
                plan[name] = ("fp8", target)
                continue
        plan[name] = target
    return plan


def _check(model, keymap, ckpt, cand, strict, label):
    """Missing, unexpected and misshaped keys, all named in one error, before any tensor is read."""
    params = dict(model.named_parameters())
    missing = [k for k in params if k not in keymap.sources]
    unexpected = list(keymap.unknown) + [s.key for k, s in keymap.sources.items() if k not in params]
    misshaped = []
    for k, s in keymap.sources.items():
        if k in params:
            got, want = s.shape(ckpt.shape(s.key)), tuple(params[k].shape)
            if got != want:
                misshaped.append(f"{s.key}: {got} in the file, {want} in the model ({k})")
    CIO.check_mismatch(TextEncoderCheckpointError, f"cannot load {label} as a {type(model).__name__} "
                       f"({cand.describe()}, config {_short_config(model.config)}):",
                       [cand.prefix + k for k in missing], unexpected, misshaped, strict=strict, limit=12, noun="",
                       hint="  (strict=False loads it without the unexpected tensors)"
                       if unexpected and not misshaped else None)


def _short_config(c):
    if isinstance(c, CLIPTextConfig):
        return f"{c.num_hidden_layers} layers, width {c.hidden_size}, {c.hidden_act}"
    return f"{c.num_layers} blocks, d_model {c.d_model}, {c.num_heads} heads"


# ----------------------------------------------------------------------------- reading tensors
def _read(keymap, ckpt, name, dtype, device):
    """The model tensor `name` in `dtype` on `device` (dequantised, transposed or cut from its file tensor)."""
    src = keymap.sources[name]
    stored = ckpt.dtype(src.key)
    if _is_fp8(stored):  # (float8_e5m2 has no device representation: widened on the host; a ComfyUI scale applied)
        t = ckpt.get(src.key, dtype=flame.float32,
                     device=device if stored == flame.float8_e4m3fn.np else "cpu").to(device).to(dtype)
    else:
        t = ckpt.get(src.key, dtype=dtype, device=device)
    if src.transform == "T":
        t = t.T.contiguous()
    elif isinstance(src.transform, tuple):
        i, n = src.transform
        rows = t.shape[0] // n
        t = t[i * rows:(i + 1) * rows].contiguous()
    return t


def _fp8_weight(keymap, ckpt, name, device):
    """(q float8_e4m3fn, scales float32 (out,)) of a Linear weight: the file's own fp8 values and scales when it
    stores them (nothing re-rounded), else quantised per row on the device."""
    src = keymap.sources[name]
    stored = ckpt.dtype(src.key)
    if stored == flame.float8_e4m3fn.np and src.transform is None:
        q = ckpt.get_stored(src.key, device=device)
        s = ckpt.scale(src.key, device=q.device)
        return q, (flame.ones(q.shape[0], dtype=flame.float32, device=q.device) if s is None else s)
    exact = dtype_of(stored) if stored.itemsize in (2, 4) and not _is_fp8(stored) else flame.float32
    return quantize_fp8(_read(keymap, ckpt, name, exact, device))


def _is_fp8(np_dtype):
    return np_dtype.itemsize == 1 and np_dtype.kind not in "iub"


def _fill(module, plan, keymap, ckpt, prefix, bar, fuse=True):
    """Load every parameter of `module` (whose names are `prefix` + its own) as `plan` says: fp8 storage for the
    Linear weights planned so, packed storage (one buffer per dtype, storage.py) for the rest."""
    dense = {}
    layers = dict(module.named_modules())
    for local, _ in list(module.named_parameters()):
        how = plan[prefix + local]
        if isinstance(how, tuple):
            q, scales = _fp8_weight(keymap, ckpt, prefix + local, _device_of(module, local))
            set_fp8_weight_(layers[local[:-len(".weight")]], q, scales, how[1])
            bar.update(1)
        else:
            dense[local] = how
    packed = Packed(module, dense)
    for local, view in packed.views.items():
        view.copy_(_read(keymap, ckpt, prefix + local, dense[local], view.device))
        bar.update(1)
    module.load_state_dict(packed.views, strict=False, assign=True)  # the parameters become the packed views
    if fuse:
        fuse_projections_(module, packed)
        fuse_fp8_projections_(module, packed)  # q | k | v, wi_0 | wi_1 in fp8 storage: stacked, one GEMM each


def _device_of(module, name):
    return module.get_parameter(name).device


def _load_streamed(model, plan, keymap, ckpt, bar):
    """Everything but the blocks on the model's device; each block loaded there, then packed into pinned host memory
    by the BlockStreamer (its device copy released) before the next one is read."""
    blocks = model.encoder.block
    index = {id(b): i for i, b in enumerate(blocks)}
    _fill(model.shared, plan, keymap, ckpt, "shared.", bar)
    _fill(model.encoder.final_layer_norm, plan, keymap, ckpt, "encoder.final_layer_norm.", bar)
    model.requires_grad_(False)  # a streamer keeps only frozen tensors in host memory
    model.streamer = BlockStreamer(
        blocks, device=model.shared.weight.device, prefixes=["encoder.block"],
        prepare=lambda block: _fill(block, plan, keymap, ckpt, f"encoder.block.{index[id(block)]}.", bar,
                                    fuse=False))  # (fused views would keep each block's packed copy alive)


__all__ = ["load_clip", "load_t5", "TextEncoderCheckpointError"]
