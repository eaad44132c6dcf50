"""conv2d (3x3, padding 1, bf16) at the SDXL / VAE shapes of PEERS.md: FLAME side by side with
torch.nn.functional.conv2d (cuDNN) in the same process.

    PYTHONPATH=$PWD python3 bench/conv.py [--shapes sdxl_l0,sdxl_l1] [--repeats 20] [--variant auto,im2col,...]

Variants (comma-separated, each timed at every shape; the first one decides the acceptance line). A variant is one
or more settings joined by '+':
    auto                  what conv2d picks (per pass: im2col + cuBLAS for column matrices up to IM2COL_MAX_BYTES,
                          else the implicit GEMM of cuda_src/conv_igemm.cu, tile/split by its model)
    im2col                the im2col kernel + cuBLAS GEMM path for every pass (FLAME_CONV_ALGO=im2col)
    igemm                 the implicit GEMM for every pass, tiles by the model (FLAME_CONV_ALGO=igemm)
    igemm:TILE[:sN]       the implicit GEMM for every pass with a forced forward / dx tile (FLAME_CONV_TILE; also the
                          dw tile when TILE serves dw) and optionally N reduction slices: 128x128, 64x128, 128x256,
                          128x256p2, 320x128, 320x128p3, 160x256 (see TILES in flame_core/kernels/conv.py)
    dwtile:TILE[:sN]      a forced dw tile (FLAME_CONV_DW_TILE): 128x128, 64x128, 128x256, 128x256p2
    fwd=A, dx=A, dw=A     the algorithm (auto, im2col, igemm) of one pass, e.g. igemm:320x128+dw=im2col
Times are CUDA-event medians after warm-up; fwd+bwd computes dx and dw (grads reset to None between runs); the
'dx ms' / 'dw ms' columns time conv2d_backward for one gradient alone (the path the variant picks for it).
FLOP: fwd = 2*N*O*H*W*C*9, fwd+bwd = 3x fwd. Prints a table last and writes $OUT/conv_bench.json (or ./).
Breakdown columns, per chunk: im2col path: the im2col kernel and the GEMM; implicit GEMM: the NHWC copy of x (in the
'im2col ms' column) and the conv kernel with its split reduction (in the 'gemm ms' column); chunks = image chunks.
"""
import argparse
import json
import os
import sys

import numpy as np

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.ops import conv as C

SHAPES = {  # name: (N, C, H, W, O) - 3x3, padding 1
    "sdxl_l0": (2, 320, 128, 128, 320),
    "sdxl_l1": (2, 640, 64, 64, 640),
    "sdxl_l2": (2, 1280, 32, 32, 1280),
    "vae_dec_256": (1, 512, 256, 256, 512),
    "vae_dec_full": (1, 128, 1024, 1024, 128),
}
ACCEPT = ("sdxl_l0", "sdxl_l1", "sdxl_l2")  # acceptance: >= 0.5x cuDNN here


BUSY_BYTES = 1 << 30  # a 1 GiB memset (~0.35 ms) queued before each timed call


def cuda_time_ms(fn, repeats, warmup=3):
    """Median GPU milliseconds of fn(), each call timed alone between CUDA events. Before each call a 1 GiB memset is
    queued, so the GPU is still busy while the host issues the call's launches: the interval measures the GPU's work,
    not the Python that precedes the first launch (FLAME's conv2d is ~2-4 launches issued from Python; cuDNN's one
    launch from C++ -- both sides get the same treatment, see bench_torch)."""
    cp = backend.cupy
    busy = cp.empty(BUSY_BYTES, dtype=cp.uint8)
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    stream = cp.cuda.get_current_stream()
    for _ in range(repeats):
        cp.cuda.runtime.memsetAsync(busy.data.ptr, 0, BUSY_BYTES, stream.ptr)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    del busy
    return float(np.median(times))


VARIANT_ENV = ("FLAME_CONV_ALGO", "FLAME_CONV_TILE", "FLAME_CONV_DW_TILE")


def set_variant(v):
    """Point conv2d at a variant through its environment switches."""
    for k in VARIANT_ENV:
        os.environ.pop(k, None)
    algo = {p: "auto" for p in C.PASSES}
    for part in v.split("+"):
        part = part.strip()
        if part in ("auto", "im2col", "igemm"):
            algo = {p: part for p in C.PASSES}
        elif part.startswith("igemm:"):
            algo = {p: "igemm" for p in C.PASSES}
            os.environ["FLAME_CONV_TILE"] = part[len("igemm:"):]
        elif part.startswith("dwtile:"):
            os.environ["FLAME_CONV_DW_TILE"] = part[len("dwtile:"):]
        elif part.partition("=")[0] in C.PASSES and part.partition("=")[2] in ("auto", "im2col", "igemm"):
            algo[part.partition("=")[0]] = part.partition("=")[2]
        else:
            sys.exit(f"unknown variant setting {part!r} in {v!r}: auto, im2col, igemm, igemm:TILE[:sN], "
                     f"dwtile:TILE[:sN], fwd=|dx=|dw=auto|im2col|igemm")
    os.environ["FLAME_CONV_ALGO"] = ",".join(f"{p}={a}" for p, a in algo.items())


