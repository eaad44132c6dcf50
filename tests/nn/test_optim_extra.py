"""RMSprop, Adagrad and the schedules of issue 31 against their reference formulas (NumPy float64, written here)
over several steps and against PyTorch's own numbers (tests/fixtures/torch_nn/*.json, made by
tests/fixtures/make_torch_nn_fixtures.py); exact resume from state_dict; clip_grad_value_,
parameters_to_vector / vector_to_parameters, init.orthogonal_ and init.trunc_normal_."""
import json
import math
import os
from bisect import bisect_right

import numpy as np
import pytest
from sched_trace import trace

import flame_core as flame
import flame_nn as nn
from flame_nn.optim import lr_scheduler as S

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn")


def npa(t):
    return t.detach().numpy().astype(np.float64)


def _params(init, device):
    return [nn.Parameter(flame.tensor(np.asarray(a), dtype=flame.float64, device=device)) for a in init]


def _run(opt, params, A, steps, device):
    At = [flame.tensor(np.asarray(a), dtype=flame.float64, device=device) for a in A]
    traj = []
    for _ in range(steps):
        opt.zero_grad()
        sum((a * p + p * p * p / 3).sum() for a, p in zip(At, params)).backward()  # grad = A + p^2
        opt.step()
        traj.append([npa(p) for p in params])
    return traj


def rmsprop_ref(init, A, steps, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
                maximize=False):
    p = [np.array(x, dtype=np.float64) for x in init]
    v = [np.zeros_like(x) for x in p]
    m = [np.zeros_like(x) for x in p]
    b = [np.zeros_like(x) for x in p]
    traj = []
    for _ in range(steps):
        for i in range(len(p)):
            g = np.asarray(A[i]) + p[i] ** 2
            g = -g if maximize else g
            g = g + weight_decay * p[i]
            v[i] = alpha * v[i] + (1 - alpha) * g * g
            if centered:
                m[i] = alpha * m[i] + (1 - alpha) * g
                avg = np.sqrt(v[i] - m[i] ** 2) + eps
            else:
                avg = np.sqrt(v[i]) + eps
            if momentum > 0:
                b[i] = momentum * b[i] + g / avg
                p[i] = p[i] - lr * b[i]
            else:
                p[i] = p[i] - lr * g / avg
        traj.append([x.copy() for x in p])
    return traj


def adagrad_ref(init, A, steps, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                maximize=False):
    p = [np.array(x, dtype=np.float64) for x in init]
    s = [np.full_like(x, initial_accumulator_value) for x in p]
    traj = []
    for t in range(1, steps + 1):
        for i in range(len(p)):
            g = np.asarray(A[i]) + p[i] ** 2
            g = -g if maximize else g
            g = g + weight_decay * p[i]
            s[i] = s[i] + g * g
            p[i] = p[i] - lr / (1 + (t - 1) * lr_decay) * g / (np.sqrt(s[i]) + eps)
        traj.append([x.copy() for x in p])
    return traj


