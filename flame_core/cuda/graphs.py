"""CUDA graphs: record the kernels of a region once, replay them with one launch.

FLAME issues every op from Python, so a training step of a 12B model costs ~10k host calls of tens of µs each. A
graph replays the same kernels (same buffers, same shapes) without any of that host work.

    g = flame_core.cuda.CUDAGraph()
    with flame_core.cuda.graph(g):             # capture: the work runs on a private stream and is only recorded
        static_out = fn(static_in)
    static_in.copy_(new_input); g.replay()     # replays into the same buffers: static_out holds the new result

    step = flame_core.cuda.graphed(fn, warmup=2)  # the same as a callable: eager for `warmup` calls, then one
    out = step(x, y)                              # capture, then copy-in + replay (eager on cpu)

Rules (as PyTorch's): inside a captured region there must be no host synchronisation (`.item()`, `.numpy()`,
printing tensors) and no host-dependent control flow on tensor values; shapes and dtypes are fixed; random numbers
drawn inside would repeat on every replay, so FLAME refuses to draw them while capturing (draw them outside and pass
them in). Tensors made inside the capture live in memory private to the graph; they (and the graph) stay valid
until the graph is reset or dropped, and each replay overwrites them.

Memory: capture runs on its own stream, and FLAME's pool keys its free lists by stream, so every buffer allocated
while capturing comes from the graph's own blocks and is never handed to eager work on another stream; those
blocks are pinned (empty_cache does not release them) while the graph lives. `graph` empties the eager cache
before capturing so that the private blocks do not double the step's footprint.
"""
import gc
import weakref

from .. import backend
from ..errors import FlameError
from ..tensor import Tensor


class GraphCaptureError(FlameError, RuntimeError):
    """Something in a captured region cannot be captured (a host sync, random numbers, no GPU)."""


def _cp():
    if not backend.cuda_available():
        raise GraphCaptureError("CUDA graphs need a CUDA GPU with CuPy")
    return backend.cupy


def is_capturing():
    """True while the current CuPy stream is being captured into a graph."""
    if not backend.cuda_available():
        return False
    s = backend.cupy.cuda.get_current_stream()
    return s.ptr != 0 and s.is_capturing()


_capturing = {}            # stream ptr -> the CUDAGraph capturing on it


def capturing_graph():
    """The CUDAGraph capturing on the current stream, or None."""
    if not backend.cuda_available() or not _capturing:
        return None
    return _capturing.get(backend.cupy.cuda.get_current_stream().ptr)
_with_users = weakref.WeakSet()  # graphs holding work of a resource that must outlive them (NCCL communicators)


def note_capture_use(owner):
    """Called by a resource (an NCCL communicator) whose work is being captured on the current stream: the graph
    that captures it is remembered, so that `release_graphs_of(owner)` can drop it before the resource goes (NCCL
    does not destroy a communicator while a graph holding its collectives lives)."""
    g = _capturing.get(backend.cupy.cuda.get_current_stream().ptr) if backend.cuda_available() else None
    if g is not None:
        g._users.add(id(owner))
        _with_users.add(g)


def hold_while_captured(obj):
    """Keep `obj` (a buffer made outside the capture that the work being captured on the current stream reads or
    writes: a shared scratch) alive as long as the capturing graph lives, so that its owner may drop it at any time
    without a replay writing into freed memory. No-op outside a capture."""
    if _capturing and backend.cuda_available():
        g = _capturing.get(backend.cupy.cuda.get_current_stream().ptr)
        if g is not None:
            g._held.append(obj)


def release_graphs_of(owner):
    """Reset every live graph that captured work of `owner` (it cannot replay once the owner is gone); returns how
    many. The CUDA graphs' executables are destroyed here, after the device finished their work."""
    gone = [g for g in list(_with_users) if id(owner) in g._users]
    if gone:
        backend.cupy.cuda.Device().synchronize()
    for g in gone:
        g.reset()
    return len(gone)


def _pool():
    from ..memory import cuda as mcuda
    if not mcuda.is_installed():
        return None
    return mcuda.pool_for(backend.cupy.cuda.runtime.getDevice())


class CUDAGraph:
    """A captured sequence of GPU work (torch.cuda.CUDAGraph)."""

    def __init__(self):
        self._graph = None
        self._stream = None
        self._prev_stream = None
        self._pool = None
        self._users = set()
        self._held = []  # buffers allocated outside the capture that its kernels use (hold_while_captured)

    def capture_begin(self, stream=None):
        cp = _cp()
        if self._graph is not None:
            raise GraphCaptureError("this CUDAGraph already holds a capture; call reset() first")
        cp.cuda.Device().synchronize()
        gc.collect()  # run pending frees now rather than in the middle of the capture
        self._stream = stream if stream is not None else cp.cuda.Stream(non_blocking=True)
        self._pool = _pool()
        if self._pool is not None:
            self._pool.empty_cache()
            self._pool.pin_stream(self._stream.ptr)
        self._prev_stream = cp.cuda.get_current_stream()
        self._stream.use()
        self._stream.begin_capture()
        _capturing[self._stream.ptr] = self

    def capture_end(self):
        try:
            self._graph = self._stream.end_capture()
        finally:
            _capturing.pop(self._stream.ptr, None)
            self._prev_stream.use()
        return self

    @property
    def is_live(self):
        """Capturing, or holding a capture: its work may still write into the memory it was captured with."""
        return self._graph is not None or (self._stream is not None and _capturing.get(self._stream.ptr) is self)

    def replay(self):
        """Launch the captured work on the current stream (ordered after the work already queued there)."""
        if self._graph is None:
            raise GraphCaptureError("replay() before a capture")
        self._graph.launch(backend.cupy.cuda.get_current_stream())

    def reset(self):
        """Drop the graph and give its private memory back (what tensors made during the capture still hold stays
        until they die; it returns to the device at the next empty_cache)."""
        self._graph = None
        self._users = set()
        self._held = []
        if self._pool is not None and self._stream is not None:
            self._pool.unpin_stream(self._stream.ptr)
            self._pool.release_stream(self._stream.ptr)
        self._pool = None

    def __del__(self):
        try:
            self.reset()
        except Exception:  # interpreter shutdown
            pass


