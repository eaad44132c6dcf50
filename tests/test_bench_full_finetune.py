"""bench/full_finetune.py on the CPU: bad --budgets exit 2 with one line; the smoke run (flux-tiny at 64²) trains
in full under a budget (every block updated inside backward) and unconstrained, each run in its own process, and
writes its figures. The Flux-dev runs and the diffusers peer need the GPU."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, out):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "OUT": str(out)}
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "full_finetune.py"), *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("budgets", ["24,x", "-1", "0"])
def test_bad_budgets_exit_2_with_one_line(tmp_path, budgets):
    r = cli("--budgets", budgets, out=tmp_path)
    assert r.returncode == 2 and "--budgets" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_smoke_run_trains_in_full_under_a_budget_and_unconstrained(tmp_path):
    if os.environ.get("FLAME_DEVICE") == "cuda":
        pytest.skip("the smoke run is the cpu's; the GPU runs the bench itself")
    r = cli("--small", "--budgets", "0.5,none", "--repeats", "2", "--warmup", "1", out=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "full_finetune.json") as f:
        got = json.load(f)["results"]
    budget, resident = got["flame_0.5GiB"], got["flame_resident"]
    for run in (budget, resident):
        assert run["error"] is None and run["loss_finite"] and run["step_ms"] > 0 and len(run["step_ms_all"]) == 2
        assert run["trained_parameters"] > 400_000
    assert budget["block_updates_per_step"] == budget["resident_blocks"] + budget["streamed_blocks"] == 4
    assert "block_updates_per_step" not in resident