@pytest.fixture(scope="module")
def torch_optim():
    with open(os.path.join(FIX, "optimizers.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def torch_sched():
    with open(os.path.join(FIX, "schedules.json")) as f:
        return {r["name"]: r for r in json.load(f)}


def _grad(A, p, i, maximize, weight_decay, l2=True):
    g = np.asarray(A[i]) + p[i] ** 2
    g = -g if maximize else g
    return g + weight_decay * p[i] if l2 else g


def _decayed_grad(A, p, i, maximize, weight_decay, decoupled, lr):
    """The gradient with L2 decay, or (decoupled) the parameter decayed in place and the plain gradient."""
    g = _grad(A, p, i, maximize, weight_decay, l2=not decoupled)
    if decoupled:
        p[i] = p[i] * (1 - lr * weight_decay)
    return g


def adamax_ref(init, A, steps, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, maximize=False):
    b1, b2 = betas
    p = [np.array(x, dtype=np.float64) for x in init]
    m, u = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
    traj = []
    for t in range(1, steps + 1):
        for i in range(len(p)):
            g = _grad(A, p, i, maximize, weight_decay)
            m[i] = m[i] + (g - m[i]) * (1 - b1)
            u[i] = np.maximum(b2 * u[i], np.abs(g) + eps)
            p[i] = p[i] - lr / (1 - b1 ** t) * m[i] / u[i]
        traj.append([x.copy() for x in p])
    return traj


def nadam_ref(init, A, steps, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
              decoupled_weight_decay=False, maximize=False):
    b1, b2 = betas
    p = [np.array(x, dtype=np.float64) for x in init]
    m, v = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
    prod = [1.0] * len(p)
    traj = []
    for t in range(1, steps + 1):
        for i in range(len(p)):
            g = _decayed_grad(A, p, i, maximize, weight_decay, decoupled_weight_decay, lr)
            mu = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
            mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
            prod[i] *= mu
            m[i] = m[i] + (g - m[i]) * (1 - b1)
            v[i] = b2 * v[i] + (1 - b2) * g * g
            d = np.sqrt(v[i] / (1 - b2 ** t)) + eps
            p[i] = p[i] - lr * (1 - mu) / (1 - prod[i]) * g / d - lr * mu_next / (1 - prod[i] * mu_next) * m[i] / d
        traj.append([x.copy() for x in p])
    return traj


def radam_ref(init, A, steps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
              maximize=False):
    b1, b2 = betas
    p = [np.array(x, dtype=np.float64) for x in init]
    m, v = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
    rho_inf = 2 / (1 - b2) - 1
    traj = []
    for t in range(1, steps + 1):
        for i in range(len(p)):
            g = _decayed_grad(A, p, i, maximize, weight_decay, decoupled_weight_decay, lr)
            m[i] = m[i] + (g - m[i]) * (1 - b1)
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mh = m[i] / (1 - b1 ** t)
            rho = rho_inf - 2 * t * b2 ** t / (1 - b2 ** t)
            if rho > 5:
                r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
                p[i] = p[i] - mh * lr * (math.sqrt(1 - b2 ** t) / (np.sqrt(v[i]) + eps)) * r
            else:
                p[i] = p[i] - mh * lr
        traj.append([x.copy() for x in p])
    return traj


REFS = {"RMSprop": rmsprop_ref, "Adagrad": adagrad_ref, "Adamax": adamax_ref, "NAdam": nadam_ref, "RAdam": radam_ref}


def test_optimizers_match_reference_and_torch(device, torch_optim):
    init, A = torch_optim["init"], torch_optim["A"]
    for run in torch_optim["runs"]:
        kind, kw, steps = run["optimizer"], run["kwargs"], run.get("steps", 5)
        params = _params(init, device)
        got = _run(getattr(nn.optim, kind)(params, **kw), params, A, steps, device)
        want = REFS[kind](init, A, steps, **kw)
        for step, (g, w, t) in enumerate(zip(got, want, run["params"])):
            for gp, wp, tp in zip(g, w, t):
                np.testing.assert_allclose(gp, wp, rtol=1e-12, atol=1e-14, err_msg=f"{kind} {kw} step {step}")
                np.testing.assert_allclose(gp, np.asarray(tp), rtol=1e-10, atol=1e-12,
                                           err_msg=f"{kind} {kw} vs torch, step {step}")


@pytest.mark.parametrize("kind,kw", [("RMSprop", {"momentum": 0.9, "centered": True, "lr": 0.01}),
                                     ("RMSprop", {"weight_decay": 0.2, "alpha": 0.5}),
                                     ("Adagrad", {"lr_decay": 0.1, "initial_accumulator_value": 0.5}),
                                     ("Adagrad", {"maximize": True, "weight_decay": 0.1}),
                                     ("Adamax", {"lr": 0.05, "weight_decay": 0.1}),
                                     ("NAdam", {"lr": 0.01, "momentum_decay": 0.01}),
                                     ("RAdam", {"lr": 0.01, "betas": (0.9, 0.99), "decoupled_weight_decay": True,
                                                "weight_decay": 0.1})])
def test_resume_from_state_dict_is_exact(device, rng, kind, kw):
    init, A = [rng.standard_normal((2, 3)), rng.standard_normal(4)], [rng.standard_normal((2, 3)),
                                                                       rng.standard_normal(4)]
    params = _params(init, device)
    straight = _run(getattr(nn.optim, kind)(params, **kw), params, A, 5, device)[-1]
    params = _params(init, device)
    opt = getattr(nn.optim, kind)(params, **kw)
    _run(opt, params, A, 3, device)
    sd = opt.state_dict()
    saved = [npa(p) for p in params]
    params2 = _params(saved, device)
    opt2 = getattr(nn.optim, kind)(params2, **kw)
    opt2.load_state_dict(sd)
    assert opt2.state[params2[0]]["step"] == 3
    resumed = _run(opt2, params2, A, 2, device)[-1]
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)
    if kind == "RMSprop" and kw.get("centered"):
        assert set(sd["state"][0]) == {"step", "square_avg", "momentum_buffer", "grad_avg"}
    if kind == "Adagrad":
        assert set(sd["state"][0]) == {"step", "sum"}


def test_optimizer_argument_errors():
    p = [nn.Parameter(flame.zeros(2))]
    with pytest.raises(ValueError, match="RMSprop: invalid"):
        nn.optim.RMSprop(p, lr=-1)
    with pytest.raises(ValueError, match="Adagrad: invalid"):
        nn.optim.Adagrad(p, lr_decay=-0.1)


# ----------------------------------------------------------------------------- schedules


def _sgd(lr=0.5, **kw):
    return nn.optim.SGD([nn.Parameter(flame.zeros(2))], lr=lr, **kw)


def onecycle_ref(t, total, max_lr, pct, div, final_div, three, linear, mmax=0.95, mbase=0.85):
    init, lo = max_lr / div, max_lr / div / final_div
    ann = (lambda a, b, f: a + (b - a) * f) if linear else \
        (lambda a, b, f: b + (a - b) / 2 * (1 + math.cos(math.pi * f)))
    e1 = pct * total - 1
    if three:
        e2 = 2 * pct * total - 2
        phases = [(0, e1, init, max_lr, mmax, mbase), (e1, e2, max_lr, init, mbase, mmax),
                  (e2, total - 1, init, lo, mmax, mmax)]
    else:
        phases = [(0, e1, init, max_lr, mmax, mbase), (e1, total - 1, max_lr, lo, mbase, mmax)]
    for k, (s, e, a, b, ma, mb) in enumerate(phases):
        if t <= e or k == len(phases) - 1:
            f = (t - s) / (e - s)
            return ann(a, b, f), ann(ma, mb, f)


def plateau_ref(metrics, lr, mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps=1e-8):
    best = math.inf if mode == "min" else -math.inf
    bad = cool = 0
    out = []
    for m in metrics:
        out.append(lr)
        if mode == "min":
            better = m < (best * (1 - threshold) if threshold_mode == "rel" else best - threshold)
        else:
            better = m > (best * (1 + threshold) if threshold_mode == "rel" else best + threshold)
        best, bad = (m, 0) if better else (best, bad + 1)
        if cool > 0:
            cool -= 1
            bad = 0
        if bad > patience:
            new = max(lr * factor, min_lr)
            lr = new if lr - new > eps else lr
            cool, bad = cooldown, 0
    return out


def test_step_multistep_exponential(torch_sched):
    cases = [("step", lambda o: S.StepLR(o, step_size=3, gamma=0.5), lambda t: 0.5 * 0.5 ** (t // 3), 10),
             ("multistep", lambda o: S.MultiStepLR(o, milestones=[5, 2, 5], gamma=0.1),
              lambda t: 0.5 * 0.1 ** bisect_right([2, 5, 5], t), 8),
             ("exponential", lambda o: S.ExponentialLR(o, gamma=0.9), lambda t: 0.5 * 0.9 ** t, 6)]
    for name, make, ref, steps in cases:
        opt = _sgd()
        lrs, _ = trace(opt, make(opt), steps)
        np.testing.assert_allclose([x[0] for x in lrs], [ref(t) for t in range(steps)], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(lrs, torch_sched[name]["lrs"], rtol=1e-12, err_msg=name)


def _sgdr_ref(t, t0, mult, eta_min, base=0.5):
    t_i = t0
    while t >= t_i:
        t, t_i = t - t_i, t_i * mult
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / t_i)) / 2


def test_warm_restarts_and_polynomial(torch_sched):
    cases = [("cosine_warm_restarts", lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.01),
              lambda t: _sgdr_ref(t, 3, 2, 0.01), 25),
             ("cosine_warm_restarts_t1", lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4),
              lambda t: _sgdr_ref(t, 4, 1, 0.0), 12),
             ("polynomial", lambda o: S.PolynomialLR(o, total_iters=6, power=2.0),
              lambda t: 0.5 * (1 - min(t, 6) / 6) ** 2, 9)]
    for name, make, ref, steps in cases:
        opt = _sgd()
        lrs, _ = trace(opt, make(opt), steps)
        np.testing.assert_allclose([x[0] for x in lrs], [ref(t) for t in range(steps)], rtol=1e-12, atol=1e-15,
                                   err_msg=name)
        np.testing.assert_allclose(lrs, torch_sched[name]["lrs"], rtol=1e-12, atol=1e-15, err_msg=name)
    # a closed form: 1000 steps of T_mult = 3 restarts land where the loop does, and resume from a state_dict exactly
    opt = _sgd()
    sched = S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=3)
    for t in range(1, 1000):
        sched.step()
        assert sched.get_last_lr()[0] == pytest.approx(_sgdr_ref(t, 2, 3, 0.0), rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="T_mult"):
        S.CosineAnnealingWarmRestarts(_sgd(), T_0=2, T_mult=0)


