"""GELU (erf / tanh), SiLU and QuickGELU (x sigmoid(1.702 x), OpenAI CLIP's) on arrays: raw kernels on CuPy
(cuda_src/activations.cu), reference on `xp` otherwise.

Every function takes and returns arrays of x's dtype; float16 / bfloat16 compute in float32, float64 in float64.
"""
import math

import numpy as np

from .. import backend
from . import erfc_fit
from . import launching as KL
from . import loader as L
from . import plans as P

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_np_erf = np.frompyfunc(math.erf, 1, 1)


def _erf(xp, a):
    if xp is np:
        return np.asarray(_np_erf(a.astype(np.float64)), dtype=np.float64).astype(a.dtype)
    from cupyx.scipy.special import erf
    return erf(a)


def _cdf(xp, a):
    """The normal CDF 0.5 (1 + erf(a / sqrt(2))) in a's dtype, a new array: on NumPy below float64 erfc_fit's float32
    form (a fitted erfc, a few float32 roundings in both tails); float64 and CuPy arrays the exact erf."""
    if xp is np and a.dtype != np.float64:
        return erfc_fit.normal_cdf32(a.astype(np.float32, copy=False)).astype(a.dtype, copy=False)
    return 0.5 * (1 + _erf(xp, a * _INV_SQRT2))


def _approx_flag(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return 1 if approximate == "tanh" else 0


# ----------------------------------------------------------------------------- references (the oracle)
def _sigmoid_pair(xp, z):
    """(sigmoid(z), 1 - sigmoid(z)) without cancellation in either tail (1 + tanh(u) loses all digits for u << 0)."""
    if xp is np:
        return _sigmoid_pair_np(np.negative(z, out=np.empty_like(z)))   # (out=: a 0-d z stays an array)
    e = xp.exp(-xp.abs(z))
    p, q = 1 / (1 + e), e / (1 + e)
    pos = z >= 0
    return xp.where(pos, p, q), xp.where(pos, q, p)


def _sigmoid_pair_np(nz):
    """(s, 1 - s), s = sigmoid(z), from nz = -z (a float32 / float64 NumPy array this call may overwrite), in six
    passes: E = e^-z, s = 1 / (1 + E), 1 - s = E s -- both without cancellation in either tail. Where E overflows
    (z below about -88 in float32) s is 0 and 1 - s, inf * 0 there, is set to 1 (fmin; also where z is NaN, whose s is
    NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(nz, out=nz)
        s = np.add(e, 1, out=np.empty_like(e))
        np.reciprocal(s, out=s)
        e *= s
    np.fmin(e, 1, out=e)
    return s, e


def _a_sigmoid_np(a, z):
    """a / (1 + e^z) = a sigmoid(-z) for NumPy arrays, z a new array of a's shape that becomes the result (three
    passes over it): SiLU (z = -a), QuickGELU (z = -1.702 a), GELU(tanh) (z = -2u) -- PyTorch's CPU formula without
    the cancellation of 0.5 a (1 + tanh u) for a << 0. Where e^z overflows the value is -0 (the true one is below
    the smallest denormal)."""
    with np.errstate(over="ignore"):
        np.exp(z, out=z)
    z += 1
    return np.divide(a, z, out=z)


def _neg_2u_np(a, a2):
    """GELU(tanh)'s -2u = -2 sqrt(2/pi) (a + 0.044715 a^3) from a and a2 = a * a, as a new array."""
    t = np.multiply(a2, -2 * _SQRT_2_OVER_PI * 0.044715, out=np.empty_like(a))   # (out=: 0-d stays an array)
    t -= 2 * _SQRT_2_OVER_PI
    t *= a
    return t


