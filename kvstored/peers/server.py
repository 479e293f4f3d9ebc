"""The listening end of the peer block channel: serves blocks by key, stores pushed ones, answers lookups."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeAlias

import xxhash

from kvstored.peers.auth import PeerAuth, listener_allowed
from kvstored.peers.byte_stream import SPILL_BYTES, Closed, Stream
from kvstored.peers.errors import PeerConfigError
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
    WELCOME_AUTH_REJECTED,
    WELCOME_AUTH_REQUIRED,
    WELCOME_BAD_VERSION,
    WELCOME_OK,
    Limits,
    as_bytes_view,
    bound_checksum,
    checksum,
    decode_keys,
    encode_frame,
)
from kvstored.rpc_guard import BadRequests

log = logging.getLogger("kvstored.peers")

_LINGER_S = 5.0            # how long a refused push is drained, waiting for the pusher to close

CheckedOut: TypeAlias = tuple[memoryview, int | None]   # a block's bytes and their xxh3-64 (None: unknown)
Served: TypeAlias = memoryview | CheckedOut | None
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
                 limits: Limits | None = None, bad_requests: BadRequests | None = None) -> None:
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
        self._bad = bad_requests if bad_requests is not None else BadRequests()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._streams: set[Stream] = set()
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

    def _make_protocol(self) -> Stream:
        return Stream(self._limits, self._connected)

    def _connected(self, stream: Stream) -> None:
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

    async def _serve_connection(self, stream: Stream) -> None:
        try:
            async with asyncio.timeout(self._limits.handshake_timeout_s):
                if not await self._hello(stream):
                    return
            while True:
                try:
                    head = await stream.read_exact(REQUEST.size, "waiting for a request")
                except Closed:
                    return   # the client is done
                op, flags, _, count, namespace_id, key_bytes = REQUEST.unpack(head)
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
                    keys = decode_keys(await stream.read_exact(key_bytes, "reading keys"), count, flags)
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
        except (Closed, ConnectionError, TimeoutError, ssl.SSLError) as exc:
            log.debug("peer connection ended: %s", exc)
        finally:
            stream.close()
            self._streams.discard(stream)

    @contextlib.asynccontextmanager
    async def _bounded(self, stream: Stream, what: str) -> AsyncIterator[None]:
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

    async def _discard_until_closed(self, stream: Stream) -> None:
        """After refusing a push midway: drop what the pusher still sends until it closes (it does
        once it has read our answer), for at most ``_LINGER_S``. Closing with its bytes unread
        would make the kernel reset the connection, and the reset can destroy the answer before
        the pusher reads it."""
        sink = memoryview(bytearray(SPILL_BYTES))
        with contextlib.suppress(Closed, ConnectionError, TimeoutError, ssl.SSLError):
            async with asyncio.timeout(_LINGER_S):
                while True:
                    await stream.read_some(sink)

    async def _hello(self, stream: Stream) -> bool:
        magic, version, flags, token_len = HELLO.unpack(await stream.read_exact(HELLO.size, "reading hello"))
        if magic != MAGIC or version != VERSION:   # e.g. a TLS client on a plain listener: answer at once
            return await self._refuse(stream, WELCOME_BAD_VERSION, f"unsupported peer protocol {magic!r} v{version}")
        token = await stream.read_exact(token_len, "reading hello")
        if self._auth.token:
            if not token:
                return await self._refuse(stream, WELCOME_AUTH_REQUIRED, "this peer requires a shared token")
            if not hmac.compare_digest(token, self._auth.token.encode()):
                # a line per connection would let anyone who reaches the port fill the log
                self._bad.record("peer_hello", "wrong_token", _peer_host(stream), "presented a wrong token")
                return await self._refuse(stream, WELCOME_AUTH_REJECTED, "shared token rejected")
        stream.bound = bool(flags & HELLO_BIND)
        stream.write(WELCOME.pack(MAGIC, BOUND if stream.bound else VERSION, WELCOME_OK, 0))
        await stream.drain()
        return True

    async def _refuse(self, stream: Stream, status: int, message: str) -> bool:
        raw = message.encode()
        stream.write(WELCOME.pack(MAGIC, VERSION, status, len(raw)) + raw)
        with contextlib.suppress(Closed):
            await stream.drain()
        return False

    async def _error(self, stream: Stream, message: str) -> None:
        raw = message.encode()[:4096]
        stream.write(encode_frame(ERROR, b"", 0, len(raw)) + raw)
        with contextlib.suppress(Closed):
            await stream.drain()

    async def _send_blocks(self, stream: Stream, namespace_id: int, keys: list[bytes]) -> bool:
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
                    stream.write(encode_frame(MISSING, key, i))
                    await stream.drain()
                    return True
                sent = False
                try:
                    if i + 1 < len(keys):
                        upcoming = (keys[i + 1], self._serve_ahead(namespace_id, keys[i + 1]))
                    known = raw[1] if isinstance(raw, tuple) else None
                    view = as_bytes_view(raw[0] if isinstance(raw, tuple) else raw)
                    check = checksum(view) if known is None else known
                    if stream.bound:
                        check = bound_checksum(check, namespace_id, key)
                    stream.write(encode_frame(BLOCK, key, i, view.nbytes, check), view)
                    await stream.drain()
                    sent = True
                finally:
                    self._release(namespace_id, key, sent)
            stream.write(encode_frame(END))
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

    async def _answer(self, stream: Stream, outcome: str | Awaitable[str], index: int) -> None:
        """One ACK frame (``index``), or an ERROR frame when ``outcome`` is a refusal message."""
        message = await outcome if inspect.isawaitable(outcome) else outcome
        if message:
            await self._error(stream, message)
        else:
            stream.write(encode_frame(ACK, b"", index))
            await stream.drain()

    async def _receive_blocks(self, stream: Stream, namespace_id: int, parent: bytes, keys: list[bytes]) -> bool:
        assert self._store_block is not None
        scratch = bytearray()
        stored = 0
        for i, key in enumerate(keys):
            kind, klen, _, index, length, check = FRAME.unpack(await stream.read_exact(FRAME.size, "reading a block"))
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
            kind, klen, *_ = FRAME.unpack(await stream.read_exact(FRAME.size, "reading the end"))
            await stream.read_exact(klen, "reading the end")
            if kind != END:
                await self._ack(stream, stored, ERROR, "expected the end of the push")
                return False
        await self._ack(stream, stored, ACK, "")
        return True

    async def _ack(self, stream: Stream, stored: int, kind: int, message: str) -> None:
        raw = message.encode()
        stream.write(encode_frame(kind, b"", stored, len(raw)) + raw)
        with contextlib.suppress(Closed):
            await stream.drain()


def _peer_host(stream: Stream) -> str:
    """The peer's address without its port: one client however many connections it opens."""
    name = stream.transport.get_extra_info("peername") if stream.transport is not None else None
    return str(name[0]) if isinstance(name, tuple) and name else "?"


def _peername(stream: Stream) -> str:
    if stream.transport is None:
        return "?"
    return str(stream.transport.get_extra_info("peername"))
