"""Probe: SiLU / GELU(tanh) backward at 4608x12288 bf16, one loop step per thread (bench/probes/act_bwd_step.cu) with
8- or 16-byte vectors, against the library's kernels and torch, in interleaved rounds (shuffled order; medians,
x torch), each variant checked against the library's output. Also: torch's kernel (name, grid, block, registers) from
its profiler, the library's kernel into a preallocated output, and outputs at byte offsets from the allocator's.
Section `placement`: SiLU forward / backward into 5 separately allocated outputs each for FLAME's kernel (CuPy buffers,
and torch's buffers through DLPack) and for torch's `silu.out` / `silu_backward.grad_input` (torch buffers), plus
torch's own allocation, in interleaved rounds: how much the output's placement moves either side.
Section `swizzle`: SiLU forward and GELU(tanh) backward with the blocks taking their chunks in S windows spread over
the array (bench/probes/act_swizzle.cu, S = 1: the library's order), each into 3 separately allocated outputs, against
torch in interleaved rounds.
Section `bulk`: the SiLU forward and a plain copy through the bulk-copy engine (bench/probes/act_bulk.cu: chunks into
shared memory on an mbarrier, mapped in place, written back by bulk stores; one chunk per block, one per warp, or two
per block; act_bulk_pipe, a persistent grid with S stages, ran in device call 1 of 2026-11-25 only, see act_bulk.cu
at commit 6ace0ce: 0.0837-0.0925 ms against torch's 0.0735), against the library, torch and cupy.copyto, each into a
fresh output, in interleaved rounds.
Section `bulk2`: the SiLU / GELU(tanh) backwards the same way (act_bulk2_one: both inputs' chunks on one mbarrier).
Same protocol as bench/kernels.py.
Run: PYTHONPATH=$PWD python3 bench/act_probe.py [step|placement|swizzle|lean|bulk [focus]|bulk2] [rounds]"""
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile

sys.path.insert(0, "bench")
_args = sys.argv[1:]
SECTION = _args[0] if _args and not _args[0].isdigit() else "step"
FOCUS = "focus" in _args  # bulk: only the one-chunk-per-block kernels with one vector per thread
ROUNDS = int(_args[-1]) if _args and _args[-1].isdigit() else 15
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402
import numpy as np  # noqa: E402
from flame_core.kernels import activations as A, loader as L  # noqa: E402

cp, F, torch = B.cp, B.F, B.torch
BF = "__nv_bfloat16"


