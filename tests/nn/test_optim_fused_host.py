"""The one-launch optimizer steps' host side on the CPU: Lion, AdamWScheduleFree and Prodigy take their fused path
with the kernels replaced by a NumPy emulation that follows cuda_src/optim_multi.cu operation by operation (float32,
each operation rounded on its own), and must match the per-operation path -- the state they make, the scalars they
pass, Prodigy's estimate of d and the step counters. The kernels themselves run against the same oracle on the GPU
(tests/kernels/test_optim_multi.py)."""
import types

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_nn.optim import multi_tensor as MT

F = np.float32
SIZES = [1, 255, 4096, 4097, 9000]


class _Table:
    def __init__(self, rows):
        self.rows = rows


def _flat(a):
    return a.reshape(-1)


def _lion(table, *, lr, beta1, beta2, decay):
    for p, g, m in table.rows:
        w, g, m = _flat(p), _flat(g).astype(F), _flat(m)
        if decay != 1:
            w *= F(decay)
        c = m * F(beta1) + g * F(1 - beta1)
        w -= F(lr) * np.sign(c)
        m[...] = m * F(beta2) + F(1 - beta2) * g


def _sfadamw(table, *, beta2, bc2, eps, decay, ckp1, y_coef, lr):
    for p, g, z, v in table.rows:
        y, g, z, v = _flat(p), _flat(g).astype(F), _flat(z), _flat(v)
        v[...] = v * F(beta2) + F(1 - beta2) * (g * g)
        u = g / (np.sqrt(v / F(bc2)) + F(eps))
        if decay:
            u = u + F(decay) * y
        y += F(ckp1) * (z - y)
        y += F(y_coef) * u
        z -= F(lr) * u


def _prodigy_stats(table, *, beta1, m_coef, beta2, v_coef, beta3, s_coef):
    dot = abs_s = 0.0
    for p, g, p0, m, v, s in table.rows:
        w, g = _flat(p), _flat(g).astype(F)
        base = np.zeros_like(w) if p0 is None else _flat(p0)
        dot += float(np.sum(g * (base - w), dtype=np.float64))
        m[...] = _flat(m) * F(beta1) + F(m_coef) * g
        v[...] = _flat(v) * F(beta2) + F(v_coef) * (g * g)
        s[...] = _flat(s) * F(beta3) + F(s_coef) * g
        abs_s += float(np.sum(np.abs(s), dtype=np.float64))
    return dot, abs_s


def _prodigy_update(table, *, dlr, d_eps, decay):
    for p, g, p0, m, v, s in table.rows:
        w = _flat(p)
        denom = np.sqrt(_flat(v)) + F(d_eps)
        if decay != 1:
            w *= F(decay)
        w -= (F(dlr) * _flat(m)) / denom


class _AfTable(_Table):
    def __init__(self, rows, salts=None):
        self.rows, self.salts = rows, salts or [0] * len(rows)

    def rms(self, t):
        return self.rms_values[t]


