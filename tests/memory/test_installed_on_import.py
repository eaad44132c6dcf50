"""`import flame_core` alone installs FLAME's memory accounting (and, on a GPU, the pool as CuPy's allocator)."""
import subprocess
import sys


def test_plain_import_accounts_tensor_storage():
    code = ("import flame_core as f; x = f.zeros(1000, device='cpu'); "
            "print(f.memory.memory_allocated('cpu'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out.strip()) >= 4000


def _run(code, **env):
    import os
    full = {k: v for k, v in os.environ.items() if k != "FLAME_CPU_MEMORY_ACCOUNTING"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=full).stdout


def test_cpu_accounting_starts_at_the_first_read_and_counts_the_tensors_alive_then():
    # the birth hook costs a quarter of a small op's host time: it is installed when the figures are first needed;
    # that first read counts every live tensor's storage once (views and shared storage included), exactly
    code = """
import sys
import numpy as np
import flame_core as f
tensor_mod = sys.modules["flame_core.tensor"]
cuda = f.memory.cpu_tracking.cuda_birth is not None
assert not f.memory.cpu_tracking.is_enabled()
assert tensor_mod._memory_hook is (f.memory.cpu_tracking._cuda_only_birth if cuda else None)
x = f.zeros(1000, device="cpu")                      # 4000 B
v = x.reshape(10, 100)[2:5]                          # a view: no new storage
arr = np.ones(500)                                   # 4000 B, shared with a tensor
s = f.from_numpy(arr[100:])
p = f.ones(25, device="cpu", requires_grad=True)      # 100 B
a = f.memory.memory_allocated("cpu")
assert f.memory.cpu_tracking.is_enabled() and tensor_mod._memory_hook is f.memory.cpu_tracking.on_birth
assert a == 4000 + 4000 + 100, a
assert f.memory.max_memory_allocated("cpu") == a
y = x * 2                                            # from now on: exact, births and deaths
assert f.memory.memory_allocated("cpu") == a + 4000
del x, v
assert f.memory.memory_allocated("cpu") == a
del s
assert f.memory.memory_allocated("cpu") == a         # arr still holds the storage
del arr
assert f.memory.memory_allocated("cpu") == a - 4000
assert f.memory.max_memory_allocated("cpu") == a + 4000
print("ok")
"""
    assert _run(code).strip() == "ok"


def test_cpu_limit_turns_the_accounting_on_and_counts_what_lives():
    code = """
import flame_core as f
x = f.zeros(1 << 20, device="cpu")                   # 4 MiB born before any accounting
f.memory.set_memory_limit(6 << 20, "cpu")
try:
    f.zeros(1 << 19, device="cpu")                   # 2 MiB: 6 MiB in all, at the limit
    try:
        f.zeros((1 << 19) + 1, device="cpu")
    except f.OutOfMemoryError:
        print("oom")
finally:
    f.memory.set_memory_limit(None, "cpu")
"""
    assert _run(code).strip() == "oom"


def test_env_switch_accounts_cpu_storage_from_import():
    code = """
import flame_core as f
xs = [f.zeros(100, device="cpu") for _ in range(3)]
del xs
s = f.memory.memory_stats("cpu")
print(s["num_alloc"] - s["num_free"] == s["allocation.all.current"], s["num_free"] >= 3,
      f.memory.max_memory_allocated("cpu") >= f.memory.memory_allocated("cpu") + 1200)
"""
    assert _run(code, FLAME_CPU_MEMORY_ACCOUNTING="1").split() == ["True"] * 3
