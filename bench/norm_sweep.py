"""Sweep of the norm kernels' candidates on the GPU (same protocol as bench/kernels.py: L2 evicted before each call,
each call timed alone with CUDA events, median), side by side with PyTorch's op and a D2D copy of the input.

Default (issue #4, < 2 minutes on an H100): every candidate of rms_norm backward 4608x3072 bf16 (weight) and of
group_norm forward / backward 2x320x128x128 G=32 bf16, each first checked against the reference path (max relative
error: max |got - ref| / max |ref|), then timed; a compact table last (and JSON: --out).
--legacy: the earlier sweeps (forward plans, QK-norm, vpt, modulate).
Run: PYTHONPATH=$PWD python3 bench/norm_sweep.py [--legacy]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import kernels as B  # noqa: E402  bench/kernels.py: time_ms, randn, flush protocol
from flame_core.kernels import loader as L, modulate as M, norms as K  # noqa: E402

ROWS = []


def _rel(got, ref):
    if got is None or ref is None:
        return None
    g, r = got.astype(np.float32), ref.astype(np.float32)
    den = float(B.cp.abs(r).max()) or 1.0
    return float(B.cp.abs(g - r).max()) / den


def _settings(**kw):
    """Set module switches (name -> value on norms / loader); returns the previous values."""
    old = {}
    for k, v in kw.items():
        mod = L if k == "vpt_override" else K
        old[k] = getattr(mod, k)
        setattr(mod, k, v)
    return old


def run(op, variant, nbytes, fn, ref, copy_ms, torch_ms, settings, tol):
    """Check fn() against ref (tuple of arrays), then time it under `settings`; one table row."""
    old = _settings(**settings)
    try:
        out = fn()
        errs = [_rel(a, b) for a, b in zip(out, ref)]
        ok = all(e is None or e <= t for e, t in zip(errs, tol))
        ms = B.time_ms(fn) if ok else float("nan")
    except Exception as e:  # a candidate that fails to compile / launch is reported, not fatal
        errs, ok, ms = [repr(e)[:60]], False, float("nan")
    finally:
        _settings(**old)
    row = {"op": op, "variant": variant, "ms": round(ms, 4), "GBps": round(nbytes / ms / 1e6, 1),
           "vs_copy": round(copy_ms / ms * (nbytes / (2 * COPY_BYTES[op])), 3),
           "vs_torch": round(torch_ms / ms, 3) if torch_ms else None,
           "err": [None if e is None else (e if isinstance(e, str) else float(f"{e:.2e}")) for e in errs], "ok": ok}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


COPY_BYTES = {}


def copy_ms(op, src):
    dst = B.cp.empty_like(src)
    COPY_BYTES[op] = src.nbytes
    return B.time_ms(lambda: B.cp.copyto(dst, src))


def sweep_rms_bwd():
    op = "rms_norm bwd 4608x3072"
    x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
    w = B.randn((3072,)) + 1
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    with L.reference():
        ref = K.rms_norm_backward(dy, x, w, rs)
    cms = copy_ms(op, x)
    tms = None
    if B.torch is not None:
        tms = B.time_ms(B._torch_bwd(lambda t: B.F.rms_norm(t, (3072,), B.tt(w), eps=1e-6), x, dy), torch_op=True)
    fn = lambda: K.rms_norm_backward(dy, x, w, rs)  # noqa: E731
    tol = (2e-2, 2e-2)
    base = dict(bwd_finish="column_sum", single_launch_sums=False, vpt_override=None, bwd_rpb_override=None,
                bwd_blocks_override=None)
    run(op, "HEAD default (column_sum)", 3 * x.nbytes, fn, ref, cms, tms, base, tol)
    run(op, "HEAD single launch (parts_finish)", 3 * x.nbytes, fn, ref, cms, tms, dict(base, single_launch_sums=True),
        tol)
    for vpt in (None, 1):
        for rpb in (None, 1, 2, 3):
            for blocks in (None, 2):
                if blocks and rpb is None:
                    continue
                shape = dict(base, vpt_override=vpt, bwd_rpb_override=rpb, bwd_blocks_override=blocks)
                tag = f"vpt={vpt or 'auto'} rpb={rpb or 'auto'} bps={blocks or 'auto'}"
                for chunk in (16, 32, 64):
                    run(op, f"chunks{chunk} {tag}", 3 * x.nbytes, fn, ref, cms, tms,
                        dict(shape, bwd_finish="chunks", chunk_cols=chunk), tol)
                for k in (8, 16, 32, 64):
                    run(op, f"spread K={k} {tag}", 3 * x.nbytes, fn, ref, cms, tms,
                        dict(shape, bwd_finish="spread", spread_k=k), tol)


def sweep_group_norm():
    g, gdy = B.randn((2, 320, 128, 128)), B.randn((2, 320, 128, 128))
    gw, gb = B.randn((320,), np.float32) + 1, B.randn((320,), np.float32)
    fop, bop, aop = "group_norm fwd 2x320x128x128", "group_norm bwd 2x320x128x128", "group_norm bwd affine"
    with L.reference():
        fref = K.group_norm_forward(g, 32, None, None, 1e-5)
    _, gm, gr = fref
    with L.reference():
        bref = K.group_norm_backward(gdy, g, 32, None, gm, gr)
        aref = K.group_norm_backward(gdy, g, 32, gw, gm, gr, gb)
    cms = {op: copy_ms(op, g) for op in (fop, bop, aop)}
    tf = tb = ta = None
    if B.torch is not None:
        tf = B.time_ms(lambda: B.F.group_norm(B.tt(g), 32, eps=1e-5), torch_op=True)
        tb = B.time_ms(B._torch_bwd(lambda t: B.F.group_norm(t, 32, eps=1e-5), g, gdy), torch_op=True)
        ta = B.time_ms(B._torch_bwd(lambda t: B.F.group_norm(t, 32, B.tt(gw).to(t.dtype), B.tt(gb).to(t.dtype),
                                                             eps=1e-5), g, gdy),
                       torch_op=True)
    n = g.nbytes
    for kern in K.GN_FWD_KERNELS:
        run(fop, kern.replace("{T}", "T"), 2 * n, lambda: K.group_norm_forward(g, 32, None, None, 1e-5), fref,
            cms[fop], tf, dict(gn_fwd_kernel=kern, use_cluster=True), (2e-2, 1e-3, 1e-4))
    run(fop, "split path (3 launches)", 2 * n, lambda: K.group_norm_forward(g, 32, None, None, 1e-5), fref, cms[fop],
        tf, dict(use_cluster=False), (2e-2, 1e-3, 1e-4))
    for kern in K.GN_BWD_KERNELS:
        run(bop, kern.replace("{T}", "T"), 3 * n, lambda: K.group_norm_backward(gdy, g, 32, None, gm, gr), bref,
            cms[bop], tb, dict(gn_bwd_kernel=kern, use_cluster=True), (2e-2, 0, 0))
        for fused in (False, True):
            run(aop, kern.replace("{T}", "T") + (" single launch" if fused else " + gn_column_sum"), 3 * n,
                lambda: K.group_norm_backward(gdy, g, 32, gw, gm, gr, gb), aref, cms[aop], ta,
                dict(gn_bwd_kernel=kern, use_cluster=True, single_launch_sums=fused), (2e-2, 1e-3, 1e-3))


def legacy():
    """The earlier sweeps: forward plans, QK-norm forward, backward vpt with and without single-launch sums."""
    x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
    w, b = B.randn((3072,)) + 1, B.randn((3072,))
    q, wq = B.randn((110592, 128)), B.randn((128,)) + 1
    _, mean, rstd = K.layer_norm_forward(x, None, None, 1e-6)
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    _, rq = K.rms_norm_forward(q, wq, 1e-6)
    fwd = {"ln": lambda: K.layer_norm_forward(x, None, None, 1e-6),
           "ln_aff": lambda: K.layer_norm_forward(x, w, b, 1e-5), "rms": lambda: K.rms_norm_forward(x, w, 1e-6)}
    print("default fwd plans: 3072 cols", K._fwd_shape(3072 // 8), "128 cols", K._fwd_shape(128 // 8))
    for plan in [None, (12, 32), (16, 32), (8, 64), (6, 64), (4, 96), (3, 128), (2, 192), (1, 384)]:
        K.fwd_override = plan
        print("fwd", plan, {k: round(B.time_ms(f), 4) for k, f in fwd.items()})
    for plan in [None, (4, 4), (2, 8), (8, 2), (1, 16), (16, 1), (2, 16), (4, 8)]:
        K.fwd_override = plan
        print("qk fwd", plan, round(B.time_ms(lambda: K.rms_norm_forward(q, wq, 1e-6)), 4))
    K.fwd_override = None
    for fused in (True, False):
        K.single_launch_sums = M.single_launch_sums = fused
        for v in [None, 1, 2, 4]:
            L.vpt_override = v
            print("bwd", "fused" if fused else "column_sum", "vpt", v,
                  "rms", round(B.time_ms(lambda: K.rms_norm_backward(dy, x, w, rs)), 4),
                  "ln", round(B.time_ms(lambda: K.layer_norm_backward(dy, x, None, mean, rstd)), 4),
                  "ln_aff", round(B.time_ms(lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b)), 4))
        L.vpt_override = None
        print("bwd", "fused" if fused else "column_sum", "qk rms (weight)",
              round(B.time_ms(lambda: K.rms_norm_backward(q, q, wq, rq)), 4))
        x3, dy3 = x.reshape(1, 4608, 3072), dy.reshape(1, 4608, 3072)
        sh, sc = B.randn((1, 1, 3072)), B.randn((1, 1, 3072), scale=0.3)
        print("bwd", "fused" if fused else "column_sum",
              "modulate", round(B.time_ms(lambda: M.modulate_backward(dy3, x3, sh, sc)), 4),
              "gated", round(B.time_ms(lambda: M.gated_residual_backward(dy3, sh, x3)), 4))
    K.single_launch_sums = M.single_launch_sums = False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--legacy", action="store_true", help="the earlier sweeps instead")
    ap.add_argument("--ops", default="rms,gn", help="which sweeps: rms (rms_norm backward), gn (group_norm)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "norm_sweep.json"))
    args = ap.parse_args()
    if not L.enabled():
        raise SystemExit("kernels are disabled (no GPU, or FLAME_KERNELS=0): nothing to measure")
    B.cp.random.seed(0)
    if args.legacy:
        legacy()
        return
    ceiling = B.bench_copy_ceiling()
    ops = args.ops.split(",")
    if "rms" in ops:
        sweep_rms_bwd()
        B.cp.get_default_memory_pool().free_all_blocks()
    if "gn" in ops:
        sweep_group_norm()
    dev = B.cp.cuda.runtime.getDeviceProperties(B.cp.cuda.Device().id)["name"]
    dev = dev.decode() if isinstance(dev, bytes) else dev
    with open(args.out, "w") as fh:
        json.dump({"device": dev, "copy_1GiB_GBps": ceiling, "rows": ROWS}, fh, indent=1)
    print(f"\n{dev}   copy ceiling (1 GiB D2D): {ceiling} GB/s   vs copy: against a copy of the op's input, same "
          f"protocol; err: max rel error of each output against the reference path")
    hdr = f"{'op':30s} {'variant':52s} {'ms':>7s} {'GB/s':>6s} {'vs copy':>7s} {'vs torch':>8s}  err"
    print(hdr)
    print("-" * len(hdr))
    best = {}
    for r in ROWS:
        print(f"{r['op'][:30]:30s} {r['variant'][:52]:52s} {r['ms']:7.4f} {r['GBps']:6.0f} {r['vs_copy']:7.3f} "
              f"{r['vs_torch'] if r['vs_torch'] is not None else float('nan'):8.3f}  {r['err']}")
        if r["ok"] and (r["op"] not in best or r["ms"] < best[r["op"]]["ms"]):
            best[r["op"]] = r
    print("\nfastest correct candidate per op:")
    for op, r in best.items():
        print(f"  {op:30s} {r['variant']:52s} {r['ms']:.4f} ms  vs copy {r['vs_copy']:.3f}  vs torch {r['vs_torch']}")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
