"""Implicit-GEMM conv2d on tensor cores (cuda_src/conv_igemm.cu) for CuPy float16 / bfloat16 arrays.

    to_nhwc(x, Rp)                              (N, C, H, W) -> (N, H*W, Rp) channel-last copy, channels >= C zero
    pack_weight(w, Cp)                          (O, C, KH, KW) -> (O, KH*KW*Cp): forward / dw column order
    pack_weight_dx(w, Op)                       (O, C, KH, KW) -> (C, KH*KW*Op), taps flipped: dx as a conv
    conv_nhwc(xt, wp, out, cg, bias=None)       out (N, O, OH, OW) (+ bias) = conv of xt (N, H*W, Cp) by wp
    conv_dw_nhwc(gt, xt, cg, C, dw=, acc32=)    dw (O, C, KH, KW) = weight gradient of conv_nhwc, gt = dy channel-last
    conv_nhwc_wgmma(xt, wp, out, cg, bias=None) conv_nhwc on Hopper warpgroup MMAs (cuda_src/conv_wgmma.cu, sm_90a)
    conv_dx_phased_wgmma(gt, wd, dx, cg, phases) a strided conv's dx (stride <= 2), every phase in one launch

`cg` (a `ConvGeom`) describes one conv_nhwc call: input H, W, Cp; output O, OH, OW; taps KH, KW; stride, padding
(any sign), dilation. The column order k = (kh*KW + kw)*Cp + c makes every 16-byte chunk of the implicit column
matrix 8 channels of one input pixel, gathered straight from the NHWC copy by cp.async: no column matrix exists.

Tiles and splits. A CTA computes a BM x BN tile of the output (output channels x pixels; for dw output channels x
columns k) over a slice of the reduction. Tile shapes (`TILES`) are instantiations of one template; `plan` picks the
shape and the number of reduction slices with the wave model of `_model_time` (the busiest SM's share of CTAs at the
occupancy it runs them with, or the tiles' traffic from L2 when that is longer, plus the fp32 partials' traffic when
slices > 1; its constants are assumptions, not measurements). `FLAME_CONV_TILE=128x128` (or
`128x128:s3`, a forced split) overrides it, for benchmarks; it also forces the dw tile when that tile serves dw
(the 320- and 160-row tiles are forward / dx only), else `FLAME_CONV_DW_TILE` does.

The sm_90a forward (`conv_nhwc_wgmma`) has its own tiles (`WGMMA_TILES`: 128 output channels x 128 or 256 pixels),
split over K where the output alone leaves SMs idle; `wgmma_plan` picks both, `FLAME_CONV_WGMMA_TILE=128x256` or
`=128x128:s3` forces them.
"""
import functools
import math
import os
from collections import namedtuple

import numpy as np

from .. import backend
from . import launching as KL
from . import loader as L
from . import plans as P
from . import tma as TMA

ConvGeom = namedtuple("ConvGeom", "N H W Cp O OH OW KH KW sh sw ph pw dh dw")

# name: (BM, BN, WARPS_M, WARPS_N, STAGES, CTAs per SM (launch bound), fragment schedule (cv_warp_gemm's PIPE:
# 0 unpipelined, 1 A and B double-buffered, 2 A single-buffered and re-read behind the mma's), kernels it serves).
# BM runs over output channels, BN over pixels (dw: columns k). The 320- and 160-row tiles divide the SDXL channel
# counts (320, 640, 1280) exactly, where 128-row tiles compute 384 of 320 rows; they are forward / dx tiles only
# (conv_dw_igemm's A tile needs BM a multiple of 64 covered by whole threads).
FWD, DW = "fwd", "dw"
TILES = {
    "128x128": (128, 128, 4, 2, 3, 2, 1, (FWD, DW)),
    "64x128": (64, 128, 2, 2, 3, 3, 1, (FWD, DW)),
    "128x256": (128, 256, 2, 4, 3, 1, 1, (FWD, DW)),
    "128x256p2": (128, 256, 2, 4, 4, 1, 2, (FWD, DW)),   # 128x256 with schedule 2 and 4 stages (A/B of the two)
    "320x128": (320, 128, 4, 2, 4, 1, 2, (FWD,)),        # warp tile 80x64; 4 stages: 224 KiB of shared memory
    "320x128p3": (320, 128, 4, 2, 3, 1, 2, (FWD,)),      # the same with 3 stages
    "160x256": (160, 256, 2, 4, 4, 1, 2, (FWD,)),        # warp tile 80x64; 4 stages: 208 KiB
}
AUTO_TILES = ("128x128", "64x128", "128x256", "320x128", "160x256")
# relative per-SM efficiency (model only). 128x128 at 2 CTAs/SM measured 0.93x of 128x256 at 1 CTA/SM on the H100
# (SDXL 2x320x128x128: 0.368 vs 0.341 ms); the 320/160-row tiles are assumed as fast per FLOP as 128x256 (unmeasured).
_TILE_EFF = {"128x128": 0.93, "64x128": 0.85, "128x256": 1.0, "128x256p2": 1.0, "320x128": 1.0, "320x128p3": 0.97,
             "160x256": 1.0}
_F_SM = 2.4e12     # assumed tensor FLOP/s of one fully occupied SM running these kernels (model only)
_BW = 2.5e12       # assumed device memory bandwidth, bytes/s (model only)
_L2_BW = 5.5e12    # assumed L2 -> SM bandwidth, bytes/s: every stage loads (BM + BN) rows of 128 bytes (model only)
_LAUNCH_S = 4e-6   # the extra launch of a split reduction
BK = 64            # reduction depth of one pipeline stage (elements)
MAX_SPLITS = 32


