"""bench/step_profile.py on the CPU: the kernel-by-kernel difference the adapters make, from two traces' lists, and the
parsing of nvidia-smi's clock / power samples."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import step_profile  # noqa: E402


def test_what_the_adapters_change_is_ranked_by_the_difference_either_way():
    lora = {"GEMM": [("gemm_a", 10.0, 4), ("lora_gemm", 3.0, 190)], "other": [("same", 1.0, 2)]}
    nolora = {"GEMM": [("gemm_a", 6.0, 4), ("gone", 2.5, 9)], "other": [("same", 1.0, 2)]}
    rows = step_profile.adapters_add(lora, nolora, top=3)
    assert rows == [("gemm_a", 10.0, 6.0, 4, 4), ("lora_gemm", 3.0, 0.0, 190, 0), ("gone", 0.0, 2.5, 0, 9)]
    assert step_profile.adapters_add(lora, None, top=1) == [("gemm_a", 10.0, 0.0, 4, 0)]


def test_nvidia_smi_clock_samples_parse_and_unreadable_lines_are_left_out():
    text = "1980, 652.31\n1755, 700.02\n[N/A], 12.0\n1980\n\n1830, 690.5"
    assert step_profile.parse_clock_samples(text) == [(1980.0, 652.31), (1755.0, 700.02), (1830.0, 690.5)]
    assert step_profile.parse_clock_samples("") == []