def test_onecycle(torch_sched):
    opt = _sgd(momentum=0.9)
    lrs, moms = trace(opt, S.OneCycleLR(opt, max_lr=0.1, total_steps=20), 20, momentum="momentum")
    ref = [onecycle_ref(t, 20, 0.1, 0.3, 25.0, 1e4, False, False) for t in range(20)]
    np.testing.assert_allclose([x[0] for x in lrs], [r[0] for r in ref], rtol=1e-12)
    np.testing.assert_allclose([x[0] for x in moms], [r[1] for r in ref], rtol=1e-12)
    np.testing.assert_allclose(lrs, torch_sched["onecycle_cos_sgd"]["lrs"], rtol=1e-12)
    np.testing.assert_allclose(moms, torch_sched["onecycle_cos_sgd"]["momentum"], rtol=1e-12)

    opt = nn.optim.Adam([nn.Parameter(flame.zeros(2))], lr=0.5)
    sched = S.OneCycleLR(opt, max_lr=0.2, total_steps=15, pct_start=0.4, anneal_strategy="linear", three_phase=True,
                         div_factor=10.0, final_div_factor=100.0)
    lrs, moms = trace(opt, sched, 15, momentum="betas")
    ref = [onecycle_ref(t, 15, 0.2, 0.4, 10.0, 100.0, True, True) for t in range(15)]
    np.testing.assert_allclose([x[0] for x in lrs], [r[0] for r in ref], rtol=1e-12)
    np.testing.assert_allclose([x[0] for x in moms], [r[1] for r in ref], rtol=1e-12)
    np.testing.assert_allclose(lrs, torch_sched["onecycle_linear_3phase_adam"]["lrs"], rtol=1e-12)
    np.testing.assert_allclose(moms, torch_sched["onecycle_linear_3phase_adam"]["momentum"], rtol=1e-12)
    assert opt.param_groups[0]["betas"][1] == 0.999
    with pytest.raises(ValueError, match="Tried to step 16 times"):
        sched.step()

    opt = nn.optim.Adam([nn.Parameter(flame.zeros(2))], lr=0.5)
    lrs, _ = trace(opt, S.OneCycleLR(opt, max_lr=0.3, epochs=3, steps_per_epoch=4, cycle_momentum=False), 12)
    np.testing.assert_allclose(lrs, torch_sched["onecycle_epochs_nomomentum"]["lrs"], rtol=1e-12)
    assert opt.param_groups[0]["betas"][0] == 0.9
    with pytest.raises(ValueError, match="total_steps OR"):
        S.OneCycleLR(opt, max_lr=0.1)
    with pytest.raises(ValueError, match="momentum or beta1"):
        S.OneCycleLR(nn.optim.Adagrad([nn.Parameter(flame.zeros(1))]), max_lr=0.1, total_steps=5)
    with pytest.raises(ValueError, match="expected 1 values for max_lr"):
        S.OneCycleLR(_sgd(), max_lr=[0.1, 0.2], total_steps=5)


