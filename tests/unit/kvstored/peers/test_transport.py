"""The peer block channel on loopback: order, checksums, missing keys, dead and partitioned peers,
and authentication (mutual TLS with generated certificates, shared tokens, listener safety).

Faults are injected by a small TCP proxy between client and server that flips a byte, cuts the
connection, or stops forwarding at a chosen offset of the stream; a real peer process is also
killed with SIGKILL mid-transfer. Throughput is measured by `python -m tools.bench peers`, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pki as test_pki
import pytest
import uvloop

from kvstored.peers import transport as T
from kvstored.peers.transport import (
    BlockServer,
    FetchResult,
    PeerAuth,
    PeerAuthError,
    PeerConfigError,
    PeerConnection,
    Stop,
    TLSFiles,
    fetch,
    push,
)

NS = 42
ROOT = Path(__file__).resolve().parents[4]


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
    pos = T._WELCOME.size
    for i in range(index):
        pos += T._FRAME.size + keylen + sizes[i]
    return pos + T._FRAME.size + keylen


# -- transfers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_blocks_arrive_in_order_and_intact(use_uvloop: bool) -> None:
    sizes = [256 << 10, 2 << 20, 1, 64 << 10, 3 << 20, 100_000]
    keys = [key(i) for i in range(len(sizes))]
    data = {k: payload(i, n) if n >= 16 else b"z" for i, (k, n) in enumerate(zip(keys, sizes))}
    blocks = Blocks(data)

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv:
            order: list[int] = []

            async def on_block(i: int, view: memoryview) -> None:
                order.append(i)
                assert bytes(view) == data[keys[i]]
                await asyncio.sleep(0.01)   # a slow consumer does not reorder or lose anything

            res = await fetch(srv.address, PeerAuth(), NS, keys, on_block, 10)
            assert res == FetchResult(len(keys), len(keys), Stop.COMPLETE)
            assert order == list(range(len(keys)))
            # straight into the caller's buffers
            dest = {i: bytearray(n) for i, n in enumerate(sizes)}
            res = await fetch(srv.address, PeerAuth(), NS, keys, lambda i, v: None, 10,
                              into=lambda i, n: memoryview(dest[i]))
            assert res.complete
            assert all(bytes(dest[i]) == data[k] for i, k in enumerate(keys))
        assert sorted(blocks.released) == sorted(keys * 2)   # every served view released exactly once

    run(main(), use_uvloop)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_a_store_may_answer_at_once_or_later_and_fail_either_way(use_uvloop: bool) -> None:
    # The daemon's store answers at once for a block in DRAM and through an awaitable for one
    # it must read from SSD first; both kinds, mixed in one chain, arrive in order and intact.
    keys, data = chain(8)
    released: list[bytes] = []

    def serve(namespace_id: int, k: bytes) -> Any:
        i = keys.index(k)
        if i == 6:
            raise OSError("bad sector")   # at once, not through an awaitable
        if i % 3 == 1:
            async def later() -> memoryview:
                await asyncio.sleep(0.005)
                return memoryview(data[k])
            return later()
        return memoryview(data[k])

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), serve, release_block=lambda ns, k: released.append(k)) \
                as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            got = Collector()
            res = await conn.fetch(NS, keys, got, 10)
            assert (res.delivered, res.stop) == (6, Stop.PEER_ERROR) and "bad sector" in res.detail
            assert [i for i, _ in got.got] == list(range(6))
            assert all(bytes(view) == data[keys[i]] for i, view in got.got)
            assert conn.usable and (await conn.fetch(NS, keys[:6], got, 10)).complete   # still in step
            conn.close()
        assert sorted(released) == sorted(keys[:6] * 2)   # every view served released once

    run(main(), use_uvloop)


def test_missing_block_stops_the_chain_and_connection_stays_usable() -> None:
    keys, data = chain(6)
    del data[keys[3]]
    blocks = Blocks(data)

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            got = Collector()
            res = await conn.fetch(NS, keys, got, 10)
            assert (res.delivered, res.stop) == (3, Stop.MISSING)
            assert [i for i, _ in got.got] == [0, 1, 2]
            assert blocks.served == keys[:4]            # nothing asked after the gap
            assert sorted(blocks.released) == sorted(keys[:3])
            assert conn.usable
            res = await conn.fetch(NS, keys[:2], got, 10)
            assert res.complete
            res = await conn.fetch(NS, [], got, 10)
            assert res == FetchResult(0, 0, Stop.COMPLETE)
            conn.close()

    run(main())


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_an_idle_connection_notices_the_peer_going_away(use_uvloop: bool) -> None:
    # Reading pauses between reads during a transfer; an idle pooled connection must still see
    # the peer close it, or the next fetch would be sent down a dead connection.
    keys, data = chain(3)

    async def main() -> None:
        blocks = Blocks(data)
        srv = BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release)
        await srv.start()
        conn = await PeerConnection.open(srv.address, PeerAuth())
        assert (await conn.fetch(NS, keys, Collector(), 10)).complete
        await srv.close()
        for _ in range(100):
            if not conn.usable:
                break
            await asyncio.sleep(0.02)
        assert not conn.usable
        conn.close()

    run(main(), use_uvloop)


def test_a_connection_accepted_as_the_listener_closes_is_not_served() -> None:
    # The loop accepts a connection, then calls connection_made on a later turn: a close between
    # the two found no such connection to end. It was served afterwards, by a listener that no
    # longer exists (after a daemon restart: from the store that was closed), until the peer left.
    keys, data = chain(2, 1024)

    async def main() -> None:
        blocks = Blocks(data)
        srv = BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release)
        closing: list[asyncio.Future[None]] = []
        make = srv._make_protocol

        def made() -> T._Stream:
            # the close starts on the loop's next turn, ahead of this connection's connection_made
            closing.append(asyncio.ensure_future(srv.close()))
            return make()

        srv._make_protocol = made   # type: ignore[method-assign]
        await srv.start()
        with contextlib.suppress(PeerAuthError, OSError):   # refused: fine
            conn = await asyncio.wait_for(PeerConnection.open(srv.address, PeerAuth()), 5)
            res = await conn.fetch(NS, keys, Collector(), 5)
            conn.close()
            assert res.delivered == 0, "a closed listener served blocks"
        await asyncio.wait_for(closing[0], 5)
        assert blocks.served == []

    run(main())


def test_corrupt_block_is_dropped_and_ends_the_transfer() -> None:
    keys, data = chain(5)
    sizes = [len(data[k]) for k in keys]

    async def main() -> None:
        blocks = Blocks(data)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv, \
                Proxy(srv.address, Fault("flip", block_offset(sizes, 2) + 1000)) as proxy:
            got = Collector()
            res = await fetch(proxy.address, PeerAuth(), NS, keys, got, 10)
            assert (res.delivered, res.stop) == (2, Stop.CORRUPT)
            assert "checksum" in res.detail
            assert [i for i, _ in got.got] == [0, 1]      # block 2 never reached the consumer
            assert all(b == data[keys[i]] for i, b in got.got)
            # "into": the caller learns block 2 is bad from delivered == 2
            dest = {i: bytearray(n) for i, n in enumerate(sizes)}
            res = await fetch(proxy.address, PeerAuth(), NS, keys, lambda i, v: None, 10,
                              into=lambda i, n: memoryview(dest[i]))
            assert (res.delivered, res.stop) == (2, Stop.CORRUPT)

    run(main())


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("where", [0, 300_000, (3 << 20) - 1], ids=["first-byte", "middle", "last-byte"])
def test_corruption_anywhere_in_a_large_block_is_caught(where: int, use_uvloop: bool) -> None:
    # Blocks are checksummed piece by piece as they land (a piece may come from the read-ahead
    # spill, the rest straight into the slot): a flip in any piece must still fail the block.
    keys, data = chain(3, 3 << 20)
    sizes = [len(data[k]) for k in keys]

    async def main() -> None:
        blocks = Blocks(data)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv, \
                Proxy(srv.address, Fault("flip", block_offset(sizes, 1) + where)) as proxy:
            dest = {i: bytearray(n) for i, n in enumerate(sizes)}
            res = await fetch(proxy.address, PeerAuth(), NS, keys, lambda i, v: None, 10,
                              into=lambda i, n: memoryview(dest[i]))
            assert (res.delivered, res.stop) == (1, Stop.CORRUPT)
            assert bytes(dest[0]) == data[keys[0]]
            res = await fetch(srv.address, PeerAuth(), NS, keys, lambda i, v: None, 10,
                              into=lambda i, n: memoryview(dest[i]))
            assert res.complete and all(bytes(dest[i]) == data[k] for i, k in enumerate(keys))

    run(main(), use_uvloop)


class Received:
    """A ``store_block`` that keeps every block it is given."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}

    async def store(self, namespace_id: int, parent: bytes, k: bytes, view: memoryview) -> bool:
        self.blocks[k] = bytes(view)
        return True


