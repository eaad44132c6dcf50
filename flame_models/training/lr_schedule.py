"""The learning-rate schedule a config names (train.lr_scheduler, its warmup and parameters), made for an optimizer
whose groups start at their own rates. Every schedule is a closed form of the step, so one made `at_step` (a resume)
is the same as one stepped that far."""
import flame_nn


def make_scheduler(optimizer, train, lrs, at_step=None):
    """The schedule of `train` (config.TrainConfig) for `optimizer`, whose param groups start at `lrs` (one rate per
    group); at_step: positioned there."""
    t, S = train, flame_nn.optim.lr_scheduler
    for g, lr in zip(optimizer.param_groups, lrs):
        g["initial_lr"] = lr
    last = -1 if at_step is None else at_step - 1
    if t.lr_scheduler in ("constant", "constant_with_warmup"):
        return S.get_constant_schedule_with_warmup(optimizer, t.lr_warmup_steps, last_epoch=last)
    if t.lr_scheduler == "linear":
        return S.get_linear_schedule_with_warmup(optimizer, t.lr_warmup_steps, t.steps, last_epoch=last)
    if t.lr_scheduler == "cosine_with_restarts":
        return S.get_cosine_with_hard_restarts_schedule_with_warmup(
            optimizer, t.lr_warmup_steps, t.steps, last_epoch=last, **t.lr_scheduler_params)
    if t.lr_scheduler == "polynomial":
        return S.get_polynomial_decay_schedule_with_warmup(optimizer, t.lr_warmup_steps, t.steps, last_epoch=last,
                                                           **t.lr_scheduler_params)
    return S.get_cosine_schedule_with_warmup(optimizer, t.lr_warmup_steps, t.steps, last_epoch=last)
