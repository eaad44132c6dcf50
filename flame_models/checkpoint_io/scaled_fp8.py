"""ComfyUI's scaled-fp8 checkpoints (`*_fp8_scaled.safetensors`, `*_fp8_e4m3fn_scaled.safetensors`): a Linear
weight stored as float8 comes with `<layer>.scale_weight` (or `<layer>.weight_scale`), and the weight is
`stored * scale` -- one scale for the tensor, or one per row. Beside them:

    scaled_fp8            the file's marker (an empty tensor)
    <layer>.scale_input   the activation scale of fp8 matmuls (`input_scale` too): ComfyUI uses it only when it runs
                          the matmul in fp8; FLAME's fp8 compute scales activations itself, so it is not read
    <layer>.comfy_quant   a JSON description of the format: float8_e4m3fn (per tensor) or float8_e4m3fn_rowwise
                          (per row) are read; any other format is refused, naming the layer

`ScaledWeights.split(handle_of)` takes these keys out of a checkpoint's key index (the families' key layouts never
see them) and keeps the scale of each weight; `SafetensorsCheckpoint.get` then returns the dequantised weight.
Every check reads headers, the scales and the descriptions (small tensors) only, before any weight is read.

Writing (`quantize`, `bake --fp8`): ComfyUI's classic layout -- the weight as float8_e4m3fn, `<layer>.scale_weight`
a float32 scalar (amax / 448, the weight = stored · scale) and the `scaled_fp8` marker under the model's prefix, a
float8_e4m3fn tensor whose dtype ComfyUI reads as the file's fp8 format. The marker holds two values: ComfyUI then
dequantises the weights and multiplies in the compute dtype (its "full precision matrix mult", as FLAME's fp8
storage does); a marker of another size turns its fp8 matmuls on, which would need activation scales
(`scale_input`) that a weights-only conversion cannot know."""
import json

import numpy as np

import flame_core as flame

SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")
QUANT_SUFFIX = ".comfy_quant"
MARKER = "scaled_fp8"
FORMATS = ("float8_e4m3fn", "float8_e4m3fn_rowwise")
_MAX_DESCRIPTION = 1 << 16  # bytes of a comfy_quant description (a few dozen in ComfyUI's files)
_SUFFIXES = SCALE_SUFFIXES + INPUT_SCALE_SUFFIXES + (QUANT_SUFFIX,)


def is_quant_key(key):
    """Whether `key` (prefix and all) is a marker, scale or description of ComfyUI's scaled fp8."""
    return key.endswith(_SUFFIXES) or key == MARKER or key.endswith("." + MARKER)


def weight_key(key):
    """The weight a scale / description key belongs to: `<layer>.scale_weight` -> `<layer>.weight`."""
    return key[:key.rindex(".")] + ".weight"