def _gelu_tanh_grad_np(g, a):
    """dy * GELU(tanh)'(a) for float32 / float64 NumPy arrays of one shape, a new array: with s = sigmoid(2u),
    d/da [a s] = s + 2 a s (1 - s) u' = s (1 + (1 - s) 2 a u'), u' = sqrt(2/pi) (1 + 3 0.044715 a^2)."""
    a2 = np.multiply(a, a, out=np.empty_like(a))
    s, q = _sigmoid_pair_np(_neg_2u_np(a, a2))
    a2 *= 6 * _SQRT_2_OVER_PI * 0.044715
    a2 += 2 * _SQRT_2_OVER_PI
    a2 *= a                     # 2 a u'
    with np.errstate(invalid="ignore"):   # inf * 0 at a = +-inf: NaN, as PyTorch's
        q *= a2
        q += 1
        q *= s
    q *= g
    return q


def _gelu_ref(x, approximate):
    xp = backend.xp_of(x)
    a = x.astype(L.compute_dtype(x.dtype))
    if approximate == "tanh":  # 0.5 a (1 + tanh(u)) = a sigmoid(2u)
        if xp is np:
            return _a_sigmoid_np(a, _neg_2u_np(a, a * a)).astype(x.dtype, copy=False)
        y = a * _sigmoid_pair(xp, 2 * _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))[0]
    else:
        if xp is np and a.dtype != np.float64:
            y = _cdf(xp, a)
            y *= a
        else:
            y = 0.5 * a * (1 + _erf(xp, a * _INV_SQRT2))
    return y.astype(x.dtype)


def _gelu_grad_ref(dy, x, approximate):
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    a, g = x.astype(cd, copy=False), dy.astype(cd, copy=False)
    if approximate == "tanh":  # d/da [a s(2u)] = s + 2 a s (1 - s) u'
        if xp is np:
            return _gelu_tanh_grad_np(g, a).astype(x.dtype, copy=False)
        s, q = _sigmoid_pair(xp, 2 * _SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))
        d = s + 2 * a * s * q * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * a * a)
    else:
        if xp is np and a.dtype != np.float64:   # Phi + a pdf(a), in place
            d = _cdf(xp, a)
            w = np.multiply(a, a, out=np.empty_like(d))
            w *= -0.5
            np.exp(w, out=w)
            w *= a
            w *= _INV_SQRT_2PI
            d += w
            d *= g
            return d.astype(x.dtype, copy=False)
        d = _cdf(xp, a) + a * _INV_SQRT_2PI * xp.exp(-0.5 * a * a)
    return (g * d).astype(x.dtype)


def _sigmoid_ref(xp, z):
    """sigmoid(z) without cancellation in either tail: exp(min(z, 0)) / (1 + exp(-|z|)) (= 1 / (1 + e^-z) for z >= 0,
    e^z / (1 + e^z) below), the forward's one value in fewer passes than _sigmoid_pair."""
    d = xp.exp(-xp.abs(z))
    d += 1
    return xp.exp(xp.minimum(z, 0)) / d


def _silu_ref(x):
    xp = backend.xp_of(x)
    a = x.astype(L.compute_dtype(x.dtype), copy=False)
    if xp is np:  # PyTorch's CPU formula x / (1 + e^-x) in four passes
        y = _a_sigmoid_np(a, np.negative(a, out=np.empty_like(a)))   # (an out= array: 0-d stays an array)
    else:
        y = _sigmoid_ref(xp, a)
        y *= a
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def _silu_grad_ref(dy, x):
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    a, g = x.astype(cd, copy=False), dy.astype(cd, copy=False)
    if xp is np:
        return _xsig_grad_np(g, a, 1.0).astype(x.dtype, copy=False)
    s, q = _sigmoid_pair(xp, a)
    return (g * s * (1 + a * q)).astype(x.dtype)


def _xsig_grad_np(g, a, k):
    """g * d/da [a sigmoid(k a)] = g s (1 + k a (1 - s)) for float32 / float64 NumPy arrays of one shape (SiLU: k = 1,
    QuickGELU: 1.702), a new array."""
    s, q = _sigmoid_pair_np(np.multiply(a, -k, out=np.empty_like(a)))
    q *= a
    if k != 1.0:
        q *= k
    with np.errstate(invalid="ignore"):   # inf * 0 at a = +-inf: NaN, as PyTorch's
        q += 1
        q *= s
    q *= g
    return q


