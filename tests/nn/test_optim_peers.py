"""Prodigy, Adafactor, Lion and schedule-free AdamW (issue 47) against NumPy float64 transcriptions of their
reference implementations' update rules (prodigyopt, transformers, lion-pytorch, schedulefree; written here, one
small function each) over several steps; exact resume from state_dict; the references' argument errors; the
cosine_with_restarts and polynomial schedules against transformers' formulas. The step-by-step comparison with the
reference packages themselves is tests/nn/test_optim_references.py (fixtures from make_optimizer_fixtures.py)."""
import math

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_nn.optim import Adafactor, AdamWScheduleFree, Lion, Prodigy
from flame_nn.optim import lr_scheduler as S

RNG = np.random.default_rng(47)
INIT = [RNG.standard_normal((3, 4)), RNG.standard_normal(5)]  # a matrix (factored in Adafactor) and a vector
A = [RNG.standard_normal((3, 4)), RNG.standard_normal(5)]
STEPS = 6


def _params(init=INIT):
    return [nn.Parameter(flame.tensor(np.asarray(a), dtype=flame.float64)) for a in init]


def _c(t):
    """A's scale at step t (0-based): it changes sign so that momenta and signs are exercised."""
    return 1.5 * math.cos(1.7 * t + 0.3)


def _grad(A, ps, t):
    return [_c(t) * a + p * p for a, p in zip(A, ps)]


def _run(opt, params, steps=STEPS):
    traj = []
    for _ in range(steps):
        t = getattr(opt, "_test_t", 0)
        opt._test_t = t + 1
        At = [flame.tensor(_c(t) * a, dtype=flame.float64) for a in A]
        opt.zero_grad()
        sum((a * p + p * p * p / 3).sum() for a, p in zip(At, params)).backward()  # grad = c_t A + p^2
        opt.step()
        traj.append([p.detach().numpy().astype(np.float64) for p in params])
    return traj


def _check(traj, ref, rtol=1e-10, atol=1e-12):
    assert len(traj) == len(ref)
    for t, (got, want) in enumerate(zip(traj, ref)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"step {t + 1}")


# ----------------------------------------------------------------------------- reference transcriptions
def lion_ref(steps, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, decoupled_weight_decay=False):
    ps, ms, out = [p.copy() for p in INIT], [np.zeros_like(p) for p in INIT], []
    wd = weight_decay / lr if decoupled_weight_decay else weight_decay
    for t in range(steps):
        for p, m, g in zip(ps, ms, _grad(A, ps, t)):
            p *= 1 - lr * wd
            p -= lr * np.sign(m * betas[0] + g * (1 - betas[0]))
            m[...] = m * betas[1] + g * (1 - betas[1])
        out.append([p.copy() for p in ps])
    return out


def sf_ref(steps, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
           weight_lr_power=2.0):
    ys, zs, vs, out = [p.copy() for p in INIT], [p.copy() for p in INIT], [np.zeros_like(p) for p in INIT], []
    lr_max, wsum = -1.0, 0.0
    for k in range(steps):
        sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
        lrk = lr * sched
        lr_max = max(lrk, lr_max)
        w = (k + 1) ** r * lr_max ** weight_lr_power
        wsum += w
        c = w / wsum
        for y, z, v, g in zip(ys, zs, vs, _grad(A, ys, k)):
            v[...] = betas[1] * v + (1 - betas[1]) * g * g
            u = g / (np.sqrt(v / (1 - betas[1] ** (k + 1))) + eps) + weight_decay * y
            y[...] = y + c * (z - y) + lrk * (betas[0] * (1 - c) - 1) * u
            z -= lrk * u
        out.append([y.copy() for y in ys])
    return out


def prodigy_ref(steps, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8, weight_decay=0.0, decouple=True,
                use_bias_correction=False, safeguard_warmup=False, d0=1e-6, d_coef=1.0, growth_rate=math.inf):
    b1, b2 = betas
    beta3 = math.sqrt(b2) if beta3 is None else beta3
    ps = [p.copy() for p in INIT]
    p0 = [p.copy() for p in INIT]
    m, v, s = ([np.zeros_like(p) for p in INIT] for _ in range(3))
    d, d_max, num, out = d0, d0, 0.0, []
    for k in range(steps):
        bc = math.sqrt(1 - b2 ** (k + 1)) / (1 - b1 ** (k + 1)) if use_bias_correction else 1.0
        dlr = d * lr * bc
        gs = _grad(A, ps, k)
        if weight_decay and not decouple:
            gs = [g + weight_decay * p for g, p in zip(gs, ps)]
        num *= beta3
        den = 0.0
        for i, g in enumerate(gs):
            num += (d / d0) * dlr * float(np.dot(g.ravel(), (p0[i] - ps[i]).ravel()))
            m[i] = b1 * m[i] + d * (1 - b1) * g
            v[i] = b2 * v[i] + d * d * (1 - b2) * g * g
            s[i] = beta3 * s[i] + (d / d0) * (d if safeguard_warmup else dlr) * g
            den += float(np.abs(s[i]).sum())
        d_hat = d_coef * num / den
        if d == d0:
            d = max(d, d_hat)
        d_max = max(d_max, d_hat)
        d = min(d_max, d * growth_rate)
        for i in range(len(ps)):
            if weight_decay and decouple:
                ps[i] = ps[i] * (1 - weight_decay * dlr)
            ps[i] = ps[i] - dlr * m[i] / (np.sqrt(v[i]) + d * eps)
        out.append([p.copy() for p in ps])
    return out


