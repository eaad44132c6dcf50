"""The TCP store: set/get/add/check/wait/delete across clients in threads and in other processes, blocking gets,
timeouts and broken connections that say what happened."""
import socket
import subprocess
import sys
import threading
import time

import pytest

from flame_core.distributed import StoreError, StoreTimeoutError, TCPStore


@pytest.fixture
def master():
    s = TCPStore("localhost", 0, is_master=True, timeout=5)
    yield s
    s.close()


def test_set_get_add_check_delete_and_num_keys(master):
    c = TCPStore("localhost", master.port, timeout=5)
    master.set("a", b"\x00\x01raw")
    c.set("text", "héllo")
    assert c.get("a") == b"\x00\x01raw" and master.get("text") == "héllo".encode()
    assert c.add("n", 3) == 3 and master.add("n", -1) == 2 and c.get("n") == b"2"
    assert c.check(["a", "text"]) and not c.check(["a", "missing"])
    assert master.num_keys() == 3
    assert c.delete_key("a") and not c.delete_key("a")
    assert master.num_keys() == 2
    c.set("a", b"")  # empty values are values
    assert master.get("a") == b""
    c.close()


def test_get_blocks_until_another_client_sets_the_key(master):
    c = TCPStore("localhost", master.port, timeout=5)
    timer = threading.Timer(0.3, lambda: master.set("late", b"v"))
    timer.start()
    t = time.monotonic()
    assert c.get("late") == b"v"
    timer.join()
    assert 0.2 < time.monotonic() - t < 3
    timer = threading.Timer(0.2, lambda: master.set("w2", b""))
    timer.start()
    master.set("w1", b"")
    c.wait(["w1", "w2"], timeout=3)
    timer.join()  # its set may still be reading the reply: closing the master under it would break that call
    c.close()


def test_a_key_that_never_comes_times_out_naming_it(master):
    t = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"waiting for key 'never'.*timed out after 0.3 s"):
        master.get("never", timeout=0.3)
    assert time.monotonic() - t < 2
    with pytest.raises(StoreTimeoutError, match=r"waiting for keys \['x', 'y'\]"):
        master.wait(["x", "y"], timeout=0.2)
    master.set("after", b"1")  # the connection is still usable after a timeout
    assert master.get("after") == b"1"


def test_many_clients_in_threads_count_atomically(master):
    n_threads, n_adds = 8, 50
    errors = []

    def work(k):
        try:
            c = TCPStore("localhost", master.port, timeout=5)
            for _ in range(n_adds):
                c.add("count", 1)
            c.set(f"done/{k}", b"1")
            c.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    [t.start() for t in ts]
    master.wait([f"done/{k}" for k in range(n_threads)], timeout=20)
    [t.join() for t in ts]
    assert not errors and int(master.get("count")) == n_threads * n_adds


def test_clients_in_other_processes(master):
    code = ("import sys; from flame_core.distributed import TCPStore; s = TCPStore('localhost', int(sys.argv[1]), "
            "timeout=10); v = s.get('go'); s.set('reply/' + sys.argv[2], v + sys.argv[2].encode()); "
            "s.add('procs', 1)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(master.port), str(k)]) for k in range(3)]
    master.set("go", b"ping")
    for p in procs:
        assert p.wait(timeout=30) == 0
    assert [master.get(f"reply/{k}") for k in range(3)] == [b"ping0", b"ping1", b"ping2"]
    assert master.get("procs") == b"3"


def test_unreachable_store_says_where_it_looked():
    with socket.socket() as held:  # bound but not listening: connections are refused, and no one else takes it
        held.bind(("localhost", 0))
        port = held.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=rf"could not reach the store at localhost:{port} within 1 s.*"
                                                   r"MASTER_ADDR reachable"):
            TCPStore("localhost", port, timeout=1)
        assert time.monotonic() - t < 5


def test_a_closed_master_breaks_its_clients_with_a_clear_error():
    m = TCPStore("localhost", 0, is_master=True, timeout=5)
    c = TCPStore("localhost", m.port, timeout=5)
    c.set("k", b"v")
    m.close()
    with pytest.raises(StoreError, match=rf"lost the store at localhost:{m.port}.*did rank 0 exit"):
        c.get("k")


def test_bad_arguments_are_refused_before_any_connection(master):
    with pytest.raises(ValueError, match="port"):
        TCPStore("localhost", 0, timeout=1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        TCPStore("localhost", master.port, timeout=0)
    with pytest.raises(TypeError, match="keys are non-empty str"):
        master.set(3, b"v")
    with pytest.raises(TypeError, match="values are bytes or str"):
        master.set("k", 3)
    with pytest.raises(StoreError, match=f"cannot host the store on port {master.port}"):
        TCPStore("localhost", master.port, is_master=True, timeout=1)
