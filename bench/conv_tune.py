"""Measure every convolution algorithm and wgmma plan of each pass (fwd, dx, dw) at the bench/conv.py shapes and the
SDXL ResBlocks' convolutions, and write the fastest into the measured table flame_core/kernels/conv_tuned.json
(flame_core/kernels/conv_table.py), which F.conv2d's 'auto' follows on a GPU of the same compute capability.

Candidates per pass: im2col + cuBLAS, and the wgmma implicit GEMM with each tile and 1, 2, 3, 4, 6 or 8 slices over K,
or a tail split (fwd / dx: the whole waves of tiles, then the last partial wave's tiles split over K in 2, 3 or 4;
flame_core.kernels.conv.tail_plan) (the weight gradient: DW_SLICES slices over the pixels); a strided dx (stride 2)
runs every phase of dx in one launch of the wgmma kernel: its candidates are the tiles alone. Each is checked against
im2col (max relative difference 2e-2) before it counts, then timed between CUDA events behind a busy-GPU head start,
median of --repeats. The VAE's (0,1,0,1) downsample is tuned as the model runs it: the pad folded into the conv
(F.pad_conv2d).
The table is written atomically (temp file, fsync, rename) into its compute capability's section, merged with the
geometries already there.
Run: PYTHONPATH=$PWD python3 bench/conv_tune.py [--shapes sdxl_l0,...] [--repeats 15] [--out PATH]
     --cpu-smoke: two shapes scaled down, float32 on the CPU with host timers (every candidate runs im2col there:
     checks the script and the table it writes, not a figure)
"""
import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile

import common
import conv as B  # bench/conv.py: the shapes
import numpy as np

import flame_core as flame
from flame_core import backend
from flame_core.kernels import conv as KC
from flame_core.kernels import conv_table, plans
from flame_core.ops import conv as C

WGMMA_SPLITS = (1, 2, 3, 4, 6, 8)
TAIL_SPLITS = (2, 3, 4)
DW_SLICES = tuple(range(1, 17)) + (20, 24, 32, 48, 64)  # every count to 16: the one that fills whole waves
ENV = ("FLAME_CONV_ALGO", "FLAME_CONV_WGMMA_TILE", "FLAME_CONV_WGMMA_DW_TILE", "FLAME_CONV_TABLE")


def geometries(names):
    """{label: (N, C, H, W, O, k, stride, pad)} to tune: the conv.py shapes named, plus both convs and the skip of
    each SDXL ResBlock (their geometry when it differs from a conv.py shape)."""
    out = {n: B.conv_spec(n) for n in names if n in B.SHAPES}
    for n in names:
        if n in B.RESBLOCKS:
            N, Ci, H, W, Co, _ = B.RESBLOCKS[n]
            for lab, spec in ((f"{n}.conv1", (N, Ci, H, W, Co, 3, 1, 1)), (f"{n}.conv2", (N, Co, H, W, Co, 3, 1, 1))):
                out[lab] = B.scaled(spec) if B.SMOKE else spec
    return out


WS_BUDGET = 512 << 20  # fp32 split-K partials of one fwd / dx plan, at most (what wgmma_plan's model allows itself)


def candidates(pass_, g):
    """[(label, env settings)] of one pass: im2col, then every wgmma plan that the geometry admits (a forward / dx
    split whose fp32 partials would pass WS_BUDGET is left out)."""
    out = [("im2col", {"FLAME_CONV_ALGO": f"{pass_}=im2col"})]
    if pass_ == "dx" and not (g.sh == g.sw == 1 or C.strided_dx(g)):
        return out
    var = "FLAME_CONV_WGMMA_DW_TILE" if pass_ == "dw" else "FLAME_CONV_WGMMA_TILE"
    out_elems = g.N * g.O * g.OH * g.OW if pass_ == "fwd" else g.N * g.C * g.H * g.W
    if pass_ == "dx" and C.one_launch_dx(g):  # every phase of dx in one launch: a tile, never split
        return out + [(f"wgmma:{tile}", {"FLAME_CONV_ALGO": "dx=wgmma", var: tile}) for tile in sorted(KC.WGMMA_TILES)]
    for tile in sorted(KC.WGMMA_TILES):
        for s in (DW_SLICES if pass_ == "dw" else WGMMA_SPLITS):
            if pass_ != "dw" and s > 1 and s * out_elems * 4 > WS_BUDGET:
                continue
            out.append((f"wgmma:{tile}:s{s}", {"FLAME_CONV_ALGO": f"{pass_}=wgmma", var: f"{tile}:s{s}"}))
        if pass_ != "dw":  # a tail split: whole waves as they are, the last partial wave split over K
            for t in TAIL_SPLITS:
                out.append((f"wgmma:{tile}:t{t}", {"FLAME_CONV_ALGO": f"{pass_}=wgmma", var: f"{tile}:t{t}"}))
    return out


def set_env(settings):
    for k in ENV:
        os.environ.pop(k, None)
    os.environ["FLAME_CONV_TABLE"] = "0"  # the table must not steer what is being measured
    os.environ.update(settings)


def pass_fn(pass_, xa, wa, ga, g):
    if pass_ == "fwd":
        return lambda: C.conv2d_forward(xa, wa, g)
    if pass_ == "dx":
        return lambda: C.conv2d_backward(ga, xa, wa, g, need_x=True, need_w=False)[0]
    return lambda: C.conv2d_backward(ga, xa, wa, g, need_x=False, need_w=True)[1]