QGELU_K = 1.702  # QuickGELU's sigmoid scale (cuda_src/activations.cuh QGELU_K)


def _qgelu_ref(x):
    xp = backend.xp_of(x)
    a = x.astype(L.compute_dtype(x.dtype), copy=False)
    if xp is np:  # a / (1 + e^(-k a)), as _silu_ref's: four passes
        return _a_sigmoid_np(a, np.multiply(a, -QGELU_K, out=np.empty_like(a))).astype(x.dtype, copy=False)
    return (a * _sigmoid_pair(xp, QGELU_K * a)[0]).astype(x.dtype)


def _qgelu_grad_ref(dy, x):
    xp = backend.xp_of(x)
    cd = L.compute_dtype(x.dtype)
    a, g = x.astype(cd, copy=False), dy.astype(cd, copy=False)
    if xp is np:
        return _xsig_grad_np(g, a, QGELU_K).astype(x.dtype, copy=False)
    s, q = _sigmoid_pair(xp, QGELU_K * a)
    return (g * s * (1 + QGELU_K * a * q)).astype(x.dtype)


# ----------------------------------------------------------------------------- kernels
# (16-byte vectors per thread and loop step U, block size) per kernel and form (approx 1 = tanh, 0 = erf; -1 none),
# the fastest of a sweep on the H100 (4608 x 12288 bf16); U is the kernels' template argument. GELU(erf)'s forward
# takes 4 vectors per thread: its polynomial wants more loads in flight (one vector: 0.090 ms against 0.080).
# QuickGELU takes SiLU's plans (the same arithmetic per element; not swept on its own).
_PLANS = {("gelu_fwd", 1): (1, 256), ("gelu_fwd", 0): (4, 128), ("gelu_bwd", 1): (2, 128), ("gelu_bwd", 0): (2, 128),
          ("silu_fwd", -1): (1, 256), ("silu_bwd", -1): (1, 256), ("qgelu_fwd", -1): (1, 256),
          ("qgelu_bwd", -1): (1, 256)}
plan_override = None  # (U, block) for every loop kernel (benchmark sweeps); None: _PLANS
_MAX_BLOCKS = 1 << 30  # past this the kernels' grid-stride loop takes the rest

# The backwards for float16 / bfloat16 as one loop step per thread with 8-byte vectors (*_bwd_step kernels,
# (U, block)). At the copy ceiling the 16-byte loop kernels stayed 0.2-0.3% behind torch's (one 16-byte vector per
# thread); the step kernels are 0.1-0.3% ahead of it (gelu(erf) 2%). One-step forwards only tied the loop kernels
# (measured at commit 58de458), so there are none.
_STEP_PLANS = {("gelu_bwd", 1): (2, 128), ("gelu_bwd", 0): (1, 128), ("silu_bwd", -1): (1, 128),
               ("qgelu_bwd", -1): (1, 128)}
use_step = True  # False: the loop kernels for every dtype (A/B checks and sweeps)
_MAX_STEP_GRID = (1 << 31) - 1  # CUDA's grid x limit; larger arrays take the loop kernels


# The SiLU forward for float16 / bfloat16 on sm_90+ through the bulk-copy engine (silu_fwd_bulk: one chunk per block
# into shared memory on an mbarrier, mapped there, written back by a bulk store; (chunk bytes, block)). One 16-byte
# vector per thread, about 32 KiB of loads in flight per SM, as the fastest bulk copies: 0.3-0.5% ahead of torch
# where the loop kernel tied it; with 2 or 4 vectors per thread, or fewer blocks per SM, it fell behind.
_BULK_PLANS = {("silu_fwd", -1): (2048, 128)}
use_bulk = True  # False: no bulk kernel (A/B checks and sweeps)


def _plan(name, approx):
    return plan_override or _PLANS[name, approx]


