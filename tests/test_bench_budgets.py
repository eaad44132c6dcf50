"""bench/budgets.py on the CPU: its command line (bad values exit 2 with one line), the runs it plans, the table it
makes from its runs' results (the hidden share from the unconstrained run), the matrix merged over calls and rendered
(bench/budget_matrix.py), and the trainer families' runs on tiny presets (cpu). The full-size runs need the GPU."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import budget_matrix  # noqa: E402
import budgets  # noqa: E402


def cli(*args, out=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if out is not None:
        env["OUT"] = str(out)  # (the runs' own results file goes there, not into the working directory)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "budgets.py"), *args], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.mark.parametrize("args, word", [(["--families", "sd2"], "--families"), (["--budgets", "4,x"], "--budgets"),
                                        (["--storages", "fp16"], "--storages"), (["--offload", "maybe"], "--offload"),
                                        (["--budgets", "-4"], "--budgets"), (["--device", "tpu"], "--device")])
def test_bad_values_exit_2_with_one_line(args, word):
    r = cli(*args, "--dry-run")
    assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_runs_come_unconstrained_first_then_each_budget_per_offload_mode():
    a = budgets.parse_args(["--budgets", "6,4,none", "--storages", "fp8", "--offload", "auto,off"])
    runs = budgets.plan_runs(a)
    assert [(r["budget"], r["offload"]) for r in runs] == [(None, "auto"), (4, "auto"), (4, "off"), (6, "auto"),
                                                            (6, "off")]


def run(budget, ms, copy_s=None, family="flux", offload="auto", gms=None, **extra):
    tag = "fp8_resident" if budget is None else f"fp8_{budget}GiB"
    res = {f"{tag}_step_ms": ms, f"{tag}_driver_peak_GiB": 3.9, f"{tag}_resident_blocks": 0,
           f"{tag}_streamed_blocks": 57, f"{tag}_h2d_s_per_step": copy_s}
    if gms is not None:
        res[f"{tag}_graph_step_ms"], res[f"{tag}_graph_driver_peak_GiB"] = gms, 3.8
    res.update({f"{tag}_{k}": v for k, v in extra.items()})
    return {"spec": dict(family=family, storage="fp8", budget=budget, offload=offload), "results": res,
            "host_peak_rss_GiB": 30.1, "error": None}


def test_the_table_gives_the_hidden_share_against_the_unconstrained_run():
    runs = [run(None, 800.0), run(4, 900.0, copy_s=0.5, offload_activations=True),
            {"spec": dict(family="flux", storage="fp8", budget=3, offload="off"), "results": {}, "host_peak_rss_GiB": 1,
             "error": "MemoryBudgetError: below the minimum"}]
    rows = budgets.rows_of(runs, {"commit": "abc1234", "date": "2026-12-02"})
    got = budget_matrix.with_hidden(rows)
    assert got[1]["hidden"] == 0.8  # 1 - (900 - 800) ms / 500 ms of copies
    assert got[1]["offload_activations"] and got[0].get("hidden") is None
    assert "below the minimum" in got[2]["error"] and rows[0]["commit"] == "abc1234"
    text = budgets.report(rows)
    assert "80%" in text and "4 GiB" in text and "30.1" in text


def test_a_capture_that_demoted_blocks_counts_them_as_streamed():
    rows = budgets.rows_of([run(4, 900.0, resident_blocks=3, streamed_blocks=54, graph_resident_blocks=2)])
    assert (rows[0]["resident"], rows[0]["streamed"]) == (2, 55)


def test_the_matrix_merges_calls_by_key_and_keeps_measured_rows_over_failures():
    first = budgets.rows_of([run(None, 800.0, gms=600.0), run(4, 900.0, copy_s=0.5, gms=700.0)], {"commit": "a"})
    second = budgets.rows_of([run(4, 950.0, copy_s=0.5), run(6, 850.0, copy_s=0.2),
                              run(None, None, family="sdxl")], {"commit": "b"})
    second[-1]["error"] = "RuntimeError: the capture failed"
    merged = budget_matrix.merge(first, second)
    by = {budget_matrix.key_of(r): r for r in merged}
    assert len(merged) == 4
    assert by[("flux", "fp8", 4, "auto")]["step_ms"] == 950.0 and by[("flux", "fp8", 4, "auto")]["commit"] == "b"
    assert by[("flux", "fp8", None, "auto")]["commit"] == "a"  # not run again: kept
    # a failed run does not wipe what an earlier call measured
    again = budget_matrix.merge(merged, [dict(by[("flux", "fp8", 6, "auto")], step_ms=None, graph_step_ms=None,
                                              error="OutOfMemoryError: x")])
    kept = {budget_matrix.key_of(r): r for r in again}[("flux", "fp8", 6, "auto")]
    assert kept["step_ms"] == 850.0 and kept["last_error"] == "OutOfMemoryError: x"
    # the hidden share uses the unconstrained row of the first call
    h = {budget_matrix.key_of(r): r for r in budget_matrix.with_hidden(again)}
    assert h[("flux", "fp8", 6, "auto")]["hidden"] == 0.75  # 1 - 50 ms / 200 ms


def test_the_matrix_renders_a_page_and_a_plot(tmp_path):
    rows = budgets.rows_of([run(None, 800.0, gms=600.0), run(4, 900.0, copy_s=0.5, gms=700.0),
                            run(None, 300.0, family="sdxl"), run(3, 330.0, family="sdxl", copy_s=0.1)])
    rows.append(dict(rows[-1], budget=2, step_ms=None, error="MemoryBudgetError: max_gpu_memory 2 GiB is below "
                                                             "the minimum"))
    paths = budget_matrix.write_all(rows, str(tmp_path))
    md = open(paths[1]).read()
    assert "| flux | fp8 |" in md and "700.0 / 3.8" in md and "300.0 / 3.9" in md and "does not fit" in md
    assert "budget_matrix.svg" in md and "| family | storage | 2 GiB | 3 GiB | 4 GiB | none |" in md
    root = ET.parse(paths[2]).getroot()  # well-formed SVG
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 2  # flux fp8 and sdxl fp8, two points each
    titles = [e.text for e in root.iter() if e.tag.endswith("title")]
    assert "flux fp8 4 GiB: 700.0 ms" in titles and "sdxl fp8 none: 300.0 ms" in titles
    assert json.load(open(paths[0]))["rows"] == rows
    assert budget_matrix.load(paths[0]) == rows


def test_the_gpu_clock_samples_are_summarised_and_a_capped_run_says_so_in_its_note(tmp_path):
    import common
    lines = ["1980, 1980, 512.31, 51, 0x0000000000000000", "garbage", "1755, 1980, 699.80, 63, 0x0000000000000004",
             "1830, 1980, 690.1, 62, 0x0000000000000004", "345, 1980, 80.0, 40, 0x0000000000000001"]
    got = common.parse_clock_samples(lines)
    assert got == {"sm_mhz_min": 345, "sm_mhz_median": 1830, "sm_mhz_rated": 1980, "power_w_max": 699.8,
                   "temp_c_max": 63.0, "clock_events": ["idle", "sw_power_cap"], "samples": 4}
    assert common.slowed(got) == ["sw_power_cap"] and common.parse_clock_samples(["", "x, y"]) is None
    assert common.slowed(common.parse_clock_samples(lines[:1])) == []
    rows = budgets.rows_of([run(4, 900.0, copy_s=0.5, gms=700.0, graph_clocks=got),
                            run(6, 800.0, copy_s=0.2, clocks=common.parse_clock_samples(lines[:1]))])
    assert rows[0]["clocks"] == got and rows[1]["clocks"]["clock_events"] == []
    note = budget_matrix.clock_note(rows[0]["clocks"])
    assert note.startswith("clock capped (sw_power_cap): SM 345-1830 of 1980 MHz") and budget_matrix.clock_note(
        rows[1]["clocks"]) == "" and budget_matrix.clock_note(None) == ""
    assert budget_matrix.clock_note(dict(got, sm_mhz_median=1965)) == ""  # a routine power-cap dip: not flagged
    assert note in budgets.report(rows)
    md = open(budget_matrix.write_all(rows, str(tmp_path))[1]).read()
    assert "clock capped (sw_power_cap)" in md and md.count("clock capped") == 1


def test_a_capture_retried_after_demotion_is_a_note_not_an_error(tmp_path):
    rows = budgets.rows_of([run(4, None, gms=426.4, graph_first_capture="OutOfMemoryError: FLAME out of memory")])
    assert rows[0]["error"] is None and rows[0]["note"].startswith("first capture failed (OutOfMemoryError")
    md = open(budget_matrix.write_all(rows, str(tmp_path))[1]).read()
    assert "captured after demoting blocks" in md and "426.4 / 3.8" in md


def test_the_clock_sampler_falls_back_to_the_older_field_name(tmp_path, monkeypatch):
    """A driver that does not know clocks_event_reasons (before R530: clocks_throttle_reasons) still gets sampled."""
    import common
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in *clocks_event_reasons*) echo 'Field is not a valid field' >&2; exit 2;;"
                   " esac\nwhile true; do echo '1755, 1980, 650.5, 60, 0x0000000000000004'; sleep 0.02; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    import time
    with common.GpuClocks(interval_ms=20) as clk:
        time.sleep(0.3)
    assert clk.summary is not None and clk.summary["clock_events"] == ["sw_power_cap"]
    assert clk.summary["sm_mhz_min"] == 1755 and clk.summary["samples"] >= 1


def test_the_clock_sampler_is_a_no_op_without_nvidia_smi(monkeypatch):
    import common
    monkeypatch.setenv("PATH", "/nonexistent")
    with common.GpuClocks(interval_ms=50) as clk:
        pass
    assert clk.summary is None


def test_a_damaged_matrix_is_refused_before_any_run(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text('{"rows": [{"family": "flux", "storage": "fp8", "budget": -1}]}')
    r = cli("--render-only", "--matrix", str(bad), "--matrix-out", str(tmp_path))
    assert r.returncode == 2 and "rows[0]" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad.write_text("not json")
    r = cli("--families", "flux", "--matrix", str(bad), "--matrix-out", str(tmp_path))
    assert r.returncode == 2 and "not a budget matrix JSON" in r.stderr


def test_the_trainer_families_run_and_fill_the_matrix_on_tiny_presets(tmp_path):
    matrix = tmp_path / "budget_matrix.json"
    matrix.write_text(json.dumps({"rows": budgets.rows_of([run(None, 800.0)], {"commit": "old"})}))
    r = cli("--families", "sdxl,sd3.5-large", "--small", "--device", "cpu", "--size", "64", "--budgets", "1",
            "--storages", "fp8", "--repeats", "1", "--warmup", "1", "--matrix", str(matrix),
            "--matrix-out", str(tmp_path), out=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert os.path.exists(tmp_path / "budgets_runs.json")
    rows = {budget_matrix.key_of(x): x for x in budget_matrix.load(str(matrix))}
    assert ("flux", "fp8", None, "auto") in rows  # the earlier call's row is kept
    for fam in ("sdxl", "sd3.5-large"):
        row = rows[(fam, "fp8", 1, "auto")]
        assert row["error"] is None and row["step_ms"] > 0 and row["resident"] > 0, row
        assert row["host_peak_rss_GiB"] > 0 and row["host_blocks_GiB"] is not None
    assert "| sdxl | fp8 |" in (tmp_path / "budget_matrix.md").read_text()


def test_the_new_families_run_through_the_trainer_on_tiny_presets(tmp_path):
    """qwen-image, chroma and flux-kontext (with its control image's reference tokens) through the trainer under a
    budget and unconstrained; their rows land in the matrix."""
    matrix = tmp_path / "budget_matrix.json"
    r = cli("--families", "qwen-image,chroma,flux-kontext", "--small", "--device", "cpu", "--size", "64", "--budgets",
            "1,none", "--storages", "fp8", "--repeats", "1", "--warmup", "1", "--matrix", str(matrix),
            "--matrix-out", str(tmp_path), out=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {budget_matrix.key_of(x): x for x in budget_matrix.load(str(matrix))}
    for fam in ("qwen-image", "chroma", "flux-kontext"):
        for budget in (1, None):
            row = rows[(fam, "fp8", budget, "auto")]
            assert row["error"] is None and row["step_ms"] > 0 and row["resident"] > 0, row
    md = (tmp_path / "budget_matrix.md").read_text()
    assert "| qwen-image | fp8 |" in md and "| flux-kontext | fp8 |" in md


def test_the_trainer_families_take_fp8_compute_as_storage_fp8c(tmp_path):
    """--storages fp8c: fp8 block storage with the blocks' matmuls on the e4m3 tensor cores (train.fp8_compute); the
    tiny presets on the cpu run it through the trainer and the row says fp8c."""
    matrix = tmp_path / "budget_matrix.json"
    r = cli("--families", "sd3.5-large", "--small", "--device", "cpu", "--size", "64", "--budgets", "1",
            "--storages", "fp8c", "--repeats", "1", "--warmup", "1", "--matrix", str(matrix),
            "--matrix-out", str(tmp_path), out=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    row = {budget_matrix.key_of(x): x for x in budget_matrix.load(str(matrix))}[("sd3.5-large", "fp8c", 1, "auto")]
    assert row["error"] is None and row["step_ms"] > 0, row
    assert "| sd3.5-large | fp8c |" in (tmp_path / "budget_matrix.md").read_text()
