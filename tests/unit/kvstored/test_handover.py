"""Handover: handing a stream's blocks to engine buffers, against a stand-in copy engine."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from unretrieved import unretrieved_errors

from kvstored.handover import Handover
from kvstored.index import Tier
from kvstored_client.contract.errors import DeadlineExceeded


@dataclass
class StubBlock:
    offset: int
    pins: int = 0


class FailingCopy:
    """A copy engine whose copies fail with DeadlineExceeded once ``fail`` is set."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()

    async def from_arena(self, buffers: Any, block_ids: Any, offsets: Any, tensor_done: Any = None, *,
                         not_after: float | None = None) -> None:
        await self.fail.wait()
        raise DeadlineExceeded("the call's deadline passed before layer 0 of its blocks could be copied")


def test_a_copy_failing_after_its_close_was_cancelled_leaves_no_unretrieved_error() -> None:
    """Found by tests/integration/test_sdk_random.py under load. Was: a stream's close, itself
    cancelled while a copy into the engine's buffers was in flight, left that copy's error (a
    passed deadline) unretrieved, and the daemon logged "Task exception was never retrieved"."""
    blocks = [StubBlock(0), StubBlock(4096)]

    async def main() -> None:
        copy = FailingCopy()
        handover = Handover(lambda arrival: None, copy, object(), [7, 8])  # type: ignore[arg-type]
        handover.give(0, blocks, [Tier.DRAM, Tier.DRAM])  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)
        assert [b.pins for b in blocks] == [1, 1], "handed-over blocks stay pinned while copied"
        closing = asyncio.ensure_future(handover.close())
        for _ in range(5):
            await asyncio.sleep(0)
        closing.cancel()   # the caller's clean-up is cancelled while the copy runs ...
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        copy.fail.set()    # ... and the copy then fails
        for _ in range(5):
            await asyncio.sleep(0)

    assert unretrieved_errors(main) == []
    assert [b.pins for b in blocks] == [0, 0], "a block stays pinned after its copy ended"