def test_push_with_known_checksums_sends_them_and_checks_their_count() -> None:
    keys, data = chain(3)
    received = Received()
    stored = received.blocks

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve, store_block=received.store) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            blocks = [(k, data[k]) for k in keys]
            with pytest.raises(ValueError, match="checksums"):
                await conn.push(NS, blocks, 10, checksums=[None])
            known = [T.checksum(data[keys[0]]), None, T.checksum(data[keys[2]])]
            res = await conn.push(NS, blocks, 10, checksums=known)
            assert res.complete and stored == data
            # a stale checksum (the bytes changed since it was taken) is caught by the receiver
            stored.clear()
            res = await conn.push(NS, blocks, 10, checksums=[known[0], known[0], None])
            assert (res.stored, res.stop) == (1, Stop.CORRUPT) and list(stored) == [keys[0]]
            conn.close()

    run(main())


def test_peer_connection_cut_mid_block_keeps_complete_blocks() -> None:
    keys, data = chain(6)
    sizes = [len(data[k]) for k in keys]

    async def main() -> None:
        blocks = Blocks(data)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv, \
                Proxy(srv.address, Fault("cut", block_offset(sizes, 3) + sizes[3] // 2)) as proxy:
            got = Collector()
            t0 = time.monotonic()
            res = await fetch(proxy.address, PeerAuth(), NS, keys, got, 30)
            assert (res.delivered, res.stop) == (3, Stop.PEER_CLOSED)
            assert time.monotonic() - t0 < 5
            assert [i for i, _ in got.got] == [0, 1, 2]
            for _ in range(100):   # the server notices the reset and releases what it held
                if len(blocks.released) == len(blocks.served):
                    break
                await asyncio.sleep(0.02)
            assert sorted(blocks.released) == sorted(blocks.served)

    run(main())


_PEER_PROCESS = """
import asyncio, sys
from kvstored.peers.transport import BlockServer, PeerAuth
N = int(sys.argv[1])
async def serve(ns, k):
    i = int.from_bytes(k[:4], "big")
    if i >= N:
        await asyncio.Event().wait()   # hangs: the test kills us here
    return memoryview(bytes([i]) * (512 << 10))
async def main():
    srv = BlockServer("127.0.0.1", 0, PeerAuth(), serve)
    await srv.start()
    print(srv.address[1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_peer_process_killed_mid_transfer_gives_a_short_result() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _PEER_PROCESS, "3"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())

        async def main() -> FetchResult:
            got: list[int] = []

            def on_block(i: int, view: memoryview) -> None:
                assert view[0] == i and len(view) == 512 << 10
                got.append(i)
                if i == 2:   # the peer now hangs serving block 3: kill it
                    os.kill(proc.pid, signal.SIGKILL)

            res = await fetch(("127.0.0.1", port), PeerAuth(), NS, [key(i) for i in range(6)], on_block, 30)
            assert got == [0, 1, 2]
            return res

        t0 = time.monotonic()
        res = run(main())
        assert (res.delivered, res.stop) == (3, Stop.PEER_CLOSED), res
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait(10)


def test_partitioned_peer_times_out_within_the_deadline() -> None:
    keys, data = chain(6)
    sizes = [len(data[k]) for k in keys]

    async def main() -> None:
        blocks = Blocks(data)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv:
            # the link stops carrying anything in the middle of block 2
            async with Proxy(srv.address, Fault("stall", block_offset(sizes, 2) + 5000)) as proxy:
                got = Collector()
                t0 = time.monotonic()
                res = await fetch(proxy.address, PeerAuth(), NS, keys, got, 1.0)
                elapsed = time.monotonic() - t0
                assert (res.delivered, res.stop) == (2, Stop.TIMEOUT)
                assert 0.9 <= elapsed < 1.8
            # a peer that accepts but never answers the hello
            async with Proxy(srv.address, Fault("stall", 0, upstream=True)) as proxy:
                t0 = time.monotonic()
                res = await fetch(proxy.address, PeerAuth(), NS, keys, Collector(), 0.5)
                assert (res.delivered, res.stop) == (0, Stop.TIMEOUT)
                assert time.monotonic() - t0 < 1.3
        # a server that stalls serving a block (its disk hangs) is the same to the client
        stalled = Blocks(data, stall_from=1)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), stalled.serve) as srv:
            res = await fetch(srv.address, PeerAuth(), NS, keys, Collector(), 0.5)
            assert (res.delivered, res.stop) == (1, Stop.TIMEOUT)

    run(main())


def test_unreachable_peer() -> None:
    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve) as srv:
            addr = srv.address
        res = await fetch(addr, PeerAuth(), NS, [key(0)], Collector(), 2)   # closed: nothing listens
        assert (res.delivered, res.stop) == (0, Stop.UNREACHABLE)

    run(main())


def test_peer_error_and_bad_requests() -> None:
    async def broken(namespace_id: int, k: bytes) -> memoryview | None:
        raise OSError("disk on fire")

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), broken) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            res = await conn.fetch(NS, [key(0), key(1)], Collector(), 5)
            assert res.stop is Stop.PEER_ERROR and "disk on fire" in res.detail
            conn.close()
        # failing after the first block: the error frame comes where a block was expected
        keys, data = chain(4)
        served: list[bytes] = []

        async def fails_at_2(namespace_id: int, k: bytes) -> memoryview | None:
            served.append(k)
            if k == keys[2]:
                raise OSError("bad sector")
            return memoryview(data[k])

        async with BlockServer("127.0.0.1", 0, PeerAuth(), fails_at_2) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            got = Collector()
            res = await conn.fetch(NS, keys, got, 5)
            assert (res.delivered, res.stop) == (2, Stop.PEER_ERROR) and "bad sector" in res.detail
            assert [i for i, _ in got.got] == [0, 1]
            assert conn.usable and (await conn.fetch(NS, keys[:2], got, 5)).complete   # still in step
            with pytest.raises(ValueError, match="key"):
                await conn.fetch(NS, [b""], Collector(), 5)
            with pytest.raises(ValueError, match="keys"):
                await conn.fetch(NS, [key(0)] * (T.Limits().max_keys + 1), Collector(), 5)
            conn.close()

    run(main())


def test_push_stores_verified_blocks_and_drops_a_corrupt_one() -> None:
    keys, data = chain(4)
    received = Received()
    stored = received.blocks

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve, store_block=received.store) as srv:
            res = await push(srv.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert res.complete and res.stored == 4
            assert stored == data
            stored.clear()
            # flip a byte inside block 1's payload on its way to the receiver
            request = T._REQUEST.size + sum(1 + len(k) for k in keys)
            offset = T._HELLO.size + request + T._FRAME.size + 32 + len(data[keys[0]]) + T._FRAME.size + 32 + 7
            async with Proxy(srv.address, Fault("flip", offset, upstream=True)) as proxy:
                res = await push(proxy.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert (res.stored, res.stop) == (1, Stop.CORRUPT)
            assert list(stored) == [keys[0]]

    run(main())


# -- frame checksums cover the namespace and the key ----------------------------------------------
OTHER = NS ^ 0xFF   # NS with the last byte of its id flipped, as the proxy below flips it
NS_BYTE = T._HELLO.size + 15   # client -> server: the last byte of the first request's namespace id


class TwoNamespaces:
    """A ``serve_block`` holding the same keys in namespaces NS and OTHER, with other bytes."""

    def __init__(self, keys: list[bytes]) -> None:
        self.blocks = {(ns, k): payload(i + 100 * (ns == OTHER)) for i, k in enumerate(keys) for ns in (NS, OTHER)}
        self.served: list[bytes] = []
        self.released: list[bytes] = []

    def serve(self, namespace_id: int, k: bytes) -> memoryview | None:
        b = self.blocks.get((namespace_id, k))
        if b is not None:
            self.served.append(k)
        return memoryview(b) if b is not None else None

    def release(self, namespace_id: int, k: bytes) -> None:
        self.released.append(k)


def test_a_request_whose_namespace_id_was_corrupted_delivers_no_block_of_another_namespace() -> None:
    """Regression: a frame's checksum covered its payload only, so a request whose namespace id
    was damaged on the way was answered with the same keys' blocks of another namespace (the
    same length: another dtype or layout of the same prompt), and they passed their checksums
    and were delivered as this namespace's. The checksum now binds the namespace id and key."""
    keys = [key(i) for i in range(3)]

    async def main() -> None:
        two = TwoNamespaces(keys)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), two.serve, release_block=two.release) as srv, \
                Proxy(srv.address, Fault("flip", NS_BYTE, upstream=True)) as proxy:
            got = Collector()
            res = await fetch(proxy.address, PeerAuth(), NS, keys, got, 10)
            assert got.got == [], "a block of another namespace was delivered"
            assert (res.delivered, res.stop) == (0, Stop.CORRUPT)
            res = await fetch(srv.address, PeerAuth(), NS, keys, got, 10)   # undamaged: as before
            assert res.complete and [b for _, b in got.got] == [two.blocks[NS, k] for k in keys]
        assert sorted(two.released) == sorted(two.served), "a served block was not released"

    run(main())


