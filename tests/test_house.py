"""Issue 41's house rules, checked on the source tree: one of each concept (an atomic-write helper, describe_keys, a
memory-budget parser, a data pipeline under flame_models/data), the trainer's stages take what they need instead of
the trainer, and the lint set-up (ruff configured, run by CI, the tree clean; no debugging leftovers)."""
import ast
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("flame_core", "flame_nn", "flame_models")


def _texts(packages=LIBRARY):
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, path.read_text(encoding="utf-8")


def _defined(pattern, packages=LIBRARY):
    """["file:name"] of the functions / classes of the library whose definition line matches `pattern` (a regex of
    `def name` / `class name`)."""
    rx = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+({pattern})\b", re.M)
    return [f"{path.relative_to(ROOT)}:{m.group(1)}" for path, text in _texts(packages) for m in rx.finditer(text)]


def test_one_atomic_write_helper():
    # before: flame_core.io.atomic_write, checkpoint_io's atomic_open, tokenization's write_atomic and training's
    # atomic_write_bytes / _text / _json
    assert _defined(r"\w*atomic\w*") == ["flame_core/io.py:atomic_write"]


def test_one_describe_keys_and_one_memory_budget_parser():
    # before: describe_keys in checkpoint_io and in training/model_files.py; training/config.py's
    # max_gpu_memory_bytes read a bare number as GiB where flame_core's parse_size read bytes
    assert _defined(r"describe_keys|parse_size|parse_budget|max_gpu_memory_bytes|\w*parse_memory\w*") == [
        "flame_core/memory/stats.py:parse_size", "flame_core/memory/stats.py:parse_budget",
        "flame_models/checkpoint_io/reading.py:describe_keys"]


def test_one_data_pipeline_under_flame_models_data():
    # before: flame_models/training/data.py had its own Loader and error type beside flame_models/data
    assert not (ROOT / "flame_models" / "training" / "data.py").exists()
    found = _defined(r"\w*Loader|\w*DataError", packages=("flame_models",))
    assert found and all(f.startswith("flame_models/data/") for f in found), found


def test_the_trainers_stages_take_what_they_need_not_the_trainer():
    # before: image_data.prepare(tr, ...), resume.load_checkpoint(self, ...) (a trainer method kept in another file)
    # and the ddp group's before_step(trainer) took the whole trainer and set its attributes
    trainer = ROOT / "flame_models" / "training" / "trainer.py"
    bad = []
    for path, text in _texts(("flame_models",)):
        if path == trainer:
            continue
        tree = ast.parse(text, str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.Lambda)):
                continue
            args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'name', 'lambda')}"
            if {"tr", "trainer"} & set(args):
                bad.append(f"{where} takes the trainer")
            if node in tree.body and args[:1] == ["self"]:
                bad.append(f"{where} is a method outside its class")
    assert bad == [], bad


def test_ruff_is_configured_run_by_ci_and_the_tree_is_clean():
    assert "[tool.ruff]" in (ROOT / "pyproject.toml").read_text()
    assert "ruff check" in (ROOT / ".ci" / "run").read_text()
    assert not (ROOT / "_dbg.py").exists()
    assert "/outputs/" in (ROOT / ".gitignore").read_text().split()
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.skip("ruff is not installed (pip install '.[test]')")
    cmd = ["ruff"] if shutil.which("ruff") else [sys.executable, "-m", "ruff"]
    r = subprocess.run(cmd + ["check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NO_COLOR": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
