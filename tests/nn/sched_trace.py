"""The lr schedules' trace, shared by the schedule tests and the fixture script that records PyTorch's
(tests/fixtures/make_data_sched_fixtures.py): the same loop on FLAME's and torch's optimizers."""


def trace(opt, sched, steps, metrics=None, momentum=None):
    """(lrs, moms): each param group's lr (and with `momentum` its momentum, or Adam's beta1 for "beta1") before each
    of `steps` steps of opt.step() then sched.step() (sched.step(metrics[i]) when metrics are given)."""
    lrs, moms = [], []
    for i in range(steps):
        lrs.append([g["lr"] for g in opt.param_groups])
        if momentum:
            moms.append([g["momentum"] if momentum == "momentum" else g["betas"][0] for g in opt.param_groups])
        opt.step()
        sched.step(metrics[i]) if metrics is not None else sched.step()
    return lrs, moms
