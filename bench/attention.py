"""Attention forward and forward+backward (bf16, non-causal) at Flux / SD3.5 / SDXL shapes: FLAME's flash kernels side
by side with torch SDPA's backends (FlashAttention-2, cuDNN, memory-efficient) in the same process.

Times are medians over repeats of CUDA-event intervals, each around `--inner` back-to-back calls (the host's launch
time overlaps the GPU work, for torch and FLAME alike), after warm-up, on random normal inputs (B, H, L, D)
contiguous. FLAME runs its kernels with their launch glue (flame_core.kernels.attention, the level the Tensor op
calls). TFLOP/s counts 4 B H Lq Lk D for the forward and 3.5x that for forward+backward. "x" columns are torch's time
over FLAME's (above 1: FLAME is faster). Each FLAME output is checked against torch's before timing. Also per shape:
the GPU time alone of the forward and of forward+backward (a 1 GiB memset queued first, so the host has issued every
call before the first starts) and the host microseconds per call, FLAME and torch FA2.
Run: PYTHONPATH=$PWD python3 bench/attention.py [--reps 25] [--only flux-1024,sdxl-cross]
     PYTHONPATH=$PWD python3 bench/attention.py --only flux-1024 --key-mask 129   (Chroma's masked T5 padding)
     PYTHONPATH=$PWD python3 bench/attention.py --fwd-variants plain,cpasync,plain:128x2x3   (the sm90 forward's
     variants, A/B; no torch needed: pingpong = SM90_FWD_PINGPONG, overlap = SM90_FWD_OVERLAP, cpasync =
     SM90_FWD_TMA off, ":BNxNWGxSTAGES" its tiles)
     PYTHONPATH=$PWD python3 bench/attention.py --bwd-variants plain,tail,tail:0.08,cpasync   (the backward alone:
     its tail schedule off / on, Q / dO by cp.async instead of TMA; no torch needed)
"""
import argparse
import statistics
import sys

import common
import numpy as np

SHAPES = [  # name, B, H, Lq, Lk, D
    ("flux-1024", 1, 24, 4608, 4608, 128),
    ("flux-512", 1, 24, 1536, 1536, 128),
    ("sd35-1024", 1, 38, 4250, 4250, 64),
    ("sd35-step", 1, 38, 4429, 4429, 64),        # the LoRA benches' SD3.5 step: 4096 image + 333 text tokens
    ("sdxl-self", 2, 10, 4096, 4096, 64),
    ("sdxl-cross", 2, 10, 4096, 77, 64),
]
BACKENDS = ("FA2", "cuDNN", "mem-eff")


def flame_fns(B, H, Lq, Lk, D, mask=None, tiles=None):
    """(forward, forward+backward, inputs q, k, v, dout) on CuPy bf16 arrays; `mask`: a bool key mask for FLAME;
    `tiles`: the forward's tiles (the sm90 kernel's (BN, consumer warpgroups, stages); None: the default)."""
    import cupy as cp
    import ml_dtypes

    from flame_core.kernels import attention as A
    rng = cp.random.default_rng(0)
    inputs = tuple(rng.standard_normal(s, dtype=cp.float32).astype(ml_dtypes.bfloat16)
                   for s in ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D), (B, H, Lq, D)))
    q, k, v, g = inputs
    scale = 1.0 / np.sqrt(D)

    def fwd():
        return A._kernel_forward(q, k, v, mask, False, scale, tiles)

    def fwd_bwd():
        o, lse = fwd()
        return o, A._kernel_backward(g, q, k, v, o, lse, mask, False, scale)
    return fwd, fwd_bwd, inputs


