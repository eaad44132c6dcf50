"""bench/kontext_chroma_lora.py on the CPU: the budget table's ratio against the compiled peer, from the same run or
from the step run saved in the same $OUT (the budget runs go in their own process). The runs themselves need the GPU."""
import json
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402
import kontext_chroma_lora as K  # noqa: E402


def _budget_results(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = common.Results("kontext_chroma_lora_kontext_chroma_budget")
    for which, ms in (("kontext", 1500.0), ("chroma", 900.0)):
        res[f"{which}_budget_12GiB_fp8_step_ms"] = ms
        res[f"{which}_budget_12GiB_fp8_driver_peak_GiB"] = 11.6
    return res


def test_the_budget_ratio_comes_from_the_step_runs_saved_in_the_same_out(tmp_path, monkeypatch):
    res = _budget_results(tmp_path, monkeypatch)
    with open(tmp_path / "kontext_chroma_lora_kontext.json", "w") as f:
        json.dump({"bench": "x", "results": {"compiled_step_kontext_1024_ckpt_ms": 1200.0}}, f)
    assert K.peer_ms(res, "kontext") == 1200.0
    assert K.peer_ms(res, "chroma") is None                     # no chroma step run saved: no ratio, no error
    table = K.budget_report(res, SimpleNamespace(budget=12), ["kontext", "chroma"])
    kontext, chroma = [line for line in table.splitlines() if "max_gpu_memory 12 GiB" in line]
    assert "1200.0" in kontext and "1.25" in kontext            # 1500 / 1200
    assert chroma.rstrip().endswith("-")


def test_the_same_runs_peer_wins_over_a_saved_one(tmp_path, monkeypatch):
    res = _budget_results(tmp_path, monkeypatch)
    res["compiled_step_chroma_1024_ckpt_ms"] = 1000.0
    with open(tmp_path / "kontext_chroma_lora_chroma.json", "w") as f:
        json.dump({"bench": "x", "results": {"compiled_step_chroma_1024_ckpt_ms": 5.0}}, f)
    assert K.peer_ms(res, "chroma") == 1000.0
    (tmp_path / "kontext_chroma_lora_kontext.json").write_text("not json")
    assert K.peer_ms(res, "kontext") is None                    # an unreadable file is no figure
