"""What runs inside a DataLoader worker process: seeding, the fetch loop, and errors carried back to the parent.

Worker `worker_id` of an iterator seeds Python's `random` and flame_core's generators with base_seed + worker_id
(PyTorch's rule; the parent draws base_seed from the loader's generator for each iterator) and NumPy's global
generator with a SeedSequence of (worker_id, base_seed). The worker runs on one BLAS thread with the cpu as its
default device (CUDA cannot be used from a forked process). Ctrl-C in a worker ends it quietly: the parent, which
gets the same signal, shuts the workers down; a worker whose parent died exits at its next queue poll.
"""
import gc
import os
import pickle
import queue
import random
import sys
import traceback

import numpy as np

POLL_INTERVAL = 5.0  # seconds between a worker's checks that its parent is alive
STATUS_INTERVAL = 1.0  # seconds between the parent's checks that its workers are alive


class WorkerInfo:
    """What `get_worker_info()` returns inside a worker: id, num_workers, seed, dataset (this worker's copy)."""

    __slots__ = ("id", "num_workers", "seed", "dataset")

    def __init__(self, id, num_workers, seed, dataset):
        self.id, self.num_workers, self.seed, self.dataset = id, num_workers, seed, dataset

    def __repr__(self):
        return f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, dataset={self.dataset!r})"


_worker_info = None


def get_worker_info():
    """The WorkerInfo of the current DataLoader worker process; None in the main process."""
    return _worker_info


class ExceptionWrapper:
    """An exception raised in a worker, carried to the parent as its type and formatted traceback."""

    def __init__(self, exc_info, where):
        self.exc_type = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def reraise(self):
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:  # KeyError's str() is the repr of its message: keep the lines readable
            msg = _KeyErrorMessage(msg)
        if not issubclass(self.exc_type, Exception):  # SystemExit and the like: an error here, not an exit
            raise RuntimeError(msg)
        try:
            exc = self.exc_type(msg)
        except Exception:  # an exception type that does not take one message
            raise RuntimeError(msg) from None
        raise exc


class _KeyErrorMessage(str):
    def __repr__(self):
        return self


class IterableStop:
    """A worker's IterableDataset is exhausted."""

    def __init__(self, worker_id):
        self.worker_id = worker_id


class ResumeIteration:
    """Sent to persistent workers at the start of each new epoch."""


class WorkerFailed:
    """A worker's last message: an exception ended it outside any fetch (unpickling its dataset under spawn, an
    import that fails there, SystemExit from the dataset, ...); the payload is its ExceptionWrapper."""

    def __init__(self, worker_id):
        self.worker_id = worker_id


def worker_main(args, index_queue, data_queue, done_event, worker_id, num_workers, parent_pid):
    """A worker process's target. `args`: worker_loop's dataset arguments (iterable, dataset, auto_collation,
    collate_fn, drop_last, base_seed, init_fn), as they are, or pickled (spawn / forkserver): unpickled here, so that
    a dataset this process cannot rebuild (its module does not import here, its state fails to load) is reported to
    the parent with its error and traceback instead of the process dying with them on its stderr."""
    try:
        if isinstance(args, bytes):
            args = pickle.loads(args)
        iterable, dataset, auto_collation, collate_fn, drop_last, base_seed, init_fn = args
        worker_loop(iterable, dataset, index_queue, data_queue, done_event, auto_collation, collate_fn, drop_last,
                    base_seed, init_fn, worker_id, num_workers, parent_pid)
    except KeyboardInterrupt:
        pass
    except BaseException:  # noqa: BLE001 - whatever ends the worker is reported, then it ends
        err = ExceptionWrapper(sys.exc_info(), f"in DataLoader worker process {worker_id}, which it ended")
        data_queue.put((WorkerFailed(worker_id), _packed(err, worker_id)))
        data_queue.close()
        data_queue.join_thread()  # the message is in the pipe before the process ends
        sys.exit(1)