def test_a_push_whose_namespace_id_was_corrupted_stores_nothing_in_another_namespace() -> None:
    """Regression: as above for a push: the receiver stored the blocks in the namespace the
    damaged id named (one it holds too), their payload checksums passing."""
    keys, data = chain(2)
    stored: list[tuple[int, bytes]] = []

    async def store(namespace_id: int, parent: bytes, k: bytes, view: memoryview) -> bool:
        stored.append((namespace_id, k))
        return True

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve, store_block=store) as srv:
            async with Proxy(srv.address, Fault("flip", NS_BYTE, upstream=True)) as proxy:
                res = await push(proxy.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert stored == [], "blocks were stored in another namespace"
            assert (res.stored, res.stop) == (0, Stop.CORRUPT)
            res = await push(srv.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert res.complete and stored == [(NS, k) for k in keys]

    run(main())


def test_nodes_that_predate_bound_checksums_still_talk_to_new_ones() -> None:
    """Binding is agreed per connection: a client that does not ask for it (an older node) gets
    payload checksums, and a server that does not answer BOUND (an older node) is sent and checked
    payload checksums, so a cluster can be upgraded one node at a time."""
    keys, data = chain(2)

    async def old_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        *_, token_len = T._HELLO.unpack(await reader.readexactly(T._HELLO.size))   # flags ignored
        await reader.readexactly(token_len)
        writer.write(T._WELCOME.pack(T.MAGIC, T.VERSION, T.WELCOME_OK, 0))
        _, flags, _, count, _, body_bytes = T._REQUEST.unpack(await reader.readexactly(T._REQUEST.size))
        for i, k in enumerate(T._decode_keys(await reader.readexactly(body_bytes), count, flags)):
            writer.write(T._frame(T.BLOCK, k, i, len(data[k]), T.checksum(data[k])) + data[k])
        writer.write(T._frame(T.END))
        await writer.drain()
        await reader.read()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(old_server, "127.0.0.1", 0)
        try:
            got = Collector()
            res = await fetch(server.sockets[0].getsockname()[:2], PeerAuth(), NS, keys, got, 10)
            assert res.complete and [b for _, b in got.got] == [data[k] for k in keys]
        finally:
            server.close()
        blocks = Blocks(data)
        async with BlockServer("127.0.0.1", 0, PeerAuth(), blocks.serve, release_block=blocks.release) as srv:
            reader, writer = await asyncio.open_connection(*srv.address)
            writer.write(T._HELLO.pack(T.MAGIC, T.VERSION, 0, 0))   # an old client: no BIND flag
            assert T._WELCOME.unpack(await reader.readexactly(T._WELCOME.size)) == (T.MAGIC, T.VERSION,
                                                                                     T.WELCOME_OK, 0)
            writer.write(T._encode_request(T.OP_FETCH, NS, keys, T.Limits()))
            for i, k in enumerate(keys):
                kind, klen, _, index, length, check = T._FRAME.unpack(await reader.readexactly(T._FRAME.size))
                assert (kind, index, await reader.readexactly(klen)) == (T.BLOCK, i, k)
                assert check == T.checksum(await reader.readexactly(length)) and length == len(data[k])
            assert T._FRAME.unpack(await reader.readexactly(T._FRAME.size))[0] == T.END
            writer.close()

    run(main())


class Landings:
    """A ``land_block`` that hands out buffers and records how each landing ended."""

    def __init__(self) -> None:
        self.stored: dict[bytes, bytes] = {}
        self.ended: list[tuple[bytes, str]] = []

    def land(self, namespace_id: int, parent: bytes, key: bytes, length: int) -> object:
        outer = self

        class _Landing:
            view = memoryview(bytearray(length))

            def commit(self, checksum: int) -> bool:
                assert checksum == T.checksum(self.view), "commit gets the checksum the bytes passed"
                outer.stored[key] = bytes(self.view)
                outer.ended.append((key, "commit"))
                return True

            def abort(self) -> None:
                outer.ended.append((key, "abort"))
        return _Landing()


def test_push_lands_blocks_in_place_and_aborts_a_corrupt_or_cut_one() -> None:
    keys, data = chain(4)

    async def refuse(*_: object) -> bool:
        raise AssertionError("every block has a landing: the copy path is not used")

    async def main() -> None:
        landings = Landings()
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve, store_block=refuse,
                               land_block=landings.land) as srv:  # type: ignore[arg-type]
            res = await push(srv.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert res.complete and landings.stored == data
            assert landings.ended == [(k, "commit") for k in keys]
            request = T._REQUEST.size + sum(1 + len(k) for k in keys)
            block1 = T._HELLO.size + request + T._FRAME.size + 32 + len(data[keys[0]]) + T._FRAME.size + 32
            for fault in (Fault("flip", block1 + 9, upstream=True), Fault("cut", block1 + 9, upstream=True)):
                landings.ended.clear()
                async with Proxy(srv.address, fault) as proxy:
                    res = await push(proxy.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
                if fault.action == "flip":   # the receiver's answer says how far it got
                    assert (res.stored, res.stop) == (1, Stop.CORRUPT)
                else:                          # the connection is gone, and the answer with it
                    assert res.stop == Stop.PEER_CLOSED
                for _ in range(100):   # the server notices a cut connection on its own time
                    if len(landings.ended) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert landings.ended == [(keys[0], "commit"), (keys[1], "abort")], fault.action

    run(main())


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("refuse", [0, 1])
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_a_push_refused_on_a_fresh_connection_says_how_far_and_why(pki: PKI, secure: bool, refuse: int,
                                                                    use_uvloop: bool) -> None:
    # Regressions: reading stayed paused after the handshake, so when the receiver refused a
    # large push early and closed, the pusher never read the answer ("peer closed" instead of
    # "refused"); and a receiver that closed with the rest of the push unread could have the
    # kernel reset the connection over its answer (it now drains the push until the pusher closes).
    keys, data = chain(3, 4 << 20)

    async def store(namespace_id: int, parent: bytes, k: bytes, view: memoryview) -> bool:
        return k != keys[refuse]

    async def main() -> None:
        server_auth = tls(pki.ca, pki.server) if secure else PeerAuth()
        client_auth = tls(pki.ca, pki.client) if secure else PeerAuth()
        async with BlockServer("127.0.0.1", 0, server_auth, Blocks({}).serve, store_block=store) as srv:
            for _ in range(5):
                conn = await PeerConnection.open(srv.address, client_auth)
                res = await conn.push(NS, [(k, data[k]) for k in keys], 10)
                conn.close()
                assert (res.stored, res.stop) == (refuse, Stop.REFUSED), res

    run(main(), use_uvloop)


def test_push_names_each_blocks_parent() -> None:
    keys, data = chain(4)
    seen: list[tuple[bytes, bytes]] = []

    def store(namespace_id: int, parent: bytes, k: bytes, view: memoryview) -> bool:
        seen.append((parent, k))
        return True

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve, store_block=store) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            try:
                assert (await conn.push(NS, [(keys[0], data[keys[0]])], 10)).complete
                res = await conn.push(NS, [(k, data[k]) for k in keys[1:]], 10, parent=keys[0])
                assert res.complete and res.stored == 3
            finally:
                conn.close()
        assert seen == [(b"", keys[0]), (keys[0], keys[1]), (keys[1], keys[2]), (keys[2], keys[3])]

    run(main())


def test_lookup_and_namespace_requests() -> None:
    keys, data = chain(5)
    held = Blocks({k: data[k] for k in keys[:3]})
    described: list[tuple[int, bytes]] = []

    def count(namespace_id: int, ks: list[bytes]) -> int:
        n = 0
        while n < len(ks) and ks[n] in held.blocks:
            n += 1
        return n

    async def open_namespace(namespace_id: int, body: bytes) -> str:
        described.append((namespace_id, body))
        return "" if body.startswith(b"{") else "not a namespace description"

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), held.serve, count_blocks=count,
                               open_namespace=open_namespace) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            try:
                assert await conn.lookup(NS, keys, 5) == 3
                assert await conn.lookup(NS, keys[3:], 5) == 0
                await conn.open_namespace(NS, b'{"model": "m"}', 5)
                with pytest.raises(T.PeerError, match="not a namespace description"):
                    await conn.open_namespace(NS, b"junk", 5)
                assert conn.usable   # a refusal is an answer, not a broken connection
                assert await conn.lookup(NS, keys, 5) == 3
            finally:
                conn.close()
        assert described == [(NS, b'{"model": "m"}'), (NS, b"junk")]

    run(main())


