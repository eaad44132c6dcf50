"""The TCP store's wire: bounded message framing, the HMAC handshake that proves the job's secret, and where the
store may listen.

A message is a count of fields (uint32) and each field as a length (uint64) and its bytes. Counts and lengths are
checked against limits before anything is allocated, and a field is received in pieces as its bytes arrive, so a
length prefix alone never reserves memory.

The handshake (both ways fixed-size, before any message): the server sends MAGIC and a random nonce; the client
answers with its own nonce and HMAC-SHA256(secret, "client" | server nonce | client nonce); the server checks it
with hmac.compare_digest and answers "OK" and HMAC(secret, "server" | client nonce | server nonce), which the client
checks in turn (a program on the port that does not know the secret is not taken for the store). The secret never
travels. Without a secret (b""), the handshake still runs and proves nothing: allowed only on loopback.
"""
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import struct

MAGIC = b"FLAME-STORE/1\n"
NONCE = 32
SECRET_ENV = "FLAME_STORE_SECRET"
MIN_SECRET = 16  # characters of a secret a user sets (the launcher makes 64 hex digits)
MAX_FIELDS = 1 << 16  # a wait / check names at most this many keys
MAX_KEY = 4096  # bytes of a key
MAX_VALUE = 1 << 30  # bytes of a value (the `store` backend's largest collective)
MAX_NUMBER = 20  # digits of a timeout or an amount
_COUNT = struct.Struct("!I")
_LEN = struct.Struct("!Q")
_PIECE = 1 << 20


class BadFrame(ConnectionError):
    """The peer broke the protocol (a size over its limit, an unknown operation, a failed handshake): the
    connection is dropped; the message says why. `reply`: bytes the peer is sent before it is dropped, once the
    reason is logged (a failed handshake's refusal), or None."""

    def __init__(self, message, reply=None):
        super().__init__(message)
        self.reply = reply


# ----------------------------------------------------------------------------- framing
def recv_exact(sock, n):
    """n bytes (n already checked against a limit), received in pieces of at most 1 MiB: memory grows with what
    arrives, not with what the peer announced."""
    if n <= _PIECE:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("connection closed by the peer")
            got += k
        return bytes(buf)
    buf = bytearray()
    while len(buf) < n:
        piece = sock.recv(min(n - len(buf), _PIECE))
        if not piece:
            raise ConnectionError("connection closed by the peer")
        buf += piece
    return bytes(buf)


def send(sock, fields):
    parts = [_COUNT.pack(len(fields))]
    for f in fields:
        parts.append(_LEN.pack(len(f)))
        parts.append(f)
    sock.sendall(b"".join(parts))


def recv(sock, max_field=MAX_VALUE):
    """The fields of one message; BadFrame when its count or a length is over the limits."""
    (n,) = _COUNT.unpack(recv_exact(sock, _COUNT.size))
    if n == 0 or n > MAX_FIELDS:
        raise BadFrame(f"a message of {n} fields (1..{MAX_FIELDS} allowed)")
    fields = []
    for _ in range(n):
        (k,) = _LEN.unpack(recv_exact(sock, _LEN.size))
        if k > max_field:
            raise BadFrame(f"a field of {k} bytes (at most {max_field} allowed)")
        fields.append(recv_exact(sock, k))
    return fields


# ----------------------------------------------------------------------------- the secret and the handshake
def secret_bytes(secret):
    """The job's secret as bytes: `secret` when given, else $FLAME_STORE_SECRET, else b"" (none)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV, "")
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"the store secret must be str or bytes, got {type(secret).__name__}")
    if secret and len(secret) < MIN_SECRET:
        raise ValueError(f"the store secret ({SECRET_ENV}) has {len(secret)} characters; use at least {MIN_SECRET}, "
                         f"e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return bytes(secret)


def new_secret():
    return secrets.token_hex(32)


def _mac(secret, *parts):
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def server_handshake(sock, secret):
    """Check that the client knows `secret`; BadFrame when it does not (its `reply` tells the client so: the caller
    logs the reason first, then sends it and drops the connection)."""
    s_nonce = os.urandom(NONCE)
    sock.sendall(MAGIC + s_nonce)
    answer = recv_exact(sock, 2 * NONCE)
    c_nonce, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", s_nonce, c_nonce)):
        raise BadFrame(f"failed authentication (the client does not know this job's {SECRET_ENV})",
                       reply=b"NO" + bytes(NONCE))
    sock.sendall(b"OK" + _mac(secret, b"server", c_nonce, s_nonce))


def client_handshake(sock, secret, where):
    """Prove `secret` to the server at `where` and check that it knows it too; returns an error message or None."""
    hello = recv_exact(sock, len(MAGIC) + NONCE)
    if not hello.startswith(MAGIC):
        return f"{where} is not a FLAME store (another program on that port?)"
    s_nonce, c_nonce = hello[len(MAGIC):], os.urandom(NONCE)
    sock.sendall(c_nonce + _mac(secret, b"client", s_nonce, c_nonce))
    reply = recv_exact(sock, 2 + NONCE)
    if reply[:2] != b"OK":
        return (f"the store at {where} refused this process: its {SECRET_ENV} differs from rank 0's (set the same "
                f"value on every rank, or leave it to the launcher)")
    if not hmac.compare_digest(reply[2:], _mac(secret, b"server", c_nonce, s_nonce)):
        return f"the server at {where} does not know this job's {SECRET_ENV} (another job's store on that port?)"
    return None


# ----------------------------------------------------------------------------- where to listen
_LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


def loopback_address(host):
    """The loopback address `host` names (a literal 127.x.y.z or ::1, or "localhost"), or None. Only these: a host
    name that happens to resolve to loopback on node 0 (Debian's 127.0.1.1 for the machine's own name) is the
    name other nodes reach it by, so the store must listen on every interface then."""
    try:
        ip = ipaddress.ip_address(host)
        return str(ip) if ip.is_loopback else None
    except ValueError:
        pass
    if host.lower().rstrip(".") not in _LOOPBACK_NAMES:
        return None
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addresses = [info[4][0] for info in infos if ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback]
    return addresses[0] if addresses else None
