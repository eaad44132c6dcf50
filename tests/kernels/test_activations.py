"""GELU (erf / tanh) and SiLU: reference values, gradients, and the CUDA kernels against the reference."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import DTYPES, assert_close, rand

import flame_core as flame
from flame_core.autograd import gradcheck
from flame_core.kernels import activations as K

POINTS = np.array([-6.0, -3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.5, 8.0])


def _gelu64(x, approximate):
    if approximate == "tanh":
        return np.array([0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x])
    return np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_reference_values(approximate):
    np.testing.assert_allclose(K.gelu_forward(POINTS, approximate), _gelu64(POINTS, approximate), rtol=1e-14,
                               atol=1e-15)
    assert abs(K.gelu_forward(np.array([1.0]), "none")[0] - 0.8413447460685429) < 1e-15


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_grad_matches_central_differences(approximate):
    h = 1e-6
    num = (_gelu64(POINTS + h, approximate) - _gelu64(POINTS - h, approximate)) / (2 * h)
    got = K.gelu_backward(np.ones_like(POINTS), POINTS, approximate)
    np.testing.assert_allclose(got, num, rtol=1e-7, atol=1e-9)


def test_silu_reference_and_grad():
    want = POINTS / (1 + np.exp(-POINTS))
    np.testing.assert_allclose(K.silu_forward(POINTS), want, rtol=1e-14, atol=1e-15)
    h = 1e-6
    num = ((POINTS + h) / (1 + np.exp(-(POINTS + h))) - (POINTS - h) / (1 + np.exp(-(POINTS - h)))) / (2 * h)
    np.testing.assert_allclose(K.silu_backward(np.full_like(POINTS, 2.0), POINTS), 2 * num, rtol=1e-7, atol=1e-9)


def test_quick_gelu_reference_and_grad():
    def f(x):
        return x / (1 + np.exp(-1.702 * x))
    np.testing.assert_allclose(K.quick_gelu_forward(POINTS), f(POINTS), rtol=1e-14, atol=1e-15)
    h = 1e-6
    num = (f(POINTS + h) - f(POINTS - h)) / (2 * h)
    np.testing.assert_allclose(K.quick_gelu_backward(np.full_like(POINTS, 2.0), POINTS), 2 * num, rtol=1e-7,
                               atol=1e-9)
    x = np.linspace(-6, 6, 97).astype(DTYPES["bfloat16"])   # half types: fp32 arithmetic, one rounding
    want = f(x.astype(np.float64)).astype(np.float32).astype(DTYPES["bfloat16"])
    got = K.quick_gelu_forward(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_half_types_compute_in_float32():
    x = np.linspace(-4, 4, 101).astype(DTYPES["bfloat16"])
    want = _gelu64(x.astype(np.float64), "tanh").astype(np.float32).astype(DTYPES["bfloat16"])
    got = K.gelu_forward(x, "tanh")
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_bad_approximate_names_the_value():
    with pytest.raises(ValueError, match="'exact'"):
        K.gelu_forward(np.zeros(3, np.float32), "exact")


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
       approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_gradcheck(shape, approximate):
    x = flame.tensor(np.random.default_rng(0).uniform(-3, 3, shape), dtype=flame.float64, requires_grad=True)
    assert gradcheck(lambda t: flame.gelu(t, approximate=approximate), (x,))


# ----------------------------------------------------------------------------- GPU: kernels vs reference
SIZES = [1, 7, 33, 1000, 4097, 65543, 3 * 12288]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_kernel(ab, rng, dt, n, approximate):
    x, dy = rand(rng, (n,), DTYPES[dt], scale=3.0), rand(rng, (n,), DTYPES[dt])
    k, r = ab(lambda a: K.gelu_forward(a, approximate), x)
    assert k.dtype == x.dtype
    assert_close(k, r, dt, "gelu forward")
    k, r = ab(lambda g, a: K.gelu_backward(g, a, approximate), dy, x)
    assert_close(k, r, dt, "gelu backward")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("n", SIZES)
def test_silu_kernel(ab, rng, dt, n):
    x, dy = rand(rng, (n,), DTYPES[dt], scale=4.0), rand(rng, (n,), DTYPES[dt])
    k, r = ab(K.silu_forward, x)
    assert_close(k, r, dt, "silu forward")
    k, r = ab(K.silu_backward, dy, x)
    assert_close(k, r, dt, "silu backward")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("n", SIZES)
def test_quick_gelu_kernel(ab, rng, dt, n):
    x, dy = rand(rng, (n,), DTYPES[dt], scale=4.0), rand(rng, (n,), DTYPES[dt])
    k, r = ab(K.quick_gelu_forward, x)
    assert_close(k, r, dt, "quick_gelu forward")
    k, r = ab(K.quick_gelu_backward, dy, x)
    assert_close(k, r, dt, "quick_gelu backward")


@pytest.mark.gpu
def test_kernels_take_unaligned_and_strided_inputs(ab, rng):
    import cupy as cp
    base = cp.asarray(rand(rng, (3, 1001), np.float32))
    k, r = ab(lambda: K.gelu_forward(base[1, 1:], "tanh"))        # 4-byte aligned start: scalar path
    assert_close(k, r, "float32", "unaligned")
    k, r = ab(lambda: K.silu_forward(base[:, ::2]))               # strided view: made contiguous
    assert_close(k, r, "float32", "strided")


def _sizes(listed):
    """The sizes that matter (vector and block edges, Flux's, past 2**31) and any size up to 2**33."""
    return st.one_of(st.sampled_from(listed), st.integers(1, 2 ** 33))


@settings(max_examples=300)
@given(n=_sizes([1, 7, 8, 33, 8191, 8192, 8193, 3 * 12288, 4608 * 12288, 2 ** 31 + 5]),
       dt=st.sampled_from(list(DTYPES)), cap=st.sampled_from([None, 1000]),
       plan=st.sampled_from(sorted(set(K._PLANS.values()) | {(2, 128)})))
def test_grid_covers_the_vectors_in_one_step_up_to_the_cap(n, dt, cap, plan):
    from flame_core.kernels import plans
    with pytest.MonkeyPatch.context() as mp:
        if cap is not None:
            mp.setattr(K, "_MAX_BLOCKS", cap)
        u, blk = plan
        (grid,), (block,) = K._grid(n, DTYPES[dt], u, blk)
        nvec = n // plans.vec_width(DTYPES[dt])
        assert block == blk and 1 <= grid <= K._MAX_BLOCKS
        assert grid * block * u >= nvec or grid == K._MAX_BLOCKS   # else the kernels' grid-stride loop goes on
        assert (grid - 1) * block * u < max(nvec, 1)               # no block without a vector


def test_every_kernel_and_form_has_a_plan():
    for name, forms in (("gelu_fwd", (0, 1)), ("gelu_bwd", (0, 1)), ("silu_fwd", (-1,)), ("silu_bwd", (-1,)),
                        ("qgelu_fwd", (-1,)), ("qgelu_bwd", (-1,))):
        for f in forms:
            u, block = K._PLANS[name, f]
            assert u >= 1 and block % 32 == 0 and block <= 1024


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [(1, 128), (2, 256), (4, 512), (8, 64)])
def test_every_plan_gives_the_same_results(rng, monkeypatch, plan):
    """The unroll / block choice changes which thread does what, never the numbers (ragged size: tail included)."""
    import cupy as cp
    x, dy = (cp.asarray(rand(rng, (65543,), DTYPES["bfloat16"], scale=3.0)) for _ in range(2))
    calls = [lambda: K.gelu_forward(x, "none"), lambda: K.gelu_forward(x, "tanh"), lambda: K.silu_forward(x),
             lambda: K.gelu_backward(dy, x, "none"), lambda: K.gelu_backward(dy, x, "tanh"),
             lambda: K.silu_backward(dy, x)]
    want = [f() for f in calls]
    monkeypatch.setattr(K, "plan_override", plan)
    for f, w in zip(calls, want):
        assert cp.array_equal(f().view(cp.uint16), w.view(cp.uint16))