def test_cancelled_lookup_does_not_leave_its_answer_for_the_next_request() -> None:
    """Regression: a lookup cancelled while its answer was in flight left the connection usable,
    and the next fetch on it read that ACK as its first frame ("unexpected frame")."""
    keys, data = chain(3)
    gate = asyncio.Event()

    async def slow_count(namespace_id: int, ks: list[bytes]) -> int:
        await gate.wait()
        return len(ks)

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks(data).serve, count_blocks=slow_count) as srv:
            conn = await PeerConnection.open(srv.address, PeerAuth())
            try:
                task = asyncio.ensure_future(conn.lookup(NS, keys, 5))
                await asyncio.sleep(0.1)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                gate.set()
                assert not conn.usable
                res = await conn.fetch(NS, keys, Collector(), 5)
                assert res.stop is Stop.PEER_CLOSED and res.delivered == 0
            finally:
                conn.close()

    run(main())


def test_fixed_and_mixed_length_keys_decode_alike() -> None:
    limits = T.Limits()
    for keys in ([key(i) for i in range(5)], [b"a", b"bb", key(3)]):
        raw = T._encode_request(T.OP_FETCH, NS, keys, limits)
        _op, flags, _, count, _, body_bytes = T._REQUEST.unpack(raw[: T._REQUEST.size])
        body = raw[T._REQUEST.size:]
        assert len(body) == body_bytes and T._decode_keys(body, count, flags) == keys
    with pytest.raises(ValueError):
        T._decode_keys(bytes([32]) + b"x" * 40, 2, T.FLAG_FIXED)


