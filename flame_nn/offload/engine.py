"""The copy engine of block streaming: a copy stream beside the compute stream, events between them, and host<->device
copies of raw bytes. `copy_engine(device)` gives the CUDA engine (CuPy streams and events, cudaMemcpyAsync from
pinned memory) or, on cpu, the host engine: the same calls, copies done at once, events and waits no-ops. The
streamer's schedule is written once against this interface, so CPU tests run the schedule the GPU runs.

    ev = eng.record_compute()       # an event after everything enqueued so far on the compute (current) stream
    eng.copy_waits(ev)              # later copies start only after it
    eng.h2d(dst, offset, src)       # device uint8 array `dst`[offset:] <- host uint8 array `src` (copy stream)
    eng.d2h(dst, src, offset)       # host uint8 `dst` <- device uint8 `src`[offset:] (copy stream)
    ev = eng.record_copy()          # an event after the copies enqueued so far
    eng.compute_waits(ev)           # later compute work starts only after it
    eng.capturing()                 # None, or a key of the CUDA graph capture the compute stream is in
    eng.writeback_waits(ev); eng.writeback(dst, src, offset); ev = eng.record_writeback()
                                    # device->host on a stream of its own (a layer-wise update's new weights): the
                                    # two directions of the bus at once; `copy_waits(ev)` / `compute_waits(ev)` order
                                    # later work after it (not capturable: eager layer-wise steps only)

CUDA graphs: all of the above is capturable. The first `copy_waits(ev)` inside a capture, with `ev` recorded on the
capturing compute stream, makes the copy stream join the capture (the fork); the copies and events that follow are
captured on it; `compute_waits(ev)` with `ev` recorded on the copy stream joins that branch back. Events recorded
outside a capture must not be waited on inside it, nor captured ones outside it (the streamer forgets its events at
either boundary).
"""
import time

import numpy as np

from flame_core import backend


class HostEngine:
    """cpu: there is one 'stream' (the Python thread); copies happen when called."""
    is_async = False

    def __init__(self, device, profile=False):
        self.device = device
        self.profile = profile
        self._timed = []  # (seconds, bytes) per copy while profiling

    def record_compute(self):
        return None

    def record_copy(self):
        return None

    def copy_waits(self, event):
        pass

    def compute_waits(self, event):
        pass

    def capturing(self):
        return None

    def h2d(self, dst, offset, src):
        t = time.perf_counter() if self.profile else 0.0
        dst[offset:offset + src.nbytes] = src.reshape(-1).view(np.uint8)
        if self.profile:
            self._timed.append((time.perf_counter() - t, src.nbytes))

    def d2h(self, dst, src, offset):
        dst.reshape(-1).view(np.uint8)[...] = src[offset:offset + dst.nbytes]

    writeback = d2h

    def writeback_waits(self, event):
        pass

    def record_writeback(self):
        return None

    def synchronize(self):
        pass

    def transfer_log(self):
        """[(seconds, bytes)] of the host->device copies since the last call (profiling on)."""
        out, self._timed = self._timed, []
        return out


class CudaEngine:
    """A non-blocking CuPy stream for copies: it never synchronises implicitly with the legacy default stream, so
    copies overlap the compute kernels; order between the two streams comes only from the events."""
    is_async = True

    def __init__(self, device, profile=False):
        cp = backend.cupy
        self._cp = cp
        self._rt = cp.cuda.runtime
        self.device = device
        self.profile = profile
        with device.context():
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._wb = None   # the write-back stream, made at its first use
        self._timed = []  # (start event, end event, bytes) while profiling

    def _event(self, stream):
        ev = self._cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream)
        return ev

    def record_compute(self):
        with self.device.context():
            return self._event(self._cp.cuda.get_current_stream())

    def record_copy(self):
        with self.device.context():
            return self._event(self.stream)

    def copy_waits(self, event):
        if event is not None:
            self.stream.wait_event(event)

    def compute_waits(self, event):
        if event is not None:
            with self.device.context():
                self._cp.cuda.get_current_stream().wait_event(event)

    def capturing(self):
        """A key of the capture the current (compute) stream is in, or None: CUDA graph capture of a streamed step."""
        s = self._cp.cuda.get_current_stream()
        if s.ptr and s.is_capturing():
            return (s.ptr, id(s))
        return None

    def h2d(self, dst, offset, src):
        n = src.nbytes
        if not n:
            return
        start = None
        if self.profile and not self.stream.is_capturing():  # timing events cannot be read back from a graph
            start = self._cp.cuda.Event()
            start.record(self.stream)
        with self.device.context():
            self._rt.memcpyAsync(dst.data.ptr + offset, src.ctypes.data, n, self._rt.memcpyHostToDevice,
                                 self.stream.ptr)
        if start is not None:
            end = self._cp.cuda.Event()
            end.record(self.stream)
            self._timed.append((start, end, n))

    def d2h(self, dst, src, offset):
        n = dst.nbytes
        if n:
            with self.device.context():
                self._rt.memcpyAsync(dst.ctypes.data, src.data.ptr + offset, n, self._rt.memcpyDeviceToHost,
                                     self.stream.ptr)

    def _writeback_stream(self):
        if self._wb is None:
            with self.device.context():
                self._wb = self._cp.cuda.Stream(non_blocking=True)
        return self._wb

    def writeback_waits(self, event):
        if event is not None:
            self._writeback_stream().wait_event(event)

    def writeback(self, dst, src, offset):
        n = dst.nbytes
        if n:
            with self.device.context():
                self._rt.memcpyAsync(dst.ctypes.data, src.data.ptr + offset, n, self._rt.memcpyDeviceToHost,
                                     self._writeback_stream().ptr)

    def record_writeback(self):
        with self.device.context():
            return self._event(self._writeback_stream())

    def synchronize(self):
        self.stream.synchronize()
        if self._wb is not None:
            self._wb.synchronize()

    def transfer_log(self):
        """[(seconds, bytes)] of the host->device copies since the last call (profiling on; waits for them)."""
        out, self._timed = self._timed, []
        if out:
            out[-1][1].synchronize()
        return [(self._cp.cuda.get_elapsed_time(s, e) / 1e3, n) for s, e, n in out]


def copy_engine(device, profile=False):
    return CudaEngine(device, profile) if device.type == "cuda" else HostEngine(device, profile)


def device_bytes(nbytes, device):
    """An uninitialised uint8 device buffer as a Tensor (so the memory accounting sees it), and its array."""
    from flame_core import as_tensor
    xp = backend.xp_for(device)
    with device.context():
        arr = xp.empty(int(nbytes), dtype=np.uint8)
    return as_tensor(arr), arr
