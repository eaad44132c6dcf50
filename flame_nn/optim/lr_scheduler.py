"""Learning-rate schedules (PyTorch names): LambdaLR, MultiplicativeLR, ConstantLR, LinearLR (linear warm-up),
CosineAnnealingLR, CosineAnnealingWarmRestarts, PolynomialLR, StepLR, MultiStepLR, ExponentialLR, CyclicLR,
OneCycleLR, ReduceLROnPlateau, SequentialLR, ChainedScheduler, and the diffusers-style factories
get_{constant,constant_with_warmup,linear,cosine}_schedule(_with_warmup),
get_cosine_with_hard_restarts_schedule_with_warmup and get_polynomial_decay_schedule_with_warmup (transformers).

Every schedule but MultiplicativeLR is a closed form of the step count, so `load_state_dict` (which restores
`last_epoch`) resumes exactly; MultiplicativeLR multiplies its last lr, which load_state_dict restores. ChainedScheduler
multiplies its schedules' factors (lr = base_lr * prod_i lr_i / base_lr): what PyTorch's recursive chaining gives for
the multiplicative schedules (StepLR, MultiStepLR, ExponentialLR, ConstantLR, LinearLR, LambdaLR, MultiplicativeLR);
ReduceLROnPlateau reacts to a metric and is its own class.
"""
import math
import types
import warnings
from bisect import bisect_right


class LRScheduler:
    def __init__(self, optimizer, last_epoch=-1):
        self.optimizer = optimizer
        for i, g in enumerate(optimizer.param_groups):
            if last_epoch == -1:
                g.setdefault("initial_lr", g["lr"])
            elif "initial_lr" not in g:
                raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming")
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def factor(self, step):
        """lr / base_lr at `step` (schedules override this or get_lr)."""
        raise NotImplementedError

    def get_lr(self):
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def step(self):
        self._step_to(self.last_epoch + 1)

    def _restart(self):
        """SequentialLR's start of this scheduler at its milestone (PyTorch's step(0))."""
        self._step_to(0)

    def _step_to(self, epoch):
        self.last_epoch = epoch
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        """The schedule's position; of lr_lambdas (LambdaLR, MultiplicativeLR) only the attributes of callable
        objects (functions are not saved), as PyTorch's."""
        state = {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v) and k != "lr_lambdas"}
        if "lr_lambdas" in self.__dict__:
            state["lr_lambdas"] = [None if isinstance(f, types.FunctionType) else dict(vars(f))
                                   for f in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        for f, attrs in zip(getattr(self, "lr_lambdas", ()), state.pop("lr_lambdas", ())):
            if attrs is not None:
                vars(f).update(attrs)
        self.__dict__.update(state)
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr


def _lambdas(optimizer, lr_lambda):
    """One function per param group: `lr_lambda` for each, or the list of them (lambdas are not saved in a
    state_dict)."""
    n = len(optimizer.param_groups)
    if isinstance(lr_lambda, (list, tuple)):
        if len(lr_lambda) != n:
            raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
        lambdas = list(lr_lambda)
    else:
        lambdas = [lr_lambda] * n
    for f in lambdas:
        if not callable(f):
            raise TypeError(f"lr_lambda should be a function, but got {type(f).__name__}")
    return lambdas


class LambdaLR(LRScheduler):
    """lr = base_lr * lr_lambda(step); one lambda, or one per param group."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        self.lr_lambdas = _lambdas(optimizer, lr_lambda)
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base * f(self.last_epoch) for base, f in zip(self.base_lrs, self.lr_lambdas)]


class MultiplicativeLR(LRScheduler):
    """Each step multiplies the lr by lr_lambda(step) (one lambda, or one per param group): lr at step t = base_lr *
    prod_{k=1..t} lr_lambda(k), as PyTorch's. It multiplies the lr it set last (not one written into the param group
    by hand since), so that it composes in ChainedScheduler; restarted at its milestone in SequentialLR it continues
    from the param group's lr (the previous scheduler's last) times lr_lambda(0), and built with last_epoch >= 0 it
    starts from the param group's lr, as PyTorch's."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        self.lr_lambdas = _lambdas(optimizer, lr_lambda)
        self._started = False
        super().__init__(optimizer, last_epoch)
        self._started = True

    def get_lr(self):
        if self.last_epoch == 0:    # built, or SequentialLR's first step (a milestone's is _restart)
            return list(self.base_lrs)
        if not self._started:       # built resumed (last_epoch >= 0)
            return [g["lr"] for g in self.optimizer.param_groups]
        return [lr * f(self.last_epoch) for lr, f in zip(self._last_lr, self.lr_lambdas)]

    def _restart(self):
        """At its SequentialLR milestone: from the param group's lr (the previous scheduler's last) times
        lr_lambda(0), as PyTorch's step(0)."""
        self.last_epoch = 0
        lrs = [g["lr"] * f(0) for g, f in zip(self.optimizer.param_groups, self.lr_lambdas)]
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = lrs