def test_lookup_of_a_silent_peer_fails_within_its_deadline() -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(T._HELLO.size)
            writer.write(T._WELCOME.pack(T.MAGIC, T.VERSION, T.WELCOME_OK, 0))
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            start = time.monotonic()
            with pytest.raises(T.PeerError, match="did not answer"):
                await conn.lookup(NS, [key(0)], 0.3)
            assert time.monotonic() - start < 5
            assert not conn.usable
        finally:
            server.close()

    run(main())


async def _answering_peer(answers: list[bytes]) -> asyncio.Server:
    """A peer that welcomes, then reads each request and sends the next of ``answers`` as is."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(T._HELLO.size)
        writer.write(T._WELCOME.pack(T.MAGIC, T.VERSION, T.WELCOME_OK, 0))
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for answer in answers:
                *_, body_bytes = T._REQUEST.unpack(await reader.readexactly(T._REQUEST.size))
                await reader.readexactly(body_bytes)
                writer.write(answer)
            await reader.read()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("answer", ["more_than_asked", "ack_with_payload"])
def test_a_malformed_answer_to_a_lookup_is_an_error_not_a_count(answer: str) -> None:
    """Regression: a LOOKUP was answered with whatever index the peer put in its ACK (a node then
    pushed from past the end of its chain: IndexError), and an ACK's payload was left unread for
    the next request on the connection to take as its answer."""
    # two keys asked: seven held; or one held, with 8 payload bytes behind the ACK
    bad = T._frame(T.ACK, b"", 7) if answer == "more_than_asked" else T._frame(T.ACK, b"", 1, 8) + bytes(8)

    async def main() -> None:
        server = await _answering_peer([bad])
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            try:
                with pytest.raises(T.PeerError, match="malformed answer"):
                    await conn.lookup(NS, [key(0), key(1)], 5)
                assert not conn.usable
            finally:
                conn.close()
        finally:
            server.close()

    run(main())


@pytest.mark.parametrize("kind", [T.MISSING, T.END])
def test_a_fetch_answer_with_a_payload_where_none_belongs_breaks_the_connection(kind: int) -> None:
    """Regression: MISSING and END frames were taken without looking at their length, leaving
    the connection usable with the payload unread: the next request read it as its answer."""
    keys = [key(0)] if kind == T.MISSING else []

    async def main() -> None:
        server = await _answering_peer([T._frame(kind, b"", 0, 8) + bytes(8), T._frame(T.ACK, b"", 1)])
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            try:
                res = await conn.fetch(NS, keys, Collector(), 5)
                assert res.stop is Stop.PEER_ERROR and not conn.usable, res
            finally:
                conn.close()
        finally:
            server.close()

    run(main())


def test_a_push_acknowledged_beyond_what_was_sent_counts_nothing_stored() -> None:
    keys, data = chain(2, 1024)

    async def main() -> None:
        server = await _answering_peer([T._frame(T.ERROR, b"", 50, 3) + b"bad"])
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            try:
                res = await conn.push(NS, [(k, data[k]) for k in keys], 5)
            finally:
                conn.close()
            assert (res.stored, res.stop) == (0, Stop.PEER_ERROR), res
        finally:
            server.close()

    run(main())


@pytest.mark.parametrize("callback", ["open_namespace", "count_blocks"])
def test_a_failing_namespace_or_lookup_is_answered_with_the_reason(callback: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Regression: an exception in open_namespace (a description of the wrong types) or in
    count_blocks killed the connection's task: the asking node saw only 'connection closed', the
    listener an unhandled task exception. It is now an ERROR answer naming the failure."""
    def fails(*_: object) -> str:
        raise TypeError("'<=' not supported between instances of 'int' and 'str'")

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve,
                               **{callback: fails}) as srv:  # type: ignore[arg-type]
            conn = await PeerConnection.open(srv.address, PeerAuth())
            try:
                with pytest.raises(T.PeerError, match="not supported between"):
                    if callback == "open_namespace":
                        await conn.open_namespace(NS, b'{"block_size": "16"}', 5)
                    else:
                        await conn.lookup(NS, [key(0)], 5)
                assert conn.usable   # an answer, like a refusal: the connection is in step
            finally:
                conn.close()

    run(main())
    assert "failed" in caplog.text


