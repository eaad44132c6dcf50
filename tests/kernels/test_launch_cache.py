"""launching.LaunchCache: what kernel wrappers keep per call configuration, per thread and bounded."""
import threading

from flame_core.kernels.launching import LaunchCache


def test_get_put_len_and_clear():
    c = LaunchCache(limit=8)
    assert c.get(("a", 1)) is None and len(c) == 0
    v = object()
    assert c.put(("a", 1), v) is v
    assert c.get(("a", 1)) is v and c.get(("a", 2)) is None and len(c) == 1
    c.clear()
    assert len(c) == 0 and c.get(("a", 1)) is None


def test_a_full_cache_starts_over_instead_of_growing():
    c = LaunchCache(limit=3)
    for i in range(3):
        c.get(i)
        c.put(i, i)
    assert len(c) == 3
    c.get(3)
    c.put(3, "new")   # the fourth configuration: the thread's entries are dropped, then it is kept
    assert len(c) == 1 and c.get(3) == "new" and c.get(0) is None


def test_entries_are_per_thread():
    """A PackedLaunch's argument buffer is rewritten at each call, so each thread keeps its own."""
    c = LaunchCache()
    c.get("k")
    c.put("k", "main")
    seen = []

    def other():
        seen.append(c.get("k"))
        c.put("k", "other")
        seen.append(c.get("k"))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [None, "other"] and c.get("k") == "main" and len(c) == 1
