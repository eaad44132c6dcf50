"""Adadelta, ASGD, Rprop, Muon and LBFGS against PyTorch's numbers (tests/fixtures/torch_nn/optimizers.json, "more",
made by tests/fixtures/make_torch_nn_fixtures.py) in float64 and float32 and against NumPy references written here;
exact resume from state_dict; parameter groups; argument errors; every constructor option either changes the steps
or raises; the strong-Wolfe line search's conditions and its cubic interpolation."""
import inspect
import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_nn.optim.lbfgs import _cubic_min, strong_wolfe

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn")
TOL = {"float64": dict(rtol=1e-10, atol=1e-12), "float32": dict(rtol=2e-5, atol=2e-6)}


@pytest.fixture(scope="module")
def torch_more():
    with open(os.path.join(FIX, "optimizers.json")) as f:
        data = json.load(f)
    return data["init"], data["A"], data["more"]


def npa(t):
    return t.detach().numpy().astype(np.float64)


def _params(init, device, dtype="float64"):
    return [nn.Parameter(flame.tensor(np.asarray(a, dtype=np.float64), dtype=getattr(flame, dtype), device=device))
            for a in init]


def _loss(problem, ps, A):
    """The fixture's closure losses: quartic sum(A p + p^2 / 2 + p^4 / 4); rosenbrock on the rows of ps[0] plus a
    quadratic pull of ps[1] towards A[1]."""
    if problem == "quartic":
        return sum((a * p + p * p / 2 + p ** 4 / 4).sum() for p, a in zip(ps, A))
    x, y = ps[0][:, 0], ps[0][:, 1]
    return ((1 - x) ** 2 + 10 * (y - x * x) ** 2).sum() + ((ps[1] - A[1]) ** 2).sum() / 2


def _run(kind, kw, init, A, steps, device, dtype="float64", problem=None, opt_and_params=None):
    """Parameters after each step: grad = A + p^2 exactly (the loss (A + p^2) p with the factor held constant), or
    LBFGS steps over the closure of `problem`. Returns (trajectory, losses LBFGS returned, optimizer, params)."""
    opt, ps = opt_and_params or (None, _params(init, device, dtype))
    opt = opt or getattr(nn.optim, kind)(ps, **kw)
    At = [flame.tensor(np.asarray(a, dtype=np.float64), dtype=ps[0].dtype, device=device) for a in A]

    def closure():
        opt.zero_grad()
        loss = _loss(problem, ps, At)
        loss.backward()
        return loss
    traj, losses = [], []
    for _ in range(steps):
        if kind == "LBFGS":
            losses.append(float(opt.step(closure)))
        else:
            opt.zero_grad()
            sum(((a + p.detach() ** 2) * p).sum() for a, p in zip(At, ps)).backward()
            opt.step()
        traj.append([npa(p) for p in ps])
    return traj, losses, opt, ps


# ----------------------------------------------------------------------------- NumPy references (float64)
def _grad(A, p, i, maximize=False, weight_decay=0.0):
    g = np.asarray(A[i]) + p[i] ** 2
    g = -g if maximize else g
    return g + weight_decay * p[i]


def adadelta_ref(init, A, steps, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, maximize=False):
    p = [np.array(x, dtype=np.float64) for x in init]
    v, u = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
    traj = []
    for _ in range(steps):
        for i in range(len(p)):
            g = _grad(A, p, i, maximize, weight_decay)
            v[i] = rho * v[i] + (1 - rho) * g * g
            delta = np.sqrt(u[i] + eps) / np.sqrt(v[i] + eps) * g
            u[i] = rho * u[i] + (1 - rho) * delta * delta
            p[i] = p[i] - lr * delta
        traj.append([x.copy() for x in p])
    return traj


def asgd_ref(init, A, steps, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0.0, maximize=False):
    p = [np.array(x, dtype=np.float64) for x in init]
    ax = [np.zeros_like(x) for x in p]
    eta, mu = lr, 1.0
    traj, axs = [], []
    for t in range(1, steps + 1):
        for i in range(len(p)):
            g = _grad(A, p, i, maximize, weight_decay)
            p[i] = p[i] * (1 - lambd * eta) - eta * g
            ax[i] = p[i].copy() if mu == 1 else ax[i] + mu * (p[i] - ax[i])
        eta, mu = lr / (1 + lambd * lr * t) ** alpha, 1 / max(1, t - t0)
        traj.append([x.copy() for x in p])
        axs.append([x.copy() for x in ax])
    return traj, axs


