"""The peer block channel: blocks by key over TCP (optionally TLS), one frame per block, in order.

Control traffic between daemons goes over gRPC; this channel carries only block bytes, because a
2 MiB payload inside a protobuf message costs copies and framing that plain TCP does not.

Wire format (all integers big-endian; one connection carries any number of requests, one at a time):

* ``HELLO`` client -> server: ``magic "KVPB", version, flags, token length`` then the token (may be
  empty). ``WELCOME`` server -> client: ``magic, version, status, message length`` then a UTF-8
  message; any status but OK is followed by the server closing the connection. HELLO flag BIND:
  the client binds frame checksums (below); a server that does too answers version 2 (BOUND), and
  the connection binds them both ways. A node that predates binding ignores the flag and answers
  version 1: its connections check payloads only, so old and new nodes still talk.
* ``REQUEST`` client -> server: ``op, flags, 0, key count, namespace id, body bytes`` then the body:
  each key as ``u8 length ‖ key`` (FETCH, PUSH, LOOKUP), or the namespace's description (NAMESPACE).
  PUSH with flag PARENT: the first key names the parent of the pushed chain and has no frame.
  LOOKUP and NAMESPACE are answered with one ACK frame (LOOKUP: ``index`` = how many leading keys
  the peer holds) or an ERROR frame.
* ``FRAME`` either way: ``kind, key length, 0, index, length, checksum`` then the key, then
  ``length`` payload bytes. Kinds: BLOCK (payload = the block), MISSING (the sender does not have
  ``keys[index]``; the transfer ends), END (all blocks sent), ERROR (payload = a UTF-8 message; the
  transfer ends), ACK (push: ``index`` = blocks the receiver stored). A BLOCK's checksum is its
  payload's xxh3-64; on a bound connection, the xxh3-64 of ``namespace id ‖ that ‖ key``
  (:func:`bound_checksum`), so that a request whose namespace id or key was damaged on the way is
  not answered with a block (of another namespace, or another key) that passes its check.

Contract:

* Blocks arrive in request order. A transfer stops at the first missing block: a chain is only
  useful up to its first gap.
* Every payload is verified against its checksum before it is handed over; a block that fails is
  never delivered, and the transfer ends there.
* The receiver reads each payload straight into its destination (a reused scratch buffer, or the
  caller's own buffer via ``into``); the sender writes the served memoryview without copying it.
* A fetch never hangs: it returns within ``deadline_s`` with a :class:`FetchResult` saying how many
  blocks were delivered and why it stopped. Credentials that the peer refuses, or a peer whose
  credentials we refuse, raise :class:`PeerAuthError`.
* Authentication is mutual TLS (:class:`TLSFiles`), a shared token (compared in constant time), or
  both. A listener on a non-loopback address refuses to start without either unless
  ``PeerAuth.insecure`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import inspect
import ipaddress
import logging
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

import xxhash

log = logging.getLogger("kvstored.peers")

MAGIC = b"KVPB"
VERSION = 1
BOUND = 2            # WELCOME's version when the connection binds frame checksums

_HELLO = struct.Struct(">4sBBH")     # magic, version, flags, token length; then the token
_WELCOME = struct.Struct(">4sBBH")   # magic, version, status, message length; then the message
_REQUEST = struct.Struct(">BBHIQI")  # op, flags, 0, key count, namespace id, body bytes; then the body
_FRAME = struct.Struct(">BBHIQQ")    # kind, key length, 0, index, length, checksum; then key, payload
_BIND = struct.Struct(">QQ")         # namespace id, payload checksum; then the key (bound_checksum)

OP_FETCH = 1
OP_PUSH = 2
OP_LOOKUP = 3
OP_NAMESPACE = 4

FLAG_PARENT = 1          # PUSH: keys[0] is the parent of the pushed chain, not a pushed block
FLAG_FIXED = 2           # the body is one length byte, then the keys back to back (all that long)
HELLO_BIND = 1           # HELLO: this client binds frame checksums to their namespace id and key
MAX_NAMESPACE_BYTES = 64 << 10
MAX_TOKEN_BYTES = (1 << 16) - 1   # HELLO's token length field

BLOCK = 1
MISSING = 2
END = 3
ERROR = 4
ACK = 5

WELCOME_OK = 0
WELCOME_AUTH_REQUIRED = 1
WELCOME_AUTH_REJECTED = 2
WELCOME_BAD_VERSION = 3

_SPILL_BYTES = 256 << 10   # received ahead of the reader before reading pauses
_LINGER_S = 5.0            # how long a refused push is drained, waiting for the pusher to close
_HASH_SLICE_BYTES = 256 << 10   # a checksummed read lands this much at a time (stays in cache)

Served: TypeAlias = memoryview | tuple[memoryview, int | None] | None
# may answer at once (a block in memory) or with an awaitable (one that must be read first)
ServeBlock = Callable[[int, bytes], "Served | Awaitable[Served]"]
ReleaseBlock = Callable[[int, bytes], None]
StoreBlock = Callable[[int, bytes, bytes, memoryview], "bool | Awaitable[bool]"]


class Landing(Protocol):
    """Where a pushed block's payload is received (see ``BlockServer``'s ``land_block``)."""

    view: memoryview

    def commit(self, checksum: int) -> bool: ...

    def abort(self) -> None: ...


LandBlock = Callable[[int, bytes, bytes, int], "Landing | None"]
CountBlocks = Callable[[int, list[bytes]], "int | Awaitable[int]"]
OpenNamespace = Callable[[int, bytes], "str | Awaitable[str]"]
WhyRefused = Callable[[int, bytes, int], str]
OnBlock = Callable[[int, memoryview], "Awaitable[None] | None"]
Into = Callable[[int, int], "memoryview | Awaitable[memoryview]"]


# -- errors and results ---------------------------------------------------------------------------
class PeerError(Exception):
    """Base of the channel's expected failures."""


class PeerConfigError(PeerError, ValueError):
    """The channel's configuration is unusable (unsafe listener, unreadable certificate, ...)."""


class PeerRefused(PeerError):
    """The peer answered, with an error: it is up and in step, but would not do what was asked
    (an unknown or refused namespace, a question it cannot take)."""


class PeerAuthError(PeerError):
    """The peer refused our credentials, or we refused the peer's; the message says which and why."""