class ConstantLR(LRScheduler):
    """lr = base_lr * factor for the first total_iters steps, then base_lr (PyTorch's ConstantLR)."""

    def __init__(self, optimizer, factor=1.0 / 3, total_iters=5, last_epoch=-1):
        if not 0 <= factor <= 1:
            raise ValueError(f"ConstantLR: factor must be in [0, 1], got {factor}")
        self.factor_, self.total_iters = factor, total_iters
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        return self.factor_ if step < self.total_iters else 1.0


class LinearLR(LRScheduler):
    """Factor goes linearly from start_factor to end_factor over total_iters steps: a linear warm-up."""

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5, last_epoch=-1):
        if not (0 < start_factor <= 1 and 0 <= end_factor <= 1):
            raise ValueError(f"LinearLR: start_factor {start_factor} must be in (0, 1], end_factor {end_factor} "
                             f"in [0, 1]")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        t = min(step, self.total_iters)
        return self.start_factor + (self.end_factor - self.start_factor) * t / max(1, self.total_iters)


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * step / T_max)) / 2 (the closed form)."""

    def __init__(self, optimizer, T_max, eta_min=0.0, last_epoch=-1):
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        c = (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
        return [self.eta_min + (base - self.eta_min) * c for base in self.base_lrs]


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine annealing restarted every T_i steps, T_0 first, each period T_mult times the last (SGDR): lr = eta_min +
    (base_lr - eta_min) (1 + cos(pi T_cur / T_i)) / 2, T_cur the steps since the last restart (closed form)."""

    def __init__(self, optimizer, T_0, T_mult=1, eta_min=0.0, last_epoch=-1):
        if not isinstance(T_0, int) or T_0 <= 0:
            raise ValueError(f"CosineAnnealingWarmRestarts: T_0 must be a positive integer, got {T_0!r}")
        if not isinstance(T_mult, int) or T_mult < 1:
            raise ValueError(f"CosineAnnealingWarmRestarts: T_mult must be an integer >= 1, got {T_mult!r}")
        self.T_0, self.T_mult, self.eta_min = T_0, T_mult, eta_min
        super().__init__(optimizer, last_epoch)

    def _position(self, step):
        """(T_cur, T_i) at `step`."""
        if self.T_mult == 1:
            return step % self.T_0, self.T_0
        if step < self.T_0:
            return step, self.T_0
        n = int(math.log(step / self.T_0 * (self.T_mult - 1) + 1, self.T_mult))   # restarts so far (float: +-1)
        start = lambda k: self.T_0 * (self.T_mult ** k - 1) // (self.T_mult - 1)  # noqa: E731  (period k's step)
        while start(n) > step:
            n -= 1
        while start(n + 1) <= step:
            n += 1
        return step - start(n), self.T_0 * self.T_mult ** n

    def get_lr(self):
        t_cur, t_i = self._position(self.last_epoch)
        c = (1 + math.cos(math.pi * t_cur / t_i)) / 2
        return [self.eta_min + (base - self.eta_min) * c for base in self.base_lrs]