def rprop_ref(init, A, steps, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), maximize=False):
    p = [np.array(x, dtype=np.float64) for x in init]
    prev, size = [np.zeros_like(x) for x in p], [np.full_like(x, lr) for x in p]
    traj = []
    for _ in range(steps):
        for i in range(len(p)):
            g = _grad(A, p, i, maximize)
            s = np.sign(g * prev[i])
            size[i] = np.clip(size[i] * np.where(s > 0, etas[1], np.where(s < 0, etas[0], 1.0)), *step_sizes)
            g = np.where(s < 0, 0.0, g)
            p[i] = p[i] - np.sign(g) * size[i]
            prev[i] = g
        traj.append([x.copy() for x in p])
    return traj


def _bf16(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def newton_schulz_ref(u, coefficients, steps, eps):
    """PyTorch's bfloat16 Newton-Schulz: every matrix op accumulated in float32 and rounded to bfloat16 once."""
    a, b, c = coefficients
    x = _bf16(u)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = _bf16(x / _bf16(max(np.sqrt(np.sum(x * x, dtype=np.float32)), np.float32(eps))))
    for _ in range(steps):
        gram = _bf16(x @ x.T)
        x = _bf16(a * x + _bf16(b * gram + c * (gram @ gram)) @ x)
    return x.T if tall else x


def muon_ref(init, A, steps, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
             ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None):
    p = [np.array(x, dtype=np.float64) for x in init]
    buf = [np.zeros_like(x) for x in p]
    traj = []
    for _ in range(steps):
        for i in range(len(p)):
            g = _grad(A, p, i)
            buf[i] = buf[i] + (1 - momentum) * (g - buf[i])
            u = g + momentum * (buf[i] - g) if nesterov else buf[i]
            o = newton_schulz_ref(u, ns_coefficients, ns_steps, eps).astype(np.float64)
            rows, cols = p[i].shape
            scale = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else \
                math.sqrt(max(1, rows / cols))
            p[i] = p[i] * (1 - lr * weight_decay) - lr * scale * o
        traj.append([x.copy() for x in p])
    return traj


def lbfgs_ref(init, A, steps, lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7, tolerance_change=1e-9,
              history_size=100):
    """L-BFGS with a fixed step on the quartic loss, over the flattened parameters."""
    shapes = [np.shape(x) for x in init]
    a = np.concatenate([np.ravel(x) for x in A])
    x = np.concatenate([np.ravel(v) for v in init]).astype(np.float64)
    max_eval = max_iter * 5 // 4 if max_eval is None else max_eval

    def f_g(x):
        return float(np.sum(a * x + x * x / 2 + x ** 4 / 4)), a + x + x ** 3
    S, Y, k = [], [], 0
    d = t = g_prev = None
    traj, losses = [], []
    for _ in range(steps):
        f, g = f_g(x)
        losses.append(f)
        evals = 1
        for n in range(1, max_iter + 1):
            if np.abs(g).max() <= tolerance_grad:
                break
            k += 1
            if k > 1:
                y, s = g - g_prev, t * d
                if y @ s > 1e-10:
                    S, Y = (S + [s])[-history_size:], (Y + [y])[-history_size:]
                q, al = -g, []
                for s_i, y_i in zip(reversed(S), reversed(Y)):
                    al.append(s_i @ q / (y_i @ s_i))
                    q = q - al[-1] * y_i
                r = q * (S[-1] @ Y[-1]) / (Y[-1] @ Y[-1])
                for s_i, y_i, al_i in zip(S, Y, reversed(al)):
                    r = r + (al_i - y_i @ r / (y_i @ s_i)) * s_i
                d = r
            else:
                d = -g
            g_prev, f_prev = g, f
            t = (min(1.0, 1.0 / np.abs(g).sum()) if k == 1 else 1.0) * lr
            if g @ d > -tolerance_change:
                break
            x = x + t * d
            if n == max_iter:
                break
            (f, g), evals = f_g(x), evals + 1
            if evals >= max_eval or np.abs(g).max() <= tolerance_grad or np.abs(t * d).max() <= tolerance_change \
                    or abs(f - f_prev) < tolerance_change:
                break
        parts = np.split(x, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
        traj.append([v.reshape(s) for v, s in zip(parts, shapes)])
    return traj, losses


def _reference(run, init, A):
    kind, kw, steps = run["optimizer"], run["kwargs"], run["steps"]
    if kind == "Adadelta":
        return adadelta_ref(init, A, steps, **kw)
    if kind == "ASGD":
        return asgd_ref(init, A, steps, **kw)[0]
    if kind == "Rprop":
        return rprop_ref(init, A, steps, **kw)
    if kind == "Muon":
        return muon_ref(init, A, steps, **kw)
    if kind == "LBFGS" and run["problem"] == "quartic" and "line_search_fn" not in kw:
        return lbfgs_ref(init, A, steps, **kw)[0]
    return None


# ----------------------------------------------------------------------------- PyTorch's numbers and the references
def _runs(kind):
    with open(os.path.join(FIX, "optimizers.json")) as f:
        runs = json.load(f)["more"]["runs"]
    return [pytest.param(i, id=f"{r['optimizer']}-{r['dtype']}-{i}") for i, r in enumerate(runs)
            if r["optimizer"] == kind]


@pytest.mark.parametrize("index", [p for k in ("Adadelta", "ASGD", "Rprop", "Muon", "LBFGS") for p in _runs(k)])
def test_matches_torch_and_reference(device, torch_more, index):
    init, A, more = torch_more
    run = more["runs"][index]
    kind, kw, dtype = run["optimizer"], run["kwargs"], run["dtype"]
    if run["problem"] == "2d":
        init, A = more["init2d"], more["A2d"]
    got, losses, opt, _ = _run(kind, kw, init, A, run["steps"], device, dtype, run["problem"])
    want = _reference(run, init, A) if dtype == "float64" else None
    for step, (g, t) in enumerate(zip(got, run["params"])):
        for i, (gp, tp) in enumerate(zip(g, t)):
            np.testing.assert_allclose(gp, np.asarray(tp), **TOL[dtype], err_msg=f"{kind} {kw} vs torch, step {step}")
            if want is not None:
                np.testing.assert_allclose(gp, want[step][i], rtol=1e-12, atol=1e-14,
                                           err_msg=f"{kind} {kw} vs reference, step {step}")
    if kind == "LBFGS":
        np.testing.assert_allclose(losses, run["losses"], **TOL[dtype])
        st = opt.state[opt.param_groups[0]["params"][0]]
        if dtype == "float64":
            assert (st["n_iter"], st["func_evals"]) == (run["n_iter"], run["func_evals"])


def test_lbfgs_reference_losses(device, torch_more):
    init, A, _ = torch_more
    kw = {"lr": 0.5, "max_iter": 6, "history_size": 3}
    _, losses, _, _ = _run("LBFGS", kw, init, A, 3, device, problem="quartic")
    np.testing.assert_allclose(losses, lbfgs_ref(init, A, 3, **kw)[1], rtol=1e-12)


def test_asgd_average(device, torch_more):
    """ax: the parameter itself while t <= t0, then the running average of the iterates since t0."""
    init, A, _ = torch_more
    kw = {"lr": 0.05, "lambd": 0.01, "alpha": 0.5, "t0": 2, "weight_decay": 0.1}
    _, _, opt, ps = _run("ASGD", kw, init, A, 6, device)
    traj, axs = asgd_ref(init, A, 6, **kw)
    for p, want in zip(ps, axs[-1]):
        np.testing.assert_allclose(npa(opt.state[p]["ax"]), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(axs[-1][0], np.mean([s[0] for s in traj[3:]], axis=0), rtol=1e-12)  # mu 1, 1/2, 1/3
    st = opt.state[ps[0]]
    assert st["step"] == 6 and st["mu"] == 1 / 4 and st["eta"] == pytest.approx(0.05 / (1 + 0.01 * 0.05 * 6) ** 0.5)


# ----------------------------------------------------------------------------- exact resume
RESUME = [("Adadelta", {"lr": 0.5, "weight_decay": 0.1}, None, {"step", "square_avg", "acc_delta"}),
          ("ASGD", {"t0": 1, "lambd": 0.01, "lr": 0.05}, None, {"step", "eta", "mu", "ax"}),
          ("Rprop", {"maximize": True, "lr": 0.05}, None, {"step", "prev", "step_size"}),
          ("Muon", {"lr": 0.02, "nesterov": False}, None, {"momentum_buffer"}),
          ("LBFGS", {"max_iter": 4, "history_size": 3}, "quartic", None),
          ("LBFGS", {"max_iter": 5, "history_size": 2, "line_search_fn": "strong_wolfe"}, "rosenbrock", None)]
LBFGS_STATE = {"func_evals", "n_iter", "d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad",
               "prev_loss"}


@pytest.mark.parametrize("kind,kw,problem,keys", RESUME)
def test_resume_from_state_dict_is_exact(device, rng, tmp_path, kind, kw, problem, keys):
    """5 steps straight = 3 steps, state_dict, a new optimizer over new parameters loading it (directly, and through
    flame.save / flame.load), 2 steps."""
    init = [rng.standard_normal((3, 4)), rng.standard_normal((5, 2))]
    A = [rng.standard_normal((3, 4)), rng.standard_normal((5, 2))]
    straight = _run(kind, kw, init, A, 5, device, problem=problem)[0][-1]
    traj, _, opt, ps = _run(kind, kw, init, A, 3, device, problem=problem)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == (keys or LBFGS_STATE)
    flame.save(sd, tmp_path / "opt.safetensors")
    resumed = []
    for loaded in (sd, flame.load(tmp_path / "opt.safetensors")):
        ps2 = _params(traj[-1], device)
        opt2 = getattr(nn.optim, kind)(ps2, **kw)
        opt2.load_state_dict(loaded)
        resumed.append((opt2, ps2))
    _run(kind, kw, init, A, 2, device, problem=problem, opt_and_params=(opt, ps))   # the source goes on: no sharing
    for opt2, ps2 in resumed:
        got = _run(kind, kw, init, A, 2, device, problem=problem, opt_and_params=(opt2, ps2))[0][-1]
        for a, b in zip(straight, got):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- parameter groups
@pytest.mark.parametrize("kind,kw,group_kw", [("Adadelta", {}, {"lr": 0.3, "rho": 0.5}),
                                              ("ASGD", {"t0": 1}, {"lr": 0.05, "weight_decay": 0.2}),
                                              ("Rprop", {}, {"etas": (0.2, 1.5), "maximize": True}),
                                              ("Muon", {"lr": 0.02}, {"adjust_lr_fn": "match_rms_adamw"})])
def test_param_groups(device, rng, kind, kw, group_kw):
    """A group's own hyper-parameters act on its parameters only, as two optimizers would."""
    init = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))]
    A = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))]
    ps = _params(init, device)
    opt = getattr(nn.optim, kind)([{"params": [ps[0]]}, {"params": [ps[1]], **group_kw}], **kw)
    assert opt.param_groups[1]["lr"] == group_kw.get("lr", opt.defaults["lr"])
    got = _run(kind, kw, init, A, 3, device, opt_and_params=(opt, ps))[0][-1]
    one = _run(kind, kw, init[:1], A[:1], 3, device)[0][-1][0]
    two = _run(kind, {**kw, **group_kw}, init[1:], A[1:], 3, device)[0][-1][0]
    np.testing.assert_array_equal(got[0], one)
    np.testing.assert_array_equal(got[1], two)


