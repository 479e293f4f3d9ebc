"""Handing a streamed chain's blocks to their reader, in order, each as soon as it is in place.

Arena readers get each block at once (it stays leased in the arena). For engine buffers a
copier task copies the blocks that have landed since its last copy in one batch (at most as many
as it has copied so far, so a prefix given at once still goes out first block first), then
reports them, so the network or the disk keeps delivering while earlier blocks are copied; each
block is pinned from the moment it is handed over until its copy is done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstored.buffers import BlockIds, RegisteredBuffers
from kvstored.copy import CopyEngine
from kvstored.index import Block, Tier


@dataclass(frozen=True, slots=True)
class Arrival:
    """Block ``index`` of a streamed chain is in place (in the engine's buffers, or at ``offset``
    of the arena under the stream's lease); ``peer``: the node it was fetched from."""

    index: int
    tier: Tier
    peer: str = ""
    offset: int = 0


class Handover:
    """``give`` blocks in chain order; ``settled`` waits until those given are out; ``finish``
    when the chain ends (waits for the last copy); ``close`` always (cancels what is left and
    unpins it, after any copy in flight)."""

    def __init__(self, emit: Callable[[Arrival], None], copy: CopyEngine | None = None,
                 buffers: RegisteredBuffers | None = None, block_ids: BlockIds = (),
                 copy_until: float | None = None) -> None:
        """``copy_until``: the event loop's time (the reader's deadline) after which no copy into
        the engine's buffers starts (see ``CopyEngine.from_arena``): ``finish`` raises
        DeadlineExceeded instead, and the blocks not copied are never reported."""
        assert (copy is None) == (buffers is None), "engine buffers need the copy engine"
        self._emit = emit
        self._copy_until = copy_until
        self._copy = copy
        self._buffers = buffers
        self._block_ids = block_ids
        self._queue: list[tuple[int, Block, Tier, str]] = []
        self._copying: list[tuple[int, Block, Tier, str]] = []
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()   # nothing given is waiting for its copy
        self._settled.set()
        self._ending = False
        self._inflight: asyncio.Future[None] | None = None
        self._copied = 0
        self._task = asyncio.ensure_future(self._copier()) if buffers is not None else None

    def give(self, first: int, blocks: Sequence[Block], tiers: Sequence[Tier], peer: str = "") -> None:
        """Blocks ``first``, ``first + 1``, ... are readable in the arena now."""
        if self._buffers is None:
            for i, (block, tier) in enumerate(zip(blocks, tiers)):
                self._emit(Arrival(first + i, tier, peer, block.offset))
            return
        for i, (block, tier) in enumerate(zip(blocks, tiers)):
            block.pins += 1   # until its bytes are in the engine's buffers
            self._queue.append((first + i, block, tier, peer))
        if self._queue:
            self._settled.clear()
        self._wake.set()

    async def settled(self) -> None:
        """Wait until every block given so far is in the engine's buffers and reported (at once
        for arena readers). Raises nothing: a failed copy is ``finish``'s to raise."""
        if self._task is not None and not self._task.done():
            waiter = asyncio.ensure_future(self._settled.wait())
            try:
                await asyncio.wait((waiter, self._task), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

    async def _copier(self) -> None:
        assert self._copy is not None and self._buffers is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Batches grow geometrically (1, 1, 2, 4, ... blocks): the first block is out after
            # one block's copy, not the whole prefix's, for a few more copy calls in all.
            batch = max(1, self._copied)
            self._copying, self._queue = self._queue[:batch], self._queue[batch:]
            if self._queue:
                self._wake.set()
            if self._copying:
                inflight = asyncio.ensure_future(self._copy.from_arena(  # noqa: RUF006 - kept in _inflight
                    self._buffers, [self._block_ids[i] for i, _, _, _ in self._copying],
                    [b.offset for _, b, _, _ in self._copying], not_after=self._copy_until))
                self._inflight = inflight
                # its error is the copier's to raise, unless a cancelled close() left it to nobody
                inflight.add_done_callback(lambda f: f.cancelled() or f.exception())
                try:
                    await asyncio.shield(inflight)
                finally:
                    if inflight.done():   # else close() unpins once the copy is out of the slots
                        self._unpin(self._copying)
                        done, self._copying = self._copying, []
                self._copied += len(done)
                for i, _, tier, peer in done:
                    self._emit(Arrival(i, tier, peer, 0))
            if not self._queue:
                self._settled.set()
            if self._ending and not self._queue:
                return

    @staticmethod
    def _unpin(items: list[tuple[int, Block, Tier, str]]) -> None:
        for _, block, _, _ in items:
            block.pins -= 1

    async def finish(self) -> None:
        """Wait until every block given so far is copied and reported (raises a copy's error)."""
        if self._task is not None:
            self._ending = True
            self._wake.set()
            await self._task

    async def close(self) -> None:
        """Stop: unpin what was never copied, once no copy is touching those slots."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        left, self._copying, self._queue = self._copying + self._queue, [], []
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            try:
                await asyncio.shield(inflight)
            except asyncio.CancelledError:
                # cancelled again while the copy runs: the caller's cleanup must go on (its
                # leases end), and the blocks stay pinned until the copy is out of their slots
                if inflight.done():
                    self._unpin(left)
                else:
                    inflight.add_done_callback(lambda _: self._unpin(left))
                raise
            except Exception:
                pass   # a failed copy is finish()'s to raise
        self._unpin(left)
