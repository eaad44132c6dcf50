"""Tuning sweep for the issue-4 kernels still short of their targets (same protocol as bench/kernels.py: L2 evicted
before each call, each call timed alone with CUDA events, median of 30):
  act   elementwise SiLU fwd / bwd and GELU(tanh) bwd at 4608x12288 bf16: variants of the 16-byte loop (vectors per
        thread, block size, grid, load / store cache hints) against torch and the library kernel;
  rms   rms_norm / layer_norm backward with weight gradients: the cluster-partial kernel (norm_bwd_cl) by cluster size
        and blocks per SM, against the per-block part rows and torch;
  gn    GroupNorm forward / backward: the register-slice kernels against the shared-memory ones and torch;
  tma   rms_norm / layer_norm backward with weight gradients: the bulk-copy kernel (norm_bwd_tma) by register cap,
        cluster size and stages (3 interleaved rounds), against norm_bwd_cl; then the kernel
        alone and the column sums alone for the fastest and the default;
  csum  the column sums' two forms (loader.column_sum_vec_rows: 0 = blocks of 32 x 32 with scalar loads, else
        blocks of 4 x rows with 16-byte loads) in the whole rms / LayerNorm backward and alone on the part rows of the
        default plan (3 interleaved rounds);
  plan  the bulk-copy backward by (register cap, blocks per SM, stages, column_sum_vec_rows, cluster, even grid):
        fewer blocks per SM, clusters or the even grid write fewer part rows (3 interleaved rounds).
  vpt   the bulk-copy backward by (16-byte vectors per thread, register cap, stages): one vector per thread puts
        twice the threads on a row (384 for 3072 bf16 columns) at fewer registers each, so more warps per SM for the
        same part rows (5 interleaved rounds with torch and the copy of x; x copy = GB/s over the copy's GB/s as in
        bench/kernels.py), then the kernel alone for the default and the fastest.
  ramp  the bulk-copy backward by (stages filled at entry, one-barrier block reduction, row loop, register cap,
        blocks per SM, stages, cluster): the first rows of all blocks not queued behind their later rows, one barrier
        per row instead of two, the weight (and the row's xhat and g between the passes) in registers (5 interleaved
        rounds with torch and the copy of x, as vpt).
  actvs the six activation rows of bench/kernels.py (library plans) against torch in 21 interleaved rounds;
  actgrid SiLU / GELU(tanh) backward by (U, block, most blocks: grid over the data or a grid-stride loop) vs torch;
  actstep the three activation backwards: the one-step 8-byte kernels (activations._STEP_PLANS) by (U, block) against
        the 16-byte loop kernels (their _PLANS) and torch in 11 shuffled interleaved rounds (medians, wins over torch).
Run: PYTHONPATH=$PWD python3 bench/kernel_sweep.py [act,actvs,actgrid,actstep,rms,gn,tma,csum,plan,vpt,ramp]"""
import itertools
import random
import statistics
import sys

sys.path.insert(0, "bench")
_args = sys.argv[1:]
sys.argv = sys.argv[:1]
import kernels as B  # noqa: E402  bench/kernels.py: time_ms, randn, flush_l2
import numpy as np  # noqa: E402
from flame_core.kernels import activations as A, loader as L, norms as K  # noqa: E402

cp, torch, F = B.cp, B.torch, B.F
SECTIONS = (_args[0].split(",") if _args else ["act", "rms", "gn"])

def _norm_inputs():
    """The norm sweeps' inputs: 4608x3072 bf16 x and dy, weight and bias, rms_norm's rstd and layer_norm's mean and
    rstd of x."""
    x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
    w, b = B.randn((3072,)) + 1, B.randn((3072,))
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    _, mean, rstd = K.layer_norm_forward(x, None, None, 1e-6)
    return x, dy, w, b, rs, mean, rstd


def _max_rel_diff(got, want):
    """Largest |got - want| over max |want| of the gradients (None entries skipped)."""
    return max(float(cp.abs(g.astype(np.float32) - r.astype(np.float32)).max() /
                     (float(cp.abs(r.astype(np.float32)).max()) + 1e-30))
               for g, r in zip(got, want) if g is not None)


