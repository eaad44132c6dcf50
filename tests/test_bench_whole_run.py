"""bench/lora_step.py's whole run (cache -> train -> samples through the trainer; bench/qwen_image_lora.py --run) on
the CPU with the tiny Qwen-Image preset: every stage runs and is reported, the step time comes from the loss log's
clock after the warm-up, and the report table reads the figures. The released sizes need the GPU."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402
import lora_step  # noqa: E402
import qwen_image_lora as Q  # noqa: E402


def test_a_tiny_whole_run_reports_its_stages_steps_and_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    res = common.Results("whole_run_smoke")
    lora_step.trainer_whole_run(res, "run_8GiB", "qwen_smoke", "qwen_image", "qwen-image-tiny", None, steps=6,
                                images=4, px=64, neg="", device="cpu", dtype="fp32")
    stages = [st["stage"] for st in res["run_8GiB_stages"]]
    assert stages == ["check", "latents", "text", "build", "train", "samples"]
    assert len(res["run_8GiB_losses"]) == 6 and all(x == x for x in res["run_8GiB_losses"])
    assert res["run_8GiB_step_ms"] > 0 and res["run_8GiB_samples"] is True
    res["compiled_step_1024_ckpt_ms"] = 2 * res["run_8GiB_step_ms"]
    row = [line for line in Q.run_report(res, [8]).splitlines() if line.strip().startswith("8 GiB")][0]
    assert "0.5" in row and "train" in row
