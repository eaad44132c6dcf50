"""The "store" backend: collectives whose data travels through the job's TCP store -- for the cpu (NumPy tensors),
tests and machines without NCCL. Correct on any number of processes and machines, and slow: every byte goes through
rank 0's store. CUDA tensors are copied through host memory, synchronously.

Each collective gets a sequence number; rank r puts its contribution under `<group>/c<seq>/<r>`, reads the others',
and every rank reduces them in rank order in float64 (int64 for integers), so all ranks hold bit-identical results.
The last rank to finish deletes the keys. NumPy collectives run on one worker thread per group, in the order issued
(async_op=True returns before the data moved; Work.wait() joins it).
"""
import concurrent.futures as cf

import numpy as np

from .. import backend as _backend
from .base import Backend, CompletedWork, ReduceOp, Work, is_floating


class _FutureWork(Work):
    def __init__(self, future):
        self.future = future

    def wait(self, timeout=None):
        self.future.result(timeout)
        return True

    def is_completed(self):
        return self.future.done()


def _reduce(parts, op, dtype):
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        f = np.maximum if op is ReduceOp.MAX else np.minimum
        acc = parts[0].copy()
        for p in parts[1:]:
            acc = f(acc, p)
        return acc
    wide = np.float64 if is_floating(dtype) else np.int64
    acc = parts[0].astype(wide)
    for p in parts[1:]:
        if op is ReduceOp.PRODUCT:
            acc *= p.astype(wide)
        else:
            acc += p.astype(wide)
    if op is ReduceOp.AVG:
        acc /= len(parts)
    return acc.astype(dtype)


class StoreBackend(Backend):
    name = "store"

    def __init__(self, store, rank, world_size, prefix):
        self.store = store.clone()  # the worker thread's own connection
        self.rank, self.world, self.prefix = rank, world_size, prefix
        self.seq = 0
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flame-{prefix}")
        self.last = None

    # ------------------------------------------------------------------ exchange
    def _key(self, seq, *parts):
        return "/".join([self.prefix, f"c{seq}"] + [str(p) for p in parts])

    def _done(self, seq, keys):
        if self.store.add(self._key(seq, "done"), 1) == self.world:
            for k in keys + [self._key(seq, "done")]:
                self.store.delete_key(k)

    def _fetch(self, key, dtype):
        return np.frombuffer(self.store.get(key), dtype=dtype)

    def _submit(self, fn, out, *args):
        """Run fn(seq, out, *args) -- on the worker for NumPy arrays; for CUDA ones on this thread (its device is
        current) through host copies, after the worker's queue."""
        self.seq += 1
        if _backend.is_cuda_array(out):
            self.wait_all()
            host = _backend.to_numpy(out)
            fn(self.seq, host, *[_backend.to_numpy(a) if _backend.is_cuda_array(a) else a for a in args])
            out.set(host)
            return CompletedWork()
        self.last = self.pool.submit(fn, self.seq, out, *args)
        return _FutureWork(self.last)

    def _all_reduce(self, seq, arr, op):
        flat = arr.reshape(-1)
        self.store.set(self._key(seq, self.rank), flat.tobytes())
        keys = [self._key(seq, r) for r in range(self.world)]
        parts = [flat if r == self.rank else self._fetch(keys[r], flat.dtype) for r in range(self.world)]
        flat[...] = _reduce(parts, op, flat.dtype)
        self._done(seq, keys)

    def _broadcast(self, seq, arr, src):
        flat = arr.reshape(-1)
        key = self._key(seq, src)
        if self.rank == src:
            self.store.set(key, flat.tobytes())
        else:
            flat[...] = self._fetch(key, flat.dtype)
        self._done(seq, [key])

    def _all_gather(self, seq, out, inp):
        n = inp.size
        self.store.set(self._key(seq, self.rank), inp.reshape(-1).tobytes())
        keys = [self._key(seq, r) for r in range(self.world)]
        for r in range(self.world):
            out[r * n:(r + 1) * n] = inp.reshape(-1) if r == self.rank else self._fetch(keys[r], inp.dtype)
        self._done(seq, keys)

    def _reduce_scatter(self, seq, out, inp, op):
        n = out.size
        flat = inp.reshape(-1)
        for r in range(self.world):  # chunk r goes to rank r
            if r != self.rank:
                self.store.set(self._key(seq, self.rank, r), flat[r * n:(r + 1) * n].tobytes())
        mine = slice(self.rank * n, (self.rank + 1) * n)
        parts = [flat[mine] if j == self.rank else self._fetch(self._key(seq, j, self.rank), flat.dtype)
                 for j in range(self.world)]
        out.reshape(-1)[...] = _reduce(parts, op, flat.dtype)
        self._done(seq, [self._key(seq, j, r) for j in range(self.world) for r in range(self.world) if j != r])

    # ------------------------------------------------------------------ the interface
    def all_reduce(self, arr, op):
        return self._submit(self._all_reduce, arr, op)

    def broadcast(self, arr, src):
        return self._submit(self._broadcast, arr, src)

    def all_gather(self, out, inp):
        return self._submit(self._all_gather, out, inp)

    def reduce_scatter(self, out, inp, op):
        return self._submit(self._reduce_scatter, out, inp, op)

    def wait_all(self):
        if self.last is not None:
            self.last.result()  # one worker thread: the last issued finishes last

    synchronize = wait_all

    def close(self):
        self.pool.shutdown(wait=True)
        self.store.close()