class ScaledWeights:
    """The scaled-fp8 side keys of one checkpoint: `scale_of` {weight key: its scale key}, `handle_of` {side key:
    its open file} (the keys `split` took out of the index)."""

    def __init__(self):
        self.scale_of = {}
        self.handle_of = {}

    def __bool__(self):
        return bool(self.handle_of)

    @classmethod
    def split(cls, handle_of, label, error):
        """Take the scaled-fp8 side keys out of `handle_of` (edited in place) and check them: a scale or description
        whose weight the files lack stays in the index (the family names it as unexpected); a scale must hold one
        value or one per row of its weight, all finite; a description must name a readable format. `error`: the family's
        CheckpointError, raised naming `label` and the key."""
        out = cls()
        for k in [k for k in handle_of if is_quant_key(k)]:
            if k == MARKER or k.endswith("." + MARKER):
                out.handle_of[k] = handle_of.pop(k)
                continue
            w = weight_key(k)
            if w not in handle_of:
                continue
            if k.endswith(SCALE_SUFFIXES):
                if w in out.scale_of:
                    raise error(f"{label}: {w} has two scales, {out.scale_of[w]} and {k}")
                out.scale_of[w] = k
            out.handle_of[k] = handle_of.pop(k)
        for w, s in out.scale_of.items():
            n, rows = _numel(out.handle_of[s].shape(s)), tuple(handle_of[w].shape(w))
            if n != 1 and (not rows or n != rows[0]):
                raise error(f"{label}: scale {s} has {n} values for a weight of "
                            f"{rows[0] if rows else 1} rows (one, or one per row)")
            v = out.handle_of[s].get_array(s)       # (one value or one per row: small)
            if v.dtype.kind not in "fV" or not np.isfinite(v.astype(np.float64)).all():
                raise error(f"{label}: scale {s} is not finite {v.dtype} values: a damaged file")
        for k, h in out.handle_of.items():
            if k.endswith(QUANT_SUFFIX):
                if _numel(h.shape(k)) > _MAX_DESCRIPTION:
                    raise error(f"{label}: {k} holds {_numel(h.shape(k))} values: too long for a description")
                fmt = describe_format(h.get_array(k))
                if fmt is None:
                    raise error(f"{label}: {k} is not a JSON description of a quantisation")
                if fmt not in FORMATS:
                    raise error(f"{label}: {weight_key(k)} is quantised as {fmt!r}; only float8_e4m3fn weights with "
                                f"per-tensor or per-row scales can be read")
        return out

    def get(self, handle, key, dtype=None, device=None):
        """The weight `key` of `handle` (an open file) as `stored * scale`, in float32 arithmetic, converted to
        `dtype` (float32 when None) on `device`."""
        s = self.scale_of[key]
        stored = handle.dtype(key)
        # float8_e5m2 has no device representation: it is widened on the host
        w = handle.get_tensor(key, dtype=flame.float32, device=device if stored.itemsize > 1
                              or stored == flame.float8_e4m3fn.np else "cpu").to(device)
        scale = self.handle_of[s].get_tensor(s, dtype=flame.float32, device=w.device).reshape(-1)
        if scale.numel() != 1:
            scale = scale.reshape((-1,) + (1,) * (w.ndim - 1))
        w = w * scale
        return w if dtype is None or dtype == flame.float32 else w.to(dtype)

    def scale(self, key, rows, device=None):
        """The scale of weight `key` (of `rows` rows) as float32, one value per row ((rows,)), or None when it has
        none."""
        s = self.scale_of.get(key)
        if s is None:
            return None
        v = self.handle_of[s].get_tensor(s, dtype=flame.float32, device=device).reshape(-1)
        return v if v.numel() == rows else flame.ones(rows, dtype=flame.float32, device=v.device) * v


E4M3_MAX = 448.0
E4M3 = np.dtype(flame.float8_e4m3fn.np)


def quantize(w, key="the weight"):
    """A weight (any float array; float64 from a bake) as ComfyUI's scaled fp8: (stored float8_e4m3fn, scale float32
    of shape ()), stored = round-to-nearest-even(w / scale) with scale = max|w| / 448 (1 for an all-zero weight), one
    rounding from w's own precision. A ValueError naming `key` when w is not all finite."""
    import ml_dtypes
    w = np.asarray(w)
    if w.dtype.kind == "V" or w.dtype.itemsize < 4:   # (bfloat16 / float16: exact in float32)
        w = w.astype(np.float32)
    amax = float(np.abs(w).max()) if w.size else 0.0
    if not np.isfinite(amax):
        raise ValueError(f"{key}: not all finite; a weight that is not finite is not written")
    scale = np.float32(amax / E4M3_MAX) if amax > 0 else np.float32(1.0)
    if scale == 0:   # (an amax below float32's smallest scale: all the values round to zero anyway)
        scale = np.float32(1.0)
    with np.errstate(over="ignore"):
        q = np.clip(w / w.dtype.type(scale), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, np.array(scale, dtype=np.float32)


def describe_format(raw):
    """The `format` a comfy_quant tensor (UTF-8 JSON bytes as uint8) names, or None when it is not such JSON."""
    try:
        fmt = json.loads(bytes(raw.astype("uint8").reshape(-1).tolist()).decode("utf-8")).get("format")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return fmt if isinstance(fmt, str) else repr(fmt)


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
