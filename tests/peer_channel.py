"""The peer channel tests' helpers: in-memory blocks to serve and store, a fault-injecting proxy,
test certificates.

Faults are injected by a small TCP proxy between client and server that flips a byte, cuts the
connection, or stops forwarding at a chosen offset of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import pki as test_pki
import pytest
import uvloop

from kvstored.peers import wire
from kvstored.peers.auth import PeerAuth, TLSFiles

NS = 42


def run(coro: Coroutine[Any, Any, Any], use_uvloop: bool = False) -> Any:
    return uvloop.run(coro) if use_uvloop else asyncio.run(coro)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(i: int, n: int = 256 << 10) -> bytes:
    return (bytes([i % 251]) + os.urandom(15)) * (n // 16)


class Blocks:
    """An in-memory ``serve_block`` that records calls and releases."""

    def __init__(self, blocks: dict[bytes, bytes], stall_from: int | None = None) -> None:
        self.blocks = blocks
        self.served: list[bytes] = []
        self.released: list[bytes] = []
        self.stall_from = stall_from

    async def serve(self, namespace_id: int, k: bytes) -> memoryview | None:
        assert namespace_id == NS
        if self.stall_from is not None and len(self.served) >= self.stall_from:
            await asyncio.Event().wait()
        self.served.append(k)
        b = self.blocks.get(k)
        return memoryview(b) if b is not None else None

    def release(self, namespace_id: int, k: bytes) -> None:
        self.released.append(k)


def chain(n: int, size: int = 256 << 10) -> tuple[list[bytes], dict[bytes, bytes]]:
    keys = [key(i) for i in range(n)]
    return keys, {k: payload(i, size) for i, k in enumerate(keys)}


class Collector:
    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def __call__(self, index: int, view: memoryview) -> None:
        self.got.append((index, bytes(view)))


# -- a fault-injecting proxy ----------------------------------------------------------------------
@dataclass
class Fault:
    """At byte ``offset`` of one direction: "flip" one byte, "cut" (reset both sides), or "stall"
    (stop forwarding, keep the connections open)."""

    action: str
    offset: int
    upstream: bool = False    # True: client -> server direction; False: server -> client


class Proxy:
    def __init__(self, target: tuple[str, int], fault: Fault | None) -> None:
        self.target = target
        self.fault = fault
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Proxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    @property
    def address(self) -> tuple[str, int]:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[:2]

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.transport.abort()
        for t in list(self.tasks):
            t.cancel()
        for t in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.server.wait_closed()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)
        self.writers += [cw, sw]
        for args in ((cr, sw, True), (sr, cw, False)):
            task = asyncio.ensure_future(self._pump(*args, peers=(cw, sw)))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool,
                    peers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        fault = self.fault if self.fault is not None and self.fault.upstream == upstream else None
        pos = 0
        while True:
            data = await reader.read(1 << 16)
            if not data:
                writer.close()
                return
            if fault is not None and pos <= fault.offset < pos + len(data):
                cut = fault.offset - pos
                if fault.action == "flip":
                    buf = bytearray(data)
                    buf[cut] ^= 0xFF
                    data = bytes(buf)
                else:
                    writer.write(data[:cut])
                    await writer.drain()
                    if fault.action == "cut":
                        for w in peers:
                            w.transport.abort()
                        return
                    await asyncio.Event().wait()   # stall forever (until the proxy closes)
            writer.write(data)
            await writer.drain()
            pos += len(data)


def block_offset(sizes: list[int], index: int, keylen: int = 32) -> int:
    """Offset in the server -> client stream where block ``index``'s payload starts."""
    pos = wire.WELCOME.size
    for i in range(index):
        pos += wire.FRAME.size + keylen + sizes[i]
    return pos + wire.FRAME.size + keylen


class Received:
    """A ``store_block`` that keeps every block it is given."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}

    async def store(self, namespace_id: int, parent: bytes, k: bytes, view: memoryview) -> bool:
        self.blocks[k] = bytes(view)
        return True


@dataclass(frozen=True)
class PKI:
    ca: str
    other_ca: str
    server: tuple[str, str]
    client: tuple[str, str]
    expired_server: tuple[str, str]
    expired_client: tuple[str, str]
    foreign_client: tuple[str, str]   # signed by other_ca


def make_pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """A CA and certificates it signed (expired ones too), and a client certificate of another CA;
    skips the test when they cannot be made."""
    test_pki.require()
    d = tmp_path_factory.mktemp("pki")
    ca, other = test_pki.make_ca("kvstored test CA"), test_pki.make_ca("some other CA")

    def leaf(name: str, issuer: test_pki.Issued, server: bool, days: tuple[int, int] = (-1, 30)) -> tuple[str, str]:
        return test_pki.write(d, name, test_pki.make_leaf(name, issuer, server=server, client=not server, days=days))

    return PKI(ca=test_pki.write(d, "ca", ca, with_key=False)[0],
               other_ca=test_pki.write(d, "other-ca", other, with_key=False)[0],
               server=leaf("server", ca, True), client=leaf("client", ca, False),
               expired_server=leaf("expired-server", ca, True, (-30, -1)),
               expired_client=leaf("expired-client", ca, False, (-30, -1)),
               foreign_client=leaf("foreign-client", other, False))


def tls(ca: str, pair: tuple[str, str] | None) -> PeerAuth:
    return PeerAuth(tls=TLSFiles(ca_file=ca, cert_file=pair[0] if pair else "", key_file=pair[1] if pair else ""))
