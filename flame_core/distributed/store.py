"""A small key-value store over TCP, hosted by rank 0, through which the ranks meet (torch's TCPStore).

    store = TCPStore("10.0.0.1", 29500, world_size=2, is_master=(rank == 0), timeout=timedelta(minutes=30))
    store.set("nccl/id", uid_bytes)            # any process
    uid = store.get("nccl/id")                 # waits until some process set the key (or the timeout)
    n = store.add("arrived", 1)                # an atomic counter (stored as its decimal text)
    store.wait(["a", "b"], timeout=10)         # until every key exists
    store.check(["a"]); store.delete_key("a"); store.num_keys()

Where it listens: when the host is a loopback address ("localhost", 127.0.0.1, ::1: one machine), on loopback only;
otherwise on every interface (IPv6 and IPv4 where the system allows both), and then only with a secret. Every
connection first proves the job's secret (`secret=`, else $FLAME_STORE_SECRET; the launcher makes one per run) by an
HMAC challenge-response (store_wire.py); a connection that fails it, or later breaks the protocol (an unknown
operation, a size over the limits), is dropped with a logged reason and the store goes on. Without a secret (allowed
on loopback only) any process of the machine can connect. docs/DISTRIBUTED.md says what this protects and what not.

The master serves each client connection on a thread of its own; every process, the master included, talks to it
as a client. A client connects with retries until `timeout`, so the ranks may start in any order. Blocking calls
wait on the server; a wait that runs out raises StoreTimeoutError naming the keys and the time waited, a connection
that breaks raises StoreError naming the address. A request's first field is the operation; a reply's first field
is b"ok", b"timeout" or b"error".
"""
import datetime
import logging
import re
import socket
import threading
import time

from ..errors import FlameError
from . import store_wire as wire

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to prove the secret
MAX_PENDING = 64  # connections authenticating at once; more are dropped (a flood does not spawn threads unbounded)
log = logging.getLogger(__name__)


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


def _key(k):
    if not isinstance(k, str) or not k:
        raise TypeError(f"store keys are non-empty str, got {k!r}")
    b = k.encode("utf-8")
    if len(b) > wire.MAX_KEY:
        raise ValueError(f"store key of {len(b)} bytes (at most {wire.MAX_KEY}): {k[:60]!r}...")
    return b


def _value(v):
    if isinstance(v, str):
        v = v.encode("utf-8")
    elif isinstance(v, (bytes, bytearray, memoryview)):
        v = bytes(v)
    else:
        raise TypeError(f"store values are bytes or str, got {type(v).__name__}")
    if len(v) > wire.MAX_VALUE:
        raise ValueError(f"store value of {len(v)} bytes (at most {wire.MAX_VALUE})")
    return v


# ----------------------------------------------------------------------------- requests
_ARITY = {b"set": (2, 2), b"get": (2, 2), b"add": (2, 2), b"check": (0, None), b"wait": (1, None),
          b"delete": (1, 1), b"num_keys": (0, 0)}
_NUMBER_AT = {b"get": 1, b"add": 1, b"wait": 0}  # the argument that is a decimal integer (timeout ms, amount)
_VALUE_AT = {b"set": 1}  # the argument that is a value; every other one is a key
_NUMBER = re.compile(rb"-?[0-9]{1,%d}" % wire.MAX_NUMBER)


def _check(req):
    """(op, args) of a well-formed request; BadFrame otherwise."""
    op, args = req[0], req[1:]
    arity = _ARITY.get(op)
    if arity is None:
        raise wire.BadFrame(f"unknown operation {op[:32]!r}")
    if len(args) < arity[0] or (arity[1] is not None and len(args) > arity[1]):
        raise wire.BadFrame(f"{op.decode()} with {len(args)} arguments")
    for i, a in enumerate(args):
        if i == _VALUE_AT.get(op):
            continue
        if i == _NUMBER_AT.get(op):
            if not _NUMBER.fullmatch(a):
                raise wire.BadFrame(f"{op.decode()}: {a[:32]!r} is not a decimal integer")
        elif not 0 < len(a) <= wire.MAX_KEY:
            raise wire.BadFrame(f"{op.decode()}: a key of {len(a)} bytes (1..{wire.MAX_KEY})")
    return op, args


