"""bench/budgets.py on the CPU: its command line (bad values exit 2 with one line), the runs it plans, and the table
it makes from its runs' results (the hidden share from the unconstrained run). The runs themselves need the GPU."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import budgets  # noqa: E402


def cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "budgets.py"), *args], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.mark.parametrize("args, word", [(["--families", "sdxl"], "--families"), (["--budgets", "4,x"], "--budgets"),
                                        (["--storages", "fp16"], "--storages"), (["--offload", "maybe"], "--offload"),
                                        (["--budgets", "-4"], "--budgets")])
def test_bad_values_exit_2_with_one_line(args, word):
    r = cli(*args, "--dry-run")
    assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_runs_come_unconstrained_first_then_each_budget_per_offload_mode():
    a = budgets.parse_args(["--budgets", "6,4,none", "--storages", "fp8", "--offload", "auto,off"])
    runs = budgets.plan_runs(a)
    assert [(r["budget"], r["offload"]) for r in runs] == [(None, "auto"), (4, "auto"), (4, "off"), (6, "auto"),
                                                            (6, "off")]


def test_the_table_gives_the_hidden_share_against_the_unconstrained_run():
    def run(budget, ms, copy_s=None, **extra):
        tag = "fp8_resident" if budget is None else f"fp8_{budget}GiB"
        res = {f"{tag}_step_ms": ms, f"{tag}_driver_peak_GiB": 3.9, f"{tag}_resident_blocks": 0,
               f"{tag}_streamed_blocks": 57, f"{tag}_h2d_s_per_step": copy_s}
        res.update({f"{tag}_{k}": v for k, v in extra.items()})
        return {"spec": dict(family="flux", storage="fp8", budget=budget, offload="auto"), "results": res,
                "host_peak_rss_GiB": 30.1, "error": None}
    runs = [run(None, 800.0), run(4, 900.0, copy_s=0.5, offload_activations=True),
            {"spec": dict(family="flux", storage="fp8", budget=3, offload="off"), "results": {}, "host_peak_rss_GiB": 1,
             "error": "MemoryBudgetError: below the minimum"}]
    rows, summary = budgets.rows_of(runs)
    assert summary[1]["hidden"] == 0.8  # 1 - (900 - 800) ms / 500 ms of copies
    assert summary[1]["offload_activations"] and summary[0]["hidden"] is None
    assert "below the minimum" in summary[2]["error"]
    text = budgets.report(runs)
    assert "80%" in text and "4 GiB" in text and "30.1" in text
