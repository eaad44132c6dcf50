"""Resizing a LoRA file: each adapter's product ΔW = up·down brought to a lower rank by its SVD, as kohya's
networks/resize_lora.py does, for kohya / LyCORIS files (lora_down / lora_up / alpha; LoCon convolutions too) and
PEFT / diffusers files (lora_A / lora_B and their scale metadata), every component (denoiser, text encoders).

    ΔW / s = up·down = U S Vh  ->  up' = U[:, :k] S[:k],  down' = Vh[:k]      (the best rank-k approximation)

The scale s = alpha / rank is kept: a kohya file gets alpha' = s·k (kohya's rule); a PEFT file gets s folded into
lora_B and no scale metadata, so every reader (diffusers: alpha = rank when a file has none; FLAME) takes s = 1.
The SVD is exact and cheap: QR of each factor, then the SVD of the small r x r core (no out x in matrix is formed),
in float64 on the host.

The new rank k (at most `rank`, and never above the adapter's own rank: resizing only goes down):
    None            k = rank
    "sv_ratio"      the singular values above S[0] / param                       (param > 1, e.g. 8)
    "sv_cumulative" the fewest leading values whose sum reaches param of the total   (0 < param <= 1)
    "sv_fro"        the fewest leading values keeping param of the Frobenius norm    (0 < param <= 1)
(kohya's three dynamic methods and their rounding; a product with S[0] <= MIN_SV is a zero matrix: rank 1).
Convolutions (LoCon) take `conv_rank` (default `rank`). DoRA, LoKr and LoHa adapters are refused (their products
are not a low-rank up·down); so are keys that are not a LoRA's.

Run: python -m flame_nn.adapters.resize IN.safetensors OUT.safetensors --rank 16 [--conv-rank 8]
     [--method sv_fro --param 0.95] [--dtype bfloat16] [--verbose]
"""
import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass

import numpy as np

from flame_core import dtypes as D
from flame_core import io as _io

from . import formats as F

METHODS = ("sv_ratio", "sv_cumulative", "sv_fro")
MIN_SV = 1e-6
SCALE_METADATA = ("lora_adapter_metadata", "flame.alphas", "flame.alphas.te1", "flame.alphas.te2",
                  "flame.alphas.te3")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": D.bfloat16.np}
_KOHYA_LORA = ("lora_down.weight", "lora_up.weight", "alpha")


class ResizeError(F.AdapterFormatError):
    """A LoRA file or option resize cannot take (the message names the key or option)."""


def factor_svd(up, down):
    """(U, S, Vh) of up·down -- up (out, r[, 1, 1]), down (r, in[, kh, kw]) -- without forming it: U (out, k), S (k,)
    decreasing, Vh (k, in·kh·kw), k = min(out, r, in·kh·kw); float64."""
    u2 = np.asarray(up, dtype=np.float64).reshape(up.shape[0], -1)
    d2 = np.asarray(down, dtype=np.float64).reshape(down.shape[0], -1)
    qu, ru = np.linalg.qr(u2)            # (out, a), (a, r)
    qd, rd = np.linalg.qr(d2.T)          # (in, b), (b, r)
    um, s, vmh = np.linalg.svd(ru @ rd.T, full_matrices=False)
    return qu @ um, s, vmh @ qd.T


def new_rank(s, rank, method=None, param=None):
    """The rank kept of singular values `s` (decreasing): `method`'s choice (module docstring), at most `rank` and
    len(s); 1 for a zero product."""
    n = len(s)
    if n == 0 or s[0] <= MIN_SV:    # a zero product
        return 1
    if method is None:
        k = rank
    elif method == "sv_ratio":
        k = int(np.sum(s > s[0] / param))
    elif method == "sv_cumulative":
        k = int(np.searchsorted(np.cumsum(s) / np.sum(s), param)) + 1
    elif method == "sv_fro":
        sq = s * s
        k = int(np.searchsorted(np.cumsum(sq) / np.sum(sq), param * param)) + 1
    else:
        raise ResizeError(f"method: one of {', '.join(METHODS)} or None, got {method!r}")
    return max(1, min(k, rank, n))


