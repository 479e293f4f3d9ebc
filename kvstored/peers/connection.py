"""The connecting end of the peer block channel: fetch, push, lookup and namespace requests; what a
transfer reports (:class:`FetchResult`, :class:`PushResult`)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvstored.addresses import parse_address
from kvstored.peers.auth import PeerAuth
from kvstored.peers.byte_stream import Closed, Stream
from kvstored.peers.errors import PeerAuthError, PeerError, PeerRefused
from kvstored.peers.wire import (
    ACK,
    BLOCK,
    BOUND,
    END,
    ERROR,
    FLAG_PARENT,
    FRAME,
    HELLO,
    HELLO_BIND,
    MAGIC,
    MAX_NAMESPACE_BYTES,
    MISSING,
    OP_FETCH,
    OP_LOOKUP,
    OP_NAMESPACE,
    OP_PUSH,
    REQUEST,
    VERSION,
    WELCOME,
    WELCOME_OK,
    Limits,
    as_bytes_view,
    bound_checksum,
    checksum,
    encode_frame,
    encode_request,
)

log = logging.getLogger("kvstored.peers")

OnBlock = Callable[[int, memoryview], "Awaitable[None] | None"]
Into = Callable[[int, int], "memoryview | Awaitable[memoryview]"]


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


@dataclass(slots=True)
class _Progress:
    done: int = 0


class PeerConnection:
    """One authenticated connection to a peer's :class:`~kvstored.peers.server.BlockServer`;
    requests run one at a time.

    A transfer that ends with COMPLETE or MISSING (or an ERROR the peer reported) leaves the
    connection usable; any other outcome closes it (``usable`` turns False)."""

    def __init__(self, stream: Stream, addr: tuple[str, int], limits: Limits) -> None:
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
                lambda: Stream(limits), host, port, ssl=ctx, server_hostname=server_name,
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
            s.write(HELLO.pack(MAGIC, VERSION, HELLO_BIND, len(token)) + token)
            magic, version, status, mlen = WELCOME.unpack(await s.read_exact(WELCOME.size, "authenticating"))
            message = (await s.read_exact(mlen, "authenticating")).decode(errors="replace")
        except (Closed, ConnectionError, ssl.SSLError) as exc:
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
    async def _turn(self) -> AsyncIterator[Stream]:
        """One exchange at a time on the connection; the stream, idle again afterwards."""
        async with self._busy:
            try:
                yield self._stream
            finally:
                self._stream.idle()

    async def _fetch(self, namespace_id: int, keys: list[bytes], on_block: OnBlock, into: Into | None,
                     progress: _Progress) -> FetchResult:
        request = encode_request(OP_FETCH, namespace_id, keys, self._limits)   # bad input: ValueError
        if not self.usable:
            return FetchResult(0, len(keys), Stop.PEER_CLOSED, "connection is closed")
        async with self._turn() as s:
            n = len(keys)
            try:
                s.write(request)
                await s.drain()
                for i in range(n + 1):
                    kind, klen, _, index, length, check = FRAME.unpack(
                        await s.read_exact(FRAME.size, f"waiting for block {i}"))
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
            except (Closed, ConnectionError, ssl.SSLError) as exc:
                self._break()
                return FetchResult(progress.done, n, Stop.PEER_CLOSED, str(exc))
            except BaseException:
                self._break()
                raise
            raise AssertionError("unreachable")

    async def _destination(self, index: int, length: int, into: Into | None) -> memoryview:
        if into is not None:
            place = into(index, length)
            dest = as_bytes_view(await place if inspect.isawaitable(place) else place)
            if dest.readonly or dest.nbytes != length:
                raise ValueError(f"into({index}, {length}) must return a writable buffer of exactly {length} bytes")
            return dest
        if len(self._scratch) < length:
            self._scratch = bytearray(length)
        return memoryview(self._scratch)[:length]

    async def lookup(self, namespace_id: int, keys: Sequence[bytes], deadline_s: float) -> int:
        """How many leading ``keys`` the peer holds. Raises :class:`PeerError` when it cannot tell
        (refused, closed, past the deadline)."""
        return await self._exchange(encode_request(OP_LOOKUP, namespace_id, keys, self._limits), deadline_s,
                                    len(keys))

    async def open_namespace(self, namespace_id: int, description: bytes, deadline_s: float) -> None:
        """Make the peer know a namespace before pushing blocks of it. Raises :class:`PeerError`
        with the peer's reason when it refuses, or when the exchange fails."""
        if len(description) > MAX_NAMESPACE_BYTES:
            raise ValueError(f"namespace description of {len(description)} bytes; at most {MAX_NAMESPACE_BYTES}")
        request = REQUEST.pack(OP_NAMESPACE, 0, 0, 0, namespace_id, len(description)) + description
        await self._exchange(request, deadline_s, 0)

    async def _exchange(self, request: bytes, deadline_s: float, most: int) -> int:
        """Send a one-answer request; the ACK's ``index`` (at most ``most``), or PeerError."""
        if not self.usable:
            raise PeerError(f"connection to {self._addr[0]}:{self._addr[1]} is closed")
        try:
            async with asyncio.timeout(deadline_s), self._turn() as s:
                s.write(request)
                await s.drain()
                head = await s.read_exact(FRAME.size, "waiting for an answer")
                kind, klen, _, index, length, _ = FRAME.unpack(head)
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
        except (Closed, ConnectionError, ssl.SSLError) as exc:
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
        request = encode_request(OP_PUSH, namespace_id, [parent, *keys] if parent else keys, self._limits,
                                  FLAG_PARENT if parent else 0)
        if not self.usable:
            return PushResult(0, n, Stop.PEER_CLOSED, "connection is closed")
        async with self._turn() as s:
            sent = 0
            try:
                s.write(request)
                for i, (key, payload) in enumerate(blocks):
                    view = as_bytes_view(memoryview(payload))
                    known = None if checksums is None else checksums[i]
                    check = checksum(view) if known is None else known
                    if s.bound:
                        check = bound_checksum(check, namespace_id, key)
                    s.write(encode_frame(BLOCK, key, i, view.nbytes, check), view)
                    await s.drain()
                    sent = i + 1
                s.write(encode_frame(END))
                await s.drain()
            except (Closed, ConnectionError, ssl.SSLError):
                pass   # the receiver may have stopped early: its answer says why
            except BaseException:
                self._break()   # cancelled mid-push: the stream is out of step
                raise
            try:
                kind, _, _, stored, length, _ = FRAME.unpack(await s.read_exact(FRAME.size, "waiting for the ack"))
                message = (await s.read_exact(min(length, 4096), "reading the ack")).decode(errors="replace")
            except (Closed, ConnectionError, ssl.SSLError) as exc:
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
