"""LayerNorm and RMSNorm (last axis) on arrays, forward and backward (GroupNorm: groupnorm.py).

Kernels: cuda_src/norms.cu. Statistics are fp32 (float64 for float64 input on the reference path); the saved
`mean` / `rstd` have shape x.shape[:-1].

    layer_norm_forward(x, weight, bias, eps, stats)     -> (y, mean, rstd) (statistics None when not stats)
    layer_norm_backward(dy, x, weight, mean, rstd, bias) -> (dx, dweight, dbias)   (None where weight / bias is None)
    rms_norm_forward(x, weight, eps, stats)              -> (y, rstd)
    rms_norm_backward(dy, x, weight, rstd)               -> (dx, dweight)
"""
import math

import numpy as np

from .. import backend
from ..errors import KernelCompileError, ShapeError
from . import column_sum as CS
from . import launching as KL
from . import loader as L
from . import plans as P


def _check_affine(name, p, size, what):
    if p is not None and (p.ndim != 1 or p.shape[0] != size):
        raise ShapeError(f"{name}: {what} must have shape ({size},) to match the input, got {tuple(p.shape)}")


def _rows_cols(x):
    cols = x.shape[-1]
    return (x.size // cols if cols else 0), cols


def _param_args(x, *params):
    """Pointers for the weight / bias and the flag telling the kernel they are fp32 (else x's dtype)."""
    present = [p for p in params if p is not None]
    if all(p.dtype == x.dtype for p in present):
        return [P.contiguous(p) if p is not None else KL.null() for p in params], 0
    return [P.contiguous(p.astype(np.float32, copy=False)) if p is not None else KL.null() for p in params], 1


# ----------------------------------------------------------------------------- references: layer / rms
def _row_mean(xp, a):
    """a's mean over its last axis, keepdims (a new array): on NumPy np.add.reduce / n -- ndarray.mean's own
    operations, without its Python wrapper (~6 us a call on tiny rows)."""
    if xp is np:
        m = np.add.reduce(a, axis=-1, keepdims=True)
        m /= a.shape[-1]
        return m
    return a.mean(axis=-1, keepdims=True)


def _layer_ref(x, weight, bias, eps, rms):
    """(y, mean, rstd) of layer / RMS norm on NumPy or CuPy arrays (the CPU's per-op path and the kernels' oracle):
    one working copy updated in place."""
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    xf = x.astype(cd)   # the working copy
    mean = None
    if not rms:
        mean = _row_mean(xp, xf)
        xf -= mean
    var = _row_mean(xp, xf * xf)
    var += cd(eps)
    xp.sqrt(var, out=var)
    rstd = xp.divide(1.0, var, out=var)
    xf *= rstd
    if weight is not None:
        xf *= weight.astype(cd, copy=False)
    if bias is not None:
        xf += bias.astype(cd, copy=False)
    return xf.astype(x.dtype, copy=False), (None if rms else mean[..., 0]), rstd[..., 0]


def _layer_grad_ref(dy, x, weight, mean, rstd, bias, rms):
    """(dx, dweight, dbias) of layer / RMS norm: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w (no mean(g)
    term for RMS), in a few new arrays updated in place (the CPU's per-op path and the kernels' oracle)."""
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    g0 = dy.astype(cd, copy=False)
    rs = rstd.astype(cd, copy=False)[..., None]
    xh = x.astype(cd) if rms else xp.subtract(x.astype(cd, copy=False), mean.astype(cd, copy=False)[..., None])
    xh *= rs
    g = g0 * weight.astype(cd, copy=False) if weight is not None else g0
    p = g * xh
    dot = _row_mean(xp, p)
    xp.multiply(xh, dot, out=p)                      # xhat * dot
    if not rms:
        dx = g - _row_mean(xp, g)
    else:
        dx = g.copy() if g is g0 else g   # (g0 may be dy itself: not written)
    dx -= p
    dx *= rs
    red = tuple(range(x.ndim - 1))
    dw = None
    if weight is not None:
        xp.multiply(g0, xh, out=p)
        dw = p.sum(axis=red).astype(weight.dtype, copy=False)
    db = g0.sum(axis=red).astype(bias.dtype, copy=False) if bias is not None else None
    return dx.astype(x.dtype, copy=False), dw, db


# ----------------------------------------------------------------------------- kernels: layer / rms
NORM_MAX_RPB = 8  # row groups of > 32 threads per block: NORM_MAX_RPB in cuda_src/norms.cu
# Weight / bias gradients (layer / rms / group norm) summed inside the backward kernel ("last block done", see
# last_arrival in cuda_src/common.cuh): one launch. False (the default): the kernels write partial rows only and a
# column_sum launch sums each. Off: the last block's sum of the partial rows runs on one SM, which made the norm
# backwards slower on the H100 (rms_norm bwd 4608x3072: 0.0933 vs 0.0455 ms). Modulate keeps it (a win there).
single_launch_sums = False
# Cluster size of the weight-gradient backward on sm_90+ (norm_bwd_cl in cuda_src/norms.cu); 0: every block writes its
# own part row (norm_bwd*). bwd_cluster_grid: blocks per SM of its grid (None: as many as fit; benchmark sweeps).
bwd_cluster = 2
bwd_cluster_grid = None
bwd_cluster_smem = 1   # partials added into shared memory as the rows go (1) or kept in registers (0)
bwd_cluster_regs = 80  # register cap of norm_bwd_cl (255: none)
# The weight-gradient backward on sm_90+ with the rows streamed through shared memory by bulk copies (norm_bwd_tma in
# cuda_src/norms.cu): bwd_tma_stages rows of x and dy in flight per block, the partials in registers, clusters of
# bwd_tma_cluster blocks adding theirs (one part row per cluster), and the column_sum after it as a programmatic
# dependent launch. Rows of > 32 threads on the 16-byte vector path; others keep _bwd_plan.
bwd_tma = True
bwd_tma_stages = 3
# Register cap of norm_bwd_tma (255: none). 128 with the kept-row loop below: 2 blocks of 192 threads per SM, no
# spills (LayerNorm's dw, db loop takes 121 registers; capped at 112 it spilled: 0.0397 against 0.0347 ms).
bwd_tma_regs = 128
BWD_TMA_MIN_REGS = 80  # rows of more threads than the SM's registers allow at bwd_tma_regs get a lower cap, >= this
bwd_tma_vpt = None    # 16-byte vectors per thread (1 or 2); None: the fewest that keep a row within 256 threads
bwd_tma_grid = None   # blocks per SM (None: as many as fit)
bwd_tma_cluster = 1   # blocks per cluster (1: every block writes its own part row)
# The grid: as many blocks as fit (False), or the fewest that keep the same most rows per block (True: 4608 rows on
# 396 block slots take 384 blocks of 12 rows, not 252 of 12 and 144 of 11; 384 part rows, not 396). Off: it was
# not faster on the H100.
bwd_tma_even = False
bwd_tma_dependent = True  # the column_sum as a programmatic dependent launch (launching.launch_dependent)
# Stages filled when a block starts (0: all); the others once its first row has arrived, so that the first rows of
# all blocks are not queued behind everyone's later rows (with every stage requested at entry, the first row landed
# 3-5 us after a block started).
bwd_tma_early = 1
bwd_tma_one_barrier = True  # the per-row block reduction with one barrier (block_sum2_1b) instead of two
# The row loop (cuda_src/norms.cu, norm_bwd_tma's LOOP): 0, the weight read through L1 in both passes of every row;
# 1, the weight in registers; 2, as 1 and the row's xhat and g kept in registers between the passes (pass 2 reads no
# shared memory; the stage is refilled a row earlier). The blocks spend their time in the row loop's passes and
# reductions, not waiting for rows, so these cut the time per row. A plan whose register cap cannot hold what the
# loop keeps takes the largest loop that fits (_tma_loop).
bwd_tma_loop = 2
_props = {}  # device -> _device_props() (the plans read them on every call)


def _device_props():
    """(registers, threads, shared memory) per SM, shared memory a block may opt into, compute capability."""
    dev = backend.cupy.cuda.runtime.getDevice()
    p = _props.get(dev)
    if p is None:
        d = P.device_properties()
        p = _props[dev] = (d["regsPerMultiprocessor"], d["maxThreadsPerMultiProcessor"],
                           d["sharedMemPerMultiprocessor"], d["sharedMemPerBlockOptin"], P.compute_capability())
    return p


def _threads_per_sm(kernel):
    """Threads of `kernel` an SM holds by its registers (allocated per warp in units of 256) and thread limit."""
    regs, threads = _device_props()[:2]
    per_warp = P.cdiv(max(1, kernel.num_regs) * 32, 256) * 256
    return min(regs // per_warp * 32, threads)


def _blocks_per_sm(kernel, block, smem=0):
    sm_smem = _device_props()[2]
    by_smem = sm_smem // (kernel.shared_size_bytes + smem + 1024)  # 1 KiB per block is reserved
    return max(1, min(_threads_per_sm(kernel) // block, 32, by_smem))


def _row_kernel(name, dtype, cols, vec, force_loop=False):
    """(kernel, vpt, tpr, looping) of the row family `<name>1/2/4` (the heuristic of plans.row_plan): looping means
    rows wider than tpr * vpt vectors (one row group of tpr threads per block, the row re-read from cache)."""
    nvec = max(1, cols // vec)
    if force_loop:
        order = [1]
    elif P.vpt_override is not None:
        order = [P.vpt_override]
    else:
        first = next((v for v in P.VPTS if P.cdiv(nvec, v) <= 256), P.VPTS[-1])
        order = [v for v in P.VPTS if v >= first]
    for vpt in order:
        kernel = L.get_function("norms", f"{name}{vpt}", dtype)
        limit = kernel.max_threads_per_block // 32 * 32
        tpr = P.row_tpr(nvec, vpt)
        if tpr <= limit and not force_loop:
            return kernel, vpt, tpr, False
    return kernel, vpt, min(limit, 1024), True


def _persistent_grid(kernel, block, rpb, rows, smem=0):
    """Blocks loop over row blocks: as many as fit on the GPU at once (or one per row block)."""
    return (max(1, min(P.cdiv(rows, rpb), P.sm_count() * _blocks_per_sm(kernel, block, smem))),)


FWD_VPTS = (1, 2, 3, 4, 6, 8, 12, 16)  # the one-pass forward kernels norm_fwdv<VPT> in cuda_src/norms.cu
fwd_override = None  # (vpt, tpr) forcing the one-pass forward's plan (benchmark sweeps); None: _fwd_plan's choice


def _group_tpr(need):
    """Threads for `need` per-thread slots of a row: a power of two up to 32, else a multiple of 32."""
    if need <= 32:
        return 1 << max(0, need - 1).bit_length()
    return P.cdiv(need, 32) * 32


def _fwd_shape(nvec):
    """(vpt, tpr) of the one-pass forward for rows of nvec 16-byte vectors. Rows of <= 64 vectors: 2 vectors per
    thread. Wider rows: 4, 6 or 3 vectors per thread, whichever leaves the fewest idle slots (tpr * vpt - nvec; ties
    in that order), with tpr <= 1024; rows too wide for that (> 6144 vectors) 8, 12 or 16. (On the H100 ~4 vectors
    per thread beat 12 on Flux's 3072-wide rows: LayerNorm affine 0.0240 against 0.0317 ms.)"""
    if nvec <= 64:
        tpr = _group_tpr(P.cdiv(nvec, 2))
        return (1 if nvec == 1 else 2), tpr
    for cands in ((4, 6, 3), (8, 12, 16)):
        best = None
        for v in cands:
            tpr = _group_tpr(P.cdiv(nvec, v))
            if tpr <= 1024 and (best is None or tpr * v - nvec < best[1] * best[0] - nvec):
                best = (v, tpr)
        if best is not None:
            return best
    return 16, 1024  # wider than 16 * 1024 vectors: _fwd_plan declines


def _fwd_plan(dtype, rows, cols):
    """(kernel, grid, block, tpr) of the one-pass forward (norm_fwdv<VPT>: the 16-byte vector path, every load of a
    row issued at once, not persistent), or None where it does not apply (cols not a multiple of the vector width,
    rows wider than 16 * 1024 vectors, too many registers): the persistent norm_fwd1/2/4 take those.

    The shape (_fwd_shape): short rows 2 vectors per thread, wider ones ~4 (3 - 6) vectors per thread and as many
    threads as that takes: groups of tpr <= 32 threads (a power of two, several rows per warp, shuffle reductions
    only) or one row per block of tpr = a multiple of 32 threads."""
    vec = P.vec_width(dtype)
    if cols % vec:
        return None
    nvec = cols // vec
    vpt, tpr = fwd_override if fwd_override is not None else _fwd_shape(nvec)
    if tpr * vpt < nvec or tpr > 1024 or (tpr > 32 and tpr % 32) or (tpr <= 32 and tpr & (tpr - 1)):
        return None
    kernel = L.get_function("norms", f"norm_fwdv{vpt}", dtype)
    if tpr > kernel.max_threads_per_block // 32 * 32:
        return None
    block = 128 if tpr <= 32 else tpr
    return kernel, (max(1, P.cdiv(rows, block // tpr)),), (block,), tpr


_FWD = KL.LaunchCache()   # (shape, dtype, params present, eps, rms, stats, plan override) -> (launch, lead)
_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)


def _packed_ptrs(xs, params):
    """The addresses a packed forward launch takes: of the arrays `xs` (C-contiguous, 16-byte aligned cupy arrays of
    xs[0]'s dtype), then of the gain / bias `params` (0 where None, else C-contiguous, 16-byte aligned cupy arrays of
    that dtype); None where one is not so (the general path casts, copies or aligns it)."""
    dt = xs[0].dtype
    out = []
    for a in xs + params:
        if a is None:
            out.append(0)
        elif type(a) is not _nd or a.dtype != dt or not a._c_contiguous:
            return None
        else:
            out.append(a.data.ptr)
    acc = 0
    for p in out:
        acc |= p
    return None if acc & 15 else out


def _layer_fwd_cached(x, weight, bias, eps, rms, stats):
    """The eager per-op path of the forward: x, weight, bias as _packed_ptrs takes them (weight / bias may be None), a
    one-pass plan for the width. Its launch is packed once per configuration; a call allocates
    the outputs, writes six addresses and launches. None otherwise (the general path runs)."""
    ptrs = _packed_ptrs((x,), (weight, bias))
    if ptrs is None:
        return None
    px, pw, pb = ptrs
    dt, shape = x.dtype, x.shape
    key = (shape, dt, pw == 0, pb == 0, eps, rms, stats, fwd_override)
    entry = _FWD.get(key)
    if entry is None:
        rows, cols = _rows_cols(x)
        plan = _fwd_plan(dt, rows, cols)
        if plan is None:
            return None
        kernel, grid, block, tpr = plan
        pl = KL.PackedLaunch(kernel, grid, block, (None,) * 6 + (KL.i64(rows), KL.i32(cols), KL.f32(eps), KL.i32(tpr),
                                                              KL.i32(rms), KL.i32(0)), 6)
        entry = _FWD.put(key, (pl, shape[:-1]))
    pl, lead = entry
    nd = _nd
    y = nd(shape, dt)
    mean = nd(lead, np.float32) if stats and not rms else None
    rstd = nd(lead, np.float32) if stats else None
    pl((px, pw, pb, y.data.ptr, 0 if mean is None else mean.data.ptr, 0 if rstd is None else rstd.data.ptr))
    return y, mean, rstd


def _layer_fwd_kernel(x, weight, bias, eps, rms, stats=True):
    """-> (y, mean, rstd); stats=False (no backward to come): neither statistic is written or kept (None)."""
    out = _layer_fwd_cached(x, weight, bias, eps, rms, stats)
    if out is not None:
        return out
    xp = backend.xp_of(x)
    x = P.contiguous(x)
    rows, cols = _rows_cols(x)
    (w, b), wf32 = _param_args(x, weight, bias)
    y = xp.empty_like(x)
    mean = None if rms or not stats else xp.empty(x.shape[:-1], dtype=np.float32)
    rstd = xp.empty(x.shape[:-1], dtype=np.float32) if stats else None
    vec = P.vec_width(x.dtype)
    plan = _fwd_plan(x.dtype, rows, cols) if x.data.ptr % 16 == 0 and y.data.ptr % 16 == 0 else None
    if plan is not None:
        kernel, grid, block, tpr = plan
    else:  # any width / alignment, very wide rows: the persistent kernels
        kernel, _, tpr, _ = _row_kernel("norm_fwd", x.dtype, cols, vec if cols % vec == 0 else 1)
        block = (tpr if tpr > 32 else 128,)
        grid = _persistent_grid(kernel, block[0], block[0] // tpr, rows)
    KL.launch(kernel, grid, block,
              (x, w, b, y, KL.null() if mean is None else mean, KL.null() if rstd is None else rstd, KL.i64(rows),
               KL.i32(cols), KL.f32(eps), KL.i32(tpr), KL.i32(rms), KL.i32(wf32)))
    return y, mean, rstd


def _bwd_plan(dtype, rows, cols, acc, aligned=True, fused=False):
    """(kernel, grid, block, tpr, dynamic smem bytes, part rows) of the backward. With weight-gradient partials
    (acc = 1: dw, 2: dw and db) a block of rpb row groups writes one partial row: rpb as large as the SM's registers
    allow (fewer partial rows to write and sum). On the 16-byte vector path with VPT <= 2 (cols % vec == 0, 16-byte
    aligned pointers: `aligned`) each thread keeps its columns' partials in registers; otherwise the block adds them
    in shared memory (acc * rpb * cols floats). On sm_90+ the register-partial case runs norm_bwd_cl instead
    (bwd_cluster blocks per cluster add their rows through distributed shared memory: one part row per cluster), unless
    the launch also sums the parts (`fused`)."""
    name = ("norm_bwdx", "norm_bwdw", "norm_bwd")[acc]
    vec = P.vec_width(dtype)
    vec = vec if cols % vec == 0 and aligned else 1
    kernel, vpt, tpr, looping = _row_kernel(name, dtype, cols, vec)
    reg_acc = acc and not looping and vec > 1 and vpt <= 2
    if reg_acc and bwd_cluster and not fused and _device_props()[4] >= 90:
        plan = _bwd_cluster_plan(dtype, rows, cols, acc, vpt, tpr)
        if plan is not None:
            return plan
    cap = min(160 * 1024, _device_props()[3] - kernel.shared_size_bytes - 1024)
    if acc and not looping and not reg_acc and acc * cols * 4 > cap:  # the row's partials do not fit: looping path
        kernel, vpt, tpr, looping = _row_kernel(name, dtype, cols, vec, force_loop=True)
        assert max(1, cols // vec) > tpr * vpt
    if looping:  # one row group per block: the partials go straight to the block's part row
        block = tpr
    elif tpr <= 32:
        block = 128
    elif acc:
        fit = min(_threads_per_sm(kernel), kernel.max_threads_per_block // 32 * 32, 1024)
        rpb = max(1, min(NORM_MAX_RPB, fit // tpr))
        while rpb > 1 and not reg_acc and acc * rpb * cols * 4 > cap:
            rpb -= 1
        block = tpr * rpb
    else:
        block = tpr
    rpb = block // tpr
    smem = acc * rpb * cols * 4 if acc and not looping and not reg_acc else 0
    grid = _persistent_grid(kernel, block, rpb, rows, smem)
    return kernel, grid, (block,), tpr, smem, grid[0]


def _bwd_cluster_plan(dtype, rows, cols, acc, vpt, tpr):
    """norm_bwd_cl's plan: one row group of tpr threads per block (groups of <= 32 threads: blocks of 128), as many
    blocks as fit on the GPU at once (bwd_cluster_grid per SM where set), a multiple of the cluster size."""
    cl, sm = bwd_cluster, bwd_cluster_smem
    try:
        kernel = L.get_function("norms", f"norm_bwd_cl<{{T}}, {vpt}, {acc}, {cl}, {sm}, {bwd_cluster_regs}>", dtype)
    except KernelCompileError:  # e.g. an NVRTC before CUDA 12.4 (no __maxnreg__): the per-block part rows
        return None
    block = 128 if tpr <= 32 else tpr
    if block > kernel.max_threads_per_block:
        return None
    rpb = block // tpr
    smem = acc * cols * 4 * (rpb if sm else 1)
    if smem + kernel.shared_size_bytes > _device_props()[3]:
        return None
    per_sm = bwd_cluster_grid or _blocks_per_sm(kernel, block, smem)
    grid = min(P.sm_count() * per_sm, P.cdiv(rows, rpb))
    grid = max(cl, grid // cl * cl)
    return kernel, (grid,), (block,), tpr, smem, grid // cl


_occ = {}  # (kernel, block, smem) -> blocks per SM (the occupancy calculator's answer, asked once)
NORM_TMA_MAX_STAGES = 8  # NORM_TMA_MAX_STAGES in cuda_src/norms.cu (one mbarrier each)


def _occupancy(kernel, block, smem):
    key = (kernel, block, smem)
    n = _occ.get(key)
    if n is None:
        KL.allow_dynamic_smem(kernel, smem)  # the calculator counts 0 blocks for more dynamic smem than the limit
        n = _occ[key] = KL.max_active_blocks(kernel, block, smem)
    return n


def _tma_loop(vec, vpt, acc, regs):
    """norm_bwd_tma's row loop: bwd_tma_loop, or the largest below it whose per-thread arrays (vpt vectors of `vec`
    fp32 values each: the acc partials, plus the weight for loop >= 1, plus xhat and g for loop 2) fit the register
    cap with ~40 registers to spare (ptxas, bf16 rows of 2 vectors per thread: loop 2 with dw and db uses 121, with
    dw 105; loop 1 with dw and db 96, no spills)."""
    loop = bwd_tma_loop
    while loop > 0 and vec * vpt * (acc + (loop >= 1) + 2 * (loop == 2)) + 40 > regs:
        loop -= 1
    return loop


def _bwd_tma_plan(dtype, rows, cols, acc, aligned):
    """(kernel, grid, block, stages, smem, cluster) of norm_bwd_tma (norm_bwd_tma_cl where bwd_tma_cluster > 1), or
    None where it does not apply: sm_90+, weight gradients (acc 1 or 2), the 16-byte vector path (cols % vec == 0,
    16-byte aligned rows), one row per block of a multiple of 32 threads (> 32) at vpt <= 2 vectors each, and >= 2
    stages of x and dy rows in shared memory. The grid: the blocks that fit at once (or one per row), whole
    clusters."""
    if not (bwd_tma and acc and aligned) or _device_props()[4] < 90:
        return None
    vec = P.vec_width(dtype)
    if cols % vec:
        return None
    nvec = cols // vec
    vpt = bwd_tma_vpt or (1 if nvec <= 256 else 2)
    tpr = P.row_tpr(nvec, vpt)
    if tpr <= 32 or tpr > 1024:
        return None
    regs = min(bwd_tma_regs, _device_props()[0] // tpr // 8 * 8)  # one block's registers fit the SM
    if regs < min(bwd_tma_regs, BWD_TMA_MIN_REGS):
        return None
    loop = _tma_loop(vec, vpt, acc, regs)
    try:
        cl = bwd_tma_cluster
        name = (f"norm_bwd_tma_cl<{{T}}, {vpt}, {acc}, {cl}, {regs}, {loop}>" if cl > 1 else
                f"norm_bwd_tma<{{T}}, {vpt}, {acc}, {regs}, {loop}>")
        kernel = L.get_function("norms", name, dtype)
    except KernelCompileError:  # e.g. an NVRTC before CUDA 12.4 (no __maxnreg__)
        return None
    if tpr > kernel.max_threads_per_block:
        return None
    row = 2 * cols * np.dtype(dtype).itemsize
    cap = _device_props()[3] - kernel.shared_size_bytes
    stages = min(bwd_tma_stages, NORM_TMA_MAX_STAGES, cap // row)
    if stages < 2:
        return None
    smem = stages * row
    per_sm = bwd_tma_grid or _occupancy(kernel, tpr, smem)
    if per_sm < 1:
        return None
    grid = max(cl, min(rows, P.sm_count() * per_sm) // cl * cl)
    if bwd_tma_even:  # the same most rows per block by the fewest blocks: fewer part rows, no shorter blocks idle
        grid = min(grid, P.cdiv(P.cdiv(rows, P.cdiv(rows, grid)), cl) * cl)
    return kernel, (grid,), (tpr,), stages, smem, cl


def bwd_tma_opts(stages):
    """norm_bwd_tma's `opts` argument from the knobs: the stages filled at entry (bits 0-3; 0: all), the one-barrier
    block reduction (bit 4)."""
    early = bwd_tma_early if 0 < bwd_tma_early < stages else 0
    return early | (16 if bwd_tma_one_barrier else 0)


def _layer_bwd_tma(plan, dy, x, w, wf32, mean_arg, rstd, weight, bias, rows, cols, rms):
    """dx, dw, db by norm_bwd_tma (see _bwd_tma_plan)."""
    kernel, grid, block, stages, smem, cl = plan
    xp = backend.xp_of(x)
    dx = xp.empty_like(x)
    parts = xp.empty((1 if bias is None else 2, grid[0] // cl, cols), dtype=np.float32)  # [dw rows | db rows]
    dw_part = parts[0] if weight is not None else None
    db_part = parts[1] if bias is not None else None
    KL.launch(kernel, grid, block,
              (dy, x, w, mean_arg, rstd, dx, KL.null() if dw_part is None else dw_part,
              KL.null() if db_part is None else db_part, KL.i64(rows), KL.i32(cols), KL.i32(rms), KL.i32(wf32),
              KL.i32(stages), KL.i32(bwd_tma_opts(stages))), shared_mem=smem)
    dep = bwd_tma_dependent
    if dw_part is not None and db_part is not None and weight.dtype == bias.dtype:
        sums = CS.column_sum("norms", "column_sum", parts, weight.dtype, dep)  # one launch for both
        return dx, sums[0], sums[1]
    dw = CS.column_sum("norms", "column_sum", dw_part, weight.dtype, dep) if weight is not None else None
    db = CS.column_sum("norms", "column_sum", db_part, bias.dtype, dep and dw is None) if bias is not None else None
    return dx, dw, db


def _layer_bwd_kernel(dy, x, weight, mean, rstd, bias, rms, weight_grad=True, residual=None):
    xp = backend.xp_of(x)
    x = P.contiguous(x)
    dy = P.contiguous(dy.astype(x.dtype, copy=False))
    rows, cols = _rows_cols(x)
    (w,), wf32 = _param_args(x, weight)
    # ACC: 0 dx alone (a frozen weight still scales dy), 1 dx and dw, 2 dx, dw and db (db alone rides on 2)
    acc = 2 if bias is not None else (1 if weight is not None and weight_grad else 0)
    mean_arg = KL.null() if rms else P.contiguous(mean.astype(np.float32, copy=False))
    rstd = P.contiguous(rstd.astype(np.float32, copy=False))
    aligned = x.data.ptr % 16 == 0 and dy.data.ptr % 16 == 0  # the memory pool's dx is 256-byte aligned
    tma = (_bwd_tma_plan(x.dtype, rows, cols, acc, aligned) if acc and not single_launch_sums and residual is None
           else None)
    if tma is not None:
        return _layer_bwd_tma(tma, dy, x, w, wf32, mean_arg, rstd, weight, bias, rows, cols, rms)
    dx = xp.empty_like(x)
    aligned = aligned and dx.data.ptr % 16 == 0 and (residual is None or residual.data.ptr % 16 == 0)
    fused = acc and single_launch_sums
    kernel, grid, block, tpr, smem, parts = _bwd_plan(x.dtype, rows, cols, acc, aligned, fused)
    dw_part = xp.empty((parts, cols), dtype=np.float32) if weight is not None and acc else None
    db_part = xp.empty((parts, cols), dtype=np.float32) if bias is not None else None
    dw = db = None
    if fused:  # the kernel also sums the part rows (parts_finish): outputs in x's dtype, else fp32 (then cast)
        odt = x.dtype if all(p is None or p.dtype == x.dtype for p in (weight, bias)) else np.dtype(np.float32)
        dw = xp.empty((cols,), dtype=odt) if dw_part is not None else None
        db = xp.empty((cols,), dtype=odt) if bias is not None else None
        group, counters = _finish_plan(parts)
        fin = (KL.null() if dw is None else dw, KL.null() if db is None else db, counters, KL.i32(group),
               KL.i32(odt != x.dtype))
    else:
        fin = (KL.null(), KL.null(), KL.null(), KL.i32(1), KL.i32(0))
    KL.launch(kernel, grid, block,
              (dy, x, w, mean_arg, rstd, dx, KL.null() if residual is None else residual,
              KL.null() if dw_part is None else dw_part, KL.null() if db_part is None else db_part,
              KL.i64(rows), KL.i32(cols), KL.i32(tpr), KL.i32(rms), KL.i32(wf32)) + fin, shared_mem=smem)
    if fused:
        dw = dw.astype(weight.dtype, copy=False) if dw is not None and weight_grad else None
        db = db.astype(bias.dtype, copy=False) if db is not None else None
        return dx, dw, db
    dw = CS.column_sum("norms", "column_sum", dw_part, weight.dtype) if dw_part is not None and weight_grad else None
    db = CS.column_sum("norms", "column_sum", db_part, bias.dtype) if bias is not None else None
    return dx, dw, db


def _finish_plan(parts):
    """(group, counters) of parts_finish in cuda_src/norms.cu: up to 16 part rows are summed by the last block alone;
    more go through two levels of ~sqrt(parts) rows each (cdiv(parts, group) + 1 counters)."""
    if parts <= 16:
        return parts, CS.reduction_counters(1)
    group = math.isqrt(parts - 1) + 1
    return group, CS.reduction_counters(P.cdiv(parts, group) + 1)


# ----------------------------------------------------------------------------- API: layer / rms
def layer_norm_forward(x, weight=None, bias=None, eps=1e-5, stats=True):
    """-> (y, mean, rstd); stats=False (no backward to come): (y, None, None), the statistics not kept."""
    _check_affine("layer_norm", weight, x.shape[-1], "weight")
    _check_affine("layer_norm", bias, x.shape[-1], "bias")
    if L.use_kernel(x) and x.size:
        return _layer_fwd_kernel(x, weight, bias, eps, 0, stats)
    out = _layer_ref(x, weight, bias, eps, False)
    return out if stats else (out[0], None, None)


def layer_norm_backward(dy, x, weight, mean, rstd, bias=None, weight_grad=True, residual=None):
    """weight_grad=False: the weight (a frozen one, or adaLN's 1 + scale of a frozen modulation) only scales dy; its
    gradient is neither accumulated nor returned (dw None): the dx-only kernel. residual: another gradient of x (a
    C-contiguous array of x's shape and dtype, e.g. a residual connection's), added to dx in the same pass (one
    rounding, no separate add)."""
    residual = _check_residual(residual, x)
    if L.use_kernel(x) and x.size:
        return _layer_bwd_kernel(dy, x, weight, mean, rstd, bias, 0, weight_grad, residual)
    dx, dw, db = _layer_grad_ref(dy, x, weight, mean, rstd, bias, False)
    return _plus(dx, residual), dw if weight_grad else None, db


def rms_norm_forward(x, weight=None, eps=1e-6, stats=True):
    """-> (y, rstd); stats=False: (y, None)."""
    _check_affine("rms_norm", weight, x.shape[-1], "weight")
    if L.use_kernel(x) and x.size:
        y, _, rstd = _layer_fwd_kernel(x, weight, None, eps, 1, stats)
    else:
        y, _, rstd = _layer_ref(x, weight, None, eps, True)
    return y, rstd if stats else None


def rms_norm_backward(dy, x, weight, rstd, weight_grad=True, residual=None):
    residual = _check_residual(residual, x)
    if L.use_kernel(x) and x.size:
        dx, dw, _ = _layer_bwd_kernel(dy, x, weight, None, rstd, None, 1, weight_grad, residual)
    else:
        dx, dw, _ = _layer_grad_ref(dy, x, weight, None, rstd, None, True)
        dx = _plus(dx, residual)
    return dx, dw if weight_grad else None


def _check_residual(residual, x):
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.flags.c_contiguous):
        raise ValueError(f"norm backward: residual gradient {residual.shape} {residual.dtype} must be a C-contiguous "
                         f"array of x's shape {x.shape} and dtype {x.dtype}")
    return residual


def _plus(dx, residual):
    """The reference path's dx + residual, summed in float32 (or wider) and rounded once, as the kernels do."""
    if residual is None:
        return dx
    wide = np.promote_types(dx.dtype, np.float32)
    return (dx.astype(wide) + residual.astype(wide)).astype(dx.dtype, copy=False)
