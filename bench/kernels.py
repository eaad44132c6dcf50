"""Achieved bandwidth of the memory-bound FLAME kernels at Flux / SDXL sizes, side by side with PyTorch and with a
device-to-device copy of the same bytes, in one process on one GPU; plus fused AdamW over 44.8M params in 912 tensors
against torch.optim.AdamW(fused=True).

Protocol (the same for FLAME, PyTorch and the copy): inputs prepared once, 5 warm-up calls, then 30 calls, each
preceded by a read of a 256 MiB buffer that evicts L2 and a GPU-side wait of --hold-us microseconds (default 300: the
GPU is busy while Python queues the call's launches, so the events see the GPU's work, not the host's), each timed
alone with CUDA events; the median is taken. Each row repeats that in --rounds interleaved rounds (default 5; FLAME
and torch alternate which goes first, the copy after them) and reports the medians over the rounds and the rounds
FLAME was faster than torch in ("wins"). After each round one more block of the input's size is held on each side,
so each round's outputs land in new memory (where an output lands moves a copy-bound op by about +-0.4%; the rounds
sample that; --same-outputs turns it off). GB/s = (bytes the op must read + write) / time; the copy moves the op's
input bytes. The host time of each FLAME call (its launch overhead) is reported beside it.
Run: PYTHONPATH=$PWD python3 bench/kernels.py [--only norms,activations,...] [--rounds 5]
"""
import argparse
import math
import statistics

import common
import cupy as cp
import ml_dtypes
import numpy as np

from flame_core.kernels import activations, adamw, fp8, groupnorm, loader, modulate, norms, rope, softmax

torch = common.import_torch()
if torch is not None:
    import torch.nn.functional as F

BF16 = np.dtype(ml_dtypes.bfloat16)
REPS, WARM = 30, 5
ROUNDS = 5
MOVE_OUTPUTS = True
HOLD_US = 300

_FLUSH = cp.RawKernel(r'''
extern "C" __global__ void flush_read(const uint4* p, long long n, unsigned int* sink) {
    unsigned int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc ^= p[i].x ^ p[i].w;
    if (acc == 0x9e3779b9u) *sink = acc;  // practically never: keeps the loads alive
}''', "flush_read")
_HOLD = cp.RawKernel(r'''
extern "C" __global__ void hold(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}''', "hold")
_flush_buf = cp.ones(256 << 20, dtype=np.uint8)
_sink = cp.zeros(1, dtype=np.uint32)
_clock_khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"]
ROWS = []


