"""The time and memory of each stage of a run (check the data, cache latents, cache text, build, train, samples).

    meter = StageMeter(device)
    with meter.stage("latents"):
        ...                                   # VAE loaded, used, freed
    meter.report()    # [{"stage", "seconds", "peak_allocated", "peak_reserved", "device_peak", "device_used_start"}]

peak_allocated / peak_reserved: FLAME's accounting of the device the run computes on, from a reset at the stage's
start (on the cpu: the storage of live tensors, host memory). device_peak (cuda only): the most memory the driver
saw in use on the GPU during the stage (cudaMemGetInfo: total - free, every process and allocator), polled every
few milliseconds by a thread; device_used_start: the same at the stage's start. A stage entered twice (sampling
during training) adds its seconds and keeps the larger peaks; a stage inside another (samples inside train)
counts in both.
"""
import threading
import time
from contextlib import contextmanager

import flame_core as flame
from flame_core import memory


class _DevicePoll:
    """The largest total - free the driver reports while running (a daemon thread)."""

    def __init__(self, device, interval=0.002):
        self.device, self.interval = device, interval
        self.peak = self.start_used = self._used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _used(self):
        free, total = flame.cuda.mem_get_info(self.device)
        return total - free

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(self.interval)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        return self.peak


class StageMeter:
    def __init__(self, device, log=None):
        self.device = flame.device(device)
        self.log = log
        self.stages = {}
        self._open = []   # records of the stages entered and not left (a stage may run inside another)

    def _fold(self, rec, allocated, reserved):
        rec["peak_allocated"] = max(rec["peak_allocated"], allocated)
        rec["peak_reserved"] = max(rec["peak_reserved"], reserved)

    def reset_peaks(self):
        """Reset the device's peak statistics (e.g. to measure one operation) without losing what the open stages
        have seen so far."""
        dev = self.device
        for outer in self._open:
            self._fold(outer, memory.max_memory_allocated(dev), memory.max_memory_reserved(dev))
        memory.reset_peak_memory_stats(dev)

    @contextmanager
    def stage(self, name, quiet=False):
        dev = self.device
        self.reset_peaks()  # the peaks so far belong to the enclosing stages
        rec = self.stages.setdefault(name, {"stage": name, "seconds": 0.0, "peak_allocated": 0,
                                            "peak_reserved": 0})
        self._open.append(rec)
        poll = _DevicePoll(dev) if dev.type == "cuda" else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if dev.type == "cuda":
                flame.cuda.synchronize()
            rec["seconds"] += time.perf_counter() - t0
            self._open.remove(rec)
            allocated, reserved = memory.max_memory_allocated(dev), memory.max_memory_reserved(dev)
            for r in [rec] + self._open:
                self._fold(r, allocated, reserved)
            if poll is not None:
                rec["device_peak"] = max(rec.get("device_peak", 0), poll.stop())
                rec.setdefault("device_used_start", poll.start_used)
            if self.log is not None and not quiet:
                self.log(describe(rec))

    def report(self):
        return [dict(r) for r in self.stages.values()]


def _gib(n):
    return f"{n / 2 ** 30:.2f} GiB"


def describe(rec):
    s = f"stage {rec['stage']}: {rec['seconds']:.1f} s, peak {_gib(rec['peak_allocated'])} allocated"
    if "device_peak" in rec:
        s += f", {_gib(rec['peak_reserved'])} reserved by the pool, {_gib(rec['device_peak'])} in use on the GPU " \
             f"(driver)"
    return s