# -- authentication ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PKI:
    ca: str
    other_ca: str
    server: tuple[str, str]
    client: tuple[str, str]
    expired_server: tuple[str, str]
    expired_client: tuple[str, str]
    foreign_client: tuple[str, str]   # signed by other_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
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


def _with_server(server_auth: PeerAuth, client: Callable[[tuple[str, int]], Awaitable[None]],
                 use_uvloop: bool = False) -> None:
    _keys, data = chain(3, 64 << 10)

    async def main() -> None:
        async with BlockServer("127.0.0.1", 0, server_auth, Blocks(data).serve) as srv:
            await client(srv.address)

    run(main(), use_uvloop)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_mutual_tls_transfer(pki: PKI, use_uvloop: bool) -> None:
    async def client(addr: tuple[str, int]) -> None:
        got = Collector()
        res = await fetch(addr, tls(pki.ca, pki.client), NS, [key(0), key(1), key(2)], got, 10)
        assert res.complete and len(got.got) == 3
    _with_server(tls(pki.ca, pki.server), client, use_uvloop)


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_an_answer_sent_just_before_the_peer_closes_is_read(pki: PKI, secure: bool, use_uvloop: bool) -> None:
    # The server refuses an oversized request with an ERROR frame and closes at once; the client
    # reads the frame's header, then its message. Over TLS, a transport paused between the two
    # reads could drop the message when the close arrives: TLS connections are not paused.
    keys = [key(i) for i in range(40)]

    async def main() -> None:
        limits = T.Limits(max_keys=16)
        server_auth = tls(pki.ca, pki.server) if secure else PeerAuth()
        async with BlockServer("127.0.0.1", 0, server_auth, Blocks({}).serve, limits=limits) as srv:
            for _ in range(5):
                res = await fetch(srv.address, tls(pki.ca, pki.client) if secure else PeerAuth(), NS, keys,
                                  Collector(), 5)
                assert res.stop is Stop.PEER_ERROR and "too large" in res.detail, res

    run(main(), use_uvloop)


