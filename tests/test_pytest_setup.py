"""The test setup itself: `python -m pytest -q` still prints the summary line, and FLAME's own modules are imported
directly by the tests (pytest.importorskip would turn a broken import into a silent skip)."""
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_quiet_run_keeps_the_summary_line(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                          str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^1 passed in [\d.]+s", out.stdout, re.M), out.stdout


def test_flame_modules_are_not_imported_through_importorskip():
    bad = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "tests").rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"importorskip\(\s*['\"]flame", line)]
    assert not bad, f"import FLAME's own modules directly: {bad}"
