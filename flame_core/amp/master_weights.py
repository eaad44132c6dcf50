"""bf16/fp16 training with float32 master weights held by the optimizer.

The model's parameters live in bf16 (half the memory, bf16 matmuls without casts); the optimizer owns a float32
copy of each and updates that. An update smaller than bf16's resolution (lr * grad < 2**-8 * |w|) is lost when
applied to a bf16 weight directly; on the master it accumulates until it shows in the rounded weight.

    opt = MasterWeightOptimizer(model.parameters(), flame_nn.optim.AdamW, lr=1e-4)
    loss.backward()                   # gradients land in the bf16 parameters' .grad
    opt.step()                        # master.grad = float32(param.grad); inner step; param = bf16(master)
    opt.zero_grad()

float32 (and float64) parameters are handed to the inner optimizer as they are (no copy). `state_dict()` carries the
master weights: they are not recoverable from the rounded parameters, so an exact resume needs them.
Gradient accumulation over micro-batches happens in the parameters' .grad dtype (bf16 here); accumulate into a
float32 gradient pool, or keep float32 parameters, when many small micro-batch gradients must sum exactly.
"""
from .. import dtypes as D
from ..errors import ShapeError, fmt_shape

_LOW = (D.bfloat16, D.float16)


class MasterWeightOptimizer:
    def __init__(self, params, optimizer_cls, *, master_dtype=D.float32, **optimizer_kwargs):
        from ..tensor import Tensor
        self.master_dtype = D.dtype(master_dtype)
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            "but got a Tensor")
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self._pairs = []  # (model parameter, master) for every low-precision parameter
        master_groups = []
        for g in groups:
            ps = []
            for p in g["params"]:
                if p.dtype in _LOW:
                    m = p.detach().to(self.master_dtype, copy=True).requires_grad_(True)
                    self._pairs.append((p, m))
                    ps.append(m)
                else:
                    ps.append(p)
            master_groups.append({**g, "params": ps})
        self.optimizer = optimizer_cls(master_groups, **optimizer_kwargs)
        self._synced = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def master_params(self):
        """The float32 masters, in the order of the low-precision parameters they shadow."""
        return [m for _, m in self._pairs]

    def sync_grads(self):
        """master.grad = float32(param.grad) into a persistent buffer (GradScaler.unscale_ calls this first)."""
        for p, m in self._pairs:
            g = p.grad
            if g is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = g.detach().to(self.master_dtype, copy=True)
            else:
                m.grad._data[...] = g._data
                m.grad._version[0] += 1
        self._synced = True

    def step(self, closure=None):
        if not self._synced:
            self.sync_grads()
        ret = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._copy_back()
        self._synced = False
        return ret

    def _copy_back(self):
        for p, m in self._pairs:
            p._data[...] = m._data.astype(p._data.dtype)
            p._version[0] += 1

    def zero_grad(self, set_to_none=True):
        for p, m in self._pairs:
            for t in (p, m):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                elif t.grad._data.flags.c_contiguous and getattr(t.grad._data.flags, "writeable", True):
                    t.grad._data.fill(0)
                else:  # a broadcast (stride-0, read-only) gradient: replace it
                    t.grad = t.grad.detach() * 0
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._synced = False

    def state_dict(self):
        from .. import backend
        return {"optimizer": self.optimizer.state_dict(),
                "master": [backend.to_numpy(m._data).copy() for _, m in self._pairs]}

    def load_state_dict(self, state_dict):
        masters = state_dict["master"]
        if len(masters) != len(self._pairs):
            raise ValueError(f"MasterWeightOptimizer.load_state_dict: {len(masters)} master weights in the state "
                             f"dict, {len(self._pairs)} low-precision parameters here")
        for k, ((p, m), a) in enumerate(zip(self._pairs, masters)):
            if tuple(a.shape) != tuple(m.shape):
                raise ShapeError(f"MasterWeightOptimizer.load_state_dict: master {k} has shape "
                                 f"{fmt_shape(a.shape)}, the parameter has shape {fmt_shape(m.shape)}")
            m._data[...] = m._xp().asarray(a, dtype=m._data.dtype)
            m._version[0] += 1
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._copy_back()

    def __repr__(self):
        return (f"MasterWeightOptimizer({type(self.optimizer).__name__}, {len(self._pairs)} low-precision "
                f"parameters with {self.master_dtype} masters)")
