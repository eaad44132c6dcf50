"""`import flame_core` alone installs FLAME's memory accounting (and, on a GPU, the pool as CuPy's allocator)."""
import subprocess
import sys


def test_plain_import_accounts_tensor_storage():
    code = ("import flame_core as f; x = f.zeros(1000, device='cpu'); "
            "print(f.memory.memory_allocated('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out.strip()) >= 4000