def torch_kernels(fn):
    """(name, grid, block, registers) of the CUDA kernels one call of fn launches, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    return [(e["name"][:150], e["args"].get("grid"), e["args"].get("block"), e["args"].get("registers per thread"))
            for e in events if e.get("cat") == "kernel"]


def _check(got, want, *tag):
    """A candidate's output within 2% of the largest magnitude of the library's (bf16 rounding of the same formula)."""
    err = float(cp.abs(got.astype(np.float32) - want.astype(np.float32)).max())
    assert err <= 0.02 * float(cp.abs(want.astype(np.float32)).max()), tag + (err,)


def _interleaved(cands, rounds, label, ref="torch"):
    """Time every candidate in `rounds` shuffled interleaved rounds; print medians, x ref and the rounds faster."""
    times = {c: [] for c in cands}
    order = list(cands)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for c in order:
            fn, is_torch = cands[c]
            times[c].append(B.time_ms(fn, torch_op=is_torch))
    mt = statistics.median(times[ref])
    print(f"== {label}, median of {rounds} interleaved rounds (ms), fastest first; wins = rounds faster than {ref}")
    for c in sorted(times, key=lambda c: statistics.median(times[c])):
        t = statistics.median(times[c])
        wins = sum(a < b for a, b in zip(times[c], times[ref]))
        print(f"  {c:40s} {t:.4f}  x {ref} {mt / t:.4f}  wins {wins}/{rounds}", flush=True)


def placement():
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    n = x.size
    xt, gt = B.tt(x), B.tt(dy)
    for label, stem, ins, tins, top in (
            ("silu fwd", "silu_fwd", (x,), (xt,), lambda o: torch.ops.aten.silu.out(xt, out=o)),
            ("silu bwd", "silu_bwd", (dy, x), (gt, xt),
             lambda o: torch.ops.aten.silu_backward.grad_input(gt, xt, grad_input=o))):
        step = A._step_split(stem, -1, n, x.itemsize)  # n % 4 == 0: the library's one launch
        if step is not None:
            u, blk, _, g = step
            k, grid, block = L.get_function("activations", f"{stem}_step<{{T}}, {u}>", x.dtype), (g,), (blk,)
        else:
            u, blk = A._PLANS[stem, -1]
            k = L.get_function("activations", f"{stem}<{{T}}, {u}>", x.dtype)
            grid, block = A._grid(n, x.dtype, u, blk)
        cbufs, tbufs = [], []
        for _ in range(5):  # separate allocations, each after a spacer of another size
            cbufs.append(cp.empty_like(x))
            cbufs.append(cp.empty(12345 * 1024, dtype=cp.uint8))
            tbufs.append(torch.empty_like(xt))
            tbufs.append(torch.empty(6789 * 1024, dtype=torch.uint8, device="cuda"))
        cbufs, tbufs = cbufs[::2], tbufs[::2]
        cands = {"torch": ((lambda: torch.nn.functional.silu(xt)) if stem == "silu_fwd"
                           else B._torch_bwd(F.silu, x, dy), True)}
        for i, o in enumerate(cbufs):
            cands[f"FLAME into cupy buffer {i}"] = (lambda o=o: L.launch(k, grid, block, ins + (o, L.i64(n))), False)
        for i, o in enumerate(tbufs):
            oc = cp.from_dlpack(o)
            cands[f"FLAME into torch buffer {i}"] = (lambda oc=oc: L.launch(k, grid, block, ins + (oc, L.i64(n))),
                                                    False)
            cands[f"torch into torch buffer {i}"] = (lambda o=o: top(o), True)
        _interleaved(cands, ROUNDS, f"{label}: output placement (FLAME's {'step' if step else 'loop'} kernel "
                                   f"{u, blk})")


def swizzle():
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    n = x.size
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_swizzle.cu").read_text()
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS,
                       name_expressions=[f"silu_fwd_swz<{BF}>", f"gelu_bwd_swz<{BF}, 2>"])
    outs = []
    for _ in range(3):  # separate allocations, each after a spacer
        outs.append(cp.empty_like(x))
        cp.empty(12345 * 1024, dtype=cp.uint8)
    for label, k, grid, block, ins, lib, tor in (
            ("silu fwd", mod.get_function(f"silu_fwd_swz<{BF}>"), n // 8 // 256, 256, (x,),
             lambda: A.silu_forward(x), (lambda: F.silu(B.tt(x)))),
            ("gelu(tanh) bwd", mod.get_function(f"gelu_bwd_swz<{BF}, 2>"), n // 4 // 256, 128, (dy, x),
             lambda: A.gelu_backward(dy, x, "tanh"), B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy))):
        want = lib()
        cands = {"torch": (tor, True), "library": (lib, False)}
        for S in (1, 2, 4, 16):
            assert grid % S == 0
            for i, o in enumerate(outs):
                fn = (lambda k=k, o=o, S=S, ins=ins, grid=grid, block=block:
                      k((grid,), (block,), ins + (o, np.int64(n), np.int32(S))) or o)
                got = fn()
                _check(got, want, label, S, i)
                cands[f"S={S} out {i}"] = (fn, False)
        _interleaved(cands, ROUNDS, f"{label}: block order in S windows")


def lean():
    """Lean one-step kernels (32-bit index math, nothing before the first load but the index; act_swizzle.cu) against
    the library and torch: silu fwd with one 16- or 8-byte vector per thread, gelu(tanh) bwd with 2 8-byte vectors."""
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    n = x.size
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_swizzle.cu").read_text()
    names = [f"silu_fwd_lean<{BF}, 16>", f"silu_fwd_lean<{BF}, 8>", f"gelu_bwd_lean<{BF}, 2>"]
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS, name_expressions=names)
    for label, lib, tor, variants in (
            ("silu fwd", lambda: A.silu_forward(x), (lambda: F.silu(B.tt(x))),
             [(names[0], 16, blk, 1, (x,)) for blk in (128, 256, 512)] + [(names[1], 8, 128, 1, (x,))]),
            ("gelu(tanh) bwd", lambda: A.gelu_backward(dy, x, "tanh"),
             B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy),
             [(names[2], 8, blk, 2, (dy, x)) for blk in (128, 256)])):
        want = lib()
        cands = {"torch": (tor, True), "library": (lib, False)}
        for name, vb, blk, u, ins in variants:
            k, nv = mod.get_function(name), n // (vb // 2)

            def fn(k=k, nv=nv, blk=blk, u=u, ins=ins):
                o = cp.empty_like(x)
                k((L.cdiv(nv, blk * u),), (blk,), ins + (o, np.int32(nv)))
                return o
            got = fn()
            _check(got, want, label, name)
            cands[f"lean v{vb} ({u}, {blk})"] = (fn, False)
        _interleaved(cands, ROUNDS, f"{label}: lean one-step kernels")


def bulk():
    x = B.randn((4608, 12288), scale=2.0)
    nbytes = x.nbytes
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_bulk.cu").read_text()
    names = [f"act_bulk_{kind}<{BF}, {op}>" for kind in ("one", "warp", "two") for op in (0, 1)]
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS, name_expressions=names)
    want = A.silu_forward(x)
    cands = {"torch silu": (lambda: F.silu(B.tt(x)), True), "library silu": (lambda: A.silu_forward(x), False)}

    def copy():
        o = cp.empty_like(x)
        cp.copyto(o, x)
        return o
    cands["cupy copy"] = (copy, False)
    # (tag, kernel, grid, threads, chunk bytes, shared bytes)
    if FOCUS:  # call 3: one 16-byte vector per thread, about 32 KiB of loads in flight per SM
        variants = [(f"one c{c} t{t}", f"act_bulk_one<{BF}, {{op}}>", L.cdiv(nbytes, c), t, c, c)
                    for c, t in ((1024, 64), (2048, 128), (3072, 192), (4096, 256))]
    else:  # calls 1-2
        variants = [(f"one c{c} t{t}", f"act_bulk_one<{BF}, {{op}}>", L.cdiv(nbytes, c), t, c, c)
                    for c, t in ((2048, 64), (2048, 128), (4096, 64), (4096, 128), (4096, 256), (8192, 256))]
        variants += [(f"warp W{w} t{t}", f"act_bulk_warp<{BF}, {{op}}>", L.cdiv(nbytes, w * t // 32), t,
                      w * t // 32, w * t // 32) for w, t in ((512, 128), (512, 256), (1024, 128), (2048, 128))]
        variants += [(f"two c{c} t{t}", f"act_bulk_two<{BF}, {{op}}>", L.cdiv(nbytes, 2 * c), t, c, 2 * c)
                     for c, t in ((2048, 128), (4096, 128), (4096, 256))]
    for tag, name, grid, t, c, shm in variants:
        for op, label in ((0, "copy"), (1, "silu")):
            k = mod.get_function(name.format(op=op))

            def fn(k=k, grid=grid, t=t, c=c, shm=shm):
                o = cp.empty_like(x)
                L.launch(k, grid, t, (x, o, L.i64(nbytes), np.int32(c)), shared_mem=shm)
                return o
            got = fn()
            ref = x if op == 0 else want
            assert bool((got.view(np.uint16) == ref.view(np.uint16)).all()), (tag, label)
            cands[f"bulk {label} {tag}"] = (fn, False)
    _interleaved(cands, ROUNDS, "silu fwd / copy 4608x12288 bf16 through bulk copies (outputs bit-identical)",
                 ref="torch silu")


def bulk2():
    """The SiLU / GELU(tanh) backwards with one chunk per block through the bulk-copy engine (act_bulk2_one) against
    the library's step kernels and torch, each into a fresh output."""
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    nbytes = x.nbytes
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_bulk.cu").read_text()
    names = [f"act_bulk2_one<{BF}, {op}>" for op in (0, 1)]
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS, name_expressions=names)
    for op, label, lib, tor in (
            (0, "silu bwd", lambda: A.silu_backward(dy, x), B._torch_bwd(F.silu, x, dy)),
            (1, "gelu(tanh) bwd", lambda: A.gelu_backward(dy, x, "tanh"),
             B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy))):
        want = lib()
        k = mod.get_function(names[op])
        cands = {"torch": (tor, True), "library": (lib, False)}
        for c, t in ((1024, 64), (2048, 128), (1024, 32), (2048, 64), (4096, 256), (4096, 128)):
            def fn(c=c, t=t):
                o = cp.empty_like(x)
                L.launch(k, L.cdiv(nbytes, c), t, (dy, x, o, L.i64(nbytes), np.int32(c)), shared_mem=2 * c)
                return o
            got = fn()
            _check(got, want, label, c, t)
            cands[f"bulk c{c} t{t}"] = (fn, False)
        _interleaved(cands, ROUNDS, f"{label} 4608x12288 bf16: one chunk (per input) per block through bulk copies")


