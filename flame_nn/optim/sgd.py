"""SGD with momentum, dampening, Nesterov momentum and (L2) weight decay - PyTorch's update rule."""
from flame_core import as_tensor

from .optimizer import Optimizer, _closure_loss, grads_of, state_on_device


class SGD(Optimizer):
    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False):
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: invalid lr={lr}, momentum={momentum} or weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize))

    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            lr, mom, damp = group["lr"], group["momentum"], group["dampening"]
            wd, nesterov, maximize = group["weight_decay"], group["nesterov"], group["maximize"]
            for p, g in grads_of(group):
                w = p.array
                if maximize:
                    g = -g
                if wd:
                    g = g + wd * w
                if mom:
                    st = state_on_device(self.state.setdefault(p, {}), p)
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        buf = st["momentum_buffer"] = as_tensor(g.copy())
                    else:
                        b = buf.array
                        b *= mom
                        b += (1 - damp) * g
                    g = g + mom * buf.array if nesterov else buf.array
                w -= (lr * g).astype(w.dtype, copy=False)
                p._version[0] += 1
        return loss