def check_options(rank, conv_rank, method, param, dtype=None):
    """A ResizeError naming the first bad option (rank None: no resizing, for merge)."""
    if dtype is not None and dtype not in DTYPES:
        raise ResizeError(f"dtype: one of {', '.join(DTYPES)}, got {dtype!r}")
    for name, v in (("rank", rank), ("conv_rank", conv_rank)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ResizeError(f"{name}: a positive int, got {v!r}")
    if method is None:
        if param is not None:
            raise ResizeError(f"param {param!r} without a method (one of {', '.join(METHODS)})")
        return
    if method not in METHODS:
        raise ResizeError(f"method: one of {', '.join(METHODS)}, got {method!r}")
    if param is None or isinstance(param, bool) or not isinstance(param, (int, float)) or not np.isfinite(param):
        raise ResizeError(f"method {method} needs a number param, got {param!r}")
    if method == "sv_ratio" and not param > 1:
        raise ResizeError(f"param: sv_ratio keeps the singular values above S[0] / param: param > 1, got {param}")
    if method != "sv_ratio" and not 0 < param <= 1:
        raise ResizeError(f"param: {method} keeps a fraction 0 < param <= 1, got {param}")


def resize_pair(up, down, rank, method=None, param=None):
    """(up', down', k, kept): the rank-k factors of up·down (up' = U S, down' = Vh, in up's and down's layouts);
    kept = the fraction of its Frobenius norm they keep."""
    u, s, vh = factor_svd(up, down)
    k = new_rank(s, rank, method, param)
    total = float(np.sqrt(np.sum(s * s)))
    kept = float(np.sqrt(np.sum(s[:k] * s[:k]))) / total if total > 0 else 1.0
    new_up = (u[:, :k] * s[:k]).reshape((up.shape[0], k) + up.shape[2:])
    new_down = vh[:k].reshape((k,) + down.shape[1:])
    return new_up, new_down, k, kept


@dataclass
class Pair:
    """One LoRA of a file: ΔW = scale·up·down; stem: its keys' common prefix (kohya `lora_unet_x`, PEFT
    `transformer.x`); alpha_dtype: the dtype of a kohya file's alpha (None: it had none)."""
    up: np.ndarray
    down: np.ndarray
    scale: float
    alpha_dtype: object = None


def _kohya_pairs(sd):
    stems = {}
    for key, v in sd.items():
        stem, _, suffix = key.partition(".")
        if suffix not in _KOHYA_LORA:
            what = ("a DoRA magnitude" if suffix == "dora_scale" else "a LoKr / LoHa factor"
                    if suffix.startswith(("lokr_", "hada_")) else "not a LoRA key")
            raise ResizeError(f"{key}: {what}; only LoRA / LoCon adapters (lora_down / lora_up / alpha) are taken")
        stems.setdefault(stem, {})[suffix] = v
    pairs = {}
    for stem, t in stems.items():
        if "lora_down.weight" not in t or "lora_up.weight" not in t:
            raise ResizeError(f"{stem}: needs lora_down.weight and lora_up.weight, found {sorted(t)}")
        tensors = {k: np.asarray(t[k]) for k in ("lora_down.weight", "lora_up.weight")}
        F.check_part("lora", tensors, stem)
        down, up = tensors["lora_down.weight"], tensors["lora_up.weight"]
        alpha = F.alpha_value(t["alpha"], f"{stem}.alpha") if "alpha" in t else None
        pairs[stem] = Pair(up, down, 1.0 if alpha is None else alpha / down.shape[0],
                           np.asarray(t["alpha"]).dtype if "alpha" in t else None)
    return pairs


def _peft_pairs(sd, meta, component):
    prefix, alphas, config = F.peft_source(sd, meta, component)
    names = sorted({k[len(prefix):].rsplit(".lora_", 1)[0] for k in sd if k.startswith(prefix) and ".lora_" in k})
    modules = F.from_peft(sd, F.IDENTITY, prefix, alphas, config, names)
    pairs = {}
    for name, (part,) in modules.items():
        if part.kind != "lora":
            raise ResizeError(f"{prefix}{name}: a DoRA adapter (lora_magnitude_vector); only LoRA / LoCon adapters "
                              f"are taken")
        down, up = part.tensors["lora_down.weight"], part.tensors["lora_up.weight"]
        pairs[prefix + name] = Pair(up, down, 1.0 if part.alpha is None else part.alpha / down.shape[0])
    return pairs


def read_pairs(path):
    """(format 'kohya' | 'peft', metadata, {stem: Pair}) of a LoRA file, every component; checked as untrusted
    (shapes, finite values, alphas), errors naming the file and key."""
    with _io.safe_open(path) as f:
        meta = dict(f.metadata() or {})
        keys = list(f.keys())
        if not keys:
            raise ResizeError(f"{path}: holds no tensors")
        fmt = F.detect_format(keys)
        groups = {}
        for k in keys:
            groups.setdefault(F.component_of(k), {})[k] = f.get_array(k)
    pairs = {}
    try:
        for component, sd in groups.items():
            pairs.update(_kohya_pairs(sd) if fmt == "kohya" else _peft_pairs(sd, meta, component))
    except F.AdapterFormatError as e:
        raise ResizeError(f"{path}: {e}") from None
    return fmt, meta, pairs


def write_pair(out, fmt, stem, up, down, scale, up_dtype, down_dtype, alpha_dtype=None):
    """The keys of ΔW = scale·up·down in `fmt` into `out`, up and down (float64) rounded once to their dtypes:
    kohya keeps up and down and writes alpha = scale·rank (in alpha_dtype, default up's); PEFT folds scale into
    lora_B."""
    k = down.shape[0]
    if fmt == "kohya":
        out[f"{stem}.lora_down.weight"] = down.astype(down_dtype)
        out[f"{stem}.lora_up.weight"] = up.astype(up_dtype)
        out[f"{stem}.alpha"] = np.asarray(scale * k, dtype=np.float64).astype(alpha_dtype or up_dtype)
    else:
        out[f"{stem}.lora_A.weight"] = down.astype(down_dtype)
        out[f"{stem}.lora_B.weight"] = (np.asarray(up, np.float64) * scale).astype(up_dtype)


def out_dtypes(dtype, *like):
    """The dtypes to write: `dtype` ('float32' | 'float16' | 'bfloat16') for all, else each of `like`'s own."""
    return [np.dtype(DTYPES[dtype]) if dtype is not None else np.asarray(a).dtype for a in like]


def resize_file(src, dst, rank, *, conv_rank=None, method=None, param=None, dtype=None, progress=False):
    """Write `src`'s LoRA resized (module docstring) to `dst` (atomically; it may be `src`). Returns a list of
    (adapter, old rank, new rank, Frobenius norm kept, new alpha or None for PEFT). dtype: 'float32' | 'float16' |
    'bfloat16' for the new tensors (default: each tensor's own)."""
    check_options(rank, conv_rank, method, param, dtype)
    fmt, meta, pairs = read_pairs(src)
    report, out = [], {}
    for stem, p in (progress_bar if progress else (lambda items, desc: items))(sorted(pairs.items()), "resizing"):
        cap = (conv_rank or rank) if p.down.ndim == 4 else rank
        up, down, k, kept = resize_pair(p.up, p.down, cap, method, param)
        write_pair(out, fmt, stem, up, down, p.scale, *out_dtypes(dtype, p.up, p.down),
                   p.alpha_dtype if dtype is None else None)
        report.append((stem, p.down.shape[0], k, kept, p.scale * k if fmt == "kohya" else None))
    for key in SCALE_METADATA if fmt == "peft" else ():
        meta.pop(key, None)
    ranks = Counter(k for _, _, k, _, _ in report)
    dynamic = method is not None and len(ranks) > 1
    summary = {"from": Counter(r for _, r, _, _, _ in report).most_common(1)[0][0],
               "to": "dynamic" if dynamic else ranks.most_common(1)[0][0], "method": method, "param": param}
    meta["flame.resized"] = json.dumps(summary, sort_keys=True)
    if "ss_network_dim" in meta:
        alphas = Counter(a for _, _, _, _, a in report if a is not None)
        meta["ss_network_dim"] = "Dynamic" if dynamic else str(summary["to"])
        meta["ss_network_alpha"] = ("Dynamic" if dynamic or len(alphas) != 1 else
                                    f"{alphas.most_common(1)[0][0]:g}")
    _io.save_file(out, dst, metadata=meta)
    return report


def parse_source(text):
    """'path' or 'path:weight' -> (path, weight): the weight is the text after the last ':' when it is a number
    (a colon whose tail is not one belongs to the path: C:\\loras\\a.safetensors); weight 1.0 when absent. The
    callers refuse a weight that is not finite."""
    path, sep, w = text.rpartition(":")
    if sep and path:
        try:
            return path, float(w)
        except ValueError:
            pass
    return text, 1.0


def check_weights(loras):
    """Refuse a LoRA weight that is not a finite number, naming its file ([(path, weight)])."""
    for path, w in loras:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w):
            raise ResizeError(f"{path}: the weight {w!r} is not a finite number")