def _tma_kernel_alone(x, dy, w, rs, mean, rstd, acc):
    """(ms, part rows) of the current bulk-copy backward plan's kernel launched alone (rms: acc 1, LayerNorm affine:
    acc 2), part rows written, no column sums."""
    kernel, grid, block, stages, smem, cl = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True)
    parts = cp.empty((acc, grid[0] // cl, 3072), dtype=np.float32)
    dx = cp.empty_like(x)
    args = (dy, x, w, L.null() if acc == 1 else mean, rs if acc == 1 else rstd, dx, parts[0],
            parts[acc - 1] if acc == 2 else L.null(), L.i64(4608), L.i32(3072), L.i32(int(acc == 1)),
            L.i32(0), L.i32(stages), L.i32(K.bwd_tma_opts(stages)))
    return B.time_ms(lambda: L.launch(kernel, grid, block, args, shared_mem=smem)), parts


def _act_ops():
    """{label: (FLAME call, torch call)} of the six activation rows of bench/kernels.py, 4608x12288 bf16."""
    x, dy = B.randn((4608, 12288), scale=2.0), B.randn((4608, 12288))
    return {"gelu(tanh) fwd": (lambda: A.gelu_forward(x, "tanh"), lambda: F.gelu(B.tt(x), approximate="tanh")),
           "gelu(erf) fwd": (lambda: A.gelu_forward(x, "none"), lambda: F.gelu(B.tt(x))),
           "gelu(tanh) bwd": (lambda: A.gelu_backward(dy, x, "tanh"),
                              B._torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy)),
           "gelu(erf) bwd": (lambda: A.gelu_backward(dy, x, "none"), B._torch_bwd(F.gelu, x, dy)),
           "silu fwd": (lambda: A.silu_forward(x), lambda: F.silu(B.tt(x))),
           "silu bwd": (lambda: A.silu_backward(dy, x), B._torch_bwd(F.silu, x, dy))}


def act_sweep():
    """The library's activation kernels under every (vectors per thread U, block) plan, then the two best plans of each
    kernel and torch in 3 interleaved rounds."""
    ops = _act_ops()
    for label, (ours, tor) in ops.items():
        res = []
        for plan in itertools.product((1, 2, 4, 8), (128, 256, 512)):
            A.plan_override = plan
            res.append((B.time_ms(ours), plan))
        res.sort()
        best = [p for _, p in res[:2]]
        rounds = {str(p): [] for p in best}
        rounds["torch"] = []
        for _ in range(3):
            for p in best:
                A.plan_override = p
                rounds[str(p)].append(B.time_ms(ours))
            rounds["torch"].append(B.time_ms(tor, torch_op=True))
        A.plan_override = None
        print(f"== {label}: " + ", ".join(f"{p} {t:.4f}" for t, p in res[:6]) + f" ... slowest {res[-1][1]} "
              f"{res[-1][0]:.4f}; default {B.time_ms(ours):.4f}\n   rounds (median of 3): "
              + ", ".join(f"{k} {statistics.median(v):.4f}" for k, v in rounds.items()), flush=True)


def actvs_sweep(rounds=21):
    """The library's activation kernels (their default plans) against torch in `rounds` interleaved rounds, the order
    of the two alternating from round to round: medians, torch / FLAME of the medians, and the rounds FLAME was
    faster in (ties: neither)."""
    ops = _act_ops()
    for label, (ours, tor) in ops.items():
        f, t = [], []
        for r in range(rounds):
            if r % 2:
                t.append(B.time_ms(tor, torch_op=True))
                f.append(B.time_ms(ours))
            else:
                f.append(B.time_ms(ours))
                t.append(B.time_ms(tor, torch_op=True))
        mf, mt = statistics.median(f), statistics.median(t)
        print(f"== {label}: FLAME {mf:.4f} ms (min {min(f):.4f} max {max(f):.4f}), torch {mt:.4f} (min {min(t):.4f} "
              f"max {max(t):.4f}); x torch {mt / mf:.4f}; FLAME faster in {sum(a < b for a, b in zip(f, t))}, torch "
              f"in {sum(b < a for a, b in zip(f, t))} of {rounds} rounds", flush=True)


def actstep_sweep(rounds=11):
    """Each activation backward: the loop kernel (its _PLANS entry), the one-step 8-byte kernel under several
    (U, block) and torch, in `rounds` interleaved rounds in a shuffled order (medians, x torch, rounds faster than
    torch). (The one-step forwards it also measured at commit 58de458 were removed.)"""
    names = {"gelu(tanh) bwd": ("gelu_bwd", 1), "gelu(erf) bwd": ("gelu_bwd", 0), "silu bwd": ("silu_bwd", -1)}
    default = dict(A._STEP_PLANS)
    rng = random.Random(0)
    for label, (ours, tor) in _act_ops().items():
        if label not in names:
            continue
        key = names[label]
        variants = {"loop " + str(A._PLANS[key]): None}
        variants.update({f"step {p}": p for p in ((1, 128), (2, 128), (1, 256), (2, 256), (4, 128))})

        def run(plan):
            A._STEP_PLANS = dict(default)
            A._STEP_PLANS.pop(key, None)
            if plan is not None:
                A._STEP_PLANS[key] = plan
            try:
                return B.time_ms(ours)
            finally:
                A._STEP_PLANS = dict(default)
        times = {v: [] for v in list(variants) + ["torch"]}
        order = list(times)
        for _ in range(rounds):
            rng.shuffle(order)
            for v in order:
                times[v].append(B.time_ms(tor, torch_op=True) if v == "torch" else run(variants[v]))
        mt = statistics.median(times["torch"])
        print(f"== {label}, median of {rounds} interleaved rounds; library default "
              f"{'step ' + str(default[key]) if key in default else 'loop'}")
        for v in sorted(times, key=lambda v: statistics.median(times[v])):
            t = statistics.median(times[v])
            wins = sum(a < b for a, b in zip(times[v], times["torch"]))
            print(f"  {v:16s} {t:.4f}  x torch {mt / t:.4f}  faster than torch in {wins}/{rounds}", flush=True)


def actgrid_sweep(rounds=7):
    """SiLU and GELU(tanh) backward (the two rows torch led by ~0.2% in actvs) by (U, block, most blocks): the grid
    covering the data (as now) or a grid-stride loop over at most 4, 8 or 16 blocks per SM, against torch in `rounds`
    interleaved rounds (medians, x torch)."""
    ops = {k: v for k, v in _act_ops().items() if k in ("silu bwd", "gelu(tanh) bwd")}
    sms = L.sm_count()
    default_max = A._MAX_BLOCKS
    configs = [(u, blk, mb) for u, blk in ((1, 256), (2, 128), (4, 128), (1, 512))
               for mb in (default_max, 16 * sms, 8 * sms, 4 * sms)]
    for label, (ours, tor) in ops.items():
        times = {c: [] for c in configs + ["torch"]}
        for _ in range(rounds):
            for c in configs:
                A.plan_override, A._MAX_BLOCKS = c[:2], c[2]
                times[c].append(B.time_ms(ours))
            times["torch"].append(B.time_ms(tor, torch_op=True))
        A.plan_override, A._MAX_BLOCKS = None, default_max
        mt = statistics.median(times["torch"])
        print(f"== {label} by (U, block, most blocks), median of {rounds} interleaved rounds, fastest first; default "
              f"plan {A._PLANS[('silu_bwd', -1)] if label.startswith('silu') else A._PLANS[('gelu_bwd', 1)]}")
        for c in sorted(times, key=lambda c: statistics.median(times[c])):
            t = statistics.median(times[c])
            print(f"  {str(c):26s} {t:.4f}  x torch {mt / t:.4f}", flush=True)


def rms_sweep():
    x, dy, w, b, rs, mean, rstd = _norm_inputs()
    q, wq = B.randn((110592, 128)), B.randn((128,)) + 1
    _, rq = K.rms_norm_forward(q, wq, 1e-6)
    dq = B.randn((110592, 128))
    tor = {"rms": B._torch_bwd(lambda t: F.rms_norm(t, (3072,), B.tt(w), eps=1e-6), x, dy),
           "qk": B._torch_bwd(lambda t: F.rms_norm(t, (128,), B.tt(wq), eps=1e-6), q, dq)}
    print("== torch: " + ", ".join(f"{k} {B.time_ms(f, torch_op=True):.4f}" for k, f in tor.items()))
    K.bwd_cluster = 0
    ref = K.rms_norm_backward(dy, x, w, rs)
    ref_ln = K.layer_norm_backward(dy, x, w, mean, rstd, b)
    ref_q = K.rms_norm_backward(dq, q, wq, rq)

    def show(tag):
        got = K.rms_norm_backward(dy, x, w, rs)
        gl = K.layer_norm_backward(dy, x, w, mean, rstd, b)
        gq = K.rms_norm_backward(dq, q, wq, rq)
        err = max(float(cp.abs(g.astype(np.float32) - r.astype(np.float32)).max())
                  for g, r in zip((*got, *gl[1:], gq[1]), (*ref, *ref_ln[1:], ref_q[1])))
        plan = K._bwd_plan(x.dtype, 4608, 3072, 1)
        print(f"{tag:28s} rms {B.time_ms(lambda: K.rms_norm_backward(dy, x, w, rs)):.4f}  "
              f"ln_aff {B.time_ms(lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b)):.4f}  "
              f"qk {B.time_ms(lambda: K.rms_norm_backward(dq, q, wq, rq)):.4f}  grid {plan[1][0]} block {plan[2][0]} "
              f"parts {plan[5]}  max|diff| {err:.3g}", flush=True)
    K.bwd_cluster = 0
    for v in (None, 1, 2):
        L.vpt_override = v
        show(f"per-block parts vpt {v}")
    modes = ((1, 255), (1, 80), (1, 72), (0, 255), (0, 80))
    for v, cl, (sm, regs), per_sm in itertools.product((None, 1), (1, 2, 4), modes, (None, 3, 4, 5)):
        L.vpt_override, K.bwd_cluster, K.bwd_cluster_grid = v, cl, per_sm
        K.bwd_cluster_smem, K.bwd_cluster_regs = sm, regs
        try:
            show(f"cl {cl} sm {sm} regs {regs} vpt {v} per_sm {per_sm}")
        except Exception as e:  # noqa: BLE001  (a plan the GPU refuses: print and go on)
            print(f"cl {cl} sm {sm} regs {regs} vpt {v} per_sm {per_sm}: {type(e).__name__}: {e}"[:300])
    L.vpt_override, K.bwd_cluster, K.bwd_cluster_grid = None, 2, None
    K.bwd_cluster_smem, K.bwd_cluster_regs = 1, 80
    # the column sum alone, by part rows
    for parts in (33, 66, 132, 264, 660):
        part = cp.random.standard_normal((parts, 3072), dtype=np.float32)
        print(f"column_sum {parts} rows: {B.time_ms(lambda: L.column_sum('norms', 'column_sum', part, x.dtype)):.4f}")


def gn_sweep():
    default = (K.use_gn_reg, K.gn_one_pass)
    # the shared-memory forward's statistics: two passes over the cache (0), one pass (1), one pass as it loads (2);
    # 3 interleaved rounds, median
    for shape in ((2, 320, 128, 128), (2, 640, 64, 64), (2, 960, 64, 64)):
        g = B.randn(shape)
        K.use_gn_reg = False
        ref = None
        times = {m: [] for m in (0, 1, 2)}
        for _ in range(3):
            for m in times:
                K.gn_one_pass = m
                y = K.group_norm_forward(g, 32, None, None, 1e-5)[0]
                ref = y if ref is None else ref
                err = float(cp.abs(y.astype(np.float32) - ref.astype(np.float32)).max())
                times[m].append(B.time_ms(lambda: K.group_norm_forward(g, 32, None, None, 1e-5)))
        copy = B.time_ms(lambda: cp.copyto(cp.empty_like(g), g))
        print(f"gn fwd {shape} (copy {copy:.4f}): " + "  ".join(
            f"stats {m}: {statistics.median(t):.4f} ({' '.join(f'{v:.4f}' for v in t)})" for m, t in times.items())
            + f"  max |y - y(0)| {err:.3g}", flush=True)
    K.use_gn_reg, K.gn_one_pass = default
    for shape in ((2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (2, 960, 64, 64)):
        g, gdy = B.randn(shape), B.randn(shape)
        c = shape[1]
        gw, gb = B.randn((c,), np.float32) + 1, B.randn((c,), np.float32)
        _, gm, gr = K.group_norm_forward(g, 32, None, None, 1e-5)
        tf = B.time_ms(lambda: F.group_norm(B.tt(g), 32, eps=1e-5), torch_op=True)
        tb = B.time_ms(B._torch_bwd(lambda t: F.group_norm(t, 32, eps=1e-5), g, gdy), torch_op=True)
        copy = B.time_ms(lambda: cp.copyto(cp.empty_like(g), g))
        outs = {}
        for reg, one in ((False, 0), (False, 1), (True, 1)):
            K.use_gn_reg, K.gn_one_pass = reg, one
            outs[reg, one] = (K.group_norm_forward(g, 32, gw, gb, 1e-5)[0],
                              *K.group_norm_backward(gdy, g, 32, gw, gm, gr, gb))
            print(f"gn {shape} reg {reg} one-pass {one}: "
                  f"fwd {B.time_ms(lambda: K.group_norm_forward(g, 32, None, None, 1e-5)):.4f}"
                  f" bwd {B.time_ms(lambda: K.group_norm_backward(gdy, g, 32, None, gm, gr)):.4f}"
                  f" bwd affine {B.time_ms(lambda: K.group_norm_backward(gdy, g, 32, gw, gm, gr, gb)):.4f}"
                  f"  (copy {copy:.4f}; torch fwd {tf:.4f} bwd {tb:.4f})", flush=True)
        for k in ((False, 1), (True, 1)):
            err = [float(cp.abs(a.astype(np.float32) - b_.astype(np.float32)).max())
                   for a, b_ in zip(outs[k], outs[False, 0])]
            print(f"   max |{k} - two-pass smem| y, dx, dw, db: {[f'{e:.3g}' for e in err]}")
    K.use_gn_reg, K.gn_one_pass = default


def probe():
    """Where the weight-gradient backward's time goes: its kernel alone (without the column sum), the same kernel with
    no part rows written, the dx-only kernel with the same plan, and the column sum alone; GroupNorm forward on the
    split path (partials, finalize, apply) against the cluster kernel."""
    x, dy = B.randn((4608, 3072)), B.randn((4608, 3072))
    w = B.randn((3072,)) + 1
    _, rs = K.rms_norm_forward(x, w, 1e-6)
    tw = B.tt(w).detach().clone().requires_grad_(True)
    tor = B._torch_bwd_many(lambda a, w_: F.rms_norm(a, (3072,), w_, eps=1e-6), (x, w), dy)
    print(f"== torch rms bwd dx only {B.time_ms(B._torch_bwd(lambda t: F.rms_norm(t, (3072,), tw, eps=1e-6), x, dy), torch_op=True):.4f}"
          f"  dx and dw {B.time_ms(tor, torch_op=True):.4f}  copy {B.time_ms(lambda: cp.copyto(cp.empty_like(x), x)):.4f}")
    dx = cp.empty_like(x)
    null = L.null()
    for acc_plan, (cl, sm, regs, per_sm) in itertools.product((0, 1), ((1, 1, 80, None), (2, 1, 80, None),
                                                                       (1, 1, 80, 3), (2, 0, 255, None))):
        K.bwd_cluster, K.bwd_cluster_smem, K.bwd_cluster_regs, K.bwd_cluster_grid = cl, sm, regs, per_sm
        kernel, grid, block, tpr, smem, parts = K._bwd_plan(x.dtype, 4608, 3072, 1)
        if acc_plan == 0:  # the dx-only kernel on the same grid / block
            kernel, smem = L.get_function("norms", "norm_bwdx2", x.dtype), 0
        K._dynamic_smem(kernel, smem)
        part = cp.empty((parts, 3072), np.float32)

        def run(p=part, kernel=kernel, grid=grid, block=block, smem=smem, tpr=tpr):
            L.launch(kernel, grid, block, (dy, x, w, null, rs, dx, p, null, L.i64(4608), L.i32(3072), L.i32(tpr),
                                           L.i32(1), L.i32(0), null, null, null, L.i32(1), L.i32(0)), shared_mem=smem)
        t_main = B.time_ms(run)
        t_noparts = B.time_ms(lambda: run(null)) if acc_plan else float("nan")
        t_both = B.time_ms(lambda: (run(), L.column_sum("norms", "column_sum", part, x.dtype)))
        print(f"{'dx-only' if acc_plan == 0 else 'dw':8s} cl {cl} sm {sm} regs {regs} per_sm {per_sm} grid {grid[0]} "
              f"block {block[0]}: kernel {t_main:.4f}  no part rows {t_noparts:.4f}  +column_sum {t_both:.4f}")
    K.bwd_cluster, K.bwd_cluster_smem, K.bwd_cluster_regs, K.bwd_cluster_grid = 2, 1, 80, None
    g = B.randn((2, 320, 128, 128))
    for cluster in (True, False):
        K.use_cluster = cluster
        print(f"gn fwd cluster {cluster}: {B.time_ms(lambda: K.group_norm_forward(g, 32, None, None, 1e-5)):.4f}")
    K.use_cluster = True
    rows, hw = 640, 128 * 128
    splits = K._gn_splits(rows, hw)
    print(f"gn split: splits {splits}; partials alone {B.time_ms(lambda: K._gn_partials(g, None, rows, hw, splits)):.4f}")
    a = cp.ones((rows,), np.float32)
    y = cp.empty_like(g)
    grid_, block_ = L.elementwise_grid(g.size, g.dtype)
    fn = L.get_function("groupnorm", "gn_apply", g.dtype)
    print(f"gn split: apply alone {B.time_ms(lambda: L.launch(fn, grid_, block_, (g, a, a, y, L.i64(g.size), L.i64(hw)))):.4f}"
          f"  partials + apply {B.time_ms(lambda: (K._gn_partials(g, None, rows, hw, splits), L.launch(fn, grid_, block_, (g, a, a, y, L.i64(g.size), L.i64(hw))))):.4f}")


def tma_sweep():
    x, dy, w, b, rs, mean, rstd = _norm_inputs()
    with L.reference():
        ref = K.rms_norm_backward(dy, x, w, rs)
        ref_ln = K.layer_norm_backward(dy, x, w, mean, rstd, b)
    tor = {"rms": B._torch_bwd_many(lambda t, w_: F.rms_norm(t, (3072,), w_, eps=1e-6), (x, w), dy),
           "ln_aff": B._torch_bwd_many(lambda t, w_, b_: F.layer_norm(t, (3072,), w_, b_, eps=1e-6), (x, w, b), dy)}
    print("== torch: " + ", ".join(f"{k} {B.time_ms(f, torch_op=True):.4f}" for k, f in tor.items()))
    src = cp.empty((3 * x.size,), x.dtype)
    dst = cp.empty_like(src)
    print(f"== copy of the same bytes: {B.time_ms(lambda: cp.copyto(dst, src)):.4f}")

    ops = {1: ("rms", lambda: K.rms_norm_backward(dy, x, w, rs), ref),
           2: ("ln_aff", lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b), ref_ln)}
    knobs = ("bwd_tma_regs", "bwd_tma_cluster", "bwd_tma_stages")
    default = {k: getattr(K, k) for k in knobs + ("bwd_tma",)}

    def err(acc):
        return _max_rel_diff(ops[acc][1](), ops[acc][2])

    def plan_of(acc):
        p = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True) if K.bwd_tma else None
        return f"grid {p[1][0]} block {p[2]} stages {p[3]} cl {p[5]}" if p else "norm_bwd_cl"

    def restore():
        for k, v in default.items():
            setattr(K, k, v)

    # (regs, cluster, stages) per case; None: norm_bwd_cl (before)
    grids = {acc: [None] + list(itertools.product(regs, (1, 2), (2, 3, 4)))
             for acc, regs in ((1, (80, 96)), (2, (80, 88, 96)))}
    for acc, configs in grids.items():
        name, fn, _ = ops[acc]
        times = {c: [] for c in configs}
        desc = {}
        for rnd in range(3):  # interleaved rounds: drifts hit every config alike
            for c in configs:
                K.bwd_tma = c is not None
                if c is not None:
                    for k, v in zip(knobs, c):
                        setattr(K, k, v)
                try:
                    if rnd == 0:
                        desc[c] = f"{plan_of(acc)}  max rel diff {err(acc):.3g}"
                    times[c].append(B.time_ms(fn))
                except Exception as e:  # noqa: BLE001  (a plan the GPU refuses: print and go on)
                    desc[c] = f"{type(e).__name__}: {e}"[:200]
                    times[c].append(float("inf"))
        restore()
        print(f"== {name} bwd 4608x3072 bf16, median of 3 interleaved rounds (ms), fastest first "
              f"(regs, cluster, stages):")
        for c in sorted(configs, key=lambda c: statistics.median(times[c])):
            print(f"  {str(c):28s} {statistics.median(times[c]):.4f}  "
                  f"({' '.join(f'{t:.4f}' for t in times[c])})  {desc[c]}", flush=True)
        # where the time goes: the kernel alone (part rows, no sums), the column sums alone
        best = min((c for c in configs if c), key=lambda c: statistics.median(times[c]))
        for cfg in dict.fromkeys((best, tuple(default[k] for k in knobs))):
            for k, v in zip(knobs, cfg):
                setattr(K, k, v)
            block = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True)[2]
            t_k, parts = _tma_kernel_alone(x, dy, w, rs, mean, rstd, acc)
            t_s = B.time_ms(lambda: L.column_sum("norms", "column_sum", parts, x.dtype))
            print(f"  {name} {cfg} block {block}: kernel alone {t_k:.4f}  column_sum of {parts.shape} alone "
                  f"{t_s:.4f}", flush=True)
        restore()


