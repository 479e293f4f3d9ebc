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
