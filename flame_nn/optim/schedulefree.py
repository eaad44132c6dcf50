"""Schedule-free AdamW (schedulefree's `AdamWScheduleFree`, its arguments and defaults; Defazio et al. 2024).

The parameters hold y (the gradient point) in train mode and x (the average, what to evaluate and save) in eval
mode; z is the base sequence. Call `train()` before stepping and `eval()` before evaluating or saving, as with the
reference. Per step k (0-based), with sched = (k+1)/warmup_steps during warm-up else 1 and lr = lr * sched:
    v = b2 v + (1 - b2) g^2 ;  u = g / (sqrt(v / (1 - b2^(k+1))) + eps) + wd y
    lr_max = max(lr_max, lr) ; w = (k+1)^r lr_max^weight_lr_power ; c = w / (weight_sum += w)
    y = lerp(y, z, c) + lr (b1 (1 - c) - 1) u ;  z -= lr u
The running scalars (k, weight_sum, lr_max, train_mode) live in the parameter groups, as in the reference.
On the GPU the float32 parameters of a group take one launch per step (flame_core.kernels.optim_multi, the same
roundings); the rest the per-operation path.
"""
from contextlib import contextmanager

from flame_core import as_tensor, backend
from flame_core.autograd import no_grad

from . import multi_tensor as MT
from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device

# group entries that are running state, not hyper-parameters (a resume keeps the checkpoint's)
RUNNING_KEYS = ("k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")


class AdamWScheduleFree(Optimizer):
    running_keys = RUNNING_KEYS
    per_parameter = False  # (see Optimizer.per_parameter)

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0, r=0.0,
                 weight_lr_power=2.0, foreach=None):
        if lr < 0 or eps < 0 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError(f"AdamWScheduleFree: invalid lr={lr}, eps={eps}, weight_decay={weight_decay} or "
                             f"warmup_steps={warmup_steps}")
        if len(betas) != 2 or not (0 < betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamWScheduleFree: betas must be two numbers, beta1 in (0, 1) and beta2 in [0, 1), "
                             f"got {betas}")
        # foreach: accepted for the reference's signature; one code path here computes the same formulas
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, r=r, k=0, warmup_steps=warmup_steps,
                                      train_mode=False, weight_sum=0.0, lr_max=-1.0, scheduled_lr=0.0,
                                      weight_lr_power=weight_lr_power, weight_decay=weight_decay, foreach=foreach))

    def _swap(self, to_train):
        with no_grad():
            for group in self.param_groups:
                if group["train_mode"] == to_train:
                    continue
                b1 = group["betas"][0]
                weight = 1 - b1 if to_train else 1 - 1 / b1
                for p in group["params"]:
                    st = self.state.get(p)
                    if st is not None and "z" in st:
                        w = p.array
                        z = state_on_device(st, p)["z"].array
                        w += (weight * (z - w)).astype(w.dtype, copy=False)
                        p._version[0] += 1
                group["train_mode"] = to_train

    def train(self):
        """Parameters to y, the point where gradients are taken."""
        self._swap(True)

    def eval(self):
        """Parameters to x, the averaged iterate to evaluate and save."""
        self._swap(False)

    def step(self, closure=None):
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError("AdamWScheduleFree: the optimizer is not in train mode when step is called; call "
                               "optimizer.train() before training and optimizer.eval() before evaluating or saving")
        loss = _closure_loss(closure)
        for group in self.param_groups:
            eps, (b1, b2), decay = group["eps"], group["betas"], group["weight_decay"]
            k, r, warmup = group["k"], group["r"], group["warmup_steps"]
            sched = (k + 1) / warmup if k < warmup else 1.0
            bc2 = 1 - b2 ** (k + 1)
            lr = group["scheduled_lr"] = group["lr"] * sched
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = ((k + 1) ** r) * (lr_max ** group["weight_lr_power"])
            weight_sum = group["weight_sum"] = group["weight_sum"] + weight
            ckp1 = weight / weight_sum if weight_sum else 0.0
            done = self._fused_step(group, b2, bc2, eps, decay, ckp1, lr * (b1 * (1 - ckp1) - 1), lr)
            for p, g in grads_of(group):
                if id(p) in done:
                    continue
                y = p.array
                xp = backend.xp_of(y)
                st = self.state.get(p)
                if st is None:
                    st = self.state[p] = {"z": as_tensor(y.copy()), "exp_avg_sq": as_tensor(xp.zeros_like(y))}
                st = state_on_device(st, p)
                z, v = st["z"].array, st["exp_avg_sq"].array
                v *= b2
                v += (1 - b2) * (g * g)
                u = g / (xp.sqrt(v / bc2) + eps)
                if decay:
                    u = u + decay * y
                y += (ckp1 * (z - y)).astype(y.dtype, copy=False)
                y += (lr * (b1 * (1 - ckp1) - 1) * u).astype(y.dtype, copy=False)
                z -= (lr * u).astype(z.dtype, copy=False)
                p._version[0] += 1
            group["k"] = k + 1
        return loss

    def _fused_step(self, group, b2, bc2, eps, decay, ckp1, y_coef, lr):
        """One launch for the group's float32 GPU parameters; returns the ids it updated."""
        if not MT.enabled():
            return ()
        rows, params = MT.gather(self, group, ("z", "exp_avg_sq"),
                                 lambda y: {"z": y.copy(), "exp_avg_sq": backend.xp_of(y).zeros_like(y)})
        if not rows:
            return ()
        MT.kernels.sfadamw_step(MT.table_of(self, rows), beta2=b2, bc2=bc2, eps=eps, decay=decay, ckp1=ckp1,
                                y_coef=y_coef, lr=lr)
        return MT.stepped(params)

    @contextmanager
    def averaged(self):
        """The parameters at x (what to sample with and save) inside the block, then back at exactly the same y
        bits (the y -> x -> y round trip of eval() / train() would round, and so change the training)."""
        if not self.param_groups[0]["train_mode"]:
            yield
            return
        kept = [(p, p.array.copy()) for g in self.param_groups for p in g["params"]]
        self.eval()
        try:
            yield
        finally:
            with no_grad():
                for p, y in kept:
                    p.array[...] = y
                    p._version[0] += 1
            for g in self.param_groups:
                g["train_mode"] = True
