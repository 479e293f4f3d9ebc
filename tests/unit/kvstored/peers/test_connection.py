"""The peer channel's connecting end on loopback: fetches in order and intact, corrupt, cut,
killed, partitioned, silent and unreachable peers, pushes with known checksums, and answers that
are malformed. A real peer process is killed with SIGKILL mid-transfer. Throughput is measured by
`python -m tools.bench peers`, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from peer_channel import (
    NS,
    Blocks,
    Collector,
    Fault,
    Proxy,
    Received,
    block_offset,
    chain,
    key,
    payload,
    run,
)

from kvstored.peers import wire
from kvstored.peers.auth import PeerAuth
from kvstored.peers.connection import FetchResult, PeerConnection, Stop, fetch
from kvstored.peers.errors import PeerError
from kvstored.peers.server import BlockServer

ROOT = Path(__file__).resolve().parents[4]


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
            known = [wire.checksum(data[keys[0]]), None, wire.checksum(data[keys[2]])]
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
from kvstored.peers.auth import PeerAuth
from kvstored.peers.server import BlockServer
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


def test_lookup_of_a_silent_peer_fails_within_its_deadline() -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(wire.HELLO.size)
            writer.write(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, wire.WELCOME_OK, 0))
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            start = time.monotonic()
            with pytest.raises(PeerError, match="did not answer"):
                await conn.lookup(NS, [key(0)], 0.3)
            assert time.monotonic() - start < 5
            assert not conn.usable
        finally:
            server.close()

    run(main())


async def _answering_peer(answers: list[bytes]) -> asyncio.Server:
    """A peer that welcomes, then reads each request and sends the next of ``answers`` as is."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(wire.HELLO.size)
        writer.write(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, wire.WELCOME_OK, 0))
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for answer in answers:
                *_, body_bytes = wire.REQUEST.unpack(await reader.readexactly(wire.REQUEST.size))
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
    bad = wire.encode_frame(wire.ACK, b"", 7) if answer == "more_than_asked" \
        else wire.encode_frame(wire.ACK, b"", 1, 8) + bytes(8)

    async def main() -> None:
        server = await _answering_peer([bad])
        try:
            conn = await PeerConnection.open(server.sockets[0].getsockname()[:2], PeerAuth())
            try:
                with pytest.raises(PeerError, match="malformed answer"):
                    await conn.lookup(NS, [key(0), key(1)], 5)
                assert not conn.usable
            finally:
                conn.close()
        finally:
            server.close()

    run(main())


@pytest.mark.parametrize("kind", [wire.MISSING, wire.END])
def test_a_fetch_answer_with_a_payload_where_none_belongs_breaks_the_connection(kind: int) -> None:
    """Regression: MISSING and END frames were taken without looking at their length, leaving
    the connection usable with the payload unread: the next request read it as its answer."""
    keys = [key(0)] if kind == wire.MISSING else []

    async def main() -> None:
        server = await _answering_peer([wire.encode_frame(kind, b"", 0, 8) + bytes(8),
                                        wire.encode_frame(wire.ACK, b"", 1)])
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
        server = await _answering_peer([wire.encode_frame(wire.ERROR, b"", 50, 3) + b"bad"])
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
