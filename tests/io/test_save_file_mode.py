"""save_file writes through a temp file + rename (atomic) but gives the result the mode open() would: 0o666 & ~umask,
not mkstemp's 0600."""
import os
import stat

import numpy as np
import pytest

import flame_core as flame
from flame_core import io


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_saved_file_gets_the_usual_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = tmp_path / "w.safetensors"
        io.save_file({"a": flame.arange(4.0)}, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
        with open(tmp_path / "plain", "wb"):
            pass
        assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode)
        assert os.umask(umask) == umask  # reading the umask left it alone
    finally:
        os.umask(old)
    np.testing.assert_array_equal(io.load_file(path)["a"].numpy(), [0, 1, 2, 3])
    assert sorted(os.listdir(tmp_path)) == ["plain", "w.safetensors"]  # no temp file left behind


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"ORIGINAL")
    with pytest.raises(Exception):
        io.save_file({"a": flame.ones(2), "b": object()}, path)
    assert path.read_bytes() == b"ORIGINAL" and os.listdir(tmp_path) == ["w.safetensors"]
