"""A small key-value store over TCP, hosted by rank 0, through which the ranks meet (torch's TCPStore).

    store = TCPStore("10.0.0.1", 29500, world_size=2, is_master=(rank == 0), timeout=timedelta(minutes=30))
    store.set("nccl/id", uid_bytes)            # any process
    uid = store.get("nccl/id")                 # waits until some process set the key (or the timeout)
    n = store.add("arrived", 1)                # an atomic counter (stored as its decimal text)
    store.wait(["a", "b"], timeout=10)         # until every key exists
    store.check(["a"]); store.delete_key("a"); store.num_keys()

The master binds the port on every interface (IPv6 and IPv4 where the system allows both) and serves each client
connection on a thread of its own; every process, the master included, talks to it as a client. A client connects
with retries until `timeout`, so the ranks may start in any order. Blocking calls wait on the server; a wait that
runs out raises StoreTimeoutError naming the keys and the time waited, a connection that breaks raises StoreError
naming the address. No authentication: the port must only be reachable from the machines of the job (as with
torch's store).

Wire format: a message is a count of fields (uint32) and each field as a length (uint64) and its bytes. A request's
first field is the operation; a reply's first field is b"ok", b"timeout" or b"error".
"""
import datetime
import socket
import struct
import threading
import time

from ..errors import FlameError

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
_COUNT = struct.Struct("!I")
_LEN = struct.Struct("!Q")
_MAX_FIELD = 1 << 40


class StoreError(FlameError, RuntimeError):
    """The store cannot be reached or answered with an error (the message names the address and the operation)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A key did not appear in time."""


