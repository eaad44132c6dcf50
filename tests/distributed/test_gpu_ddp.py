"""On two GPUs (skipped otherwise), through the launcher and NCCL: the collectives and a graph-captured DDP step are
right; the same LoRA step on 2 ranks equals one rank with twice the batch (loss and gradients within bf16
tolerance); a 2-rank trainer run equals a 1-GPU run of twice the batch and resumes to the same parameters as an
uninterrupted one."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flame_core as flame

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "distributed", "scripts")
# a rank still running after 60 s prints its threads' stacks (a hung collective shows where each rank waits)
ENV = {**os.environ, "PYTHONPATH": ROOT, "FLAME_DIST_HANG_DUMP": "60"}


def two_gpus():
    return flame.cuda_is_available() and flame.cuda_device_count() >= 2


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]


def launch(world, script, *args, timeout=180, via_launcher=False):
    cmd = [sys.executable, "-m", "flame_core.distributed.run", "--nproc-per-node", str(world),
           os.path.join(SCRIPTS, script), *args]
    if world == 1 and not via_launcher:
        cmd = [sys.executable, os.path.join(SCRIPTS, script), *args]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:   # a hung collective: fail with what the ranks printed so far
        tail = lambda b: (b or b"").decode(errors="replace")[-8000:]  # noqa: E731
        pytest.fail(f"{script} on {world} rank(s) did not finish in {timeout} s\nstdout: {tail(e.stdout)}\n"
                    f"stderr: {tail(e.stderr)}")
    assert r.returncode == 0, (r.stdout.decode()[-2000:], r.stderr.decode()[-4000:])
    return r


def test_nccl_collectives_and_a_captured_ddp_step(tmp_path):
    launch(2, "gpu_collectives.py", str(tmp_path / "c"))
    for rank in range(2):
        res = json.load(open(tmp_path / f"c.rank{rank}.json"))
        assert "exception" not in res, res["exception"]
        bad = {k: v for k, v in res.items() if v is not True}
        assert not bad, (rank, bad)
        assert "ddp_step4_graph" in res and "all_reduce_AVG_flame.bfloat16" in res


def train(tmp_path, tag, name, world, *args):
    launch(world, "train_tiny.py", str(tmp_path / tag), str(tmp_path / "runs"), name, "--device", "cuda", *args)
    return [dict(np.load(tmp_path / f"{tag}.rank{k}.npz")) for k in range(world)]


def test_lora_step_on_two_ranks_equals_one_rank_with_twice_the_batch(tmp_path):
    one = train(tmp_path, "one", "g1", 1, "--batch", "2", "--bf16", "--ckpt", "--grads")[0]
    two = train(tmp_path, "two", "g2", 2, "--batch", "1", "--bf16", "--ckpt", "--grads")
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=2e-2)
    grads = [k for k in one if k.startswith("g/")]
    assert grads and any(np.abs(one[k]).max() > 0 for k in grads)
    for k in grads:
        scale = np.abs(one[k]).max()
        for r in two:
            assert np.abs(r[k] - one[k]).max() <= 3e-2 * scale + 1e-8, (k, np.abs(r[k] - one[k]).max(), scale)
        assert np.array_equal(two[0][k], two[1][k])  # the average is the same bits on both ranks


def test_trainer_on_two_gpus_equals_one_gpu_with_twice_the_batch(tmp_path):
    one = train(tmp_path, "one", "t1", 1, "--batch", "2", "--steps", "4", "--bf16")[0]
    two = train(tmp_path, "two", "t2", 2, "--batch", "1", "--steps", "4", "--bf16")
    for r in (one, *two):   # the steps ran as CUDA graphs (the DDP all-reduces captured in them)
        assert str(r["graph_failure"]) == "" and int(r["graphs_captured"]) == 1, (r["graph_failure"],
                                                                                r["graphs_captured"])
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=3e-2)
    keys = [k for k in one if k.startswith("p/")]
    diff = np.concatenate([np.abs(two[0][k] - one[k]).ravel() for k in keys])
    # AdamW moves each element by about lr (3e-3) per step whatever the gradient's size: an element whose tiny
    # gradient differs in sign under bf16 rounding may end up to 4 lr apart; the bulk must agree closely
    assert diff.max() <= 4 * 3e-3 * 1.05 and np.mean(diff) < 5e-4, (diff.max(), np.mean(diff))
    for k in keys:
        assert np.array_equal(two[0][k], two[1][k]), k


def test_two_rank_run_resumes_to_the_parameters_of_an_uninterrupted_one(tmp_path):
    full = train(tmp_path, "full", "u", 2, "--batch", "1", "--steps", "6", "--bf16")
    train(tmp_path, "a", "r", 2, "--batch", "1", "--steps", "3", "--bf16")    # checkpoint at 3, the run ends
    resumed = train(tmp_path, "b", "r", 2, "--batch", "1", "--steps", "6", "--bf16")
    np.testing.assert_allclose(resumed[0]["losses"], full[0]["losses"], rtol=1e-5)
    for k in (k for k in full[0] if k.startswith("p/")):
        np.testing.assert_allclose(resumed[0][k], full[0][k], rtol=1e-5, atol=1e-6, err_msg=k)
