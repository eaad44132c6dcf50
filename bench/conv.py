"""conv2d at the SDXL UNet and VAE shapes (3x3 stride 1 and 2, the VAE's asymmetric downsample pad, the 1x1 skip
convs), and whole SDXL ResBlocks: FLAME side by side with PyTorch (cuDNN; diffusers' ResnetBlock2D) in the same
process (issue 27).

Each call is timed alone between CUDA events with a 1 GiB memset queued before it on both sides, so the interval is
the GPU's work and not the Python before the first launch (FLAME's conv2d issues 2-4 launches from Python, cuDNN one
from C++); median after warm-up. fwd+bwd computes dx and dw; 'dx ms' / 'dw ms' time conv2d_backward for one gradient
alone (cuDNN's: aten.convolution_backward with one output asked for). A shape with an asymmetric pad ("pad 0,1,0,1":
the VAE encoder's downsample) times the op as each side's model runs it: F.pad + conv in torch (diffusers'
Downsample2D), F.pad_conv2d in FLAME (the pad folded into the conv). FLOP: fwd = 2*N*O*OH*OW*C*k*k, fwd+bwd =
3x fwd. Ratio = torch time / FLAME time (1.0 = parity; the bars: fwd >= 1.0 and fwd+bwd >= 0.9 at every shape,
ResBlock fwd+bwd >= 1.0).
ResBlocks (--resblocks): GroupNorm+SiLU, conv, time-embedding add, GroupNorm+SiLU, conv, skip (1x1 conv when the
channels change), fwd+bwd with the weights frozen (a LoRA step: dx only) and with their gradients (full training).
Variants (comma-separated, each timed at every shape; the first decides the acceptance line), settings joined by '+':
    auto                  what conv2d picks (im2col + cuBLAS for column matrices up to IM2COL_MAX_BYTES, else the
                          implicit GEMM: on sm_90 cuda_src/conv_wgmma.cu (a strided dx as one stride-1 conv per
                          phase of dx), elsewhere conv_igemm.cu's mma.sync kernels; plain 1x1: one batched cuBLAS
                          GEMM)
    im2col / igemm        that path for every pass (FLAME_CONV_ALGO)
    igemm:TILE[:sN]       the mma.sync implicit GEMM with a forced forward / dx tile and N reduction slices
                          (FLAME_CONV_TILE; tiles: TILES in flame_core/kernels/conv.py)
    dwtile:TILE[:sN]      a forced dw tile (FLAME_CONV_DW_TILE)
    wgmma[:TILE[:sN]]     every pass on the sm_90a wgmma kernels (cuda_src/conv_wgmma.cu; FLAME_CONV_ALGO=wgmma),
                          optionally with a forced fwd / dx tile and N slices over K (FLAME_CONV_WGMMA_TILE:
                          128x128, 128x256, e.g. wgmma:128x256:s3)
    wgmmadw:TILE[:sN]     a forced wgmma dw tile and N slices over the pixels (FLAME_CONV_WGMMA_DW_TILE)
    fwd=A, dx=A, dw=A     the algorithm (auto, im2col, igemm; fwd and dx also wgmma) of one pass, e.g.
                          igemm:320x128+dw=im2col
Run: PYTHONPATH=$PWD python3 bench/conv.py [--shapes sdxl_l0,vae_down_1024] [--repeats 20] [--variant auto,im2col]
     [--resblocks sdxl_rb_320,sdxl_rb_640_1280 | --resblocks none]
     --cpu-smoke: every shape scaled down, float32 on the cpu with host timers (checks the script, not a figure)
"""
import argparse
import os
import sys

import common
import numpy as np

import flame_core as flame
import flame_nn.functional as F
from flame_core import backend
from flame_core.kernels import conv as KC
from flame_core.kernels import plans
from flame_core.ops import conv as C