def torch_fns(torch, backend, inputs):
    """(forward, forward+backward, the first call for the check) of torch SDPA pinned to one backend."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    q, k, v, g = inputs
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with sdpa_kernel(backend), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)

    def fwd_bwd():  # the gradients accumulate from call to call, as a training loop's without zero_grad
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qr, kr, vr)
        out.backward(g)
        return out, (qr.grad, kr.grad, vr.grad)

    def first():  # values and fresh gradients, for the check against FLAME
        qr.grad = kr.grad = vr.grad = None
        out, grads = fwd_bwd()
        return out, tuple(t.clone() for t in grads)
    return fwd, fwd_bwd, first


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def measure(res, torch, name, B, H, Lq, Lk, D, reps, inner):
    import cupy as cp
    from torch.nn.attention import SDPBackend
    fwd, fwd_bwd, inputs = flame_fns(B, H, Lq, Lk, D)
    as_torch = (lambda a: torch.as_tensor(a.view(cp.uint16), device="cuda").view(torch.bfloat16))
    tin = [as_torch(a) for a in inputs]
    row = {"shape": (B, H, Lq, Lk, D), "flops": 4.0 * B * H * Lq * Lk * D,
           "flame_fwd_ms": common.cuda_ms(fwd, reps, 5, inner=inner)[0],
           "flame_fwd_bwd_ms": common.cuda_ms(fwd_bwd, reps, 5, inner=inner)[0]}
    o, (dq, dk, dv) = fwd_bwd()
    t_fns = {}
    for bname, be in zip(BACKENDS, (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION)):
        tf, tfb, first = torch_fns(torch, be, tin)
        t_fns[bname] = (tf, tfb)
        try:  # a backend that does not take this shape (or fails) is reported, not fatal
            tout, tgrads = first()
            if "check" not in row:  # FLAME against the first backend that ran
                row["check"] = {"ref": bname, "o": rel(as_torch(o), tout),
                                **{n: rel(as_torch(a), b) for n, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), tgrads)}}
            row[f"{bname}_fwd_ms"] = common.cuda_ms(tf, reps, 5, lib="torch", inner=inner)[0]
            row[f"{bname}_fwd_bwd_ms"] = common.cuda_ms(tfb, reps, 5, lib="torch", inner=inner)[0]
        except Exception as e:
            row[f"{bname}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    fa_f, fa_fb = t_fns["FA2"]
    for what, fl, tr in (("fwd", fwd, fa_f), ("fwd_bwd", fwd_bwd, fa_fb)):
        row[f"flame_{what}_gpu_ms"] = common.cuda_ms(fl, 15, 1, before=common.busy_gpu(), inner=inner)[0]
        row[f"fa2_{what}_gpu_ms"] = common.cuda_ms(tr, 15, 1, lib="torch", before=common.busy_gpu("torch"),
                                                   inner=inner)[0]
        row[f"flame_{what}_host_us"] = common.host_us(fl, n=200 if what == "fwd" else 100)
        row[f"fa2_{what}_host_us"] = common.host_us(tr, "torch", n=200 if what == "fwd" else 100)
    res.log(name, row)
    del inputs, tin, o, dq, dk, dv
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def measure_key_mask(res, torch, name, B, H, Lq, Lk, D, reps, inner, kept, text=512):
    """Chroma's key-padding mask (B, 1, 1, Lk): of the first `text` keys (the T5 tokens) only `kept` attended. FLAME
    masked (its key-padding kernels, and the element-wise bool mask they replace) against FLAME unmasked, and
    torch's memory-efficient SDPA with the same mask (the peers' path; cuDNN and FA2 take no boolean mask), the
    output checked against it."""
    import cupy as cp
    from torch.nn.attention import SDPBackend
    keep = np.ones((B, 1, 1, Lk), bool)
    keep[..., kept:text] = False
    fwd, fwd_bwd, inputs = flame_fns(B, H, Lq, Lk, D, cp.asarray(keep))
    plain_f, plain_fb, _ = flame_fns(B, H, Lq, Lk, D)
    as_torch = (lambda a: torch.as_tensor(a.view(cp.uint16), device="cuda").view(torch.bfloat16))
    q, k, v, g = (as_torch(a) for a in inputs)
    tmask = torch.as_tensor(keep, device="cuda")
    F = torch.nn.functional
    from torch.nn.attention import sdpa_kernel
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))

    def t_fwd():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=tmask)

    def t_fwd_bwd():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=tmask)
        o.backward(g)
        return o
    from flame_core.kernels import attention as A
    o, _ = fwd()
    keypad = A.SM90_KEYPAD
    try:  # the element-wise bool mask (kind 1) the key-padding kernels replace
        A.SM90_KEYPAD = False
        elementwise = {"flame_elementwise_fwd_ms": common.cuda_ms(fwd, reps, 5, inner=inner)[0],
                       "flame_elementwise_fwd_bwd_ms": common.cuda_ms(fwd_bwd, reps, 5, inner=inner)[0]}
    finally:
        A.SM90_KEYPAD = keypad
    row = {"shape": (B, H, Lq, Lk, D), "kept": kept, "text": text, "check_o": rel(as_torch(o), t_fwd()),
           "flame_masked_fwd_ms": common.cuda_ms(fwd, reps, 5, inner=inner)[0],
           "flame_masked_fwd_bwd_ms": common.cuda_ms(fwd_bwd, reps, 5, inner=inner)[0], **elementwise,
           "flame_fwd_ms": common.cuda_ms(plain_f, reps, 5, inner=inner)[0],
           "flame_fwd_bwd_ms": common.cuda_ms(plain_fb, reps, 5, inner=inner)[0],
           "memeff_masked_fwd_ms": common.cuda_ms(t_fwd, reps, 5, lib="torch", inner=inner)[0],
           "memeff_masked_fwd_bwd_ms": common.cuda_ms(t_fwd_bwd, reps, 5, lib="torch", inner=inner)[0]}
    res.log(name + "-keymask", row)
    print(f"{name}, key mask ({kept} of the first {text} keys attended): FLAME masked fwd "
          f"{row['flame_masked_fwd_ms']:.3f} / fwd+bwd {row['flame_masked_fwd_bwd_ms']:.3f} ms (SM90_KEYPAD="
          f"{keypad}; element-wise mask {row['flame_elementwise_fwd_ms']:.3f} / "
          f"{row['flame_elementwise_fwd_bwd_ms']:.3f}); unmasked "
          f"{row['flame_fwd_ms']:.3f} / {row['flame_fwd_bwd_ms']:.3f}; torch mem-eff masked "
          f"{row['memeff_masked_fwd_ms']:.3f} / {row['memeff_masked_fwd_bwd_ms']:.3f}; rel. error vs mem-eff "
          f"{row['check_o']:.2e}", flush=True)
    del inputs, o
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


# the sm90 forward's variants: (SM90_FWD_PINGPONG, SM90_FWD_TMA, SM90_FWD_OVERLAP) -- the schedule and how K / V
# are loaded; a variant may name its tiles too, "plain:128x2x3" (BN keys per tile, consumer warpgroups, K / V stages)
FWD_SWITCHES = ("SM90_FWD_PINGPONG", "SM90_FWD_TMA", "SM90_FWD_OVERLAP")
FWD_VARIANTS = {"plain": (False, True, False), "pingpong": (True, True, False), "overlap": (False, True, True),
                "cpasync": (False, False, False), "pingpong-cpasync": (True, False, False),
                "overlap-cpasync": (False, False, True), "pingpong-overlap": (True, True, True)}
SMEM_OPTIN = 232448  # the H100 / H200's shared memory per block (opt-in), static included


def _int_triple(t):
    """"AxBxC" as three ints, or None where it is not that."""
    try:
        ints = tuple(int(x) for x in t.split("x"))
    except ValueError:
        return None
    return ints if len(ints) == 3 else None


def parse_fwd_variant(v, D):
    """(pingpong, tma, overlap, tiles or None) of a --fwd-variants entry "schedule[:BNxNWGxSTAGES]" at head dim D;
    ValueError names what is wrong (an unknown schedule, tiles that are not three ints, or that need more shared
    memory than a block gets)."""
    name, _, t = v.partition(":")
    if name not in FWD_VARIANTS:
        raise ValueError(f"--fwd-variants: unknown schedule {name!r} in {v!r} (one of {', '.join(FWD_VARIANTS)})")
    tiles = None
    if t:
        tiles = _int_triple(t)
        if tiles is None or tiles[0] % 64 or not 0 < tiles[0] <= 256 or tiles[1] not in (1, 2) or tiles[2] < 1:
            raise ValueError(f"--fwd-variants: tiles {t!r} in {v!r} must be BNxNWGxSTAGES (BN a multiple of 64 up to "
                             "256, NWG 1 or 2, STAGES >= 1)")
        from flame_core.kernels.attention import sm90_fwd_smem
        smem = sm90_fwd_smem(D, *tiles) + 64   # (+ the kernel's static barriers and flags)
        if smem > SMEM_OPTIN:
            raise ValueError(f"--fwd-variants: {v!r} needs {smem} bytes of shared memory at head dim {D}, over the "
                             f"{SMEM_OPTIN} a block gets")
    return FWD_VARIANTS[name] + (tiles,)


def _alternate(A, names, setting, fn, variants, rounds, reps, inner, keep, gpu_too=False):
    """Time `fn` under each of `variants` in alternating rounds (clock drift hits all alike): setting(v) switches
    flame_core.kernels.attention's module switches `names` (restored after); the first round keeps keep(fn()) per
    variant. Returns ({variant: samples}, {variant: GPU-alone samples} (gpu_too), {variant: kept})."""
    saved = [getattr(A, n) for n in names]
    samples, gpu, outs = {v: [] for v in variants}, {v: [] for v in variants}, {}
    try:
        for r in range(rounds):
            for v in variants:
                setting(v)
                if r == 0:
                    outs[v] = keep(fn())
                samples[v] += common.cuda_ms(fn, reps, 5, inner=inner)[2]
                if gpu_too:
                    gpu[v] += common.cuda_ms(fn, 5, 1, before=common.busy_gpu(), inner=inner)[2]
    finally:
        for n, val in zip(names, saved):
            setattr(A, n, val)
    return samples, gpu, outs


def measure_fwd_variants(res, name, B, H, Lq, Lk, D, reps, inner, variants, rounds=3):
    """FLAME's sm90 forward under each schedule of `variants` in one process: the rounds alternate the variants
    (clock drift hits all alike), each variant's figure is the median of all its samples; its output is compared
    with the first variant's (bit-equal or the largest difference)."""
    import cupy as cp

    from flame_core.kernels import attention as A
    if not A._use_sm90(D, None, Lk):
        res.log(name + "-fwd-variants", {"skipped": "this shape does not run the sm90 forward here"})
        return
    try:
        parsed = {v: parse_fwd_variant(v, D) for v in variants}
    except ValueError as e:
        res.log(name + "-fwd-variants", {"skipped": str(e)})
        return
    fns, inputs, current = {}, None, [None]
    for v in variants:  # the same seed: every variant reads the same q, k, v
        fns[v], _, inputs = flame_fns(B, H, Lq, Lk, D, tiles=parsed[v][-1])

    def setting(v):
        for name, on in zip(FWD_SWITCHES, parsed[v][:-1]):
            setattr(A, name, on)
        current[0] = fns[v]
    samples, gpu, outs = _alternate(A, FWD_SWITCHES, setting, lambda: current[0](),
                                    variants, rounds, reps, inner, lambda out: (out[0].copy(), out[1].copy()),
                                    gpu_too=True)
    flops = 4.0 * B * H * Lq * Lk * D
    row = {"shape": (B, H, Lq, Lk, D), "flops": flops}
    o0, lse0 = outs[variants[0]]
    for v in variants:
        o, lse = outs[v]
        ms = statistics.median(samples[v])
        row[v] = {"ms": ms, "tflops": flops / ms / 1e9, "gpu_ms": statistics.median(gpu[v]),
                  "equal": bool((o == o0).all()) and bool((lse == lse0).all()),
                  "max_abs_o": float(cp.abs(o.astype(cp.float32) - o0.astype(cp.float32)).max()),
                  "max_abs_lse": float(cp.abs(lse - lse0).max())}
    res.log(name + "-fwd-variants", row)
    del inputs, outs
    cp.get_default_memory_pool().free_all_blocks()