def csum_sweep():
    x, dy, w, b, rs, mean, rstd = _norm_inputs()
    grid = K._bwd_tma_plan(x.dtype, 4608, 3072, 1, True)[1]
    parts = {a: B.randn((a, grid[0], 3072)).astype(np.float32) for a in (1, 2)}
    fns = {"rms bwd": lambda: K.rms_norm_backward(dy, x, w, rs),
           "ln affine bwd": lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b),
           "column_sum 1 batch alone": lambda: L.column_sum("norms", "column_sum", parts[1], x.dtype),
           "column_sum 2 batches alone": lambda: L.column_sum("norms", "column_sum", parts[2], x.dtype)}
    default = L.column_sum_vec_rows
    forms = (0, 64, 128, 256)
    times = {(f, r): [] for f in fns for r in forms}
    for _ in range(3):
        for f, fn in fns.items():
            for r in forms:
                L.column_sum_vec_rows = r
                times[f, r].append(B.time_ms(fn))
    L.column_sum_vec_rows = default
    print(f"== column sums by form (column_sum_vec_rows; 0: scalar 32 x 32), part rows {grid[0]}, "
          f"median of 3 interleaved rounds (ms)")
    for f in fns:
        print(f"  {f:28s} " + "  ".join(f"{r}: {statistics.median(times[f, r]):.4f}" for r in forms), flush=True)


