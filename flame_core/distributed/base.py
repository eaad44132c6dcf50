"""What the collective backends share: the reduction operations, the handle of an issued collective (Work), and the
interface a backend implements on contiguous arrays.

A backend (nccl.py on CUDA, store_backend.py on the cpu) receives contiguous arrays of one device and issues each
collective asynchronously, in the order called; every rank must call the same collectives in the same order.
"""
import enum

import numpy as np

from ..errors import DTypeError


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


REDUCE_OPS = tuple(ReduceOp)


class Work:
    """The handle of a collective issued with async_op=True (torch's Work).

    wait(): orders what the caller does next after the collective -- on CUDA the current stream waits for it (the
    host does not block), on the cpu the caller blocks until it is done; the tensors may then be read or reused.
    is_completed(): done, without waiting. synchronize(): the host blocks until it is done."""

    def wait(self, timeout=None):
        raise NotImplementedError

    def is_completed(self):
        raise NotImplementedError

    def synchronize(self):
        self.wait()


class CompletedWork(Work):
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class Backend:
    """Collectives on contiguous arrays (all of the group's device). Each returns a Work."""

    name = None

    def all_reduce(self, arr, op):
        raise NotImplementedError

    def broadcast(self, arr, src):
        raise NotImplementedError

    def all_gather(self, out, inp):
        """out: (world_size * inp.size,) elements, rank r's input at [r * n, (r + 1) * n)."""
        raise NotImplementedError

    def reduce_scatter(self, out, inp, op):
        """inp: (world_size * out.size,) elements; rank r receives the reduction of every rank's chunk r."""
        raise NotImplementedError

    def wait_all(self):
        """Order the caller after every collective issued so far (the DDP's end of backward)."""
        raise NotImplementedError

    def synchronize(self):
        """The host waits for every collective issued so far."""
        raise NotImplementedError

    def close(self):
        pass


def check_reducible(arr, op, what):
    """Reductions take numbers (not bool, not fp8 storage); AVG only floating types (as NCCL and torch)."""
    dt = np.dtype(arr.dtype)
    if not (dt.kind in "iu" or is_floating(dt)):
        raise DTypeError(f"{what}: cannot reduce a tensor of dtype {dt.name} (numbers only)")
    if op is ReduceOp.AVG and not is_floating(dt):
        raise DTypeError(f"{what}: ReduceOp.AVG needs a floating-point tensor, got {dt.name}")


def is_floating(dt):
    dt = np.dtype(dt)
    return dt.kind == "f" or dt.name == "bfloat16"