def test_reduce_lr_on_plateau(torch_sched):
    cases = [("plateau_min_rel", dict(mode="min", factor=0.5, patience=2, cooldown=1, min_lr=0.05),
              dict(threshold=1e-4, threshold_mode="rel")),
             ("plateau_max_abs", dict(mode="max", factor=0.2, patience=1, threshold=0.1, threshold_mode="abs"),
              dict(cooldown=0, min_lr=0.0))]
    for name, kw, rest in cases:
        metrics = torch_sched[name]["metrics"]
        opt = _sgd()
        lrs, _ = trace(opt, S.ReduceLROnPlateau(opt, **kw), len(metrics), metrics=metrics)
        want = plateau_ref(metrics, 0.5, **kw, **rest)
        np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(lrs, torch_sched[name]["lrs"], rtol=1e-12, err_msg=name)
    assert len(set(want)) > 2  # the lr was really reduced more than once
    opt = _sgd()
    s = S.ReduceLROnPlateau(opt, patience=0)
    for m in (1.0, 2.0, 2.0):
        s.step(m)
    sd = s.state_dict()
    s2 = S.ReduceLROnPlateau(_sgd(), patience=0)
    s2.load_state_dict(sd)
    assert (s2.best, s2.num_bad_epochs, s2.last_epoch) == (1.0, 0, 3)
    with pytest.warns(UserWarning, match="deprecated"):
        s2.step(0.5, epoch=10)
    assert s2.last_epoch == 10 and s2.best == 0.5
    with pytest.raises(ValueError, match="Factor should be < 1.0"):
        S.ReduceLROnPlateau(opt, factor=1.0)
    with pytest.raises(ValueError, match="unknown"):
        S.ReduceLROnPlateau(opt, mode="median")