def report_fwd_variants(res, shapes, variants):
    rows = []
    for name, *_ in shapes:
        r = res.get(name + "-fwd-variants")
        if not r or "skipped" in r:
            continue
        base = r[variants[0]]["ms"]
        for v in variants:
            c = r[v]
            rows.append([name if v == variants[0] else "", v, f"{c['ms']:.4f} ({c['tflops']:.0f})",
                         f"{c['gpu_ms']:.4f}", common.ratio(base, c["ms"], 3), "yes" if c["equal"] else "no",
                         f"{c['max_abs_o']:.2e} / {c['max_abs_lse']:.2e}"])
    return common.table(["shape", "schedule", "ms (TFLOP/s)", "GPU ms", f"x {variants[0]}", "bit-equal",
                         f"max |diff| O / lse vs {variants[0]}"], rows,
                        title=f"\nsm90 attention forward schedules, bf16, non-causal; x = {variants[0]} time / time")


def _bwd_variant(v):
    """(SM90_BWD_TAIL, TAIL_PIECE_COST, SM90_BWD_TMA, tiles) of a backward variant: plain, tail, tail:COST (Q / dO by
    TMA), or cpasync (the tail schedule, Q / dO by cp.async); any of them @NWGxSTAGESxBM runs the sm90 backward with
    those tiles instead of BWD_SM90_TILES' (e.g. tail@2x3x64)."""
    from flame_core.kernels import attention as A
    name, _, t = v.partition("@")
    tiles = None
    if t:
        tiles = _int_triple(t)
        if tiles is None or tiles[0] not in (1, 2) or tiles[1] < 1 or tiles[2] not in (64, 128):
            raise ValueError(f"--bwd-variants: {v!r}: tiles are NWGxSTAGESxBM (NWG 1 or 2, STAGES >= 1, BM 64 or 128), "
                             "e.g. tail@2x3x64")
    if name == "plain":
        return False, A.TAIL_PIECE_COST, True, tiles
    if name == "tail":
        return True, A.TAIL_PIECE_COST, True, tiles
    if name == "cpasync":
        return True, A.TAIL_PIECE_COST, False, tiles
    if name.startswith("tail:"):
        return True, float(name[5:]), True, tiles
    raise ValueError(f"--bwd-variants: unknown variant {v!r} (plain, tail, tail:COST, cpasync; @NWGxSTAGESxBM)")