def adafactor_ref(steps, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                  weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
    def rms(a):
        return np.sqrt(np.mean(a * a))
    ps = [p.copy() for p in INIT]
    row = np.zeros(INIT[0].shape[0])
    col = np.zeros(INIT[0].shape[1])
    vec = np.zeros_like(INIT[1])
    ms = [np.zeros_like(p) for p in INIT]
    out = []
    for t in range(1, steps + 1):
        gs = _grad(A, ps, t - 1)
        b2t = 1 - t ** decay_rate
        for i, (p, g) in enumerate(zip(ps, gs)):
            rel = min(1e-6 * t if warmup_init else 1e-2, 1 / math.sqrt(t)) if relative_step else lr
            lrt = (max(eps[1], rms(p)) if scale_parameter else 1.0) * rel
            sq = g * g + eps[0]
            if i == 0:  # the matrix: factored second moment
                row[...] = b2t * row + (1 - b2t) * sq.mean(axis=1)
                col[...] = b2t * col + (1 - b2t) * sq.mean(axis=0)
                u = g / np.sqrt(np.outer(row / row.mean(), col))
            else:
                vec[...] = b2t * vec + (1 - b2t) * sq
                u = g / np.sqrt(vec)
            u = u / max(1.0, rms(u) / clip_threshold) * lrt
            if beta1 is not None:
                ms[i] = beta1 * ms[i] + (1 - beta1) * u
                u = ms[i]
            ps[i] = p * (1 - weight_decay * lrt) - u
        out.append([p.copy() for p in ps])
    return out


# ----------------------------------------------------------------------------- against the transcriptions
@pytest.mark.parametrize("kw", [{}, {"lr": 3e-2, "betas": (0.8, 0.95), "weight_decay": 0.5},
                                {"lr": 3e-2, "weight_decay": 1e-3, "decoupled_weight_decay": True}])
def test_lion_matches_reference_rule(kw):
    _check(_run(Lion(ps := _params(), **kw), ps),
           lion_ref(STEPS, **kw))


@pytest.mark.parametrize("kw", [{}, {"lr": 0.05, "betas": (0.8, 0.99), "weight_decay": 0.1, "warmup_steps": 3},
                                {"lr": 0.01, "r": 1.0, "weight_lr_power": 1.0}])
def test_schedule_free_adamw_matches_reference_rule(kw):
    opt = AdamWScheduleFree(ps := _params(), **kw)
    opt.train()
    _check(_run(opt, ps), sf_ref(STEPS, **kw))


@pytest.mark.parametrize("kw", [{}, {"lr": 0.5, "betas": (0.8, 0.99), "weight_decay": 0.1, "d0": 1e-3},
                                {"use_bias_correction": True, "safeguard_warmup": True, "growth_rate": 1.5,
                                 "d_coef": 2.0, "beta3": 0.9},
                                {"weight_decay": 0.1, "decouple": False}])
def test_prodigy_matches_reference_rule(kw):
    _check(_run(Prodigy(ps := _params(), **kw), ps), prodigy_ref(STEPS, **kw), rtol=1e-9)


@pytest.mark.parametrize("kw", [{}, {"lr": 1e-2, "relative_step": False, "scale_parameter": False},
                                {"beta1": 0.9, "weight_decay": 0.1, "warmup_init": True, "clip_threshold": 0.5},
                                {"lr": 3e-2, "relative_step": False, "decay_rate": -0.5, "eps": (1e-20, 1e-2)}])
def test_adafactor_matches_reference_rule(kw):
    _check(_run(Adafactor(ps := _params(), **kw), ps), adafactor_ref(STEPS, **kw))


def test_adafactor_factors_matrices_only():
    opt = Adafactor(ps := _params())
    _run(opt, ps, 1)
    assert sorted(opt.state[ps[0]]) == ["RMS", "exp_avg_sq_col", "exp_avg_sq_row", "step"]
    assert tuple(opt.state[ps[0]]["exp_avg_sq_row"].shape) == (3,)
    assert sorted(opt.state[ps[1]]) == ["RMS", "exp_avg_sq", "step"]


def test_prodigy_estimates_d_upward():
    opt = Prodigy(ps := _params())
    _run(opt, ps, 4)
    assert opt.param_groups[0]["d"] > 1e-6  # the distance estimate grew from d0
    assert opt.param_groups[0]["k"] == 4


def test_schedule_free_eval_train_switch_points():
    """eval() moves parameters to x = lerp(y, z, 1 - 1/b1), train() back to y; x is the reference's average."""
    opt = AdamWScheduleFree(ps := _params(), lr=0.05)
    opt.train()
    _run(opt, ps, 3)
    y = [p.detach().numpy().copy() for p in ps]
    z = [opt.state[p]["z"].numpy().copy() for p in ps]
    opt.eval()
    for p, yy, zz in zip(ps, y, z):
        np.testing.assert_allclose(p.detach().numpy(), yy + (1 - 1 / 0.9) * (zz - yy), rtol=1e-12)
    opt.eval()  # idempotent
    opt.train()
    for p, yy in zip(ps, y):
        np.testing.assert_allclose(p.detach().numpy(), yy, rtol=1e-10, atol=1e-12)
    opt.eval()
    with pytest.raises(RuntimeError, match="train mode"):
        opt.step()


# ----------------------------------------------------------------------------- resume
def _resumed(make, before=3, after=3):
    """(continuous trajectory, trajectory of a fresh optimizer loaded from a state_dict taken at `before`)."""
    full_ps = _params()
    full = _run(make(full_ps), full_ps, before + after)[before:]
    ps = _params()
    opt = make(ps)
    _run(opt, ps, before)
    sd = opt.state_dict()
    sd = {"state": {i: {k: (v.clone() if isinstance(v, flame.Tensor) else v) for k, v in s.items()}
                    for i, s in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]]}
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = make(ps2, fresh=False)
    opt2._test_t = before
    opt2.load_state_dict(sd)
    return full, _run(opt2, ps2, after)