@settings(max_examples=200)
@given(n=_sizes([1, 3, 4, 5, 7, 8, 511, 512, 513, 65543, 4608 * 12288, 2 ** 31 + 5]),
       kernel=st.sampled_from(sorted(K._STEP_PLANS)))
def test_step_split_covers_the_whole_vectors_and_leaves_under_one(n, kernel):
    name, approx = kernel
    got = K._step_split(name, approx, n, 2)
    if n < 4:
        assert got is None                                    # no whole 8-byte vector: the loop kernel does it all
        return
    u, block, main, grid = got
    assert (u, block) == K._STEP_PLANS[name, approx]
    assert main % 4 == 0 and 0 <= n - main < 4                # whole vectors; the < 4 rest goes to the loop kernel
    assert grid * block * u * 4 >= main > (grid - 1) * block * u * 4   # every vector, no block without one


def test_step_split_only_for_two_byte_types_and_default_plans(monkeypatch):
    assert K._step_split("silu_bwd", -1, 4096, 4) is None     # float32: the 16-byte loop kernel
    assert K._step_split("silu_fwd", -1, 4096, 2) is None     # forwards: no step kernel
    monkeypatch.setattr(K, "plan_override", (2, 128))
    assert K._step_split("silu_bwd", -1, 4096, 2) is None     # a forced loop plan (sweeps) turns it off
    monkeypatch.setattr(K, "plan_override", None)
    monkeypatch.setattr(K, "use_step", False)
    assert K._step_split("gelu_bwd", 1, 4096, 2) is None
    monkeypatch.setattr(K, "use_step", True)
    monkeypatch.setattr(K, "_MAX_STEP_GRID", 3)
    u, block = K._STEP_PLANS["gelu_bwd", 1]
    assert K._step_split("gelu_bwd", 1, 4 * block * u * 3, 2)[3] == 3
    assert K._step_split("gelu_bwd", 1, 4 * block * u * 3 + 4, 2) is None   # past the grid limit: the loop kernel