class PolynomialLR(LRScheduler):
    """lr = base_lr * (1 - min(step, total_iters) / total_iters) ** power (closed form)."""

    def __init__(self, optimizer, total_iters=5, power=1.0, last_epoch=-1):
        if total_iters <= 0:
            raise ValueError(f"PolynomialLR: total_iters must be positive, got {total_iters!r}")
        self.total_iters, self.power = total_iters, power
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        return (1.0 - min(self.total_iters, step) / self.total_iters) ** self.power


class StepLR(LRScheduler):
    """lr = base_lr * gamma ** (step // step_size)."""

    def __init__(self, optimizer, step_size, gamma=0.1, last_epoch=-1):
        if int(step_size) < 1:
            raise ValueError(f"StepLR: step_size must be a positive integer, got {step_size}")
        self.step_size, self.gamma = int(step_size), gamma
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        return self.gamma ** (step // self.step_size)


class MultiStepLR(LRScheduler):
    """lr = base_lr * gamma ** (number of milestones <= step); a milestone listed twice counts twice."""

    def __init__(self, optimizer, milestones, gamma=0.1, last_epoch=-1):
        self.milestones, self.gamma = sorted(int(m) for m in milestones), gamma
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        return self.gamma ** bisect_right(self.milestones, step)


class ExponentialLR(LRScheduler):
    """lr = base_lr * gamma ** step."""

    def __init__(self, optimizer, gamma, last_epoch=-1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def factor(self, step):
        return self.gamma ** step


def _per_group(name, optimizer, value):
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"expected {n} values for {name}, got {len(value)}")
        return list(value)
    return [value] * n


def _uses_beta1(optimizer):
    """Whether the momentum a schedule cycles is betas[0] (Adam and kin) rather than `momentum` (SGD, RMSprop)."""
    if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
        raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
    return "betas" in optimizer.defaults


def _set_momentum(group, use_beta1, value):
    if use_beta1:
        group["betas"] = (value,) + tuple(group["betas"][1:])
    else:
        group["momentum"] = value


class CyclicLR(LRScheduler):
    """The cyclical learning rate policy (PyTorch's CyclicLR; step it after every batch): the lr climbs from base_lr
    to max_lr over step_size_up steps, comes back over step_size_down (default: step_size_up), and so on; the
    amplitude max_lr - base_lr is scaled by 1 ('triangular'), 1 / 2^(cycle - 1) ('triangular2') or gamma^step
    ('exp_range'), or by scale_fn(cycle) / scale_fn(step) (scale_mode 'cycle' / 'iterations') when scale_fn is given
    (then mode and gamma are not used). With cycle_momentum the momentum (or beta1) moves inversely, from
    max_momentum at base_lr to base_momentum at max_lr. Constructing it sets each group's lr to base_lr."""

    def __init__(self, optimizer, base_lr, max_lr, step_size_up=2000, step_size_down=None, mode="triangular",
                 gamma=1.0, scale_fn=None, scale_mode="cycle", cycle_momentum=True, base_momentum=0.8,
                 max_momentum=0.9, last_epoch=-1):
        base_lrs = _per_group("base_lr", optimizer, base_lr)
        if last_epoch == -1:
            for lr, g in zip(base_lrs, optimizer.param_groups):
                g["lr"] = lr
        self.max_lrs = _per_group("max_lr", optimizer, max_lr)
        up = float(step_size_up)
        down = float(step_size_down) if step_size_down is not None else up
        if not (up > 0 and down >= 0):
            raise ValueError(f"CyclicLR: step_size_up must be positive and step_size_down non-negative, got "
                             f"{step_size_up} and {step_size_down}")
        self.total_size, self.step_ratio = up + down, up / (up + down)
        if mode not in ("triangular", "triangular2", "exp_range") and scale_fn is None:
            raise ValueError("mode is invalid and scale_fn is None")
        if scale_mode not in ("cycle", "iterations"):
            raise ValueError(f"scale_mode must be 'cycle' or 'iterations', got {scale_mode!r}")
        self.mode, self.gamma, self._scale_fn_custom = mode, gamma, scale_fn
        self.scale_mode = scale_mode if scale_fn is not None else "iterations" if mode == "exp_range" else "cycle"
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.use_beta1 = _uses_beta1(optimizer)
            self.base_momentums = _per_group("base_momentum", optimizer, base_momentum)
            self.max_momentums = _per_group("max_momentum", optimizer, max_momentum)
            if last_epoch == -1:
                for mx, base, g in zip(self.max_momentums, self.base_momentums, optimizer.param_groups):
                    _set_momentum(g, self.use_beta1, mx)
                    g["max_momentum"], g["base_momentum"] = mx, base
        super().__init__(optimizer, last_epoch)
        if self.base_lrs != base_lrs:  # a group kept the initial_lr of an earlier schedule: start from base_lr
            self.base_lrs = base_lrs
            self._step_to(self.last_epoch)

    def scale_fn(self, x):
        """The amplitude's scale at cycle (or step) x."""
        if self._scale_fn_custom is not None:
            return self._scale_fn_custom(x)
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / (2.0 ** (x - 1))
        return self.gamma ** x

    def get_lr(self):
        cycle = math.floor(1 + self.last_epoch / self.total_size)
        x = 1.0 + self.last_epoch / self.total_size - cycle  # the position in the cycle, in [0, 1)
        height = x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)
        scale = self.scale_fn(cycle if self.scale_mode == "cycle" else self.last_epoch)
        if self.cycle_momentum:
            for g, base, mx in zip(self.optimizer.param_groups, self.base_momentums, self.max_momentums):
                _set_momentum(g, self.use_beta1, mx - (mx - base) * height * scale)
        return [base + (mx - base) * height * scale for base, mx in zip(self.base_lrs, self.max_lrs)]

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.cycle_momentum:  # the momentum at last_epoch again (building the schedule set max_momentum)
            self.get_lr()