# ----------------------------------------------------------------------------- server
class _Server:
    """The master's side: a dict, a condition for waiters, one thread per connection. bind: the loopback address to
    listen on, or None for every interface."""

    def __init__(self, port, bind, secret):
        if bind is not None:
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            self.sock = socket.create_server((bind, port), family=family, backlog=128)
            self.connect_host = bind
        elif socket.has_dualstack_ipv6():
            self.sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128,
                                             reuse_port=False)
            self.connect_host = "localhost"
        else:
            self.sock = socket.create_server(("", port), backlog=128)
            self.connect_host = "localhost"
        self.port = self.sock.getsockname()[1]
        self.where = f"{bind or '*'}:{self.port}"
        self.secret = secret
        self.pending = threading.BoundedSemaphore(MAX_PENDING)
        self.data = {}
        self.cond = threading.Condition()
        self.conns = set()
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name=f"flame-store:{self.port}", daemon=True)
        self.thread.start()

    def _accept(self):
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            if not self.pending.acquire(blocking=False):
                log.warning("store %s: dropped a connection from %s: %d others are still authenticating", self.where,
                            addr[0], MAX_PENDING)
                conn.close()
                continue
            with self.cond:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"), daemon=True).start()

    def _authenticate(self, conn):
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            wire.server_handshake(conn, self.secret)
            conn.settimeout(None)
        except TimeoutError:
            raise wire.BadFrame(f"no handshake within {HANDSHAKE_TIMEOUT:.0f} s") from None

    def _serve(self, conn, peer):
        try:
            try:
                self._authenticate(conn)
            finally:
                self.pending.release()
            while True:
                op, args = _check(wire.recv(conn))
                try:
                    reply = self._handle(op, args)
                except ValueError as e:  # e.g. add to a value that is not an integer: answered, the server goes on
                    reply = [b"error", f"{type(e).__name__}: {e}".encode()]
                wire.send(conn, reply)
        except wire.BadFrame as e:
            if not self.closed:
                log.warning("store %s: dropped the connection from %s: %s", self.where, peer, e)
            if e.reply is not None:  # (after the log line: a refused client never sees its refusal before it)
                try:
                    conn.sendall(e.reply)
                except OSError:
                    pass
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

    def _handle(self, op, args):
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
        with self.cond:  # num_keys (_check let nothing else through)
            return [b"ok", str(len(d)).encode()]

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
    port, then read `store.port`). timeout: how long blocking calls and the first connection may take. secret: the
    job's secret (str or bytes, at least 16 characters; default $FLAME_STORE_SECRET), the same in every process;
    required unless host_name is a loopback address."""

    def __init__(self, host_name, port, world_size=None, is_master=False, timeout=DEFAULT_TIMEOUT, secret=None):
        if not isinstance(port, int) or not 0 <= port < 65536 or (port == 0 and not is_master):
            raise ValueError(f"store port must be an int in 1..65535 (0 only for the master: any free port), got "
                             f"{port!r}")
        self.host, self.world_size, self.is_master = str(host_name), world_size, bool(is_master)
        self.timeout = seconds(timeout)
        self._secret = wire.secret_bytes(secret)
        loopback = wire.loopback_address(self.host)
        if loopback is None and not self._secret:
            raise StoreError(f"the store at {self.host}:{port} would be reachable from other machines without a "
                             f"secret: set {wire.SECRET_ENV} to the same random value on every node (e.g. "
                             f"python -c 'import secrets; print(secrets.token_hex(32))'), or use a loopback "
                             f"MASTER_ADDR (localhost) on one machine")
        self._server = None
        self._connect_host = self.host
        if self.is_master:
            try:
                self._server = _Server(port, loopback, self._secret)
            except OSError as e:
                raise StoreError(f"cannot host the store on port {port}: {e} (another job or an earlier run still "
                                 f"holds it? choose another MASTER_PORT)") from None
            port, self._connect_host = self._server.port, self._server.connect_host
        self.port = port
        self._lock = threading.Lock()
        self._sock = None
        self._connect()

    def _connect(self):
        deadline = time.monotonic() + self.timeout
        delay, last = 0.05, None
        while True:
            sock = None
            try:
                sock = socket.create_connection((self._connect_host, self.port), timeout=min(10.0, self.timeout))
                refused = wire.client_handshake(sock, self._secret, f"{self.host}:{self.port}")
                if refused is not None:
                    sock.close()
                    raise StoreError(refused)
                break
            except (OSError, ConnectionError) as e:  # not up yet, or dropped while authenticating: try again
                last = e
                if sock is not None:
                    sock.close()
            if time.monotonic() + delay > deadline:
                raise StoreTimeoutError(f"could not reach the store at {self.host}:{self.port} within "
                                        f"{self.timeout:.0f} s ({last}); is MASTER_ADDR reachable from this machine "
                                        f"and is rank 0 running?")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock

    def clone(self):
        """Another connection to the same store (for a second thread); never hosts."""
        c = TCPStore.__new__(TCPStore)
        c.host, c.port, c.world_size, c.is_master = self.host, self.port, self.world_size, False
        c.timeout, c._server, c._lock, c._sock = self.timeout, None, threading.Lock(), None
        c._secret, c._connect_host = self._secret, self._connect_host
        c._connect()
        return c

    def _call(self, op, fields, what, wait=None):
        if self._sock is None:
            raise StoreError(f"the store client of {self.host}:{self.port} is closed")
        with self._lock:
            try:
                self._sock.settimeout(self.timeout + 30.0 if wait is None else wait + 30.0)
                wire.send(self._sock, [op] + fields)
                reply = wire.recv(self._sock)
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