STEP_KERNELS = [("gelu_bwd", 0), ("gelu_bwd", 1), ("silu_bwd", -1), ("qgelu_bwd", -1)]


def test_step_plans_name_only_kernels_with_a_step_form():
    assert set(K._STEP_PLANS) <= set(STEP_KERNELS)            # *_bwd_step exists for these only


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [4, 7, 512, 515, 65543, 3 * 12288 + 2])
@pytest.mark.parametrize("plan", [(1, 128), (2, 128), (1, 256), (4, 128)])
def test_step_kernels_match_the_loop_kernels_bit_for_bit(rng, monkeypatch, dt, n, plan):
    """The one-step 8-byte backwards (plus the loop kernel on the < 4 trailing elements), under each plan, give the
    loop kernels' bits."""
    import cupy as cp

    from flame_core.kernels import launching
    monkeypatch.setattr(K, "_STEP_PLANS", {k: plan for k in STEP_KERNELS})
    x, dy = (cp.asarray(rand(rng, (n,), DTYPES[dt], scale=3.0)) for _ in range(2))
    calls = [lambda: K.gelu_backward(dy, x, "none"), lambda: K.gelu_backward(dy, x, "tanh"),
             lambda: K.silu_backward(dy, x), lambda: K.quick_gelu_backward(dy, x)]
    got = []
    for f in calls:
        before = launching.launches
        got.append(f())
        assert launching.launches - before == (1 if n % 4 == 0 else 2)   # the step kernel ran (and the tail's loop)
    monkeypatch.setattr(K, "use_step", False)
    for f, g in zip(calls, got):
        before = launching.launches
        want = f()
        assert launching.launches - before == 1
        assert cp.array_equal(g.view(cp.uint16), want.view(cp.uint16))


@settings(max_examples=200)
@given(n=_sizes([1, 7, 8, 9, 1023, 1024, 1031, 65543, 4608 * 12288, 2 ** 31 + 5]))
def test_bulk_split_covers_the_whole_vectors_and_leaves_under_one(n):
    got = K._bulk_split("silu_fwd", -1, n, 2, 90)
    if n < 8:
        assert got is None                                    # no whole 16-byte vector: the loop kernel does it all
        return
    chunk, block, main, grid = got
    assert (chunk, block) == K._BULK_PLANS["silu_fwd", -1]
    assert main % 8 == 0 and 0 <= n - main < 8                # whole vectors; the < 8 rest goes to the loop kernel
    assert grid * chunk >= 2 * main > (grid - 1) * chunk      # every byte, no block without one


