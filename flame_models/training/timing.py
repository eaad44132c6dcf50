"""ai-toolkit's `performance_log_every: N`: every N steps a report of where the wall-clock time of the last N went.

    timing = TimingReport(cfg.performance_log_every, log)
    with timing.phase("step"):            # around each part of the loop
        ...
    timing.step_done(step)                # after everything of a step: logs a report every N steps

Phases: "step" (the optimizer step: forward, backward, clipping, the optimizer and EMA; it ends with the step's one
synchronisation, so on a GPU it holds the device's time too), "data" (the batches taken from the loader, inside the
step: reported apart), "previews", "validation", "saves" (checkpoints); "other" is the rest of the window's wall-clock
time (logging, the progress bar, the finite-value checks). Off (no clock read) with N = 0.
"""
import time
from contextlib import contextmanager, nullcontext

import flame_core as flame

PHASES = ("step", "data", "previews", "validation", "saves")


class TimingReport:
    def __init__(self, every, log, device=None):
        self.every = int(every or 0)
        self.log, self.device = log, device
        self._off = nullcontext()
        self._reset()

    def _reset(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps, self.first, self.start = 0, None, time.perf_counter()

    def phase(self, name):
        """A context adding its wall-clock time to phase `name` (one of PHASES)."""
        if not self.every:
            return self._off
        if name not in self.totals:
            raise ValueError(f"TimingReport: unknown phase {name!r}; one of {', '.join(PHASES)}")
        return self._timed(name)

    @contextmanager
    def _timed(self, name):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t

    def step_done(self, step):
        """Count step `step` as done (after its previews, validation and saves); every `every` steps log the report
        of the steps since the last one and start the next window. Returns the report's text (None between)."""
        if not self.every:
            return None
        self.steps += 1
        self.first = step if self.first is None else self.first
        if step % self.every:
            return None
        text = self.report(step)
        self.log(text)
        self._reset()
        return text

    def report(self, step):
        wall = time.perf_counter() - self.start
        n = max(self.steps, 1)
        per = {k: 1e3 * v / n for k, v in self.totals.items()}
        per["step"] -= per["data"]   # (the loader's batches are taken inside the step)
        other = 1e3 * wall / n - sum(per.values())
        parts = [f"step {per['step']:.1f} ms (forward, backward, optimizer)", f"data {per['data']:.1f}"]
        parts += [f"{k} {per[k]:.1f}" for k in ("previews", "validation", "saves") if self.totals[k]]
        parts.append(f"other {max(other, 0.0):.1f}")
        text = (f"timing, steps {self.first}-{step} ({self.steps} steps in {wall:.2f} s, {self.steps / wall:.2f} "
                f"steps/s), per step: " + ", ".join(parts))
        if self.device is not None and flame.device(self.device).type == "cuda":
            text += f"; peak {flame.memory.max_memory_allocated(self.device) / 2 ** 30:.2f} GiB allocated"
        return text