class Stop(enum.Enum):
    """Why a transfer ended."""

    COMPLETE = "complete"        # every requested block was delivered
    MISSING = "missing"          # the peer does not have the next block
    CORRUPT = "corrupt"          # the next block failed its checksum and was dropped
    PEER_CLOSED = "peer_closed"  # the connection ended mid-transfer (peer died or reset)
    TIMEOUT = "timeout"          # the deadline passed
    UNREACHABLE = "unreachable"  # no connection could be made
    PEER_ERROR = "peer_error"    # the peer reported an error, or sent something malformed
    REFUSED = "refused"          # push: the receiver declined to store a block


@dataclass(frozen=True, slots=True)
class FetchResult:
    """``delivered`` blocks (a prefix of the request) were handed to ``on_block``, then ``stop``."""

    delivered: int
    requested: int
    stop: Stop
    detail: str = ""

    @property
    def complete(self) -> bool:
        return self.stop is Stop.COMPLETE


@dataclass(frozen=True, slots=True)
class PushResult:
    """The receiver stored ``stored`` blocks (a prefix of those sent), then ``stop``."""

    stored: int
    sent: int
    stop: Stop
    detail: str = ""

    @property
    def complete(self) -> bool:
        return self.stop is Stop.COMPLETE


# -- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for mutual TLS. A server needs all three; a client without ``cert_file`` presents
    no certificate (and a server requiring one refuses it). ``server_name``: the name to verify in
    the server's certificate; "" = the host we connect to."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""


