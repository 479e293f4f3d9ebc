"""The servicer's StreamBlocks loop, in process, against a stand-in store: how a stream that fails
midway ends (the blocks already in place still reach the client, then the call ends with the error,
never a hang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvstored.errors import NotFound
from kvstored.handover import Arrival
from kvstored.index import Tier
from kvstored.server.servicer import KVStoreServicer
from kvstored_client._proto import kvstored_pb2 as pb


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Context:
    """What StreamBlocks uses of grpc.aio.ServicerContext: abort raises, as grpc's does."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class FailingStore:
    """``stream_blocks`` places two blocks, then fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def stream_blocks(self, session_id: str, namespace_id: int, keys: Any, buffers_id: int,
                            block_ids: Any, emit: Callable[[Arrival], None], fetcher: Any,
                            on_lease: Callable[[int], None] | None = None) -> Any:
        emit(Arrival(0, Tier.DRAM))
        emit(Arrival(1, Tier.DRAM))
        await asyncio.sleep(0)
        raise self.error


async def collect(servicer: KVStoreServicer) -> tuple[list[int], BaseException | None]:
    got: list[int] = []
    try:
        async with asyncio.timeout(5):   # a hang fails the test instead of stalling the suite
            async for event in servicer.StreamBlocks(pb.StreamBlocksRequest(session_id="s"), Context()):  # type: ignore[arg-type]
                got.extend(b.index for b in event.blocks)
    except (Aborted, RuntimeError) as exc:
        return got, exc
    return got, None


@pytest.mark.parametrize("error", [NotFound("the session ended"), RuntimeError("a bug")], ids=["kv-error", "bug"])
def test_a_stream_failing_midway_delivers_what_is_in_place_then_ends_with_the_error(error: Exception) -> None:
    servicer = KVStoreServicer(FailingStore(error), None, 30.0, 64, asyncio.Event())  # type: ignore[arg-type]
    got, exc = asyncio.run(collect(servicer))
    assert got == [0, 1]
    if isinstance(error, NotFound):
        assert isinstance(exc, Aborted) and exc.code == grpc.StatusCode.NOT_FOUND and "session" in str(exc)
    else:
        assert exc is error


def test_a_stream_from_a_silent_peer_ends_before_the_callers_deadline() -> None:
    """With the defaults, peers.deadline_s and the SDK's timeout_s are both 30 s, and the fetch's
    deadline starts after the call's: a peer that went silent mid-transfer made every stream and
    pull fail with DEADLINE_EXCEEDED (an error, the blocks in place not accounted for) instead of
    the short outcome ("timeout") the README promises. The transfer now ends before the caller's
    deadline (here 2 s, with peers.deadline_s at 30 s)."""
    import tempfile

    from loopback import free_ports

    from kvstored import config
    from kvstored.copy import CopyEngine
    from kvstored.peers.node import PeerNode
    from kvstored.store import BlockStore
    from kvstored.tiers.dram import Arena
    from kvstored_client.hashing import block_hashes
    from kvstored_client.namespace import Namespace

    block = 4096
    ns = Namespace(model="m", block_bytes=block)

    class DeadlineContext(Context):
        def time_remaining(self) -> float:
            return 2.0

    async def main() -> pb.BlockStreamEnd:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()   # accepts, never answers, until the other side goes away
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (own,) = free_ports(1)
        cfg = config.build({"dram": {"capacity": 8 * block, "page_bytes": 4 * block, "prefault": False},
                            "peers": {"listen": f"127.0.0.1:{own}", "node_id": "b", "token": "t",
                                      "static": [f"b=127.0.0.1:{own}", f"x=127.0.0.1:{port}"],
                                      "deadline_s": 30.0, "lookup_timeout_s": 30.0}})
        arena = Arena(tempfile.mkdtemp(), cfg.dram.capacity, prefault=False)
        copy = CopyEngine(arena)
        store = BlockStore(cfg, arena, copy)
        ns_id = store.open_namespace(ns).namespace_id
        peers = PeerNode(cfg, store)
        await peers.start()
        servicer = KVStoreServicer(store, arena, 30.0, 64, asyncio.Event(), peers)
        session = store.open_session("decode", 1).session_id
        request = pb.StreamBlocksRequest(session_id=session, namespace_id=ns_id, peers=True, end_only=True)
        request.keys.hashes.extend(block_hashes(list(range(32))))
        try:
            async with asyncio.timeout(10):   # a hang fails the test instead of stalling the suite
                async for event in servicer.StreamBlocks(request, DeadlineContext()):  # type: ignore[arg-type]
                    if event.HasField("end"):
                        return event.end
            raise AssertionError("no end")
        finally:
            await peers.close()
            server.close()
            copy.close()
            arena.close()

    end = asyncio.run(main())
    assert end.blocks == 0 and end.stop != "complete", end