# ----------------------------------------------------------------------------- options and errors
UNSUPPORTED = {"foreach": True, "capturable": True, "differentiable": True}
OPTIONS = {   # each constructor option: a value that must change the steps, or the error it raises
    "Adadelta": {"lr": 0.5, "rho": 0.5, "eps": 1e-3, "weight_decay": 0.1, "maximize": True, **UNSUPPORTED},
    "ASGD": {"lr": 0.05, "lambd": 0.1, "alpha": 0.5, "t0": 0, "weight_decay": 0.1, "maximize": True, **UNSUPPORTED},
    "Rprop": {"lr": 0.05, "etas": (0.3, 1.5), "step_sizes": (1e-3, 0.011), "maximize": True, **UNSUPPORTED},
    "Muon": {"lr": 0.02, "weight_decay": 0.5, "momentum": 0.5, "nesterov": False, "ns_coefficients": (3.0, -3.2, 1.2),
             "eps": 10.0, "ns_steps": 2, "adjust_lr_fn": "match_rms_adamw"},
    "LBFGS": {"lr": 0.5, "max_iter": 3, "max_eval": 2, "tolerance_grad": 10.0, "tolerance_change": 0.5,
              "history_size": 1, "line_search_fn": "strong_wolfe"},
}
BASE = {"LBFGS": {"max_iter": 8}}   # the defaults the options are varied from (LBFGS: each limit bites)


