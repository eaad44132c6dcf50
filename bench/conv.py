"""conv2d (3x3, padding 1, bf16) at SDXL UNet / VAE decoder shapes: FLAME side by side with
torch.nn.functional.conv2d (cuDNN) in the same process.

Each call is timed alone between CUDA events with a 1 GiB memset queued before it on both sides, so the interval is
the GPU's work and not the Python before the first launch (FLAME's conv2d issues 2-4 launches from Python, cuDNN one
from C++); median after warm-up. fwd+bwd computes dx and dw; 'dx ms' / 'dw ms' time conv2d_backward for one gradient
alone. FLOP: fwd = 2*N*O*H*W*C*9, fwd+bwd = 3x fwd. Ratio = cuDNN time / FLAME time (target >= 0.5 at the SDXL shapes).
Variants (comma-separated, each timed at every shape; the first decides the acceptance line), settings joined by '+':
    auto                  what conv2d picks (im2col + cuBLAS for column matrices up to IM2COL_MAX_BYTES, else the
                          implicit GEMM of cuda_src/conv_igemm.cu)
    im2col / igemm        that path for every pass (FLAME_CONV_ALGO)
    igemm:TILE[:sN]       the implicit GEMM with a forced forward / dx tile and N reduction slices (FLAME_CONV_TILE;
                          tiles: TILES in flame_core/kernels/conv.py)
    dwtile:TILE[:sN]      a forced dw tile (FLAME_CONV_DW_TILE)
    wgmma[:TILE]          the forward on the sm_90a wgmma kernel (cuda_src/conv_wgmma.cu; fwd=wgmma, backward
                          passes auto), optionally with a forced tile (FLAME_CONV_WGMMA_TILE: 128x128, 128x256)
    fwd=A, dx=A, dw=A     the algorithm (auto, im2col, igemm; fwd also wgmma) of one pass, e.g. igemm:320x128+dw=im2col
Run: PYTHONPATH=$PWD python3 bench/conv.py [--shapes sdxl_l0,sdxl_l1] [--repeats 20] [--variant auto,im2col]
     e.g. --variant auto,igemm,wgmma,wgmma:128x128 (wgmma: the 'fwd ms' column is the kernel to compare)
"""
import argparse
import os
import sys

import numpy as np

import common
import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.kernels import conv as KC, plans
from flame_core.ops import conv as C

SHAPES = {  # name: (N, C, H, W, O) - 3x3, padding 1
    "sdxl_l0": (2, 320, 128, 128, 320),
    "sdxl_l1": (2, 640, 64, 64, 640),
    "sdxl_l2": (2, 1280, 32, 32, 1280),
    "vae_dec_256": (1, 512, 256, 256, 512),
    "vae_dec_full": (1, 128, 1024, 1024, 128),
}
ACCEPT = ("sdxl_l0", "sdxl_l1", "sdxl_l2")
VARIANT_ENV = ("FLAME_CONV_ALGO", "FLAME_CONV_TILE", "FLAME_CONV_DW_TILE", "FLAME_CONV_WGMMA_TILE")


def gpu_ms(fn, repeats, lib="cupy"):
    return common.cuda_ms(fn, repeats, 3, lib=lib, before=common.busy_gpu(lib))[0]


def set_variant(v):
    """Point conv2d at a variant through its environment switches."""
    for k in VARIANT_ENV:
        os.environ.pop(k, None)
    algo = {p: "auto" for p in C.PASSES}
    for part in (p.strip() for p in v.split("+")):
        kind, _, value = part.partition("=")
        if part in ("auto", "im2col", "igemm"):
            algo = {p: part for p in C.PASSES}
        elif part.startswith("igemm:"):
            algo = {p: "igemm" for p in C.PASSES}
            os.environ["FLAME_CONV_TILE"] = part[len("igemm:"):]
        elif part.startswith("dwtile:"):
            os.environ["FLAME_CONV_DW_TILE"] = part[len("dwtile:"):]
        elif part == "wgmma" or part.startswith("wgmma:"):
            algo["fwd"] = "wgmma"
            if part != "wgmma":
                os.environ["FLAME_CONV_WGMMA_TILE"] = part[len("wgmma:"):]
        elif kind in C.PASSES and value in ("auto", "im2col", "igemm") + (("wgmma",) if kind == "fwd" else ()):
            algo[kind] = value
        else:
            sys.exit(f"unknown variant setting {part!r} in {v!r}")
    os.environ["FLAME_CONV_ALGO"] = ",".join(f"{p}={a}" for p, a in algo.items())


