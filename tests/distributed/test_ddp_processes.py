"""DistributedDataParallel across real processes on the "store" backend, started by the launcher: after a few SGD
steps every rank holds the same parameters, equal (to float32 rounding) to one process training on the whole
global batches -- with gradient checkpointing (a block used twice: two accumulations per backward), with gradient
accumulation under no_sync, on 2 and 3 ranks. Each rank also reports the bucket all-reduces it issued."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .conftest import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "scripts", "ddp_train.py")


def run(tmp_path, world, *args):
    out = str(tmp_path / "r.json")
    r = subprocess.run([sys.executable, "-m", "flame_core.distributed.run", "--nproc-per-node", str(world), SCRIPT,
                        out, *args], cwd=ROOT, env=cpu_env(ROOT),
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return [json.load(open(f"{out}.rank{k}")) for k in range(world)]


@pytest.mark.parametrize("world,args,expected", [
    (2, ["--ckpt"], [1, 1, 2, 2, 2, 2, 1, 1]),        # the checkpointed block's parameters: 2 per backward
    (3, ["--accum", "2"], [1] * 8),
])
def test_ranks_agree_with_one_process_on_the_global_batch(tmp_path, world, args, expected):
    res = run(tmp_path, world, "--steps", "3", *args)
    ref = res[0]["reference"]
    for r in res:
        assert r["expected"] == expected
        for name, want in ref.items():
            got = np.asarray(r["params"][name])
            assert np.array_equal(got, np.asarray(res[0]["params"][name])), (r["rank"], name)  # bit-identical
            np.testing.assert_allclose(got, np.asarray(want), rtol=2e-6, atol=2e-7, err_msg=name)
    n = res[0]["buckets"]
    assert n == 6  # tiny caps: several buckets
    steps = 3
    # each bucket once per optimizer step (at its last micro-step), in bucket order, the same on every rank
    micro = 2 if "--accum" in args else 1
    for r in res:
        assert r["launches"] == [[micro * s + micro - 1, b] for s in range(steps) for b in range(n)]
    st = res[0]["stats"]
    assert st["synced_passes"] == steps
    # the first backward learns the counts (buckets at its end); the later ones overlap every bucket
    if "--accum" in args:  # the learning pass was a no_sync micro-step: every synced pass overlaps
        assert st == {"synced_passes": 3, "buckets_overlapped": 3 * n, "buckets_at_end": 0}
    else:
        assert st == {"synced_passes": 3, "buckets_overlapped": 2 * n, "buckets_at_end": n}