def _outcome(opt, ps):
    """The parameters, every state tensor and number (ASGD's t0 shows in its average only; LBFGS's line search on
    this easy loss in its evaluation count: the first step tried meets the Wolfe conditions)."""
    state = [v for st in opt.state.values() for v in st.values()]
    return [npa(p) for p in ps] + [npa(v) if isinstance(v, flame.Tensor) else np.asarray(v) for v in state
                                   if not isinstance(v, list)]


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_every_option_works_or_raises(device, rng, kind):
    cls = getattr(nn.optim, kind)
    names = [n for n in inspect.signature(cls).parameters if n != "params"]
    assert sorted(names) == sorted(OPTIONS[kind]), "an option without a test"
    init = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))]
    A = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2))]
    problem = "quartic" if kind == "LBFGS" else None
    base = BASE.get(kind, {})
    ref = _outcome(*_run(kind, base, init, A, 3, device, problem=problem)[2:])
    for name, value in OPTIONS[kind].items():
        if name in UNSUPPORTED:
            with pytest.raises(ValueError, match=f"{name}=True is not supported"):
                cls(_params(init, device), **{name: value})
            cls(_params(init, device), **{name: None if name == "foreach" else False})   # the defaults are fine
            continue
        got = _outcome(*_run(kind, {**base, name: value}, init, A, 3, device, problem=problem)[2:])
        assert len(got) != len(ref) or any(not np.array_equal(a, b) for a, b in zip(got, ref)), \
            f"{kind}: {name}={value} changed nothing"


