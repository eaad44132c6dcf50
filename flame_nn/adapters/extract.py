"""Extracting a LoRA from two checkpoints of one model (kohya's networks/extract_lora_from_models.py, ai-toolkit's
extract job): for every Linear / Conv2d weight the two hold in the same shape, ΔW = tuned - base brought to rank k by
its SVD, written as a LoRA (scale 1: kohya alpha = k; PEFT none) that turns the base into (an approximation of) the
tuned model.

    ΔW = U S Vh  ->  up = U[:, :k] S[:k],  down = Vh[:k]        (convolutions: ΔW reshaped to (out, in·kh·kw))

The SVD is randomized for large matrices (Halko et al.: a Gaussian sketch of k + 16 columns, two power iterations,
then the exact SVD of the small projection) -- the leading singular values to a relative ~1e-6 on a decaying
spectrum, as torch.svd_lowrank does for kohya; small matrices take the exact SVD. `method` / `param` choose k per
weight from its singular values (resize.new_rank: sv_ratio, sv_cumulative, sv_fro), at most `rank`.

Names: the checkpoint's own keys without ".weight" -- kohya: `lora_unet_` + the name with "." -> "_" (what ComfyUI
reads for BFL-layout Flux files, `double_blocks.0.img_attn.qkv`), PEFT: `transformer.` + the name (diffusers-layout
files, `transformer_blocks.0.attn.to_q`; `--prefix unet.` for an SDXL UNet). Weights equal in both (max |ΔW| <=
`min_diff`), 1-D weights (norms, biases) and keys only one file has are left out and counted. A checkpoint is a
.safetensors file or a folder of them (diffusers' shards); files are untrusted: shapes compared before any weight is
read, a key that two shards both hold is refused.

Run: python -m flame_nn.adapters.extract BASE TUNED OUT.safetensors --rank 32 [--conv-rank 16]
     [--method sv_fro --param 0.95] [--format kohya|peft] [--prefix ...] [--min-diff 1e-6] [--dtype bfloat16]
"""
import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

from flame_core import io as _io

from .resize import (
    DTYPES,
    ResizeError,
    add_rank_arguments,
    check_options,
    new_rank,
    progress_bar,
    run_command,
    write_pair,
)

FORMATS = {"kohya": "lora_unet_", "peft": "transformer."}
OVERSAMPLE, POWER_ITERS = 16, 2


class _Checkpoint:
    """The tensors of a .safetensors file or a folder of them (key -> open reader)."""

    def __init__(self, path):
        path = os.fspath(path)
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise ResizeError(f"{path}: a folder without .safetensors files")
        elif os.path.isfile(path):
            files = [path]
        else:
            raise ResizeError(f"{path} does not exist")
        self.path, self.readers, self.where = path, [], {}
        try:
            for f in files:
                r = _io.safe_open(f)
                self.readers.append(r)
                for k in r.keys():
                    if k in self.where:
                        raise ResizeError(f"{k}: in both {self.where[k].filename} and {f}")
                    self.where[k] = r
        except BaseException:
            self.close()
            raise

    def shape(self, key):
        return tuple(self.where[key].shape(key))

    def dtype(self, key):
        return self.where[key].dtype(key)

    def get(self, key):
        return self.where[key].get_array(key)

    def close(self):
        for r in self.readers:
            r.close()


def low_rank_svd(w, k, seed=0):
    """(U, S, Vh) of the leading min(k, ...) singular triplets of the 2-D float64 array w: exact for small
    matrices, randomized (module docstring) when both sides exceed k + OVERSAMPLE by far."""
    m, n = w.shape
    q = k + OVERSAMPLE
    if min(m, n) <= 2 * q:
        u, s, vh = np.linalg.svd(w, full_matrices=False)
        return u[:, :k], s[:k], vh[:k]
    rng = np.random.default_rng(seed)
    y = w @ rng.standard_normal((n, q))
    for _ in range(POWER_ITERS):
        y, _ = np.linalg.qr(y)
        y = w @ (w.T @ y)
    basis, _ = np.linalg.qr(y)
    ub, s, vh = np.linalg.svd(basis.T @ w, full_matrices=False)
    return (basis @ ub)[:, :k], s[:k], vh[:k]