def measure_bwd_variants(res, name, B, H, Lq, Lk, D, reps, inner, variants, rounds=3):
    """FLAME's backward alone (the forward's o and lse made once) under each variant of `variants` (the sm90
    backward's tail schedule off / on / with another piece cost), in alternating rounds as measure_fwd_variants; the
    gradients compared with the first variant's (the tail's fp32 sums change the order of additions, not the
    result beyond rounding)."""
    import cupy as cp

    from flame_core.kernels import attention as A
    fwd, _, inputs = flame_fns(B, H, Lq, Lk, D)
    q, k, v_, g = inputs
    o, lse = fwd()
    scale = 1.0 / np.sqrt(D)

    tiles = [None]

    def bwd():
        return A._kernel_backward(g, q, k, v_, o, lse, None, False, scale, tiles=tiles[0])
    chosen, search = [], A._bwd_tail   # the schedule the backward picks, seen where it asks for it

    def setting(v):
        A.SM90_BWD_TAIL, A.TAIL_PIECE_COST, A.SM90_BWD_TMA, tiles[0] = _bwd_variant(v)
        chosen.clear()

    def keep(grads):
        return tuple(x.astype(cp.float32) for x in grads), (chosen[0] if chosen else None)
    A._bwd_tail = lambda *a, **kw: chosen.append(search(*a, **kw)) or chosen[-1]
    A._bwd_plans.clear()
    try:
        samples, _, kept = _alternate(A, ("SM90_BWD_TAIL", "TAIL_PIECE_COST", "SM90_BWD_TMA"), setting, bwd,
                                      variants, rounds, reps, inner, keep)
    finally:
        A._bwd_tail = search
    outs = {v: kept[v][0] for v in variants}
    plans = {v: kept[v][1] for v in variants}
    flops = 2.5 * 4.0 * B * H * Lq * Lk * D
    row = {"shape": (B, H, Lq, Lk, D), "flops": flops}
    base = outs[variants[0]]
    for v in variants:
        ms = statistics.median(samples[v])
        diff = max(float(cp.abs(a - b).max() / (cp.abs(b).max() + 1e-30)) for a, b in zip(outs[v], base))
        row[v] = {"ms": ms, "tflops": flops / ms / 1e9, "schedule": plans[v], "max_rel_diff": diff}
    res.log(name + "-bwd-variants", row)
    del inputs, outs
    cp.get_default_memory_pool().free_all_blocks()