@dataclass(frozen=True, slots=True)
class PeerAuth:
    """How peers prove who they are: mutual TLS, a shared token, both, or (loopback or explicitly
    ``insecure``) neither."""

    tls: TLSFiles | None = None
    token: str = ""
    insecure: bool = False

    @property
    def authenticated(self) -> bool:
        return self.tls is not None or bool(self.token)

    def server_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        if not (self.tls.cert_file and self.tls.key_file and self.tls.ca_file):
            raise PeerConfigError("peer TLS on a listener needs ca_file, cert_file and key_file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)   # trusts ca_file only (no system roots)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx, self.tls)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.sslobject_class = _LoggedHandshake   # the refusing side says why, too
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        # Not create_default_context: it loads the host's public roots too, and a certificate
        # any of them issued for a peer's address would pass. Peers are trusted via ca_file alone.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # CERT_REQUIRED, check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load(ctx, self.tls)
        return ctx


class _LoggedHandshake(ssl.SSLObject):
    """A server-side TLS session that logs why it refused a peer (its certificate expired, was
    signed by another CA, ...): otherwise only the connecting side would learn it."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise   # the handshake is still under way
        except ssl.SSLError as exc:
            reason = getattr(exc, "verify_message", "") or exc.reason or str(exc)
            if "ALERT" in str(exc.reason or ""):   # the peer refused ours (it sent an alert)
                log.warning("a peer refused this node's TLS handshake: %s", reason)
            else:
                log.warning("refused a peer's TLS handshake: %s", reason)
            raise


def certificate_warning(cert_file: str, now: float) -> str:
    """Why this node's own certificate will be refused by its peers (expired, not yet valid), or
    "" when its dates are fine or cannot be read."""
    try:
        info = ssl._ssl._test_decode_cert(cert_file)  # type: ignore[attr-defined]  # stdlib's PEM reader
        not_before = ssl.cert_time_to_seconds(info["notBefore"])
        not_after = ssl.cert_time_to_seconds(info["notAfter"])
    except Exception:
        return ""
    if now > not_after:
        return f"the peer certificate {cert_file} expired on {info['notAfter']}: peers will refuse it"
    if now < not_before:
        return f"the peer certificate {cert_file} is not valid before {info['notBefore']}: peers will refuse it"
    return ""


def _load(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    try:
        ctx.load_verify_locations(cafile=files.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise PeerConfigError(f"cannot load the peer CA file {files.ca_file!r}: {exc}") from None
    if files.cert_file or files.key_file:
        try:
            ctx.load_cert_chain(files.cert_file, files.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise PeerConfigError(f"cannot load the peer certificate {files.cert_file!r} / key "
                                  f"{files.key_file!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what a peer may ask for or send; anything beyond is a protocol error."""

    max_keys: int = 1 << 16
    max_key_bytes: int = 255
    max_block_bytes: int = 1 << 30
    handshake_timeout_s: float = 10.0
    # A listener gives up a fetch or push it serves after this long (0 = never): a peer that stops
    # reading (stuck process, zero window) must not keep the blocks it asked for pinned for ever.
    transfer_timeout_s: float = 0.0
    socket_buffer_bytes: int = 0    # SO_SNDBUF/SO_RCVBUF; 0 = leave the kernel's autotuning on


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals; "" and wildcard addresses are not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listener_allowed(host: str, auth: PeerAuth) -> bool:
    """A listener may serve peers on ``host`` if it authenticates them, listens only on loopback,
    or the configuration explicitly says ``insecure``."""
    return auth.authenticated or auth.insecure or is_loopback(host)


def parse_address(addr: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> ``(host, port)``."""
    if isinstance(addr, tuple):
        return addr
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def bound_checksum(payload_checksum: int, namespace_id: int, key: bytes) -> int:
    """A BLOCK frame's checksum on a bound connection: the payload's xxh3-64 bound to the namespace
    id and key it is sent under. One small hash per block on top of the payload's (which a store
    may have computed once for all its peers)."""
    return xxhash.xxh3_64_intdigest(_BIND.pack(namespace_id, payload_checksum) + key)


def _as_bytes_view(buf: memoryview) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# -- a byte stream whose reads land in the reader's own buffer ------------------------------------
class _Closed(Exception):
    """The connection ended before the bytes asked for arrived."""


class _Stream(asyncio.BufferedProtocol):
    """Reads go straight into the buffer the reader passes (``read_into``); bytes that arrive
    before a reader asks wait in a small spill area (reading pauses when it is full). Writes go
    to the transport; ``drain`` returns once the transport has handed everything to the kernel, so
    a written memoryview is no longer referenced after it."""

    def __init__(self, limits: Limits, on_connect: Callable[[_Stream], None] | None = None) -> None:
        self._limits = limits
        self._on_connect = on_connect
        self.transport: asyncio.Transport | None = None
        self._spill = bytearray(_SPILL_BYTES)
        self._pending = bytearray()
        self._target: memoryview | None = None
        self._filled = 0
        self._hasher: xxhash.xxh3_64 | None = None
        self._pause_between_reads = False
        self._read_waiter: asyncio.Future[None] | None = None
        self._write_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._read_paused = False
        self._eof = False
        self._error: BaseException | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.bound = False   # both sides agreed (HELLO, WELCOME) to bind frame checksums

    # protocol callbacks -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's transports are not subclasses
        # Pause as soon as anything is queued. uvloop's TLS transport pauses at size >= high, so
        # high=0 would pause it after every write, even a fully sent one, until the next read.
        tls = transport.get_extra_info("ssl_object") is not None
        self.transport.set_write_buffer_limits(high=1 if tls else 0, low=0)
        # Reading pauses between reads on plain TCP only, where it was measured; by their code,
        # paused TLS transports may drop decrypted bytes not yet taken out when the peer closes
        # (not reproduced here), so TLS connections read on.
        self._pause_between_reads = not tls
        sock = transport.get_extra_info("socket")
        if sock is not None and self._limits.socket_buffer_bytes:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._limits.socket_buffer_bytes)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._limits.socket_buffer_bytes)
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            # Hashed reads take a slice at a time, so each is checksummed while still in cache.
            end = len(self._target) if self._hasher is None else self._filled + _HASH_SLICE_BYTES
            return self._target[self._filled:end]
        return memoryview(self._spill)

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            if self._hasher is not None:
                self._hasher.update(self._target[self._filled:self._filled + nbytes])
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None
                # Stop reading until the reader asks again: bytes read with nobody waiting land in
                # the spill and are copied twice (a block's payload right behind its header).
                # Measured with two daemon pairs side by side: pulls 1.13-1.19x, pushes 1.05x.
                # Between exchanges the client side reads on (``idle``), so a close is noticed;
                # the server always has its next request read pending then.
                if self._pause_between_reads and not self._read_paused and self.transport is not None:
                    self._read_paused = True
                    self.transport.pause_reading()
                _wake(self._read_waiter)
            return
        self._pending += memoryview(self._spill)[:nbytes]
        if len(self._pending) >= _SPILL_BYTES and not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()
        _wake(self._read_waiter)   # a ``read_some`` takes whatever arrived

    def eof_received(self) -> bool | None:
        self._eof = True
        _wake(self._read_waiter)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        _wake(self._read_waiter)
        _wake(self._write_waiter)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        _wake(self._write_waiter)

    # the stream API -----------------------------------------------------------------------------
    def _raise_closed(self, what: str) -> None:
        if self._error is not None:
            raise _Closed(f"connection lost while {what}: {self._error}") from self._error
        raise _Closed(f"connection closed by the peer while {what}")

    async def read_into(self, view: memoryview, what: str = "reading",
                        hasher: xxhash.xxh3_64 | None = None) -> None:
        """Fill ``view`` completely or raise :class:`_Closed`; with ``hasher``, feed it every byte
        as it lands (the digest equals :func:`checksum` of ``view`` once this returns)."""
        n = len(view)
        got = 0
        if self._pending:
            got = min(n, len(self._pending))
            with memoryview(self._pending) as pending:   # one copy, not a slice and then a copy
                view[:got] = pending[:got]
            del self._pending[:got]
            if hasher is not None:
                hasher.update(view[:got])
        if got == n:
            return
        if self._eof:
            self._raise_closed(what)
        self._target = view
        self._filled = got
        self._hasher = hasher
        try:
            await self._arrival()
        finally:
            self._target = None
            self._hasher = None
        if self._filled != n:
            self._raise_closed(what)

    async def read_some(self, view: memoryview) -> int:
        """Read what has arrived (at least one byte) into ``view``; :class:`_Closed` at the end."""
        if not self._pending:
            if self._eof:
                self._raise_closed("discarding")
            await self._arrival()
            if not self._pending:
                self._raise_closed("discarding")
        n = min(len(view), len(self._pending))
        with memoryview(self._pending) as pending:
            view[:n] = pending[:n]
        del self._pending[:n]
        if len(self._pending) < _SPILL_BYTES:
            self._resume_reading()
        return n

    async def _arrival(self) -> None:
        """Read on, and wait until the reader is woken (its target filled, bytes spilled, or the
        end of the connection)."""
        self._read_waiter = asyncio.get_running_loop().create_future()
        self._resume_reading()
        try:
            await self._read_waiter
        finally:
            self._read_waiter = None

    def _resume_reading(self) -> None:
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()

    async def read_exact(self, n: int, what: str = "reading") -> bytes:
        buf = bytearray(n)
        if n:
            await self.read_into(memoryview(buf), what)
        return bytes(buf)

    def idle(self) -> None:
        """Between exchanges: read on (reading pauses after each read during one), so the peer
        closing the connection is noticed while nobody is waiting for bytes."""
        if self._target is None and len(self._pending) < _SPILL_BYTES \
                and self.transport is not None and not self.transport.is_closing():
            self._resume_reading()

    def write(self, *data: bytes | memoryview) -> None:
        """Queue ``data`` (several pieces go out in one system call, not one segment each)."""
        if self.transport is None or self.transport.is_closing():
            self._raise_closed("writing")
        assert self.transport is not None
        if len(data) > 1 and type(self.transport).writelines is not asyncio.WriteTransport.writelines:
            self.transport.writelines(data)   # uvloop's: one writev, nothing joined
        else:
            for piece in data:   # the default writelines would copy the pieces into one
                self.transport.write(piece)

    async def drain(self) -> None:
        """Wait until the transport holds nothing (every byte written is in the kernel)."""
        while self._write_paused:
            if self.transport is None or self.transport.is_closing() or self.closed.done():
                self._raise_closed("writing")
            self._write_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._write_waiter
            finally:
                self._write_waiter = None
        if self.closed.done():
            self._raise_closed("writing")

    def close(self, abort: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if abort:
                self.transport.abort()
            else:
                self.transport.close()


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _frame(kind: int, key: bytes = b"", index: int = 0, length: int = 0, check: int = 0) -> bytes:
    return _FRAME.pack(kind, len(key), 0, index, length, check) + key


def _encode_request(op: int, namespace_id: int, keys: Sequence[bytes], limits: Limits, flags: int = 0) -> bytes:
    if len(keys) > limits.max_keys:
        raise ValueError(f"{len(keys)} keys in one request; at most {limits.max_keys}")
    sizes = set(map(len, keys))
    if len(sizes) == 1:   # the usual case (one hash algorithm): no Python loop over the keys
        size = sizes.pop()
        if not 0 < size <= limits.max_key_bytes:
            raise ValueError(f"a key must be 1..{limits.max_key_bytes} bytes, got {size}")
        body_bytes = 1 + size * len(keys)
        return _REQUEST.pack(op, flags | FLAG_FIXED, 0, len(keys), namespace_id, body_bytes) + bytes([size]) \
            + b"".join(keys)
    body = bytearray()
    for key in keys:
        if not 0 < len(key) <= limits.max_key_bytes:
            raise ValueError(f"a key must be 1..{limits.max_key_bytes} bytes, got {len(key)}")
        body.append(len(key))
        body += key
    return _REQUEST.pack(op, flags, 0, len(keys), namespace_id, len(body)) + bytes(body)


def _decode_keys(body: bytes, count: int, flags: int = 0) -> list[bytes]:
    if flags & FLAG_FIXED:
        if not body or body[0] == 0 or len(body) != 1 + body[0] * count:
            raise ValueError("malformed fixed-size key list")
        size = body[0]
        return [body[i: i + size] for i in range(1, len(body), size)]
    keys, pos = [], 0
    for _ in range(count):
        if pos >= len(body):
            raise ValueError("key list shorter than its count")
        n = body[pos]
        key = body[pos + 1:pos + 1 + n]
        if n == 0 or len(key) != n:
            raise ValueError("malformed key list")
        keys.append(key)
        pos += 1 + n
    if pos != len(body):
        raise ValueError("key list longer than its count")
    return keys


# -- server ---------------------------------------------------------------------------------------
class BlockServer:
    """Serves blocks by key to authenticated peers, and optionally stores pushed blocks.

    ``serve_block(namespace_id, key)`` returns the block's bytes (or the bytes and their xxh3-64
    checksum, when the caller knows it: it is sent as is), or None if this node does not have it;
    either at once or through an awaitable (a block that must be read from a slower tier first).
    The view must stay valid and unchanged until ``release_block(namespace_id, key)`` is called
    for it: exactly once per non-None view, once its bytes are in the kernel or the transfer was
    abandoned. While block ``i`` is being written, ``serve_block`` for ``i + 1`` already runs,
    so a slow tier (SSD) overlaps with the network. ``release_unsent(namespace_id, key)``
    (optional) is called instead of ``release_block`` for a view whose bytes did not all reach the
    kernel (served ahead, then the transfer ended; or the connection failed while it was written).

    ``store_block(namespace_id, parent, key, payload)`` (optional) takes a pushed block whose
    checksum was verified (``parent``: the key before it in the chain, b"" at the root);
    ``payload`` is valid only until it returns (or its awaitable is done). It returns False to
    refuse the block, which ends the push.

    ``land_block(namespace_id, parent, key, length)`` (optional, with ``store_block``) gives a
    :class:`Landing` to receive the pushed payload straight into: after the bytes arrive its
    ``commit(checksum)`` (the xxh3-64 the bytes passed; False refuses the block) or ``abort()``
    (anything else) is called, exactly once. None: receive into a buffer here and offer it to ``store_block``.

    ``why_refused(namespace_id, parent, length)`` (optional) says why a block was refused, for
    the pusher's error.

    ``count_blocks(namespace_id, keys)`` (optional) answers LOOKUP: how many leading keys this node
    holds. ``open_namespace(namespace_id, description)`` (optional) learns a namespace before
    blocks of it are pushed; it returns "" or why it refuses.
    """

    def __init__(self, host: str, port: int, auth: PeerAuth, serve_block: ServeBlock, *,
                 release_block: ReleaseBlock | None = None, release_unsent: ReleaseBlock | None = None,
                 store_block: StoreBlock | None = None,
                 land_block: LandBlock | None = None, count_blocks: CountBlocks | None = None,
                 open_namespace: OpenNamespace | None = None, why_refused: WhyRefused | None = None,
                 limits: Limits | None = None) -> None:
        self._host = host
        self._port = port
        self._auth = auth
        self._serve_block = serve_block
        self._release_block = release_block
        self._release_unsent = release_unsent
        self._store_block = store_block
        self._land_block = land_block
        self._count_blocks = count_blocks
        self._open_namespace = open_namespace
        self._why_refused = why_refused
        self._limits = limits or Limits()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._streams: set[_Stream] = set()
        self._closing = False

    @property
    def address(self) -> tuple[str, int]:
        """The bound address (the real port when constructed with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("BlockServer is not started")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        """Listen. Raises :class:`PeerConfigError` for an unauthenticated non-loopback listener or
        unusable TLS files, OSError if the address cannot be bound."""
        if not listener_allowed(self._host, self._auth):
            raise PeerConfigError(
                f"refusing to serve peers unauthenticated on {self._host or '*'}:{self._port}: configure "
                "mutual TLS or a shared token, or set insecure = true to allow it explicitly")
        ctx = self._auth.server_context()
        loop = asyncio.get_running_loop()
        self._closing = False
        self._server = await loop.create_server(
            self._make_protocol, self._host or None, self._port, ssl=ctx, reuse_address=True,
            ssl_handshake_timeout=self._limits.handshake_timeout_s if ctx is not None else None)

    async def close(self) -> None:
        """Stop listening and end every connection (in-flight transfers see the peer close)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for stream in list(self._streams):
            stream.close(abort=True)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> BlockServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _make_protocol(self) -> _Stream:
        return _Stream(self._limits, self._connected)

    def _connected(self, stream: _Stream) -> None:
        """Called once the connection (and its TLS handshake, if any) is up."""
        if self._closing:
            # Accepted just before the listener closed, and up only now (after ``close`` ended the
            # connections it knew of): served, it would outlive the listener (and, after a restart,
            # the store it serves from) until the peer hangs up.
            stream.close(abort=True)
            return
        self._streams.add(stream)
        task = asyncio.ensure_future(self._serve_connection(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_connection(self, stream: _Stream) -> None:
        try:
            async with asyncio.timeout(self._limits.handshake_timeout_s):
                if not await self._hello(stream):
                    return
            while True:
                try:
                    head = await stream.read_exact(_REQUEST.size, "waiting for a request")
                except _Closed:
                    return   # the client is done
                op, flags, _, count, namespace_id, key_bytes = _REQUEST.unpack(head)
                if op == OP_NAMESPACE and self._open_namespace is not None:
                    if count or key_bytes > MAX_NAMESPACE_BYTES:
                        await self._error(stream, "malformed namespace request")
                        return
                    body = await stream.read_exact(key_bytes, "reading a namespace")
                    try:
                        opened = self._open_namespace(namespace_id, body)
                        refusal = await opened if inspect.isawaitable(opened) else opened
                    except Exception as exc:   # a description it chokes on: say so, like a refusal
                        log.warning("opening namespace %x for %s failed: %r", namespace_id, _peername(stream), exc)
                        refusal = f"opening namespace {namespace_id:x} failed: {exc!r}"
                    await self._answer(stream, refusal, 0)
                    continue
                if count > self._limits.max_keys or key_bytes > count * (1 + self._limits.max_key_bytes):
                    await self._error(stream, f"request too large: {count} keys, {key_bytes} key bytes")
                    return
                try:
                    keys = _decode_keys(await stream.read_exact(key_bytes, "reading keys"), count, flags)
                except ValueError as exc:
                    await self._error(stream, str(exc))
                    return
                if op == OP_FETCH:
                    async with self._bounded(stream, "fetch"):
                        if not await self._send_blocks(stream, namespace_id, keys):
                            return
                elif op == OP_PUSH and self._store_block is not None:
                    parent = b""
                    if flags & FLAG_PARENT:
                        if not keys:
                            await self._error(stream, "a push with a parent names it first")
                            return
                        parent, keys = keys[0], keys[1:]
                    async with self._bounded(stream, "push"):
                        received = await self._receive_blocks(stream, namespace_id, parent, keys)
                    if not received:
                        await self._discard_until_closed(stream)
                        return
                elif op == OP_LOOKUP and self._count_blocks is not None:
                    try:
                        counted = self._count_blocks(namespace_id, keys)
                        held = await counted if inspect.isawaitable(counted) else counted
                    except Exception as exc:
                        log.warning("counting %d block(s) for %s failed: %r", len(keys), _peername(stream), exc)
                        await self._error(stream, f"lookup failed: {exc!r}")
                        continue
                    await self._answer(stream, "", int(held))
                else:
                    await self._error(stream, f"operation {op} not supported by this peer")
                    return
        except (_Closed, ConnectionError, TimeoutError, ssl.SSLError) as exc:
            log.debug("peer connection ended: %s", exc)
        finally:
            stream.close()
            self._streams.discard(stream)

    @contextlib.asynccontextmanager
    async def _bounded(self, stream: _Stream, what: str) -> AsyncIterator[None]:
        """One served transfer, given up (TimeoutError, the connection is closed) after
        ``limits.transfer_timeout_s``."""
        limit = self._limits.transfer_timeout_s
        if not limit:
            yield
            return
        try:
            async with asyncio.timeout(limit):
                yield
        except TimeoutError:
            log.warning("gave up a %s for %s after %g s: the peer stopped reading or sending", what,
                        _peername(stream), limit)
            raise

    async def _discard_until_closed(self, stream: _Stream) -> None:
        """After refusing a push midway: drop what the pusher still sends until it closes (it does
        once it has read our answer), for at most ``_LINGER_S``. Closing with its bytes unread
        would make the kernel reset the connection, and the reset can destroy the answer before
        the pusher reads it."""
        sink = memoryview(bytearray(_SPILL_BYTES))
        with contextlib.suppress(_Closed, ConnectionError, TimeoutError, ssl.SSLError):
            async with asyncio.timeout(_LINGER_S):
                while True:
                    await stream.read_some(sink)

    async def _hello(self, stream: _Stream) -> bool:
        magic, version, flags, token_len = _HELLO.unpack(await stream.read_exact(_HELLO.size, "reading hello"))
        if magic != MAGIC or version != VERSION:   # e.g. a TLS client on a plain listener: answer at once
            return await self._refuse(stream, WELCOME_BAD_VERSION, f"unsupported peer protocol {magic!r} v{version}")
        token = await stream.read_exact(token_len, "reading hello")
        if self._auth.token:
            if not token:
                return await self._refuse(stream, WELCOME_AUTH_REQUIRED, "this peer requires a shared token")
            if not hmac.compare_digest(token, self._auth.token.encode()):
                log.warning("peer from %s presented a wrong token", _peername(stream))
                return await self._refuse(stream, WELCOME_AUTH_REJECTED, "shared token rejected")
        stream.bound = bool(flags & HELLO_BIND)
        stream.write(_WELCOME.pack(MAGIC, BOUND if stream.bound else VERSION, WELCOME_OK, 0))
        await stream.drain()
        return True

    async def _refuse(self, stream: _Stream, status: int, message: str) -> bool:
        raw = message.encode()
        stream.write(_WELCOME.pack(MAGIC, VERSION, status, len(raw)) + raw)
        with contextlib.suppress(_Closed):
            await stream.drain()
        return False

    async def _error(self, stream: _Stream, message: str) -> None:
        raw = message.encode()[:4096]
        stream.write(_frame(ERROR, b"", 0, len(raw)) + raw)
        with contextlib.suppress(_Closed):
            await stream.drain()

    async def _send_blocks(self, stream: _Stream, namespace_id: int, keys: list[bytes]) -> bool:
        """Stream ``keys`` in order; True if the connection can take another request."""
        upcoming: tuple[bytes, asyncio.Future[Served]] | None = None
        if keys:
            upcoming = (keys[0], self._serve_ahead(namespace_id, keys[0]))
        try:
            for i, key in enumerate(keys):
                assert upcoming is not None
                current, upcoming = upcoming[1], None
                try:
                    raw = await current
                except asyncio.CancelledError:
                    # given up (timeout, shutdown): a block that was checked out just now goes back
                    await self._abandon(namespace_id, key, current)
                    raise
                except Exception as exc:
                    log.warning("serving block %s failed: %r", key.hex()[:16], exc)
                    await self._error(stream, f"serving block {i} failed: {exc}")
                    return True
                if raw is None:
                    stream.write(_frame(MISSING, key, i))
                    await stream.drain()
                    return True
                sent = False
                try:
                    if i + 1 < len(keys):
                        upcoming = (keys[i + 1], self._serve_ahead(namespace_id, keys[i + 1]))
                    known = raw[1] if isinstance(raw, tuple) else None
                    view = _as_bytes_view(raw[0] if isinstance(raw, tuple) else raw)
                    check = checksum(view) if known is None else known
                    if stream.bound:
                        check = bound_checksum(check, namespace_id, key)
                    stream.write(_frame(BLOCK, key, i, view.nbytes, check), view)
                    await stream.drain()
                    sent = True
                finally:
                    self._release(namespace_id, key, sent)
            stream.write(_frame(END))
            await stream.drain()
            return True
        finally:
            if upcoming is not None:
                await self._abandon(namespace_id, *upcoming)

    def _serve_ahead(self, namespace_id: int, key: bytes) -> asyncio.Future[Served]:
        """The block's checkout, started now (sent once the block before it is): a future, done
        already when the store answered at once."""
        fut: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
        try:
            served = self._serve_block(namespace_id, key)
        except Exception as exc:   # reported when its turn comes, as a failed awaitable would be
            fut.set_exception(exc)
            return fut
        if inspect.isawaitable(served):
            return asyncio.ensure_future(served)
        fut.set_result(served)
        return fut

    async def _abandon(self, namespace_id: int, key: bytes, fut: asyncio.Future[Served]) -> None:
        """A block served ahead but never sent: cancel it, or release it if it already came back."""
        if not fut.done():
            fut.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            if await fut is not None:
                self._release(namespace_id, key, sent=False)

    def _release(self, namespace_id: int, key: bytes, sent: bool) -> None:
        release = self._release_block if sent or self._release_unsent is None else self._release_unsent
        if release is not None:
            try:
                release(namespace_id, key)
            except Exception:
                log.exception("releasing a served block failed")

    async def _answer(self, stream: _Stream, outcome: str | Awaitable[str], index: int) -> None:
        """One ACK frame (``index``), or an ERROR frame when ``outcome`` is a refusal message."""
        message = await outcome if inspect.isawaitable(outcome) else outcome
        if message:
            await self._error(stream, message)
        else:
            stream.write(_frame(ACK, b"", index))
            await stream.drain()

    async def _receive_blocks(self, stream: _Stream, namespace_id: int, parent: bytes, keys: list[bytes]) -> bool:
        assert self._store_block is not None
        scratch = bytearray()
        stored = 0
        for i, key in enumerate(keys):
            kind, klen, _, index, length, check = _FRAME.unpack(await stream.read_exact(_FRAME.size, "reading a block"))
            fkey = await stream.read_exact(klen, "reading a block")
            if kind == END:
                break
            if kind != BLOCK or index != i or fkey != key:
                await self._ack(stream, stored, ERROR, f"malformed block frame at {i}")
                return False
            if length > self._limits.max_block_bytes:   # refused before a byte of it is buffered
                await self._ack(stream, stored, ERROR, f"block {i} has {length} bytes; this node takes "
                                                       f"at most {self._limits.max_block_bytes}")
                return False
            landing = self._land_block(namespace_id, parent, key, length) if self._land_block else None
            if landing is not None:
                view = landing.view
            else:
                if len(scratch) < length:
                    scratch = bytearray(length)
                view = memoryview(scratch)[:length]
            hasher = xxhash.xxh3_64()
            try:
                await stream.read_into(view, "reading a block", hasher)
            except BaseException:
                if landing is not None:
                    landing.abort()
                raise
            digest = hasher.intdigest()
            if (bound_checksum(digest, namespace_id, key) if stream.bound else digest) != check:
                if landing is not None:
                    landing.abort()
                log.warning("pushed block %d (%s) failed its checksum: dropped", i, key.hex()[:16])
                await self._ack(stream, stored, ERROR, f"block {i} failed its checksum: dropped")
                return False
            ok: bool | Awaitable[bool] = landing.commit(digest) if landing is not None else \
                self._store_block(namespace_id, parent, key, view)
            if inspect.isawaitable(ok):
                ok = await ok
            if not ok:
                why = self._why_refused(namespace_id, parent, length) if self._why_refused else ""
                await self._ack(stream, stored, ERROR, f"block {i} refused by the receiver{': ' + why if why else ''}")
                return False
            stored += 1
            parent = key
        else:
            kind, klen, *_ = _FRAME.unpack(await stream.read_exact(_FRAME.size, "reading the end"))
            await stream.read_exact(klen, "reading the end")
            if kind != END:
                await self._ack(stream, stored, ERROR, "expected the end of the push")
                return False
        await self._ack(stream, stored, ACK, "")
        return True

    async def _ack(self, stream: _Stream, stored: int, kind: int, message: str) -> None:
        raw = message.encode()
        stream.write(_frame(kind, b"", stored, len(raw)) + raw)
        with contextlib.suppress(_Closed):
            await stream.drain()


def _peername(stream: _Stream) -> str:
    if stream.transport is None:
        return "?"
    return str(stream.transport.get_extra_info("peername"))


# -- client ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Progress:
    done: int = 0


class PeerConnection:
    """One authenticated connection to a peer's :class:`BlockServer`; requests run one at a time.

    A transfer that ends with COMPLETE or MISSING (or an ERROR the peer reported) leaves the
    connection usable; any other outcome closes it (``usable`` turns False)."""

    def __init__(self, stream: _Stream, addr: tuple[str, int], limits: Limits) -> None:
        self._stream = stream
        self._addr = addr
        self._limits = limits
        self._scratch = bytearray()
        self._busy = asyncio.Lock()
        self._broken = False

    @property
    def usable(self) -> bool:
        return not self._broken and not self._stream.closed.done()

    @classmethod
    async def open(cls, addr: str | tuple[str, int], auth: PeerAuth, limits: Limits | None = None) -> PeerConnection:
        """Connect and authenticate. Raises :class:`PeerAuthError` when either side refuses the
        other's credentials, OSError when no connection can be made. Bound it with a timeout."""
        limits = limits or Limits()
        host, port = parse_address(addr)
        ctx = auth.client_context()
        server_name = (auth.tls.server_name or host) if auth.tls is not None else None
        loop = asyncio.get_running_loop()
        try:
            _, stream = await loop.create_connection(
                lambda: _Stream(limits), host, port, ssl=ctx, server_hostname=server_name,
                ssl_handshake_timeout=limits.handshake_timeout_s if ctx is not None else None)
        except ssl.SSLCertVerificationError as exc:
            raise PeerAuthError(f"peer {host}:{port}: its TLS certificate is not trusted: "
                                f"{exc.verify_message or exc}") from None
        except ssl.SSLError as exc:
            raise PeerAuthError(f"peer {host}:{port}: TLS handshake failed: {exc.reason or exc}") from None
        conn = cls(stream, (host, port), limits)
        try:
            await conn._hello(auth)
        except BaseException:
            stream.close(abort=True)
            raise
        return conn

    async def _hello(self, auth: PeerAuth) -> None:
        token = auth.token.encode()
        s = self._stream
        where = f"peer {self._addr[0]}:{self._addr[1]}"
        try:
            s.write(_HELLO.pack(MAGIC, VERSION, HELLO_BIND, len(token)) + token)
            magic, version, status, mlen = _WELCOME.unpack(await s.read_exact(_WELCOME.size, "authenticating"))
            message = (await s.read_exact(mlen, "authenticating")).decode(errors="replace")
        except (_Closed, ConnectionError, ssl.SSLError) as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, ssl.SSLError):
                raise PeerAuthError(f"{where} refused our TLS certificate: {cause.reason or cause}") from None
            if auth.tls is not None:
                raise PeerAuthError(f"{where} closed the connection during authentication: it most likely refused "
                                    "our TLS certificate (missing, expired, or not signed by a CA it trusts)") from None
            raise PeerAuthError(f"{where} closed the connection during authentication (does it require TLS?): "
                                f"{exc}") from None
        if magic != MAGIC:
            hint = "" if auth.tls is not None else " (or it expects TLS)"
            raise PeerAuthError(f"{where} does not speak the kvstored peer protocol{hint}")
        if status != WELCOME_OK:
            raise PeerAuthError(f"{where} refused the connection: {message}")
        s.bound = version == BOUND
        s.idle()   # read on until the first exchange: an early answer or close is noticed

    def close(self) -> None:
        self._stream.close()

    async def wait_closed(self) -> None:
        await self._stream.closed

    def _break(self) -> None:
        self._broken = True
        self._stream.close(abort=True)

    async def fetch(self, namespace_id: int, keys: Sequence[bytes], on_block: OnBlock, deadline_s: float, *,
                    into: Into | None = None) -> FetchResult:
        """Request ``keys`` and hand each verified block to ``on_block(index, payload)`` in order.

        ``payload`` is valid until ``on_block`` returns (or its awaitable is done): copy what you keep.
        With ``into(index, length)`` the payload is received straight into the writable memoryview
        it returns or resolves to (exactly ``length`` bytes); if the result's ``delivered`` is ``i``, the buffer for
        block ``i`` (if one was asked for) holds unverified bytes and must be discarded.
        The deadline covers the whole transfer, ``on_block`` included."""
        progress = _Progress()
        try:
            async with asyncio.timeout(deadline_s):
                return await self._fetch(namespace_id, list(keys), on_block, into, progress)
        except TimeoutError:
            self._break()
            return FetchResult(progress.done, len(keys), Stop.TIMEOUT,
                               f"deadline of {deadline_s:g}s passed after {progress.done} block(s)")

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[_Stream]:
        """One exchange at a time on the connection; the stream, idle again afterwards."""
        async with self._busy:
            try:
                yield self._stream
            finally:
                self._stream.idle()

    async def _fetch(self, namespace_id: int, keys: list[bytes], on_block: OnBlock, into: Into | None,
                     progress: _Progress) -> FetchResult:
        request = _encode_request(OP_FETCH, namespace_id, keys, self._limits)   # bad input: ValueError
        if not self.usable:
            return FetchResult(0, len(keys), Stop.PEER_CLOSED, "connection is closed")
        async with self._turn() as s:
            n = len(keys)
            try:
                s.write(request)
                await s.drain()
                for i in range(n + 1):
                    kind, klen, _, index, length, check = _FRAME.unpack(
                        await s.read_exact(_FRAME.size, f"waiting for block {i}"))
                    key = await s.read_exact(klen, f"reading block {i}")
                    # (END and MISSING carry no payload: one would be read as the next request's answer)
                    if kind == END and i == n and not length:
                        return FetchResult(n, n, Stop.COMPLETE)
                    if kind == MISSING and index == i and not length:
                        return FetchResult(i, n, Stop.MISSING, f"peer does not have block {i}")
                    if kind == ERROR:
                        message = (await s.read_exact(min(length, 4096), "reading an error")).decode(errors="replace")
                        if length > 4096:
                            self._break()
                        return FetchResult(i, n, Stop.PEER_ERROR, f"peer: {message}")
                    if kind != BLOCK or i == n or index != i or key != keys[i]:
                        self._break()
                        return FetchResult(i, n, Stop.PEER_ERROR, f"unexpected frame (kind {kind}, index {index}) "
                                                                  f"at block {i}")
                    if length > self._limits.max_block_bytes:
                        self._break()
                        return FetchResult(i, n, Stop.PEER_ERROR, f"block {i} of {length} bytes exceeds the limit")
                    dest = await self._destination(i, length, into)
                    hasher = xxhash.xxh3_64()
                    await s.read_into(dest, f"reading block {i}", hasher)
                    digest = hasher.intdigest()
                    if (bound_checksum(digest, namespace_id, keys[i]) if s.bound else digest) != check:
                        self._break()
                        log.warning("block %d (%s) from %s:%d failed its checksum: dropped", i, keys[i].hex()[:16],
                                    *self._addr)
                        return FetchResult(i, n, Stop.CORRUPT, f"block {i} failed its checksum and was dropped")
                    res = on_block(i, dest)
                    if inspect.isawaitable(res):
                        await res
                    progress.done = i + 1
            except (_Closed, ConnectionError, ssl.SSLError) as exc:
                self._break()
                return FetchResult(progress.done, n, Stop.PEER_CLOSED, str(exc))
            except BaseException:
                self._break()
                raise
            raise AssertionError("unreachable")

    async def _destination(self, index: int, length: int, into: Into | None) -> memoryview:
        if into is not None:
            place = into(index, length)
            dest = _as_bytes_view(await place if inspect.isawaitable(place) else place)
            if dest.readonly or dest.nbytes != length:
                raise ValueError(f"into({index}, {length}) must return a writable buffer of exactly {length} bytes")
            return dest
        if len(self._scratch) < length:
            self._scratch = bytearray(length)
        return memoryview(self._scratch)[:length]

    async def lookup(self, namespace_id: int, keys: Sequence[bytes], deadline_s: float) -> int:
        """How many leading ``keys`` the peer holds. Raises :class:`PeerError` when it cannot tell
        (refused, closed, past the deadline)."""
        return await self._exchange(_encode_request(OP_LOOKUP, namespace_id, keys, self._limits), deadline_s,
                                    len(keys))

    async def open_namespace(self, namespace_id: int, description: bytes, deadline_s: float) -> None:
        """Make the peer know a namespace before pushing blocks of it. Raises :class:`PeerError`
        with the peer's reason when it refuses, or when the exchange fails."""
        if len(description) > MAX_NAMESPACE_BYTES:
            raise ValueError(f"namespace description of {len(description)} bytes; at most {MAX_NAMESPACE_BYTES}")
        request = _REQUEST.pack(OP_NAMESPACE, 0, 0, 0, namespace_id, len(description)) + description
        await self._exchange(request, deadline_s, 0)

    async def _exchange(self, request: bytes, deadline_s: float, most: int) -> int:
        """Send a one-answer request; the ACK's ``index`` (at most ``most``), or PeerError."""
        if not self.usable:
            raise PeerError(f"connection to {self._addr[0]}:{self._addr[1]} is closed")
        try:
            async with asyncio.timeout(deadline_s), self._turn() as s:
                s.write(request)
                await s.drain()
                head = await s.read_exact(_FRAME.size, "waiting for an answer")
                kind, klen, _, index, length, _ = _FRAME.unpack(head)
                await s.read_exact(klen, "reading an answer")
                if kind == ACK:
                    if index > most or length:   # more than was asked, or bytes the next request would read
                        self._break()
                        raise PeerError(f"peer {self._addr[0]}:{self._addr[1]}: malformed answer (index {index} "
                                        f"of {most}, {length} payload bytes)")
                    return int(index)
                message = (await s.read_exact(min(length, 4096), "reading an error")).decode(errors="replace")
                if kind != ERROR or length > 4096:
                    self._break()
                    raise PeerError(f"peer {self._addr[0]}:{self._addr[1]}: {message}")
                raise PeerRefused(f"peer {self._addr[0]}:{self._addr[1]}: {message}")
        except TimeoutError:
            self._break()
            raise PeerError(f"peer {self._addr[0]}:{self._addr[1]} did not answer within {deadline_s:g}s") from None
        except (_Closed, ConnectionError, ssl.SSLError) as exc:
            self._break()
            raise PeerError(f"peer {self._addr[0]}:{self._addr[1]}: {exc}") from None
        except PeerError:
            raise           # the peer answered (with a refusal): the connection is in step
        except BaseException:
            self._break()   # cancelled mid-exchange: the answer would be read by the next request
            raise

    async def push(self, namespace_id: int, blocks: Sequence[tuple[bytes, memoryview | bytes]],
                   deadline_s: float, *, parent: bytes = b"",
                   checksums: Sequence[int | None] | None = None) -> PushResult:
        """Send ``(key, payload)`` blocks in order for the peer to store; it verifies each one and
        stops at the first bad or refused block. ``parent``: the key of the block before the first
        (b"" when the chain starts at the root). ``checksums``: the payloads' xxh3-64 where already
        known (None entries are computed). The payloads are not copied: keep them unchanged until
        this returns."""
        n = len(blocks)
        if checksums is not None and len(checksums) != n:
            raise ValueError(f"{len(checksums)} checksums for {n} blocks")
        try:
            async with asyncio.timeout(deadline_s):
                return await self._push(namespace_id, blocks, parent, checksums)
        except TimeoutError:
            self._break()
            return PushResult(0, n, Stop.TIMEOUT, f"deadline of {deadline_s:g}s passed")

    async def _push(self, namespace_id: int, blocks: Sequence[tuple[bytes, memoryview | bytes]],
                    parent: bytes, checksums: Sequence[int | None] | None) -> PushResult:
        n = len(blocks)
        keys = [k for k, _ in blocks]
        request = _encode_request(OP_PUSH, namespace_id, [parent, *keys] if parent else keys, self._limits,
                                  FLAG_PARENT if parent else 0)
        if not self.usable:
            return PushResult(0, n, Stop.PEER_CLOSED, "connection is closed")
        async with self._turn() as s:
            sent = 0
            try:
                s.write(request)
                for i, (key, payload) in enumerate(blocks):
                    view = _as_bytes_view(memoryview(payload))
                    known = None if checksums is None else checksums[i]
                    check = checksum(view) if known is None else known
                    if s.bound:
                        check = bound_checksum(check, namespace_id, key)
                    s.write(_frame(BLOCK, key, i, view.nbytes, check), view)
                    await s.drain()
                    sent = i + 1
                s.write(_frame(END))
                await s.drain()
            except (_Closed, ConnectionError, ssl.SSLError):
                pass   # the receiver may have stopped early: its answer says why
            except BaseException:
                self._break()   # cancelled mid-push: the stream is out of step
                raise
            try:
                kind, _, _, stored, length, _ = _FRAME.unpack(await s.read_exact(_FRAME.size, "waiting for the ack"))
                message = (await s.read_exact(min(length, 4096), "reading the ack")).decode(errors="replace")
            except (_Closed, ConnectionError, ssl.SSLError) as exc:
                self._break()
                return PushResult(0, sent, Stop.PEER_CLOSED, str(exc))
            except BaseException:
                self._break()
                raise
            if kind == ACK and stored == n and length <= 4096:
                return PushResult(n, n, Stop.COMPLETE)
            self._break()
            if stored > sent:   # it cannot have stored what it was not sent: trust none of it
                return PushResult(0, sent, Stop.PEER_ERROR, f"peer acknowledged {stored} block(s) of {sent} sent")
            stop = Stop.CORRUPT if "checksum" in message else Stop.REFUSED if "refused" in message else Stop.PEER_ERROR
            return PushResult(stored, sent, stop, f"peer: {message}")