def test_sequential_and_chained(torch_sched):
    opt = _sgd(lr=0.05)
    s = S.SequentialLR(opt, [S.ConstantLR(opt, factor=0.1, total_iters=3), S.ExponentialLR(opt, gamma=0.9)],
                       milestones=[3])
    lrs, _ = trace(opt, s, 8)
    want = [0.005] * 3 + [0.05 * 0.9 ** k for k in range(5)]
    np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12)
    np.testing.assert_allclose(lrs, torch_sched["sequential_const_exp"]["lrs"], rtol=1e-12)

    opt = _sgd()
    s = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.25, total_iters=4), S.StepLR(opt, 2, 0.5)],
                       milestones=[4])
    lrs, _ = trace(opt, s, 10)
    want = [0.5 * (0.25 + 0.75 * t / 4) for t in range(4)] + [0.5 * 0.5 ** (k // 2) for k in range(6)]
    np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12)
    np.testing.assert_allclose(lrs, torch_sched["sequential_linear_step"]["lrs"], rtol=1e-12)

    opt = _sgd(lr=1.0)
    s = S.ChainedScheduler([S.ConstantLR(opt, factor=0.1, total_iters=2), S.ExponentialLR(opt, gamma=0.9)])
    lrs, _ = trace(opt, s, 6)
    want = [(0.1 if t < 2 else 1.0) * 0.9 ** t for t in range(6)]
    np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12)
    np.testing.assert_allclose(lrs, torch_sched["chained_const_exp"]["lrs"], rtol=1e-12)

    opt = _sgd()
    s = S.ChainedScheduler([S.LinearLR(opt, start_factor=0.5, total_iters=3),
                            S.MultiStepLR(opt, milestones=[4], gamma=0.5)])
    lrs, _ = trace(opt, s, 7)
    np.testing.assert_allclose(lrs, torch_sched["chained_linear_multistep"]["lrs"], rtol=1e-12)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        S.ChainedScheduler([S.ReduceLROnPlateau(opt)], optimizer=opt)
    with pytest.raises(ValueError, match="one milestone fewer"):
        S.SequentialLR(opt, [S.StepLR(opt, 2)], milestones=[1])
    with pytest.raises(ValueError, match="same optimizer"):
        S.SequentialLR(opt, [S.StepLR(opt, 2), S.StepLR(_sgd(), 2)], milestones=[1])


@pytest.mark.parametrize("make", [
    lambda o: S.StepLR(o, 2, 0.5),
    lambda o: S.MultiStepLR(o, [1, 3], 0.3),
    lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=12, three_phase=True),
    lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.5, total_iters=3), S.ExponentialLR(o, 0.8)], milestones=[3]),
    lambda o: S.ChainedScheduler([S.StepLR(o, 2, 0.5), S.ExponentialLR(o, 0.9)]),
])
def test_schedules_resume_from_state_dict(make):
    opt = _sgd(momentum=0.9)
    straight, _ = trace(opt, make(opt), 10)
    opt = _sgd(momentum=0.9)
    sched = make(opt)
    first, _ = trace(opt, sched, 4)
    sd = json.loads(json.dumps(sched.state_dict()))  # plain data only
    opt_sd = opt.state_dict()
    opt2 = _sgd(momentum=0.9)
    opt2.load_state_dict(opt_sd)
    sched2 = make(opt2)
    sched2.load_state_dict(sd)
    rest, _ = trace(opt2, sched2, 6)
    np.testing.assert_allclose(first + rest, straight, rtol=1e-12)