def breakdown(x, w, repeats):
    """(per-chunk first-pass ms, per-chunk GEMM ms, chunks, plan) of the path conv2d takes for x, w."""
    cp = backend.cupy
    N, Cin, H, W = x.shape
    O = w.shape[0]
    g = C.geometry(tuple(x.shape), tuple(w.shape), 1, 1, 1, 1)
    xa, wa = x._data, w._data
    if C.use_igemm(xa, g):
        from flame_core.kernels import conv as K
        Cp = K.round8(Cin)
        chunks = C._image_chunks(N, H * W * Cp * 2, C.workspace_bytes(True), H * W)
        k = chunks[0][1]
        wp = K.pack_weight(wa, Cp)
        first = cuda_time_ms(lambda: K.to_nhwc(xa[:k], Cp), repeats)
        xt = K.to_nhwc(xa[:k], Cp)
        cg = K.ConvGeom(k, H, W, Cp, O, H, W, 3, 3, 1, 1, 1, 1, 1, 1)
        y = cp.empty((k, O, H, W), dtype=xa.dtype)
        gemm = cuda_time_ms(lambda: K.conv_nhwc(xt, wp, y, cg), repeats)
        P = k * H * W
        fwd_plan = K.plan(O, P, -(-9 * Cp // K.BK), O * P, False, C.workspace_bytes(True))
        Op = K.round8(O)
        dx_plan = K.plan(Cin, P, -(-9 * Op // K.BK), Cin * P, False, C.workspace_bytes(True))
        dw_plan = K.plan(O, 9 * Cp, -(-P // K.BK), O * 9 * Cp, True, C.workspace_bytes(True), K.DW)
        return first, gemm, len(chunks), {"fwd (tile, k-tiles per slice, slices)": fwd_plan,
                                          "dx (tile, k-tiles per slice, slices)": dx_plan,
                                          "dw (tile, k-tiles per slice, slices)": dw_plan,
                                          "fwd kernel": K.kernel_info("conv_fwd_igemm", fwd_plan[0], xa.dtype),
                                          "dw kernel": K.kernel_info("conv_dw_igemm", dw_plan[0], xa.dtype)}
    n0, nimg, oh0, nrows = C.plan(g, 2, C.workspace_bytes(True))[0]
    first = cuda_time_ms(lambda: C.im2col(xa, g, n0, nimg, oh0, nrows), repeats)
    cols = C.im2col(xa, g, n0, nimg, oh0, nrows)
    w2 = wa.reshape(O, -1)
    gemm = cuda_time_ms(lambda: cp.matmul(w2, cols), repeats)
    return first, gemm, len(C.plan(g, 2, C.workspace_bytes(True))), None


def bench_flame(N, Cin, H, W, O, repeats):
    flame.manual_seed(0)
    x = flame.randn(N, Cin, H, W, device="cuda", dtype=flame.bfloat16, requires_grad=True)
    w = (flame.randn(O, Cin, 3, 3, device="cuda") * 0.02).to(flame.bfloat16).detach().requires_grad_(True)
    go = flame.randn(N, O, H, W, device="cuda", dtype=flame.bfloat16)
    fwd = cuda_time_ms(lambda: F.conv2d(x, w, padding=1), repeats)

    def fb():
        x.grad = None
        w.grad = None
        F.conv2d(x, w, padding=1).backward(go)
    fwdbwd = cuda_time_ms(fb, max(5, repeats // 2))
    # where the forward time goes: one chunk's first pass (im2col or NHWC copy) alone and its GEMM alone
    first, gemm, n_chunks, gemm_plan = breakdown(x.detach(), w.detach(), repeats)
    # backward by gradient: dx alone and dw alone, on arrays (each by the path this variant picks for it)
    g = C.geometry(tuple(x.shape), tuple(w.shape), 1, 1, 1, 1)
    xa, wa, ga = x.detach()._data, w.detach()._data, go._data
    dx_ms = cuda_time_ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=True, need_w=False), repeats)
    dw_ms = cuda_time_ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=False, need_w=True), repeats)
    paths = {p: "igemm" if C.use_igemm(xa, g, p) else "im2col" for p in C.PASSES}
    with flame.no_grad():
        y = F.conv2d(x, w, padding=1)
    r = dict(fwd_ms=fwd, fwdbwd_ms=fwdbwd, bwd_dx_ms=dx_ms, bwd_dw_ms=dw_ms, paths=paths, chunk_im2col_ms=first,
             chunk_gemm_ms=gemm, chunks=n_chunks)
    if gemm_plan:
        r["plan"] = gemm_plan
    return r, (x.detach(), w.detach(), y)


def bench_torch(x, w, repeats):
    import torch
    import torch.nn.functional as TF
    def to_torch(t):  # the same values (zero-copy through DLPack where CuPy exports bf16, else via float32)
        try:
            return torch.from_dlpack(t._data).clone()
        except Exception:
            return torch.from_numpy(t.float().numpy()).cuda().to(torch.bfloat16)
    xt = to_torch(x).requires_grad_(True)
    wt = to_torch(w).requires_grad_(True)
    go = torch.randn(xt.shape[0], wt.shape[0], xt.shape[2], xt.shape[3], device="cuda", dtype=torch.bfloat16)

    busy = torch.empty(BUSY_BYTES, dtype=torch.uint8, device="cuda")

    def t_time(fn, n):  # as cuda_time_ms: a 1 GiB memset queued before each timed call
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(n):
            busy.zero_()
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return float(np.median(ts))
    fwd = t_time(lambda: TF.conv2d(xt, wt, padding=1), repeats)

    def fb():
        xt.grad = None
        wt.grad = None
        TF.conv2d(xt, wt, padding=1).backward(go)
    fwdbwd = t_time(fb, max(5, repeats // 2))
    with torch.no_grad():
        y = TF.conv2d(xt, wt, padding=1)
    return dict(fwd_ms=fwd, fwdbwd_ms=fwdbwd), y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variant", default="auto", help="comma-separated variants, each settings joined by '+': auto, "
                    "im2col, igemm, igemm:TILE[:sN], dwtile:TILE[:sN], fwd=|dx=|dw=auto|im2col|igemm")
    args = ap.parse_args()
    if not backend.cuda_available():
        sys.exit("bench/conv.py needs a CUDA GPU with CuPy")
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:
        have_torch = False
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    saved_env = {k: os.environ.get(k) for k in VARIANT_ENV}
    results = {}
    for name in args.shapes.split(","):
        N, Cin, H, W, O = SHAPES[name]
        flops = 2 * N * O * H * W * Cin * 9
        t = None
        for vi, variant in enumerate(variants):
            set_variant(variant)
            f, (x, w, y) = bench_flame(N, Cin, H, W, O, args.repeats)
            r = {"shape": [N, Cin, H, W, O], "variant": variant, "flame": f}
            f["fwd_TFLOPs"] = flops / f["fwd_ms"] / 1e9
            f["fwdbwd_TFLOPs"] = 3 * flops / f["fwdbwd_ms"] / 1e9
            if have_torch:
                if t is None:
                    t, yt = bench_torch(x, w, args.repeats)
                    t["fwd_TFLOPs"] = flops / t["fwd_ms"] / 1e9
                    t["fwdbwd_TFLOPs"] = 3 * flops / t["fwdbwd_ms"] / 1e9
                    yb = yt.float().cpu().numpy()
                    del yt
                r["torch_cudnn"] = t
                ya = backend.cupy.asnumpy(y._data).astype(np.float32)
                r["max_rel_diff_vs_torch"] = float(np.abs(ya - yb).max() / np.abs(yb).max())
                r["ratio_fwd"] = t["fwd_ms"] / f["fwd_ms"]
                r["ratio_fwdbwd"] = t["fwdbwd_ms"] / f["fwdbwd_ms"]
            key = name if vi == 0 else f"{name}[{variant}]"
            results[key] = r
            print(key, json.dumps(r), flush=True)
            del x, w, y
            backend.cupy.get_default_memory_pool().free_all_blocks()
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    out = os.path.join(os.environ.get("OUT", "."), "conv_bench.json")
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nconv2d 3x3 pad 1, bf16 ({backend.cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()})")
    hdr = f"{'shape':<13}{'flame fwd ms':>13}{'TFLOP/s':>9}{'cuDNN ms':>10}{'ratio':>7}{'flame f+b ms':>14}" \
          f"{'TFLOP/s':>9}{'cuDNN ms':>10}{'ratio':>7}{'dx ms':>8}{'dw ms':>8}{'im2col ms':>11}{'gemm ms':>9}" \
          f"{'chunks':>7}  variant"
    print(hdr)
    for key, r in results.items():
        f, t = r["flame"], r.get("torch_cudnn", {})
        name = key.split("[")[0]
        print(f"{name:<13}{f['fwd_ms']:>13.3f}{f['fwd_TFLOPs']:>9.1f}{t.get('fwd_ms', float('nan')):>10.3f}"
              f"{r.get('ratio_fwd', float('nan')):>7.2f}{f['fwdbwd_ms']:>14.3f}{f['fwdbwd_TFLOPs']:>9.1f}"
              f"{t.get('fwdbwd_ms', float('nan')):>10.3f}{r.get('ratio_fwdbwd', float('nan')):>7.2f}"
              f"{f['bwd_dx_ms']:>8.3f}{f['bwd_dw_ms']:>8.3f}{f['chunk_im2col_ms']:>11.3f}{f['chunk_gemm_ms']:>9.3f}{f['chunks']:>7}  {r['variant']}")
    ok = [results[n].get("ratio_fwd", 0) >= 0.5 for n in ACCEPT if n in results]
    print(f"acceptance (fwd >= 0.5x cuDNN at SDXL shapes, variant {variants[0]}): "
          f"{'PASS' if ok and all(ok) else 'FAIL'}")


if __name__ == "__main__":
    main()
