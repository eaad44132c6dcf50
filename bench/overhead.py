"""Per-op host overhead: a chain of 200 small ops with requires_grad, forward + backward, in µs per op.

FLAME on cpu and (when CuPy sees a GPU) on cuda, side by side with PyTorch eager in the same process when torch is
importable (torch's cpu is the peer on cpu, torch's cuda on cuda; without torch FLAME is timed alone).

What is timed: the wall-clock time of one whole chain -- 200 ops on a 16-element float32 tensor, forward and
backward -- ended by a device synchronize on cuda, divided by 200. The tensors are tiny, so the GPU is idle and the
figure is the host's cost of issuing an op and its backward (Python, array library, driver launches): the op-overhead
question, not kernel speed.

Protocol (robust to host drift: a lent VM's host speed moves by 30 % between and within processes): interleaved A/B.
`--rounds` rounds (default 15); a round is one FLAME trial and one torch trial, FLAME first in even rounds and torch
first in odd ones; a trial is the median of `--chains` consecutive chains (default 5). Reported per device: the median
over rounds of each framework's µs/op, the median of the per-round ratios FLAME/torch (the figure to quote: both
sides of a ratio ran within a few milliseconds of each other, so a drift of the host cancels), and that ratio's
spread over the rounds (min, quartiles, max).
`--split` adds as many rounds again, after those, that time a chain's forward and its backward apart (a device
synchronize between them; the same interleaving, their own per-round ratios): which half an op's cost sits in. The
whole-chain figure above never includes these rounds.
`--chain linear` times another chain of 200 ops: 100 x (F.linear(y, W_i, b_i) then tanh) on a (16, 64) float32
input, every W_i (64, 64) and b_i (64,) requiring grad: an eager MLP's host cost (GEMMs through cuBLAS / cuBLASLt,
the weight and bias gradients), where the default chain (`elementwise`) has no GEMM. `--chain matmul`: the same
with `y @ W_i` (W_i (64, 64) requiring grad, no bias) for the linear: Tensor.__matmul__'s path (cuBLAS GemmEx).
`--profile N` then profiles FLAME's chain on each device: cProfile of N chains, forward and backward apart (the top
functions by own time, printed and saved as text), and the kernels FLAME launched per chain through its packed
launches (`kernels.launching.launches`; CuPy's own kernels are not counted): where the host time of an op goes.
Run: PYTHONPATH=$PWD python3 bench/overhead.py [--rounds 15] [--chains 5] [--device all|cpu|cuda] [--split]
     [--chain elementwise|linear|matmul] [--profile 20]
"""
import argparse
import cProfile
import os
import pstats
import statistics
import time

import common

import flame_core as flame

N_OPS = 200