SHAPES = {  # name: (N, C, H, W, O, k, stride, pad); pad an int (both sides) or F.pad's (left, right, top, bottom)
    # SDXL UNet, batch 2 (a CFG pair or two images), 3x3
    "sdxl_l0": (2, 320, 128, 128, 320, 3, 1, 1),
    "sdxl_l1": (2, 640, 64, 64, 640, 3, 1, 1),
    "sdxl_l2": (2, 1280, 32, 32, 1280, 3, 1, 1),
    "sdxl_down_128": (2, 320, 128, 128, 320, 3, 2, 1),        # input_blocks.3: 128^2 -> 64^2
    "sdxl_down_64": (2, 640, 64, 64, 640, 3, 2, 1),           # input_blocks.6: 64^2 -> 32^2
    # SDXL 1x1 skip convs (channel changes)
    "sdxl_skip_320_640": (2, 320, 64, 64, 640, 1, 1, 0),     # input_blocks.4
    "sdxl_skip_2560_1280": (2, 2560, 32, 32, 1280, 1, 1, 0),  # output_blocks.0-1
    "sdxl_skip_1920_640": (2, 1920, 64, 64, 640, 1, 1, 0),    # output_blocks.3
    "sdxl_skip_960_320": (2, 960, 128, 128, 320, 1, 1, 0),    # output_blocks.6
    # VAE (one 1024^2 image), 3x3: encoder and decoder levels
    "vae_1024_128": (1, 128, 1024, 1024, 128, 3, 1, 1),
    "vae_512_256": (1, 256, 512, 512, 256, 3, 1, 1),
    "vae_256_512": (1, 512, 256, 256, 512, 3, 1, 1),
    "vae_128_512": (1, 512, 128, 128, 512, 3, 1, 1),
    "vae_dec_512_512_256": (1, 512, 512, 512, 256, 3, 1, 1),  # decoder up_blocks.2 resnet 0 (512 -> 256)
    "vae_dec_1024_256_128": (1, 256, 1024, 1024, 128, 3, 1, 1),  # decoder up_blocks.3 resnet 0 (256 -> 128)
    # VAE encoder downsample: pad (0, 1, 0, 1), 3x3 stride 2
    "vae_down_1024": (1, 128, 1024, 1024, 128, 3, 2, (0, 1, 0, 1)),
    "vae_down_512": (1, 256, 512, 512, 256, 3, 2, (0, 1, 0, 1)),
    "vae_down_256": (1, 512, 256, 256, 512, 3, 2, (0, 1, 0, 1)),
}
RESBLOCKS = {  # name: (N, C_in, H, W, C_out, emb channels) - SDXL ResBlocks
    "sdxl_rb_320": (2, 320, 128, 128, 320, 1280),
    "sdxl_rb_640": (2, 640, 64, 64, 640, 1280),
    "sdxl_rb_640_1280": (2, 640, 32, 32, 1280, 1280),        # input_blocks.7: the 1x1 skip conv
    "sdxl_rb_960_320": (2, 960, 128, 128, 320, 1280),        # output_blocks.6
}
VARIANT_ENV = ("FLAME_CONV_ALGO", "FLAME_CONV_TILE", "FLAME_CONV_DW_TILE", "FLAME_CONV_WGMMA_TILE",
               "FLAME_CONV_WGMMA_DW_TILE")
SMOKE = False   # --cpu-smoke


def out_size(H, W, k, stride, pad):
    pl, pr, pt, pb = (pad,) * 4 if isinstance(pad, int) else pad
    return (H + pt + pb - k) // stride + 1, (W + pl + pr - k) // stride + 1


