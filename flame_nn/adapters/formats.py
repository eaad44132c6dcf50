"""LoRA-family files: the kohya/LyCORIS layout (ComfyUI reads it) and the PEFT/diffusers layout, and the exact
conversions between them. Array-level (NumPy): no modules here, so the conversions are testable on their own.

Canonical form: `{module_name: [AdapterPart, ...]}` where a part adapts some output rows of one Linear (W: out × in)
and holds its tensors under the kohya/LyCORIS suffixes:

    lora  lora_down.weight (r, in), lora_up.weight (out, r)                       ΔW = s·up·down
          on a Conv2d (LoCon): (r, in, kh, kw) and (out, r, 1, 1)                 ΔW = s·(up·down.reshape(r, -1))
    dora  lora + dora_scale (out, 1): the magnitude m                            W' = m ⊙ (W+ΔW) / ‖W+ΔW‖_row
    lokr  lokr_w1 (a, c) and lokr_w2 (b, d) or lokr_w2_a (b, r) @ lokr_w2_b (r, d) ΔW = s·kron(w1, w2)
    loha  hada_w1_a (out, r), hada_w1_b (r, in), hada_w2_a, hada_w2_b            ΔW = s·(w1a·w1b) ⊙ (w2a·w2b)

`alpha` is always the kohya alpha: s = alpha / rank (s = 1 when alpha is None, and for a LoKr whose factors are
both full). rsLoRA (s = α/√r) is written as alpha = α·√r so every reader gets the same s.

kohya keys: `lora_unet_<module name with . -> _>.<suffix>` plus `.alpha` (a 0-d float32).
PEFT keys:  `transformer.<diffusers name>.lora_A.weight / .lora_B.weight / .lora_magnitude_vector`, no alpha. FLAME
writes s folded into lora_B (exact whenever s is a power of two, e.g. α = r) and records the original alphas in the
metadata so that its own loader restores them. Reading, s comes from (first found): a per-module `.alpha` key (the
kohya alpha, as ComfyUI reads it), FLAME's recorded alphas, the PEFT LoraConfig that diffusers' save_lora_weights
stores as JSON under the metadata key `lora_adapter_metadata` (`transformer.r`, `.lora_alpha`, `.rank_pattern`,
`.alpha_pattern`, `.use_rslora`, `.use_dora`; patterns matched as PEFT does, by a bounded matcher: patterns.py), else
s = 1 (diffusers' own default
when a file has no metadata: lora_alpha = r). Fused FLAME/BFL Linears map to several diffusers Linears through a
`NameMap` (for Flux: flame_models/flux/lora_keys.py), e.g. img_attn.qkv rows [0:H] / [H:2H] / [2H:3H] -> to_q / to_k /
to_v. A LoRA on a fused Linear splits exactly into one LoRA per part (same down, rows of up); the reverse joins them
again when their downs are equal.

Files are untrusted: every part read is checked (check_part) before use -- shapes that form the adapter (2-D or
conv 4-D, ranks that agree and are >= 1), floating-point values that are all finite, an alpha with one finite value
(0-d as kohya writes it, or [1]: ComfyUI reads any one-element alpha with .item()) -- and the error names the key.
"""
import json
import math
from dataclasses import dataclass

import numpy as np

from flame_core import io as _io
from flame_core.errors import FlameError, fmt_shape

from . import patterns as _patterns

