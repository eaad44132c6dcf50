"""Optimizer base: param groups, per-parameter state, zero_grad, state_dict / load_state_dict (PyTorch layout).

state_dict() = {"state": {index: {name: Tensor | int}}, "param_groups": [{hyper-parameters..., "params": [index]}]}
with parameters numbered in group order, so an optimizer rebuilt over the same parameters resumes exactly.
"""
import contextlib

from flame_core import backend
from flame_core.autograd import no_grad
from flame_core.io import convert
from flame_core.tensor import Tensor

from ..utils import zero_grads

try:
    from flame_core import grad_pool as pool
except ImportError:  # no gradient pool in this build
    pool = None


class Optimizer:
    _state_keep_dtype = ("step",)  # state entries not cast to the parameter dtype on load
    # a step over some of the parameters (`restricted`) updates those as a step over all would: each parameter's
    # update reads its own gradient and state only, and the groups keep no running state a step advances. False
    # where the parameters are coupled (Prodigy's D estimate, schedule-free's weight sum, L-BFGS's history):
    # flame_nn.offload.LayerwiseOptimizer refuses those
    per_parameter = True

    def __init__(self, params, defaults):
        self.defaults = dict(defaults)
        self.state = {}
        self.param_groups = []
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            "but got a Tensor")
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)
        if pool is not None:  # gradients into flat buffers: no allocation per step, fused updates over them
            pool.register([p for g in self.param_groups for p in g["params"] if p.requires_grad])

    def _salts(self):
        """{id(param): its ordinal among the optimizer's parameters, group by group}: the salt of a bfloat16
        parameter's stochastic rounding (flame_core.kernels.stochastic_rounding: AdamW8bit, Adafactor), rebuilt when
        the parameters change (within `restricted`, the ordinals among all of them)."""
        held = self.__dict__.get("_all_params") or [g["params"] for g in self.param_groups]
        ids = tuple(id(q) for ps in held for q in ps)
        got = self.__dict__.get("_salt_map")
        if got is None or got[0] != ids:
            got = self.__dict__["_salt_map"] = (ids, {i: k for k, i in enumerate(ids)})
        return got[1]

    @contextlib.contextmanager
    def restricted(self, subsets):
        """Within the block, group k holds only the parameters `subsets[k]` (a subset of its own, in its order): a
        `step()` then updates those alone, every parameter keeping its state and its stochastic-rounding salt (a
        layer-wise update: flame_nn.offload.LayerwiseOptimizer, for optimizers with `per_parameter`)."""
        if len(subsets) != len(self.param_groups):
            raise ValueError(f"restricted: {len(subsets)} subsets for {len(self.param_groups)} parameter groups")
        if self.__dict__.get("_all_params") is not None:
            raise RuntimeError("restricted: already restricted")
        held = [g["params"] for g in self.param_groups]
        self.__dict__["_all_params"] = held
        try:
            for g, sub in zip(self.param_groups, subsets):
                g["params"] = list(sub)
            yield self
        finally:
            for g, ps in zip(self.param_groups, held):
                g["params"] = ps
            self.__dict__["_all_params"] = None

    def add_param_group(self, group):
        group = dict(group)
        ps = group["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        for p in ps:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in ps) or len({id(p) for p in ps}) != len(ps):
            raise ValueError("some parameters appear in more than one parameter group (or twice in one)")
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        group["params"] = ps
        self.param_groups.append(group)

    def zero_grad(self, set_to_none=True):
        zero_grads([p for g in self.param_groups for p in g["params"]], set_to_none=set_to_none)

    def _indexed(self):
        index = {}
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        return index

    def state_dict(self):
        """References to the live state tensors (clone them to keep a snapshot while training goes on)."""
        index = self._indexed()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        params = {id(p): p for g in self.param_groups for p in g["params"]}
        state = {index[pid]: dict(s) for pid, s in ((id(p), s) for p, s in self.state.items()) if pid in params}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(groups)} parameter groups, the optimizer has "
                             f"{len(self.param_groups)}")
        for i, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError(f"loaded state dict's parameter group {i} has {len(theirs['params'])} parameters, "
                                 f"the optimizer's has {len(mine['params'])}")
        by_index = {}
        for mine, theirs in zip(self.param_groups, groups):
            for p, i in zip(mine["params"], theirs["params"]):
                by_index[int(i)] = p
        new_state = {}
        with no_grad():
            for i, s in state_dict["state"].items():
                p = by_index.get(int(i))
                if p is None:
                    raise ValueError(f"loaded optimizer state refers to parameter index {i}, which no group has")
                new_state[p] = {k: self._cast_state(p, k, v) for k, v in s.items()}
        self.state = new_state
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def _prepare(self, p, g, group, l2=True):
        """(state, gradient) for updating `p` with gradient array `g`: p's state (made by `_init_state` on first use,
        moved to p's device after `Module.to`) with its step counted, and the gradient negated for `maximize` and,
        when `l2`, with weight_decay * p added (PyTorch's coupled weight decay)."""
        st = self.state.get(p)
        st = self._init_state(p, group) if st is None else state_on_device(st, p)
        if group.get("maximize"):
            g = -g
        if l2 and group["weight_decay"]:
            g = g + group["weight_decay"] * p.array
        st["step"] += 1
        return st, g

    def _cast_state(self, p, key, v):
        """A private copy of a loaded state value on p's device (floating state in p's dtype, as PyTorch)."""
        if not isinstance(v, Tensor):
            return v
        dt = p.dtype if (v.dtype.is_floating_point and key not in self._state_keep_dtype) else v.dtype
        out = v.to(device=p.device, dtype=dt)
        return out.clone() if out is v else out

    def step(self, closure=None):
        raise NotImplementedError

    def __repr__(self):
        lines = [type(self).__name__ + " ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for k in sorted(k for k in g if k != "params"):
                lines.append(f"    {k}: {g[k]}")
        return "\n".join(lines) + "\n)"


def reject_unsupported(name, **options):
    """ValueError naming the PyTorch implementation options set (truthy) that FLAME's optimizers cannot honour."""
    bad = [f"{k}={v}" for k, v in options.items() if v]
    if bad:
        raise ValueError(f"{name}: {', '.join(bad)} is not supported (FLAME updates parameter by parameter under "
                         f"no_grad, the step count on the host); leave it at its default")


def _closure_loss(closure):
    if closure is None:
        return None
    from flame_core.autograd import enable_grad
    with enable_grad():
        return closure()


def grads_of(group):
    """(param, grad array) for the parameters of a group that have a gradient."""
    for p in group["params"]:
        g = p._grad
        if g is not None:
            yield p, g.array


def state_on_device(st, p):
    """The state dict of `p` with its arrays moved to p's device (after `Module.to` moved the parameter)."""
    want_cuda = backend.is_cuda_array(p.array)
    for k, v in st.items():
        if isinstance(v, Tensor) and backend.is_cuda_array(v.array) != want_cuda:
            v.set_array_(*convert(v.array, None, p.device, v._f8))
    return st