class OneCycleLR(LRScheduler):
    """The 1cycle policy (PyTorch's OneCycleLR): lr rises from max_lr / div_factor to max_lr over the first
    pct_start of total_steps, then anneals ('cos' or 'linear') to initial_lr / final_div_factor; three_phase=True
    first comes back down to the initial lr symmetrically, then anneals to the minimum. With cycle_momentum the
    momentum (SGD, RMSprop) or beta1 (Adam) moves inversely between max_momentum and base_momentum. Stepping past
    total_steps raises."""

    def __init__(self, optimizer, max_lr, total_steps=None, epochs=None, steps_per_epoch=None, pct_start=0.3,
                 anneal_strategy="cos", cycle_momentum=True, base_momentum=0.85, max_momentum=0.95, div_factor=25.0,
                 final_div_factor=1e4, three_phase=False, last_epoch=-1):
        if total_steps is not None:
            if not isinstance(total_steps, int) or total_steps <= 0:
                raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
            self.total_steps = total_steps
        elif epochs is not None and steps_per_epoch is not None:
            if not isinstance(epochs, int) or epochs <= 0:
                raise ValueError(f"Expected positive integer epochs, but got {epochs}")
            if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
                raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
        self.anneal_strategy, self.three_phase = anneal_strategy, three_phase
        n = self.total_steps
        if three_phase:
            self._phases = [(float(pct_start * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                            (float(2 * pct_start * n) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                            (n - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            self._phases = [(float(pct_start * n) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                            (n - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        max_lrs = _per_group("max_lr", optimizer, max_lr)
        if last_epoch == -1:
            for m, g in zip(max_lrs, optimizer.param_groups):
                g["initial_lr"] = m / div_factor
                g["max_lr"] = m
                g["min_lr"] = g["initial_lr"] / final_div_factor
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self.use_beta1 = _uses_beta1(optimizer)
            if last_epoch == -1:
                for mx, base, g in zip(_per_group("max_momentum", optimizer, max_momentum),
                                       _per_group("base_momentum", optimizer, base_momentum), optimizer.param_groups):
                    _set_momentum(g, self.use_beta1, mx)
                    g["max_momentum"], g["base_momentum"] = mx, base
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self):
        t = self.last_epoch
        if t > self.total_steps:
            raise ValueError(f"Tried to step {t} times. The specified number of total steps is {self.total_steps}")
        lrs = []
        for g in self.optimizer.param_groups:
            start = 0.0
            for i, (end, lr0, lr1, m0, m1) in enumerate(self._phases):
                if t <= end or i == len(self._phases) - 1:
                    pct = (t - start) / (end - start)
                    lrs.append(self._anneal(g[lr0], g[lr1], pct))
                    if self.cycle_momentum:
                        _set_momentum(g, self.use_beta1, self._anneal(g[m0], g[m1], pct))
                    break
                start = end
        return lrs

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.cycle_momentum:   # the momentum at last_epoch again (building the schedule set max_momentum)
            self.get_lr()


class ReduceLROnPlateau(LRScheduler):
    """Multiply the lr by `factor` (not below min_lr, and only by more than eps) once the metric given to
    `step(metrics)` has not improved for more than `patience` steps; then wait `cooldown` steps. Improvement: below
    best * (1 - threshold) ('min', 'rel'), best - threshold ('min', 'abs'), above best * (1 + threshold) ('max',
    'rel') or best + threshold ('max', 'abs')."""

    def __init__(self, optimizer, mode="min", factor=0.1, patience=10, threshold=1e-4, threshold_mode="rel",
                 cooldown=0, min_lr=0, eps=1e-8):
        if factor >= 1.0:
            raise ValueError("Factor should be < 1.0.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode {mode} is unknown!")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"threshold mode {threshold_mode} is unknown!")
        self.optimizer, self.factor = optimizer, factor
        if isinstance(min_lr, (list, tuple)):
            self.default_min_lr, self.min_lrs = None, _per_group("min_lr", optimizer, min_lr)
        else:
            self.default_min_lr, self.min_lrs = min_lr, [min_lr] * len(optimizer.param_groups)
        self.patience, self.cooldown, self.eps = patience, cooldown, eps
        self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode
        self.mode_worse = math.inf if mode == "min" else -math.inf
        self.last_epoch = 0
        self._last_lr = [g["lr"] for g in optimizer.param_groups]
        self._reset()

    def _reset(self):
        self.best = self.mode_worse
        self.cooldown_counter = 0
        self.num_bad_epochs = 0

    @property
    def in_cooldown(self):
        return self.cooldown_counter > 0

    def is_better(self, a, best):
        if self.mode == "min":
            return a < best * (1.0 - self.threshold) if self.threshold_mode == "rel" else a < best - self.threshold
        return a > best * (1.0 + self.threshold) if self.threshold_mode == "rel" else a > best + self.threshold

    def step(self, metrics, epoch=None):
        current = float(metrics)
        if epoch is not None:
            warnings.warn("The epoch parameter in `scheduler.step()` was not necessary and is being deprecated where "
                          "possible. Please use `scheduler.step()` to step the scheduler.", UserWarning, stacklevel=2)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        if self.is_better(current, self.best):
            self.best = current
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.in_cooldown:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad steps in cooldown do not count
        if self.num_bad_epochs > self.patience:
            self._reduce_lr()
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _reduce_lr(self):
        groups = self.optimizer.param_groups
        if len(groups) != len(self.min_lrs):
            if self.default_min_lr is None:
                raise RuntimeError(f"The number of param groups in the optimizer ({len(groups)}) differs from when "
                                   f"ReduceLROnPlateau was initialized ({len(self.min_lrs)}); set min_lrs to match")
            self.min_lrs = [self.default_min_lr] * len(groups)
        for g, min_lr in zip(groups, self.min_lrs):
            old = float(g["lr"])
            new = max(old * self.factor, min_lr)
            if old - new > self.eps:
                g["lr"] = new


def _check_members(owner, optimizer, schedulers):
    if len(schedulers) < 1:
        raise ValueError(f"{owner} expects at least one scheduler")
    for i, s in enumerate(schedulers):
        if not hasattr(s, "optimizer"):
            raise TypeError(f"{owner}: the scheduler at index {i} has no `optimizer` attribute")
        if isinstance(s, ReduceLROnPlateau):
            raise ValueError(f"{owner} does not support ReduceLROnPlateau (its step needs the metric), got one at "
                             f"index {i}")
        if s.optimizer is not optimizer:
            raise ValueError(f"{owner} expects all schedulers to belong to the same optimizer, but the scheduler "
                             f"{type(s).__name__} at index {i} has another one")


class _Composite(LRScheduler):
    def state_dict(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict):
        state = dict(state_dict)
        members = state.pop("_schedulers")
        for s, sd in zip(self._schedulers, members):
            s.load_state_dict(sd)
        super().load_state_dict(state)


class SequentialLR(_Composite):
    """schedulers[i] runs from milestones[i - 1] on, restarted at its step 0 there (PyTorch's SequentialLR)."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch=-1):
        _check_members("SequentialLR", optimizer, schedulers)
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR expects one milestone fewer than schedulers, got {len(schedulers)} "
                             f"schedulers and {len(milestones)} milestones")
        self._schedulers, self._milestones = list(schedulers), list(milestones)
        self.optimizer = optimizer
        self.last_epoch = last_epoch + 1
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"]
        for s in self._schedulers:  # undo the step each scheduler took when it was built
            s.last_epoch -= 1
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first.step()
        self._last_lr = first.get_last_lr()

    def step(self):
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        s = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            s._restart()
        else:
            s.step()
        self._last_lr = s.get_last_lr()


class ChainedScheduler(_Composite):
    """Steps every scheduler at each step; the lr is base_lr times the product of their factors."""

    def __init__(self, schedulers, optimizer=None):
        optimizer = optimizer if optimizer is not None else schedulers[0].optimizer if schedulers else None
        _check_members("ChainedScheduler", optimizer, schedulers)
        self._schedulers, self.optimizer = list(schedulers), optimizer
        self._combine()

    def _combine(self):
        lrs = []
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g["initial_lr"]
            for s in self._schedulers:
                base = s.base_lrs[i]
                lr = lr * (s.get_last_lr()[i] / base) if base else 0.0
            g["lr"] = lr
            lrs.append(lr)
        self._last_lr = lrs

    def step(self):
        for s in self._schedulers:
            s.step()
        self._combine()


def get_constant_schedule(optimizer, last_epoch=-1):
    return LambdaLR(optimizer, lambda _: 1.0, last_epoch)


def get_constant_schedule_with_warmup(optimizer, num_warmup_steps, last_epoch=-1):
    def f(step):
        return step / max(1.0, num_warmup_steps) if step < num_warmup_steps else 1.0
    return LambdaLR(optimizer, f, last_epoch)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def f(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return LambdaLR(optimizer, f, last_epoch)


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles=0.5,
                                    last_epoch=-1):
    def f(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
    return LambdaLR(optimizer, f, last_epoch)


def get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps,
                                                       num_cycles=1, last_epoch=-1):
    """transformers' `cosine_with_restarts`: `num_cycles` cosine decays from the base lr to 0, each restarting at
    the base lr, after a linear warm-up; 0 from num_training_steps on."""
    def f(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))
    return LambdaLR(optimizer, f, last_epoch)


def get_polynomial_decay_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, lr_end=1e-7,
                                              power=1.0, last_epoch=-1):
    """transformers' `polynomial`: (lr_init - lr_end) * (1 - progress)^power + lr_end after a linear warm-up, then
    lr_end; lr_init is the optimizer's default lr, as in transformers."""
    lr_init = optimizer.defaults["lr"]
    if lr_init is None or not lr_init > lr_end:
        raise ValueError(f"polynomial schedule: lr_end ({lr_end}) must be smaller than the initial lr ({lr_init})")

    def f(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        if step > num_training_steps:
            return lr_end / lr_init
        pct_remaining = 1 - (step - num_warmup_steps) / (num_training_steps - num_warmup_steps)
        return ((lr_init - lr_end) * pct_remaining ** power + lr_end) / lr_init
    return LambdaLR(optimizer, f, last_epoch)