def rel_diff(a, b):
    a, b = backend.to_numpy(a).astype(np.float64), backend.to_numpy(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def tune_geometry(label, spec, repeats, smoke):
    N, Cin, H, W, O, k, stride, pad = spec
    dev, dt = ("cpu", flame.float32) if smoke else ("cuda", flame.bfloat16)
    flame.manual_seed(0)
    x = flame.randn(N, Cin, H, W, device=dev).to(dt)
    w = (flame.randn(O, Cin, k, k, device=dev) * 0.02).to(dt)
    g = B.flame_geometry(tuple(x.shape), tuple(w.shape), stride, pad)  # an asymmetric pad folded in (pad_conv2d)
    go = flame.randn(N, O, g.OH, g.OW, device=dev).to(dt)
    xa, wa, ga = x.array, w.array, go.array
    if C.is_pointwise(g):  # a plain 1x1 is one batched cuBLAS GEMM whatever the algorithm: nothing to choose
        print(f"{label}: a plain 1x1 (one batched GEMM on every path): not tuned", flush=True)
        return {}
    ms = B.timer(repeats, "cupy")
    found = {}
    for pass_ in C.PASSES:
        cands = candidates(pass_, g)
        timed, ref = {}, None
        for name, settings in cands:
            set_env(settings)
            fn = pass_fn(pass_, xa, wa, ga, g)
            try:
                out = fn()
            except Exception as e:  # a plan the geometry cannot take (e.g. workspace): reported, not counted
                timed[name] = f"error: {type(e).__name__}: {e}"
                continue
            if ref is None:
                ref = out
            else:
                d = rel_diff(out, ref)
                if d > 2e-2:
                    timed[name] = f"wrong: max rel diff {d:.2e} vs im2col"
                    continue
            timed[name] = round(ms(fn), 5)
            del out
        ok = {n: t for n, t in timed.items() if isinstance(t, float)}
        best = min(ok, key=ok.get) if ok else None
        entry = None
        if best is not None:
            algo, _, plan = best.partition(":")
            entry = {"algo": algo, **({"plan": plan} if plan else {}), "ms": ok[best], "im2col_ms": ok.get("im2col"),
                     "timed": timed}
        found[conv_table.key(pass_, g)] = entry
        print(f"{label} {pass_}: best {best} {ok.get(best)} ms (im2col {ok.get('im2col')}; {len(cands)} candidates)",
              flush=True)
        del ref
    set_env({})
    if not smoke:
        backend.cupy.get_default_memory_pool().free_all_blocks()
    return found


def write_table(path, section, entries, device):
    """Merge `entries` into `section` of the JSON table at `path`: temp file, fsync, rename."""
    path = pathlib.Path(path)
    doc = json.loads(path.read_text()) if path.exists() else {}
    sec = doc.setdefault(section, {"entries": {}})
    sec.update(device=device, commit=os.environ.get("FLAME_COMMIT", "unknown"),
               date=datetime.date.today().isoformat(), tool="bench/conv_tune.py")
    sec.setdefault("entries", {}).update({k: v for k, v in entries.items() if v is not None})
    sec["entries"] = dict(sorted(sec["entries"].items()))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    for k, v in entries.items():  # the table checks what it will read
        if v is not None:
            conv_table.check_entry(path, k, v)
    conv_table.clear_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(list(B.SHAPES) + list(B.RESBLOCKS)),
                    help="bench/conv.py shapes and SDXL ResBlocks (their convs)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None, help=f"the table file (default {conv_table.TABLE_FILE}; --cpu-smoke "
                    f"writes one only when given, in section 'smoke')")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    B.SMOKE = args.cpu_smoke
    names = args.shapes.split(",")
    bad = [n for n in names if n not in B.SHAPES and n not in B.RESBLOCKS]
    if bad:
        sys.exit(f"unknown shape(s) {', '.join(bad)}; known: {', '.join(list(B.SHAPES) + list(B.RESBLOCKS))}")
    if args.cpu_smoke:
        names = names[:2]
    elif not KC.wgmma_available():
        sys.exit("conv_tune.py measures the wgmma kernels: it needs a compute capability 9.0 GPU")
    res = common.Results("conv_tune")
    entries, seen = {}, set()
    name = plans.device_properties()["name"] if not args.cpu_smoke else "cpu"
    name = name.decode() if isinstance(name, bytes) else name
    out = args.out if args.cpu_smoke else (args.out or conv_table.TABLE_FILE)
    section = "smoke" if args.cpu_smoke else conv_table.section_name()
    for label, spec in geometries(names).items():
        if spec in seen:  # a ResBlock conv with a conv.py shape's geometry
            continue
        seen.add(spec)
        found = tune_geometry(label, spec, args.repeats, args.cpu_smoke)
        res.log(label, {k: (v and {f: v[f] for f in ("algo", "plan", "ms", "im2col_ms") if f in v})
                        for k, v in found.items()})
        entries.update(found)
        if out is not None:  # after every geometry: an interrupted run keeps what it measured
            write_table(out, section, entries, name)
    res.save()
    if out is not None:
        print(f"table: {out} [{section}] ({len(entries)} entries)")


if __name__ == "__main__":
    main()