def _grid(n, dtype, unroll, block):
    """One loop step per thread: the grid covers the data (as PyTorch's elementwise kernels do)."""
    blocks = P.cdiv(n // P.vec_width(dtype), block * unroll)
    return (max(1, min(blocks, _MAX_BLOCKS)),), (block,)


def _step_split(name, approx, n, itemsize):
    """(U, block, whole-vector elements, grid) of the one-step kernel for n elements of this item size, or None where
    the loop kernel does it all. The n - whole-vector elements (< 4) past the last 8-byte vector go to the loop
    kernel."""
    plan = _STEP_PLANS.get((name, approx)) if use_step and plan_override is None and itemsize == 2 else None
    if plan is None:
        return None
    u, block = plan
    per = 8 // itemsize
    main = n - n % per
    grid = P.cdiv(main // per, block * u)
    return (u, block, main, grid) if 0 < grid <= _MAX_STEP_GRID else None


def _bulk_split(name, approx, n, itemsize, cc):
    """(chunk bytes, block, whole-vector elements, grid) of the bulk kernel for n elements of this item size on a device
    of compute capability cc, or None where it does not run. The elements (< 8) past the last 16-byte vector go to the
    loop kernel."""
    plan = (_BULK_PLANS.get((name, approx)) if use_bulk and plan_override is None and itemsize == 2 and cc >= 90
            else None)
    if plan is None:
        return None
    chunk, block = plan
    main = n - n % (16 // itemsize)
    grid = P.cdiv(main * itemsize, chunk)
    return (chunk, block, main, grid) if 0 < grid <= _MAX_STEP_GRID else None


def _fast(name, approx, n, itemsize):
    """(kernel expression, grid, block, whole-vector elements) of the bulk or one-step kernel for n elements, or None
    where the loop kernel does it all."""
    bulk = (_bulk_split(name, approx, n, itemsize, P.compute_capability()) if (name, approx) in _BULK_PLANS
            else None)
    if bulk is not None:
        chunk, block, main, grid = bulk
        return f"{name}_bulk<{{T}}, {chunk}>", grid, block, main
    step = _step_split(name, approx, n, itemsize)
    if step is not None:
        u, block, main, grid = step
        return f"{name}_step<{{T}}, {u}>", grid, block, main
    return None


_RUNS = KL.LaunchCache()   # per (kernel, form, size, dtype, plan switches): the _program
_nd = backend._cupy_ndarray   # cupy.ndarray, or () without CuPy (no array's type)


def _program(name, approx, n, dtype, n_in):
    """_run's launches for n elements as [(PackedLaunch, byte offset of its first element)]: the arrays' addresses
    are its dynamic arguments (the inputs', then the output's)."""
    extra = () if approx < 0 else (KL.i32(approx),)
    itemsize = np.dtype(dtype).itemsize
    dyn = (None,) * (n_in + 1)
    prog, off = [], 0
    fast = _fast(name, approx, n, itemsize)
    if fast is not None:
        expr, grid, block, main = fast
        prog.append((KL.PackedLaunch(L.get_function("activations", expr, dtype), (grid,), (block,),
                                     dyn + (KL.i64(main),) + extra, n_in + 1), 0))
        if main == n:
            return prog
        off, n = main * itemsize, n - main
    u, block = _plan(name, approx)
    grid, block = _grid(n, dtype, u, block)
    prog.append((KL.PackedLaunch(L.get_function("activations", f"{name}<{{T}}, {u}>", dtype), grid, block,
                                 dyn + (KL.i64(n),) + extra, n_in + 1), off))
    return prog


def _run(name, ins, out, approx):
    """Kernel `name` over the arrays `ins` into `out` (contiguous, 16-byte aligned, one shape): the bulk or one-step
    kernel over the whole vectors where it has a plan, the loop kernel over the rest (or over everything). On cuda
    the launches of each (kernel, size, dtype) are packed once (_program)."""
    if type(out) is _nd:
        key = (name, approx, out.size, out.dtype, plan_override, use_step, use_bulk)
        prog = _RUNS.get(key)
        if prog is None:
            prog = _RUNS.put(key, _program(name, approx, out.size, out.dtype, len(ins)))
        ptrs = tuple(a.data.ptr for a in ins) + (out.data.ptr,)
        for pl, off in prog:
            pl(ptrs if not off else tuple(p + off for p in ptrs))
        return
    extra = () if approx < 0 else (KL.i32(approx),)
    fast = _fast(name, approx, out.size, out.itemsize)
    if fast is not None:
        expr, grid, block, main = fast
        KL.launch(L.get_function("activations", expr, out.dtype), (grid,), (block,), ins + (out, KL.i64(main)) + extra)
        if main == out.size:
            return
        ins, out = tuple(a.reshape(-1)[main:] for a in ins), out.reshape(-1)[main:]
    u, block = _plan(name, approx)
    grid, block = _grid(out.size, out.dtype, u, block)
    KL.launch(L.get_function("activations", f"{name}<{{T}}, {u}>", out.dtype), grid, block,
              ins + (out, KL.i64(out.size)) + extra)


def _unary(name, x, approx=-1):
    x = P.contiguous(x)
    y = _nd(x.shape, x.dtype) if type(x) is _nd else backend.xp_of(x).empty_like(x)
    _run(name, (x,), y, approx)
    return y


def _binary(name, dy, x, approx=-1):
    if dy.shape != x.shape:
        raise ValueError(f"{name}: gradient shape {dy.shape} differs from input shape {x.shape}")
    x, dy = P.contiguous(x), P.contiguous(dy.astype(x.dtype, copy=False))
    dx = _nd(x.shape, x.dtype) if type(x) is _nd else backend.xp_of(x).empty_like(x)
    _run(name, (dy, x), dx, approx)
    return dx


# ----------------------------------------------------------------------------- API
def gelu_forward(x, approximate="none"):
    flag = _approx_flag(approximate)
    if L.use_kernel(x) and x.size:
        return _unary("gelu_fwd", x, flag)
    return _gelu_ref(x, approximate)


def gelu_backward(dy, x, approximate="none", out=None):
    """dy * gelu'(x). out: None, or dy itself (contiguous, x's shape and dtype) to write the result over dy: the
    kernels read each element before the same thread writes it."""
    flag = _approx_flag(approximate)
    if out is not None and (out is not dy or dy.dtype != x.dtype or dy.shape != x.shape
                            or not dy.flags.c_contiguous):
        raise ValueError("gelu_backward: out must be dy itself, contiguous, of x's shape and dtype "
                         f"(got {out.dtype} {out.shape} for dy {dy.dtype} {dy.shape}, x {x.dtype} {x.shape})")
    if L.use_kernel(x) and x.size:
        if out is None or dy.data.ptr % 16:  # the kernels' vectors need a 16-byte aligned output
            return _binary("gelu_bwd", dy, x, flag)
        _run("gelu_bwd", (dy, P.contiguous(x)), out, flag)
        return out
    dx = _gelu_grad_ref(dy, x, approximate)
    if out is None:
        return dx
    out[...] = dx
    return out


def silu_forward(x):
    if L.use_kernel(x) and x.size:
        return _unary("silu_fwd", x)
    return _silu_ref(x)


def silu_backward(dy, x):
    if L.use_kernel(x) and x.size:
        return _binary("silu_bwd", dy, x)
    return _silu_grad_ref(dy, x)


def quick_gelu_forward(x):
    """x * sigmoid(1.702 x) (transformers' QuickGELUActivation), in fp32 for half types, one rounding."""
    if L.use_kernel(x) and x.size:
        return _unary("qgelu_fwd", x)
    return _qgelu_ref(x)


def quick_gelu_backward(dy, x):
    if L.use_kernel(x) and x.size:
        return _binary("qgelu_bwd", dy, x)
    return _qgelu_grad_ref(dy, x)
