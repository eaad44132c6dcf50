"""The small-array pointwise entry points in C (flame_core/csrc/pointwise.c) against their Python versions
(kernels.pointwise_small.py_fast_*) on the CPU: a stand-in environment with CuPy's array attributes, the kernel
loader's cached state and a launch cache whose launches record what they were given, so both implementations run
every check and reach the launch, and must decide and launch alike. The GPU side (real kernels, both
implementations) is tests/kernels/test_pointwise_small.py."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from flame_core import speedups
from flame_core.kernels import pointwise_small as ps

pytestmark = pytest.mark.skipif(speedups.module is None, reason="flame_core._speedups is not built (no C compiler)")

_ptrs = itertools.count(4096, 256)


class Arr:  # what the fast path reads of a cupy.ndarray
    def __init__(self, shape, dtype=np.float32, contiguous=True, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(shape))
        self._c_contiguous = contiguous
        self.flags = SimpleNamespace(c_contiguous=contiguous)  # the public flags (a CuPy without _c_contiguous)
        self.data = SimpleNamespace(ptr=next(_ptrs), device_id=device)


class Launch:  # a PackedLaunch the C code hands to its Python method (a "dependent" launch): records the call
    _dep, _lead = True, 0

    def __init__(self, key, log):
        self.key, self.log = key, log

    def launch2(self, a, b):
        self.log.append((self.key, (a, b)))

    def launch3(self, a, b, c):
        self.log.append((self.key, (a, b, c)))


class Launches(dict):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __missing__(self, key):
        pl = self[key] = Launch(key, self.log)
        return pl


@pytest.fixture
def env(monkeypatch):
    log = []
    raw = object()
    state = SimpleNamespace(enabled=True, devices=None)
    monkeypatch.setattr(ps, "_nd", Arr)
    monkeypatch.setattr(ps, "_CUPY_FLAG_ATTR", True)
    monkeypatch.setattr(ps, "_kstate", [raw, True, 0])
    monkeypatch.setattr(ps, "_env_get", lambda key: raw)
    monkeypatch.setattr(ps, "backend", SimpleNamespace(_cuda_ok=True))
    monkeypatch.setattr(ps, "loader", SimpleNamespace(enabled=lambda: state.enabled))
    monkeypatch.setattr(ps, "_one_device", True)
    monkeypatch.setattr(ps, "_get_device", lambda: 0)
    monkeypatch.setattr(ps.backend, "cuda_device_count", lambda: 2, raising=False)
    monkeypatch.setattr(ps, "_rc_on", [False])
    monkeypatch.setattr(ps, "_local", SimpleNamespace(launches=Launches(log)))
    monkeypatch.setattr(ps, "_bits", ({}, {}, {}))
    return SimpleNamespace(log=log, state=state, raw=raw)


def both(env, name, *args):
    """(result, launches) of the Python and the C entry point on the same arguments."""
    out = []
    for fn in (getattr(ps, "py_" + name), getattr(speedups.module, name)):
        env.log.clear()
        r = fn(*args)
        out.append((r, list(env.log)))
    return out


def roles(r, log, *inputs):
    """A result and its launches with the addresses named by role (inputs by position, a new output as 'out')."""
    names = {a.data.ptr: f"in{i}" for i, a in enumerate(inputs)}
    if r is not None:
        names.setdefault(r.data.ptr, "out")
        r = (r.shape, r.dtype, names[r.data.ptr])
    return r, [(k, tuple(names.get(v, v) for v in vals)) for k, vals in log]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["mul", "add", "sub", "rsub"])
@pytest.mark.parametrize("s", [1.01, 2, -0.0, 0, 1e-3, 3.0e38, float("inf"), 1 << 25, True])
def test_scalar(env, dtype, op, s):
    x = Arr((4, 5), dtype)
    (rp, lp), (rc, lc) = both(env, "fast_scalar", op, x, s)
    assert (rp is None) == (rc is None)
    assert roles(rp, lp, x) == roles(rc, lc, x)
    if rp is not None:
        assert lp[0][0] == (ps._SCALAR[op], ps._DTYPES.index(np.dtype(dtype)), 20, 0)
    (rp, lp), (rc, lc) = both(env, "fast_scalar", op, x, s, x)  # in place
    assert rp is rc is (x if rp is not None else None) and lp == lc


@pytest.mark.parametrize("op", ["mul", "add", "sub"])
def test_binary_unary_grad(env, op):
    a, b, o = Arr((7,)), Arr((7,)), Arr((7,))
    for args in ((op, a, b), (op, a, b, a), (op, a, b, o), (op, a, b, None)):
        (rp, lp), (rc, lc) = both(env, "fast_binary", *args)
        assert roles(rp, lp, a, b, o) == roles(rc, lc, a, b, o) and rp is not None
    for u in ("neg", "tanh"):
        (rp, lp), (rc, lc) = both(env, "fast_unary", u, a)
        assert roles(rp, lp, a) == roles(rc, lc, a) and lp[0][0][0] == ps._UNARY[u]
    for k in ("tanh_bwd", "relu_bwd", "nope_bwd"):
        for extra in ((), (a,), (o,)):
            (rp, lp), (rc, lc) = both(env, "fast_grad", k, a, b, *extra)
            assert roles(rp, lp, a, b, o) == roles(rc, lc, a, b, o)
            assert (rp is None) == (k == "nope_bwd")


def test_every_reason_to_decline(env, monkeypatch):
    x = Arr((8,))
    cases = [
        ("fast_unary", ("tanh", np.zeros(8, np.float32))),  # not a cupy array
        ("fast_unary", ("tanh", Arr((8,), contiguous=False))),
        ("fast_unary", ("tanh", Arr((ps.MAX_NUMEL + 1,)))),
        ("fast_unary", ("tanh", Arr((8,), np.float64))),  # no kernel dtype
        ("fast_binary", ("add", x, Arr((4, 2)))),  # shapes differ
        ("fast_binary", ("add", x, Arr((8,), np.float16))),  # dtypes differ
        ("fast_binary", ("add", x, Arr((8,), contiguous=False))),
        ("fast_binary", ("add", x, x, Arr((8,), contiguous=False))),  # an out that does not apply
        ("fast_scalar", ("mul", x, np.float32(2.0))),  # not a Python float / int
        ("fast_scalar", ("mul", x, 2.0, Arr((9,)))),
        ("fast_grad", ("tanh_bwd", x, Arr((8,), np.float16))),
    ]
    for name, args in cases:
        (rp, lp), (rc, lc) = both(env, name, *args)
        assert rp is None and rc is None and lp == lc == [], name
    # kernels disabled: the cached state stale (another FLAME_KERNELS value) and loader.enabled() False
    monkeypatch.setattr(ps, "_env_get", lambda key: "0")
    env.state.enabled = False
    (rp, lp), (rc, lc) = both(env, "fast_unary", "tanh", x)
    assert rp is None and rc is None
    env.state.enabled = True  # stale, but the loader says enabled: the fast path runs
    (rp, lp), (rc, lc) = both(env, "fast_unary", "tanh", x)
    assert rp is not None and roles(rp, lp, x) == roles(rc, lc, x)


def test_several_devices_ask_current_device(env, monkeypatch):
    monkeypatch.setattr(ps, "_one_device", None)
    x, y = Arr((8,)), Arr((8,), device=1)
    (rp, lp), (rc, lc) = both(env, "fast_unary", "neg", x)
    assert rp is not None and roles(rp, lp, x) == roles(rc, lc, x) and lp[0][0][3] == 0
    (rp, lp), (rc, lc) = both(env, "fast_binary", "add", x, y)  # y on another device than the current one
    assert rp is None and rc is None


def test_the_bin_supplies_outputs(env, monkeypatch):
    spare = [Arr((3,)) for _ in range(2)]
    monkeypatch.setattr(ps, "_rc_on", [True])
    monkeypatch.setattr(ps, "_rc_take", lambda shape, dtype: spare.pop() if spare else None)
    x = Arr((3,))
    (rp, _), (rc, _) = both(env, "fast_unary", "neg", x)
    assert rp is not rc and not spare  # each took one binned array
    (rp, _), (rc, _) = both(env, "fast_unary", "neg", x)  # the bin is empty: new arrays
    assert type(rp) is Arr and type(rc) is Arr


def test_errors_propagate_alike(env):
    x = Arr((3,))
    for fn in (ps.py_fast_scalar, speedups.module.fast_scalar):
        with pytest.raises(KeyError):
            fn("pow", x, 2.0)
    with pytest.raises(TypeError):
        speedups.module.fast_unary("neg")


def test_the_public_contiguity_flags_where_cupy_has_no_internal_one(env, monkeypatch):
    monkeypatch.setattr(ps, "_CUPY_FLAG_ATTR", False)
    x, bent = Arr((8,)), Arr((8,))
    bent._c_contiguous = True  # only the public flag says it is not contiguous
    bent.flags.c_contiguous = False
    (rp, lp), (rc, lc) = both(env, "fast_unary", "tanh", x)
    assert rp is not None and roles(rp, lp, x) == roles(rc, lc, x)
    (rp, lp), (rc, lc) = both(env, "fast_binary", "add", x, bent)
    assert rp is None and rc is None
