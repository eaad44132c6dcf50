"""bench/fp8_lora_quality.py end to end on the CPU at flux-tiny size (fp8 compute emulated there): every mode trains
from the same LoRA init to the same targets, the JSON holds the curves and the comparisons, the bf16-trained LoRA
compared with itself is exact, and bad --modes exit with a usage error. The real-width run needs the GPU."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fp8_lora_quality as Q  # noqa: E402

TINY = ["--preset", "flux-tiny", "--device", "cpu", "--blocks", "1,1", "--size", "32", "--txt", "4", "--samples", "2",
        "--held-out", "1", "--steps", "4", "--every", "2"]


def test_tiny_run_trains_every_mode_and_compares_the_loras(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    Q.main(TINY)
    res = json.load(open(tmp_path / "fp8_lora_quality.json"))["results"]
    for mode in Q.MODES:
        curve = res[f"{mode}_loss_curve"]
        assert len(curve) == 4 and all(v > 0 for v in curve)
        for key in ("held_out_mse_bf16_base", "held_out_mse_own_base", "recovered_bf16_base", "effect_cos_vs_bf16",
                    "delta_w_rel_vs_bf16"):
            assert f"{mode}_{key}" in res
    # the same init and the same first batch: the first losses differ only by the base's precision
    assert res["bf16_loss_curve"][0] != res["fp8_compute_loss_curve"][0]
    assert res["bf16_effect_cos_vs_bf16"] == pytest.approx(1.0) and res["bf16_delta_w_rel_vs_bf16"] == 0.0
    assert res["fp8_held_out_floor_mse"] > 0              # the truth LoRA on the fp8 base misses the bf16 targets
    out = capsys.readouterr().out
    assert "training loss" in out and "held out" in out


def test_modes_must_start_with_bf16(capsys):
    with pytest.raises(SystemExit) as e:
        Q.main(TINY + ["--modes", "fp8_compute"])
    assert e.value.code == 2 and "--modes" in capsys.readouterr().err
