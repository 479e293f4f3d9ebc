"""The peer channel's byte stream on loopback: an idle connection notices its peer leaving, blocks
checksummed piece by piece as they land, an answer read although the peer closes right after it."""

from __future__ import annotations

import asyncio

import pytest
from peer_channel import (
    NS,
    PKI,
    Blocks,
    Collector,
    Fault,
    Proxy,
    block_offset,
    chain,
    key,
    make_pki,
    run,
    tls,
)

from kvstored.peers import wire
from kvstored.peers.auth import PeerAuth
from kvstored.peers.connection import PeerConnection, Stop, fetch
from kvstored.peers.server import BlockServer


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory)


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


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "tls"])
def test_an_answer_sent_just_before_the_peer_closes_is_read(pki: PKI, secure: bool, use_uvloop: bool) -> None:
    # The server refuses an oversized request with an ERROR frame and closes at once; the client
    # reads the frame's header, then its message. Over TLS, a transport paused between the two
    # reads could drop the message when the close arrives: TLS connections are not paused.
    keys = [key(i) for i in range(40)]

    async def main() -> None:
        limits = wire.Limits(max_keys=16)
        server_auth = tls(pki.ca, pki.server) if secure else PeerAuth()
        async with BlockServer("127.0.0.1", 0, server_auth, Blocks({}).serve, limits=limits) as srv:
            for _ in range(5):
                res = await fetch(srv.address, tls(pki.ca, pki.client) if secure else PeerAuth(), NS, keys,
                                  Collector(), 5)
                assert res.stop is Stop.PEER_ERROR and "too large" in res.detail, res

    run(main(), use_uvloop)
