"""The peer channel's listening end on loopback: blocks served from a store (at once or later,
failing either way), a gap in the chain, pushes stored or landed in place, refused or damaged,
lookups and namespaces, and a listener that closes while a connection comes up."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from peer_channel import (
    NS,
    PKI,
    Blocks,
    Collector,
    Fault,
    Proxy,
    Received,
    chain,
    key,
    make_pki,
    run,
    tls,
)

from kvstored.peers import wire
from kvstored.peers.auth import PeerAuth
from kvstored.peers.byte_stream import Stream
from kvstored.peers.connection import FetchResult, PeerConnection, Stop, push
from kvstored.peers.errors import PeerAuthError, PeerError
from kvstored.peers.server import BlockServer


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory)


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

        def made() -> Stream:
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
                await conn.fetch(NS, [key(0)] * (wire.Limits().max_keys + 1), Collector(), 5)
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
            request = wire.REQUEST.size + sum(1 + len(k) for k in keys)
            offset = wire.HELLO.size + request + wire.FRAME.size + 32 + len(data[keys[0]]) + wire.FRAME.size + 32 + 7
            async with Proxy(srv.address, Fault("flip", offset, upstream=True)) as proxy:
                res = await push(proxy.address, PeerAuth(), NS, [(k, data[k]) for k in keys], 10)
            assert (res.stored, res.stop) == (1, Stop.CORRUPT)
            assert list(stored) == [keys[0]]

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
                assert checksum == wire.checksum(self.view), "commit gets the checksum the bytes passed"
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
            request = wire.REQUEST.size + sum(1 + len(k) for k in keys)
            block1 = wire.HELLO.size + request + wire.FRAME.size + 32 + len(data[keys[0]]) + wire.FRAME.size + 32
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
                with pytest.raises(PeerError, match="not a namespace description"):
                    await conn.open_namespace(NS, b"junk", 5)
                assert conn.usable   # a refusal is an answer, not a broken connection
                assert await conn.lookup(NS, keys, 5) == 3
            finally:
                conn.close()
        assert described == [(NS, b'{"model": "m"}'), (NS, b"junk")]

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
                with pytest.raises(PeerError, match="not supported between"):
                    if callback == "open_namespace":
                        await conn.open_namespace(NS, b'{"block_size": "16"}', 5)
                    else:
                        await conn.lookup(NS, [key(0)], 5)
                assert conn.usable   # an answer, like a refusal: the connection is in step
            finally:
                conn.close()

    run(main())
    assert "failed" in caplog.text