def _adafactor_step(table, *, eps1, beta2t, eps2, rel, scale_parameter, clip_threshold, beta1, weight_decay, seed=0):
    """optim_multi.cu's four launches, tensor by tensor: 2-D parameters factored, the rest unfactored; bfloat16 ones
    computed in float32 and stochastically rounded."""
    from flame_core.kernels.stochastic_rounding import to_bf16_stochastic
    table.rms_values = []
    one_minus = F(1 - beta2t)
    for (p, g, m, v, col), salt in zip(table.rows, table.salts):
        g = g.astype(F)
        w = p.astype(F)
        u = g * g + F(eps1)
        rms = np.sqrt(np.sum(w * w) / F(w.size))
        table.rms_values.append(np.asarray(float(rms), F))
        if col is not None:   # factored: a matrix, or a batch of them (the sums launch's thread per matrix)
            R, C = p.shape[-2:]
            u3, g3, v3, c3 = u.reshape(-1, R, C), g.reshape(-1, R, C), v.reshape(-1, R), col.reshape(-1, C)
            v3[...] = v3 * F(beta2t) + one_minus * (u3.sum(axis=2) / F(C))
            c3[...] = c3 * F(beta2t) + one_minus * (u3.sum(axis=1) / F(R))
            mean = v3.sum(axis=1, keepdims=True) / F(R)
            uu = ((F(1) / np.sqrt(v3 * (F(1) / mean)))[:, :, None] * (F(1) / np.sqrt(c3))[:, None, :]
                  * g3).reshape(p.shape)
        else:
            v[...] = v * F(beta2t) + one_minus * u
            uu = (F(1) / np.sqrt(v)) * g
        lr_t = F((max(eps2, float(rms)) if scale_parameter else 1.0) * rel)
        uu = uu / max(np.sqrt(np.sum(uu * uu) / F(w.size)) / F(clip_threshold), F(1)) * lr_t
        if beta1 is not None:
            m[...] = m * F(beta1) + F(1 - beta1) * uu
            uu = m
        new = (w * (F(1) - F(weight_decay) * lr_t) if weight_decay else w) - uu
        p[...] = to_bf16_stochastic(new, seed, salt) if p.dtype.name == "bfloat16" else new


@pytest.fixture
def emulated(monkeypatch):
    """MT's kernels replaced by the emulation, and NumPy arrays taken as the GPU's."""
    from flame_core.kernels.optim_multi import adafactor_kind
    fake = types.SimpleNamespace(adafactor_kind=adafactor_kind, optim_table=_Table, lion_step=_lion,
                                 sfadamw_step=_sfadamw, prodigy_stats=_prodigy_stats, prodigy_update=_prodigy_update,
                                 adafactor_table=_AfTable, adafactor_step=_adafactor_step, calls=[])
    for name in ("lion_step", "sfadamw_step", "prodigy_stats", "prodigy_update", "adafactor_step"):
        f = getattr(fake, name)
        setattr(fake, name, lambda *a, _f=f, _n=name, **k: (fake.calls.append(_n), _f(*a, **k))[1])
    monkeypatch.setattr(MT, "kernels", fake)
    monkeypatch.setattr(MT, "enabled", lambda: True)
    monkeypatch.setattr(MT, "fusable", lambda a, g, param_dtypes=("float32",): a.dtype.name in param_dtypes
                        and g.size == a.size)
    monkeypatch.setattr(MT, "usable", lambda s, n: s is not None and s.dtype == np.float32 and s.size == n)

    class Tables:
        def get(self, rows, make=None):
            return (make or _Table)(rows)
    monkeypatch.setattr(MT, "Tables", Tables)
    return fake


def _run(make, steps, seed=3):
    rng = np.random.default_rng(seed)
    params = []
    for i, n in enumerate(SIZES):
        a = np.zeros(n, np.float32) if i % 3 == 1 else rng.standard_normal(n).astype(np.float32)
        params.append(nn.Parameter(flame.tensor(a.reshape(1, -1) if n % 2 else a)))
    opt = make(params)
    if hasattr(opt, "train"):
        opt.train()
    for _ in range(steps):
        for p in params:
            p.grad = flame.tensor((rng.standard_normal(p.shape) * rng.choice([1e-3, 1.0])).astype(np.float32))
        opt.step()
    states = [{k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in opt.state[p].items()} for p in params]
    return [p.detach().numpy() for p in params], states, [{k: v for k, v in g.items() if k != "params"}
                                                          for g in opt.param_groups]


