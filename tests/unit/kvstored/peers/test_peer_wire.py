"""The peer channel's wire format: frame checksums bound to the namespace and key (and nodes that
predate binding), key lists of one length and of mixed lengths. (Not test_wire.py: that name is
tests/unit/client's, and test modules share one namespace.)"""

from __future__ import annotations

import asyncio

import pytest
from peer_channel import (
    NS,
    Blocks,
    Collector,
    Fault,
    Proxy,
    chain,
    key,
    payload,
    run,
)

from kvstored.peers import wire
from kvstored.peers.auth import PeerAuth
from kvstored.peers.connection import Stop, fetch, push
from kvstored.peers.server import BlockServer

# -- frame checksums cover the namespace and the key ----------------------------------------------
OTHER = NS ^ 0xFF   # NS with the last byte of its id flipped, as the proxy below flips it
NS_BYTE = wire.HELLO.size + 15   # client -> server: the last byte of the first request's namespace id


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
        *_, token_len = wire.HELLO.unpack(await reader.readexactly(wire.HELLO.size))   # flags ignored
        await reader.readexactly(token_len)
        writer.write(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, wire.WELCOME_OK, 0))
        _, flags, _, count, _, body_bytes = wire.REQUEST.unpack(await reader.readexactly(wire.REQUEST.size))
        for i, k in enumerate(wire.decode_keys(await reader.readexactly(body_bytes), count, flags)):
            writer.write(wire.encode_frame(wire.BLOCK, k, i, len(data[k]), wire.checksum(data[k])) + data[k])
        writer.write(wire.encode_frame(wire.END))
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
            writer.write(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, 0))   # an old client: no BIND flag
            assert wire.WELCOME.unpack(await reader.readexactly(wire.WELCOME.size)) == (wire.MAGIC, wire.VERSION,
                                                                                        wire.WELCOME_OK, 0)
            writer.write(wire.encode_request(wire.OP_FETCH, NS, keys, wire.Limits()))
            for i, k in enumerate(keys):
                kind, klen, _, index, length, check = wire.FRAME.unpack(await reader.readexactly(wire.FRAME.size))
                assert (kind, index, await reader.readexactly(klen)) == (wire.BLOCK, i, k)
                assert check == wire.checksum(await reader.readexactly(length)) and length == len(data[k])
            assert wire.FRAME.unpack(await reader.readexactly(wire.FRAME.size))[0] == wire.END
            writer.close()

    run(main())


def test_fixed_and_mixed_length_keys_decode_alike() -> None:
    limits = wire.Limits()
    for keys in ([key(i) for i in range(5)], [b"a", b"bb", key(3)]):
        raw = wire.encode_request(wire.OP_FETCH, NS, keys, limits)
        _op, flags, _, count, _, body_bytes = wire.REQUEST.unpack(raw[: wire.REQUEST.size])
        body = raw[wire.REQUEST.size:]
        assert len(body) == body_bytes and wire.decode_keys(body, count, flags) == keys
    with pytest.raises(ValueError):
        wire.decode_keys(bytes([32]) + b"x" * 40, 2, wire.FLAG_FIXED)
