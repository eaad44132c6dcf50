"""The TCP store's defences, on loopback only: it listens on loopback for a loopback host, every connection proves
the job's secret (HMAC challenge-response) before it may touch a key, sizes are bounded before anything is
allocated, and a client that fails the handshake or breaks the protocol is dropped with a logged reason while the
store goes on serving the others."""
import ipaddress
import logging
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from flame_core.distributed import StoreError, TCPStore
from flame_core.distributed import store as store_mod
from flame_core.distributed import store_wire as wire

SECRET = "0123456789abcdef-test-secret"
LOG = "flame_core.distributed.store"


@pytest.fixture
def master(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    s = TCPStore("localhost", 0, is_master=True, timeout=5, secret=SECRET)
    yield s
    s.close()


def _raw(port):
    return socket.create_connection(("localhost", port), timeout=5)


def _closed_by_server(sock, timeout=5):
    """True when the server closed the connection (reads b"" or a reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _authenticated(port, secret=SECRET):
    sock = _raw(port)
    assert wire.client_handshake(sock, secret.encode(), "test") is None
    return sock


def _alive(master):
    master.set("alive", b"yes")
    return master.get("alive", timeout=2) == b"yes"


def test_a_loopback_store_listens_on_loopback_only(master):
    assert ipaddress.ip_address(master._server.sock.getsockname()[0]).is_loopback


def test_clients_without_or_with_a_wrong_secret_are_refused_and_set_nothing(master, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    for secret in (None, "another-secret-of-this-length"):
        with pytest.raises(StoreError, match="refused this process: its FLAME_STORE_SECRET differs"):
            TCPStore("localhost", master.port, timeout=5, secret=secret)
    # the old attack: a request sent straight away, without the handshake
    sock = _raw(master.port)
    sock.recv(len(wire.MAGIC) + wire.NONCE)
    sock.sendall(struct.pack("!I", 3) + b"".join(struct.pack("!Q", len(f)) + f for f in (b"set", b"k", b"evil")))
    sock.sendall(b"\0" * 64)
    assert _closed_by_server(sock)
    sock.close()
    assert master.num_keys() == 0 and not master.check(["k"])
    assert caplog.text.count("failed authentication") == 3   # (logged before each client is told)
    good = TCPStore("localhost", master.port, timeout=5, secret=SECRET)  # the right secret still gets in
    good.set("k", b"v")
    assert master.get("k") == b"v"
    good.close()


def test_the_client_checks_that_the_server_knows_the_secret_too(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def serve():  # answers "OK" without knowing the secret
        conn, _ = fake.accept()
        conn.sendall(wire.MAGIC + bytes(wire.NONCE))
        conn.recv(2 * wire.NONCE)
        conn.sendall(b"OK" + bytes(wire.NONCE))
        time.sleep(0.5)
        conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(StoreError, match="does not know this job's FLAME_STORE_SECRET"):
        TCPStore("127.0.0.1", port, timeout=5, secret=SECRET)
    t.join()
    fake.close()


def test_an_oversized_length_prefix_is_refused_without_allocating(master, caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    tracemalloc.start()
    try:
        for frame in (struct.pack("!I", 1) + struct.pack("!Q", 1 << 31),  # the 22-byte request that took 2 GiB
                      struct.pack("!I", 0xFFFFFFFF),  # 4 billion fields
                      struct.pack("!I", 1) + struct.pack("!Q", wire.MAX_VALUE) + b"set"):  # allowed, never sent
            sock = _authenticated(master.port)
            sock.sendall(frame)
            if len(frame) > 12:
                sock.shutdown(socket.SHUT_WR)  # the announced bytes never come
            assert _closed_by_server(sock)
            sock.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert "a field of 2147483648 bytes" in caplog.text and "a message of 4294967295 fields" in caplog.text
    assert _alive(master)


@pytest.mark.parametrize("fields, reason", [
    ([b"shutdown"], "unknown operation b'shutdown'"),
    ([b"set", b"k"], "set with 1 arguments"),
    ([b"get", b"k", b"soon"], "is not a decimal integer"),
    ([b"set", b"", b"v"], "a key of 0 bytes"),
    ([b"check", b"k" * (wire.MAX_KEY + 1)], f"a key of {wire.MAX_KEY + 1} bytes"),
])
def test_a_bad_frame_drops_that_client_with_a_logged_reason_and_the_store_goes_on(master, caplog, fields, reason):
    caplog.set_level(logging.WARNING, logger=LOG)
    other = TCPStore("localhost", master.port, timeout=5, secret=SECRET)
    sock = _authenticated(master.port)
    wire.send(sock, fields)
    assert _closed_by_server(sock)
    sock.close()
    assert reason in caplog.text and "dropped the connection from 127.0.0.1" in caplog.text
    other.set("still", b"here")  # another client's connection is untouched
    assert _alive(master) and master.get("still") == b"here"
    other.close()


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(master, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=LOG)
    monkeypatch.setattr(store_mod, "HANDSHAKE_TIMEOUT", 0.3)
    sock = _raw(master.port)
    assert _closed_by_server(sock, timeout=5)
    sock.close()
    assert "no handshake within" in caplog.text and _alive(master)


def test_a_store_other_machines_could_reach_needs_a_secret(monkeypatch):
    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    with pytest.raises(StoreError, match="reachable from other machines without a secret: set FLAME_STORE_SECRET"):
        TCPStore("192.0.2.1", 0, is_master=True, timeout=1)  # refused before binding anything (TEST-NET address)
    with pytest.raises(StoreError, match="without a secret"):
        TCPStore("192.0.2.1", 29500, timeout=1)
    with pytest.raises(ValueError, match="has 5 characters; use at least 16"):
        TCPStore("localhost", 0, is_master=True, timeout=1, secret="short")
    monkeypatch.setenv(wire.SECRET_ENV, SECRET)  # the environment's secret is the default
    m = TCPStore("localhost", 0, is_master=True, timeout=5)
    c = TCPStore("localhost", m.port, timeout=5, secret=SECRET)
    c.set("k", "v")
    assert m.get("k") == b"v" and m.clone().get("k") == b"v"
    c.close()
    m.close()


def test_loopback_addresses():
    assert wire.loopback_address("localhost") and wire.loopback_address("127.0.0.1") == "127.0.0.1"
    assert wire.loopback_address("::1") == "::1"
    assert wire.loopback_address("192.0.2.1") is None and wire.loopback_address("10.0.0.7") is None
    assert wire.loopback_address(socket.gethostname()) is None  # a machine name is how other nodes reach it


def test_waiting_for_or_checking_no_keys_is_still_allowed(master):
    master.wait([], timeout=1)
    assert master.check([])
    assert _alive(master)


def test_connections_still_authenticating_are_bounded(monkeypatch, caplog):
    """A flood of connections that never authenticate does not make the master spawn threads without end: past
    MAX_PENDING they are dropped at once, and the store serves again when the silent ones time out."""
    caplog.set_level(logging.WARNING, logger=LOG)
    monkeypatch.setattr(store_mod, "MAX_PENDING", 2)
    monkeypatch.setattr(store_mod, "HANDSHAKE_TIMEOUT", 5.0)
    m = TCPStore("localhost", 0, is_master=True, timeout=5, secret=SECRET)
    deadline = time.monotonic() + 5  # its own client's slot is freed by the server thread just after the handshake
    while m._server.pending._value < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    silent = [_raw(m.port) for _ in range(2)]
    time.sleep(0.2)
    extra = _raw(m.port)
    assert _closed_by_server(extra, timeout=4)  # dropped at once, not after the silent ones' handshake timeout
    assert "2 others are still authenticating" in caplog.text
    for s in silent + [extra]:
        s.close()  # the server sees them go and frees their slots
    c = TCPStore("localhost", m.port, timeout=5, secret=SECRET)
    c.set("k", b"v")
    assert m.get("k") == b"v"
    c.close()
    m.close()
