"""The CuPy warm-up's worker processes, the parent's side (flame_core/kernels/cupy_warmup.py uses it).

Why processes: the warm-up's threads compile in parallel only on paper. On the H200 the 94 compiles of the demo summed
117 s on 8 threads against 24.8 s one at a time (BENCHMARKS.md, "Cold start"): something in one process's compile
path serialises them. Each worker process (cupy_compile_worker.py) has its own NVRTC and its own interpreter.

The pool stays the warm-up's WarmPool (its queue, order, and the process's claim: a queued request is taken back
and compiled by the caller, one compiling is waited for); only what a pool thread does with a job changes: each
thread drives one worker process, sends it the job and waits for its answer. The worker writes the result into CuPy's
disk cache (the parent's folder), where the process then loads it. A worker that cannot start, dies, or answers
nothing within `job_timeout` is dropped (killed if alive) and its thread compiles in this process instead, as the
thread pool does: the warm-up never fails the run and never leaves the caller waiting longer than `job_timeout`.

A worker has no CUDA context (cupy_compile_worker.py says how): it costs host memory (an interpreter, CuPy, NVRTC's
working memory) and one CPU while it compiles, never GPU memory. At the end of the queue each worker's stdin is
closed and it exits; once the main thread has finished (the interpreter is exiting) a thread stops waiting within
`POLL` seconds, closes its worker's stdin and leaves: a worker still compiling finishes that one request (its cache
file is whole or absent) and exits on its own."""
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cupy_compile_worker.py")
READY_TIMEOUT = 60.0  # seconds for a worker to start (an interpreter and CuPy's import)
JOB_TIMEOUT = 60.0    # seconds for one compile (a CuPy kernel takes well under one)
POLL = 0.05           # how often a waiting thread looks whether the main thread has finished


class WorkerError(RuntimeError):
    """A worker that could not start, died, or went silent."""


class Abandoned(RuntimeError):
    """The main thread finished while a thread waited for its worker."""


class Worker:
    """One worker process: started with `init` (a dict, the worker's first line), then `run(job)` per job."""

    def __init__(self, init, env=None, ready_timeout=READY_TIMEOUT, job_timeout=JOB_TIMEOUT):
        self.job_timeout = job_timeout
        self._err = tempfile.TemporaryFile()
        self._buf = b""
        self.proc = subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env, close_fds=True)
        try:
            self._send(init)
            msg = self._receive(ready_timeout)
            if not msg.get("ready"):
                raise WorkerError(f"the worker did not start: {msg.get('error')}")
        except BaseException:
            self.kill()
            raise
        self.facts = msg

    def run(self, job):
        """The worker's answer to `job` (a dict with "ok"); WorkerError when it died or took over job_timeout
        (it is killed then), Abandoned when the main thread finished meanwhile."""
        self._send(job)
        return self._receive(self.job_timeout)

    def _send(self, msg):
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            raise WorkerError(f"the worker is gone ({e}){self._stderr_tail()}") from e

    def _receive(self, timeout):
        fd = self.proc.stdout.fileno()
        main = threading.main_thread()
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            if not main.is_alive():
                raise Abandoned("the main thread has finished")
            left = end - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"no answer from the worker within {timeout:g} s (killed)")
            ready, _, _ = select.select([fd], [], [], min(POLL, left))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    rc = self.proc.wait()
                    raise WorkerError(f"the worker exited (code {rc}){self._stderr_tail()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _stderr_tail(self, n=600):
        try:
            self._err.seek(0)
            tail = self._err.read().decode(errors="replace").strip()[-n:]
        except (OSError, ValueError):
            return ""
        return f": {tail}" if tail else ""

    def close(self, wait=None):
        """Close the worker's stdin (it exits after the job it is on); with `wait`, wait that many seconds for it
        and kill it after."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if wait is not None:
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.kill()
        self._err.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def job_message(payload):
    """The worker's job for a warm-up payload (source, options, kw): CuPy's headers travel as a flag (the worker
    holds the same ones; the init checked their SHA-1)."""
    source, options, kw = payload
    ne = kw.get("name_expressions")
    return {"source": source, "options": list(options), "headers": kw.get("extra_source") is not None,
            "backend": kw.get("backend", "nvrtc"), "name_expressions": None if ne is None else list(ne),
            "jitify": bool(kw.get("jitify", False)),
            "enable_cooperative_groups": bool(kw.get("enable_cooperative_groups", False))}


class ProcessSlots:
    """What the WarmPool's threads do in the process pool: `thread_init` starts this thread's worker (`make_init()`
    gives its init message, after `setup()` ran in this thread), `compile(payload)` hands the job to it -- or, with
    no worker (it could not start, or died), to `fallback(payload)` in this process -- and `thread_exit` closes it.
    `counters` gains: processes (workers that started), worker_failures, worker_error (the first reason),
    worker_seconds (compile seconds the workers reported), worker_contexts (answers from a worker with a CUDA
    context current: 0 expected), in_process (jobs compiled in this process)."""

    def __init__(self, make_init, fallback, counters, setup=None, env=None, ready_timeout=READY_TIMEOUT,
                 job_timeout=JOB_TIMEOUT):
        self._make_init, self._fallback, self._setup, self._env = make_init, fallback, setup, env
        self._ready_timeout, self._job_timeout = ready_timeout, job_timeout
        self.stats = counters
        self.stats.update(processes=0, worker_failures=0, worker_error=None, worker_seconds=0.0, worker_contexts=0,
                          in_process=0)
        self._lock = threading.Lock()
        self._local = threading.local()
        self.workers = []

    def _failed(self, e):
        with self._lock:
            self.stats["worker_failures"] += 1
            if self.stats["worker_error"] is None:
                self.stats["worker_error"] = str(e)[:1000]

    def thread_init(self):
        if self._setup is not None:
            self._setup()
        self._local.worker = None
        try:
            w = Worker(self._make_init(), env=self._env, ready_timeout=self._ready_timeout,
                       job_timeout=self._job_timeout)
        except Abandoned:
            return
        except Exception as e:  # this thread compiles in-process (the thread pool's way)
            self._failed(e)
            return
        self._local.worker = w
        with self._lock:
            self.workers.append(w)
            self.stats["processes"] += 1

    def compile(self, payload):
        w = getattr(self._local, "worker", None)
        if w is None:
            self._fallback(payload)
            with self._lock:
                self.stats["in_process"] += 1
            return
        try:
            msg = w.run(job_message(payload))
        except WorkerError as e:  # died or went silent: this thread compiles in-process from here on
            self._failed(e)
            self._local.worker = None
            w.close(wait=1.0)
            raise
        with self._lock:
            self.stats["worker_seconds"] += float(msg.get("s", 0.0))
            self.stats["worker_contexts"] += bool(msg.get("ctx"))
        if not msg.get("ok"):
            raise RuntimeError(msg.get("error"))

    def thread_exit(self):
        w = getattr(self._local, "worker", None)
        if w is not None:
            self._local.worker = None
            w.close(wait=5.0 if threading.main_thread().is_alive() else None)
