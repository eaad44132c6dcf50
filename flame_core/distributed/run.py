"""The launcher: one process per GPU, the distributed environment set, signals forwarded, all-or-nothing exit.

    python -m flame_core.distributed.run --nproc-per-node 2 train.py --config my.yaml
    python -m flame_core.distributed.run --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py        # on the first of two machines (node-rank 1 on
                                                                     # the other)

Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (GROUP_RANK), MASTER_ADDR, MASTER_PORT,
FLAME_STORE_SECRET and PYTHONUNBUFFERED=1; CUDA_VISIBLE_DEVICES is left as it is (LOCAL_RANK chooses the GPU). On one
machine a free port is chosen when --master-port is not given, and a fresh random secret for the store (unless
FLAME_STORE_SECRET is set); with several machines, FLAME_STORE_SECRET must be set, the same on every one. Output lines
are prefixed with "[rankN]: " (--no-prefix: the children write to this terminal directly).

SIGINT and SIGTERM are forwarded to every child (the children run in a session of their own, so a Ctrl-C reaches
them once, through here); a child exits when this launcher dies (Linux). When a child fails (non-zero exit or killed
by a signal), the others get SIGTERM, then SIGKILL after --kill-timeout seconds, and the launcher exits with the
failed rank's code (128 + N for a signal N).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .store_wire import MIN_SECRET, SECRET_ENV, new_secret

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child, before exec: get SIGKILL when the launcher dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:  # noqa: BLE001 - not Linux: children may outlive a killed launcher
        pass


def _pump(stream, out, prefix, lock):
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def exit_code(returncode):
    """A child's return code as a shell would report it (signals as 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m flame_core.distributed.run",
                                 description="Start one process per GPU with the distributed environment set.")
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                    help="processes on this machine (one per GPU)")
    ap.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index (0..nnodes-1)")
    ap.add_argument("--master-addr", "--master_addr", default=None,
                    help="address of node 0, reachable from every machine (default: localhost on one machine)")
    ap.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="a free TCP port on node 0 (default: a free one on one machine, 29500 on several)")
    ap.add_argument("--kill-timeout", type=float, default=10.0,
                    help="seconds between SIGTERM and SIGKILL when stopping the other ranks after a failure")
    ap.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with the rank")
    ap.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m target)")
    ap.add_argument("target", help="the script (or module with -m)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = ap.parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        ap.error(f"need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes (got "
                 f"{a.nproc_per_node}, {a.nnodes}, {a.node_rank})")
    if a.nnodes > 1 and not a.master_addr:
        ap.error("--master-addr is required with --nnodes > 1 (the address of node 0, reachable from every node)")
    if not a.module and not os.path.exists(a.target):
        ap.error(f"no such script: {a.target}")
    secret = os.environ.get(SECRET_ENV, "")
    if a.nnodes > 1 and not secret:
        ap.error(f"--nnodes > 1 needs {SECRET_ENV} set to the same random value on every node (the ranks prove it "
                 f"to rank 0's store), e.g. export {SECRET_ENV}=$(python -c 'import secrets; "
                 f"print(secrets.token_hex(32))')")
    if secret and len(secret) < MIN_SECRET:
        ap.error(f"{SECRET_ENV} has {len(secret)} characters; use at least {MIN_SECRET}")
    return a


def child_env(a, local_rank, port, secret):
    env = dict(os.environ)
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # our children host their own store on MASTER_PORT
    env.update({"RANK": str(a.node_rank * a.nproc_per_node + local_rank),
                "WORLD_SIZE": str(a.nnodes * a.nproc_per_node), "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(a.nproc_per_node), "NODE_RANK": str(a.node_rank),
                "GROUP_RANK": str(a.node_rank), "MASTER_ADDR": a.master_addr or "localhost",
                "MASTER_PORT": str(port), SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"})
    return env


class Launcher:
    def __init__(self, a):
        self.a = a
        self.port = a.master_port or (_free_port() if a.nnodes == 1 else 29500)
        self.secret = os.environ.get(SECRET_ENV) or new_secret()  # parse_args made sure several nodes have one
        self.procs, self.pumps = [], []
        self.lock = threading.Lock()
        self.signals = []

    def _forward(self, signum, frame):
        self.signals.append(signum)
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def start(self):
        a = self.a
        cmd = [sys.executable, "-u"] + (["-m", a.target] if a.module else [a.target]) + list(a.args)
        pipe = None if a.no_prefix else subprocess.PIPE
        for local in range(a.nproc_per_node):
            env = child_env(a, local, self.port, self.secret)
            p = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, start_new_session=True,
                                 preexec_fn=_die_with_parent)
            p.rank = int(env["RANK"])
            self.procs.append(p)
            if pipe is not None:
                prefix = f"[rank{p.rank}]: ".encode()
                for stream, out in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(stream, out, prefix, self.lock), daemon=True)
                    t.start()
                    self.pumps.append(t)

    def _stop_others(self, failed):
        live = [p for p in self.procs if p is not failed and p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.a.kill_timeout
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in live:
            if p.poll() is None:
                p.kill()
        for p in live:
            p.wait()

    def wait(self):
        """Until every child exited; the job's exit code."""
        failed = None
        while True:
            running = False
            for p in self.procs:
                rc = p.poll()
                if rc is None:
                    running = True
                elif rc != 0 and failed is None:
                    failed = p
            if failed is not None:
                self._say(f"rank {failed.rank} exited with code {exit_code(failed.returncode)}"
                          + ("" if all(p.poll() is not None for p in self.procs) else
                             "; stopping the other ranks"))
                self._stop_others(failed)
                break
            if not running:
                break
            time.sleep(0.05)
        for t in self.pumps:
            t.join(timeout=5)
        return 0 if failed is None else exit_code(failed.returncode)

    def _say(self, msg):
        with self.lock:
            sys.stderr.write(f"flame_core.distributed.run: {msg}\n")
            sys.stderr.flush()


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(a)
    previous = {s: signal.signal(s, launcher._forward) for s in FORWARDED}
    try:
        launcher.start()
        return launcher.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