def plan_sweep():
    x, dy, w, b, rs, mean, rstd = _norm_inputs()
    fns = {"rms bwd": (lambda: K.rms_norm_backward(dy, x, w, rs), 1),
           "ln affine bwd": (lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b), 2)}
    knobs = ((K, "bwd_tma_regs"), (K, "bwd_tma_grid"), (K, "bwd_tma_stages"), (L, "column_sum_vec_rows"),
             (K, "bwd_tma_cluster"), (K, "bwd_tma_even"))
    default = tuple(getattr(m, k) for m, k in knobs)
    configs = [default, (96, None, 3, 128, 1, False), (128, None, 3, 128, 1, True), (128, None, 3, 128, 1, False),
               (96, None, 3, 128, 2, True), (96, None, 3, 0, 1, True), (96, None, 3, 0, 1, False)]
    for name, (fn, acc) in fns.items():
        times = {c: [] for c in configs}
        for _ in range(3):
            for c in configs:
                for (m, k), v in zip(knobs, c):
                    setattr(m, k, v)
                times[c].append(B.time_ms(fn))
        for (m, k), v in zip(knobs, default):
            setattr(m, k, v)
        print(f"== {name} 4608x3072 bf16 by (regs, blocks per SM, stages, column_sum_vec_rows, cluster, even grid), "
              f"median of 3 interleaved rounds (ms), fastest first; default {default}")
        for c in sorted(configs, key=lambda c: statistics.median(times[c])):
            for (m, k), v in zip(knobs, c):
                setattr(m, k, v)
            p = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True)
            print(f"  {str(c):34s} {statistics.median(times[c]):.4f}  ({' '.join(f'{t:.4f}' for t in times[c])})"
                  f"  grid {p[1][0]} stages {p[3]} part rows {p[1][0] // p[5]}", flush=True)
        for (m, k), v in zip(knobs, default):
            setattr(m, k, v)