KINDS = ("lora", "dora", "lokr", "loha")
KOHYA_PREFIX = "lora_unet_"
KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")      # the second: OneTrainer / some ai-toolkit exports
PEFT_PREFIX = "transformer."
PEFT_PREFIXES = ("transformer.", "unet.", "diffusion_model.", "base_model.model.")
_LORA = ("lora_down.weight", "lora_up.weight")
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LOKR = ("lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
KOHYA_SUFFIXES = _LORA + ("dora_scale", "alpha") + _LOHA + _LOKR


class AdapterFormatError(FlameError, ValueError):
    """A LoRA file or state that cannot be read, written or converted (the message names the keys involved)."""


# ----------------------------------------------------------------------------- the canonical part
@dataclass
class AdapterPart:
    kind: str
    tensors: dict
    alpha: float = None
    rows: tuple = None  # (lo, hi) output rows of the module; None: all of them

    def __post_init__(self):
        if self.kind not in KINDS:
            raise AdapterFormatError(f"unknown adapter kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def rank(self):
        t = self.tensors
        if self.kind in ("lora", "dora"):
            return int(t["lora_down.weight"].shape[0])
        if self.kind == "loha":
            return int(t["hada_w1_b"].shape[0])
        return int(t["lokr_w2_b"].shape[0]) if "lokr_w2_b" in t else None  # None: full w2

    @property
    def scale(self):
        r = self.rank
        if self.alpha is None or r is None:
            return 1.0
        return float(self.alpha) / r

    @property
    def shape(self):
        """(out, in) of the weight block this part adapts."""
        t = self.tensors
        if self.kind in ("lora", "dora"):
            return (t["lora_up.weight"].shape[0], t["lora_down.weight"].shape[1])
        if self.kind == "loha":
            return (t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1])
        w1 = t["lokr_w1"]
        b, d = (t["lokr_w2"].shape if "lokr_w2" in t else (t["lokr_w2_a"].shape[0], t["lokr_w2_b"].shape[1]))
        return (w1.shape[0] * b, w1.shape[1] * d)

    def delta_weight(self, xp=np, dtype=np.float64):
        """ΔW in `dtype` (for lora/lokr/loha; DoRA's change depends on W: see merged_weight); xp: the array module
        to compute with (NumPy, or CuPy for a weight on a GPU)."""
        t = {k: xp.asarray(np.asarray(v, dtype=dtype)) for k, v in self.tensors.items()}  # (bf16: on the host)
        if self.kind in ("lora", "dora"):
            up, down = t["lora_up.weight"], t["lora_down.weight"]
            if down.ndim == 4:   # a convolution's: (r, in, kh, kw) down, (out, r, 1, 1) up
                return self.scale * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(
                    (up.shape[0],) + down.shape[1:])
            d = up @ down
        elif self.kind == "loha":
            d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        else:
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            d = xp.kron(t["lokr_w1"], w2)
        return self.scale * d

    def merged_weight(self, w, xp=np, dtype=np.float64):
        """W' in `dtype` for the rows this part covers, given those rows of the base weight W; xp as delta_weight's
        (W an array of it)."""
        w = xp.asarray(w, dtype=dtype)
        v = w + self.delta_weight(xp, dtype)
        if self.kind == "dora":
            m = xp.asarray(np.asarray(self.tensors["dora_scale"], dtype=dtype)).reshape(-1, 1)
            v = v * (m / xp.linalg.norm(v, axis=1, keepdims=True))
        return v


def kind_of(suffixes, where=""):
    """Adapter kind from the set of tensor suffixes present for one module."""
    s = set(suffixes) - {"alpha"}
    if s <= set(_LORA) | {"dora_scale"} and set(_LORA) <= s:
        return "dora" if "dora_scale" in s else "lora"
    if s == set(_LOHA):
        return "loha"
    if "lokr_w1" in s and (s == {"lokr_w1", "lokr_w2"} or s == {"lokr_w1", "lokr_w2_a", "lokr_w2_b"}):
        return "lokr"
    raise AdapterFormatError(f"{where}: cannot tell the adapter kind from the keys {sorted(s)} (expected "
                             f"lora_down/lora_up [+ dora_scale], hada_w1_a/b + hada_w2_a/b, or lokr_w1 + lokr_w2 "
                             f"[_a/_b]; LoKr with a factorised w1 (lokr_w1_a/b) or Tucker (lokr_t2) is not supported)")


def alpha_value(value, where):
    """The float of a file's alpha: one finite value (0-d, or any one-element shape such as [1])."""
    a = np.asarray(value)
    if a.size != 1:
        raise AdapterFormatError(f"{where}: alpha has shape {fmt_shape(a.shape)}; one value expected")
    try:
        v = float(a.reshape(()).astype(np.float64))
    except (TypeError, ValueError):
        raise AdapterFormatError(f"{where}: alpha {a.reshape(())!r} is not a number") from None
    if not math.isfinite(v):
        raise AdapterFormatError(f"{where}: alpha is {v}, not a finite number")
    return v


def _ranked(a, b, where, ka, kb):
    """The rank that a (.., r) and b (r, ..) share; an error naming both keys when they disagree or it is 0."""
    if a.shape[1] != b.shape[0]:
        raise AdapterFormatError(f"{where}: {ka} {fmt_shape(a.shape)} and {kb} {fmt_shape(b.shape)} do not share "
                                 f"a rank ({a.shape[1]} != {b.shape[0]})")
    if a.shape[1] == 0:
        raise AdapterFormatError(f"{where}: {ka} {fmt_shape(a.shape)} and {kb} {fmt_shape(b.shape)} have rank 0")
    return a.shape[1]


def check_part(kind, tensors, where, key_names=None):
    """Refuse a part whose tensors do not form one `kind` adapter (dimensions, ranks) or hold non-finite values;
    `where` (the key prefix) and the key are named (`key_names`: the file's name of a suffix, e.g. PEFT's)."""
    def nm(suffix):
        return (key_names or {}).get(suffix, suffix)

    for k, v in tensors.items():
        v = np.asarray(v)
        if v.dtype.kind not in "fV":          # (V: bfloat16 / float8 from ml_dtypes)
            raise AdapterFormatError(f"{where}.{nm(k)}: dtype {v.dtype}; LoRA tensors are floating point")
        if 0 in v.shape:
            raise AdapterFormatError(f"{where}.{nm(k)}: shape {fmt_shape(v.shape)} is empty (rank 0?)")
        bad = v.size - int(np.count_nonzero(np.isfinite(v)))
        if bad:
            raise AdapterFormatError(f"{where}.{nm(k)}: {bad} of {v.size} values are not finite (NaN or inf)")
    t = {k: np.asarray(v) for k, v in tensors.items()}
    if kind in ("lora", "dora"):
        down, up = t["lora_down.weight"], t["lora_up.weight"]
        conv = down.ndim == 4 and (up.ndim == 2 or (up.ndim == 4 and up.shape[2:] == (1, 1)))
        if not (conv or (down.ndim == 2 and up.ndim == 2)):
            raise AdapterFormatError(f"{where}: {nm('lora_down.weight')} {fmt_shape(down.shape)} and "
                                     f"{nm('lora_up.weight')} {fmt_shape(up.shape)} do not form a LoRA (2-D (rank, "
                                     f"in) and (out, rank), or a convolution's (rank, in, kh, kw) and (out, rank, 1, "
                                     f"1))")
        _ranked(up, down, where, nm("lora_up.weight"), nm("lora_down.weight"))
        if kind == "dora":
            m = t["dora_scale"]
            if m.shape not in ((up.shape[0], 1), (up.shape[0],)):
                raise AdapterFormatError(f"{where}.{nm('dora_scale')}: shape {fmt_shape(m.shape)}, expected "
                                         f"({up.shape[0]}, 1) (one magnitude per output row; a decomposition over "
                                         f"the input dimension is not supported)")
        return
    bad2d = [k for k, v in t.items() if v.ndim != 2]
    if bad2d:
        raise AdapterFormatError(f"{where}: {', '.join(f'{k} {fmt_shape(t[k].shape)}' for k in bad2d)}: a {kind} "
                                 f"takes 2-D tensors (convolutions take LoRA only)")
    if kind == "loha":
        r1 = _ranked(t["hada_w1_a"], t["hada_w1_b"], where, "hada_w1_a", "hada_w1_b")
        r2 = _ranked(t["hada_w2_a"], t["hada_w2_b"], where, "hada_w2_a", "hada_w2_b")
        if r1 != r2 or t["hada_w1_a"].shape[0] != t["hada_w2_a"].shape[0] or \
                t["hada_w1_b"].shape[1] != t["hada_w2_b"].shape[1]:
            raise AdapterFormatError(f"{where}: the two Hadamard factors differ in shape: "
                                     + ", ".join(f"{k} {fmt_shape(t[k].shape)}" for k in _LOHA))
    elif "lokr_w2_a" in t:
        _ranked(t["lokr_w2_a"], t["lokr_w2_b"], where, "lokr_w2_a", "lokr_w2_b")


# ----------------------------------------------------------------------------- name maps
class NameMap:
    """FLAME module name <-> PEFT/diffusers names. `targets[module] = [(peft_name, [(lo, hi), ...]), ...]` lists, for
    each diffusers Linear carved out of the FLAME one, the FLAME output-row ranges it is made of, in order
    (several ranges = the rows are permuted, e.g. Flux's final adaLN whose two halves are swapped in diffusers).
    Modules not listed map to themselves. `peft_prefix`: the component PEFT files put in front of the names
    ("transformer." for diffusers' transformers, "unet." for SDXL's UNet)."""

    def __init__(self, targets=None, peft_prefix=PEFT_PREFIX):
        self.targets = dict(targets or {})
        self.peft_prefix = peft_prefix
        self._inverse = {}
        for mod, parts in self.targets.items():
            for peft_name, ranges in parts:
                self._inverse[peft_name] = (mod, [tuple(r) for r in ranges])

    def peft_targets(self, module, out_features=None):
        if module in self.targets:
            return self.targets[module]
        return [(module, None if out_features is None else [(0, out_features)])]

    def module_of(self, peft_name):
        """(module, ranges or None for the identity mapping)."""
        return self._inverse.get(peft_name, (peft_name, None))

    def out_features(self, module):
        parts = self.targets.get(module)
        return None if parts is None else max(hi for _, ranges in parts for _, hi in ranges)


IDENTITY = NameMap()


def kohya_name(module, prefix=KOHYA_PREFIX):
    return prefix + module.replace(".", "_")


# ----------------------------------------------------------------------------- kohya
def _check_one_scale(parts, module):
    scales = {round(p.scale, 12) for p in parts}
    return len(scales) == 1


def join_block_diagonal(parts, out_features, module, row_norms=None):
    """Several LoRA/DoRA parts over disjoint row ranges -> one whole-module part of rank Σr whose up is block
    diagonal: ΔW identical, which is how a file with one entry per module (kohya, ComfyUI) expresses them."""
    if any(p.kind not in ("lora", "dora") for p in parts):
        raise AdapterFormatError(f"{module}: only LoRA/DoRA adapters on part of a Linear can be written as one "
                                 f"kohya entry; got {[p.kind for p in parts]}")
    if len({p.kind for p in parts}) != 1:
        raise AdapterFormatError(f"{module}: parts mix LoRA and DoRA: {[p.kind for p in parts]}")
    parts = sorted(parts, key=lambda p: p.rows[0])
    ranks = [p.rank for p in parts]
    R = sum(ranks)
    same = _check_one_scale(parts, module)
    down = np.concatenate([np.asarray(p.tensors["lora_down.weight"]) for p in parts], axis=0)
    dt = np.asarray(parts[0].tensors["lora_up.weight"]).dtype
    up = np.zeros((out_features, R), dtype=dt)
    c = 0
    for p, r in zip(parts, ranks):
        lo, hi = p.rows
        blk = np.asarray(p.tensors["lora_up.weight"])
        up[lo:hi, c:c + r] = blk if same else (blk.astype(np.float64) * p.scale).astype(dt)
        c += r
    tensors = {"lora_down.weight": down, "lora_up.weight": up}
    alpha = parts[0].scale * R if same else float(R)
    if parts[0].kind == "dora":
        covered = np.zeros(out_features, dtype=bool)
        mag = np.zeros((out_features, 1), dtype=np.asarray(parts[0].tensors["dora_scale"]).dtype)
        for p in parts:
            lo, hi = p.rows
            mag[lo:hi] = np.asarray(p.tensors["dora_scale"]).reshape(-1, 1)
            covered[lo:hi] = True
        if not covered.all():
            if row_norms is None:
                raise AdapterFormatError(f"{module}: a DoRA on rows {[p.rows for p in parts]} of {out_features} "
                                         f"needs the base weight's row norms to fill dora_scale for the other rows")
            mag[~covered, 0] = np.asarray(row_norms, dtype=np.float64).reshape(-1)[~covered]
        tensors["dora_scale"] = mag
    return AdapterPart(parts[0].kind, tensors, alpha, None)


def to_kohya(modules, prefix=KOHYA_PREFIX, out_features=None, row_norms=None, dtype=None):
    """Canonical -> kohya state dict (name -> NumPy array). Segmented modules are joined block-diagonally
    (`out_features[module]` and, for a DoRA not covering every row, `row_norms[module]` are then needed)."""
    sd = {}
    for module, parts in modules.items():
        if len(parts) == 1 and parts[0].rows is None:
            part = parts[0]
        else:
            if out_features is None or module not in out_features:
                raise AdapterFormatError(f"{module}: segmented adapter; to_kohya needs out_features[{module!r}]")
            part = join_block_diagonal(parts, out_features[module], module,
                                       None if row_norms is None else row_norms.get(module))
        base = kohya_name(module, prefix)
        for k, v in part.tensors.items():
            v = np.asarray(v)
            sd[f"{base}.{k}"] = v.astype(dtype) if dtype is not None else v
        if part.alpha is not None:
            sd[f"{base}.alpha"] = np.asarray(part.alpha, dtype=np.float32)
    return sd


def from_kohya(sd, module_names, prefix=KOHYA_PREFIX):
    """kohya state dict -> canonical. `module_names`: the FLAME Linear names the file may refer to (an underscore
    in a kohya name may be a dot or a real underscore, so names are matched, not parsed)."""
    lookup = {kohya_name(m, prefix): m for m in module_names}
    grouped, unexpected = {}, []
    for key, v in sd.items():
        base, _, suffix = key.partition(".")
        if base not in lookup or suffix not in KOHYA_SUFFIXES:
            unexpected.append(key)
            continue
        grouped.setdefault(lookup[base], {})[suffix] = v
    if unexpected:
        raise AdapterFormatError(f"{len(unexpected)} key(s) match no module of the model (prefix {prefix!r}): "
                                 f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    out = {}
    for module, t in grouped.items():
        where = kohya_name(module, prefix)
        alpha = t.pop("alpha", None)
        kind = kind_of(t, where)
        t = {k: np.asarray(v) for k, v in t.items()}
        check_part(kind, t, where)
        out[module] = [AdapterPart(kind, t, None if alpha is None else alpha_value(alpha, where + ".alpha"), None)]
    return out


# ----------------------------------------------------------------------------- PEFT / diffusers
def _rows_of(arr, ranges):
    return np.concatenate([arr[lo:hi] for lo, hi in ranges], axis=0) if len(ranges) > 1 else arr[ranges[0][0]:
                                                                                                 ranges[0][1]]


def to_peft(modules, name_map=IDENTITY, prefix=PEFT_PREFIX, dtype=None):
    """Canonical -> PEFT/diffusers state dict, with s folded into lora_B. Returns (state_dict, alphas) where
    alphas[peft_name] = [kohya alpha or None, rank] lets FLAME's loader unfold exactly."""
    sd, alphas = {}, {}
    for module, parts in modules.items():
        for part in parts:
            if part.kind not in ("lora", "dora"):
                raise AdapterFormatError(f"{module}: {part.kind} adapters have no PEFT/diffusers layout; save them "
                                         f"in kohya format (ComfyUI reads LoKr/LoHa from it)")
            down = np.asarray(part.tensors["lora_down.weight"])
            up = np.asarray(part.tensors["lora_up.weight"])
            s = part.scale
            up_f = up if s == 1.0 else (up.astype(np.float64) * s).astype(up.dtype)
            mag = None if part.kind == "lora" else np.asarray(part.tensors["dora_scale"]).reshape(-1)
            targets = name_map.peft_targets(module)
            if part.rows is None:
                chosen = [(n, rg) for n, rg in targets]
            else:
                chosen = [(n, [(0, part.rows[1] - part.rows[0])]) for n, rg in targets
                          if rg is not None and [tuple(r) for r in rg] == [tuple(part.rows)]]
                if not chosen:
                    raise AdapterFormatError(f"{module}: rows {part.rows} are not one diffusers Linear "
                                             f"({[(n, rg) for n, rg in targets]})")
            for name, ranges in chosen:
                key = prefix + name
                sd[key + ".lora_A.weight"] = down
                sd[key + ".lora_B.weight"] = up_f if ranges is None else _rows_of(up_f, ranges)
                if mag is not None:
                    sd[key + ".lora_magnitude_vector"] = mag if ranges is None else _rows_of(mag, ranges)
                alphas[name] = [part.alpha, part.rank]
    if dtype is not None:
        sd = {k: v.astype(dtype) for k, v in sd.items()}
    return sd, alphas


_PEFT_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector", ".alpha")
PEFT_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY


def peft_config_of(meta, prefix=PEFT_PREFIX):
    """The PEFT LoraConfig fields diffusers stored for the component `prefix` names ("transformer."), or None."""
    raw = (meta or {}).get(PEFT_METADATA_KEY)
    if raw is None:
        return None
    try:
        packed = json.loads(raw)
    except ValueError as e:
        raise AdapterFormatError(f"metadata {PEFT_METADATA_KEY!r} is not JSON: {e}") from None
    if not isinstance(packed, dict):
        raise AdapterFormatError(f"metadata {PEFT_METADATA_KEY!r} is not a JSON object")
    comp = prefix.rstrip(".")
    config = {k[len(comp) + 1:]: v for k, v in packed.items() if comp and k.startswith(comp + ".")}
    if not comp and "r" in packed:
        config = packed
    if not config:
        return None
    if "r" not in config or "lora_alpha" not in config:
        raise AdapterFormatError(f"metadata {PEFT_METADATA_KEY!r} for {comp or 'the model'} lacks r / lora_alpha: "
                                 f"{sorted(config)[:12]}")
    if config.get("lora_bias"):
        raise AdapterFormatError("the LoRA has lora_bias=True (a bias on lora_B): not supported")
    where = f"metadata {PEFT_METADATA_KEY!r} ({comp or 'the model'})"
    _rank_value(config["r"], f"{where}: r")
    _alpha_number(config["lora_alpha"], f"{where}: lora_alpha")
    budget = _patterns.Budget()     # one bound for all of the file's patterns
    config["_rank_pattern"] = _compiled(config, "rank_pattern", where, budget, _rank_value)
    config["_alpha_pattern"] = _compiled(config, "alpha_pattern", where, budget, _alpha_number)
    return config


MAX_PATTERNS = 4096    # per rank_pattern / alpha_pattern (diffusers writes at most one per module)


def _rank_value(v, where):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise AdapterFormatError(f"{where}: a rank is a positive integer, got {v!r}")
    return v


def _alpha_number(v, where):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AdapterFormatError(f"{where}: an alpha is a finite number, got {v!r}")
    return v


def _compiled(config, field, where, budget, check_value):
    """[(SuffixPattern, value)] of a LoraConfig's rank_pattern / alpha_pattern; AdapterFormatError naming the
    pattern when one is refused (patterns.py) or its value is not a rank / alpha."""
    raw = config.get(field) or {}
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{where}: {field} is {type(raw).__name__}, not an object of pattern: value")
    if len(raw) > MAX_PATTERNS:
        raise AdapterFormatError(f"{where}: {field} has {len(raw)} patterns, more than {MAX_PATTERNS}")
    out = []
    for key, value in raw.items():
        try:
            out.append((_patterns.SuffixPattern(key, budget), check_value(value, f"{where}: {field}[{key!r}]")))
        except _patterns.PatternError as e:
            raise AdapterFormatError(f"{where}: {field} pattern {_short(key)}: {e}") from None
    return out


def _short(key, n=80):
    return repr(key) if len(key) <= n else repr(key[:n]) + f"... ({len(key)} characters)"


def _pattern_value(compiled, name, default, field):
    """PEFT's get_pattern_key: the value of the first pattern that matches `name` or a dotted suffix of it."""
    for pattern, value in compiled:
        try:
            if pattern.matches(name):
                return value
        except _patterns.PatternError as e:
            raise AdapterFormatError(f"metadata {PEFT_METADATA_KEY!r}: {field} pattern {_short(pattern.key)} "
                                     f"against {name!r}: {e}") from None
    return default


def _alpha_from_config(config, name, rank, where, has_magnitude):
    """The kohya alpha (s·rank) of module `name` under a PEFT LoraConfig, after checking the file agrees with it."""
    want_rank = _pattern_value(config["_rank_pattern"], name, config["r"], "rank_pattern")
    if int(want_rank) != rank:
        raise AdapterFormatError(f"{where}: lora_A has rank {rank} but the file's LoraConfig gives {name} rank "
                                 f"{want_rank} (r={config['r']}, rank_pattern={config.get('rank_pattern')})")
    if bool(config.get("use_dora")) != has_magnitude:
        raise AdapterFormatError(f"{where}: the file's LoraConfig has use_dora={bool(config.get('use_dora'))} but "
                                 f"this module {'has' if has_magnitude else 'has no'} lora_magnitude_vector")
    alpha = float(_pattern_value(config["_alpha_pattern"], name, config["lora_alpha"], "alpha_pattern"))
    s = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return s * rank


_PEFT_KEY_NAMES = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
                   "dora_scale": "lora_magnitude_vector"}


def from_peft(sd, name_map=IDENTITY, prefix=PEFT_PREFIX, alphas=None, peft_config=None, module_names=None):
    """PEFT/diffusers state dict -> canonical: one part per diffusers Linear (rows = its FLAME rows). Parts whose rows
    are permuted (several ranges) are put back in FLAME row order. `alphas` (from FLAME's metadata) unfolds s;
    `peft_config` (`peft_config_of(metadata)`) gives s as PEFT computes it. module_names: when given, adapters on
    other modules are refused before any pattern is matched against their names."""
    grouped, unexpected = {}, []
    for key, v in sd.items():
        suffix = next((s for s in _PEFT_SUFFIXES if key.endswith(s)), None)
        if suffix is None or not key.startswith(prefix):
            unexpected.append(key)
            continue
        grouped.setdefault(key[len(prefix):-len(suffix)], {})[suffix] = np.asarray(v)
    if unexpected:
        raise AdapterFormatError(f"{len(unexpected)} key(s) are not PEFT LoRA keys under {prefix!r}: "
                                 f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if module_names is not None:
        known = set(module_names)
        unknown = [prefix + n for n in grouped if name_map.module_of(n)[0] not in known]
        if unknown:
            raise AdapterFormatError(f"{len(unknown)} adapter(s) name no module of the model: {unknown[:8]}")
    out = {}
    for name, t in grouped.items():
        if ".lora_A.weight" not in t or ".lora_B.weight" not in t:
            raise AdapterFormatError(f"{prefix}{name}: needs both lora_A.weight and lora_B.weight, found "
                                     f"{sorted(t)}")
        module, ranges = name_map.module_of(name)
        down, up = t[".lora_A.weight"], t[".lora_B.weight"]
        mag = t.get(".lora_magnitude_vector")
        check_part("lora" if mag is None else "dora",
                   {"lora_down.weight": down, "lora_up.weight": up, **({} if mag is None else {"dora_scale": mag})},
                   prefix + name, _PEFT_KEY_NAMES)
        if down.ndim == 4 and up.ndim == 2:
            raise AdapterFormatError(f"{prefix}{name}: lora_A {fmt_shape(down.shape)} is a convolution's but "
                                     f"lora_B {fmt_shape(up.shape)} is not (PEFT writes (out, rank, 1, 1))")
        alpha = alpha_value(t[".alpha"], f"{prefix}{name}.alpha") if ".alpha" in t else None
        if alphas is not None and name in alphas and ".alpha" not in t:
            alpha, rank = _recorded_alpha(alphas[name], f"{prefix}{name}", down.shape[0])
            s = 1.0 if alpha is None else float(alpha) / rank
            if s != 1.0:
                up = (up.astype(np.float64) / s).astype(up.dtype)
        elif peft_config is not None and ".alpha" not in t:
            alpha = _alpha_from_config(peft_config, name, down.shape[0], prefix + name, mag is not None)
        rows = None
        if ranges is not None:
            n = sum(hi - lo for lo, hi in ranges)
            if up.shape[0] != n:
                raise AdapterFormatError(f"{prefix}{name}: lora_B has {up.shape[0]} rows, the model's "
                                         f"{name} has {n}")
            if len(ranges) == 1:
                rows = tuple(ranges[0])
            else:  # a permutation of whole-module rows: undo it
                order = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
                inv = np.argsort(order)
                up = up[inv]
                mag = None if mag is None else mag[inv]
                rows = (0, n)
        tensors = {"lora_down.weight": down, "lora_up.weight": up}
        if mag is not None:
            tensors["dora_scale"] = mag.reshape(-1, 1)
        out.setdefault(module, []).append(AdapterPart("dora" if mag is not None else "lora", tensors, alpha, rows))
    for module, parts in out.items():
        parts.sort(key=lambda p: (p.rows or (0, 0))[0])
        full = name_map.out_features(module)
        if len(parts) == 1 and parts[0].rows is not None and full is not None and parts[0].rows == (0, full):
            parts[0].rows = None
    return out


def _recorded_alpha(entry, where, rank):
    """(alpha or None, rank) FLAME recorded for one module in its metadata (flame.alphas), checked: s = alpha / rank
    was folded into lora_B, so alpha 0 or another rank than the tensors' cannot be unfolded."""
    ok = isinstance(entry, list) and len(entry) == 2 and (entry[0] is None or (
        not isinstance(entry[0], bool) and isinstance(entry[0], (int, float)) and math.isfinite(entry[0])
        and entry[0] != 0)) and entry[1] == rank and not isinstance(entry[1], bool)
    if not ok:
        raise AdapterFormatError(f"{where}: the metadata flame.alphas entry {entry!r} is not [alpha (finite, not 0) "
                                 f"or null, rank {rank}]")
    return entry[0], rank


def _recorded_alphas(meta, key):
    """The metadata's flame.alphas[.component] object, or None."""
    if key not in meta:
        return None
    try:
        alphas = json.loads(meta[key])
    except ValueError as e:
        raise AdapterFormatError(f"metadata {key!r} is not JSON: {e}") from None
    if not isinstance(alphas, dict):
        raise AdapterFormatError(f"metadata {key!r} is not a JSON object")
    return alphas


# ----------------------------------------------------------------------------- fitting a file to a model's adapters
def join_equal_downs(parts, out_features, module):
    """Parts that share one down (a split of a whole-module LoRA) and tile all rows -> one whole-module part."""
    parts = sorted(parts, key=lambda p: p.rows[0])
    first = parts[0]
    ok = (all(p.kind == first.kind and p.kind in ("lora", "dora") for p in parts)
          and all(np.array_equal(p.tensors["lora_down.weight"], first.tensors["lora_down.weight"]) for p in parts)
          and _check_one_scale(parts, module)
          and parts[0].rows[0] == 0 and parts[-1].rows[1] == out_features
          and all(a.rows[1] == b.rows[0] for a, b in zip(parts, parts[1:])))
    if not ok:
        raise AdapterFormatError(f"{module}: the file has separate adapters on rows {[p.rows for p in parts]} "
                                 f"(different lora_A or scales) but the model has one adapter on the whole Linear; "
                                 f"inject with matching targets (e.g. the diffusers names) to load it")
    tensors = {"lora_down.weight": first.tensors["lora_down.weight"],
               "lora_up.weight": np.concatenate([p.tensors["lora_up.weight"] for p in parts], axis=0)}
    if first.kind == "dora":
        tensors["dora_scale"] = np.concatenate([p.tensors["dora_scale"] for p in parts], axis=0)
    return AdapterPart(first.kind, tensors, first.alpha, None)


def split_block_diagonal(part, dest_rows, dest_ranks, module):
    """Inverse of join_block_diagonal: a whole-module LoRA/DoRA whose up is block diagonal -> one part per
    destination row range (rank dest_ranks[i]). Raises when the blocks off the diagonal are not zero."""
    if part.kind not in ("lora", "dora"):
        raise AdapterFormatError(f"{module}: a {part.kind} adapter cannot be split over rows {dest_rows}")
    down = np.asarray(part.tensors["lora_down.weight"])
    up = np.asarray(part.tensors["lora_up.weight"])
    if down.shape[0] != sum(dest_ranks):
        raise AdapterFormatError(f"{module}: the file's adapter has rank {down.shape[0]}, the model's parts on rows "
                                 f"{dest_rows} have ranks {dest_ranks} (sum {sum(dest_ranks)})")
    mask = np.zeros(up.shape, dtype=bool)
    c, out = 0, []
    s = part.scale
    for (lo, hi), r in zip(dest_rows, dest_ranks):
        mask[lo:hi, c:c + r] = True
        t = {"lora_down.weight": down[c:c + r], "lora_up.weight": up[lo:hi, c:c + r]}
        if part.kind == "dora":
            t["dora_scale"] = np.asarray(part.tensors["dora_scale"]).reshape(-1, 1)[lo:hi]
        out.append(AdapterPart(part.kind, t, s * r, (lo, hi)))
        c += r
    if np.any(up[~mask] != 0):
        raise AdapterFormatError(f"{module}: lora_up is not block diagonal over rows {dest_rows}; it cannot be "
                                 f"loaded into separate adapters on those rows")
    return out


def fit_parts(file_parts, dest, module, out_features):
    """Arrange a file's parts for one module like the model's adapters. `dest`: [(rows or None, rank)], one per
    model part. Returns parts in the order of `dest`."""
    dest_rows = [r for r, _ in dest]
    file_rows = [p.rows for p in file_parts]
    if sorted(file_rows, key=lambda r: (r or (0, 0))[0]) == sorted(dest_rows, key=lambda r: (r or (0, 0))[0]):
        by_rows = {p.rows: p for p in file_parts}
        return [by_rows[r] for r in dest_rows]
    if dest_rows == [None]:
        return [join_equal_downs(file_parts, out_features, module)]
    if file_rows == [None] and None not in dest_rows:
        return split_block_diagonal(file_parts[0], dest_rows, [r for _, r in dest], module)
    raise AdapterFormatError(f"{module}: the file adapts rows {file_rows}, the model's adapter rows {dest_rows} "
                             f"(None = whole Linear)")


# ----------------------------------------------------------------------------- files
def detect_format(keys):
    keys = list(keys)
    if any(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys):
        return "peft"
    if any(k.split(".")[-1] in KOHYA_SUFFIXES or k.endswith(("lora_up.weight", "lora_down.weight"))
           for k in keys):
        return "kohya"
    raise AdapterFormatError(f"not a LoRA file: none of its {len(keys)} keys look like kohya (lora_up/lora_down, "
                             f"lokr_*, hada_*) or PEFT (lora_A/lora_B) keys; first keys: {keys[:5]}")


def save(path, modules, format="kohya", *, name_map=IDENTITY, out_features=None, row_norms=None, dtype=None,
         metadata=None, components=None):
    """Write canonical adapters to a .safetensors file (atomically) in `format` 'kohya' or 'peft'. components:
    {'te1' | 'te2' | 'te3': canonical adapters of that text encoder (its own module names)} written beside the
    denoiser's under kohya's lora_te1_ / lora_te2_ / lora_te3_ or diffusers' text_encoder. / text_encoder_2. /
    text_encoder_3. (load(component=...) reads
    them back; in PEFT files their alphas are recorded under the metadata key flame.alphas.<component>)."""
    meta = {"format": "pt", "flame.format": format}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    if format not in ("kohya", "peft"):
        raise AdapterFormatError(f"unknown LoRA file format {format!r}; use 'kohya' or 'peft'")
    bad = [c for c in (components or {}) if c not in TEXT_ENCODER_PREFIXES]
    if bad:
        raise AdapterFormatError(f"components must be text encoders ({', '.join(TEXT_ENCODER_PREFIXES)}), got {bad}")
    if format == "kohya":
        sd = to_kohya(modules, out_features=out_features, row_norms=row_norms, dtype=dtype)
        for comp, mods in (components or {}).items():
            sd.update(to_kohya(mods, prefix=TEXT_ENCODER_PREFIXES[comp][0], dtype=dtype))
    else:
        sd, alphas = to_peft(modules, name_map, prefix=name_map.peft_prefix, dtype=dtype)
        meta["flame.alphas"] = json.dumps(alphas, sort_keys=True)
        for comp, mods in (components or {}).items():
            part, alphas = to_peft(mods, IDENTITY, prefix=TEXT_ENCODER_PREFIXES[comp][-1], dtype=dtype)
            sd.update(part)
            meta[f"flame.alphas.{comp}"] = json.dumps(alphas, sort_keys=True)
    sd = {k: np.require(v, requirements="C") for k, v in sd.items()}  # (ascontiguousarray makes 0-d 1-d)
    _io.save_file(sd, path, metadata=meta)
    return path


# The text encoders' parts of a LoRA file (kohya's lora_te1_ / lora_te2_ / lora_te3_, lora_te_ for a single one;
# diffusers' text_encoder. / text_encoder_2. / text_encoder_3.); every other key belongs to the denoiser. Which model
# a part is depends on the family: SDXL te1 CLIP-L, te2 CLIP-G; SD3 te1 CLIP-L, te2 CLIP-G, te3 T5; Flux te1 CLIP-L
# and T5 as te3 (kohya's lora_te3_) or te2 (diffusers' text_encoder_2.).
TEXT_ENCODER_PREFIXES = {"te1": ("lora_te1_", "lora_te_", "text_encoder."), "te2": ("lora_te2_", "text_encoder_2."),
                         "te3": ("lora_te3_", "text_encoder_3.")}
COMPONENTS = ("denoiser", "te1", "te2", "te3")


def component_of(key):
    """'te1', 'te2', 'te3' or 'denoiser': the model of a multi-model LoRA file that `key` adapts."""
    for comp, prefixes in TEXT_ENCODER_PREFIXES.items():
        if key.startswith(prefixes):
            return comp
    return "denoiser"


def load(path, module_names, *, name_map=IDENTITY, component="denoiser"):
    """Read a kohya or PEFT file -> (canonical adapters, metadata dict). Keys are checked against `module_names`.
    component: the part of the file to read -- 'denoiser' (the transformer / UNet: every key not of a text
    encoder), 'te1', 'te2' or 'te3' (a text encoder's: kohya lora_te1_ / lora_te2_ / lora_te3_, PEFT text_encoder. /
    text_encoder_2. / text_encoder_3.; its module names are the encoder's own, e.g.
    text_model.encoder.layers.0.self_attn.q_proj or T5's encoder.block.0.layer.0.SelfAttention.q)."""
    if component not in COMPONENTS:
        raise AdapterFormatError(f"component must be one of {', '.join(COMPONENTS)}, got {component!r}")
    with _io.safe_open(path) as f:
        sd = {k: f.get_array(k) for k in f.keys() if component_of(k) == component}
        meta = f.metadata() or {}
    if not sd:
        return {}, meta
    try:
        return _parse(sd, meta, list(module_names), name_map, component), meta
    except AdapterFormatError as e:
        raise AdapterFormatError(f"{path}: {e}") from None


def peft_source(keys, meta, component="denoiser"):
    """(prefix, FLAME's recorded alphas, the PEFT LoraConfig) of a PEFT file's `component` keys: what from_peft takes
    besides the tensors."""
    if component == "denoiser":
        prefix = next((p for p in PEFT_PREFIXES if all(k.startswith(p) for k in keys)), "")
        alphas = _recorded_alphas(meta, "flame.alphas")
    else:
        prefix = TEXT_ENCODER_PREFIXES[component][-1]
        alphas = _recorded_alphas(meta, f"flame.alphas.{component}")
    return prefix, alphas, peft_config_of(meta, prefix)


def _parse(sd, meta, module_names, name_map, component):
    fmt = detect_format(sd)
    if fmt == "kohya":
        kohya = TEXT_ENCODER_PREFIXES[component][:-1] if component != "denoiser" else KOHYA_PREFIXES
        prefix = next((p for p in kohya if any(k.startswith(p) for k in sd)), kohya[0])
        return from_kohya(sd, module_names, prefix)
    prefix, alphas, config = peft_source(sd, meta, component)
    return from_peft(sd, name_map if component == "denoiser" else IDENTITY, prefix, alphas, config, module_names)


def describe(modules):
    """(kind, rank, alpha) of the adapters: the most common ones (for file metadata)."""
    kinds = [p.kind for parts in modules.values() for p in parts]
    ranks = [p.rank for parts in modules.values() for p in parts if p.rank is not None]
    alphas = [p.alpha for parts in modules.values() for p in parts if p.alpha is not None]
    pick = (lambda xs: max(set(xs), key=xs.count) if xs else None)
    return pick(kinds), pick(ranks), pick(alphas)

