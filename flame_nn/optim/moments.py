"""What the Adam-family optimizers without a fused kernel share (Adamax, NAdam, RAdam): their argument check, their
first / second moment state, and PyTorch's moment updates."""
from flame_core import as_tensor, backend


def check_args(name, lr, betas, eps, weight_decay, **more):
    """ValueError naming every hyper-parameter unless lr, eps, weight_decay and `more` are >= 0 and betas in [0, 1)."""
    if lr < 0 or eps < 0 or weight_decay < 0 or any(v < 0 for v in more.values()) or \
            not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        extra = "".join(f", {k}={v}" for k, v in more.items())
        raise ValueError(f"{name}: invalid lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}{extra}")


def init_moments(opt, p, second="exp_avg_sq", **extra):
    """p's state: step 0, zero `exp_avg` and zero `second` moment in p's dtype and device, and `extra`."""
    xp = backend.xp_of(p.array)
    st = {"step": 0, "exp_avg": as_tensor(xp.zeros_like(p.array)), second: as_tensor(xp.zeros_like(p.array)),
          **extra}
    opt.state[p] = st
    return st


def update_moments(m, v, g, b1, b2):
    """In place, as PyTorch: m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2."""
    m += (g - m) * (1 - b1)
    v *= b2
    v += (1 - b2) * (g * g)


def prepare(opt, p, g, group):
    """(state, gradient, p's array) for one step of p: weight decay added to the gradient (L2), or with
    `decoupled_weight_decay` the weights scaled by 1 - lr * weight_decay in place instead."""
    decoupled, wd = group["decoupled_weight_decay"], group["weight_decay"]
    st, g = opt._prepare(p, g, group, l2=not decoupled)
    w = p.array
    if wd and decoupled:
        w *= 1 - group["lr"] * wd
    return st, g, w