def _knob_sweep(title, knobs, configs, rounds=5):
    """The whole rms / LayerNorm affine backward (4608x3072 bf16) under each config of norms.py `knobs`, in `rounds`
    interleaved rounds with torch and the copy of x (x copy = GB/s over the copy's GB/s as in bench/kernels.py), each
    config's max relative difference from the reference; then the kernel alone for the default and the fastest."""
    x, dy, w, b, rs, mean, rstd = _norm_inputs()
    with L.reference():
        refs = {1: K.rms_norm_backward(dy, x, w, rs), 2: K.layer_norm_backward(dy, x, w, mean, rstd, b)}
    fns = {1: ("rms", lambda: K.rms_norm_backward(dy, x, w, rs)),
           2: ("ln_aff", lambda: K.layer_norm_backward(dy, x, w, mean, rstd, b))}
    tor = {1: B._torch_bwd_many(lambda t, w_: F.rms_norm(t, (3072,), w_, eps=1e-6), (x, w), dy),
           2: B._torch_bwd_many(lambda t, w_, b_: F.layer_norm(t, (3072,), w_, b_, eps=1e-6), (x, w, b), dy)}
    dst = cp.empty_like(x)
    default = tuple(getattr(K, k) for k in knobs)
    configs = list(dict.fromkeys([default] + configs))

    def setc(c):
        for k, v in zip(knobs, c):
            setattr(K, k, v)

    for acc, (name, fn) in fns.items():
        times = {c: [] for c in configs + ["torch", "copy"]}
        desc = {}
        for c in configs:
            setc(c)
            p = K._bwd_tma_plan(x.dtype, 4608, 3072, acc, True)
            desc[c] = (f"grid {p[1][0]} block {p[2][0]} regs {p[0].num_regs} stages {p[3]}  "
                       f"max rel diff {_max_rel_diff(fn(), refs[acc]):.3g}")
        for _ in range(rounds):  # interleaved rounds: drifts hit every config alike
            for c in configs:
                setc(c)
                times[c].append(B.time_ms(fn))
            times["torch"].append(B.time_ms(tor[acc], torch_op=True))
            times["copy"].append(B.time_ms(lambda: cp.copyto(dst, x)))
        copy = statistics.median(times["copy"])
        print(f"== {name} bwd 4608x3072 bf16 by {title} {knobs}, median of {rounds} interleaved rounds (ms), fastest "
              f"first; copy of x {copy:.4f} ms")
        for c in sorted(times, key=lambda c: statistics.median(times[c])):
            t = statistics.median(times[c])
            print(f"  {str(c):22s} {t:.4f}  x copy {1.5 * copy / t:.3f}  ({' '.join(f'{v:.4f}' for v in times[c])})"
                  f"  {desc.get(c, '')}", flush=True)
        best = min(configs, key=lambda c: statistics.median(times[c]))
        for c in dict.fromkeys((default, best)):  # the kernel alone (part rows, no sums)
            setc(c)
            print(f"  {name} {c}: kernel alone {_tma_kernel_alone(x, dy, w, rs, mean, rstd, acc)[0]:.4f}",
                  flush=True)
        setc(default)