def seconds(timeout):
    """A timeout given as a timedelta or a number of seconds, as float seconds (> 0)."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}") from None
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout} s")
    return timeout


# ----------------------------------------------------------------------------- framing
def _recv_exact(sock, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k
    return bytes(buf)


def _send(sock, fields):
    parts = [_COUNT.pack(len(fields))]
    for f in fields:
        parts.append(_LEN.pack(len(f)))
        parts.append(f)
    sock.sendall(b"".join(parts))


def _recv(sock):
    (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
    fields = []
    for _ in range(n):
        (k,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if k > _MAX_FIELD:
            raise ConnectionError(f"malformed message (a field of {k} bytes)")
        fields.append(_recv_exact(sock, k))
    return fields


def _key(k):
    if not isinstance(k, str) or not k:
        raise TypeError(f"store keys are non-empty str, got {k!r}")
    return k.encode("utf-8")


def _value(v):
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    raise TypeError(f"store values are bytes or str, got {type(v).__name__}")


# ----------------------------------------------------------------------------- server
class _Server:
    """The master's side: a dict, a condition for waiters, one thread per connection."""

    def __init__(self, port):
        if socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128,
                                             reuse_port=False)
        else:
            self.sock = socket.create_server(("", port), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.data = {}
        self.cond = threading.Condition()
        self.conns = set()
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name=f"flame-store:{self.port}", daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            while True:
                req = _recv(conn)
                try:
                    reply = self._handle(req)
                except Exception as e:  # noqa: BLE001 - a bad request is answered, the server goes on
                    reply = [b"error", f"{type(e).__name__}: {e}".encode()]
                _send(conn, reply)
        except (ConnectionError, OSError):
            pass
        finally:
            with self.cond:
                self.conns.discard(conn)
            conn.close()

    def _wait_for(self, keys, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000.0
        with self.cond:
            while not all(k in self.data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(left)
            return True

    def _handle(self, req):
        op, args = req[0], req[1:]
        d = self.data
        if op == b"set":
            with self.cond:
                d[args[0]] = args[1]
                self.cond.notify_all()
            return [b"ok"]
        if op == b"get":
            if not self._wait_for([args[0]], int(args[1])):
                return [b"timeout"]
            with self.cond:
                return [b"ok", d[args[0]]]
        if op == b"add":
            with self.cond:
                v = int(d.get(args[0], b"0")) + int(args[1])
                d[args[0]] = str(v).encode()
                self.cond.notify_all()
            return [b"ok", str(v).encode()]
        if op == b"check":
            with self.cond:
                return [b"ok", b"1" if all(k in d for k in args) else b"0"]
        if op == b"wait":
            return [b"ok"] if self._wait_for(args[1:], int(args[0])) else [b"timeout"]
        if op == b"delete":
            with self.cond:
                return [b"ok", b"1" if d.pop(args[0], None) is not None else b"0"]
        if op == b"num_keys":
            with self.cond:
                return [b"ok", str(len(d)).encode()]
        raise ValueError(f"unknown store operation {op!r}")

    def close(self):
        with self.cond:
            self.closed = True
            conns = list(self.conns)
            self.cond.notify_all()
        try:
            self.sock.close()
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ----------------------------------------------------------------------------- client
class TCPStore:
    """A client of the store at host_name:port; with is_master=True this process also hosts it (port 0: a free
    port, then read `store.port`). timeout: how long blocking calls and the first connection may take."""

    def __init__(self, host_name, port, world_size=None, is_master=False, timeout=DEFAULT_TIMEOUT):
        if not isinstance(port, int) or not 0 <= port < 65536 or (port == 0 and not is_master):
            raise ValueError(f"store port must be an int in 1..65535 (0 only for the master: any free port), got "
                             f"{port!r}")
        self.host, self.world_size, self.is_master = str(host_name), world_size, bool(is_master)
        self.timeout = seconds(timeout)
        self._server = None
        if self.is_master:
            try:
                self._server = _Server(port)
            except OSError as e:
                raise StoreError(f"cannot host the store on port {port}: {e} (another job or an earlier run still "
                                 f"holds it? choose another MASTER_PORT)") from None
            port = self._server.port
        self.port = port
        self._lock = threading.Lock()
        self._sock = None
        self._connect()

    def _connect(self):
        deadline = time.monotonic() + self.timeout
        host = "localhost" if self.is_master else self.host
        delay, last = 0.05, None
        while True:
            try:
                sock = socket.create_connection((host, self.port), timeout=min(10.0, self.timeout))
                break
            except OSError as e:
                last = e
            if time.monotonic() + delay > deadline:
                raise StoreTimeoutError(f"could not reach the store at {self.host}:{self.port} within "
                                        f"{self.timeout:.0f} s ({last}); is MASTER_ADDR reachable from this machine "
                                        f"and is rank 0 running?")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def clone(self):
        """Another connection to the same store (for a second thread); never hosts."""
        c = TCPStore.__new__(TCPStore)
        c.host, c.port, c.world_size, c.is_master = self.host, self.port, self.world_size, False
        c.timeout, c._server, c._lock, c._sock = self.timeout, None, threading.Lock(), None
        if self.is_master:
            c.host = "localhost"
        c._connect()
        return c

    def _call(self, op, fields, what, wait=None):
        if self._sock is None:
            raise StoreError(f"the store client of {self.host}:{self.port} is closed")
        with self._lock:
            try:
                self._sock.settimeout(self.timeout + 30.0 if wait is None else wait + 30.0)
                _send(self._sock, [op] + fields)
                reply = _recv(self._sock)
            except (OSError, ConnectionError) as e:
                raise StoreError(f"lost the store at {self.host}:{self.port} during {what}: {e} (did rank 0 "
                                 f"exit?)") from None
        status = reply[0]
        if status == b"ok":
            return reply[1:]
        if status == b"timeout":
            raise StoreTimeoutError(f"store {self.host}:{self.port}: {what} timed out after "
                                    f"{wait if wait is not None else self.timeout:.1f} s")
        raise StoreError(f"store {self.host}:{self.port}: {what} failed: {reply[1].decode(errors='replace')}")

    def set(self, key, value):
        self._call(b"set", [_key(key), _value(value)], f"set {key!r}")

    def get(self, key, timeout=None):
        """The value of `key` (bytes), waiting until it is set."""
        t = self.timeout if timeout is None else seconds(timeout)
        return self._call(b"get", [_key(key), str(int(t * 1000)).encode()], f"waiting for key {key!r}", t)[0]

    def add(self, key, amount):
        """Add `amount` to the integer at `key` (0 when missing); returns the new value."""
        return int(self._call(b"add", [_key(key), str(int(amount)).encode()], f"add to {key!r}")[0])

    def check(self, keys):
        return self._call(b"check", [_key(k) for k in keys], f"check {list(keys)}")[0] == b"1"

    def wait(self, keys, timeout=None):
        t = self.timeout if timeout is None else seconds(timeout)
        keys = list(keys)
        self._call(b"wait", [str(int(t * 1000)).encode()] + [_key(k) for k in keys], f"waiting for keys {keys}", t)

    def delete_key(self, key):
        return self._call(b"delete", [_key(key)], f"delete {key!r}")[0] == b"1"

    def num_keys(self):
        return int(self._call(b"num_keys", [], "num_keys")[0])

    def set_timeout(self, timeout):
        self.timeout = seconds(timeout)

    def close(self):
        """Close this client (and, on the master, the server: every other client then sees the store gone)."""
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