# ----------------------------------------------------------------------------- gradient and parameter utilities
def test_clip_grad_value(device, rng):
    ps = _params([rng.standard_normal((3, 2)), rng.standard_normal(4)], device)
    nn.optim.SGD(ps, lr=0.1)  # registers the parameters: their gradients live in the pool's flat buffer
    g = [rng.standard_normal((3, 2)) * 3, rng.standard_normal(4) * 3]
    (sum((flame.tensor(a, dtype=flame.float64, device=device) * p).sum() for a, p in zip(g, ps))).backward()
    nn.utils.clip_grad_value_(ps, 1.5)
    for p, a in zip(ps, g):
        np.testing.assert_array_equal(npa(p.grad), np.clip(a, -1.5, 1.5))
    lone = nn.Parameter(flame.tensor([-3.0, 0.5, 9.0], device=device))
    lone.grad = flame.tensor([-3.0, 0.5, 9.0], device=device)
    nn.utils.clip_grad_value_(lone, 2)
    assert npa(lone.grad).tolist() == [-2.0, 0.5, 2.0]


def test_parameters_to_vector_and_back(device, rng):
    ps = _params([rng.standard_normal((3, 2)), rng.standard_normal(4)], device)
    v = nn.utils.parameters_to_vector(ps)
    assert tuple(v.shape) == (10,)
    np.testing.assert_array_equal(npa(v), np.concatenate([npa(p).ravel() for p in ps]))
    (v * flame.arange(10, dtype=flame.float64, device=device)).sum().backward()
    np.testing.assert_array_equal(npa(ps[0].grad), np.arange(6.0).reshape(3, 2))  # differentiable
    new = flame.arange(10, dtype=flame.float64, device=device) * 0.5
    keep = ps[0]
    nn.utils.vector_to_parameters(new, ps)
    assert ps[0] is keep
    np.testing.assert_array_equal(npa(ps[0]), np.arange(6.0).reshape(3, 2) * 0.5)
    np.testing.assert_array_equal(npa(ps[1]), np.arange(6.0, 10.0) * 0.5)
    with pytest.raises(ValueError, match="10 elements"):
        nn.utils.vector_to_parameters(new[:9], ps)
    with pytest.raises(TypeError, match="expected a Tensor"):
        nn.utils.vector_to_parameters(np.zeros(10), ps)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 2, 3, 3), (6, 6)])
def test_orthogonal_init(device, shape):
    t = flame.empty(*shape, dtype=flame.float64, device=device)
    g = flame.Generator().manual_seed(3)
    nn.init.orthogonal_(t, gain=2.0, generator=g)
    m = npa(t).reshape(shape[0], -1) / 2.0
    rows, cols = m.shape
    gram = m.T @ m if rows >= cols else m @ m.T
    np.testing.assert_allclose(gram, np.eye(min(rows, cols)), atol=1e-12)
    t2 = flame.empty(*shape, dtype=flame.float64, device=device)
    nn.init.orthogonal_(t2, gain=2.0, generator=flame.Generator().manual_seed(3))
    np.testing.assert_array_equal(npa(t2), npa(t))  # the generator decides
    with pytest.raises(ValueError, match="2 or more dimensions"):
        nn.init.orthogonal_(flame.empty(3))


def test_trunc_normal_init(device):
    t = flame.empty(20000, dtype=flame.float64, device=device)
    nn.init.trunc_normal_(t, mean=0.5, std=1.0, a=-0.5, b=1.0, generator=flame.Generator().manual_seed(0))
    x = npa(t)
    assert x.min() >= -0.5 and x.max() <= 1.0
    # moments of Normal(0.5, 1) truncated to [-0.5, 1]
    al, be = -1.0, 0.5
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    Z = cdf(be) - cdf(al)
    mean = 0.5 + (pdf(al) - pdf(be)) / Z
    var = 1 + (al * pdf(al) - be * pdf(be)) / Z - ((pdf(al) - pdf(be)) / Z) ** 2
    assert abs(x.mean() - mean) < 0.01 and abs(x.var() - var) < 0.01
