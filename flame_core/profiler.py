"""Per-op time profile of the tape: where a step's host and device time goes.

    with flame_core.profiler.profile() as prof:
        loss = model(x).square().mean(); loss.backward()
    print(prof.table())                      # op, calls, host ms, device ms (forward and backward rows)

While active, every `Function` subclass's forward and backward is wrapped: host time with perf_counter, device time
with a pair of CUDA events on the current stream (no synchronisation inside the step; the events are read when the
context closes). Nested ops (an op whose forward calls other ops) count once, under the outermost name. Work outside
Functions (optimizer steps, tensor creation, the autograd engine's own bookkeeping) appears as the gap between the
sum of the rows and the wall time of the region, reported by `table()` too.
"""
import collections
import contextlib
import time

from . import backend
from .autograd.function import Function


def _subclasses(cls):
    out, stack = [], [cls]
    while stack:
        c = stack.pop()
        for s in c.__subclasses__():
            out.append(s)
            stack.append(s)
    return out


class Profile:
    def __init__(self, cuda):
        self.cuda = cuda
        self.records = []          # (name, phase, host_s, (start_event, end_event) | None)
        self.wall_s = 0.0
        self.device_wall_ms = None
        self._depth = 0
        self._patched = []

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, fn_cls, attr, phase):
        original = fn_cls.__dict__[attr]
        raw = original.__func__ if isinstance(original, staticmethod) else original
        name = fn_cls.__name__
        prof = self

        def timed(*args, **kwargs):
            if prof._depth:
                return raw(*args, **kwargs)
            prof._depth += 1
            ev = None
            if prof.cuda:
                cp = backend.cupy
                ev = (cp.cuda.Event(), cp.cuda.Event())
                ev[0].record()
            t = time.perf_counter()
            try:
                return raw(*args, **kwargs)
            finally:
                host = time.perf_counter() - t
                if ev is not None:
                    ev[1].record()
                prof.records.append((name, phase, host, ev))
                prof._depth -= 1

        setattr(fn_cls, attr, staticmethod(timed))
        self._patched.append((fn_cls, attr, original))

    def _install(self):
        for c in _subclasses(Function):
            for attr, phase in (("forward", "fwd"), ("backward", "bwd")):
                if attr in c.__dict__:
                    self._wrap(c, attr, phase)

    def _uninstall(self):
        for c, attr, original in reversed(self._patched):
            setattr(c, attr, original)
        self._patched.clear()

    # ------------------------------------------------------------------ results
    def key_averages(self):
        """{(op, phase): [calls, host_s, device_ms]} (device_ms None without CUDA)."""
        agg = collections.OrderedDict()
        for name, phase, host, ev in self.records:
            row = agg.setdefault((name, phase), [0, 0.0, 0.0 if ev is not None else None])
            row[0] += 1
            row[1] += host
            if ev is not None:
                row[2] += backend.cupy.cuda.get_elapsed_time(ev[0], ev[1])
        return agg

    def table(self, sort_by="device", limit=40):
        agg = self.key_averages()
        key = (lambda kv: -(kv[1][2] or 0.0)) if sort_by == "device" else (lambda kv: -kv[1][1])
        rows = sorted(agg.items(), key=key)
        lines = [f"{'op':34s} {'phase':5s} {'calls':>6s} {'host ms':>9s} {'device ms':>10s}"]
        host_sum = dev_sum = 0.0
        for (name, phase), (n, host, dev) in rows:
            host_sum += host
            dev_sum += dev or 0.0
        for (name, phase), (n, host, dev) in rows[:limit]:
            d = f"{dev:10.3f}" if dev is not None else f"{'-':>10s}"
            lines.append(f"{name[:34]:34s} {phase:5s} {n:6d} {host * 1e3:9.3f} {d}")
        lines.append(f"{'sum of ops':34s} {'':5s} {len(self.records):6d} {host_sum * 1e3:9.3f} {dev_sum:10.3f}")
        dw = f"{self.device_wall_ms:10.3f}" if self.device_wall_ms is not None else f"{'-':>10s}"
        lines.append(f"{'region wall time':34s} {'':5s} {'':6s} {self.wall_s * 1e3:9.3f} {dw}")
        return "\n".join(lines)


@contextlib.contextmanager
def profile(cuda=None):
    """Profile the ops run inside the block (see the module docstring). `cuda` defaults to whether CuPy sees a GPU."""
    if cuda is None:
        cuda = backend.cuda_available()
    prof = Profile(cuda)
    start = end = None
    if cuda:
        cp = backend.cupy
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
    prof._install()
    t = time.perf_counter()
    try:
        yield prof
    finally:
        prof._uninstall()
        if cuda:
            end.record()
            end.synchronize()
            prof.device_wall_ms = backend.cupy.cuda.get_elapsed_time(start, end)
        prof.wall_s = time.perf_counter() - t


# ----------------------------------------------------------------------------- what a graph keeps for backward
def _storage(a):
    """(key, bytes) of the allocation an array lives on: views of one buffer count once."""
    if backend.is_cuda_array(a):
        mem = a.data.mem
        return ("cuda", mem.ptr), mem.size
    base = a
    while getattr(base, "base", None) is not None and hasattr(base.base, "nbytes"):
        base = base.base
    return ("cpu", id(base)), base.nbytes


def _arrays_of(node):
    from .tensor import Tensor
    out = []
    for item in node._saved or ():
        if item is not None:
            out.append(item[0]._data)
    for v in (node.__dict__ or {}).values():
        if isinstance(v, Tensor):
            out.append(v._data)
        elif hasattr(v, "nbytes") and hasattr(v, "dtype") and hasattr(v, "shape"):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x._data if isinstance(x, Tensor) else x for x in v
                       if isinstance(x, Tensor) or (hasattr(x, "nbytes") and hasattr(x, "shape")))
    return out


def saved_tensors_report(*outputs, exclude=()):
    """Bytes the recorded graph behind `outputs` keeps alive for backward, by op: each storage counted once (for the
    first node that holds it, in reverse-topological order from the outputs). `exclude`: tensors whose storage is
    not to be counted (e.g. the parameters). Returns (total_bytes, [(op, bytes, storages)] sorted by bytes)."""
    seen_nodes, seen_store = set(), {_storage(t._data)[0] for t in exclude}
    by_op = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    total = 0
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for a in _arrays_of(node):
            key, nbytes = _storage(a)
            if key in seen_store:
                continue
            seen_store.add(key)
            name = node.name()
            row = by_op.setdefault(name, [0, 0])
            row[0] += nbytes
            row[1] += 1
            total += nbytes
        for e in node.next_functions or ():
            if e is not None:
                stack.append(e[0])
    rows = sorted(((k, v[0], v[1]) for k, v in by_op.items()), key=lambda r: -r[1])
    return total, rows
