"""Scaled dot-product attention on arrays, forward and backward, without an Lq x Lk matrix.

    flash_attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None)             -> (o, lse)
    flash_attention_backward(do, q, k, v, o, lse, attn_mask=None, is_causal=False, scale=None) -> (dq, dk, dv)

q (B, H, Lq, E), k (B, H, Lk, E), v (B, H, Lk, Ev), any strides. attn_mask broadcasts to (B, H, Lq, Lk): bool (True =
attend) or float (added to the scaled scores). is_causal keeps key j for query i when j <= i (top-left aligned, as
torch). scale defaults to 1 / sqrt(E). lse (B, H, Lq) is the natural-log logsumexp of the masked, scaled scores
(float32; float64 for float64 inputs), +inf for a row that attends nothing: such rows get output 0 and gradient 0
(torch's math backend gives the same since 2.5).

CuPy bfloat16 / float16 run the FlashAttention-2 kernels of cuda_src/flash_attention_{fwd,bwd}.cu (fp32 softmax and
accumulation; head dims 64 and 128 have their own tiles, other E <= 256 run zero-padded to 64 / 128 / 256).
CuPy float32 without a mask (causal or not) whose scores fit CHUNK_BYTES runs dense: cuBLAS products around the
softmax kernels of cuda_src/softmax.cu (`_dense_forward` / `_dense_backward`). Everything else (NumPy, float64, masks,
E != Ev, E > 256, larger float32 problems) takes the chunked reference below, written against `xp`: it handles blocks
of query rows so that at most CHUNK_BYTES of scores exist at a time. It is also the test oracle.
"""
import functools
import math
import threading

import numpy as np

from .. import backend
from ..errors import DTypeError, ShapeError, fmt_shape
from . import gemm as _gemm
from . import launching as KL
from . import loader as L
from . import plans as P
from . import softmax as _softmax
from . import tma

CHUNK_BYTES = 64 << 20  # bound on the scores (and their same-size temporaries) the reference holds at once
LOG2E = 1.4426950408889634
_HALF = ("float16", "bfloat16")

# Kernel tiles per padded head dim: forward (BM, BN, warps, OPT) for large / small grids and for masked calls;
# backward (BM, BN, warps, warps along M for S, along N for dK/dV, along M for dQ, OPT). OPT selects the
# kernels' scheduling variants (see their headers). The fastest of the tiles timed on the H100.
FWD_TILES = {64: {"large": (128, 64, 4, 0), "small": (64, 64, 4, 0), "mask": (64, 64, 4, 0)},
             128: {"large": (128, 64, 4, 0), "small": (64, 64, 4, 0), "mask": (64, 64, 4, 0)},
             256: {"large": (64, 64, 4, 0), "small": (64, 64, 4, 0), "mask": (64, 32, 4, 0)}}
BWD_TILES = {64: (64, 128, 8, 2, 4, 2, 0), 128: (64, 128, 8, 2, 4, 2, 0), 256: (64, 64, 8, 2, 4, 2, 0)}
_FWD_CTAS_PER_SM = {(64, 128): 2, (64, 64): 4, (128, 128): 2, (128, 64): 3}  # (D, BM): resident CTAs per SM
# Hopper (sm_90a) forward, cuda_src/flash_attention_fwd_sm90.cu, per padded head dim: (BN, consumer warpgroups,
# stages); a CTA holds 64 query rows per warpgroup. SM90_FWD = False keeps every call on the sm_80 kernels (A/B).
FWD_SM90_TILES = {64: (128, 2, 3), 128: (128, 2, 2)}
SM90_FWD = True
# FA3's ping-pong between the sm90 forward's two consumer warpgroups (named barriers: each issues its next product
# only after the other issued its previous one, so one's softmax runs while the other's products use the tensor
# cores). Off: measured slower on the H200 (2026-12-02, bit-equal outputs): Flux 1024² 0.632 vs 0.630 ms, SD3.5
# 0.520 vs 0.492, SDXL self 0.248 vs 0.236 -- without intra-warpgroup overlap each warpgroup's softmax is shorter
# than the other's two products, so the forced alternation only adds barrier waits. With the intra-warpgroup overlap
# (SM90_FWD_OVERLAP, FA3's head-dim-128 schedule: both) also no gain (H200, 2026-12-03, two rounds, bit-equal): Flux
# 1024² 0.476 / 0.467 vs 0.456 / 0.469 ms overlap alone, SD3.5 0.462 / 0.458 vs 0.448 / 0.443, SDXL self 0.215 / 0.219
# vs 0.211 / 0.216. True: for A/B.
SM90_FWD_PINGPONG = False
# The sm90 forward's producer loads K and V by TMA (flash_attn_fwd_sm90_tma: one thread issues each tile's boxes from
# 4-D tensor maps encoded per call) wherever TMA can describe their strides, else by cp.async from two warps. The
# cp.async producer bounded the forward: H200, Flux 1024², 0.629 ms, or 0.464 with its copies left out (a probe, not
# a result). False: cp.async everywhere (A/B).
SM90_FWD_TMA = True
# FA3's intra-warpgroup overlap (S of the next key tile issued before this tile's P V's wait, its softmax while P V
# runs; the kernels' OV template flag, alone or with the ping-pong): first built and timed on the H200 while the
# cp.async producer bounded the forward (1b5d93b: bit-equal but 1.6-5.4% slower on every shape; removed in 2eac2ce);
# built again on the TMA producer and timed there (H200, 2026-12-03, bench/attention.py --fwd-variants plain,overlap,
# bit-equal): Flux 1024² 0.468 vs 0.525 ms, SD3.5 1024² 0.447 vs 0.465, SDXL self 0.213 vs 0.218. False: the plain
# schedule (A/B).
SM90_FWD_OVERLAP = True
SMALL_LK = 128  # at most this many keys (one key block, e.g. SDXL's 77 text tokens) the forward runs the sm_80
# kernel's small tiles: 4 CTAs per SM beat the Hopper kernel's one (GPU time 0.019 vs 0.024 ms at SDXL cross, H100)
# Hopper backward, cuda_src/flash_attention_bwd_sm90.cu: (consumer warpgroups, stages, BM) per padded head dim; a
# CTA owns 64 keys per warpgroup and streams blocks of BM queries. SM90_BWD = False: the sm_80 kernel (A/B).
BWD_SM90_TILES = {64: (2, 3, 128), 128: (2, 2, 64)}
SM90_BWD = True
# The Hopper backward's producer loads the Q / dO tiles by TMA (flash_attn_bwd_sm90_tma: one thread issues each
# stage's boxes) instead of two warps of cp.async; False, or strides TMA cannot describe: cp.async (A/B).
SM90_BWD_TMA = True
# The Hopper backward adds each warpgroup's 64 x 64 dQ tile to a tiled fp32 accumulator with one bulk reduction from
# shared memory (DQB = 1) instead of per-thread vector atomics; False: the atomics (A/B). The stage count drops
# where the tiles' 16 KB of shared memory per warpgroup would not fit. H200, bf16, backward alone: Flux 1024²
# 2.153 -> 1.706 ms, SD3.5 1024² 1.866 -> 1.629, SDXL self 0.851 -> 0.734, Flux 512² 0.376 -> 0.312.
SM90_BWD_BULK_DQ = True
# The Hopper backward's tail schedule (flash_attention.cuh: fa_bwd_work_tail): when the CTAs of whole key blocks
# leave a last, partial wave (SD3.5 1024²: 1330 CTAs on 132 SMs = 10.08 waves, so 11 rounds), the last key blocks are
# cut into pieces of a few query blocks (their dK / dV summed through fp32 atomics) that fill it. The schedule is
# chosen by _bwd_tail's model of the SMs' work; TAIL_PIECE_COST is a piece's fixed cost in whole key blocks (its K / V
# loads and reductions). False: one CTA per key block (A/B).
SM90_BWD_TAIL = True
TAIL_PIECE_COST = 0.03
SM90_SMEM_MAX = 227 * 1024
# A boolean mask the same for every query row (B or 1, H or 1, 1, Lk) -- padded text tokens, Chroma's and
# Qwen-Image's -- runs the Hopper kernels' FA_MASK_KEYPAD (kind 3): the forward classifies the keys per 64 once per
# CTA and reads the mask only in a tile that mixes kept and masked keys, the backward reads each thread's two keys
# once; FA_MASK_BOOL reads one mask byte per score. False: kind 1 (A/B).
SM90_KEYPAD = True
KEYPAD_MAX_LK = 64 * 256  # FA_KEYPAD_GRANULES: the forward's shared table of key granules
MASK_KEYPAD = 3