@pytest.mark.parametrize("kind,kw,match", [
    ("Adadelta", {"lr": -1}, "lr=-1"), ("Adadelta", {"rho": 1.5}, "rho=1.5"), ("Adadelta", {"eps": -1}, "eps=-1"),
    ("Adadelta", {"weight_decay": -0.1}, "weight_decay=-0.1"),
    ("ASGD", {"lr": -1}, "lr=-1"), ("ASGD", {"weight_decay": -1}, "weight_decay=-1"),
    ("Rprop", {"lr": -1}, "lr=-1"), ("Rprop", {"etas": (1.2, 0.5)}, "etas="), ("Rprop", {"etas": (0.0, 1.2)}, "etas="),
    ("Muon", {"lr": -1}, "lr=-1"), ("Muon", {"momentum": -0.1}, "momentum=-0.1"),
    ("Muon", {"weight_decay": -1}, "weight_decay=-1"), ("Muon", {"adjust_lr_fn": "sqrt"}, "adjust_lr_fn='sqrt'"),
    ("Muon", {"ns_steps": 100}, "ns_steps=100"), ("Muon", {"ns_coefficients": (1, 2)}, "ns_coefficients"),
    ("LBFGS", {"lr": -1}, "lr=-1"), ("LBFGS", {"line_search_fn": "armijo"}, "line_search_fn='armijo'"),
    ("LBFGS", {"history_size": 0}, "history_size=0"), ("LBFGS", {"max_iter": 0}, "max_iter=0")])
def test_argument_errors(device, kind, kw, match):
    with pytest.raises(ValueError, match=match):
        getattr(nn.optim, kind)([nn.Parameter(flame.zeros(2, 2, device=device))], **kw)


def test_muon_takes_2d_parameters_only(device):
    w, b = nn.Parameter(flame.zeros(3, 2, device=device)), nn.Parameter(flame.zeros(3, device=device))
    with pytest.raises(ValueError, match=r"Muon only supports 2-D parameters, got one of shape \(3,\)"):
        nn.optim.Muon([w, b])
    opt = nn.optim.Muon([w])
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": b})
    assert len(opt.param_groups) == 1


