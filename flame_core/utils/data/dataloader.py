"""DataLoader (PyTorch's arguments and semantics) with a single-process and a multi-process iterator.

Worker processes (num_workers > 0): each has an index queue; all put their results on one queue. The parent keeps
prefetch_factor * num_workers batches in flight, hands them out round robin and returns them in sampler order,
holding early arrivals (map-style datasets) -- so batches come in the same order as with num_workers=0. With an
IterableDataset each worker iterates its own copy (split it with get_worker_info()), and batches alternate between
the workers that are not exhausted. An exception in a worker is raised again in the parent with the worker's
traceback, after the workers are shut down; so is Ctrl-C, and an exception that ends a worker outside a fetch (under
spawn, a dataset the worker cannot unpickle or import); a worker that dies silently is reported by pid and exit code.
pin_memory=True copies each batch's cpu tensors into FLAME's pinned host pool (only where CUDA is available, as
PyTorch) in the parent process, as the batch is handed out.
"""
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import warnings

from ... import backend
from ...random import default_generator
from .collate import default_collate, default_convert
from .dataset import IterableDataset
from .pin_memory import pin_memory as _pin
from .sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler
from .worker import (
    POLL_INTERVAL,
    STATUS_INTERVAL,
    ExceptionWrapper,
    IterableFetcher,
    IterableStop,
    MapFetcher,
    ResumeIteration,
    WorkerFailed,
    worker_main,
)


class _InfiniteConstantSampler(Sampler):
    """The sampler of an IterableDataset: None forever (the dataset decides when to stop)."""

    def __iter__(self):
        while True:
            yield None