def _sf(ps, fresh=True, **kw):
    opt = AdamWScheduleFree(ps, lr=0.05, warmup_steps=2, **kw)
    if fresh:
        opt.train()
    return opt


@pytest.mark.parametrize("make", [
    lambda ps, fresh=True: Lion(ps, lr=1e-2, weight_decay=0.1),
    lambda ps, fresh=True: Prodigy(ps, weight_decay=0.01, use_bias_correction=True),
    lambda ps, fresh=True: Adafactor(ps, beta1=0.9),
    _sf,
], ids=["lion", "prodigy", "adafactor", "schedulefree"])
def test_state_dict_round_trip_resumes_exactly(make):
    full, resumed = _resumed(make)
    for a, b in zip(full, resumed):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- argument errors (the references')
@pytest.mark.parametrize("make, match", [
    (lambda ps: Prodigy(ps, d0=0), "d0"),
    (lambda ps: Prodigy(ps, lr=0), "learning rate"),
    (lambda ps: Prodigy(ps, eps=0), "epsilon"),
    (lambda ps: Prodigy(ps, betas=(1.0, 0.999)), "index 0"),
    (lambda ps: Prodigy(ps, betas=(0.9, -0.1)), "index 1"),
    (lambda ps: Prodigy(ps, fsdp_in_use=True), "fsdp_in_use"),
    (lambda ps: Adafactor(ps, lr=1e-3), "relative_step"),
    (lambda ps: Adafactor(ps, lr=1e-3, relative_step=False, warmup_init=True), "warmup_init"),
    (lambda ps: Adafactor(ps, relative_step=False), "needs an `lr`"),
    (lambda ps: Lion(ps, lr=0), "lr"),
    (lambda ps: Lion(ps, betas=(0.9, 1.5)), "betas"),
    (lambda ps: AdamWScheduleFree(ps, lr=-1), "lr"),
    (lambda ps: AdamWScheduleFree(ps, betas=(0.0, 0.999)), "betas"),
])
def test_argument_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make(_params())


def test_prodigy_rejects_different_group_lrs():
    ps = _params()
    opt = Prodigy([{"params": [ps[0]], "lr": 1.0}, {"params": [ps[1]], "lr": 0.5}])
    with pytest.raises(RuntimeError, match="different lr"):
        _run(opt, ps, 1)


# ----------------------------------------------------------------------------- schedules (transformers' formulas)
def _lrs(make, n, lr=1.0):
    opt = Lion(_params(), lr=lr)
    sch = make(opt)
    out = []
    for _ in range(n):
        out.append(sch.get_last_lr()[0])
        sch.step()
    return out


def test_cosine_with_restarts_schedule():
    got = _lrs(lambda o: S.get_cosine_with_hard_restarts_schedule_with_warmup(o, 2, 12, num_cycles=2), 14)
    want = []
    for s in range(14):
        if s < 2:
            want.append(s / 2)
            continue
        prog = (s - 2) / 10
        want.append(0.0 if prog >= 1 else 0.5 * (1 + math.cos(math.pi * ((2 * prog) % 1.0))))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert got[7] == pytest.approx(1.0)  # the restart: back at the base lr half way


def test_polynomial_schedule():
    got = _lrs(lambda o: S.get_polynomial_decay_schedule_with_warmup(o, 2, 10, lr_end=0.1, power=2.0), 13, lr=0.5)
    want = []
    for s in range(13):
        if s < 2:
            want.append(0.5 * s / 2)
        elif s > 10:
            want.append(0.1)
        else:
            want.append((0.5 - 0.1) * (1 - (s - 2) / 8) ** 2 + 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="lr_end"):
        S.get_polynomial_decay_schedule_with_warmup(Lion(_params(), lr=1e-8), 0, 10)