CASES = {
    "lion": lambda ps: nn.optim.Lion(ps, lr=1e-3, weight_decay=0.1),
    "lion_decoupled": lambda ps: nn.optim.Lion(ps, lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True),
    "schedulefree": lambda ps: nn.optim.AdamWScheduleFree(ps, lr=1e-2, warmup_steps=2, weight_decay=0.01),
    "schedulefree_r": lambda ps: nn.optim.AdamWScheduleFree(ps, lr=1e-2, r=0.5),
    "prodigy": lambda ps: nn.optim.Prodigy(ps, lr=1.0),
    "prodigy_decay": lambda ps: nn.optim.Prodigy(ps, lr=1.0, weight_decay=0.01),
    "prodigy_safeguard": lambda ps: nn.optim.Prodigy(ps, lr=1.0, safeguard_warmup=True, use_bias_correction=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_host_path_matches_the_per_operation_path(emulated, monkeypatch, name):
    fw, fs, fg = _run(CASES[name], steps=4)
    prodigy = name.startswith("prodigy")
    assert emulated.calls == (["prodigy_stats", "prodigy_update"] * 4 if prodigy else
                              [("lion_step" if name.startswith("lion") else "sfadamw_step")] * 4)
    emulated.calls.clear()
    monkeypatch.setattr(MT, "enabled", lambda: False)  # the per-operation path
    rw, rs, rg = _run(CASES[name], steps=4)
    assert not emulated.calls

    def same(x, y, what):
        if prodigy and isinstance(x, (float, np.ndarray)):  # its two sums are added in another order
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-12, err_msg=what)
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=what)
        else:
            assert x == y, what
    for k in fg[0]:
        same(fg[0][k], rg[0][k], k)
    for n, a, b, s, r in zip(SIZES, fw, rw, fs, rs):
        assert set(s) == set(r)
        same(a, b, f"weights of the {n}-element tensor")
        for k in s:
            same(s[k], r[k], f"{k} of the {n}-element tensor")


AF_SHAPES = [(16, 300), (300, 16), (1, 255), (64,), (33, 70), (5, 7, 3, 3), (2, 3, 4), (3, 2, 17)]
AF_CASES = {
    "relative_step": dict(),
    "lr_beta1_decay": dict(lr=1e-3, relative_step=False, scale_parameter=False, beta1=0.9, weight_decay=0.01),
    "warmup_init": dict(warmup_init=True),
}


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(AF_CASES))
def test_adafactor_fused_host_path_matches_the_per_operation_path(emulated, monkeypatch, name, bf16):
    """2-D parameters factored, 1-D unfactored and batches of small matrices (a convolution kernel's (5, 7, 3, 3))
    factored per matrix in the fused path; (3, 2, 17) (a last dimension over 16) per operation. bfloat16
    weights (full_bf16) rounded stochastically with the per-operation path's bits: equal where the float32 values
    before rounding fall on the same side of the random threshold -- all but a rare element, one bf16 step away."""
    def run():
        rng = np.random.default_rng(5)
        params = [nn.Parameter(flame.tensor(rng.standard_normal(s).astype(np.float32),
                                            dtype=flame.bfloat16 if bf16 else None)) for s in AF_SHAPES]
        opt = nn.optim.Adafactor(params, **AF_CASES[name])
        for _ in range(4):
            for p in params:
                p.grad = flame.tensor(rng.standard_normal(p.shape).astype(np.float32))
            opt.step()
        return [p.detach().float().numpy() for p in params], [opt.state[p] for p in params]
    fw, fs = run()
    assert emulated.calls == ["adafactor_step"] * 4  # one launch group a step
    monkeypatch.setattr(MT, "enabled", lambda: False)
    rw, rs = run()
    for shape, a, b, s, r in zip(AF_SHAPES, fw, rw, fs, rs):
        if bf16:
            assert np.mean(a != b) < 0.01, f"weights {shape}"
            np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=1e-30, err_msg=f"weights {shape}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7, err_msg=f"weights {shape}")
        assert set(s) == set(r) and s["step"] == r["step"] == 4
        # the fused path keeps rms(w) as a 0-d tensor (the kernel's scratch), the per-operation path as a float
        assert isinstance(s["RMS"], float) == (shape == (3, 2, 17)), shape
        np.testing.assert_allclose(float(s["RMS"]), r["RMS"], rtol=1e-5)
        for k in set(s) - {"step", "RMS"}:
            np.testing.assert_allclose(s[k].numpy(), r[k].numpy(), rtol=1e-4, atol=1e-9, err_msg=f"{k} {shape}")