def vpt_sweep():
    _knob_sweep("(vectors per thread, regs, stages)", ("bwd_tma_vpt", "bwd_tma_regs", "bwd_tma_stages"),
                [(1, 56, 3), (1, 56, 4), (1, 56, 2), (1, 64, 3), (1, 80, 3)])


def ramp_sweep():
    _knob_sweep("(stages filled at entry, one-barrier reduction, row loop, regs, blocks per SM, stages, cluster)",
                ("bwd_tma_early", "bwd_tma_one_barrier", "bwd_tma_loop", "bwd_tma_regs", "bwd_tma_grid",
                 "bwd_tma_stages", "bwd_tma_cluster"),
                [(2, True, 1, 96, None, 3, 1), (1, True, 1, 112, None, 3, 1), (2, True, 1, 112, None, 3, 1),
                 (2, True, 2, 96, None, 3, 1), (1, True, 2, 96, None, 3, 1), (2, True, 2, 112, None, 3, 1),
                 (1, True, 2, 112, None, 3, 1), (1, True, 2, 128, None, 3, 1), (1, True, 2, 112, None, 4, 1),
                 (2, True, 2, 112, None, 4, 1), (2, True, 2, 96, 2, 3, 1), (1, True, 2, 96, None, 3, 2),
                 (2, True, 2, 96, None, 2, 1)])


if __name__ == "__main__":
    cp.random.seed(0)
    for s in SECTIONS:
        {"act": act_sweep, "rms": rms_sweep, "gn": gn_sweep, "probe": probe, "tma": tma_sweep, "csum": csum_sweep,
         "plan": plan_sweep, "vpt": vpt_sweep, "ramp": ramp_sweep, "actvs": actvs_sweep,
         "actgrid": actgrid_sweep, "actstep": actstep_sweep}[s]()
