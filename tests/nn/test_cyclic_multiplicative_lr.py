"""CyclicLR and MultiplicativeLR against PyTorch's numbers (tests/fixtures/torch_nn/data_sched.json, made by
tests/fixtures/make_data_sched_fixtures.py) and their own formulas; exact resume from state_dict; errors."""
import json
import math
import os

import numpy as np
import pytest
from sched_trace import trace

import flame_core as flame
import flame_nn as nn
from flame_nn.optim import lr_scheduler as S

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "torch_nn", "data_sched.json")


@pytest.fixture(scope="module")
def golden():
    with open(FIX) as f:
        return {r["name"]: r for r in json.load(f)["schedules"]}


def _sgd(groups=1, lr=0.5, momentum=0.9):
    return nn.optim.SGD([{"params": [nn.Parameter(flame.zeros(2))]} for _ in range(groups)], lr=lr, momentum=momentum)


def _adam():
    return nn.optim.Adam([nn.Parameter(flame.zeros(2))], lr=0.5)


def _trace(opt, sched, steps=25, momentum=None):
    return trace(opt, sched, steps, momentum=momentum)


CASES = {
    "cyclic_triangular": (_sgd, lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4), "momentum"),
    "cyclic_triangular2_uneven": (_sgd, lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=3, step_size_down=5,
                                                             mode="triangular2"), "momentum"),
    "cyclic_exp_range": (_sgd, lambda o: S.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="exp_range", gamma=0.9,
                                                    base_momentum=0.7, max_momentum=0.95), "momentum"),
    "cyclic_scale_fn_cycle": (_sgd, lambda o: S.CyclicLR(o, 0.02, 0.2, step_size_up=2, step_size_down=3,
                                                         scale_fn=lambda x: 1 / x, scale_mode="cycle"), "momentum"),
    "cyclic_scale_fn_iterations": (_sgd, lambda o: S.CyclicLR(o, 0.02, 0.2, step_size_up=5,
                                                              scale_fn=lambda x: 0.95 ** x, scale_mode="iterations"),
                                   "momentum"),
    "cyclic_two_groups": (lambda: _sgd(groups=2),
                          lambda o: S.CyclicLR(o, base_lr=[0.01, 0.001], max_lr=[0.1, 0.05], step_size_up=3,
                                               base_momentum=[0.8, 0.85], max_momentum=[0.9, 0.99]), "momentum"),
    "cyclic_adam_beta1": (_adam, lambda o: S.CyclicLR(o, 0.001, 0.01, step_size_up=4, mode="triangular2"), "betas"),
    "cyclic_no_momentum": (_adam, lambda o: S.CyclicLR(o, 0.001, 0.01, step_size_up=6, step_size_down=2,
                                                       cycle_momentum=False), "betas"),
    "multiplicative": (_sgd, lambda o: S.MultiplicativeLR(o, lambda e: 0.95), None),
    "multiplicative_per_group": (lambda: _sgd(groups=2),
                                 lambda o: S.MultiplicativeLR(o, [lambda e: 0.9, lambda e: 1.0 if e % 3 else 0.5]),
                                 None),
    "chained_const_multiplicative": (_sgd, lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.1, total_iters=3),
                                                                         S.MultiplicativeLR(o, lambda e: 0.9)]),
                                     None),
    "sequential_multiplicative_step": (_sgd, lambda o: S.SequentialLR(o, [S.MultiplicativeLR(o, lambda e: 0.8),
                                                                          S.StepLR(o, 2, 0.5)], milestones=[6]),
                                       None),
    "sequential_warmup_multiplicative": (_sgd, lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, 1.0, total_iters=4),
                                                                            S.MultiplicativeLR(o, lambda e: 0.9)],
                                                                        milestones=[4]), None),
    "sequential_step_multiplicative": (_sgd, lambda o: S.SequentialLR(
        o, [S.StepLR(o, 2, 0.5), S.MultiplicativeLR(o, lambda e: 0.8 if e % 2 else 1.0)], milestones=[5]), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_pytorch(golden, name):
    make_opt, make, momentum = CASES[name]
    opt = make_opt()
    lrs, moms = _trace(opt, make(opt), momentum=momentum)
    np.testing.assert_allclose(lrs, golden[name]["lrs"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(moms, golden[name]["momentum"], rtol=1e-12, atol=1e-15)


def _triangular(t, base, top, up, down, scale=lambda cycle, t: 1.0):
    """The lr at step t from the picture: up for `up` steps, down for `down`, the height scaled per cycle."""
    cycle, pos = divmod(t, up + down)
    frac = pos / up if pos <= up else 1 - (pos - up) / down
    return base + (top - base) * frac * scale(cycle + 1, t)


def test_cyclic_formulas_and_momentum_inverse():
    opt = _sgd()
    sched = S.CyclicLR(opt, 0.1, 1.0, step_size_up=3, step_size_down=5, mode="triangular2")
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9  # base_lr, max_momentum
    lrs, moms = _trace(opt, sched, 30, momentum="momentum")
    want = [_triangular(t, 0.1, 1.0, 3, 5, lambda c, t: 0.5 ** (c - 1)) for t in range(30)]
    np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12)
    # momentum moves inversely: max_momentum at base_lr, base_momentum at the peak
    frac = [(lr[0] - 0.1) / 0.9 for lr in lrs]
    np.testing.assert_allclose([m[0] for m in moms], [0.9 - 0.1 * f for f in frac], rtol=1e-12)
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]
    assert opt.param_groups[0]["max_momentum"] == 0.9 and opt.param_groups[0]["base_momentum"] == 0.8

    opt = _sgd()
    lrs, _ = _trace(opt, S.CyclicLR(opt, 0.1, 1.0, step_size_up=4, mode="exp_range", gamma=0.8), 20)
    want = [_triangular(t, 0.1, 1.0, 4, 4, lambda c, t: 0.8 ** t) for t in range(20)]
    np.testing.assert_allclose([x[0] for x in lrs], want, rtol=1e-12)


def test_cyclic_starts_from_base_lr_after_another_schedule():
    opt = _sgd()
    S.StepLR(opt, 2)  # leaves initial_lr = 0.5 in the group
    sched = S.CyclicLR(opt, base_lr=0.1, max_lr=1.0, step_size_up=3)
    assert sched.base_lrs == [0.1] and opt.param_groups[0]["lr"] == 0.1 and sched.get_last_lr() == [0.1]


def test_multiplicative_formula_and_last_epoch():
    opt = _sgd(lr=2.0)
    lrs, _ = _trace(opt, S.MultiplicativeLR(opt, lambda e: 1 / (e + 1)), 8)
    np.testing.assert_allclose([x[0] for x in lrs], [2.0 / math.factorial(t + 1) for t in range(8)], rtol=1e-12)
    # built to resume at last_epoch: the group's lr as it is, then multiplied from step last_epoch + 2 on
    opt = _sgd(lr=0.3)
    opt.param_groups[0]["initial_lr"] = 1.0
    sched = S.MultiplicativeLR(opt, lambda e: e, last_epoch=4)
    assert sched.last_epoch == 5 and sched.get_last_lr() == [0.3]
    sched.step()
    assert sched.get_last_lr() == [pytest.approx(1.8)]


@pytest.mark.parametrize("name", ["cyclic_exp_range", "cyclic_two_groups", "cyclic_adam_beta1",
                                  "cyclic_scale_fn_cycle", "multiplicative_per_group"])
def test_resume_from_state_dict(name):
    make_opt, make, momentum = CASES[name]
    opt = make_opt()
    straight = _trace(opt, make(opt), 20, momentum)
    opt = make_opt()
    sched = make(opt)
    first = _trace(opt, sched, 7, momentum)
    sd = json.loads(json.dumps(sched.state_dict()))  # plain data only
    opt2 = make_opt()
    opt2.load_state_dict(opt.state_dict())
    sched2 = make(opt2)
    sched2.load_state_dict(sd)
    rest = _trace(opt2, sched2, 13, momentum)
    np.testing.assert_allclose(first[0] + rest[0], straight[0], rtol=1e-12)
    np.testing.assert_allclose(first[1] + rest[1], straight[1], rtol=1e-12)


def test_errors():
    opt = _sgd()
    with pytest.raises(ValueError, match="mode is invalid and scale_fn is None"):
        S.CyclicLR(opt, 0.1, 1.0, mode="sine")
    with pytest.raises(ValueError, match="scale_mode must be 'cycle' or 'iterations'"):
        S.CyclicLR(opt, 0.1, 1.0, scale_fn=lambda x: 1.0, scale_mode="epochs")
    with pytest.raises(ValueError, match="step_size_up must be positive"):
        S.CyclicLR(opt, 0.1, 1.0, step_size_up=0)
    with pytest.raises(ValueError, match="expected 1 values for base_lr"):
        S.CyclicLR(opt, [0.1, 0.2], 1.0)
    with pytest.raises(ValueError, match="momentum or beta1"):
        S.CyclicLR(nn.optim.Adagrad([nn.Parameter(flame.zeros(1))]), 0.1, 1.0)
    S.CyclicLR(nn.optim.Adagrad([nn.Parameter(flame.zeros(1))]), 0.1, 1.0, cycle_momentum=False)
    with pytest.raises(ValueError, match="Expected 1 lr_lambdas, but got 2"):
        S.MultiplicativeLR(opt, [lambda e: 1.0, lambda e: 1.0])
    with pytest.raises(TypeError, match="lr_lambda should be a function, but got int"):
        S.MultiplicativeLR(opt, 3)


def test_one_cycle_resume_restores_the_momentum_whatever_the_load_order():
    def fresh():
        p = nn.Parameter(flame.ones(2))
        opt = nn.optim.SGD([p], lr=0.1, momentum=0.9)
        return opt, S.OneCycleLR(opt, max_lr=1.0, total_steps=20)
    opt, sched = fresh()
    for _ in range(7):
        opt.step()
        sched.step()
    want = (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"])
    opt_state, sched_state = opt.state_dict(), sched.state_dict()
    opt2 = nn.optim.SGD([nn.Parameter(flame.ones(2))], lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt_state)                      # the optimizer first, then the schedule is built
    sched2 = S.OneCycleLR(opt2, max_lr=1.0, total_steps=20)
    sched2.load_state_dict(sched_state)
    assert (opt2.param_groups[0]["lr"], opt2.param_groups[0]["momentum"]) == pytest.approx(want, rel=1e-12)


def test_lambda_schedules_save_the_state_of_callable_objects():
    class Decay:
        def __init__(self):
            self.rate = 0.5

        def __call__(self, step):
            return self.rate ** step

    def fresh(rate):
        opt = nn.optim.SGD([nn.Parameter(flame.ones(1))], lr=1.0)
        d = Decay()
        d.rate = rate
        return opt, S.LambdaLR(opt, [d]), d
    opt, sched, _ = fresh(0.9)
    sched.step()
    state = sched.state_dict()
    assert state["lr_lambdas"] == [{"rate": 0.9}]
    opt2, sched2, d2 = fresh(0.1)
    sched2.load_state_dict(state)
    assert d2.rate == 0.9
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.81)
    assert S.LambdaLR(opt, lambda e: 1.0).state_dict()["lr_lambdas"] == [None]
