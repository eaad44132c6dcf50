"""Ctrl-C and SIGTERM during training: the first asks the loop to stop after the current step (it then saves), the
second aborts at once (KeyboardInterrupt)."""
import signal
import sys
import threading


class StopRequest:
    """`with StopRequest() as stop:` ... `if stop.requested:` -- installs the handlers in the main thread only
    (elsewhere signals cannot be caught and `requested` stays None) and puts the previous ones back on exit."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, stream=None):
        self.requested = None            # the name of the first signal received
        self._stream = stream
        self._previous = {}

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        out = self._stream or sys.stderr
        if self.requested is None:
            self.requested = name
            out.write(f"\n{name}: stopping after this step and saving a checkpoint (press Ctrl-C again to abort "
                      f"at once, losing the steps since the last checkpoint)\n")
            out.flush()
            return
        self.restore()
        out.write(f"\n{name} again: aborting now\n")
        out.flush()
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def restore(self):
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous = {}

    def __exit__(self, *exc):
        self.restore()
        return False
