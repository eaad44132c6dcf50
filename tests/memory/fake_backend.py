"""A stand-in for cudaMalloc: hands out address ranges from a pretend device of given capacity, with gaps
between backend allocations so that neighbouring segments are never adjacent."""
from types import SimpleNamespace

from flame_core.memory.pool import DeviceOutOfMemory

GAP = 1 << 40


class FakeBackend:
    def __init__(self, capacity=1 << 40):
        self.capacity = capacity
        self.used = 0
        self.next_ptr = 1 << 44
        self.live = {}  # ptr -> size
        self.mallocs = self.frees = 0
        self.stream = 0

    def malloc(self, nbytes):
        if self.used + nbytes > self.capacity:
            raise DeviceOutOfMemory(f"fake device: {nbytes} requested, {self.capacity - self.used} free")
        ptr = self.next_ptr
        self.next_ptr += nbytes + GAP
        self.live[ptr] = nbytes
        self.used += nbytes
        self.mallocs += 1
        return ptr

    def free(self, ptr, nbytes):
        assert self.live.pop(ptr) == nbytes
        self.used -= nbytes
        self.frees += 1

    def current_stream(self):
        return SimpleNamespace(ptr=self.stream)

    def mem_info(self):
        return self.capacity - self.used, self.capacity