def main():
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    n = x.size
    src = L.source("activations") + (pathlib.Path(__file__).parent / "probes" / "act_bwd_step.cu").read_text()
    steps = [(8, 1, 128, False), (8, 1, 128, True), (8, 2, 128, False), (8, 1, 256, False),
             (16, 1, 128, False), (16, 1, 128, True), (16, 2, 128, False), (16, 1, 256, False)]
    names = {}
    for vb, u, blk, tail in steps:
        t = "true" if tail else "false"
        names["silu", vb, u, tail, False] = f"silu_bwd_step<{BF}, {vb}, {u}, {t}>"
        names["gelu", vb, u, tail, False] = f"gelu_bwd_step<{BF}, {vb}, {u}, {t}, false>"
        names["gelu", vb, u, tail, True] = f"gelu_bwd_step<{BF}, {vb}, {u}, {t}, true>"
    mod = cp.RawModule(code=src, options=L.NVRTC_OPTIONS, name_expressions=list(names.values()))
    pad = (1 << 20) + 8192
    big = cp.empty(n + pad, dtype=x.dtype)

    def out_at(off_bytes):
        e = off_bytes // x.itemsize
        return big[e:e + n].reshape(x.shape)

    ops = {"silu bwd": ("silu", -1, lambda: A.silu_backward(dy, x), B._torch_bwd(F.silu, x, dy)),
           "gelu(tanh) bwd": ("gelu", 1, lambda: A.gelu_backward(dy, x, "tanh"),
                              B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy))}
    for label, (stem, approx, lib, tor) in ops.items():
        print(f"== {label}: torch launches", flush=True)
        for k in torch_kernels(tor):
            print("  ", k, flush=True)
        u0, blk0 = A._PLANS[f"{stem}_bwd", approx]
        libk = L.get_function("activations", f"{stem}_bwd<{{T}}, {u0}>", x.dtype)
        lgrid, lblock = A._grid(n, x.dtype, u0, blk0)
        extra = () if approx < 0 else (np.int32(approx),)
        want = lib()
        cands = {"library": lib}
        for off in (0, 4096, 65536 + 512, (1 << 20) + 4096):
            o = out_at(off)
            cands[f"library kernel, out +{off}"] = (lambda o=o: L.launch(libk, lgrid, lblock,
                                                                         (dy, x, o, L.i64(n)) + extra) or o)
        for (st, vb, u, tail, br), name in names.items():
            if st != stem:
                continue
            blk = next(b for v, uu, b, t in steps if (v, uu, t) == (vb, u, tail))
            k = mod.get_function(name)
            grid = (L.cdiv(n // (vb // 2), blk * u),)
            args = (np.int64(n),) + ((np.int32(approx),) if stem == "gelu" else ())
            tag = f"step v{vb} ({u}, {blk})" + (" tail" if tail else "") + (" branch" if br else "")
            for off in ((0, (1 << 20) + 4096) if (vb, u, blk, tail, br) == (8, 1, 128, False, False) else (0,)):
                o = out_at(off)
                cands[tag + (f" out +{off}" if off else "")] = (lambda k=k, grid=grid, blk=blk, o=o, args=args:
                                                                 k(grid, (blk,), (dy, x, o) + args) or o)
            if (vb, u, blk, tail, br) == (8, 1, 128, False, False):
                def fresh(k=k, grid=grid, blk=blk, args=args):
                    o = cp.empty_like(x)
                    k(grid, (blk,), (dy, x, o) + args)
                    return o
                cands[tag + " fresh out"] = fresh
        for name, fn in cands.items():
            got = fn()
            _check(got, want, label, name)
        times = {c: [] for c in list(cands) + ["torch"]}
        order = list(times)
        rng = random.Random(0)
        for _ in range(ROUNDS):
            rng.shuffle(order)
            for c in order:
                times[c].append(B.time_ms(tor, torch_op=True) if c == "torch" else B.time_ms(cands[c]))
        mt = statistics.median(times["torch"])
        print(f"== {label}, median of {ROUNDS} interleaved rounds (ms), fastest first; wins = rounds faster than torch")
        for c in sorted(times, key=lambda c: statistics.median(times[c])):
            t = statistics.median(times[c])
            wins = sum(a < b for a, b in zip(times[c], times["torch"]))
            print(f"  {c:40s} {t:.4f}  x torch {mt / t:.4f}  wins {wins}/{ROUNDS}", flush=True)


if __name__ == "__main__":
    {"step": main, "placement": placement, "swizzle": swizzle, "lean": lean, "bulk": bulk, "bulk2": bulk2}[SECTION]()
