"""MemoryProfiler: timeline of (op, allocated, reserved), owners of the peak, JSON and PNG output."""
import importlib.util
import json
import sys

import pytest

import flame_core as flame
import flame_core.memory as M

from .conftest import storage

KiB, MiB = 1 << 10, 1 << 20


def test_timeline_peak_owners_json_and_png(device, tmp_path, no_gc):
    w = flame.randn(64, 64, device=device)  # allocated before profiling: 16 KiB
    (w @ w).sum()  # a first matmul's one-time buffers (cuBLAS's workspace on cuda) come before the profiler, not in it
    jpath, ppath = tmp_path / "mem.json", tmp_path / "mem.png"
    have_mpl = importlib.util.find_spec("matplotlib") is not None  # the plot is an optional extra
    with M.MemoryProfiler(device, json_path=str(jpath), plot_path=str(ppath) if have_mpl else None) as prof:
        with prof.phase("forward"):
            a = flame.ones(256, 64, device=device)  # 64 KiB
            b = a @ w  # 64 KiB, op Matmul
            del a
        d = flame.zeros(1024, 1024, device=device)  # 4 MiB: the peak
        del d
    tl = prof.timeline
    allocs = [e for e in tl if e[2] == "alloc"]
    assert [e[3] for e in allocs][:1] == ["ones"] and allocs[0][4] == "forward"
    assert any(e[3] == "Matmul" and e[5] == storage(64 * KiB, device) for e in allocs)
    assert tl[-1][6] == M.memory_allocated(device)  # the timeline ends where the accountant stands
    p = prof.peak
    assert p["allocated"] == max(e[6] for e in tl)
    assert tl[p["index"]][3] == "zeros" and tl[p["index"]][2] == "alloc"
    by_op = dict(p["by_op"])
    assert by_op["zeros"] == storage(4 * MiB, device)
    assert by_op["Matmul"] >= storage(64 * KiB, device)  # b is alive at the peak; `a` was freed before it
    assert "ones" not in by_op
    assert by_op["<before profiling>"] >= storage(16 * KiB, device)  # w
    top = p["largest"][0]
    assert (top["shape"], top["dtype"], top["op"]) == ([1024, 1024], "float32", "zeros")
    assert sum(by_op.values()) == p["allocated"]
    data = json.loads(jpath.read_text())
    assert len(data["timeline"]) == len(tl) and data["peak"]["allocated"] == p["allocated"]
    owners = [d["op"] for d in data["peak"]["by_op"] if d["op"] != "<before profiling>"]
    assert data["timeline"][0]["op"] == "ones" and owners[0] == "zeros"
    if have_mpl:
        assert ppath.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and ppath.stat().st_size > 10_000
    assert "zeros" in prof.report() and "(1024, 1024) float32" in prof.report()
    del b


def test_backward_events_are_named_after_the_node(device, no_gc):
    x = flame.randn(32, 32, device=device, requires_grad=True)
    with M.MemoryProfiler(device) as prof:
        (x @ x).sum().backward()
    ops = {e[3] for e in prof.timeline if e[2] == "alloc"}
    assert "MatmulBackward" in ops and "Matmul" in ops
    assert M.memory_allocated(device) == prof.timeline[-1][6]


def test_profiler_restores_the_previous_observer(device):
    acct = M._accountant(device)
    before = acct.observer
    with M.MemoryProfiler(device):
        assert acct.observer is not None
    assert acct.observer is before


def test_plot_without_matplotlib_says_how_to_get_it(device, tmp_path, monkeypatch):
    with M.MemoryProfiler(device) as prof:
        t = flame.zeros(10, device=device)
    del t
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"flame-diffusion\[plot\]"):
        prof.plot(str(tmp_path / "x.png"))