def test_bulk_split_only_on_sm90_for_two_byte_types_and_default_plans(monkeypatch):
    assert K._bulk_split("silu_fwd", -1, 4096, 2, 90) is not None
    assert K._bulk_split("silu_fwd", -1, 4096, 2, 89) is None     # no bulk-copy engine before sm_90
    assert K._bulk_split("silu_fwd", -1, 4096, 4, 90) is None     # float32: the 16-byte loop kernel
    assert K._bulk_split("silu_bwd", -1, 4096, 2, 90) is None     # no bulk form: the step kernel
    assert K._bulk_split("gelu_fwd", 1, 4096, 2, 90) is None
    monkeypatch.setattr(K, "plan_override", (2, 128))
    assert K._bulk_split("silu_fwd", -1, 4096, 2, 90) is None     # a forced loop plan (sweeps) turns it off
    monkeypatch.setattr(K, "plan_override", None)
    monkeypatch.setattr(K, "use_bulk", False)
    assert K._bulk_split("silu_fwd", -1, 4096, 2, 90) is None
    monkeypatch.setattr(K, "use_bulk", True)
    monkeypatch.setattr(K, "_MAX_STEP_GRID", 3)
    chunk = K._BULK_PLANS["silu_fwd", -1][0]
    assert K._bulk_split("silu_fwd", -1, chunk // 2 * 3, 2, 90)[3] == 3
    assert K._bulk_split("silu_fwd", -1, chunk // 2 * 3 + 8, 2, 90) is None   # past the grid limit: the loop kernel


def test_bulk_plans_name_only_kernels_with_a_bulk_form():
    assert set(K._BULK_PLANS) <= {("silu_fwd", -1)}              # silu_fwd_bulk exists for this one only
    for chunk, block in K._BULK_PLANS.values():
        assert chunk % 16 == 0 and block % 32 == 0 and block <= 1024


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [7, 8, 9, 1023, 1024, 1031, 65543, 3 * 12288 + 5])
@pytest.mark.parametrize("plan", [(2048, 128), (4096, 128), (1024, 32)])
def test_bulk_kernel_matches_the_loop_kernel_bit_for_bit(rng, monkeypatch, dt, n, plan):
    """The SiLU forward through the bulk-copy engine (plus the loop kernel on the < 8 trailing elements), under each
    plan (chunks of one or more vectors per thread, the last one partial), gives the loop kernel's bits; before sm_90
    it does not run."""
    import cupy as cp

    from flame_core.kernels import launching, plans
    monkeypatch.setattr(K, "_BULK_PLANS", {("silu_fwd", -1): plan})
    x = cp.asarray(rand(rng, (n,), DTYPES[dt], scale=3.0))
    bulk = plans.compute_capability() >= 90
    before = launching.launches
    got = K.silu_forward(x)
    assert launching.launches - before == (1 if n < 8 or not bulk or n % 8 == 0 else 2)
    monkeypatch.setattr(K, "use_bulk", False)
    want = K.silu_forward(x)
    assert cp.array_equal(got.view(cp.uint16), want.view(cp.uint16))
    assert_close(got, K._silu_ref(x), dt, "silu bulk")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(DTYPES))
def test_packed_programs_match_the_general_launches(rng, monkeypatch, dt):
    """On cuda `_run` packs each (kernel, size, dtype)'s launches once (`_program`: a bulk / step kernel and the loop
    kernel over the tail at its byte offset); its outputs are the per-call launches' bit for bit, and a repeated call
    reuses the program."""
    import cupy as cp
    K._RUNS.clear()
    cases = [(n, name, approx) for n in (1, 1001, 4097, 65543)
             for name, approx in (("gelu_fwd", 0), ("gelu_fwd", 1), ("silu_fwd", -1), ("qgelu_fwd", -1))]
    arrays = {n: cp.asarray(rand(rng, (n,), DTYPES[dt], scale=4.0)) for n, _, _ in cases}

    def run_all():
        outs = []
        for n, name, approx in cases:
            y = cp.empty_like(arrays[n])
            K._run(name, (arrays[n],), y, approx)
            outs.append(cp.asnumpy(y))
        return outs
    packed, again = run_all(), run_all()
    assert len(K._RUNS) == len(cases)
    monkeypatch.setattr(K, "_nd", None)   # `type(out) is _nd` fails: the per-call launches
    general = run_all()
    for p, a, g, case in zip(packed, again, general, cases):
        view = np.uint32 if p.itemsize == 4 else np.uint16
        np.testing.assert_array_equal(p.view(view), g.view(view), err_msg=str(case))
        np.testing.assert_array_equal(a.view(view), g.view(view), err_msg=str(case))


def _sig64(z):
    """sigmoid in float64 without cancellation in either tail (the truth the float32 paths are held to)."""
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1 / (1 + e), e / (1 + e))