def flush_l2():
    _FLUSH((1024,), (256,), (_flush_buf, np.int64(_flush_buf.size // 16), _sink))
    if HOLD_US:
        _HOLD((1,), (1,), (np.int64(HOLD_US * _clock_khz // 1000),))


def time_ms(fn, lib="cupy"):
    """(median ms, median host us) of fn() over REPS calls, each after an L2 eviction, each timed alone."""
    ms, host, _ = common.cuda_ms(fn, REPS, WARM, lib=lib, before=flush_l2)
    return ms, host * 1e3


def randn(shape, dtype=BF16, scale=1.0):
    return (cp.random.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def tt(a):
    return torch.from_dlpack(a) if torch is not None else None


def record(name, nbytes, flame_fn, torch_fn=None, copy_src=None, note=""):
    """One row: FLAME, torch and the copy of copy_src in ROUNDS interleaved rounds; medians over the rounds."""
    has_torch = torch is not None and torch_fn is not None
    src, dst = copy_src, cp.empty_like(copy_src)
    f, t, c, host, held = [], [], [], [], []
    for r in range(ROUNDS):
        for side in (("flame", "torch") if r % 2 == 0 else ("torch", "flame")):
            if side == "flame":
                ms, us = time_ms(flame_fn)
                f.append(ms)
                host.append(us)
            elif has_torch:
                t.append(time_ms(torch_fn, "torch")[0])
        c.append(time_ms(lambda: cp.copyto(dst, src))[0])
        if MOVE_OUTPUTS and r < ROUNDS - 1:  # hold the block each side's output of src's size just used
            held.append(cp.empty_like(src))
            if has_torch:
                held.append(torch.empty(src.nbytes, dtype=torch.uint8, device="cuda"))
    del held
    ms, copy_gbs = statistics.median(f), 2 * src.nbytes / statistics.median(c) / 1e6
    row = {"op": name, "bytes": int(nbytes), "flame_ms": round(ms, 4), "flame_GBps": round(nbytes / ms / 1e6, 1),
           "copy_GBps": round(copy_gbs, 1), "vs_copy": round(nbytes / ms / 1e6 / copy_gbs, 3),
           "flame_host_us": round(statistics.median(host), 1), "note": note, "flame_ms_rounds": f}
    if has_torch:
        tms = statistics.median(t)
        row.update(torch_ms=round(tms, 4), vs_torch=round(tms / ms, 3), torch_ms_rounds=t,
                   flame_wins=sum(a < b for a, b in zip(f, t)))
    ROWS.append(row)
    print(row, flush=True)


# ----------------------------------------------------------------------------- the ops
def bench_norms():
    x, dy = randn((4608, 3072)), randn((4608, 3072))
    w, b = randn((3072,)) + 1, randn((3072,))
    n = x.nbytes
    record("layer_norm fwd 4608x3072 (no affine, Flux LN0)", 2 * n,
           lambda: norms.layer_norm_forward(x, None, None, 1e-6),
           (lambda: F.layer_norm(tt(x), (3072,), eps=1e-6)), x)
    record("layer_norm fwd 4608x3072 (affine)", 2 * n, lambda: norms.layer_norm_forward(x, w, b, 1e-5),
           (lambda: F.layer_norm(tt(x), (3072,), tt(w), tt(b), eps=1e-5)), x)
    _, mean, rstd = norms.layer_norm_forward(x, None, None, 1e-6)
    record("layer_norm bwd 4608x3072 (no affine)", 3 * n, lambda: norms.layer_norm_backward(dy, x, None, mean, rstd),
           _torch_bwd(lambda t: F.layer_norm(t, (3072,), eps=1e-6), x, dy), x)
    record("rms_norm fwd 4608x3072 (weight)", 2 * n, lambda: norms.rms_norm_forward(x, w, 1e-6),
           (lambda: F.rms_norm(tt(x), (3072,), tt(w), eps=1e-6)), x)
    q = randn((4608 * 24, 128))
    wq = randn((128,)) + 1
    record("rms_norm fwd QK-norm 110592x128 (weight)", 2 * q.nbytes, lambda: norms.rms_norm_forward(q, wq, 1e-6),
           (lambda: F.rms_norm(tt(q), (128,), tt(wq), eps=1e-6)), q)
    _, rs = norms.rms_norm_forward(x, w, 1e-6)
    record("rms_norm bwd 4608x3072 (weight)", 3 * n, lambda: norms.rms_norm_backward(dy, x, w, rs),
           _torch_bwd_many(lambda t, w_: F.rms_norm(t, (3072,), w_, eps=1e-6), (x, w), dy), x,
           note="dx and dweight on both sides")
    record("layer_norm bwd 4608x3072 (affine)", 3 * n, lambda: norms.layer_norm_backward(dy, x, w, mean, rstd, b),
           _torch_bwd_many(lambda t, w_, b_: F.layer_norm(t, (3072,), w_, b_, eps=1e-6), (x, w, b), dy), x,
           note="dx, dweight and dbias on both sides")
    g = randn((2, 320, 128, 128))
    gdy = randn((2, 320, 128, 128))
    record("group_norm fwd 2x320x128x128 G32", 2 * g.nbytes,
           lambda: groupnorm.group_norm_forward(g, 32, None, None, 1e-5),
           (lambda: F.group_norm(tt(g), 32, eps=1e-5)), g)
    _, gm, gr = groupnorm.group_norm_forward(g, 32, None, None, 1e-5)
    record("group_norm bwd 2x320x128x128 G32", 3 * g.nbytes,
           lambda: groupnorm.group_norm_backward(gdy, g, 32, None, gm, gr),
           _torch_bwd(lambda t: F.group_norm(t, 32, eps=1e-5), g, gdy), g)
    record("group_norm+silu fwd 2x320x128x128 G32 (fused)", 2 * g.nbytes,
           lambda: groupnorm.group_norm_forward(g, 32, None, None, 1e-5, act="silu"),
           (lambda: F.silu(F.group_norm(tt(g), 32, eps=1e-5))), g, note="torch: two ops")
    record("group_norm+silu bwd 2x320x128x128 G32 (fused)", 3 * g.nbytes,
           lambda: groupnorm.group_norm_backward(gdy, g, 32, None, gm, gr, act="silu"),
           _torch_bwd(lambda t: F.silu(F.group_norm(t, 32, eps=1e-5)), g, gdy), g, note="torch: two ops")


def _torch_bwd(fn, x, dy):
    """Backward alone in torch: the graph is built once and retained."""
    if torch is None:
        return None
    xt = tt(x).detach().clone().requires_grad_(True)
    y = fn(xt)
    g = tt(dy)
    return lambda: torch.autograd.grad(y, xt, g, retain_graph=True)


def bench_activations():
    x, dy = randn((4608, 12288), scale=2.0), randn((4608, 12288))
    n = x.nbytes
    record("gelu(tanh) fwd 4608x12288", 2 * n, lambda: activations.gelu_forward(x, "tanh"),
           (lambda: F.gelu(tt(x), approximate="tanh")), x)
    record("gelu(erf) fwd 4608x12288", 2 * n, lambda: activations.gelu_forward(x, "none"), (lambda: F.gelu(tt(x))), x)
    record("gelu(tanh) bwd 4608x12288", 3 * n, lambda: activations.gelu_backward(dy, x, "tanh"),
           _torch_bwd(lambda t: F.gelu(t, approximate="tanh"), x, dy), x)
    record("silu fwd 4608x12288", 2 * n, lambda: activations.silu_forward(x), (lambda: F.silu(tt(x))), x)
    record("silu bwd 4608x12288", 3 * n, lambda: activations.silu_backward(dy, x), _torch_bwd(F.silu, x, dy), x)


def bench_softmax():
    s, dy = randn((4608, 4608), scale=3.0), randn((4608, 4608))
    n = s.nbytes
    record("softmax fwd 4608x4608", 2 * n, lambda: softmax.softmax_forward(s), (lambda: torch.softmax(tt(s), -1)), s)
    y = softmax.softmax_forward(s)
    record("softmax bwd 4608x4608", 3 * n, lambda: softmax.softmax_backward(dy, y),
           _torch_bwd(lambda t: torch.softmax(t, -1), s, dy), s)


def bench_modulate():
    x, y, dy = randn((1, 4608, 3072)), randn((1, 4608, 3072)), randn((1, 4608, 3072))
    sh, sc, gt = randn((1, 1, 3072)), randn((1, 1, 3072), scale=0.3), randn((1, 1, 3072))
    n = x.nbytes
    record("modulate fwd 1x4608x3072", 2 * n, lambda: modulate.modulate_forward(x, sh, sc),
           (lambda: tt(x) * (1 + tt(sc)) + tt(sh)), x, note="torch: eager x*(1+scale)+shift")
    record("modulate bwd 1x4608x3072", 3 * n, lambda: modulate.modulate_backward(dy, x, sh, sc),
           _torch_bwd_many(lambda a, s_, c_: a * (1 + c_) + s_, (x, sh, sc), dy), x)
    record("gated_residual fwd 1x4608x3072", 3 * n, lambda: modulate.gated_residual_forward(x, gt, y),
           (lambda: torch.addcmul(tt(x), tt(gt), tt(y))), x, note="torch: addcmul (one kernel)")
    record("gated_residual bwd 1x4608x3072", 3 * n, lambda: modulate.gated_residual_backward(dy, gt, y),
           _torch_bwd_many(lambda a, g_, b_: torch.addcmul(a, g_, b_), (x, gt, y), dy), x)


def _torch_bwd_many(fn, arrays, dy):
    if torch is None:
        return None
    ts = [tt(a).detach().clone().requires_grad_(True) for a in arrays]
    out = fn(*ts)
    g = tt(dy)
    return lambda: torch.autograd.grad(out, ts, g, retain_graph=True)


def _flux_freqs(L, D):
    pos = cp.arange(L, dtype=cp.float64)
    omega = 1.0 / 10000 ** (cp.arange(0, D, 2, dtype=cp.float64) / D)
    ang = pos[:, None] * omega
    f = cp.stack([cp.cos(ang), -cp.sin(ang), cp.sin(ang), cp.cos(ang)], -1).reshape(1, 1, L, D // 2, 2, 2)
    return f.astype(cp.float32)


def _torch_rope(x, f):
    xq = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (f[..., 0] * xq[..., 0] + f[..., 1] * xq[..., 1]).reshape(*x.shape).type_as(x)


def bench_rope():
    q = randn((1, 24, 4608, 128))
    f = _flux_freqs(4608, 128)
    record("rope fwd q 1x24x4608x128 (fp32 freqs)", 2 * q.nbytes + f.nbytes, lambda: rope.rope_forward(q, f),
           (lambda: _torch_rope(tt(q), tt(f))), q, note="torch: Flux apply_rope, eager")


def bench_fp8():
    w = randn((3072, 12288))
    n = w.size
    record("fp8 quantize per row 3072x12288", 3 * n + 4 * 3072, lambda: fp8.quantize_per_row(w),
           (lambda: _torch_quant(tt(w))), w, note="torch: amax, divide, cast (eager)")
    qb, s = fp8.quantize_per_row(w)
    qt = tt(qb).view(torch.float8_e4m3fn) if torch is not None else None
    record("fp8 dequantize per row 3072x12288", 3 * n + 4 * 3072, lambda: fp8.dequantize_per_row(qb, s, BF16),
           (lambda: qt.to(torch.bfloat16) * tt(s)[:, None].to(torch.bfloat16)), w, note="torch: cast, multiply")


def _torch_quant(x):
    amax = x.abs().amax(-1, keepdim=True).float()
    scale = amax / 448
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def bench_adamw():
    shapes = [(16, 3072)] * 456 + [(3072, 16)] * 456        # the peer's 44.8M params in 912 tensors (fp32)
    sizes = [a * b for a, b in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    total = int(sum(sizes))
    flat_w = randn((total,), np.float32)
    params = [flat_w[o:o + n].reshape(s).copy() for o, n, s in zip(offsets, sizes, shapes)]
    grad = randn((total,), np.float32)
    m, v = cp.zeros(total, np.float32), cp.zeros(total, np.float32)
    plan = adamw.adamw_plan(params, offsets)
    step = [0]

    def ours():
        step[0] += 1
        adamw.adamw_step(plan, grad, m, v, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                         step=step[0])
    torch_fn = None
    if torch is not None:
        tp = [torch.nn.Parameter(tt(p).clone()) for p in params]
        for p, o, n in zip(tp, offsets, sizes):
            p.grad = tt(grad[o:o + n]).reshape(p.shape).clone()
        opt = torch.optim.AdamW(tp, lr=1e-4, fused=True)
        torch_fn = opt.step
    record("adamw 44.8M fp32 params / 912 tensors", 28 * total, ours, torch_fn, flat_w,
           note="28 B/param: p, m, v read+write, g read; torch fused=True")


def copy_ceiling():
    a, b = cp.empty(1 << 30, dtype=np.uint8), cp.empty(1 << 30, dtype=np.uint8)
    return round(2 * a.nbytes / time_ms(lambda: cp.copyto(b, a))[0] / 1e6, 1)


def main():
    global HOLD_US, ROUNDS, MOVE_OUTPUTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated groups: norms,activations,softmax,modulate,rope,"
                                               "fp8,adamw")
    ap.add_argument("--hold-us", type=int, default=300, help="GPU-side wait queued before each timed call (0: none)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved FLAME / torch / copy rounds per row")
    ap.add_argument("--same-outputs", action="store_true", help="leave each side's outputs where its allocator puts "
                                                                "them in every round")
    args = ap.parse_args()
    HOLD_US, ROUNDS, MOVE_OUTPUTS = args.hold_us, args.rounds, not args.same_outputs
    if not loader.enabled():
        raise SystemExit("kernels are disabled (no GPU, or FLAME_KERNELS=0): nothing to measure")
    cp.random.seed(0)
    groups = dict(norms=bench_norms, activations=bench_activations, softmax=bench_softmax, modulate=bench_modulate,
                  rope=bench_rope, fp8=bench_fp8, adamw=bench_adamw)
    res = common.Results("kernels")
    ceiling = res.log("copy_1GiB_GBps", copy_ceiling())
    for g in [g for g in args.only.split(",") if g] or list(groups):
        groups[g]()
        cp.get_default_memory_pool().free_all_blocks()
    res.log("rows", ROWS)
    res.save()
    nan = math.nan
    print(common.table(["op", "FLAME ms", "GB/s", "x copy", "torch ms", "x torch", "wins", "host us"], [
        [r["op"], r["flame_ms"], round(r["flame_GBps"]), r["vs_copy"], r.get("torch_ms", nan), r.get("vs_torch", nan),
         f"{r.get('flame_wins', '-')}/{ROUNDS}", r["flame_host_us"]] for r in ROWS],
        title=f"\ncopy ceiling (1 GiB D2D) {ceiling} GB/s; median of {REPS} after L2 eviction and a {HOLD_US} us GPU "
              f"wait, {ROUNDS} interleaved rounds" + (", outputs in new memory each round" if MOVE_OUTPUTS else "")))


if __name__ == "__main__":
    main()