def progress_bar(items, desc):
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, unit="adapter")


def add_rank_arguments(ap, rank_help, dtype_help, required=True):
    """The rank options the LoRA tools share (resize, merge, extract)."""
    ap.add_argument("--rank", type=int, required=required, help=rank_help)
    ap.add_argument("--conv-rank", type=int, help="the rank of convolution (LoCon) adapters (default --rank)")
    ap.add_argument("--method", choices=METHODS, help="choose each adapter's rank from its singular values")
    ap.add_argument("--param", type=float, help="sv_ratio: > 1 (e.g. 8); sv_cumulative / sv_fro: 0-1 (e.g. 0.9)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), help=dtype_help)


def run_command(ap, dst, work):
    """`work()`'s result for a tool writing `dst` (a .safetensors name, else the usage error); a ResizeError or
    OSError is printed as 'error: ...' on stderr and gives None (the command exits 2)."""
    if not dst.endswith(".safetensors"):
        ap.error(f"dst: a .safetensors file, got {dst!r}")
    try:
        return work()
    except (ResizeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flame_nn.adapters.resize",
                                 description="Resize a LoRA file to a lower rank by SVD (kohya's resize_lora).")
    ap.add_argument("src", help="the LoRA file (.safetensors: kohya / LyCORIS or PEFT / diffusers keys)")
    ap.add_argument("dst", help="the resized file to write (.safetensors)")
    add_rank_arguments(ap, "the new rank (with --method: the most kept)",
                       "the new tensors' dtype (default: the file's)")
    ap.add_argument("--verbose", action="store_true", help="one line per adapter")
    args = ap.parse_args(argv)
    report = run_command(ap, args.dst, lambda: resize_file(
        args.src, args.dst, args.rank, conv_rank=args.conv_rank, method=args.method, param=args.param,
        dtype=args.dtype, progress=True))
    if report is None:
        return 2
    if args.verbose:
        for name, r, k, kept, _ in report:
            print(f"{name:80s} rank {r} -> {k}, Frobenius norm kept {kept:.1%}")
    kept = [x[3] for x in report]
    print(f"{len(report)} adapters, rank {Counter(r for _, r, _, _, _ in report).most_common(1)[0][0]} -> "
          f"{'/'.join(str(k) for k, _ in Counter(x[2] for x in report).most_common(3))}; Frobenius norm kept: mean "
          f"{np.mean(kept):.2%}, min {np.min(kept):.2%}; wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