def scaled(spec):
    """--cpu-smoke: the shape at 1/8 of the channels (at least 8, groups of 32 kept whole) and 1/16 of the side."""
    N, Cin, H, W, O, *rest = spec
    c = lambda v: max(32, v // 256 * 32)  # noqa: E731  (1/8, a multiple of 32: GroupNorm(32) stays valid)
    return (1, c(Cin), max(8, H // 16), max(8, W // 16), c(O), *rest)


def timer(repeats, lib):
    """ms per call: CUDA events after a busy-GPU head start on cuda, host time on the cpu (--cpu-smoke). The head
    start is 1 GiB memsets queued ahead of the interval, enough of them to outlast the host's issuing of the calls
    (measured first; FLAME issues a ResBlock's fwd+bwd from Python, op by op), so that the interval holds the GPU's
    work alone on both sides - the time a graphed training step spends."""
    def run(fn, reps=repeats):
        if SMOKE:
            import statistics
            import time
            fn()
            ts = []
            for _ in range(max(2, reps // 4)):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            return statistics.median(ts)
        busy = common.busy_gpu(lib)
        _, host_ms, _ = common.cuda_ms(fn, 3, 2, lib=lib)
        per_busy = common.cuda_ms(busy, 3, 1, lib=lib)[0]
        k = max(1, min(64, int(2 * host_ms / max(per_busy, 1e-3)) + 1))
        return common.cuda_ms(fn, reps, 1, lib=lib, before=lambda: [busy() for _ in range(k)])[0]
    return run


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
        elif part.startswith("wgmmadw:"):
            os.environ["FLAME_CONV_WGMMA_DW_TILE"] = part[len("wgmmadw:"):]
        elif part.startswith("dwtile:"):
            os.environ["FLAME_CONV_DW_TILE"] = part[len("dwtile:"):]
        elif part == "wgmma" or part.startswith("wgmma:"):
            algo = {p: "wgmma" for p in C.PASSES}
            if part != "wgmma":
                os.environ["FLAME_CONV_WGMMA_TILE"] = part[len("wgmma:"):]
        elif kind in C.PASSES and value in ("auto", "im2col", "igemm", "wgmma"):
            algo[kind] = value
        else:
            sys.exit(f"unknown variant setting {part!r} in {v!r}")
    os.environ["FLAME_CONV_ALGO"] = ",".join(f"{p}={a}" for p, a in algo.items())


def conv_spec(name):
    spec = SHAPES[name]
    return scaled(spec) if SMOKE else spec


def flame_conv_op(stride, pad):
    """The op as a model runs it: an asymmetric pad folded into the conv (F.pad_conv2d, as the VAE's Downsample)."""
    if isinstance(pad, int):
        return lambda x, w: F.conv2d(x, w, stride=stride, padding=pad)
    return lambda x, w: F.pad_conv2d(x, w, None, pad, stride=stride)


def flame_geometry(x_shape, w_shape, stride, pad):
    """The conv geometry of a shape: an asymmetric pad (F.pad's order) is the leading padding plus the output size."""
    if isinstance(pad, int):
        return C.geometry(x_shape, w_shape, stride, pad, 1, 1)
    pl, pr, pt, pb = pad
    return C.geometry(x_shape, w_shape, stride, (pt, pl), 1, 1, pad_end=(pb, pr))


def bench_flame(N, Cin, H, W, O, k, stride, pad, repeats):
    dev, dt = ("cpu", flame.float32) if SMOKE else ("cuda", flame.bfloat16)
    ms = timer(repeats, "cupy")
    flame.manual_seed(0)
    OH, OW = out_size(H, W, k, stride, pad)
    x = flame.randn(N, Cin, H, W, device=dev).to(dt).detach().requires_grad_(True)
    w = (flame.randn(O, Cin, k, k, device=dev) * 0.02).to(dt).detach().requires_grad_(True)
    go = flame.randn(N, O, OH, OW, device=dev).to(dt)
    op = flame_conv_op(stride, pad)

    def fb():
        x.grad = w.grad = None
        op(x, w).backward(go)
    # the backward passes alone
    g = flame_geometry(tuple(x.shape), tuple(w.shape), stride, pad)
    xa, wa, ga = x.detach().array, w.detach().array, go.array
    r = dict(fwd_ms=ms(lambda: op(x, w)), fwdbwd_ms=ms(fb, max(5, repeats // 2)),
             dx_ms=ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=True, need_w=False)),
             dw_ms=ms(lambda: C.conv2d_backward(ga, xa, wa, g, need_x=False, need_w=True)),
             paths={q: ("wgmma" if C.use_wgmma(xa, g, q) else "igemm")
                    if C.use_igemm(xa, g, q) and (q != "dx" or g.sh == g.sw == 1 or C.strided_dx(g))
                    else ("cublas 1x1" if C.is_pointwise(g) else "im2col") for q in C.PASSES})
    if r["paths"]["fwd"] == "wgmma":  # registers / spills / shared memory of the tile that ran
        r["wgmma_kernel"] = KC.wgmma_kernel_info(KC.wgmma_tile(O, N * OH * OW, plans.sm_count()), xa.dtype)
    with flame.no_grad():
        y = op(x, w)
    return r, (x.detach(), w.detach(), y)


def bench_torch(torch, x, w, go_shape, stride, pad, repeats):
    import torch.nn.functional as TF
    dev, dt = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
    ms = timer(repeats, "torch")
    xt = torch.from_numpy(x.float().numpy()).to(dev, dt).requires_grad_(True)
    wt = torch.from_numpy(w.float().numpy()).to(dev, dt).requires_grad_(True)
    go = torch.randn(*go_shape, device=dev, dtype=dt)
    if isinstance(pad, int):
        op = lambda a, b: TF.conv2d(a, b, stride=stride, padding=pad)  # noqa: E731
    else:
        op = lambda a, b: TF.conv2d(TF.pad(a, pad), b, stride=stride)  # noqa: E731

    def fb():
        xt.grad = wt.grad = None
        op(xt, wt).backward(go)
    r = dict(fwd_ms=ms(lambda: op(xt, wt)), fwdbwd_ms=ms(fb, max(5, repeats // 2)))
    # cuDNN's two backward passes alone (aten.convolution_backward on the conv's own input, after any pad)
    xc = xt.detach() if isinstance(pad, int) else TF.pad(xt.detach(), pad)
    p = pad if isinstance(pad, int) else 0
    bw = torch.ops.aten.convolution_backward
    for q, mask in (("dx_ms", [True, False, False]), ("dw_ms", [False, True, False])):
        r[q] = ms(lambda m=mask: bw(go, xc, wt.detach(), None, [stride] * 2, [p] * 2, [1, 1], False, [0, 0], 1, m))
    with torch.no_grad():
        y = op(xt, wt).float().cpu().numpy()
    return r, y


def run_shape(res, torch, name, variants, repeats):
    N, Cin, H, W, O, k, stride, pad = conv_spec(name)
    OH, OW = out_size(H, W, k, stride, pad)
    flops = 2 * N * O * OH * OW * Cin * k * k
    peer = yt = None
    for vi, variant in enumerate(variants):
        set_variant(variant)
        f, (x, w, y) = bench_flame(N, Cin, H, W, O, k, stride, pad, repeats)
        f.update(fwd_TFLOPs=flops / f["fwd_ms"] / 1e9, fwdbwd_TFLOPs=3 * flops / f["fwdbwd_ms"] / 1e9)
        r = {"shape": [N, Cin, H, W, O], "kernel": k, "stride": stride, "pad": pad, "variant": variant, "flame": f}
        if torch is not None:
            if peer is None:
                peer, yt = bench_torch(torch, x, w, (N, O, OH, OW), stride, pad, repeats)
            ya = y.float().numpy()
            r.update(torch_cudnn=peer, max_rel_diff_vs_torch=float(np.abs(ya - yt).max() / np.abs(yt).max()),
                     ratio_fwd=peer["fwd_ms"] / f["fwd_ms"], ratio_fwdbwd=peer["fwdbwd_ms"] / f["fwdbwd_ms"])
        res.log(name if vi == 0 else f"{name}[{variant}]", r)
        del x, w, y
        if not SMOKE:
            backend.cupy.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------- whole ResBlocks
def flame_resblock(Cin, Cout, E, dev, dt):
    """FLAME's SDXL ResBlock with random weights: GroupNorm scales near 1, small conv / Linear weights and biases."""
    from flame_models.sdxl.resblocks import ResBlock
    flame.manual_seed(0)
    blk = ResBlock(Cin, E, Cout, device=dev)
    with flame.no_grad():
        for n, q in blk.named_parameters():
            scale = 0.02 if q.ndim > 1 else 0.1
            q.copy_(flame.randn(*q.shape, device=dev) * scale + (1.0 if q.ndim == 1 and n.endswith("0.weight") else 0))
    return blk.to(dt)


def torch_resblock(torch, blk, Cin, Cout, E, dev, dt):
    """diffusers' ResnetBlock2D (the SDXL UNet's) with the FLAME block's weights."""
    from diffusers.models.resnet import ResnetBlock2D
    ref = ResnetBlock2D(in_channels=Cin, out_channels=Cout, temb_channels=E, groups=32, eps=1e-5)
    names = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
             "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
    mine = dict(blk.named_parameters())
    sd = {}
    for k in ref.state_dict():
        mod, _, leaf = k.rpartition(".")
        sd[k] = torch.from_numpy(mine[f"{names[mod]}.{leaf}"].detach().float().numpy())
    ref.load_state_dict(sd)
    return ref.to(dev, dt)


def run_resblock(res, torch, name, repeats):
    N, Cin, H, W, Cout, E = RESBLOCKS[name]
    if SMOKE:
        N, Cin, H, W, Cout = scaled((N, Cin, H, W, Cout))[:5]
    dev, dt = ("cpu", flame.float32) if SMOKE else ("cuda", flame.bfloat16)
    ms = timer(repeats, "cupy")
    blk = flame_resblock(Cin, Cout, E, dev, dt)
    x = flame.randn(N, Cin, H, W, device=dev).to(dt).detach().requires_grad_(True)
    emb = flame.randn(N, E, device=dev).to(dt)
    go = flame.randn(N, Cout, H, W, device=dev).to(dt)
    r = {"shape": [N, Cin, H, W, Cout], "emb": E}

    def fb():
        x.grad = None
        for q in blk.parameters():
            q.grad = None
        blk(x, emb).backward(go)
    for trained in (False, True):
        for q in blk.parameters():
            q.requires_grad_(trained)
        tag = "trained" if trained else "frozen"
        r["flame_fwd_ms"] = ms(lambda: blk(x, emb))
        r[f"flame_fwdbwd_{tag}_ms"] = ms(fb, max(5, repeats // 2))
    with flame.no_grad():
        yf = blk(x, emb).float().numpy()
    if torch is not None:
        tdev, tdt = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
        tms = timer(repeats, "torch")
        ref = torch_resblock(torch, blk, Cin, Cout, E, tdev, tdt)
        xt = torch.from_numpy(x.detach().float().numpy()).to(tdev, tdt).requires_grad_(True)
        et = torch.from_numpy(emb.float().numpy()).to(tdev, tdt)
        gt = torch.from_numpy(go.float().numpy()).to(tdev, tdt)

        def tfb():
            xt.grad = None
            ref.zero_grad(set_to_none=True)
            ref(xt, et).backward(gt)
        for trained in (False, True):
            ref.requires_grad_(trained)
            tag = "trained" if trained else "frozen"
            r["torch_fwd_ms"] = tms(lambda: ref(xt, et))
            r[f"torch_fwdbwd_{tag}_ms"] = tms(tfb, max(5, repeats // 2))
        with torch.no_grad():
            yt = ref(xt, et).float().cpu().numpy()
        r["max_rel_diff_vs_torch"] = float(np.abs(yf - yt).max() / np.abs(yt).max())
        r["ratio_fwd"] = r["torch_fwd_ms"] / r["flame_fwd_ms"]
        for tag in ("frozen", "trained"):
            r[f"ratio_fwdbwd_{tag}"] = r[f"torch_fwdbwd_{tag}_ms"] / r[f"flame_fwdbwd_{tag}_ms"]
    res.log(name, r)


def main():
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="conv shapes, or 'none'")
    ap.add_argument("--resblocks", default=",".join(RESBLOCKS), help="SDXL ResBlocks, or 'none'")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variant", default="auto", help="comma-separated variants (see the docstring)")
    ap.add_argument("--cpu-smoke", action="store_true", help="scaled-down shapes in float32 on the cpu")
    args = ap.parse_args()
    SMOKE = args.cpu_smoke
    if not SMOKE and not backend.cuda_available():
        sys.exit("bench/conv.py needs a CUDA GPU with CuPy (or --cpu-smoke)")
    torch = common.import_torch()
    variants = [v.strip() for v in args.variant.split(",") if v.strip()]
    shapes = [] if args.shapes == "none" else args.shapes.split(",")
    blocks = [] if args.resblocks == "none" else args.resblocks.split(",")
    for n in shapes + blocks:
        if n not in SHAPES and n not in RESBLOCKS:
            sys.exit(f"unknown shape {n!r}; conv shapes: {', '.join(SHAPES)}; ResBlocks: {', '.join(RESBLOCKS)}")
    saved = {k: os.environ.get(k) for k in VARIANT_ENV}
    res = common.Results("conv")
    failed = common.run_parts(res, [(name, (lambda n: lambda: run_shape(res, torch, n, variants, args.repeats))(name))
                                    for name in shapes])
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    failed |= common.run_parts(res, [(name, (lambda n: lambda: run_resblock(res, torch, n, args.repeats))(name))
                                     for name in blocks])
    nan = float("nan")
    rows = [[key.split("[")[0], f"{r['kernel']}x{r['kernel']}/{r['stride']}", round(r["flame"]["fwd_ms"], 3),
             round(r["flame"]["fwd_TFLOPs"], 1), round(r.get("torch_cudnn", {}).get("fwd_ms", nan), 3),
             round(r.get("ratio_fwd", nan), 2), round(r["flame"]["fwdbwd_ms"], 3),
             round(r.get("torch_cudnn", {}).get("fwdbwd_ms", nan), 3), round(r.get("ratio_fwdbwd", nan), 2),
             f'{r["flame"]["dx_ms"]:.3f} / {r.get("torch_cudnn", {}).get("dx_ms", nan):.3f}',
             f'{r["flame"]["dw_ms"]:.3f} / {r.get("torch_cudnn", {}).get("dw_ms", nan):.3f}', r["variant"]]
            for key, r in res.items() if "variant" in r]
    if rows:
        print(common.table(["shape", "k/s", "FLAME fwd ms", "TFLOP/s", "torch ms", "ratio", "FLAME f+b ms", "torch ms",
                            "ratio", "dx ms FLAME / cuDNN", "dw ms FLAME / cuDNN", "variant"], rows,
                           title="\nconv2d, " + ("float32 cpu smoke" if SMOKE else "bf16") + "; ratio = torch / FLAME"))
    brows = [[n, round(r["flame_fwd_ms"], 3), round(r.get("torch_fwd_ms", nan), 3), round(r.get("ratio_fwd", nan), 2),
              round(r["flame_fwdbwd_frozen_ms"], 3), round(r.get("torch_fwdbwd_frozen_ms", nan), 3),
              round(r.get("ratio_fwdbwd_frozen", nan), 2), round(r["flame_fwdbwd_trained_ms"], 3),
              round(r.get("torch_fwdbwd_trained_ms", nan), 3), round(r.get("ratio_fwdbwd_trained", nan), 2)]
             for n, r in res.items() if n in RESBLOCKS]
    if brows:
        print(common.table(["ResBlock", "FLAME fwd", "torch fwd", "ratio", "FLAME f+b frozen", "torch", "ratio",
                            "FLAME f+b trained", "torch", "ratio"], brows,
                           title="\nSDXL ResBlocks (ms; frozen: dx only, as in a LoRA step); ratio = torch / FLAME"))
    first = [r for r in res.values() if r.get("variant") == variants[0]]
    if first and torch is not None:
        bad_f = [r["shape"] for r in first if r["ratio_fwd"] < 1.0]
        bad_b = [r["shape"] for r in first if r["ratio_fwdbwd"] < 0.9]
        print(f"bars (variant {variants[0]}): fwd >= 1.0x torch at every shape: "
              f"{'PASS' if not bad_f else f'FAIL at {len(bad_f)} of {len(first)}'}; fwd+bwd >= 0.9x: "
              f"{'PASS' if not bad_b else f'FAIL at {len(bad_b)} of {len(first)}'}")
    if brows and torch is not None:
        bad = [n for n, r in res.items() if n in RESBLOCKS  # the exact ratios, not the table's rounded ones
               and not (r.get("ratio_fwdbwd_frozen", nan) >= 1.0 and r.get("ratio_fwdbwd_trained", nan) >= 1.0)]
        print(f"bar: ResBlock fwd+bwd >= 1.0x torch: {'PASS' if not bad else 'FAIL at ' + ', '.join(bad)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