async def fetch(addr: str | tuple[str, int], auth: PeerAuth, namespace_id: int, keys: Sequence[bytes],
                on_block: OnBlock, deadline_s: float, *, into: Into | None = None,
                limits: Limits | None = None) -> FetchResult:
    """Connect to ``addr``, fetch ``keys`` (see :meth:`PeerConnection.fetch`) and close.

    Never hangs: connecting, authenticating and the transfer all count against ``deadline_s``.
    A peer that cannot be reached gives ``Stop.UNREACHABLE``; refused credentials raise
    :class:`PeerAuthError`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(deadline_s):
            conn = await PeerConnection.open(addr, auth, limits)
    except TimeoutError:
        return FetchResult(0, len(keys), Stop.TIMEOUT, f"no connection within the deadline of {deadline_s:g}s")
    except OSError as exc:
        return FetchResult(0, len(keys), Stop.UNREACHABLE, f"cannot connect to {addr}: {exc}")
    try:
        return await conn.fetch(namespace_id, keys, on_block, max(0.0, deadline_s - (loop.time() - start)), into=into)
    finally:
        conn.close()


async def push(addr: str | tuple[str, int], auth: PeerAuth, namespace_id: int,
               blocks: Sequence[tuple[bytes, memoryview | bytes]], deadline_s: float, *,
               limits: Limits | None = None) -> PushResult:
    """Connect to ``addr``, push ``blocks`` (see :meth:`PeerConnection.push`) and close."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(deadline_s):
            conn = await PeerConnection.open(addr, auth, limits)
    except TimeoutError:
        return PushResult(0, 0, Stop.TIMEOUT, f"no connection within the deadline of {deadline_s:g}s")
    except OSError as exc:
        return PushResult(0, 0, Stop.UNREACHABLE, f"cannot connect to {addr}: {exc}")
    try:
        return await conn.push(namespace_id, blocks, max(0.0, deadline_s - (loop.time() - start)))
    finally:
        conn.close()
