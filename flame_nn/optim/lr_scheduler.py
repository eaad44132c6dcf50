"""Learning-rate schedules (PyTorch names): LambdaLR, ConstantLR, LinearLR (linear warm-up), CosineAnnealingLR, and
the diffusers-style factories get_{constant,constant_with_warmup,linear,cosine}_schedule(_with_warmup).

Every schedule is a closed form of the step count, so `load_state_dict` (which restores `last_epoch`) resumes
exactly.
"""
import math


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
        self.last_epoch += 1
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self):
        return self._last_lr

    def state_dict(self):
        return {k: v for k, v in self.__dict__.items() if k != "optimizer" and not callable(v)
                and k != "lr_lambdas"}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)
        for g, lr in zip(self.optimizer.param_groups, self._last_lr):
            g["lr"] = lr


class LambdaLR(LRScheduler):
    """lr = base_lr * lr_lambda(step); one lambda, or one per param group."""

    def __init__(self, optimizer, lr_lambda, last_epoch=-1):
        n = len(optimizer.param_groups)
        if isinstance(lr_lambda, (list, tuple)):
            if len(lr_lambda) != n:
                raise ValueError(f"expected {n} lr_lambdas, got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * n
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        return [base * f(self.last_epoch) for base, f in zip(self.base_lrs, self.lr_lambdas)]


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
