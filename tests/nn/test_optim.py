"""Optimizers against the reference update formulas (NumPy float64) over several steps, exact resume from
state_dict, AdamW8bit vs AdamW, learning-rate schedules and clip_grad_norm_."""
import copy
import math

import numpy as np
import pytest

import flame_core as flame
import flame_nn as nn
from flame_core import grad_pool, io
from flame_nn.optim import lr_scheduler as S
from flame_nn.optim.adamw8bit import dequantize_blockwise, dynamic_map, quantize_blockwise


def npa(t):
    return t.detach().numpy().astype(np.float64)


STEPS = 5


def _problem(device, seed=0):
    """Two float64 parameters; loss = sum(A * p + p^3 / 3) so that grad = A + p^2 depends on p."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal((4, 3)), rng.standard_normal(5)]
    A = [rng.standard_normal((4, 3)), rng.standard_normal(5)]
    params = [nn.Parameter(flame.tensor(a, dtype=flame.float64, device=device)) for a in init]
    At = [flame.tensor(a, dtype=flame.float64, device=device) for a in A]

    def loss():
        return sum((a * p + p * p * p / 3).sum() for a, p in zip(At, params))
    return params, loss, [a.copy() for a in init], A


def _run(opt, params, loss, steps=STEPS):
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return [npa(p) for p in params]


def _ref_sgd(p, A, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False, maximize=False):
    bufs = [None] * len(p)
    for _ in range(STEPS):
        for i in range(len(p)):
            g = A[i] + p[i] ** 2
            g = -g if maximize else g
            g = g + wd * p[i]
            if momentum:
                bufs[i] = g.copy() if bufs[i] is None else momentum * bufs[i] + (1 - dampening) * g
                g = g + momentum * bufs[i] if nesterov else bufs[i]
            p[i] = p[i] - lr * g
    return p


def _ref_adam(p, A, lr, b1, b2, eps, wd, decoupled, amsgrad=False, maximize=False):
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    vmax = [np.zeros_like(x) for x in p]
    for t in range(1, STEPS + 1):
        for i in range(len(p)):
            g = A[i] + p[i] ** 2
            g = -g if maximize else g
            if decoupled:
                p[i] = p[i] * (1 - lr * wd)
            else:
                g = g + wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            vhat = v[i]
            if amsgrad:
                vmax[i] = np.maximum(vmax[i], v[i])
                vhat = vmax[i]
            p[i] = p[i] - lr / (1 - b1 ** t) * m[i] / (np.sqrt(vhat) / math.sqrt(1 - b2 ** t) + eps)
    return p


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9, dampening=0.1), dict(momentum=0.8, nesterov=True),
                                dict(momentum=0.5, weight_decay=0.05), dict(maximize=True)])
def test_sgd_matches_reference(device, kw):
    params, loss, p0, A = _problem(device)
    got = _run(nn.optim.SGD(params, lr=0.05, **kw), params, loss)
    want = _ref_sgd(p0, A, 0.05, kw.get("momentum", 0.0), kw.get("dampening", 0.0), kw.get("weight_decay", 0.0),
                    kw.get("nesterov", False), kw.get("maximize", False))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls, kw", [(nn.optim.Adam, dict()), (nn.optim.Adam, dict(weight_decay=0.1)),
                                     (nn.optim.Adam, dict(amsgrad=True, betas=(0.8, 0.9))),
                                     (nn.optim.AdamW, dict()), (nn.optim.AdamW, dict(weight_decay=0.3, eps=1e-3)),
                                     (nn.optim.AdamW, dict(amsgrad=True)), (nn.optim.AdamW, dict(maximize=True))])
def test_adam_family_matches_reference(device, cls, kw):
    params, loss, p0, A = _problem(device, seed=1)
    opt = cls(params, lr=0.03, **kw)
    got = _run(opt, params, loss)
    b1, b2 = kw.get("betas", (0.9, 0.999))
    wd = kw.get("weight_decay", 1e-2 if cls is nn.optim.AdamW else 0.0)
    want = _ref_adam(p0, A, 0.03, b1, b2, kw.get("eps", 1e-8), wd, cls is nn.optim.AdamW, kw.get("amsgrad", False),
                     kw.get("maximize", False))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert all(st["step"] == STEPS for st in opt.state.values())


@pytest.mark.gpu
def test_fused_adamw_on_pooled_fp32_gradients_matches_reference():
    """float32 cuda parameters with pooled gradients take the fused multi-tensor kernel."""
    rng = np.random.default_rng(3)
    shapes = [(300, 70), (1000,), (17, 5)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    A = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [nn.Parameter(flame.tensor(a, device="cuda")) for a in init]
    At = [flame.tensor(a, device="cuda") for a in A]
    opt = nn.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    assert all(grad_pool.is_registered(p) for p in params)
    got = _run(opt, params, lambda: sum((a * p + p * p * p / 3).sum() for a, p in zip(At, params)))
    flat = opt._flat  # the fused path ran: moments are flat buffers, state tensors views into them
    assert len(flat) == 1
    want = _ref_adam([a.astype(np.float64) for a in init], [a.astype(np.float64) for a in A], 0.01, 0.9, 0.999,
                     1e-8, 0.1, True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def _clone_state(sd):
    return copy.deepcopy(sd)  # tensors pickle through NumPy: a real snapshot


@pytest.mark.parametrize("make", [lambda ps: nn.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
                                  lambda ps: nn.optim.AdamW(ps, lr=0.02, amsgrad=True),
                                  lambda ps: nn.optim.AdamW8bit(ps, lr=0.02, min_8bit_size=0, block_size=4)])
def test_exact_resume_from_state_dict(device, make):
    params, loss, _, _ = _problem(device, seed=2)
    opt = make(params)
    sched = S.get_cosine_schedule_with_warmup(opt, 2, 10)
    for _ in range(3):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
    snap_p = [npa(p) for p in params]
    snap_o, snap_s = _clone_state(opt.state_dict()), _clone_state(sched.state_dict())
    for _ in range(4):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
    final = [npa(p) for p in params]

    params2, loss2, _, _ = _problem(device, seed=2)
    with flame.no_grad():
        for p, a in zip(params2, snap_p):
            p.copy_(flame.tensor(a, device=device))
    opt2 = make(params2)
    sched2 = S.get_cosine_schedule_with_warmup(opt2, 2, 10)
    opt2.load_state_dict(snap_o)
    sched2.load_state_dict(snap_s)
    assert opt2.param_groups[0]["lr"] == snap_s["_last_lr"][0] == snap_o["param_groups"][0]["lr"]
    for _ in range(4):
        opt2.zero_grad()
        loss2().backward()
        opt2.step()
        sched2.step()
    for a, b in zip(final, [npa(p) for p in params2]):
        np.testing.assert_array_equal(a, b)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_optimizer_state_survives_a_safetensors_roundtrip(tmp_path, device):
    params, loss, _, _ = _problem(device, seed=4)
    opt = nn.optim.AdamW(params, lr=0.01)
    _run(opt, params, loss, steps=2)
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, flame.Tensor)}
    io.save_file(tensors, tmp_path / "opt.safetensors")
    loaded = io.load_file(tmp_path / "opt.safetensors", device=device)
    state = {i: {"step": st["step"], **{k: loaded[f"{i}.{k}"] for k in st if k != "step"}}
             for i, st in sd["state"].items()}
    params2 = [nn.Parameter(p.detach().clone()) for p in params]
    opt2 = nn.optim.AdamW(params2, lr=0.01)
    opt2.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    for p, q in zip(params, params2):
        p.grad = flame.ones_like(p)
        q.grad = flame.ones_like(q)
    opt.step()
    opt2.step()
    for p, q in zip(params, params2):
        np.testing.assert_array_equal(npa(p), npa(q))


def test_optimizers_pool_their_gradients(device):
    params, loss, _, _ = _problem(device, seed=6)
    nn.optim.SGD(params, lr=0.1)
    assert all(grad_pool.is_registered(p) for p in params)
    loss().backward()
    assert params[0].grad.data_ptr() == grad_pool.flat_buffer_of(params[0]).data_ptr()


def test_optimizer_argument_errors(device):
    p = nn.Parameter(flame.zeros(2, device=device))
    with pytest.raises(ValueError, match="empty parameter list"):
        nn.optim.SGD([], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        nn.optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)
    with pytest.raises(ValueError, match="non-leaf"):
        nn.optim.SGD([p * 2], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        nn.optim.SGD([p], lr=0.1, nesterov=True)
    opt = nn.optim.Adam([p], lr=0.1)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_param_groups_have_their_own_hyperparameters(device):
    a = nn.Parameter(flame.ones(3, dtype=flame.float64, device=device))
    b = nn.Parameter(flame.ones(3, dtype=flame.float64, device=device))
    opt = nn.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    np.testing.assert_allclose(npa(a), 0.9)
    np.testing.assert_allclose(npa(b), 0.5)


# ----------------------------------------------------------------------------- AdamW8bit
def test_blockwise_quantisation_error_is_bounded_by_the_code_book():
    rng = np.random.default_rng(0)
    for signed in (True, False):
        code = dynamic_map(signed)
        assert code.size == 256 and np.all(np.diff(code) >= 0) and code[-1] == 1.0 and 0.0 in code
        assert -1.0 < code.min() < -0.99 if signed else code.min() == 0.0
        x = (rng.standard_normal(3000) * np.exp(rng.uniform(-8, 0, 3000))).astype(np.float32)
        x = x if signed else x * x
        codes, absmax = quantize_blockwise(x, code, 256)
        assert codes.dtype == np.uint8 and absmax.shape == (12,)
        y = dequantize_blockwise(codes, absmax, code, 256)
        worst = max(np.diff(code).max() / 2, 1.0 + code.min())  # between two codes, or below the lowest one
        bound = np.repeat(absmax, 256)[:3000] * worst * (1 + 1e-5)
        assert np.all(np.abs(y - x) <= bound)
        np.testing.assert_allclose(np.abs(x).reshape(-1)[:2816].reshape(11, 256).max(1), absmax[:11], rtol=1e-6)


def test_adamw8bit_tracks_adamw(device):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    W_true = rng.standard_normal((64, 128)).astype(np.float32) * 0.3
    Y = X @ W_true + 0.01 * rng.standard_normal((256, 128)).astype(np.float32)
    Xt, Yt = flame.tensor(X, device=device), flame.tensor(Y, device=device)
    w0 = (rng.standard_normal((64, 128)) * 0.1).astype(np.float32)
    finals, losses = [], []
    for cls, kw in ((nn.optim.AdamW, {}), (nn.optim.AdamW8bit, {"min_8bit_size": 0})):
        w = nn.Parameter(flame.tensor(w0, device=device))
        opt = cls([w], lr=0.01, weight_decay=0.01, **kw)
        curve = []
        for i in range(150):
            opt.zero_grad()
            loss = nn.functional.mse_loss(Xt @ w, Yt)
            loss.backward()
            opt.step()
            if i % 50 == 49:
                curve.append(float(loss))
        finals.append(npa(w))
        losses.append(np.array(curve))
        if cls is nn.optim.AdamW8bit:
            st = opt.state[w]
            assert st["exp_avg"].dtype == flame.uint8 and st["exp_avg_sq"].dtype == flame.uint8
    moved = np.linalg.norm(finals[0] - w0)
    assert np.linalg.norm(finals[1] - finals[0]) < 0.05 * moved
    assert np.all(losses[1] < 1.25 * losses[0])  # the 8-bit loss curve stays within 25% of AdamW's
    assert losses[0][-1] < 1e-3 * float(np.mean(Y ** 2)) and losses[1][-1] < 1e-3 * float(np.mean(Y ** 2))


# ----------------------------------------------------------------------------- schedules
def _opt(device, lr=1.0):
    return nn.optim.SGD([nn.Parameter(flame.zeros(1, device=device))], lr=lr)


def _lrs(sched, n):
    out = [sched.get_last_lr()[0]]
    for _ in range(n):
        sched.optimizer.step()
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out


def test_schedules_follow_their_formulas(device):
    np.testing.assert_allclose(_lrs(S.LambdaLR(_opt(device, 2.0), lambda s: 0.5 ** s), 4),
                               [2 * 0.5 ** s for s in range(5)])
    np.testing.assert_allclose(_lrs(S.ConstantLR(_opt(device), factor=0.25, total_iters=2), 3), [0.25, 0.25, 1, 1])
    np.testing.assert_allclose(_lrs(S.LinearLR(_opt(device), 0.1, 1.0, total_iters=3), 4),
                               [0.1, 0.4, 0.7, 1.0, 1.0])
    np.testing.assert_allclose(_lrs(S.CosineAnnealingLR(_opt(device), T_max=4, eta_min=0.1), 4),
                               [0.1 + 0.9 * (1 + math.cos(math.pi * s / 4)) / 2 for s in range(5)])
    np.testing.assert_allclose(_lrs(S.get_constant_schedule_with_warmup(_opt(device), 2), 3), [0, 0.5, 1, 1])
    np.testing.assert_allclose(_lrs(S.get_linear_schedule_with_warmup(_opt(device), 2, 6), 6),
                               [0, 0.5, 1, 0.75, 0.5, 0.25, 0])
    cos = _lrs(S.get_cosine_schedule_with_warmup(_opt(device), 1, 5), 5)
    np.testing.assert_allclose(cos, [0, 1] + [0.5 * (1 + math.cos(math.pi * (s - 1) / 4)) for s in range(2, 6)])
    np.testing.assert_allclose(_lrs(S.get_constant_schedule(_opt(device, 0.3)), 2), [0.3] * 3)


def test_scheduler_resume(device):
    a = S.LinearLR(_opt(device), 0.2, 1.0, total_iters=10)
    _lrs(a, 4)
    b = S.LinearLR(_opt(device), 0.2, 1.0, total_iters=10)
    b.load_state_dict(a.state_dict())
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert _lrs(a, 3) == _lrs(b, 3)


# ----------------------------------------------------------------------------- clip_grad_norm_
@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm(device, rng, pooled, norm_type):
    ps = [nn.Parameter(flame.zeros(s, device=device)) for s in ((3, 4), (7,), (2, 2, 2))]
    if pooled:
        grad_pool.register(ps)
    gs = [rng.standard_normal(tuple(p.shape)).astype(np.float32) for p in ps]
    loss = sum((p * flame.tensor(g, device=device)).sum() for p, g in zip(ps, gs))
    loss.backward()
    # pooled gradients are reduced and scaled over their one flat buffer
    assert len(nn.utils.grad_arrays(ps)) == (1 if pooled else 3)
    flat = np.concatenate([g.ravel() for g in gs]).astype(np.float64)
    want = np.abs(flat).max() if norm_type == math.inf else (np.abs(flat) ** norm_type).sum() ** (1 / norm_type)
    total = nn.utils.clip_grad_norm_(ps, max_norm=0.5, norm_type=norm_type)
    assert float(total) == pytest.approx(want, rel=1e-5)
    scale = min(1.0, 0.5 / (want + 1e-6))
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(npa(p.grad), g * scale, rtol=1e-5)
    nn.utils.clip_grad_norm_(ps, max_norm=100.0, norm_type=norm_type)  # no-op above the norm
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(npa(p.grad), g * scale, rtol=1e-5)


def test_clip_grad_norm_nonfinite(device):
    p = nn.Parameter(flame.zeros(3, device=device))
    p.grad = flame.tensor([1.0, float("inf"), 0.0], device=device)
    with pytest.raises(flame.FlameError, match="non-finite"):
        nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert float(nn.utils.clip_grad_norm_([nn.Parameter(flame.zeros(1, device=device))], 1.0)) == 0.0