def extract_files(base, tuned, dst, rank, *, conv_rank=None, method=None, param=None, format="kohya", prefix=None,
                  min_diff=0.0, dtype=None, progress=False):
    """Write the LoRA of tuned - base (module docstring) to `dst` (atomically). Returns (report, skipped):
    [(name, new rank, Frobenius norm kept)] and {reason: count}."""
    check_options(rank, conv_rank, method, param, dtype)
    if format not in FORMATS:
        raise ResizeError(f"format: one of {', '.join(FORMATS)}, got {format!r}")
    if isinstance(min_diff, bool) or not isinstance(min_diff, (int, float)) or not min_diff >= 0:
        raise ResizeError(f"min_diff: a number >= 0, got {min_diff!r}")
    prefix = FORMATS[format] if prefix is None else prefix
    a, b = _Checkpoint(base), _Checkpoint(tuned)
    try:
        skipped = Counter(only_base=len(set(a.where) - set(b.where)), only_tuned=len(set(b.where) - set(a.where)))
        names = []
        for key in sorted(set(a.where) & set(b.where)):
            sa, sb = a.shape(key), b.shape(key)
            if sa != sb:
                raise ResizeError(f"{key}: {sa} in {a.path}, {sb} in {b.path}: not checkpoints of one model")
            if not key.endswith(".weight") or len(sa) not in (2, 4) or a.dtype(key).kind not in "fV":
                skipped["not a Linear / Conv2d weight"] += 1
                continue
            names.append(key)
        if not names:
            raise ResizeError(f"{a.path} and {b.path} share no Linear / Conv2d weight")
        out, report = {}, []
        for key in (progress_bar if progress else (lambda it, desc: it))(names, "extracting"):
            w0, w1 = a.get(key), b.get(key)
            for which, w in ((a.path, w0), (b.path, w1)):
                bad = w.size - int(np.count_nonzero(np.isfinite(w)))
                if bad:
                    raise ResizeError(f"{key} in {which}: {bad} of {w.size} values are not finite")
            delta = w1.astype(np.float64) - w0.astype(np.float64)
            if not np.abs(delta).max() > min_diff:
                skipped["unchanged"] += 1
                continue
            shape = delta.shape
            cap = (conv_rank or rank) if len(shape) == 4 else rank
            u, s, vh = low_rank_svd(delta.reshape(shape[0], -1), cap)
            k = new_rank(s, cap, method, param)
            total = float(np.linalg.norm(delta))
            kept = float(np.sqrt(np.sum(s[:k] ** 2))) / total
            up = (u[:, :k] * s[:k]).reshape((shape[0], k) + ((1, 1) if len(shape) == 4 else ()))
            down = vh[:k].reshape((k,) + shape[1:])
            name = key[:-len(".weight")]
            stem = prefix + (name.replace(".", "_") if format == "kohya" else name)
            # (bfloat16's NumPy kind is 'V'; float8 tuned weights give a float32 LoRA)
            like = np.dtype(DTYPES[dtype]) if dtype is not None else (
                w1.dtype if w1.dtype.kind in "fV" and w1.dtype.itemsize >= 2 else np.dtype(np.float32))
            write_pair(out, format, stem, up, down, 1.0, like, like)
            report.append((stem, k, kept))
        if not report:
            raise ResizeError(f"{a.path} and {b.path} hold the same weights (max |ΔW| <= {min_diff}): nothing to "
                              f"extract")
    finally:
        a.close()
        b.close()
    meta = {"format": "pt", "flame.format": format,
            "flame.extracted": json.dumps({"base": os.path.basename(os.fspath(base)),
                                           "tuned": os.path.basename(os.fspath(tuned)), "rank": rank,
                                           "method": method, "param": param}, sort_keys=True)}
    if format == "kohya":
        ranks = Counter(k for _, k, _ in report)
        meta["ss_network_dim"] = str(rank) if method is None and len(ranks) == 1 else "Dynamic"
        meta["ss_network_alpha"] = meta["ss_network_dim"]
    _io.save_file(out, dst, metadata=meta)
    return report, dict(skipped)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flame_nn.adapters.extract",
                                 description="Extract a LoRA from two checkpoints of one model (tuned - base, by SVD).")
    ap.add_argument("base", help="the base checkpoint (.safetensors, or a folder of them)")
    ap.add_argument("tuned", help="the fine-tuned checkpoint")
    ap.add_argument("dst", help="the LoRA file to write (.safetensors)")
    add_rank_arguments(ap, "the LoRA's rank (with --method: the most kept)",
                       "the LoRA's dtype (default: the tuned weights')")
    ap.add_argument("--format", choices=tuple(FORMATS), default="kohya",
                    help="kohya (lora_unet_<name>: BFL-layout Flux, SAI-layout SDXL) or peft (transformer.<name>: "
                         "diffusers-layout files)")
    ap.add_argument("--prefix", help="the keys' prefix (default lora_unet_ / transformer.)")
    ap.add_argument("--min-diff", type=float, default=0.0, help="leave out weights whose |ΔW| never exceeds this")
    args = ap.parse_args(argv)
    done = run_command(ap, args.dst, lambda: extract_files(
        args.base, args.tuned, args.dst, args.rank, conv_rank=args.conv_rank, method=args.method, param=args.param,
        format=args.format, prefix=args.prefix, min_diff=args.min_diff, dtype=args.dtype, progress=True))
    if done is None:
        return 2
    report, skipped = done
    kept = [x[2] for x in report]
    left = ", ".join(f"{n} {why}" for why, n in skipped.items() if n)
    print(f"{len(report)} adapters, Frobenius norm of ΔW kept: mean {np.mean(kept):.2%}, min {np.min(kept):.2%}"
          f"{f'; left out: {left}' if left else ''}; wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