def report_bwd_variants(res, shapes, variants):
    rows = []
    for name, *_ in shapes:
        r = res.get(name + "-bwd-variants")
        if not r:
            continue
        base = r[variants[0]]["ms"]
        for v in variants:
            c = r[v]
            rows.append([name if v == variants[0] else "", v, str(c["schedule"]), f"{c['ms']:.4f} ({c['tflops']:.0f})",
                         common.ratio(base, c["ms"], 3), f"{c['max_rel_diff']:.1e}"])
    return common.table(["shape", "variant", "(whole, per)", "bwd ms (TFLOP/s)", f"x {variants[0]}",
                         "max |diff| / max"], rows,
                        title=f"\nattention backward alone, bf16, non-causal; x = {variants[0]} time / time")


def report(res, shapes):
    rows = []
    for name, *_ in shapes:
        r = res.get(name)
        if r is None:
            continue
        for what, mult in (("fwd", 1.0), ("fwd_bwd", 3.5)):
            mine = r[f"flame_{what}_ms"]
            cells = [name if what == "fwd" else "", what.replace("_", "+"),
                     f"{mine:.3f} ({mult * r['flops'] / mine / 1e9:.0f})"]
            times = [r.get(f"{b}_{what}_ms") for b in BACKENDS]
            cells += [f"{t:.3f}" if t else "n/a" for t in times]
            best = min((t for t in times if t), default=None)
            cells += [common.ratio(times[0], mine, 2), common.ratio(best, mine, 2),
                      f"{r[f'flame_{what}_gpu_ms']:.4f} / {r[f'fa2_{what}_gpu_ms']:.4f}",
                      f"{r[f'flame_{what}_host_us']:.0f} / {r[f'fa2_{what}_host_us']:.0f}"]
            rows.append(cells)
    return common.table(["shape", "pass", "FLAME ms (TFLOP/s)", "FA2 ms", "cuDNN ms", "mem-eff ms", "x FA2", "x best",
                         "GPU ms FLAME / FA2", "host us FLAME / FA2"], rows,
                        title="\nattention, bf16, non-causal; x = torch time / FLAME time")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--inner", type=int, default=5, help="back-to-back calls per timed interval")
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--key-mask", type=int, default=None, metavar="KEPT",
                    help="instead: FLAME with Chroma's key-padding mask (KEPT of the first 512 keys attended) "
                         "against itself unmasked and torch's mem-efficient SDPA with the mask")
    ap.add_argument("--fwd-variants", default=None, metavar="LIST",
                    help="instead: FLAME's sm90 forward under these schedules (comma-separated, first = baseline: "
                         + ", ".join(FWD_VARIANTS) + "; :BNxNWGxSTAGES picks the tiles, e.g. plain:128x2x3), timed in "
                         "alternating rounds, outputs compared")
    ap.add_argument("--bwd-variants", default=None, metavar="LIST",
                    help="instead: FLAME's backward alone under these variants (first = baseline): plain, tail, "
                         "tail:COST (the tail schedule with another piece cost), cpasync; @NWGxSTAGESxBM picks the "
                         "sm90 tiles (e.g. tail@2x3x64); in alternating rounds")
    args = ap.parse_args()
    if args.bwd_variants is not None:
        variants = [v.strip() for v in args.bwd_variants.split(",") if v.strip()]
        try:
            [_bwd_variant(v) for v in variants]
        except ValueError as e:
            sys.exit(str(e))
        if len(variants) < 2:
            sys.exit("--bwd-variants: give two or more variants")
        shapes = [sh for sh in SHAPES if args.only is None or sh[0] in args.only.split(",")]
        res = common.Results("attention_bwd_variants")
        failed = common.run_parts(res, [(sh[0], (lambda sh: lambda: measure_bwd_variants(
            res, *sh, args.reps, args.inner, variants))(sh)) for sh in shapes])
        print(report_bwd_variants(res, shapes, variants), flush=True)
        sys.exit(1 if failed else 0)
    if args.fwd_variants is not None:
        variants = [v.strip() for v in args.fwd_variants.split(",") if v.strip()]
        bad = [v for v in variants if v.partition(":")[0] not in FWD_VARIANTS]
        if bad or len(variants) < 2:
            sys.exit(f"--fwd-variants: give two or more of {', '.join(FWD_VARIANTS)} (got {args.fwd_variants!r})")
        shapes = [sh for sh in SHAPES if args.only is None or sh[0] in args.only.split(",")]
        res = common.Results("attention_fwd_variants")
        failed = common.run_parts(res, [(sh[0], (lambda sh: lambda: measure_fwd_variants(
            res, *sh, args.reps, args.inner, variants))(sh)) for sh in shapes])
        print(report_fwd_variants(res, shapes, variants), flush=True)
        sys.exit(1 if failed else 0)
    torch = common.import_torch()
    if torch is None:
        sys.exit("bench/attention.py compares with torch SDPA: torch is not importable")
    shapes = [sh for sh in SHAPES if args.only is None or sh[0] in args.only.split(",")]
    if args.key_mask is not None:
        res = common.Results("attention_key_mask")
        failed = common.run_parts(res, [(sh[0], (lambda sh: lambda: measure_key_mask(
            res, torch, *sh, args.reps, args.inner, args.key_mask))(sh)) for sh in shapes])
        sys.exit(1 if failed else 0)
    res = common.Results("attention")
    failed = common.run_parts(res, [(sh[0], (lambda sh: lambda: measure(res, torch, *sh, args.reps, args.inner))(sh))
                                    for sh in shapes])
    print(report(res, shapes), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