def bench_flame(N, Cin, H, W, O, repeats):
    flame.manual_seed(0)
    x = flame.randn(N, Cin, H, W, device="cuda", dtype=flame.bfloat16, requires_grad=True)
    w = (flame.randn(O, Cin, 3, 3, device="cuda") * 0.02).to(flame.bfloat16).detach().requires_grad_(True)
    go = flame.randn(N, O, H, W, device="cuda", dtype=flame.bfloat16)

    def fb():
        x.grad = w.grad = None
        F.conv2d(x, w, padding=1).backward(go)
    g = C.geometry(tuple(x.shape), tuple(w.shape), 1, 1, 1, 1)
    xa, wa, ga = x.detach()._data, w.detach()._data, go._data
    r = dict(fwd_ms=gpu_ms(lambda: F.conv2d(x, w, padding=1), repeats), fwdbwd_ms=gpu_ms(fb, max(5, repeats // 2)),
             dx_ms=gpu_ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=True, need_w=False), repeats),
             dw_ms=gpu_ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=False, need_w=True), repeats),
             paths={p: ("wgmma" if p == "fwd" and C.use_wgmma(xa, g) else "igemm") if C.use_igemm(xa, g, p)
                    else "im2col" for p in C.PASSES})
    if r["paths"]["fwd"] == "wgmma":  # registers / spills / shared memory of the tile that ran
        r["wgmma_kernel"] = KC.wgmma_kernel_info(KC.wgmma_tile(O, N * H * W, plans.sm_count()), xa.dtype)
    with flame.no_grad():
        y = F.conv2d(x, w, padding=1)
    return r, (x.detach(), w.detach(), y)


def bench_torch(torch, x, w, repeats):
    import torch.nn.functional as TF
    xt = torch.from_numpy(x.float().numpy()).cuda().to(torch.bfloat16).requires_grad_(True)
    wt = torch.from_numpy(w.float().numpy()).cuda().to(torch.bfloat16).requires_grad_(True)
    go = torch.randn(xt.shape[0], wt.shape[0], xt.shape[2], xt.shape[3], device="cuda", dtype=torch.bfloat16)

    def fb():
        xt.grad = wt.grad = None
        TF.conv2d(xt, wt, padding=1).backward(go)
    r = dict(fwd_ms=gpu_ms(lambda: TF.conv2d(xt, wt, padding=1), repeats, "torch"),
             fwdbwd_ms=gpu_ms(fb, max(5, repeats // 2), "torch"))
    with torch.no_grad():
        y = TF.conv2d(xt, wt, padding=1).float().cpu().numpy()
    return r, y


def run_shape(res, torch, name, variants, repeats):
    N, Cin, H, W, O = SHAPES[name]
    flops = 2 * N * O * H * W * Cin * 9
    peer = yt = None
    for vi, variant in enumerate(variants):
        set_variant(variant)
        f, (x, w, y) = bench_flame(N, Cin, H, W, O, repeats)
        f.update(fwd_TFLOPs=flops / f["fwd_ms"] / 1e9, fwdbwd_TFLOPs=3 * flops / f["fwdbwd_ms"] / 1e9)
        r = {"shape": [N, Cin, H, W, O], "variant": variant, "flame": f}
        if torch is not None:
            if peer is None:
                peer, yt = bench_torch(torch, x, w, repeats)
            ya = y.float().numpy()
            r.update(torch_cudnn=peer, max_rel_diff_vs_torch=float(np.abs(ya - yt).max() / np.abs(yt).max()),
                     ratio_fwd=peer["fwd_ms"] / f["fwd_ms"], ratio_fwdbwd=peer["fwdbwd_ms"] / f["fwdbwd_ms"])
        res.log(name if vi == 0 else f"{name}[{variant}]", r)
        del x, w, y
        backend.cupy.get_default_memory_pool().free_all_blocks()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variant", default="auto", help="comma-separated variants (see the docstring)")
    args = ap.parse_args()
    if not backend.cuda_available():
        sys.exit("bench/conv.py needs a CUDA GPU with CuPy")
    torch = common.import_torch()
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    saved = {k: os.environ.get(k) for k in VARIANT_ENV}
    res = common.Results("conv")
    failed = common.run_parts(res, [(name, (lambda n: lambda: run_shape(res, torch, n, variants, args.repeats))(name))
                                    for name in args.shapes.split(",")])
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    nan = float("nan")
    rows = [[key.split("[")[0], round(r["flame"]["fwd_ms"], 3), round(r["flame"]["fwd_TFLOPs"], 1),
             round(r.get("torch_cudnn", {}).get("fwd_ms", nan), 3), round(r.get("ratio_fwd", nan), 2),
             round(r["flame"]["fwdbwd_ms"], 3), round(r.get("torch_cudnn", {}).get("fwdbwd_ms", nan), 3),
             round(r.get("ratio_fwdbwd", nan), 2), round(r["flame"]["dx_ms"], 3), round(r["flame"]["dw_ms"], 3),
             r["variant"]] for key, r in res.items()]
    print(common.table(["shape", "FLAME fwd ms", "TFLOP/s", "cuDNN ms", "ratio", "FLAME f+b ms", "cuDNN ms", "ratio",
                        "dx ms", "dw ms", "variant"], rows, title="\nconv2d 3x3 pad 1, bf16; ratio = cuDNN / FLAME"))
    ok = [res[n].get("ratio_fwd", 0) >= 0.5 for n in ACCEPT if n in res]
    print(f"acceptance (fwd >= 0.5x cuDNN at SDXL shapes, variant {variants[0]}): "
          f"{'PASS' if ok and all(ok) else 'FAIL'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
