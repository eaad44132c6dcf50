"""Progress bar whose speed and ETA count only training time.

Sampling and checkpointing pause the clock (`with progress.paused(): ...`), so it/s and the ETA stay right after
a pause (tqdm's own rate would fold the pause into its average). The rate is the mean over the last `window`
steps of active time; right after a resume (no step timed yet) it is the earlier part's mean pace, from the
`active_time` the checkpoint restored. The bar is drawn by tqdm when it is installed (else one line every
`print_every` steps).
"""
import sys
import time
from collections import deque
from contextlib import contextmanager


def _fmt_time(s):
    if s is None or s != s or s == float("inf"):
        return "?"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


class Progress:
    def __init__(self, total, initial=0, desc="train", window=20, clock=time.perf_counter, enabled=True,
                 file=None, print_every=50, active_time=0.0):
        self.total, self.n, self.window, self.clock = int(total), int(initial), int(window), clock
        self._times = deque(maxlen=self.window)    # active seconds of the last steps
        self._last = None                           # clock at the end of the last step (None: not started)
        self.active_time = float(active_time)     # training seconds so far, earlier runs of a resumed one included
        self._initial = int(initial)
        self.postfix = {}
        self._bar = None
        self._file = file or sys.stderr
        self._print_every = print_every
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=self.total, initial=self.n, desc=desc, file=self._file, dynamic_ncols=True,
                                 bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")
            except ImportError:
                self._bar = None
        self._enabled = enabled

    def start(self):
        self._last = self.clock()

    @property
    def rate(self):
        """Steps per second of active time over the recent window (None before the first step)."""
        if not self._times:
            return self._initial / self.active_time if self._initial and self.active_time > 0 else None
        t = sum(self._times)
        return len(self._times) / t if t > 0 else None

    @property
    def eta(self):
        r = self.rate
        return None if not r else (self.total - self.n) / r

    def update(self, n=1, **postfix):
        now = self.clock()
        if self._last is None:
            self._last = now
        dt = now - self._last
        self._last = now
        self.active_time += dt
        for _ in range(n):
            self._times.append(dt / n)
        self.n += n
        self.postfix.update(postfix)
        self._draw(n)

    def describe(self):
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.postfix.items()]
        r = self.rate
        parts.append(f"{r:.2f}it/s" if r is not None and r >= 1 else
                     (f"{1 / r:.2f}s/it" if r else "?it/s"))
        parts.append(f"eta {_fmt_time(self.eta)}")
        return ", ".join(parts)

    def _draw(self, n):
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(self.describe(), refresh=False)
            self._bar.update(n)
        elif self.n % self._print_every == 0 or self.n == self.total:
            print(f"step {self.n}/{self.total}: {self.describe()}", file=self._file, flush=True)

    @contextmanager
    def paused(self):
        """Time inside the block is not training time."""
        t0 = self.clock()
        try:
            yield
        finally:
            if self._last is not None:
                self._last += self.clock() - t0

    def write(self, msg):
        if self._bar is not None:
            self._bar.write(msg, file=self._file)
        elif self._enabled:
            print(msg, file=self._file, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
