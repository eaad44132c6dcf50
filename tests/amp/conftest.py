"""A minimal SGD with momentum (flame_core tests cannot use flame_nn.optim): param_groups, step, zero_grad,
state_dict / load_state_dict, the interface GradScaler and MasterWeightOptimizer rely on."""
import pytest

from flame_core import backend


class SGD:
    def __init__(self, params, lr, momentum=0.0):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{"lr": lr, "momentum": momentum, **g} for g in groups]
        self.state = {}
        self.steps = 0

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def step(self, closure=None):
        self.steps += 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                d = p.grad._data
                if g["momentum"]:
                    st = self.state.setdefault(id(p), {})
                    buf = st.get("buf")
                    st["buf"] = buf = d.copy() if buf is None else buf * g["momentum"] + d
                    d = buf
                p._data -= (g["lr"] * d).astype(p._data.dtype)
                p._version[0] += 1
        return "stepped"

    def zero_grad(self, set_to_none=True):
        for p in self._params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None and getattr(p.grad._data.flags, "writeable", True):  # CuPy has no such flag
                p.grad._data.fill(0)
            elif p.grad is not None:
                p.grad = p.grad.detach() * 0   # a leaf's .grad may be a read-only broadcast view

    def state_dict(self):
        ps = self._params()
        return {"state": {i: {"buf": backend.to_numpy(self.state[id(p)]["buf"]).copy()} for i, p in enumerate(ps)
                          if id(p) in self.state},
                "param_groups": [{"lr": g["lr"], "momentum": g["momentum"]} for g in self.param_groups]}

    def load_state_dict(self, sd):
        ps = self._params()
        self.state = {id(ps[i]): {"buf": ps[i]._xp().asarray(s["buf"])} for i, s in sd["state"].items()}
        for g, s in zip(self.param_groups, sd["param_groups"]):
            g.update(s)


@pytest.fixture
def sgd():
    return SGD