@pytest.mark.parametrize("case, match", [
    ("wrong_ca", "not trusted"),
    ("expired_server", "expired"),
    ("expired_client", "our TLS certificate"),
    ("missing_client_cert", "our TLS certificate"),
    ("foreign_client", "our TLS certificate"),
    ("plain_client", "closed the connection during authentication"),
    ("tls_client_plain_server", "TLS handshake failed"),
])
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_bad_tls_credentials_are_refused(pki: PKI, case: str, match: str, use_uvloop: bool) -> None:
    server = tls(pki.ca, pki.expired_server if case == "expired_server" else pki.server)
    if case == "tls_client_plain_server":
        server = PeerAuth(token="t")
    client_auth = {
        "wrong_ca": tls(pki.other_ca, pki.client),
        "expired_server": tls(pki.ca, pki.client),
        "expired_client": tls(pki.ca, pki.expired_client),
        "missing_client_cert": tls(pki.ca, None),
        "foreign_client": tls(pki.ca, pki.foreign_client),
        "plain_client": PeerAuth(),
        "tls_client_plain_server": tls(pki.ca, pki.client),
    }[case]

    async def client(addr: tuple[str, int]) -> None:
        t0 = time.monotonic()
        with pytest.raises(PeerAuthError, match=match):
            await fetch(addr, client_auth, NS, [key(0)], Collector(), 10)
        assert time.monotonic() - t0 < 5   # refused promptly, not by a timeout

    _with_server(server, client, use_uvloop)