def chain(x):
    """N_OPS small ops on a FLAME or a torch tensor (the same methods on both)."""
    y = x
    for _ in range(N_OPS // 4):
        y = y * 1.01
        y = y + 0.5
        y = y.tanh()
        y = y - x
    return y.sum()


def linear_chain(linear, layers):
    """`--chain linear`: N_OPS ops, N_OPS / 2 times linear then tanh (linear: F.linear of FLAME or torch)."""
    def run(x):
        y = x
        for w, b in layers:
            y = linear(y, w, b).tanh()
        return y.sum()
    return run


def matmul_chain(weights):
    """`--chain matmul`: N_OPS ops, N_OPS / 2 times `y @ W` then tanh (the same on FLAME and torch tensors)."""
    def run(x):
        y = x
        for w in weights:
            y = (y @ w).tanh()
        return y.sum()
    return run


def _trial(side, chains):
    """Median µs/op over `chains` consecutive chains (forward + backward, synchronized)."""
    x, sync, run, params = side[1:]
    out = []
    for _ in range(chains):
        for p in params:
            p.grad = None
        t = time.perf_counter()
        run(x).backward()
        sync()
        out.append((time.perf_counter() - t) / N_OPS * 1e6)
    return statistics.median(out)


def _split_trial(side, chains):
    """(forward, backward) median µs/op over `chains` chains, a synchronize after each half."""
    x, sync, run, params = side[1:]
    fw, bw = [], []
    for _ in range(chains):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        y = run(x)
        sync()
        t1 = time.perf_counter()
        y.backward()
        sync()
        t2 = time.perf_counter()
        fw.append((t1 - t0) / N_OPS * 1e6)
        bw.append((t2 - t1) / N_OPS * 1e6)
    return statistics.median(fw), statistics.median(bw)


def _side(name, lib, linear, device, kind, sync):
    """(name, x, sync, run, the tensors whose .grad a chain resets) for FLAME or torch (lib: the module)."""
    lib.manual_seed(0)
    if kind == "elementwise":
        x = lib.randn(16, device=device, requires_grad=True)
        return name, x, sync, chain, [x]
    x = lib.randn(16, 64, device=device, requires_grad=True)
    if kind == "matmul":
        ws = [(lib.randn(64, 64, device=device) * 0.125).requires_grad_() for _ in range(N_OPS // 2)]
        return name, x, sync, matmul_chain(ws), [x] + ws
    layers = [((lib.randn(64, 64, device=device) * 0.125).requires_grad_(),
               (lib.randn(64, device=device) * 0.1).requires_grad_()) for _ in range(N_OPS // 2)]
    return name, x, sync, linear_chain(linear, layers), [x] + [t for wb in layers for t in wb]


def _flame_side(device, kind):
    if device == "cuda":
        import cupy
        sync = cupy.cuda.Device().synchronize
    else:
        def sync():
            pass
    import flame_nn.functional as F
    return _side("flame", flame, F.linear, device, kind, sync)


def _torch_side(torch, device, kind):
    if device == "cuda":
        sync = torch.cuda.synchronize
    else:
        def sync():
            pass
    return _side("torch", torch, torch.nn.functional.linear if kind == "linear" else None, device, kind, sync)


def _spread(values):
    v = sorted(values)
    if len(v) >= 2:
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
    else:
        q1 = q3 = v[0]
    return {"min": v[0], "q1": q1, "median": statistics.median(v), "q3": q3, "max": v[-1]}


def interleaved(device, torch, rounds, chains, warmup=5, split=False, kind="elementwise"):
    """The A/B protocol of the docstring on one device; torch=None times FLAME alone. split: the forward / backward
    rounds after the whole-chain ones (row["split"]). kind: the chain (`elementwise` or `linear`)."""
    sides = [_flame_side(device, kind)]
    if torch is not None:
        sides.append(_torch_side(torch, device, kind))
    for _, x, sync, run, params in sides:  # warm-up: kernel compilation, caches, the memory pools' free lists
        for _ in range(warmup):
            for p in params:
                p.grad = None
            run(x).backward()
        sync()
    per = {side[0]: [] for side in sides}
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            per[side[0]].append(_trial(side, chains))
    row = {"device": device, "flame_us_per_op": statistics.median(per["flame"]), "torch_us_per_op": None,
           "ratio": None, "ratio_of_medians": None, "ratio_spread": None, "flame_spread": _spread(per["flame"]),
           "torch_spread": None, "rounds": rounds, "chains_per_trial": chains, "flame_rounds": per["flame"],
           "torch_rounds": None, "chain": kind}
    if torch is not None:
        ratios = [f / t for f, t in zip(per["flame"], per["torch"])]
        row.update(torch_us_per_op=statistics.median(per["torch"]), ratio=statistics.median(ratios),
                   ratio_spread=_spread(ratios), torch_spread=_spread(per["torch"]), torch_rounds=per["torch"],
                   ratio_rounds=ratios)
        row["ratio_of_medians"] = row["flame_us_per_op"] / row["torch_us_per_op"]
    if split:
        row["split"] = _split_rounds(sides, rounds, chains)
    return row


def _split_rounds(sides, rounds, chains):
    """Forward and backward µs/op per framework (medians over rounds) and, with torch, the medians of the per-round
    ratios FLAME / torch of each half."""
    per = {side[0]: [] for side in sides}
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            per[side[0]].append(_split_trial(side, chains))
    out = {}
    for name, vals in per.items():
        out[f"{name}_forward"] = statistics.median(v[0] for v in vals)
        out[f"{name}_backward"] = statistics.median(v[1] for v in vals)
    if "torch" in per:
        for k, half in enumerate(("forward", "backward")):
            out[f"{half}_ratio"] = statistics.median(f[k] / t[k] for f, t in zip(per["flame"], per["torch"]))
    return out


def profile(device, kind, n, top=30):
    """cProfile of `n` FLAME chains on `device`, forward and backward apart, and the packed launches per chain: a
    text report (also the returned dict's "report"). Function.apply runs its Python version while profiled
    (function.hold_python_apply): Python 3.12's cProfile lost the frames around the C one, run_backward's among them."""
    from flame_core.autograd import function
    function.hold_python_apply(True)
    try:
        return _profile(device, kind, n, top)
    finally:
        function.hold_python_apply(False)


def _profile(device, kind, n, top):
    from flame_core.kernels import launching
    _, x, sync, run, params = _flame_side(device, kind)
    for _ in range(5):
        run(x).backward()
    sync()
    prof = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    launches = {"forward": 0, "backward": 0}
    for _ in range(n):
        for p in params:
            p.grad = None
        n0 = launching.launches
        prof["forward"].enable()
        y = run(x)
        sync()
        prof["forward"].disable()
        n1 = launching.launches
        prof["backward"].enable()
        y.backward()
        sync()
        prof["backward"].disable()
        launches["forward"] += n1 - n0
        launches["backward"] += launching.launches - n1
    text = [f"\n## {kind} chain on {device}: packed kernel launches per chain: forward "
            f"{launches['forward'] / n:.1f}, backward {launches['backward'] / n:.1f} ({N_OPS} ops)"]
    for half, pr in prof.items():
        stats = pstats.Stats(pr).stats   # (file, line, function) -> (primitive calls, calls, own s, cumulative s, ..)
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        total = sum(v[2] for v in stats.values())
        text.append(f"\n### {half}, {n} chains: the top {len(rows)} functions by own time, per op of the chain "
                    f"(cProfile's own overhead inflates small frames; total {total / n / N_OPS * 1e6:.2f} us/op)")
        text.append(f"{'calls/op':>9} {'own us/op':>10} {'cum us/op':>10}  function")
        for (file, line, func), (_, calls, own, cum, _) in rows:
            where = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({func})"
            text.append(f"{calls / n / N_OPS:9.2f} {own / n / N_OPS * 1e6:10.3f} {cum / n / N_OPS * 1e6:10.3f}  "
                        f"{where}")
    return {"launches_per_chain": {k: v / n for k, v in launches.items()}, "report": "\n".join(text)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="A/B rounds per device (one FLAME and one torch trial each)")
    ap.add_argument("--chains", type=int, default=5, help="chains per trial (a trial's figure is their median)")
    ap.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    ap.add_argument("--no-torch", action="store_true", help="time FLAME alone even when torch is importable")
    ap.add_argument("--split", action="store_true", help="also time the forward and the backward apart (more rounds)")
    ap.add_argument("--chain", choices=("elementwise", "linear", "matmul"), default="elementwise",
                    help="the 200-op chain: elementwise ops (default), 100 x (linear, tanh) or 100 x (@, tanh)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then cProfile N of FLAME's chains per device (forward and backward apart)")
    args = ap.parse_args()
    if args.profile < 0:
        ap.error(f"--profile: a number of chains (0: none), got {args.profile}")
    torch = None if args.no_torch else common.import_torch()
    cuda = flame.cuda_is_available()
    res = common.Results("overhead" if args.chain == "elementwise" else f"overhead_{args.chain}")
    for dev in (d for d in ("cpu", "cuda") if args.device in ("all", d) and (d == "cpu" or cuda)):
        peer = torch if torch is not None and (dev == "cpu" or torch.cuda.is_available()) else None
        res.log(dev, interleaved(dev, peer, args.rounds, args.chains, split=args.split, kind=args.chain))
    reports = []
    if args.profile:
        for dev in (d for d in ("cpu", "cuda") if args.device in ("all", d) and (d == "cpu" or cuda)):
            prof = profile(dev, args.chain, args.profile)
            res.get(dev)["profile_launches_per_chain"] = prof["launches_per_chain"]
            reports.append(prof["report"])
        out_dir = os.environ.get("OUT")
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"overhead_{args.chain}_profile.txt"), "w") as f:
                f.write("\n".join(reports) + "\n")
    res.save()
    rows = []
    for dev in ("cpu", "cuda"):
        r = res.get(dev)
        if r is not None:
            sp = r["ratio_spread"]
            rows.append([dev, round(r["flame_us_per_op"], 2), round(r["torch_us_per_op"] or float("nan"), 2),
                         round(r["ratio"] or float("nan"), 2),
                         f"[{sp['min']:.2f}, {sp['q1']:.2f}-{sp['q3']:.2f}, {sp['max']:.2f}]" if sp else "(no torch)"])
    print(common.table(["device", "FLAME us/op", "torch us/op", "ratio", "ratio spread"], rows,
                       title=f"\n{N_OPS}-op {args.chain} chain, forward + backward, us/op; interleaved A/B, "
                             f"{args.rounds} rounds x {args.chains} chains; ratio = median of per-round FLAME/torch "
                             f"ratios [min, q1-q3, max]"))
    if args.split:
        rows = []
        for dev in ("cpu", "cuda"):
            sp = (res.get(dev) or {}).get("split")
            if sp:
                rows.append([dev] + [round(sp[k], 2) if sp.get(k) is not None else "-" for k in
                                     ("flame_forward", "torch_forward", "forward_ratio", "flame_backward",
                                      "torch_backward", "backward_ratio")])
        print(common.table(["device", "FLAME fwd", "torch fwd", "fwd ratio", "FLAME bwd", "torch bwd", "bwd ratio"],
                           rows, title="\nthe same chain's forward and backward timed apart, us/op (ratios: medians "
                                       "of per-round ratios)"))


    for text in reports:
        print(text)


if __name__ == "__main__":
    main()