class graph:
    """`with graph(g):` captures the block into CUDAGraph g (torch.cuda.graph)."""

    def __init__(self, cuda_graph, stream=None):
        self.cuda_graph, self.stream = cuda_graph, stream

    def __enter__(self):
        self.cuda_graph.capture_begin(self.stream)
        return self.cuda_graph

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.cuda_graph.capture_end()
            return False
        try:  # a failed capture: end it (the driver invalidated it) and restore the stream
            self.cuda_graph.capture_end()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass
        self.cuda_graph.reset()
        from .. import grad_pool
        grad_pool.forget_capture(self.cuda_graph)  # gradient storage it allocated never received its values
        return False


def _tensors(args):
    """The tensor arguments (top level: a graphed function's inputs are its tensor arguments)."""
    return [a for a in args if isinstance(a, Tensor)]


def _out_tensors(out):
    """The tensors in a graphed function's result (a tensor, or nested tuples / lists / dict values of them)."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _out_tensors(o)]
    return []


class GraphedFunction:
    """`fn` run eagerly for `warmup` calls (compiles kernels, builds optimizer state and caches), then captured once
    with static copies of the arguments and replayed: each call copies its tensor arguments into the static inputs,
    replays, and returns the static outputs (the same objects every call: read or clone them before the next call).
    Only top-level tensor arguments are inputs; other arguments (None, numbers) must not change after capture.
    Without a GPU (or with enabled=False, or with tensor arguments none of which is on cuda) every call is eager.
    A function of no tensor arguments (a training step over its own model and batch) is captured; if its capture
    returns only cpu tensors (cpu work: nothing recorded) that call's result is returned and the calls stay eager.
    alias_inputs: the capture call's own tensors become the static inputs instead of copies of them (as
    torch.cuda.make_graphed_callables' sample_args): no second copy of the inputs, but a later call with other
    tensors overwrites those (a loop that passes the same tensors every call, or fresh ones, loses nothing)."""

    def __init__(self, fn, warmup=2, enabled=True, alias_inputs=False):
        self.fn, self.warmup, self.calls = fn, int(warmup), 0
        self.alias_inputs = bool(alias_inputs)
        self.enabled = bool(enabled) and backend.cuda_available()
        self.graph = None
        self.static_args = self.static_out = None

    def _check(self, args):
        got = [(tuple(t.shape), t.dtype) for t in _tensors(args)]
        want = [(tuple(t.shape), t.dtype) for t in _tensors(self.static_args)]
        if got != want:
            raise GraphCaptureError(f"a graphed function was called with tensors {got}, but it was captured for "
                                    f"{want}; shapes and dtypes must stay fixed")

    def __call__(self, *args):
        self.calls += 1
        if not self.enabled or self.calls <= self.warmup:
            return self.fn(*args)
        from ..autograd.grad_mode import no_grad
        if self.graph is None:
            ts = _tensors(args)
            if ts and not any(a.is_cuda for a in ts):  # cpu work (a cpu run on a GPU machine): nothing to record
                self.enabled = False
                return self.fn(*args)
            with no_grad():
                self.static_args = tuple((a.detach() if self.alias_inputs else a.detach().clone())
                                         if isinstance(a, Tensor) else a for a in args)
            g = CUDAGraph()
            with graph(g):
                out = self.fn(*self.static_args)
            outs = _out_tensors(out)
            if not ts and outs and not any(o.is_cuda for o in outs):
                # no tensor arguments and only cpu results: fn's work ran on the cpu (during the capture, for real);
                # the graph holds nothing a replay could redo, so this call's result stands and the calls stay eager
                g.reset()
                self.enabled, self.static_args = False, None
                return out
            self.static_out = out
            self.graph = g
        else:
            self._check(args)
            with no_grad():
                for s, a in zip(_tensors(self.static_args), _tensors(args)):
                    if s is not a and s.data_ptr() != a.data_ptr():  # (an aliased input passed again: in place)
                        s.copy_(a)
        self.graph.replay()
        return self.static_out

    def reset(self):
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.static_args = self.static_out = None
        self.calls = 0


def graphed(fn, warmup=2, enabled=True, alias_inputs=False):
    """A callable that replays `fn` as a CUDA graph after `warmup` eager calls (see GraphedFunction)."""
    return GraphedFunction(fn, warmup=warmup, enabled=enabled, alias_inputs=alias_inputs)