class DataLoader:
    """Batches of `dataset`: `for batch in DataLoader(ds, batch_size=32, shuffle=True, generator=g)`."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, num_workers=0,
                 collate_fn=None, pin_memory=False, drop_last=False, timeout=0, worker_init_fn=None,
                 multiprocessing_context=None, generator=None, *, prefetch_factor=None, persistent_workers=False):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable "
                             "multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if timeout > 0 and num_workers == 0:
            raise ValueError("timeout bounds the wait for a worker process's batch: it needs num_workers > 0")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing. Let num_workers > 0 "
                             "to enable multiprocessing, otherwise set prefetch_factor to None.")
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ValueError("prefetch_factor option should be a positive integer")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable:
            if shuffle not in (None, False):
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
                                 f"shuffle={shuffle}")
            if sampler is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler option, but got "
                                 f"sampler={sampler}")
            if batch_sampler is not None:
                raise ValueError(f"DataLoader with IterableDataset: expected unspecified batch_sampler option, but "
                                 f"got batch_sampler={batch_sampler}")
        else:
            shuffle = bool(shuffle)
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
                                 "drop_last")
            batch_size, drop_last = None, False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with "
                             "drop_last")
        if sampler is None:
            if self._iterable:
                sampler = _InfiniteConstantSampler()
            elif shuffle:
                sampler = RandomSampler(dataset, generator=generator)
            else:
                sampler = SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        if collate_fn is None:
            collate_fn = default_collate if batch_sampler is not None else default_convert
        if isinstance(multiprocessing_context, str):
            multiprocessing_context = mp.get_context(multiprocessing_context)
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler, self.batch_sampler, self.num_workers = sampler, batch_sampler, num_workers
        self.collate_fn, self.pin_memory, self.timeout = collate_fn, bool(pin_memory), timeout
        self.worker_init_fn, self.multiprocessing_context = worker_init_fn, multiprocessing_context
        self.generator, self.prefetch_factor, self.persistent_workers = generator, prefetch_factor, persistent_workers
        self._iterator = None
        if self.pin_memory and not backend.cuda_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device pinned "
                          "memory won't be used.", UserWarning, stacklevel=2)

    @property
    def _auto_collation(self):
        return self.batch_sampler is not None

    @property
    def _index_sampler(self):
        return self.batch_sampler if self._auto_collation else self.sampler

    def _pins(self):
        return self.pin_memory and backend.cuda_available()

    def __len__(self):
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is not None:
                n = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
            return n
        return len(self._index_sampler)

    def __iter__(self):
        if self.num_workers == 0:
            return _SingleProcessIter(self)
        if self.persistent_workers:
            if self._iterator is None:
                self._iterator = _MultiProcessIter(self)
            else:
                self._iterator._reset(self)
            return self._iterator
        return _MultiProcessIter(self)

    def _base_seed(self):
        gen = self.generator if self.generator is not None else default_generator("cpu")
        return int(gen._integers(0, 2 ** 62, ()))


class _BaseIter:
    def __init__(self, loader):
        self._loader = loader
        self._auto_collation = loader._auto_collation
        self._sampler_iter = iter(loader._index_sampler)
        self._base_seed = loader._base_seed()
        self._pin = loader._pins()

    def __iter__(self):
        return self

    def _next_index(self):
        return next(self._sampler_iter)

    def __len__(self):
        return len(self._loader)


class _SingleProcessIter(_BaseIter):
    def __init__(self, loader):
        super().__init__(loader)
        cls = IterableFetcher if loader._iterable else MapFetcher
        self._fetcher = cls(loader.dataset, self._auto_collation, loader.collate_fn, loader.drop_last)

    def __next__(self):
        index = self._next_index()
        data = self._fetcher.fetch(index)
        return _pin(data) if self._pin else data


class _MultiProcessIter(_BaseIter):
    def __init__(self, loader):
        super().__init__(loader)
        self._shutdown = True  # until the workers exist
        n = self._num_workers = loader.num_workers
        self._prefetch = loader.prefetch_factor
        self._timeout = loader.timeout
        self._persistent = loader.persistent_workers
        ctx = loader.multiprocessing_context or mp.get_context()
        self._done_event = ctx.Event()
        self._data_queue = ctx.Queue()
        self._index_queues, self._workers = [], []
        args = (loader._iterable, loader.dataset, self._auto_collation, loader.collate_fn, loader.drop_last,
                self._base_seed, loader.worker_init_fn)
        if ctx.get_start_method() != "fork":
            try:  # unpickled by the worker itself, which reports what fails there (worker_main)
                args = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - e.g. a multiprocessing object: only the spawning pickler takes it
                pass
        try:
            for w in range(n):
                iq = ctx.Queue()
                iq.cancel_join_thread()  # a dead worker's unread indices must not block our exit
                p = ctx.Process(target=worker_main, daemon=True,
                                args=(args, iq, self._data_queue, self._done_event, w, n, os.getpid()))
                p.start()
                self._index_queues.append(iq)
                self._workers.append(p)
        except BaseException:
            self._shutdown = False
            self._shutdown_workers()
            raise
        self._shutdown = False
        self._reset(loader, first_iter=True)

    def _reset(self, loader, first_iter=False):
        self._sampler_iter = iter(loader._index_sampler)
        self._send_idx = self._rcvd_idx = 0
        self._task_info = {}
        self._outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._worker_cycle = itertools.cycle(range(self._num_workers))
        if not first_iter:  # persistent workers: a new epoch; wait until every worker has acknowledged
            for iq in self._index_queues:
                iq.put(ResumeIteration())
            pending = self._num_workers
            while pending:
                r = self._get()
                if isinstance(r[0], ResumeIteration):
                    pending -= 1
        for _ in range(self._prefetch * self._num_workers):
            self._put_index()

    def _put_index(self):
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):
            w = next(self._worker_cycle)
            if self._workers_status[w]:
                break
        else:
            return  # every worker is exhausted (IterableDataset)
        self._index_queues[w].put((self._send_idx, index))
        self._task_info[self._send_idx] = (w,)
        self._outstanding += 1
        self._send_idx += 1

    def _get(self):
        """(idx, payload) from the result queue, checking the workers while waiting."""
        waited = 0.0
        while True:
            step = STATUS_INTERVAL if self._timeout <= 0 else min(STATUS_INTERVAL, self._timeout - waited)
            try:
                return self._checked(self._data_queue.get(timeout=step))
            except queue.Empty:
                waited += step
                dead = [p for p, alive in zip(self._workers, self._workers_status) if alive and not p.is_alive()]
                if dead:
                    try:  # its last words may have arrived since the wait ended
                        return self._checked(self._data_queue.get(timeout=0.1))
                    except queue.Empty:
                        pass
                    how = ", ".join(f"{p.pid}: " + (f"killed by signal {-p.exitcode}" if p.exitcode < 0 else
                                                    f"exit code {p.exitcode}") for p in dead)
                    raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(str(p.pid) for p in dead)}) exited "
                                       f"unexpectedly ({how}), saying nothing: see its output above") from None
                if self._timeout > 0 and waited >= self._timeout:
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None

    @staticmethod
    def _checked(result):
        """A result from the queue; a worker's report that an exception ended it is raised here."""
        if isinstance(result[0], WorkerFailed):
            pickle.loads(result[1]).reraise()
        return result

    def __next__(self):
        try:
            return self._next_data()
        except StopIteration:
            if not self._persistent:
                self._shutdown_workers()
            raise
        except BaseException:  # a worker's error, a dead worker, Ctrl-C: leave no worker behind
            self._shutdown_workers()
            raise

    def _next_data(self):
        if self._shutdown:
            raise StopIteration
        while True:
            while self._rcvd_idx < self._send_idx:  # skip the tasks of exhausted workers
                info = self._task_info.get(self._rcvd_idx)
                if info is not None and (len(info) == 2 or self._workers_status[info[0]]):
                    break
                self._task_info.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
            else:
                raise StopIteration
            info = self._task_info[self._rcvd_idx]
            if len(info) == 2:  # arrived earlier, out of order
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._process(info[1])
            idx, payload = self._get()
            if isinstance(idx, ResumeIteration):
                continue
            self._outstanding -= 1
            data = pickle.loads(payload)
            if isinstance(data, IterableStop):
                self._workers_status[data.worker_id] = False
                self._put_index()
                continue
            if idx != self._rcvd_idx:
                self._task_info[idx] += (data,)
                continue
            del self._task_info[idx]
            self._rcvd_idx += 1
            return self._process(data)

    def _process(self, data):
        self._put_index()
        if isinstance(data, ExceptionWrapper):
            data.reraise()
        return _pin(data) if self._pin else data

    def _shutdown_workers(self):
        if self._shutdown:
            return
        self._shutdown = True
        try:
            self._done_event.set()
            for iq in self._index_queues:
                try:
                    iq.put(None)
                except Exception:
                    pass
            for p in self._workers:
                p.join(timeout=POLL_INTERVAL)
            for iq in self._index_queues:
                iq.close()
            self._data_queue.cancel_join_thread()
            self._data_queue.close()
        finally:
            for p in self._workers:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=1.0)

    def __del__(self):
        try:
            self._shutdown_workers()
        except Exception:
            pass
