"""Which algorithm runs each pass (fwd, dx, dw) of a convolution: im2col + cuBLAS, the mma.sync implicit GEMM or
the Hopper wgmma one. `FLAME_CONV_ALGO=im2col` or `=igemm` forces a path (benchmarks and tests compare the two), for
every pass or per pass (`fwd=igemm,dx=igemm,dw=im2col`); `auto` (the default) picks im2col + cuBLAS for small column
matrices (IM2COL_MAX_BYTES, or FLAME_CONV_IM2COL_MAX_MB) and the implicit GEMM for larger ones, per pass, unless the
measured table (flame_core/kernels/conv_table.py) knows the geometry. On a compute capability 9.0 device (H100/H200)
the passes run the implicit GEMM on warpgroup MMAs (cuda_src/conv_wgmma.cu) wherever 'auto' takes it (WGMMA_AUTO);
`wgmma` (or `fwd=wgmma` etc.) asks for it (RuntimeError on other devices), `igemm` keeps the mma.sync kernels, and
arrays the kernels do not take (cpu, float32, groups > 1, plain 1x1) keep their usual path."""
import os

from ... import backend
from .phases import strided_dx
from .planning import HALF, is_pointwise

# Column matrices up to this size take im2col + cuBLAS in "auto" mode. Measured on the H100 (bench/conv.py --variant,
# 2026-11-23): SDXL 2x640x64x64 (94 MB of columns) im2col 0.57x cuDNN vs implicit GEMM 0.50x; 2x1280x32x32 (47 MB)
# 0.85x vs 0.46x; 2x320x128x128 (189 MB) 0.39x vs 0.47x; the VAE shapes (600 MB and more) 0.39x vs 0.54x.
# 64 MB since 2026-11-26 (H200, bench/sdxl_lora.py --graph): the 90 MiB column matrix of SDXL's 1x320x128x128 convs
# was alive at the checkpointed LoRA step's peak; with the implicit GEMM there the step took 145.0 ms instead of
# 147.6 and peaked 30 MB lower.
IM2COL_MAX_BYTES = 64 << 20
PASSES = ("fwd", "dx", "dw")
_ALGOS = ("auto", "im2col", "igemm", "wgmma")  # wgmma: the Hopper implicit GEMM (cuda_src/conv_wgmma.cu)


# 'auto' runs the wgmma kernel wherever it runs the implicit GEMM on a compute capability 9.0 device
WGMMA_AUTO = True


def conv_algo(pass_="fwd"):
    """The algorithm FLAME_CONV_ALGO asks for one pass (fwd, dx or dw): 'auto' (default), 'im2col', 'igemm' (the
    mma.sync implicit GEMM) or 'wgmma' (the implicit GEMM on sm_90a warpgroup MMAs).
    The variable holds one name for every pass, or per-pass settings such as 'fwd=igemm,dx=igemm,dw=im2col'
    (separated by ',', ';', '/' or '+'; passes not named are 'auto')."""
    spec = os.environ.get("FLAME_CONV_ALGO", "auto").strip().lower()
    if "=" not in spec:
        algos = dict.fromkeys(PASSES, spec or "auto")
    else:
        algos = dict.fromkeys(PASSES, "auto")
        for item in spec.replace(";", ",").replace("/", ",").replace("+", ",").split(","):
            k, _, v = item.strip().partition("=")
            if k.strip() not in PASSES:
                raise ValueError(f"FLAME_CONV_ALGO={spec!r}: {k.strip()!r} is not a pass ({', '.join(PASSES)})")
            algos[k.strip()] = v.strip()
    for p, algo in algos.items():  # every pass checked, so that a bad backward setting fails at the forward
        if algo not in _ALGOS:
            raise ValueError(f"FLAME_CONV_ALGO={spec!r}: the algorithm must be one of {', '.join(_ALGOS)}")
    return algos[pass_]


def im2col_max_bytes():
    """IM2COL_MAX_BYTES, or FLAME_CONV_IM2COL_MAX_MB (benchmarks: where 'auto' switches to the implicit GEMM)."""
    mb = os.environ.get("FLAME_CONV_IM2COL_MAX_MB")
    return int(float(mb) * 2 ** 20) if mb else IM2COL_MAX_BYTES