class MapFetcher:
    def __init__(self, dataset, auto_collation, collate_fn, drop_last):
        self.dataset, self.auto_collation, self.collate_fn = dataset, auto_collation, collate_fn

    def fetch(self, index):
        if self.auto_collation:
            getitems = getattr(self.dataset, "__getitems__", None)
            data = getitems(index) if callable(getitems) else [self.dataset[i] for i in index]
        else:
            data = self.dataset[index]
        return self.collate_fn(data)


class IterableFetcher:
    def __init__(self, dataset, auto_collation, collate_fn, drop_last):
        self.it = iter(dataset)
        self.auto_collation, self.collate_fn, self.drop_last = auto_collation, collate_fn, drop_last
        self.ended = False

    def fetch(self, index):
        if self.ended:
            raise StopIteration
        if self.auto_collation:
            data = []
            for _ in index:
                try:
                    data.append(next(self.it))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < len(index)):
                raise StopIteration
        else:
            data = next(self.it)
        return self.collate_fn(data)


def _packed(data, worker_id):
    """The result pickled here, so that a batch that cannot be pickled is reported instead of lost in the queue's
    feeder thread (which would leave the parent waiting)."""
    try:
        return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        err = data if isinstance(data, ExceptionWrapper) else \
            ExceptionWrapper(sys.exc_info(), f"in DataLoader worker process {worker_id} (pickling its batch)")
        try:
            return pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # the exception's class itself cannot be pickled (a local class): report it by name
            err.exc_msg = f"{err.exc_type.__module__}.{err.exc_type.__qualname__}: {err.exc_msg}"
            err.exc_type = RuntimeError
            return pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)


def seed_worker(base_seed, worker_id):
    import flame_core
    seed = base_seed + worker_id
    random.seed(seed)
    flame_core.manual_seed(seed)
    np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    return seed


def worker_loop(iterable, dataset, index_queue, data_queue, done_event, auto_collation, collate_fn, drop_last,
                base_seed, init_fn, worker_id, num_workers, parent_pid):
    global _worker_info
    gc.freeze()  # what a forked worker inherited (the parent's CUDA arrays among it) is never collected here
    try:
        import flame_core
        flame_core.set_default_device("cpu")
        flame_core.set_num_threads(1)
        seed = seed_worker(base_seed, worker_id)
        _worker_info = WorkerInfo(worker_id, num_workers, seed, dataset)
        fetcher_cls = IterableFetcher if iterable else MapFetcher
        init_error = fetcher = None
        try:
            if init_fn is not None:
                init_fn(worker_id)
            fetcher = fetcher_cls(dataset, auto_collation, collate_fn, drop_last)
        except Exception:
            init_error = ExceptionWrapper(sys.exc_info(), f"in DataLoader worker process {worker_id}")
        ended = False
        while True:
            try:
                r = index_queue.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if os.getppid() != parent_pid:  # the parent is gone: nobody will read our results
                    break
                continue
            if isinstance(r, ResumeIteration):
                ended = False
                if iterable and init_error is None:
                    fetcher = fetcher_cls(dataset, auto_collation, collate_fn, drop_last)
                data_queue.put((r, None))
                continue
            if r is None:  # shut down
                break
            if done_event.is_set() or ended:
                continue
            idx, index = r
            if init_error is not None:
                data, init_error = init_error, None
            else:
                try:
                    data = fetcher.fetch(index)
                except StopIteration:
                    if not iterable:
                        data = ExceptionWrapper(sys.exc_info(), f"in DataLoader worker process {worker_id}")
                    else:
                        data, ended = IterableStop(worker_id), True
                except Exception:
                    data = ExceptionWrapper(sys.exc_info(), f"in DataLoader worker process {worker_id}")
            data_queue.put((idx, _packed(data, worker_id)))
            del data, r
    except KeyboardInterrupt:
        pass
    if done_event.is_set():
        data_queue.cancel_join_thread()
        data_queue.close()
