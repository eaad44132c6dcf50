"""Merging LoRA files into one: the weighted sum of their adapters, exactly or brought to a rank by SVD (kohya's
networks/svd_merge_lora.py), for kohya / LyCORIS or PEFT / diffusers files (all of one layout), every component.

For each adapter name (a kohya key stem or a PEFT module), over the files that have it, with weights w_i and scales
s_i:  ΔW = Σ w_i s_i up_i down_i = [w_1 s_1 up_1 | w_2 s_2 up_2 | ...] · [down_1; down_2; ...]
-- without `rank`, those concatenated factors are written as they are (exact: rank Σ r_i); with `rank`, their best
rank-k approximation (resize.resize_pair: the factored SVD; `method` / `param` choose k per adapter as resize does).
The result has scale 1 (kohya: alpha = rank; PEFT: no scale metadata). An adapter that two files shape differently
(other in / out features or kernel) is an error naming both files.

Run: python -m flame_nn.adapters.merge OUT.safetensors A.safetensors:0.7 B.safetensors:0.5 [--rank 32]
     [--conv-rank 16] [--method sv_fro --param 0.95] [--dtype bfloat16]
(a file without ":weight" has weight 1)
"""
import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

from flame_core import io as _io

from .resize import (
    ResizeError,
    add_rank_arguments,
    check_options,
    check_weights,
    out_dtypes,
    parse_source,
    progress_bar,
    read_pairs,
    resize_pair,
    run_command,
    write_pair,
)


def merge_files(sources, dst, rank=None, *, conv_rank=None, method=None, param=None, dtype=None, progress=False):
    """Write the merge of `sources` ([(path, weight)] or paths) to `dst` (atomically). Returns [(adapter, rank of
    the concatenation, rank written, Frobenius norm kept)]."""
    sources = [(s, 1.0) if isinstance(s, (str, os.PathLike)) else tuple(s) for s in sources]
    if not sources:
        raise ResizeError("no LoRA files to merge")
    check_weights(sources)
    if rank is None and (method is not None or conv_rank is not None):
        raise ResizeError("method / conv_rank choose ranks for an SVD merge: give rank too")
    check_options(rank if rank is not None else 1, conv_rank, method, param, dtype)
    read = [(path, w, *read_pairs(path)) for path, w in sources]
    fmts = {path: fmt for path, _, fmt, _, _ in read}
    if len(set(fmts.values())) > 1:
        raise ResizeError(f"the files mix layouts ({', '.join(f'{p}: {f}' for p, f in fmts.items())}): convert them "
                          f"to one (kohya or PEFT) first")
    fmt = read[0][2]
    by_stem = {}
    for path, w, _, _, pairs in read:
        for stem, p in pairs.items():
            by_stem.setdefault(stem, []).append((path, w, p))
    out, report = {}, []
    for stem, items in (progress_bar if progress else (lambda it, desc: it))(sorted(by_stem.items()), "merging"):
        first_path, _, first = items[0]
        for path, _, p in items[1:]:
            if p.up.shape[0] != first.up.shape[0] or p.down.shape[1:] != first.down.shape[1:] or \
                    p.up.shape[2:] != first.up.shape[2:]:
                raise ResizeError(f"{stem}: {first_path} has up {first.up.shape} / down {first.down.shape}, {path} "
                                  f"up {p.up.shape} / down {p.down.shape}: not one layer's adapters")
        up = np.concatenate([np.asarray(p.up, np.float64) * (w * p.scale) for _, w, p in items], axis=1)
        down = np.concatenate([np.asarray(p.down, np.float64) for _, _, p in items], axis=0)
        total = down.shape[0]
        kept = 1.0
        if rank is not None:
            cap = (conv_rank or rank) if down.ndim == 4 else rank
            up, down, _, kept = resize_pair(up, down, cap, method, param)
        write_pair(out, fmt, stem, up, down, 1.0, *out_dtypes(dtype, first.up, first.down),
                   first.alpha_dtype if dtype is None else None)
        report.append((stem, total, down.shape[0], kept))
    meta = {"format": "pt", "flame.format": fmt,
            "flame.merged": json.dumps({"sources": [[os.path.basename(str(p)), w] for p, w in sources],
                                        "rank": rank, "method": method, "param": param}, sort_keys=True)}
    _io.save_file(out, dst, metadata=meta)
    return report


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flame_nn.adapters.merge",
                                 description="Merge LoRA files into one (a weighted sum; exact, or to a rank by SVD).")
    ap.add_argument("dst", help="the merged file to write (.safetensors)")
    ap.add_argument("sources", nargs="+", metavar="LORA[:WEIGHT]", help="the LoRA files, each with its weight")
    add_rank_arguments(ap, "the merged rank by SVD (default: exact, the ranks summed)",
                       "the merged tensors' dtype (default: the first file's)", required=False)
    args = ap.parse_args(argv)

    def work():
        sources = [parse_source(s) for s in args.sources]
        return sources, merge_files(sources, args.dst, args.rank, conv_rank=args.conv_rank, method=args.method,
                                    param=args.param, dtype=args.dtype, progress=True)
    done = run_command(ap, args.dst, work)
    if done is None:
        return 2
    sources, report = done
    ranks = Counter(k for _, _, k, _ in report)
    print(f"{len(report)} adapters from {len(sources)} files, rank "
          f"{'/'.join(str(k) for k, _ in ranks.most_common(3))}; Frobenius norm kept: min "
          f"{min(x[3] for x in report):.2%}; wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