def tuned(g, pass_):
    """The measured table's entry for one pass of geometry g (flame_core/kernels/conv_table.py: {'algo': 'im2col' or
    'wgmma', 'plan': 'TILE:sN'}) when FLAME_CONV_ALGO leaves the pass 'auto'; None otherwise or when the geometry
    was not measured on this kind of GPU."""
    if conv_algo(pass_) != "auto":
        return None
    from ...kernels import conv_table
    return conv_table.lookup(pass_, g)


def tuned_plan(g, pass_):
    """The measured wgmma plan ('TILE' or 'TILE:sN') of one pass, or None (the waves model of wgmma_plan picks)."""
    e = tuned(g, pass_)
    return e.get("plan") if e is not None and e["algo"] == "wgmma" else None


def use_igemm(x, g, pass_="fwd"):
    """Whether one pass of conv2d on x (fwd, dx or dw) runs the implicit-GEMM kernels: a CuPy float16/bfloat16
    array, groups 1, not a plain 1x1 (cuBLAS on the input itself is the better GEMM there), sizes within the
    kernels' int32 indexing and grid limits, kernels enabled, and the pass's FLAME_CONV_ALGO 'igemm' (or 'wgmma'
    for fwd: see use_wgmma), or 'auto' (default) with a column matrix over IM2COL_MAX_BYTES. (dx with stride > 1
    and dilation > 1 takes im2col whatever this says.)"""
    if x.dtype not in HALF or g.G != 1 or is_pointwise(g) or not backend.is_cuda_array(x):
        return False
    algo = conv_algo(pass_)
    if algo == "im2col":
        return False
    if algo == "auto":
        entry = tuned(g, pass_)
        if entry is not None:
            if entry["algo"] == "im2col":
                return False
        elif g.N * g.OH * g.OW * g.C * g.KH * g.KW * x.itemsize <= im2col_max_bytes():
            return False  # a small column matrix: im2col + cuBLAS measured faster (SDXL 64x64 / 32x32 layers)
    if max(g.C, g.O) > 65535 or g.KH * g.KW * (max(g.C, g.O) + 8) >= 2 ** 31 \
            or max(g.H * g.W, g.OH * g.OW) >= 2 ** 31 - 4096:
        return False
    from ...kernels import loader
    return loader.enabled()


def use_wgmma(x, g, pass_="fwd"):
    """Whether one pass of conv2d on x runs cuda_src/conv_wgmma.cu - the forward ('fwd'), the input gradient ('dx',
    stride 1: a conv of dy) or the weight gradient ('dw'): use_igemm(x, g, pass_), for fwd / dx a kernel of at most
    32 taps (larger ones take the mma.sync implicit GEMM) and one image's NHWC copy under 2 GiB (32-bit row offsets),
    for dw 32-bit column offsets, and FLAME_CONV_ALGO's 'wgmma' for the pass, or 'auto' on a compute
    capability 9.0 device (WGMMA_AUTO). Raises RuntimeError when 'wgmma' is asked for on a device that cannot run
    sm_90a code."""
    from ...kernels import conv as K
    algo = conv_algo(pass_)
    if algo not in ("wgmma", "auto") or (algo == "auto" and not WGMMA_AUTO):
        return False
    if pass_ == "dx" and not (g.sh == g.sw == 1 or strided_dx(g)):
        return False
    if not use_igemm(x, g, pass_) or (pass_ != "dw" and g.KH * g.KW > K.WGMMA_MAX_TAPS):
        return False
    if pass_ == "dw":
        if not K.wgmma_dw_fits(g.H, g.W, K.round8(g.C), g.KH, g.KW, g.dh, g.dw) \
                or max(g.H * g.W * K.round8(g.C), g.OH * g.OW * K.round8(g.O)) >= 2 ** 31:
            return False  # one image's x or dY past 32-bit element offsets
    else:
        src_pixels, src_channels = (g.H * g.W, g.C) if pass_ == "fwd" else (g.OH * g.OW, g.O)
        if src_pixels * K.round8(src_channels) * x.itemsize >= 2 ** 31 - 2 ** 20:
            return False
    if not K.wgmma_available():
        if algo == "auto":
            return False
        raise RuntimeError(f"FLAME_CONV_ALGO={pass_}=wgmma: the wgmma conv kernel (cuda_src/conv_wgmma.cu) needs a "
                           f"compute capability 9.0 GPU (H100/H200); this device is not one - unset it or use "
                           f"{pass_}=igemm")
    return True