def test_unreadable_tls_files_are_a_config_error(pki: PKI, tmp_path: Path) -> None:
    with pytest.raises(PeerConfigError, match="certificate"):
        tls(pki.ca, (str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))).server_context()
    with pytest.raises(PeerConfigError, match="CA file"):
        tls(str(tmp_path / "nope-ca.pem"), pki.client).client_context()
    with pytest.raises(PeerConfigError, match="needs"):
        tls(pki.ca, None).server_context()


@pytest.mark.parametrize("presented, match", [
    ("s3cret-token", None),
    ("wrong-token", "token rejected"),
    ("", "requires a shared token"),
])
def test_shared_token(presented: str, match: str | None) -> None:
    async def client(addr: tuple[str, int]) -> None:
        auth = PeerAuth(token=presented)
        if match is None:
            res = await fetch(addr, auth, NS, [key(0)], Collector(), 10)
            assert res.complete
        else:
            with pytest.raises(PeerAuthError, match=match):
                await fetch(addr, auth, NS, [key(0)], Collector(), 10)

    _with_server(PeerAuth(token="s3cret-token"), client)


def test_token_over_tls(pki: PKI) -> None:
    server = PeerAuth(tls=tls(pki.ca, pki.server).tls, token="t0ken")

    async def client(addr: tuple[str, int]) -> None:
        good = PeerAuth(tls=tls(pki.ca, pki.client).tls, token="t0ken")
        assert (await fetch(addr, good, NS, [key(0)], Collector(), 10)).complete
        with pytest.raises(PeerAuthError, match="token"):
            await fetch(addr, PeerAuth(tls=good.tls), NS, [key(0)], Collector(), 10)

    _with_server(server, client)


def test_listener_safety() -> None:
    # No bind happens for a refused listener, so no test listens beyond loopback.
    async def main() -> None:
        for host in ("0.0.0.0", "::", "", "10.1.2.3", "peer.example"):
            with pytest.raises(PeerConfigError, match="insecure = true"):
                await BlockServer(host, 0, PeerAuth(), Blocks({}).serve).start()
        async with BlockServer("127.0.0.1", 0, PeerAuth(), Blocks({}).serve):
            pass   # loopback needs no credentials

    run(main())
    assert T.listener_allowed("0.0.0.0", PeerAuth(insecure=True))
    assert T.listener_allowed("0.0.0.0", PeerAuth(token="x"))
    assert not T.listener_allowed("0.0.0.0", PeerAuth())
    assert T.listener_allowed("::1", PeerAuth()) and T.listener_allowed("localhost", PeerAuth())


def test_address_parsing() -> None:
    assert T.parse_address("10.0.0.1:7070") == ("10.0.0.1", 7070)
    assert T.parse_address("[::1]:7070") == ("::1", 7070)
    assert T.parse_address(("h", 1)) == ("h", 1)
    with pytest.raises(ValueError):
        T.parse_address("nohost")


def test_a_peer_certificate_from_a_ca_the_host_trusts_is_refused(pki: PKI, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Peers are trusted through peers.tls_ca alone. A CA the host trusts (the system bundle, here
    # SSL_CERT_FILE) must not let a certificate it issued for a peer's address pass as a peer:
    # the client would send its token to, and fetch KV blocks from, whoever holds it.
    public_ca = test_pki.make_ca("a public root the host trusts")
    monkeypatch.setenv("SSL_CERT_FILE", test_pki.write(tmp_path, "public-ca", public_ca, with_key=False)[0])
    impostor = test_pki.write(tmp_path, "impostor", test_pki.make_leaf("impostor", public_ca, server=True,
                                                                        client=False))

    async def client(addr: tuple[str, int]) -> None:
        with pytest.raises(PeerAuthError, match="not trusted"):
            await fetch(addr, tls(pki.ca, pki.client), NS, [key(0)], Collector(), 10)

    _with_server(tls(pki.ca, impostor), client)
