"""The output folder is checked at set-up, before any caching or model: a file where a folder should be, or a folder
that cannot be written, is a RunFolderError naming the path (the example: exit 2, one line)."""
import importlib.util
import os

import pytest

from flame_models.training import image_data
from flame_models.training.run_folder import RunFolderError
from flame_models.training.trainer import Trainer

from .conftest import draw_images, image_config, make_samples

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_flux_lora.py")


@pytest.fixture
def no_caching(monkeypatch):
    def prepare(*a, **kw):
        raise AssertionError("the caches were built before the output folder was checked")
    monkeypatch.setattr(image_data, "prepare", prepare)


def _file(path):
    path.write_text("not a folder")
    return path


@pytest.mark.parametrize("where", ["training_folder", "run folder", "checkpoints", "under a file"])
def test_a_file_where_the_output_folder_goes_is_refused_before_caching(tmp_path, tiny_model, no_caching, where):
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1)
    top = tmp_path / "out"
    if where == "training_folder":
        bad = _file(top)
    elif where == "run folder":
        top.mkdir()
        bad = _file(top / "r")
    elif where == "checkpoints":
        (top / "r").mkdir(parents=True)
        bad = _file(top / "r" / "checkpoints")
    else:
        top.mkdir()
        bad = _file(top / "a_file")
        top = bad / "deeper"
    c = image_config(tmp_path, "r", tiny_model, images, training_folder=str(top))
    with pytest.raises(RunFolderError, match=f"output folder .*: {bad} is a file, not a folder"):
        Trainer(c, verbose=False).setup()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc: a folder even root cannot write in")
def test_a_folder_that_cannot_be_written_is_refused_before_caching(tmp_path, tiny_model, no_caching):
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1)
    c = image_config(tmp_path, "r", tiny_model, images, training_folder="/proc/self")
    with pytest.raises(RunFolderError, match="output folder /proc/self/r cannot be written"):
        Trainer(c, verbose=False).setup()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path, tiny_model, no_caching):
    images = draw_images(tmp_path / "images", n_concept=1, n_other=1)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        c = image_config(tmp_path, "r", tiny_model, images, training_folder=str(ro))
        with pytest.raises(RunFolderError, match=f"output folder {ro}/r cannot be written: Permission denied"):
            Trainer(c, verbose=False).setup()
    finally:
        ro.chmod(0o755)


def test_the_example_exits_2_with_one_line(tmp_path, capsys, flux_file):
    spec = importlib.util.spec_from_file_location("train_flux_lora", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = _file(tmp_path / "out")
    args = ["--model", flux_file, "--data", make_samples(tmp_path / "d", n=2), "--output", str(out), "--steps", "1"]
    assert example.main(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: output folder {out}/flux_lora: {out} is a file, not a folder; choose another " \
                          f"training_folder (--output)", err