def test_lbfgs_one_group_and_closure(device):
    a, b = nn.Parameter(flame.zeros(2, device=device)), nn.Parameter(flame.zeros(2, device=device))
    with pytest.raises(ValueError, match="parameter groups"):
        nn.optim.LBFGS([{"params": [a]}, {"params": [b]}])
    opt = nn.optim.LBFGS([a])
    with pytest.raises(ValueError, match="parameter groups"):
        opt.add_param_group({"params": [b]})
    with pytest.raises(TypeError):
        opt.step()
    with pytest.raises(TypeError, match="needs a closure"):
        opt.step(None)
    assert opt.defaults["max_eval"] == 25 and nn.optim.LBFGS([b], max_iter=7).defaults["max_eval"] == 8


# ----------------------------------------------------------------------------- the line search's parts
def test_cubic_min():
    """Exact on a cubic (its local minimum from two points' values and slopes), either point order, clamped to the
    bounds; the midpoint of the bounds when the interpolant has no minimum."""
    def f(x):
        return x ** 3 - 3 * x, 3 * x * x - 3     # local minimum at 1
    for x1, x2 in ((0.0, 2.0), (2.0, 0.0), (0.5, 3.0)):
        assert _cubic_min(x1, *f(x1), x2, *f(x2)) == pytest.approx(1.0, abs=1e-12)
    assert _cubic_min(0.0, *f(0.0), 2.0, *f(2.0), bounds=(1.5, 4.0)) == 1.5
    # a concave piece with slopes that leave no minimum (d1^2 < g1 g2): the middle of the bounds
    assert _cubic_min(0.0, 0.0, 1.0, 1.0, 2 / 3, 1.0, bounds=(0.0, 3.0)) == 1.5


LINE_FUNCTIONS = {   # as in the fixture's generator: (f, f') of one variable, descending at 0
    "quartic": (lambda t: t ** 4 / 4 - 2 * t, lambda t: t ** 3 - 2),
    "wiggle": (lambda t: -2 * t + 0.3 * math.sin(5 * t) + 0.05 * t * t,
               lambda t: -2 + 1.5 * math.cos(5 * t) + 0.1 * t),
    "steep": (lambda t: math.exp(3 * t) - 5 * t, lambda t: 3 * math.exp(3 * t) - 5),
    "bumpy": (lambda t: -0.5 * t + math.sin(3 * t) ** 2, lambda t: -0.5 + 3 * math.sin(6 * t)),
    "hinge": (lambda t: -t + 50 * max(t - 1, 0.0) ** 2, lambda t: -1 + 100 * max(t - 1, 0.0)),
    "ripple": (lambda t: -t + 0.075 * math.sin(8 * t) + 0.02 * math.sin(13 * t) + 0.5 * t * t,
               lambda t: -1 + 0.6 * math.cos(8 * t) + 0.26 * math.cos(13 * t) + t),
}


def test_strong_wolfe_matches_torch(torch_more):
    """The line search alone, along d = 1 from 0, against PyTorch's: every branch of bracketing and zoom."""
    for case in torch_more[2]["line_search"]:
        f, df = LINE_FUNCTIONS[case["function"]]
        f_new, g_new, t, evals = strong_wolfe(lambda t: (f(t), np.array([df(t)])), case["t0"], np.ones(1), f(0.0),
                                              np.array([df(0.0)]), df(0.0), tolerance_change=case["tolerance_change"],
                                              max_ls=case["max_ls"])
        assert (t, f_new, float(g_new[0]), evals) == pytest.approx(
            (case["t"], case["loss"], case["grad"], case["evals"]), rel=1e-12, abs=1e-14), case


@pytest.mark.parametrize("t0", [1e-3, 1.0, 30.0])
def test_strong_wolfe_conditions(t0):
    """On f(x) = x^4 / 4 - 2 x from 0 along d = 1 (f'(0) = -2): from a step far too short, a good one and far too
    long, the result meets the strong Wolfe conditions and reports its loss, gradient and evaluations."""
    calls = []

    def evaluate(t):
        calls.append(t)
        return t ** 4 / 4 - 2 * t, np.array([t ** 3 - 2.0])
    d = np.array([1.0])
    f_new, g_new, t, evals = strong_wolfe(evaluate, t0, d, 0.0, np.array([-2.0]), -2.0)
    assert f_new <= 1e-4 * t * -2.0 and abs(float(g_new[0])) <= 0.9 * 2.0
    assert f_new == pytest.approx(t ** 4 / 4 - 2 * t) and evals == len(calls) and t in calls
