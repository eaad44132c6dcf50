"""MemoryProfiler: a timeline of (op, allocated, reserved) and the owners of the peak.

    with flame_core.memory.MemoryProfiler(json_path="mem.json", plot_path="mem.png") as prof:
        with prof.phase("forward"):
            loss = model(x)
        loss.backward()
    print(prof.report())

Every allocation and free of the device's accountant (the cuda pool, or cpu tensor storage) becomes one timeline
entry naming the op that caused it: `MatMulBackward` while backward runs that node, `MatMul` inside a Function,
else the outermost flame_core function called (`randn`, `zeros`, ...). At the end, the allocations alive at the
peak are grouped by op and listed largest first (with shape, dtype and, when tracking is on, the creating line).
The PNG needs matplotlib (`pip install flame-diffusion[plot]`).
"""
import json
import os
import sys
import time
from contextlib import contextmanager

from .stats import fmt_bytes
from .tracking import _PKG_DIR

_MEM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _op_codes():
    from ..autograd import engine, function
    return function.py_apply.__func__.__code__, engine.run_backward.__code__


class MemoryProfiler:
    def __init__(self, device=None, json_path=None, plot_path=None, top=10):
        from ..device import device as parse_device
        from . import _accountant
        self.device = parse_device(device)
        self._acct = _accountant(self.device)
        self.json_path, self.plot_path, self.top = json_path, plot_path, top
        self.timeline = []  # (seq, t seconds, event, op, phase, nbytes, allocated, reserved)
        self.peak = None
        self._records = []  # [seq_alloc, seq_free, nbytes, op, phase, shape, dtype, origin]
        self._open = {}  # id(block or ref) -> record
        self._phase = None
        self._prev = None
        self._t0 = 0.0
        self._apply_code = self._backward_code = None

    # ------------------------------------------------------------------ context
    def __enter__(self):
        from ..autograd import function
        function.hold_python_apply(True)  # ops are read from py_apply's frame (not the C apply's)
        self._apply_code, self._backward_code = _op_codes()
        a = self._acct
        self.baseline = (a.allocated, a.reserved)
        self._prev = a.observer
        a.observer = self._on_event
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        from ..autograd import function
        function.hold_python_apply(False)
        self._acct.observer = self._prev
        self._finish()
        if self.json_path:
            self.export_json(self.json_path)
        if self.plot_path:
            self.plot(self.plot_path)
        return False

    @contextmanager
    def phase(self, name):
        """Label the events inside the block (e.g. 'forward', 'optimizer')."""
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    # ------------------------------------------------------------------ events
    def _on_event(self, event, acct, obj):
        if event == "tag":
            rec = self._open.get(id(obj))
            if rec is not None and obj.tag is not None:
                rec[5], rec[6], rec[7] = obj.tag
            return
        seq = len(self.timeline)
        if event == "alloc":
            op = self._current_op()
            if hasattr(obj, "info"):  # cpu storage: the array is known at birth
                nbytes, shape, dtype, origin = obj.info
            else:  # a device block: the tensor birth hook (installed while an observer is set) tags it ("tag")
                nbytes, shape, dtype, origin = obj.size, None, None, None
            rec = [seq, None, nbytes, op, self._phase, shape, dtype, origin]
            self._records.append(rec)
            self._open[id(obj)] = rec
        else:
            rec = self._open.pop(id(obj), None)
            if rec is None:  # allocated before profiling began
                nbytes = obj.size if hasattr(obj, "size") else obj.nbytes
                op = "<before profiling>"
            else:
                rec[1] = seq
                nbytes, op = rec[2], rec[3]
        self.timeline.append((seq, time.perf_counter() - self._t0, event, op, self._phase, nbytes, acct.allocated,
                              acct.reserved))

    def _current_op(self):
        f = sys._getframe(2)
        inner_fn = api = None
        in_run = False  # inside the contiguous run of flame_core frames above the allocation
        for _ in range(96):
            if f is None:
                break
            code = f.f_code
            if code is self._backward_code:
                node = f.f_locals.get("node")
                return node.name() if node is not None else "backward"
            if code is self._apply_code and inner_fn is None:
                inner_fn = f.f_locals["cls"].__name__
            fn = code.co_filename
            if fn.startswith(_PKG_DIR):
                if not fn.startswith(_MEM_DIR):
                    in_run = True
                    api = code.co_name
            elif in_run and inner_fn is None:
                break  # left flame_core for user code: `api` is the entry point the user called
            f = f.f_back
        return inner_fn or api or "<python>"

    # ------------------------------------------------------------------ results
    def _finish(self):
        alloc = [e[6] for e in self.timeline]
        base_alloc, base_res = self.baseline
        if not alloc or max(alloc) <= base_alloc:
            self.peak = {"index": None, "allocated": base_alloc, "reserved": base_res, "by_op": [], "largest": []}
            return
        i = max(range(len(alloc)), key=alloc.__getitem__)
        seq = self.timeline[i][0]
        live = [r for r in self._records if r[0] <= seq and (r[1] is None or r[1] > seq)]
        by_op = {}
        for r in live:
            by_op[r[3]] = by_op.get(r[3], 0) + r[2]
        before = self.timeline[i][6] - sum(r[2] for r in live)
        if before > 0:
            by_op["<before profiling>"] = before
        largest = sorted(live, key=lambda r: -r[2])[:self.top]
        self.peak = {
            "index": i, "t": self.timeline[i][1], "allocated": self.timeline[i][6], "reserved": self.timeline[i][7],
            "phase": self.timeline[i][4],
            "by_op": sorted(by_op.items(), key=lambda kv: -kv[1]),
            "largest": [{"bytes": r[2], "op": r[3], "phase": r[4],
                         "shape": None if r[5] is None else list(r[5]),
                         "dtype": None if r[6] is None else str(r[6]), "origin": r[7]} for r in largest],
        }

    @property
    def max_allocated(self):
        return self.peak["allocated"] if self.peak else None

    def as_dict(self):
        keys = ("seq", "t", "event", "op", "phase", "bytes", "allocated", "reserved")
        return {"device": str(self.device),
                "baseline": {"allocated": self.baseline[0], "reserved": self.baseline[1]},
                "timeline": [dict(zip(keys, e)) for e in self.timeline],
                "peak": {**self.peak, "by_op": [{"op": k, "bytes": v} for k, v in self.peak["by_op"]]}}

    def export_json(self, path):
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def report(self):
        p = self.peak
        lines = [f"memory profile on {self.device}: {len(self.timeline)} events, peak allocated "
                 f"{fmt_bytes(p['allocated'])} (reserved {fmt_bytes(p['reserved'])})"
                 + (f" during {p['phase']}" if p.get("phase") else "")]
        if p["by_op"]:
            lines.append("owners of the peak, by op:")
            lines.extend(f"  {fmt_bytes(b):>12}  {op}" for op, b in p["by_op"][:self.top])
            lines.append("largest allocations alive at the peak:")
            for r in p["largest"]:
                what = f"{tuple(r['shape'])} {r['dtype']}" if r["shape"] is not None else "(internal buffer)"
                lines.append(f"  {fmt_bytes(r['bytes']):>12}  {what}  from {r['op']}"
                             + (f" at {r['origin']}" if r["origin"] else ""))
        return "\n".join(lines)

    def plot(self, path):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("MemoryProfiler.plot needs matplotlib: pip install flame-diffusion[plot]") from e
        top = max([e[7] for e in self.timeline] + [self.baseline[1], 1])
        unit, scale = ("GiB", float(1 << 30)) if top >= 1 << 30 else ("MiB", float(1 << 20))
        x = [e[1] * 1e3 for e in self.timeline]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        ax.step(x, [e[6] / scale for e in self.timeline], where="post", label="allocated")
        ax.step(x, [e[7] / scale for e in self.timeline], where="post", label="reserved", alpha=0.7)
        p = self.peak
        if p["index"] is not None:
            owners = ", ".join(f"{op} {fmt_bytes(b)}" for op, b in p["by_op"][:3])
            ax.annotate(f"peak {fmt_bytes(p['allocated'])}\n{owners}", (p["t"] * 1e3, p["allocated"] / scale),
                        textcoords="offset points", xytext=(10, -30), fontsize=8,
                        arrowprops={"arrowstyle": "->"})
        ax.set_xlabel("time since profiling began (ms)")
        ax.set_ylabel(unit)
        ax.set_title(f"FLAME memory timeline ({self.device})")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
