"""bench/fp8_load_memory.py at a small width: each case runs in its own process and loads the same model into fp8
storage; loading it in fp8 as it is read takes less anonymous memory than the bfloat16 load it replaced, and an
fp8 file's load holds no more than the model it makes."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import fp8_load_memory  # noqa: E402


def test_the_three_loads_and_their_order(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("PYTHONPATH", ROOT)
    res = fp8_load_memory.main(["--double", "2", "--single", "2", "--width", "512", "--dir", str(tmp_path)])
    before, read, stored = (res[c] for c in ("bf16 then quantise", "fp8 on read (bf16 file)",
                                             "fp8 on read (fp8 file)"))
    assert before["fp8_layers"] == read["fp8_layers"] == stored["fp8_layers"] == 2 * 10 + 2 * 3
    blocks = res["files"]["fp8_bytes"]
    assert read["peak"] - read["base"] < before["peak"] - before["base"]
    assert stored["peak"] - stored["base"] < read["peak"] - read["base"]
    assert stored["peak"] - stored["after"] < 0.25 * blocks      # (sampling: within a quarter of the file)
    assert os.path.exists(tmp_path / "out" / "fp8_load_memory.json")