# ----------------------------------------------------------------------------- checks
def _check(q, k, v, attn_mask):
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim != 4:
            raise ShapeError(f"flash attention takes (B, H, L, E) arrays; {name} has shape {fmt_shape(a.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ShapeError(f"flash attention: query {fmt_shape(q.shape)}, key {fmt_shape(k.shape)} and value "
                         f"{fmt_shape(v.shape)} do not fit (B, H equal; key and value share L; query and key share E)")
    if not (q.dtype == k.dtype == v.dtype):
        raise DTypeError(f"flash attention: query, key and value must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if attn_mask is not None:
        if attn_mask.dtype != np.bool_ and attn_mask.dtype.kind != "f":
            raise DTypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        full = q.shape[:3] + (k.shape[2],)
        try:
            np.broadcast_shapes(attn_mask.shape, full)
            ok = attn_mask.ndim <= 4
        except ValueError:
            ok = False
        if not ok:
            raise ShapeError(f"attn_mask of shape {fmt_shape(attn_mask.shape)} does not broadcast to (B, H, Lq, Lk) "
                             f"= {fmt_shape(full)}")


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _mask4(mask):
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


# ----------------------------------------------------------------------------- chunked reference (numpy / cupy)
def _rows_per_chunk(q, k):
    B, H, _, _ = q.shape
    per_row = B * H * max(k.shape[2], 1) * np.dtype(L.compute_dtype(q.dtype)).itemsize
    return max(1, min(q.shape[2], CHUNK_BYTES // per_row))


def _scores(xp, qc, kT, mask, is_causal, scale, i0):
    """Masked scaled scores of query rows [i0, i0 + rows) against all keys: (B, H, rows, Lk)."""
    s = _gemm.mm(qc, kT)
    s *= scale
    rows, lk = s.shape[-2], s.shape[-1]
    if mask is not None:
        mc = mask[..., i0:i0 + rows, :] if mask.shape[-2] > 1 else mask
        if mc.dtype == np.bool_:
            xp.copyto(s, -np.inf, where=~mc)
        else:
            s += mc.astype(s.dtype, copy=False)
    if is_causal:
        xp.copyto(s, -np.inf, where=xp.arange(lk)[None, :] > xp.arange(i0, i0 + rows)[:, None])
    return s


def _reference_forward(q, k, v, mask, is_causal, scale):
    xp = backend.xp_of(q)
    cd = L.compute_dtype(q.dtype)
    B, H, Lq, _ = q.shape
    o = xp.empty((B, H, Lq, v.shape[3]), dtype=q.dtype)
    lse = xp.empty((B, H, Lq), dtype=cd)
    kT = k.astype(cd, copy=False).swapaxes(-1, -2)   # read only: no copy when k is in cd already
    vf = v.astype(cd, copy=False)
    step = _rows_per_chunk(q, k)
    for i0 in range(0, Lq, step):
        i1 = min(Lq, i0 + step)
        s = _scores(xp, q[:, :, i0:i1].astype(cd, copy=False), kT, mask, is_causal, scale, i0)
        m = s.max(axis=-1, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0)
        s -= m
        p = xp.exp(s, out=s)
        l = p.sum(axis=-1, keepdims=True)
        attends = l > 0
        o[:, :, i0:i1] = _gemm.mm(p, vf) / xp.where(attends, l, 1)
        lse[:, :, i0:i1] = xp.where(attends, xp.log(xp.where(attends, l, 1)) + m, np.inf)[..., 0]
    return o, lse


def _reference_backward(do, q, k, v, o, lse, mask, is_causal, scale):
    xp = backend.xp_of(q)
    cd = L.compute_dtype(q.dtype)
    Lq = q.shape[2]
    kf, vf = k.astype(cd, copy=False), v.astype(cd, copy=False)   # read only, as the chunks below
    kT, vT = kf.swapaxes(-1, -2), vf.swapaxes(-1, -2)
    dq = xp.empty(q.shape, dtype=q.dtype)
    dk = xp.zeros(k.shape, dtype=cd)
    dv = xp.zeros(v.shape, dtype=cd)
    step = _rows_per_chunk(q, k)
    for i0 in range(0, Lq, step):
        i1 = min(Lq, i0 + step)
        qc, gc = q[:, :, i0:i1].astype(cd, copy=False), do[:, :, i0:i1].astype(cd, copy=False)
        delta = (gc * o[:, :, i0:i1].astype(cd, copy=False)).sum(axis=-1, keepdims=True)
        s = _scores(xp, qc, kT, mask, is_causal, scale, i0)
        s -= lse[:, :, i0:i1, None].astype(cd)
        p = xp.exp(s, out=s)  # 0 where masked or where the row attends nothing (lse = +inf)
        dv += _gemm.mm(p.swapaxes(-1, -2), gc)
        ds = _gemm.mm(gc, vT)
        ds -= delta
        ds *= p
        dq[:, :, i0:i1] = _gemm.mm(ds, kf) * scale
        dk += _gemm.mm(ds.swapaxes(-1, -2), qc) * scale
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- dense float32 path (cuda)
def _dense_ok(q, k, v, mask):
    """float32 cuda attention without a mask whose whole score matrix fits the reference's chunk bound: two cuBLAS
    products around FLAME's softmax kernels (a handful of launches; the chunked reference issues some twenty CuPy
    ops, ~0.7 ms of host time at any size -- the flash kernels take half types only)."""
    return (mask is None and q.dtype == np.float32 and k.dtype == np.float32 and v.dtype == np.float32
            and backend.is_cuda_array(q) and L.use_kernel(q, k, v) and k.shape[2] > 0 and q.shape[2] > 0
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4 <= CHUNK_BYTES)


_causal_bias = {}   # (Lq, Lk, device) -> (Lq, Lk) float32: 0 where key j <= query i, -inf above (top-left aligned)


def _dense_scores(q, k, is_causal, scale):
    s = _gemm.matmul(q, k.swapaxes(-1, -2), alpha=scale)
    if is_causal:   # every row keeps key 0: no row is left empty
        lq, lk = s.shape[-2:]
        key = (lq, lk, q.data.device_id)
        bias = _causal_bias.get(key)
        if bias is None:
            cp = backend.cupy
            bias = cp.where(cp.arange(lk)[None, :] > cp.arange(lq)[:, None], -np.inf, 0.0).astype(np.float32)
            if len(_causal_bias) > 64:
                _causal_bias.clear()
            _causal_bias[key] = bias
        s += bias
    return s


def _dense_forward(q, k, v, is_causal, scale):
    s = _dense_scores(q, k, is_causal, scale)
    p = _softmax.softmax_forward(s)
    logp = _softmax.softmax_forward(s, log=True)
    lse = s[..., 0] - logp[..., 0]   # s_0 - (s_0 - lse): key 0 is attended by every row
    return _gemm.matmul(p, v), lse


def _dense_backward(do, q, k, v, is_causal, scale):
    p = _softmax.softmax_forward(_dense_scores(q, k, is_causal, scale))
    dv = _gemm.matmul(p.swapaxes(-1, -2), do)
    ds = _softmax.softmax_backward(_gemm.matmul(do, v.swapaxes(-1, -2)), p)
    return _gemm.matmul(ds, k, alpha=scale), _gemm.matmul(ds.swapaxes(-1, -2), q, alpha=scale), dv


# ----------------------------------------------------------------------------- kernel path
def _use_kernel(q, k, v, attn_mask, scale):
    return (L.use_kernel(q, k, v) and (attn_mask is None or backend.is_cuda_array(attn_mask))
            and L.dtype_name(q.dtype) in _HALF and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[3] == v.shape[3] and q.shape[3] <= 256 and math.isfinite(scale) and scale > 0
            and q.shape[2] > 0 and k.shape[2] > 0 and q.shape[0] * q.shape[1] > 0
            and q.shape[0] <= 65535 and q.shape[1] <= 65535)


def _operand(a, e_pad):
    """`a` with unit column stride, 16-byte aligned rows and e_pad columns (zero-padded when E is not a multiple of
    8), plus its (batch, head, row) strides in elements."""
    xp = backend.xp_of(a)
    item = a.itemsize
    if a.shape[3] != e_pad:
        p = xp.zeros(a.shape[:3] + (e_pad,), dtype=a.dtype)
        p[..., :a.shape[3]] = a
        a = p
    elif (a.strides[3] != item or a.data.ptr % 16 or any(s % 16 for s in a.strides[:3])):
        a = xp.ascontiguousarray(a)
    return a, tuple(KL.i64(s // item) for s in a.strides[:3])


def _out_like(a, e_pad):
    """An output with a's layout (e.g. (B, L, H, E) memory under a (B, H, L, E) view) and e_pad columns."""
    xp = backend.xp_of(a)
    if a.shape[3] == e_pad:
        out = xp.empty_like(a)
        if out.strides[3] == a.itemsize and not any(s % 16 for s in out.strides[:3]):
            return out
    return xp.empty(a.shape[:3] + (e_pad,), dtype=a.dtype)


def _mask_arg(mask, shape4):
    """(pointer argument, mask kind, element strides (b, h, q, k)) with broadcast dims at stride 0."""
    if mask is None:
        return KL.null(), 0, (KL.i64(0),) * 4
    xp = backend.xp_of(mask)
    m = _mask4(mask)
    if m.dtype == np.bool_:
        kind = 1
    else:
        kind = 2
        m = m.astype(np.float32, copy=False)  # before broadcasting: copies only the mask's own elements
    m = xp.broadcast_to(m, shape4)
    return m, kind, tuple(KL.i64(s // m.itemsize) for s in m.strides)


def _keypad(kind, ms):
    """Whether a mask of kind `kind` with element strides `ms` (b, h, q, k) is a key-padding mask: boolean, the
    same for every query row."""
    return SM90_KEYPAD and kind == 1 and int(ms[2]) == 0


def _tile_dim(e_pad):
    return 64 if e_pad <= 64 else (128 if e_pad <= 128 else 256)


def _fwd_tiles(D, B, H, Lq, masked, Lk=SMALL_LK + 1):
    tiles = FWD_TILES[D]
    if masked:
        return tiles["mask"]
    if Lk <= SMALL_LK:
        return tiles["small"]
    big, small = tiles["large"], tiles["small"]
    if big == small:
        return big
    sms = P.sm_count()

    def efficiency(t):  # fraction of the last wave's slots in use, over all waves
        ctas = P.cdiv(Lq, t[0]) * B * H
        slots = sms * _FWD_CTAS_PER_SM.get((D, t[0]), 1)
        return ctas / (P.cdiv(ctas, slots) * slots)

    return big if efficiency(big) >= 0.8 or efficiency(big) >= efficiency(small) else small


_functions = {}


def _kernel(stem, expr, dtype, shared_mem=0):
    """The RawKernel for a template expression (memoised here: the launch path is hot), with its dynamic shared
    memory limit raised once."""
    key = (stem, expr, dtype)
    fn = _functions.get(key)
    if fn is None:
        fn = L.get_function(stem, expr, dtype)
        KL.allow_dynamic_smem(fn, shared_mem)  # its launches go through PackedLaunch
        _functions[key] = fn
    return fn


def sm90_fwd_smem(D, BN, NWG, STAGES):
    """Dynamic shared memory of the sm90 forward: the Q tile of 64 * NWG rows and STAGES K and V tiles of BN rows,
    bf16 / fp16, plus 1024 bytes for the tiles' 1024-byte alignment."""
    return 1024 + (64 * NWG + 2 * STAGES * BN) * D * 2


def sm90_fwd_expression(D, BN, NWG, STAGES, kind, pp, tma=False, ov=0):
    """The name expression of one sm90 forward instantiation (the launch and tools/build_kernels.py share it, so
    that every default one is prebuilt); tma: the kernel whose producer loads by TMA; ov: the intra-warpgroup overlap
    (SM90_FWD_OVERLAP)."""
    name = "flash_attn_fwd_sm90_tma" if tma else "flash_attn_fwd_sm90"
    return f"{name}<{{T}}, {D}, {BN}, {NWG}, {STAGES}, {kind}, {pp}" + (", 1>" if ov else ">")


def sm90_bwd_expression(D, NWG, STAGES, kind, BM, dqb, tma=False):
    """The name expression of one sm90 backward instantiation (the launch and tools/build_kernels.py share it);
    tma: the kernel whose producer loads Q / dO by TMA."""
    name = "flash_attn_bwd_sm90_tma" if tma else "flash_attn_bwd_sm90"
    return f"{name}<{{T}}, {D}, {NWG}, {STAGES}, {kind}, {BM}, {dqb}>"


def _kv_maps(k, v, e_pad, BN):
    """The forward's K / V maps (_tile_maps), or None where SM90_FWD_TMA is off."""
    return _tile_maps(k, v, e_pad, BN) if SM90_FWD_TMA else None


def _tile_maps(k, v, e_pad, BN):
    """(the kernel's two-map tensor-map parameter, its two TiledMap encoders, already encoded for k and v), or None
    where TMA cannot describe them (a broadcast dimension's stride 0, a stride not a multiple of 16 bytes) or the
    driver cannot encode: the cp.async kernel serves those. Each map is k or v as a 4-D (e_pad, L, H, B) tensor, the
    box 64 columns x BN rows (past the rows and the columns: zeros, as the cp.async copies fill). The forward passes
    K and V (BN keys), the backward Q and dO (BM queries)."""
    if not tma.available():
        return None
    out = tma.TensorMap(2)
    encoders = []
    try:
        for slot, a in enumerate((k, v)):
            B, H, Lk, _ = a.shape
            dims = [e_pad, Lk, H, B]
            strides = [a.strides[2], a.strides[1], a.strides[0]]
            inner = e_pad * a.itemsize
            for i, n in enumerate((Lk, H, B)):  # a size-1 dimension's stride is never used: any valid one
                if n == 1:
                    strides[i] = max(16, -(-inner // 16) * 16)
                inner = strides[i] * n
            m = tma.TiledMap(a.dtype, dims, strides, (64, BN, 1, 1), out, slot)
            m.encode(a.data.ptr)
            encoders.append(m)
    except (ValueError, RuntimeError, TypeError):
        return None
    return out, tuple(encoders)


def _use_sm90(D, tiles, Lk=SMALL_LK + 1):
    """Whether a forward call runs the Hopper kernel: `tiles` of 3 entries name one, of 4 the sm_80 kernel."""
    if tiles is not None:
        return len(tiles) == 3
    return SM90_FWD and D in FWD_SM90_TILES and Lk > SMALL_LK and L.arch_available("sm_90a")


_fwd_plans = {}  # everything about a forward launch except the data: (shapes, strides, dtype, ...) -> plan
MAX_PLANS = 512  # per direction; past it the cache starts over


_F32 = np.dtype(np.float32)


def _fwd_key(q, k, v, is_causal, scale, tiles, mask=None):
    """The key of a forward's plan in _fwd_plans: everything that fixes the launch but the addresses (a mask's layout
    and dtype too, with the key-padding switches: its kind, strides and the key-padding variant follow from them)."""
    return (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, q.dtype, is_causal, scale,
            q.data.device_id, SM90_FWD, SM90_FWD_PINGPONG, SM90_FWD_TMA, SM90_FWD_OVERLAP, tiles, threading.get_ident(),
            None if mask is None else (mask.shape, mask.strides, mask.dtype, SM90_KEYPAD, KEYPAD_MAX_LK))


_qkv_plans = KL.LaunchCache(MAX_PLANS)   # per packed-qkv configuration: (launch, TMA encoders, out / lse shapes, step)
_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)


def qkv_attention_forward(qkv, heads, is_causal, scale):
    """Unmasked attention over a packed projection on cuda: qkv (B, L, 3 * heads * D), a C-contiguous cupy array
    holding q | k | v on its last dim -> (out (B, L, heads * D): the heads merged, lse (B, heads, L)), or None where
    the caller's general path runs (another array type or layout, kernels off, a shape the kernels do not take).
    The eager per-op path of ops.attention.qkv_attention: a configuration's first call runs the kernel on the head
    views and keeps its packed launch (when the kernel writes the output in (B, L, heads, D) order, i.e. merged);
    later calls allocate the output and launch with q, k, v's addresses."""
    if type(qkv) is not _nd or not qkv._c_contiguous or qkv.ndim != 3:
        return None
    B, Lq, W = qkv.shape
    p = qkv.data.ptr
    dt = qkv.dtype
    key = (qkv.shape, dt, heads, is_causal, scale, SM90_FWD, SM90_FWD_PINGPONG, SM90_FWD_TMA, SM90_FWD_OVERLAP)
    entry = _qkv_plans.get(key)
    if entry is not None and not p & 15 and L.enabled():
        launch, maps, o_shape, lse_shape, step = entry
        kp, vp = p + step, p + 2 * step
        if maps is not None:
            maps[0].encode(kp)
            maps[1].encode(vp)
        o, lse = _nd(o_shape, dt), _nd(lse_shape, _F32)
        launch((p, kp, vp, o.data.ptr, lse.data.ptr))
        return o, lse
    if heads < 1 or W % (3 * heads) or Lq == 0:
        return None
    E = W // (3 * heads)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in qkv.reshape(B, Lq, 3, heads, E).transpose(2, 0, 1, 3, 4))
    if not _use_kernel(q, k, v, None, scale):
        return None
    o4, lse = _kernel_forward(q, k, v, None, is_causal, scale)
    merged = o4.transpose(0, 2, 1, 3)   # (B, L, heads, E)
    if not merged.flags.c_contiguous:   # the kernel wrote (B, heads, L, E) memory: the merge is a copy
        return o4.transpose(0, 2, 1, 3).reshape(B, Lq, W // 3), lse
    plan = _fwd_plans.get(_fwd_key(q, k, v, is_causal, scale, None))
    step = heads * E * qkv.itemsize
    if plan is not None and not p & 15 and not step & 15:
        launch, _, _, lse_shape, maps = plan
        _qkv_plans.put(key, (launch, maps, (B, Lq, W // 3), lse_shape, step))
    return merged.reshape(B, Lq, W // 3), lse


def _kernel_forward(q, k, v, mask, is_causal, scale, tiles=None):
    # the repeated call (a mask, if any, of a layout seen before: T5's position bias, a padding mask): one dict
    # lookup, two allocations, one packed launch
    plan = _fwd_plans.get(_fwd_key(q, k, v, is_causal, scale, tiles, mask))
    if plan is not None:
        qp, kp, vp = q.data.ptr, k.data.ptr, v.data.ptr
        if not (qp | kp | vp) & 15:
            launch, like_q, o_shape, lse_shape, maps = plan
            if maps is not None:
                maps[0].encode(kp)
                maps[1].encode(vp)
            nd = type(q)  # cupy.ndarray: its constructor is the cheapest allocation
            o = backend.xp_of(q).empty_like(q) if like_q else nd(o_shape, q.dtype)
            lse = nd(lse_shape, _F32)
            if mask is None:
                launch((qp, kp, vp, o.data.ptr, lse.data.ptr))
            else:
                launch((qp, kp, vp, o.data.ptr, lse.data.ptr, mask.data.ptr))
            return o, lse
    xp = backend.xp_of(q)
    B, H, Lq, E = q.shape
    Lk = k.shape[2]
    e_pad = -(-E // 8) * 8
    D = _tile_dim(e_pad)
    qa, qs = _operand(q, e_pad)
    ka, ks = _operand(k, e_pad)
    va, vs = _operand(v, e_pad)
    o = _out_like(q, e_pad)
    os_ = tuple(KL.i64(s // o.itemsize) for s in o.strides[:3])
    lse = xp.empty((B, H, Lq), dtype=np.float32)
    marg, kind, ms = _mask_arg(mask, (B, H, Lq, Lk))
    maps = None
    if _use_sm90(D, tiles, Lk):
        BN, NWG, STAGES = tiles or FWD_SM90_TILES[D]
        BM = 64 * NWG
        smem = sm90_fwd_smem(D, BN, NWG, STAGES)
        pp = int(SM90_FWD_PINGPONG and NWG == 2)
        ov = int(SM90_FWD_OVERLAP)
        if _keypad(kind, ms) and Lk <= KEYPAD_MAX_LK:
            kind = MASK_KEYPAD
        maps = _kv_maps(ka, va, e_pad, BN)
        expr = sm90_fwd_expression(D, BN, NWG, STAGES, kind, pp, maps is not None, ov)
        fn = _kernel("flash_attention_fwd_sm90", expr, q.dtype, smem)
        block = ((NWG + 1) * 128, 1, 1)
    else:
        BM, BN, NW, OPT = tiles or _fwd_tiles(D, B, H, Lq, mask is not None, Lk)
        smem = (BM + 2 * BN) * D * 2
        fn = _kernel("flash_attention_fwd", f"flash_attn_fwd<{{T}}, {D}, {BM}, {BN}, {NW}, {kind}, {OPT}>", q.dtype,
                     smem)
        block = (NW * 32, 1, 1)
    grid = (P.cdiv(Lq, BM), H, B)
    tail = (marg, KL.i32(H), KL.i32(Lq), KL.i32(Lk), KL.i32(e_pad), *qs, *ks, *vs, *os_, *ms, KL.f32(scale * LOG2E),
            KL.i32(bool(is_causal))) + (() if maps is None else (maps[0],))
    KL.launch(fn, grid, block, (qa, ka, va, o, lse) + tail, shared_mem=smem)
    # a plan when the launch is fixed by the addresses of q, k, v, the outputs and the mask: the operands and the
    # mask passed as they are (a mask converted to float32 is a new array at every call: no plan)
    if (qa is q and ka is k and va is v and e_pad == E
            and (mask is None or (type(marg) is type(mask) and marg.data.ptr == mask.data.ptr))):
        contiguous = o.strides == xp.empty(o.shape, dtype=o.dtype).strides
        if contiguous or (o.shape == q.shape and o.strides == xp.empty_like(q).strides):
            if len(_fwd_plans) >= MAX_PLANS:  # many distinct shapes (variable lengths): rebuild on demand
                _fwd_plans.clear()
            _fwd_plans[_fwd_key(q, k, v, is_causal, scale, tiles, mask)] = (
                KL.PackedLaunch(fn, grid, block, (q, k, v, o, lse) + tail, 5 if mask is None else 6, smem),
                not contiguous, o.shape, lse.shape, None if maps is None else maps[1])
    return (o if e_pad == E else o[..., :E]), lse


def _bwd_splits(n_ctas, m_blocks):
    """Slices of the query blocks per key block: enough CTAs to fill the GPU twice (dK, dV then go through fp32
    atomics)."""
    want = 2 * P.sm_count()
    if n_ctas >= want or m_blocks <= 1:
        return 1, m_blocks
    per = P.cdiv(m_blocks, min(m_blocks, P.cdiv(want, n_ctas)))
    return P.cdiv(m_blocks, per), per


def _tail_makespan(whole, pieces_of, sms, cost):
    """The time (in whole key blocks) when the last SM finishes: `whole` units of cost 1 then the pieces (a list of
    query-block counts as fractions of a unit), each given in order to the SM that frees first."""
    import heapq
    a, r = divmod(whole, sms)
    heap = [float(a + 1)] * r + [float(a)] * (sms - r)
    heapq.heapify(heap)
    for frac in pieces_of:
        heapq.heappush(heap, heapq.heappop(heap) + frac + cost)
    return max(heap)


def _bwd_tail(units, m_blocks, sms, cost=None):
    """The tail schedule for `units` key blocks of m_blocks query blocks each on `sms` SMs: (u_whole, per) -- units
    0 .. u_whole-1 whole, the rest in pieces of `per` query blocks -- or None where one CTA per key block is as
    fast (no partial last wave, or pieces would not shorten it by 2%)."""
    cost = TAIL_PIECE_COST if cost is None else cost
    if units <= sms or m_blocks < 2 or units % sms == 0:
        return None
    return _bwd_tail_search(units, m_blocks, sms, float(cost))


@functools.lru_cache(maxsize=1024)
def _bwd_tail_search(units, m_blocks, sms, cost):
    """_bwd_tail's search, memoised: a masked call (never a cached plan) would run it in every backward (~10 ms of
    host time at Flux / Qwen-Image 1024² shapes)."""
    plain = float(P.cdiv(units, sms))
    best, choice = plain * 0.98, None
    rem = units % sms
    for t in (rem, rem + sms):
        if t > units:
            continue
        seen = set()
        for n in range(2, m_blocks + 1):
            per = P.cdiv(m_blocks, n)
            if per in seen:
                continue
            seen.add(per)
            n = P.cdiv(m_blocks, per)
            fracs = [min(per, m_blocks - i * per) / m_blocks for i in range(n)] * t
            span = _tail_makespan(units - t, fracs, sms, cost)
            if span < best:
                best, choice = span, (units - t, per)
    return choice


_bwd_plans = {}  # as _fwd_plans, for the backward: (packed launches, allocation recipe)


def _alloc_mode(out, like):
    """How a plan re-creates an output: "c" (C-contiguous), "like" (empty_like of the input), None (neither)."""
    xp = backend.xp_of(out)
    if out.strides == xp.empty(out.shape, dtype=out.dtype).strides:
        return "c"
    if out.shape == like.shape and out.strides == xp.empty_like(like).strides:
        return "like"
    return None


def _run_bwd_plan(plan, do, q, k, v, o, lse):
    delta_launch, main_launch, converts, delta_shape, dq_acc_shape, acc_shape, modes, dq_in_main, maps = plan
    xp, nd = backend.xp_of(q), type(q)
    if maps is not None:  # the Q / dO tensor maps hold this call's addresses
        maps[0].encode(q.data.ptr)
        maps[1].encode(do.data.ptr)
    outs = [xp.empty_like(src) if mode == "like" else nd(src.shape, src.dtype) for mode, src in zip(modes, (q, k, v))]
    delta = nd(delta_shape, _F32)
    delta_launch((o.data.ptr, do.data.ptr, delta.data.ptr))
    dq_acc = xp.zeros(dq_acc_shape, dtype=_F32) if dq_acc_shape else None
    accs = (xp.zeros(acc_shape, dtype=_F32), xp.zeros(acc_shape, dtype=_F32)) if acc_shape else (None, None)
    ptr = [q.data.ptr, k.data.ptr, v.data.ptr, do.data.ptr, lse.data.ptr, delta.data.ptr,
           0 if dq_acc is None else dq_acc.data.ptr, outs[1].data.ptr, outs[2].data.ptr,
           0 if accs[0] is None else accs[0].data.ptr, 0 if accs[1] is None else accs[1].data.ptr]
    if dq_in_main:
        ptr.append(outs[0].data.ptr)
    main_launch(ptr)
    srcs = {"dq": dq_acc, "dk": accs[0], "dv": accs[1]}
    dsts = {"dq": outs[0], "dk": outs[1], "dv": outs[2]}
    for name, launch in converts:
        launch((srcs[name].data.ptr, dsts[name].data.ptr))
    return tuple(outs)


def _delta_lanes(e_pad):
    """flash_attn_bwd_delta's lanes per row: e_pad / 8 rounded up to a power of two, at most 32 (as the kernel)."""
    g = 1
    while g < 32 and g * 8 < e_pad:
        g *= 2
    return g


def _bwd_sm90_smem(D, NWG, STAGES, BM, dqb):
    BN = 64 * NWG
    return (1024 + (2 * BN * D + 2 * STAGES * BM * D + 2 * BN * BM) * 2 + 2 * STAGES * BM * 4
            + dqb * NWG * 64 * 64 * 4)


def _kernel_backward(do, q, k, v, o, lse, mask, is_causal, scale, tiles=None):
    if mask is None:  # the repeated call: one dict lookup, the allocations, packed launches
        key = (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, o.shape, o.strides, do.strides,
               lse.strides, q.dtype, o.dtype, do.dtype, lse.dtype, is_causal, scale, q.data.device_id, SM90_BWD,
               SM90_BWD_BULK_DQ, SM90_BWD_TAIL, SM90_BWD_TMA, TAIL_PIECE_COST, tiles, threading.get_ident())
        plan = _bwd_plans.get(key)
        if plan is not None and not (q.data.ptr | k.data.ptr | v.data.ptr | o.data.ptr | do.data.ptr) & 15:
            return _run_bwd_plan(plan, do, q, k, v, o, lse)
    xp = backend.xp_of(q)
    B, H, Lq, E = q.shape
    Lk = k.shape[2]
    e_pad = -(-E // 8) * 8
    D = _tile_dim(e_pad)
    T = q.dtype
    sm90 = len(tiles) == 3 if tiles is not None else (SM90_BWD and D in BWD_SM90_TILES
                                                       and L.arch_available("sm_90a"))
    if sm90:
        NWG, STAGES, BM = tiles or BWD_SM90_TILES[D]
        BN = 64 * NWG
    else:
        BM, BN, NW, WMS, WNKV, WMQ, OPT = tiles or BWD_TILES[D]
    qa, qs = _operand(q, e_pad)
    ka, ks = _operand(k, e_pad)
    va, vs = _operand(v, e_pad)
    oa, os_ = _operand(o.astype(T, copy=False), e_pad)
    ga, gs = _operand(do.astype(T, copy=False), e_pad)
    lse_in, lse = lse, xp.ascontiguousarray(lse, dtype=np.float32)
    marg, kind, ms = _mask_arg(mask, (B, H, Lq, Lk))

    delta = xp.empty((B, H, Lq), dtype=np.float32)
    delta_fn = _kernel("flash_attention_bwd", "flash_attn_bwd_delta<{T}>", T)
    delta_grid = (P.cdiv(Lq, 256 // _delta_lanes(e_pad)), H, B)
    delta_args = (oa, ga, delta, KL.i32(H), KL.i32(Lq), KL.i32(e_pad), *os_, *gs)
    KL.launch(delta_fn, delta_grid, (256,), delta_args)

    n_blocks, m_blocks = P.cdiv(Lk, BN), P.cdiv(Lq, BM)
    splits, per = _bwd_splits(n_blocks * B * H, m_blocks)
    tail = (_bwd_tail(n_blocks * B * H, m_blocks, P.sm_count())
            if sm90 and SM90_BWD_TAIL and splits == 1 and not is_causal else None)
    dq_direct = sm90 and n_blocks == 1  # one key block: each CTA's dQ rows are complete (no fp32 accumulator)
    # the bulk dQ path: a warpgroup's dQ tile is 64 x 64 (BM = 128: 64 rows x D = 64; BM = 64: D / NWG = 64 columns)
    dqb = int(sm90 and SM90_BWD_BULK_DQ and not dq_direct and (D if BM == 128 else D // NWG) == 64)
    if sm90:
        while dqb and STAGES > 2 and _bwd_sm90_smem(D, NWG, STAGES, BM, dqb) > SM90_SMEM_MAX:
            STAGES -= 1
    if dq_direct:
        dq_acc = KL.null()
    elif dqb:
        dq_acc = xp.zeros((B * H * m_blocks * BM * D,), dtype=np.float32)
    else:
        dq_acc = xp.zeros((B, H, Lq, e_pad), dtype=np.float32)
    dq = _out_like(q, e_pad)
    dk = _out_like(k, e_pad)
    dv = _out_like(v, e_pad)
    acc_row0 = 0  # the first (b, h, key) row the dK / dV accumulators hold, flattened
    if tail is not None:
        u_whole, per = tail
        bh0, nb0 = divmod(u_whole, n_blocks)
        acc_row0 = bh0 * Lk + nb0 * BN
        dk_acc = xp.zeros((B * H * Lk - acc_row0, e_pad), dtype=np.float32)
        dv_acc = xp.zeros((B * H * Lk - acc_row0, e_pad), dtype=np.float32)
        acc_args = (dk_acc, dv_acc)
    elif splits > 1:
        dk_acc = xp.zeros((B, H, Lk, e_pad), dtype=np.float32)
        dv_acc = xp.zeros((B, H, Lk, e_pad), dtype=np.float32)
        acc_args = (dk_acc, dv_acc)
    else:
        acc_args = (KL.null(), KL.null())
    summed = tail is not None or splits > 1  # dK / dV come from the fp32 accumulators (all or their last rows)
    dks = tuple(KL.i64(s // dk.itemsize) for s in dk.strides[:3])
    dvs = tuple(KL.i64(s // dv.itemsize) for s in dv.strides[:3])
    maps = None
    if sm90:
        smem = _bwd_sm90_smem(D, NWG, STAGES, BM, dqb)
        if _keypad(kind, ms):
            kind = MASK_KEYPAD
        maps = _tile_maps(qa, ga, e_pad, BM) if SM90_BWD_TMA else None
        fn = _kernel("flash_attention_bwd_sm90", sm90_bwd_expression(D, NWG, STAGES, kind, BM, dqb, maps is not None),
                     T, smem)
        block = ((NWG + 1) * 128,)
    else:
        smem = (2 * BN * D + 4 * BM * D + 2 * BM * BN) * 2 + 2 * BM * 4
        fn = _kernel("flash_attention_bwd",
                     f"flash_attn_bwd<{{T}}, {D}, {BM}, {BN}, {NW}, {WMS}, {WNKV}, {WMQ}, {kind}, {OPT}>", T, smem)
        block = (NW * 32,)
    if tail is not None:
        main_grid = (tail[0] + (n_blocks * B * H - tail[0]) * P.cdiv(m_blocks, per), 1, 1)
    else:
        main_grid = (n_blocks * splits, H, B)
    main_args = ((qa, ka, va, ga, lse, delta, dq_acc, dk, dv, *acc_args, marg, KL.i32(H), KL.i32(Lq), KL.i32(Lk),
                  KL.i32(e_pad), KL.i32(n_blocks), KL.i32(per), *qs, *ks, *vs, *gs, *dks, *dvs, *ms,
                  KL.f32(scale * LOG2E), KL.f32(scale), KL.i32(bool(is_causal)))
                 + ((dq, *(KL.i64(s // dq.itemsize) for s in dq.strides[:3]),
                     KL.i32(-1 if tail is None else tail[0]), KL.i64(acc_row0)) if sm90 else ()))
    dq_slot = len(main_args) - 6  # sm90: dq's pointer (its strides, u_whole and acc_row0 follow)
    if maps is not None:
        main_args += (maps[0],)
    KL.launch(fn, main_grid, block, main_args, shared_mem=smem)
    convert = _kernel("flash_attention_bwd", "flash_attn_convert<{T}>", T)
    outs = [] if dq_direct else [("dq", dq_acc, dq, scale, Lq, 0)]
    if summed:
        outs += [("dk", dk_acc, dk, 1.0, Lk, acc_row0 * e_pad), ("dv", dv_acc, dv, 1.0, Lk, acc_row0 * e_pad)]
    converts = []
    for name, src, dst, sc, rows, i0 in outs:
        strides = tuple(KL.i64(s // dst.itemsize) for s in dst.strides[:3])
        if name == "dq" and dqb:   # one CTA per 64 x 64 tile of the accumulator
            cfn = _kernel("flash_attention_bwd", "flash_attn_convert_tiles<{T}>", T)
            tiles = B * H * m_blocks * NWG
            vec = all(s % (8 * dst.itemsize) == 0 for s in dst.strides[:3])   # 16-byte row pieces
            args = (src, dst, KL.i32(H), KL.i32(rows), KL.i32(e_pad), KL.i32(BM), KL.i32(NWG),
                    KL.i32(int(BM == 128)), KL.i64(tiles), *strides, KL.f32(sc), KL.i32(int(vec)))
            grid = (max(1, min(tiles, P.sm_count() * 16)),)
        else:
            cfn, total = convert, src.size   # a multiple of 8 (e_pad is): 8 elements per thread
            args = (src, dst, KL.i32(H), KL.i32(rows), KL.i32(e_pad), KL.i64(total), *strides, KL.f32(sc),
                    KL.i64(i0))
            grid = (max(1, min(P.cdiv(total, 8 * 256), P.sm_count() * 32)),)
        KL.launch(cfn, grid, (256,), args)
        converts.append((name, cfn, grid, args))
    if (mask is None and e_pad == E and qa is q and ka is k and va is v and oa is o and ga is do
            and lse is lse_in):
        modes = tuple(_alloc_mode(out, src) for out, src in ((dq, q), (dk, k), (dv, v)))
        if None not in modes:
            pointers = list(range(11)) + ([dq_slot] if sm90 else [])
            if len(_bwd_plans) >= MAX_PLANS:
                _bwd_plans.clear()
            _bwd_plans[key] = (
                KL.PackedLaunch(delta_fn, delta_grid, (256,), delta_args, 3),
                KL.PackedLaunch(fn, main_grid, block, main_args, pointers, smem),
                tuple((name, KL.PackedLaunch(cfn, grid, (256,), args, 2)) for name, cfn, grid, args in converts),
                delta.shape, None if dq_direct else dq_acc.shape, dk_acc.shape if summed else None, modes,
                sm90, None if maps is None else maps[1])
    if e_pad != E:
        dq, dk, dv = dq[..., :E], dk[..., :E], dv[..., :E]
    return dq, dk, dv


# ----------------------------------------------------------------------------- API
def flash_attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """Attention output (B, H, Lq, Ev) in q's dtype and the row logsumexp (B, H, Lq)."""
    _check(q, k, v, attn_mask)
    scale = _scale(q, scale)
    mask = None if attn_mask is None else _mask4(attn_mask)
    if _use_kernel(q, k, v, mask, scale):
        return _kernel_forward(q, k, v, mask, is_causal, scale)
    if _dense_ok(q, k, v, mask):
        return _dense_forward(q, k, v, is_causal, scale)
    if k.shape[2] == 0:  # nothing to attend: output 0, as for a fully masked row
        xp = backend.xp_of(q)
        return (xp.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype),
                xp.full(q.shape[:3], np.inf, dtype=L.compute_dtype(q.dtype)))
    return _reference_forward(q, k, v, mask, is_causal, scale)


def flash_attention_backward(do, q, k, v, o, lse, attn_mask=None, is_causal=False, scale=None):
    """Gradients (dq, dk, dv) of the attention output with respect to q, k, v, given its gradient `do`."""
    _check(q, k, v, attn_mask)
    if do.shape != o.shape or o.shape != q.shape[:3] + (v.shape[3],) or lse.shape != q.shape[:3]:
        raise ShapeError(f"flash_attention_backward: grad {fmt_shape(do.shape)}, output {fmt_shape(o.shape)} and "
                         f"lse {fmt_shape(lse.shape)} do not match query {fmt_shape(q.shape)} / value "
                         f"{fmt_shape(v.shape)}")
    scale = _scale(q, scale)
    mask = None if attn_mask is None else _mask4(attn_mask)
    if _use_kernel(q, k, v, mask, scale):
        return _kernel_backward(do, q, k, v, o, lse, mask, is_causal, scale)
    if _dense_ok(q, k, v, mask):
        return _dense_backward(do.astype(np.float32, copy=False), q, k, v, is_causal, scale)
    if k.shape[2] == 0:
        xp = backend.xp_of(q)
        return xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    return _reference_backward(do, q, k, v, o, lse, mask, is_causal, scale)