def empty(shape, dtype):
    return backend.cupy.empty(shape, dtype=dtype)


def round8(n):
    return -(-int(n) // 8) * 8


def _ptr(a):
    return KL.null() if a is None else a


def _gemm_kernel(kern, name, dtype):
    bm, bn, wm, wn, st, minb, pipe, _ = TILES[name]
    fn = L.get_function("conv_igemm", f"{kern}<{{T}}, {bm}, {bn}, {wm}, {wn}, {st}, {minb}, {pipe}>", dtype)
    smem = tile_smem(name)
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
        try:  # ask for the largest shared-memory carveout so that `minb` CTAs fit on an SM
            fn.preferred_shared_memory_carveout = 100
        except Exception:
            pass
    return fn, wm * wn * 32, smem


def kernel_info(kern, name, dtype):
    """Registers, local (spilled) bytes per thread and dynamic shared memory of one GEMM kernel (benchmarks)."""
    fn, threads, smem = _gemm_kernel(kern, name, dtype)
    return {"kernel": f"{kern} {name}", "threads": threads, "num_regs": int(fn.num_regs),
            "local_size_bytes": int(fn.local_size_bytes), "dynamic_smem": smem}


# ----------------------------------------------------------------------------- tile / split plan
def _occupancy_eff(warps):
    """Fraction of an SM's tensor throughput reached with this many resident warps (model only). 8 warps count as
    full: on the H100 one 8-warp 128x256 CTA per SM beat two 8-warp 128x128 CTAs (SDXL 2x320x128x128)."""
    return min(1.0, math.sqrt(warps / 8.0))


def _model_time(name, M, N, KT, S, out_elems, always_ws, sms):
    bm, bn, wm, wn, st, minb, pipe, _ = TILES[name]
    kps = -(-KT // S)
    ctas = -(-M // bm) * -(-N // bn) * S
    per_sm = -(-ctas // sms)  # CTAs of the busiest SM
    cta_flop = 2.0 * bm * bn * BK * kps
    rate = _F_SM * _TILE_EFF[name]
    full, rest = divmod(per_sm, minb)
    warps = wm * wn
    t = full * minb * cta_flop / (rate * _occupancy_eff(minb * warps))
    if rest:
        t += rest * cta_flop / (rate * _occupancy_eff(rest * warps))
    t = max(t, ctas * kps * (bm + bn) * BK * 2 / _L2_BW)
    if S > 1 or always_ws:
        t += S * out_elems * 8 / _BW + _LAUNCH_S
    return t


def forced_tile(kind):
    """The tile forced for a kernel kind by the environment (None: the model picks). FLAME_CONV_TILE forces the
    forward / dx tile, and the dw tile too when that tile serves dw and FLAME_CONV_DW_TILE is unset."""
    if kind == DW:
        dw = os.environ.get("FLAME_CONV_DW_TILE")
        if dw:
            return dw
        f = os.environ.get("FLAME_CONV_TILE")
        return f if f and f.partition(":s")[0] in TILES and DW in TILES[f.partition(":s")[0]][7] else None
    return os.environ.get("FLAME_CONV_TILE") or None


def plan(M, N, KT, out_elems, always_ws, budget, kind=FWD):
    """(tile name, k-tiles per slice, slices) for an M x N output reduced over KT k-tiles; slices > 1 write
    S * out_elems fp32 partials, which must fit `budget` bytes. kind: FWD (conv_fwd_igemm) or DW (conv_dw_igemm)."""
    return _plan(M, N, KT, out_elems, always_ws, budget, forced_tile(kind), P.sm_count(), kind, max_smem())


def max_smem():
    """Dynamic shared memory one block may opt into on this device (bytes): tiles needing more are not planned."""
    return int(P.device_properties()["sharedMemPerBlockOptin"])


def tile_smem(name):
    bm, bn, wm, wn, st = TILES[name][:5]
    return st * (bm + bn) * BK * 2


@functools.lru_cache(maxsize=1024)
def _plan(M, N, KT, out_elems, always_ws, budget, forced, sms, kind=FWD, smem_limit=232448):
    names = tuple(n for n in AUTO_TILES if kind in TILES[n][7] and tile_smem(n) <= smem_limit)
    splits = None
    if forced:
        name, _, s = forced.partition(":s")
        if name not in TILES or kind not in TILES[name][7]:
            ok = sorted(n for n, t in TILES.items() if kind in t[7])
            raise ValueError(f"conv tile {forced!r} for the {kind} kernel: must be one of {ok} (optionally ':s<N>')")
        names = (name,)
        if s:
            splits = [max(1, min(int(s), KT))]
    max_s = max(1, min(KT, MAX_SPLITS, budget // max(1, out_elems * 4)))
    best = None
    for name in names:
        for S in splits or range(1, max_s + 1):
            kps = -(-KT // S)
            S = -(-KT // kps)  # no empty slices
            t = _model_time(name, M, N, KT, S, out_elems, always_ws, sms)
            if best is None or t < best[0] * 0.999:
                best = (t, name, kps, S)
    return best[1], best[2], best[3]


# ----------------------------------------------------------------------------- layout copies
def to_nhwc(x, Rp, flip_group=0):
    """(B, R, *spatial) -> (B, prod(spatial), Rp) channel-last copy, channels R..Rp-1 zero (tap-flipped when
    flip_group > 0: see conv_transpose_pad)."""
    B, R = x.shape[0], x.shape[1]
    Lsp = int(np.prod(x.shape[2:], dtype=np.int64))
    out = empty((B, Lsp, Rp), x.dtype)
    fn = L.get_function("conv_igemm", "conv_transpose_pad", x.dtype)
    ld = 64 + (2 if x.dtype.itemsize == 2 else 1)
    KL.launch(fn, (P.cdiv(Lsp, 64), P.cdiv(Rp, 64), B), (256,),
              (x, out, KL.i32(R), KL.i32(Lsp), KL.i32(Rp), KL.i32(flip_group)), shared_mem=64 * ld * x.dtype.itemsize)
    return out


def dx_interleave(outs, dx, sh, sw):
    """dx (N, C, H, W) of a strided conv (sh, sw <= 2) from its phases' outputs outs[(a, b)] = rows a::sh, columns
    b::sw (a phase missing: zeros), in one pass (cuda_src/conv_igemm.cu: conv_dx_interleave)."""
    if sh > 2 or sw > 2 or not dx.flags.c_contiguous:
        raise ValueError(f"dx_interleave: strides {sh, sw} must be at most 2 and dx C-contiguous")
    N, C, H, W = dx.shape
    ptr = (lambda a, b: _ptr(outs.get((a, b))))
    total = N * C * H * P.cdiv(W, 8)
    KL.launch(L.get_function("conv_igemm", "conv_dx_interleave", dx.dtype), (P.cdiv(total, 256),), (256,),
              (ptr(0, 0), ptr(0, 1), ptr(1, 0), ptr(1, 1), dx, KL.i64(N * C), KL.i32(H), KL.i32(W), KL.i32(sh),
               KL.i32(sw)))


def pack_weight(w, Cp):
    """(O, C, KH, KW) -> (O, KH*KW*Cp) with k = (kh*KW + kw)*Cp + c, channels >= C zero."""
    O, C, KH, KW = w.shape
    T = KH * KW
    out = empty((O, T * Cp), w.dtype)
    CT = 512  # channels per block: the block's CT * T input elements are staged in shared memory
    while CT > 8 and CT * T * w.dtype.itemsize > 16384:
        CT //= 2
    fn = L.get_function("conv_igemm", "conv_pack_weight", w.dtype)
    KL.launch(fn, (P.cdiv(Cp, CT), O), (256,), (w, out, KL.i32(C), KL.i32(Cp), KL.i32(T), KL.i32(CT)),
              shared_mem=CT * T * w.dtype.itemsize)
    return out


def pack_weight_dx(w, Op):
    """(O, C, KH, KW) -> (C, KH*KW*Op): out[c, (kh*KW + kw)*Op + o] = w[o, c, KH-1-kh, KW-1-kw] (o < O, else 0)."""
    O, C, KH, KW = w.shape
    return to_nhwc(w.reshape(1, O, C * KH * KW), Op, flip_group=KH * KW).reshape(C, KH * KW * Op)


# ----------------------------------------------------------------------------- GEMMs
def conv_nhwc(xt, wp, out, cg, bias=None, budget=512 << 20):
    """out (N, O, OH, OW) = conv of xt (N, H, W, Cp) with packed weights wp (O, KH*KW*Cp) (+ bias (O,))."""
    NP = cg.N * cg.OH * cg.OW  # output pixels
    K = cg.KH * cg.KW * cg.Cp
    KT = P.cdiv(K, BK)
    name, kps, S = plan(cg.O, NP, KT, cg.O * NP, False, budget)
    fn, threads, smem = _gemm_kernel("conv_fwd_igemm", name, xt.dtype)
    bm, bn = TILES[name][:2]
    ws = empty((S, cg.O, NP), np.float32) if S > 1 else None
    i32 = KL.i32
    KL.launch(fn, (P.cdiv(cg.O, bm) * P.cdiv(NP, bn), S), (threads,),
              (xt, wp, _ptr(bias) if S == 1 else KL.null(), out, _ptr(ws), i32(cg.H), i32(cg.W), i32(cg.Cp), i32(cg.O),
              i32(cg.KH), i32(cg.KW), i32(cg.sh), i32(cg.sw), i32(cg.ph), i32(cg.pw), i32(cg.dh), i32(cg.dw),
              i32(cg.OH), i32(cg.OW), i32(NP), i32(K), i32(kps)), shared_mem=smem)
    if S > 1:
        _splitk_reduce(ws, bias, out, cg)
    return out


def conv_dw_nhwc(gt, xt, cg, C, dw=None, acc32=None, accumulate=False, budget=512 << 20):
    """Weight gradient of conv_nhwc: gt (N, OH, OW, Op) is dy channel-last. Writes the (O, C, KH, KW) sum to dw
    (the weights' dtype) and/or acc32 (float32; accumulate=True adds acc32's previous value)."""
    NP = cg.N * cg.OH * cg.OW  # output pixels
    K = cg.KH * cg.KW * cg.Cp
    Op = gt.shape[-1]
    KT = P.cdiv(NP, BK)
    name, kps, S = plan(cg.O, K, KT, cg.O * K, True, budget, DW)
    fn, threads, smem = _gemm_kernel("conv_dw_igemm", name, xt.dtype)
    bm, bn = TILES[name][:2]
    ws = empty((S, cg.O, K), np.float32)
    i32 = KL.i32
    KL.launch(fn, (P.cdiv(cg.O, bm) * P.cdiv(K, bn), S), (threads,),
              (gt, xt, ws, i32(cg.H), i32(cg.W), i32(cg.Cp), i32(cg.O), i32(Op), i32(cg.KH), i32(cg.KW),
              i32(cg.sh), i32(cg.sw), i32(cg.ph), i32(cg.pw), i32(cg.dh), i32(cg.dw), i32(cg.OH), i32(cg.OW),
              i32(NP), i32(K), i32(kps)), shared_mem=smem)
    _dw_reduce(ws, acc32, dw, cg, C, accumulate, xt.dtype)


def _splitk_reduce(ws, bias, out, cg, p_first=0, emb=None, res=None):
    """out (N, O, OH, OW) = the sum of the fp32 partials ws (S, O, N*OH*OW - p_first) (+ bias (O,)) (+ emb (N, O))
    (+ res, out's shape) at the pixels from p_first on (a tail split's; 0: every pixel): conv_igemm.cu's
    conv_splitk_reduce, after a split forward of either kernel."""
    OHW = cg.OH * cg.OW
    n_first = p_first // OHW
    KL.launch(L.get_function("conv_igemm", "conv_splitk_reduce", out.dtype),
              (P.cdiv(OHW, 256), cg.O, cg.N - n_first), (256,),
              (ws, _ptr(bias), out, KL.i32(ws.shape[0]), KL.i32(cg.O), KL.i32(OHW), KL.i64(ws.shape[2]),
               KL.i64(p_first), _ptr(emb), _ptr(res)))


def _dw_reduce(ws, acc32, dw, cg, C, accumulate, dtype):
    """dw (O, C, KH, KW) of `dtype` (the weights') and/or acc32 (+= when accumulate) = the sum of the fp32 partials
    ws (S, O, KH*KW*Cp): conv_igemm.cu's conv_dw_reduce, after either weight-gradient kernel."""
    K, i32 = ws.shape[2], KL.i32
    KL.launch(L.get_function("conv_igemm", "conv_dw_reduce", dtype),
              (P.cdiv(K, 256), cg.O), (256,), (ws, _ptr(acc32), _ptr(dw), i32(ws.shape[0]), i32(cg.O), i32(C),
                                               i32(cg.Cp), i32(cg.KH * cg.KW), i32(1 if accumulate else 0)))


# ----------------------------------------------------------------------------- Hopper forward (sm_90a)
WGMMA_STEM = "conv_wgmma"
# name: (BN pixels, STAGES); BM = 128 output channels (two consumer warpgroups of 64), BK = 64, 256 + 128 PW threads
WGMMA_TILES = {
    "128x128": (128, 4),
    "128x256": (256, 4),
}


def wgmma_available():
    """Whether the current device runs cuda_src/conv_wgmma.cu (compute capability 9.0: sm_90a code)."""
    return L.arch_available(L.file_arch(WGMMA_STEM))


def wgmma_smem(name):
    bn, st = WGMMA_TILES[name]
    return 1024 + st * (128 + bn) * BK * 2  # + 1024: the kernel aligns its stages to 1024 bytes itself


def wgmma_tile(O, NP, sms):
    """The wgmma tile wgmma_plan picks for an O x NP output (K long enough not to matter)."""
    return wgmma_plan(O, NP, 1, sms)[0]


WGMMA_MAX_SPLITS = 8
# the model's units: one 64-deep k-tile of a 128x128 CTA (2.1 MFLOP: ~0.42 us at 5 TFLOP/s per SM); fp32 partials
# written and read back, and the output written, at ~3 TB/s: 1.26 MB per unit
_WGMMA_UNIT_BYTES = 1.26e6
# a k-tile's time per tile in those units: 128x256 did twice the work in 1.69x the time of 128x128 (SDXL 2x320x128^2
# on an H200 at 243fd45: 0.358 vs 0.423 ms)
_WGMMA_KTILE_COST = {"128x128": 1.0, "128x256": 1.7}


def wgmma_plan(O, NP, KT, sms, ws_budget=512 << 20, env="FLAME_CONV_WGMMA_TILE", max_splits=WGMMA_MAX_SPLITS,
               forced=None):
    """(tile, k-tiles per slice, slices) of a wgmma kernel with an O x NP output (the forward: channels x pixels; the
    weight gradient: channels x K) and KT k-tiles. $FLAME_CONV_WGMMA_TILE (dw: $FLAME_CONV_WGMMA_DW_TILE) = 'TILE' or
    'TILE:sN' forces the tile (and N slices over K; the forward's 'TILE:tN', a tail split, is conv_nhwc_wgmma's);
    `forced` (the same form: the measured table's plan, flame_core/kernels/conv_table.py) does when the variable is
    unset. Otherwise the tile and split that a simple model says finish first: waves of CTAs (ceil(CTAs * slices /
    SMs)) times k-tiles per slice times the tile's width, plus the split's fp32 partials written and summed: what
    geometries the table does not hold get."""
    label = env if env and os.environ.get(env) else "plan"
    forced = (os.environ.get(env) if env else None) or forced
    names, splits = sorted(WGMMA_TILES), None
    if forced:
        name, _, sn = forced.partition(":s")
        if name not in WGMMA_TILES or (sn and not sn.isdigit()) or sn == "0":
            raise ValueError(f"{label}={forced!r}: must be one of {sorted(WGMMA_TILES)}, optionally "
                             f"with ':s<N>' (N >= 1 slices over K)")
        names, splits = [name], ([int(sn)] if sn else None)
    max_s = max(1, min(KT, max_splits, ws_budget // max(1, O * NP * 4)))
    best = None
    for name in names:
        bn = WGMMA_TILES[name][0]
        ctas = P.cdiv(O, 128) * P.cdiv(NP, bn)
        for S in splits or range(1, max_s + 1):
            kps = P.cdiv(KT, min(S, KT))
            S = P.cdiv(KT, kps)  # no empty slices
            t = P.cdiv(ctas * S, sms) * kps * _WGMMA_KTILE_COST[name]
            if S > 1:
                t += (2 * S * 4 + 2) * O * NP / _WGMMA_UNIT_BYTES
            if best is None or t < best[0] * 0.999:
                best = (t, name, kps, S)
    return best[1], best[2], best[3]


WGMMA_LAUNCH_REGS = 168  # registers per thread the kernel's setmaxnreg split (72 producer, 216 consumer) moves within


_wgmma_checked = set()  # ids of the kernel functions whose register count was checked (loader caches them)


EPI_PLAIN, EPI_ADDS, EPI_PHASED = 0, 1, 2  # conv_fwd_wgmma's epilogues (cuda_src/conv_wgmma.cu)


def _wgmma_kernel(name, dtype, kernel="conv_fwd_wgmma", epi=None, producers=1, tma=False):
    """(function, dynamic smem) of a wgmma kernel's tile; the forward's `epi` picks its epilogue's instantiation
    (conv_fwd_wgmma<..., EPI, PW, TMA>: EPI_PLAIN, EPI_ADDS adding emb / res, EPI_PHASED a strided conv's dx) and
    `tma` its TMA producer (one producer warpgroup); `producers` (PW) its producer warpgroups: 256 + 128 PW
    threads."""
    bn, st = WGMMA_TILES[name]
    flag = ("" if epi is None else f", {epi}") + f", {producers}" + (", true" if tma else "")
    fn = L.get_function(WGMMA_STEM, f"{kernel}<{{T}}, {bn}, {st}{flag}>", dtype)
    if id(fn) not in _wgmma_checked:  # once per compiled function, not per launch (a driver call)
        regs = int(fn._attribute(getattr(backend.cupy.cuda.driver, "CU_FUNC_ATTRIBUTE_NUM_REGS", 4)))
        want = WGMMA_LAUNCH_REGS if producers == 1 else 128  # 65536 registers over 512 threads
        if regs != want:  # fewer: the consumers' setmaxnreg.inc would wait forever (a hang)
            raise RuntimeError(f"{kernel} {name}: compiled with {regs} registers per thread, not "
                               f"{want}: its setmaxnreg split (cuda_src/conv_wgmma.cu) would not fit")
        _wgmma_checked.add(id(fn))
    return fn, wgmma_smem(name)


def wgmma_kernel_info(name, dtype):
    """Registers, local (spilled) bytes per thread and dynamic shared memory of one wgmma tile (benchmarks)."""
    pw = fwd_producers()
    fn, smem = _wgmma_kernel(name, dtype, epi=EPI_PLAIN, producers=pw)
    drv = backend.cupy.cuda.driver
    attr = fn._attribute  # an sm_90a kernel (loader._ArchKernel) reads its attributes from the driver
    return {"kernel": f"conv_fwd_wgmma {name}", "threads": 256 + 128 * pw,
            "num_regs": int(attr(getattr(drv, "CU_FUNC_ATTRIBUTE_NUM_REGS", 4))),
            "local_size_bytes": int(attr(getattr(drv, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", 3))), "dynamic_smem": smem}


WGMMA_MAX_TAPS = 32  # KH * KW: each pixel row's in-image taps are one 32-bit mask (cuda_src/conv_wgmma.cu)
WGMMA_FWD_PRODUCERS = 2  # the forward / dx kernel's producer warpgroups: two halve each thread's gather


def fwd_producers():
    """The forward (and dx) kernel's producer warpgroups where it gathers with cp.async (not the TMA producer's
    geometries: _im2col_map): FLAME_CONV_FWD_PRODUCERS (1 or 2), else WGMMA_FWD_PRODUCERS."""
    return _producers("FLAME_CONV_FWD_PRODUCERS", WGMMA_FWD_PRODUCERS)


def _producers(var, default):
    v = os.environ.get(var)
    if v is None:
        return default
    if v not in ("1", "2"):
        raise ValueError(f"{var} must be 1 or 2, got {v!r}")
    return int(v)


WGMMA_DW_PRODUCERS = 2  # the weight gradient kernel's producer warpgroups: two halve each thread's gather


def dw_producers():
    """The weight gradient kernel's producer warpgroups where it gathers with cp.async (not the TMA producer's
    geometries: _im2col_map): FLAME_CONV_DW_PRODUCERS (1 or 2), else WGMMA_DW_PRODUCERS."""
    return _producers("FLAME_CONV_DW_PRODUCERS", WGMMA_DW_PRODUCERS)


WGMMA_DW_MAX_SPLITS = 64  # dw reduces over every pixel into a small output: many slices keep the SMs busy


def wgmma_dw_fits(H, W, Cp, KH, KW, dh, dw):
    """Whether conv_dw_nhwc_wgmma takes this geometry (its columns' offsets in x are 32-bit)."""
    return ((KH - 1) * dh * W + (KW - 1) * dw + 1) * Cp < 2 ** 31 - 1


def tma_enabled():
    """Whether the wgmma kernels load their operands by TMA where the geometry allows (_im2col_map): FLAME_CONV_TMA=1
    or 0, else WGMMA_TMA - and the driver encodes tensor maps (tma.available)."""
    v = os.environ.get("FLAME_CONV_TMA")
    if v is not None and v not in ("0", "1"):
        raise ValueError(f"FLAME_CONV_TMA must be 0 or 1, got {v!r}")
    return (WGMMA_TMA if v is None else v == "1") and TMA.available()


WGMMA_TMA = True


def _im2col_map(xt, cg, pixels):
    """The im2col map of xt (N, H*W, Cp) for the TMA producers (tma.im2col_nhwc: 64 channels x `pixels` per load),
    or None where TMA does not apply: TMA off (tma_enabled), Cp not a multiple of 64 (a 64-deep k-tile / slab must
    be 64 channels of one tap), or a bounding box past the 4-D map's corner range. The box of tap-(0, 0) positions
    runs from (-pw, -ph) to the last output pixel's ((OW-1)*sw - pw, (OH-1)*sh - ph), i.e. upper corners relative
    to (W-1, H-1)."""
    if not tma_enabled() or cg.Cp % BK:
        return None
    lower = (-cg.pw, -cg.ph)
    upper = ((cg.OW - 1) * cg.sw - cg.pw - (cg.W - 1), (cg.OH - 1) * cg.sh - cg.ph - (cg.H - 1))
    if not all(-128 <= v <= 127 for v in lower + upper) or max((cg.KH - 1) * cg.dh, (cg.KW - 1) * cg.dw) >= 2 ** 16:
        return None
    return TMA.im2col_nhwc(xt, cg.N, cg.H, cg.W, cg.Cp, lower, upper, (cg.sw, cg.sh), BK, pixels)



def conv_nhwc_wgmma(xt, wp, out, cg, bias=None, budget=512 << 20, plan=None, emb=None, res=None):
    """conv_nhwc on Hopper warpgroup MMAs: out (N, O, OH, OW) = conv of xt (N, H, W, Cp) with packed weights
    wp (O, KH*KW*Cp) (+ bias (O,)) (+ emb (N, O): a per-image bias) (+ res: a residual of out's shape), the adds in
    the epilogue. float16 / bfloat16, compute capability 9.0 only. Split over K (fp32 partials, then
    conv_splitk_reduce) when the output alone gives fewer CTAs than SMs (wgmma_plan; `plan` 'TILE:sN' or 'TILE:tN'
    forces one)."""
    if not wgmma_available():
        raise RuntimeError("conv_nhwc_wgmma: cuda_src/conv_wgmma.cu runs on compute capability 9.0 (sm_90a) only; "
                           "this device is not one (use conv_nhwc)")
    if xt.dtype.itemsize != 2 or wp.dtype != xt.dtype or out.dtype != xt.dtype:
        raise TypeError(f"conv_nhwc_wgmma: xt, wp and out must share one float16/bfloat16 dtype, got {xt.dtype}, "
                        f"{wp.dtype}, {out.dtype}")
    NP = cg.N * cg.OH * cg.OW  # output pixels
    K = cg.KH * cg.KW * cg.Cp
    if cg.KH * cg.KW > WGMMA_MAX_TAPS:
        raise ValueError(f"conv_nhwc_wgmma: a {cg.KH}x{cg.KW} kernel has more than {WGMMA_MAX_TAPS} taps (the rows' "
                         f"tap masks are 32 bits); use conv_nhwc")
    if cg.Cp % 8 or tuple(wp.shape) != (cg.O, K) or xt.size != cg.N * cg.H * cg.W * cg.Cp:
        raise ValueError(f"conv_nhwc_wgmma: packed weights {tuple(wp.shape)} / input of {xt.size} elements do not "
                         f"match the geometry {cg} (weights ({cg.O}, {K}), Cp a multiple of 8)")
    KT = P.cdiv(K, BK)
    forced, tail = split_tail(os.environ.get("FLAME_CONV_WGMMA_TILE") or plan)
    name, kps, S = wgmma_plan(cg.O, NP, KT, P.sm_count(), budget, env=None, forced=forced)
    bn = WGMMA_TILES[name][0]
    xmap = _im2col_map(xt, cg, bn)  # the TMA producer's (BN-pixel loads), or None: the cp.async gather
    pw = 1 if xmap else fwd_producers()
    fn, smem = _wgmma_kernel(name, xt.dtype, epi=EPI_PLAIN if emb is None and res is None else EPI_ADDS,
                             producers=pw, tma=xmap is not None)
    tm_w, tm_x = (TMA.tiled_2d(wp, 128, BK), TMA.pack([xmap], 4)) if xmap else (TMA.ZERO, TMA.ZERO4)
    o_tiles, p_tiles = P.cdiv(cg.O, 128), P.cdiv(NP, bn)
    dp = tail_plan(o_tiles, p_tiles, P.sm_count()) if tail else 0
    i32 = KL.i32

    def launch(tile0, ntiles, S, kps, ws, pw0):
        KL.launch(fn, (ntiles, S), (256 + 128 * pw,),
                  (xt, wp, _ptr(bias) if ws is None else KL.null(), out, _ptr(ws), i32(cg.H), i32(cg.W),
                   i32(cg.Cp), i32(cg.O), i32(cg.KH), i32(cg.KW), i32(cg.sh), i32(cg.sw), i32(cg.ph), i32(cg.pw),
                   i32(cg.dh), i32(cg.dw), i32(cg.OH), i32(cg.OW), i32(NP), i32(K), i32(kps), i32(tile0), i32(pw0),
                   _ptr(emb if ws is None else None), _ptr(res if ws is None else None), i32(0), i32(1), i32(0),
                   tm_w, tm_x),
                  shared_mem=smem)
    if dp:  # whole waves as they are, then the last partial wave's pixel tiles split over K in `tail` slices
        launch(0, dp * o_tiles, 1, KT, None, 0)
        kps = P.cdiv(KT, min(tail, KT))
        S = P.cdiv(KT, kps)
        pw0 = dp * bn
        ws = empty((S, cg.O, NP - pw0), np.float32)
        launch(dp * o_tiles, (p_tiles - dp) * o_tiles, S, kps, ws, pw0)
        _splitk_reduce(ws, bias, out, cg, pw0, emb, res)
        return out
    ws = empty((S, cg.O, NP), np.float32) if S > 1 else None
    launch(0, o_tiles * p_tiles, S, kps, ws, 0)
    if S > 1:
        _splitk_reduce(ws, bias, out, cg, 0, emb, res)
    return out


# a phased dx's groups of pixel tiles write at most about this much of dx each (L2-resident: a phase writes every
# other element of dx's rows, the phase beside it the rest). Measured on the H200 (per-phase tiles of 128x256): one
# group beat two at the SDXL 2x320x128^2 downsample (0.075 vs 0.078 ms); at the VAE's 1x128x1024^2 groups of 64
# pixel tiles (16 MiB) beat one group (0.523 vs 0.554 ms)
DX_GROUP_BYTES = 24 << 20


def conv_dx_phased_wgmma(gt, wd, dx, cg, phases, plan=None, group=None):
    """dx (N, C, H, W) of a strided conv (stride up to 2, dilation 1) in one launch of conv_fwd_wgmma's EPI_PHASED
    instantiation: every phase (a, b) of dx (rows a::sh, columns b::sw) is a stride-1 conv of gt = dy channel-last
    (N, OH*OW, Op) by its taps of wd = pack_weight_dx(w, Op) (C, KH*KW*Op), written into dx's rows and columns from
    the accumulators - no per-phase weights, temporaries or interleave pass. cg: ConvGeom(N, OH, OW, Op, C, H, W, KH,
    KW, sh, sw, ph, pw, 1, 1) (dy's size as the input, dx's as the output, the strided conv's taps, stride and
    leading padding). phases: the phases with taps (ops/conv/phases.py dx_phases: a, b, kh, kw, ph, pw, OH, OW); dx
    elements of other phases must be zeroed by the caller. `plan` 'TILE' picks the tile (else wgmma_plan's model);
    `group` the pixel tiles per group ($FLAME_CONV_DX_GROUP; 0: one group; else equal groups of at most about
    DX_GROUP_BYTES of dx): CTAs run group by group, each group's phases the most taps first. With TMA (Op a multiple
    of 64, _im2col_map) the weight tiles come from a tiled map of wd and each phase's pixel tiles from its own
    im2col map of gt (its padding and output grid)."""
    if not wgmma_available():
        raise RuntimeError("conv_dx_phased_wgmma: cuda_src/conv_wgmma.cu runs on compute capability 9.0 (sm_90a) only")
    if gt.dtype.itemsize != 2 or wd.dtype != gt.dtype or dx.dtype != gt.dtype:
        raise TypeError(f"conv_dx_phased_wgmma: gt, wd and dx must share one float16/bfloat16 dtype, got {gt.dtype}, "
                        f"{wd.dtype}, {dx.dtype}")
    N, C, H, W = dx.shape
    Kf = cg.KH * cg.KW * cg.Cp
    if not (1 <= cg.sh <= 2 and 1 <= cg.sw <= 2) or cg.dh != 1 or cg.dw != 1 or not phases or len(phases) > 4:
        raise ValueError(f"conv_dx_phased_wgmma: strides {cg.sh, cg.sw} must be 1 or 2, dilation 1, and 1-4 phases "
                         f"given (got {len(phases)})")
    if (N, C, H, W) != (cg.N, cg.O, cg.OH, cg.OW) or tuple(wd.shape) != (C, Kf) or cg.Cp % 8 \
            or gt.size != cg.N * cg.H * cg.W * cg.Cp or not dx.flags.c_contiguous:
        raise ValueError(f"conv_dx_phased_wgmma: dx {tuple(dx.shape)}, weights {tuple(wd.shape)} or dy of {gt.size} "
                         f"elements do not match the geometry {cg} (dx C-contiguous, weights ({C}, {Kf}))")
    if cg.KH * cg.KW > WGMMA_MAX_TAPS:
        raise ValueError(f"conv_dx_phased_wgmma: a {cg.KH}x{cg.KW} kernel has more than {WGMMA_MAX_TAPS} taps")
    forced = os.environ.get("FLAME_CONV_WGMMA_TILE") or plan
    NP = N * P.cdiv(H, cg.sh) * P.cdiv(W, cg.sw)  # phase (0, 0)'s pixels: the most
    name, _, split = (forced or wgmma_tile(C, NP, P.sm_count())).partition(":")
    if name not in WGMMA_TILES or split not in ("", "s1"):
        raise ValueError(f"conv_dx_phased_wgmma: plan {forced!r} must be one of {sorted(WGMMA_TILES)}, optionally "
                         f"with ':s1' (a phased dx is not split over K)")
    bn = WGMMA_TILES[name][0]
    order = sorted(phases, key=lambda ph: -len(ph.kh) * len(ph.kw))
    code = len(order)
    for i, ph in enumerate(order):
        code |= (ph.a * 4 + ph.b) << (4 + 4 * i)
    o_tiles, tpmax = P.cdiv(C, 128), P.cdiv(NP, bn)
    env = os.environ.get("FLAME_CONV_DX_GROUP")
    if env is not None and not env.isdigit():
        raise ValueError(f"FLAME_CONV_DX_GROUP={env!r}: must be a whole number of pixel tiles (0: one group)")
    group = int(env) if env is not None else group
    if group is None:
        group = P.cdiv(tpmax, P.cdiv(dx.nbytes, DX_GROUP_BYTES))
    group = min(tpmax, group) if group > 0 else tpmax
    xmaps = [_im2col_map(gt, cg._replace(KH=len(ph.kh), KW=len(ph.kw), sh=1, sw=1, ph=ph.ph, pw=ph.pw,
                                         OH=ph.OH, OW=ph.OW), bn) for ph in order]
    tma = all(m is not None for m in xmaps)
    tm_w, tm_x = (TMA.tiled_2d(wd, 128, BK), TMA.pack(xmaps, 4)) if tma else (TMA.ZERO, TMA.ZERO4)
    pw = 1 if tma else fwd_producers()
    fn, smem = _wgmma_kernel(name, gt.dtype, epi=EPI_PHASED, producers=pw, tma=tma)
    i32 = KL.i32
    KL.launch(fn, (o_tiles * len(order) * tpmax, 1), (256 + 128 * pw,),
              (gt, wd, KL.null(), dx, KL.null(), i32(cg.H), i32(cg.W), i32(cg.Cp), i32(C), i32(cg.KH), i32(cg.KW),
               i32(cg.sh), i32(cg.sw), i32(cg.ph), i32(cg.pw), i32(1), i32(1), i32(H), i32(W), i32(N * H * W),
               i32(Kf), i32(P.cdiv(Kf, BK)), i32(0), i32(0), KL.null(), KL.null(), i32(code), i32(group), i32(N),
               tm_w, tm_x),
              shared_mem=smem)
    return dx


def split_tail(plan):
    """(the plan for wgmma_plan, tail slices) of a wgmma plan string: 'TILE:tN' asks for a tail split in N - the
    tile unsplit ('TILE:s1') and N; anything else is itself with 0 (no tail)."""
    if plan and ":t" in plan:
        name, _, n = plan.partition(":t")
        if not n.isdigit() or int(n) < 2:
            raise ValueError(f"wgmma plan {plan!r}: ':t<N>' needs N >= 2 slices for the tail")
        return f"{name}:s1", int(n)
    return plan, 0


def tail_plan(o_tiles, p_tiles, sms):
    """Pixel tiles of a tail split's first launch: the whole waves of CTAs rounded down to whole pixel tiles (every
    channel tile), so that the second launch covers pixels from one point on; 0 when there is no whole wave or no
    tail (the split would not pay)."""
    tiles = o_tiles * p_tiles
    dp = (tiles // sms) * sms // o_tiles
    return dp if 0 < dp < p_tiles else 0


def conv_dw_nhwc_wgmma(gt, xt, cg, C, dw=None, acc32=None, accumulate=False, budget=512 << 20, plan=None):
    """conv_dw_nhwc on Hopper warpgroup MMAs (cuda_src/conv_wgmma.cu, compute capability 9.0): the weight gradient
    of conv_nhwc from gt = dy channel-last (N, OH*OW, Op) and xt (N, H*W, Cp), summed over pixels in slices of fp32
    partials that conv_dw_reduce adds up into dw (O, C, KH, KW) (the weights' dtype) and/or acc32 (float32;
    accumulate=True adds acc32's previous value). `plan` 'TILE:sN' forces the tile and the slices (wgmma_plan)."""
    if not wgmma_available():
        raise RuntimeError("conv_dw_nhwc_wgmma: cuda_src/conv_wgmma.cu runs on compute capability 9.0 (sm_90a) only; "
                           "this device is not one (use conv_dw_nhwc)")
    if xt.dtype.itemsize != 2 or gt.dtype != xt.dtype:
        raise TypeError(f"conv_dw_nhwc_wgmma: gt and xt must share one float16/bfloat16 dtype, got {gt.dtype}, "
                        f"{xt.dtype}")
    NP = cg.N * cg.OH * cg.OW  # output pixels: the reduction
    K = cg.KH * cg.KW * cg.Cp
    Op = gt.shape[-1]
    if not wgmma_dw_fits(cg.H, cg.W, cg.Cp, cg.KH, cg.KW, cg.dh, cg.dw):
        raise ValueError(f"conv_dw_nhwc_wgmma: the geometry {cg} has column offsets past 2^31 elements; use "
                         f"conv_dw_nhwc")
    if cg.Cp % 8 or Op % 8 or Op < cg.O or gt.size != NP * Op or xt.size != cg.N * cg.H * cg.W * cg.Cp:
        raise ValueError(f"conv_dw_nhwc_wgmma: dy of {gt.size} elements ({Op} channels) / input of {xt.size} do not "
                         f"match the geometry {cg}")
    if max(gt.size, xt.size) >= 2 ** 31:
        raise ValueError(f"conv_dw_nhwc_wgmma: dy ({gt.size}) and x ({xt.size}) must be under 2^31 elements (its "
                         f"producer's offsets are 32-bit); convolve fewer images at a time")
    name, kps, S = wgmma_plan(cg.O, K, P.cdiv(NP, BK), P.sm_count(), budget, env="FLAME_CONV_WGMMA_DW_TILE",
                              max_splits=WGMMA_DW_MAX_SPLITS, forced=plan)
    maps = _im2col_map(xt, cg, BK)
    maps = maps and (TMA.tiled_2d(gt.reshape(NP, Op), BK, BK), maps)
    pw = 1 if maps else dw_producers()
    fn, smem = _wgmma_kernel(name, xt.dtype, "conv_dw_wgmma", producers=pw, tma=maps is not None)
    bn = WGMMA_TILES[name][0]
    ws = empty((S, cg.O, K), np.float32)
    i32 = KL.i32
    KL.launch(fn, (P.cdiv(cg.O, 128) * P.cdiv(K, bn), S), (256 + 128 * pw,),
              (gt, xt, ws, i32(cg.H), i32(cg.W), i32(cg.Cp), i32(cg.O), i32(Op), i32(cg.KH), i32(cg.KW), i32(cg.sh),
               i32(cg.sw), i32(cg.ph), i32(cg.pw), i32(cg.dh), i32(cg.dw), i32(cg.OH), i32(cg.OW), i32(NP), i32(K),
               i32(kps)) + (maps or (TMA.ZERO, TMA.ZERO)), shared_mem=smem)
    _dw_reduce(ws, acc32, dw, cg, C, accumulate, xt.dtype)
