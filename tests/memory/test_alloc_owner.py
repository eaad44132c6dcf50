"""FLAME's CuPy allocator in C (flame_core/csrc/alloc.c) without a GPU: `Allocator.malloc` makes CuPy's objects as
CuPy's PythonFunctionAllocator does, with each block's free held by a `BlockOwner` that the garbage collector does not
track -- so a block comes back once, whether its arrays die by reference count or inside a cycle the collector frees.
Stand-ins play CuPy's UnownedMemory and MemoryPointer; the GPU test with real arrays is in test_cuda_pool.py."""
import gc
import sys
import types

import pytest

from flame_core import speedups
from flame_core.memory import cuda as mcuda

c = speedups.module
pytestmark = pytest.mark.skipif(c is None, reason="the C extension flame_core._speedups is not built")


class Unowned:
    """CuPy's UnownedMemory(ptr, size, owner, device_id): a collector-tracked object holding its owner."""

    def __init__(self, ptr, size, owner, device_id):
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class Pointer:
    """CuPy's MemoryPointer(mem, offset)."""

    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


class Recorder:
    def __init__(self):
        self.calls = []
        self.next_ptr = 4096

    def malloc(self, size, device_id):
        self.calls.append(("malloc", size, device_id))
        self.next_ptr += 4096
        return self.next_ptr

    def free(self, ptr, device_id):
        self.calls.append(("free", ptr, device_id))


def make(rec, device_id=3, unowned=Unowned, pointer=Pointer):
    return c.Allocator(rec.malloc, rec.free, lambda: device_id, unowned, pointer)


def test_malloc_builds_cupys_objects_and_the_owner_frees_once():
    rec = Recorder()
    mp = make(rec).malloc(3000)
    assert type(mp) is Pointer and mp.ptr == 8192 and mp.device_id == 3
    mem = mp.mem
    assert (mem.ptr, mem.size, mem.device_id) == (8192, 3000, 3)
    owner = mem._owner
    assert type(owner) is c.BlockOwner and (owner.ptr, owner.device_id) == (8192, 3)
    assert not gc.is_tracked(owner) and "ptr=8192" in repr(owner)
    assert rec.calls == [("malloc", 3000, 3)]
    del mp, mem, owner
    assert rec.calls == [("malloc", 3000, 3), ("free", 8192, 3)]
    gc.collect()
    assert len(rec.calls) == 2


def test_size_zero_is_a_null_pointer_without_malloc():
    rec = Recorder()
    mp = make(rec, device_id=0).malloc(0)
    assert (mp.ptr, mp.mem.size, mp.mem._owner, mp.device_id) == (0, 0, None, 0)
    del mp
    assert rec.calls == []


@pytest.mark.parametrize("cycle_first", [False, True])
def test_a_cycle_freed_by_the_collector_returns_every_block_once(cycle_first):
    rec = Recorder()
    alloc = make(rec)
    gc.collect()
    gc.disable()  # the collector's order is the objects' order: no collection before the one below
    try:
        box = [] if cycle_first else None
        ptrs = [alloc.malloc(n) for n in (100, 200, 300)]
        box = box if cycle_first else []
        box += ptrs
        box.append(box)
        del ptrs, box
        assert [k for k, *_ in rec.calls] == ["malloc"] * 3
        gc.collect()
    finally:
        gc.enable()
    freed = sorted(p for k, p, _ in rec.calls if k == "free")
    assert freed == [8192, 12288, 16384]


def test_errors_propagate_and_an_unused_block_goes_back():
    rec = Recorder()

    class OutOfMemory(Exception):
        pass

    def full(size, device_id):
        raise OutOfMemory(f"{size} bytes on cuda:{device_id}")

    with pytest.raises(OutOfMemory, match="3000 bytes on cuda:3"):
        c.Allocator(full, rec.free, lambda: 3, Unowned, Pointer).malloc(3000)
    assert rec.calls == []

    def bad_unowned(*args):
        raise ValueError("no memory object")

    with pytest.raises(ValueError, match="no memory object"):
        make(rec, unowned=bad_unowned).malloc(64)
    assert rec.calls == [("malloc", 64, 3), ("free", 8192, 3)]  # the block came back, the error stayed
    with pytest.raises(TypeError):
        make(rec).malloc("64")
    with pytest.raises(TypeError, match="free_func is not callable"):
        c.BlockOwner(None, 1, 0)
    with pytest.raises(TypeError, match="get_device_id is not callable"):
        c.Allocator(rec.malloc, rec.free, 0, Unowned, Pointer)


def test_a_raising_free_is_reported_unraisable_and_an_exception_in_flight_is_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    def bad_free(ptr, device_id):
        raise RuntimeError(f"free {ptr}")

    owner = c.BlockOwner(bad_free, 7, 0)
    del owner
    assert len(seen) == 1 and str(seen[0].exc_value) == "free 7" and seen[0].object is bad_free

    freed = []

    def fails_holding_a_block():
        owner = c.BlockOwner(lambda p, d: freed.append(p), 9, 0)  # noqa: F841 (dies while the error unwinds)
        raise KeyError("in flight")

    with pytest.raises(KeyError, match="in flight"):
        fails_holding_a_block()
    assert freed == [9]


def test_make_allocator_picks_the_extension_or_cupys_allocator(monkeypatch):
    made = []

    class PythonFunctionAllocator:
        def __init__(self, malloc, free):
            made.append((malloc, free))

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        device=types.SimpleNamespace(get_device_id=lambda: 0),
        memory=types.SimpleNamespace(PythonFunctionAllocator=PythonFunctionAllocator, UnownedMemory=Unowned,
                                     MemoryPointer=Pointer)))
    alloc = mcuda.make_allocator(cp)
    assert type(alloc) is c.Allocator and made == []
    monkeypatch.setattr(speedups, "module", None)  # no extension (not built, or FLAME_SPEEDUPS=0)
    assert isinstance(mcuda.make_allocator(cp), PythonFunctionAllocator)
    assert made == [(mcuda._malloc, mcuda._free)]