def test_cpu_sigmoid_forms_hold_float32_to_the_float64_truth_in_both_tails():
    """The NumPy paths of GELU(tanh), SiLU and QuickGELU in float32 (e^-z formed once, no tanh cancellation, e^-z
    overflowing for z << 0) against float64 sigmoid forms, from -120 (where e^-z overflows float32) to 40. The error
    is the float32 rounding of the exponent 2u (up to ~88 before e^-2u overflows: ~1e-5 relative, as the previous
    three-pass form had); results below 1e-35 in magnitude may be 0 (PyTorch's are 0 there: its 1 + tanh u is). Near
    a gradient's zero (1 + (1 - s) 2a u' cancels) the error is a few float32 roundings of the gradient's scale, g."""
    x = np.concatenate([np.linspace(-120, 40, 20011), np.linspace(-9, 9, 4001)]).astype(np.float32)
    g = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    a = x.astype(np.float64)
    c = math.sqrt(2 / math.pi)
    s2u = _sig64(2 * c * (a + 0.044715 * a ** 3))
    sa, sk = _sig64(a), _sig64(1.702 * a)
    want = {
        "gelu tanh": (K.gelu_forward(x, "tanh"), a * s2u),
        "gelu tanh grad": (K.gelu_backward(g, x, "tanh"),
                           g * (s2u + 2 * a * s2u * (1 - s2u) * c * (1 + 3 * 0.044715 * a * a))),
        "silu grad": (K.silu_backward(g, x), g * sa * (1 + a * (1 - sa))),
        "quick gelu": (K.quick_gelu_forward(x), a * sk),
        "quick gelu grad": (K.quick_gelu_backward(g, x), g * sk * (1 + 1.702 * a * (1 - sk))),
    }
    for name, (got, truth) in want.items():
        assert got.dtype == np.float32, name
        err = np.abs(got.astype(np.float64) - truth)
        bad = err > 3e-5 * np.abs(truth) + 4e-7 * np.abs(g) + 1e-35
        assert not bad.any(), (name, x[bad][:5], got[bad][:5], truth[bad][:5])


def test_cpu_sigmoid_forms_at_infinities_and_nan_follow_pytorch():
    x = np.array([np.nan, np.inf, -np.inf, -200.0, 200.0], np.float32)
    one = np.ones_like(x)
    # PyTorch: gelu(tanh) 0.5 x (1 + tanh u): nan, inf, nan (-inf * 0); its gradients and SiLU's / QuickGELU's: NaN at
    # +-inf (inf * 0); far tails: 0 and x (forward), 0 and 1 (gradient)
    np.testing.assert_array_equal(K.gelu_forward(x, "tanh"), [np.nan, np.inf, np.nan, 0, 200])
    for got in (K.gelu_backward(one, x, "tanh"), K.silu_backward(one, x), K.quick_gelu_backward(one, x)):
        np.testing.assert_array_equal(got, [np.nan, np.nan, np.nan, 0, 1])
    np.testing.assert_array_equal(K.quick_gelu_forward(x), [np.nan, np.inf, np.nan, 0, 200])


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_cpu_forms_take_0d_and_strided_arrays(dt):
    """The NumPy paths (in place, out= arrays) on a 0-d array and on a strided view: the values of the same elements
    in a plain 1-D array, in the input's dtype and shape."""
    dtype = DTYPES[dt]
    base = np.linspace(-5, 5, 24).astype(dtype).reshape(4, 6)
    g = np.linspace(1, 2, 24).astype(dtype).reshape(4, 6)
    fwd = [lambda v: K.gelu_forward(v, "none"), lambda v: K.gelu_forward(v, "tanh"), K.silu_forward,
           K.quick_gelu_forward]
    bwd = [lambda d, v: K.gelu_backward(d, v, "none"), lambda d, v: K.gelu_backward(d, v, "tanh"), K.silu_backward,
           K.quick_gelu_backward]
    for f in fwd:
        flat = f(base.reshape(-1))
        got0 = f(base[1, 2].reshape(()))
        assert got0.shape == () and got0.dtype == dtype and got0 == flat[8]
        strided = f(base.T[::2])
        np.testing.assert_array_equal(strided, flat.reshape(4, 6).T[::2])
    for f in bwd:
        flat = f(g.reshape(-1), base.reshape(-1))
        got0 = f(g[1, 2].reshape(()), base[1, 2].reshape(()))
        assert got0.shape == () and got0.dtype == dtype and got0 == flat[8]
        np.testing.assert_array_equal(f(g.T[::2], base.T[::2]), flat.reshape(4, 6).T[::2])
