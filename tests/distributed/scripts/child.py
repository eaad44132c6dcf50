"""A child for tests/distributed/test_launcher.py: `child.py MODE OUTDIR [args]` under flame_core.distributed.run.

env      write this rank's distributed environment to OUTDIR/rank<R>.json; one line on stdout and one on stderr
fail     rank args[0] exits with code args[1] after 0.3 s; the others write OUTDIR/rank<R>.started and sleep 60 s
killed   rank args[0] kills itself with SIGKILL; the others sleep 60 s
stubborn rank 0 fails with code 3 at once; the others ignore SIGTERM and sleep 60 s (the launcher must SIGKILL them)
signal   write OUTDIR/rank<R>.ready, then wait; on SIGTERM write OUTDIR/rank<R>.sigterm and exit 0
"""
import json
import os
import signal
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])


def touch(name):
    with open(os.path.join(out, f"rank{rank}.{name}"), "w") as f:
        f.write(str(os.getpid()))


if mode == "env":
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES", "FLAME_STORE_SECRET")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    print(f"out of {rank}")
    print(f"err of {rank}", file=sys.stderr)
elif mode in ("fail", "killed"):
    if rank == int(sys.argv[3]):
        time.sleep(0.3)
        if mode == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(sys.argv[4]))
    touch("started")
    time.sleep(60)
    touch("finished")
elif mode == "stubborn":
    if rank == 0:
        time.sleep(0.3)
        sys.exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    touch("started")
    time.sleep(60)
    touch("finished")
elif mode == "signal":
    def on_term(signum, frame):
        touch("sigterm")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    touch("ready")
    time.sleep(60)
    touch("finished")
