"""Promotion: blocks brought up from the SSD tier into DRAM slots, shared by every reader that
waits for them, with their reuse history carried from the SSD policy to the DRAM policy."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from kvstored.index import NO_SLOT, PROMOTING, SEALED, Block, Tier
from kvstored.store.background import Background
from kvstored.store.placement import Placement
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import Corrupt, SSDTier

log = logging.getLogger("kvstored.store")

PROMOTIONS_PER_STEP = 32   # SSD reads a lookup sets up before it lets other tasks run


class Promotion:
    """The promotions in flight (each block's, awaited by every reader of it) and their counts.

    A block being promoted has its DRAM slot already and carries the PROMOTING flag until its
    read lands: nothing evicts, demotes or frees it meanwhile."""

    def __init__(self, placement: Placement, arena: Arena, tier: SSDTier | None, background: Background) -> None:
        self._placement = placement
        self._arena = arena
        self._tier = tier
        self._background = background
        self._promoting: dict[Block, asyncio.Future[bool]] = {}
        self.promotions = 0
        self.read_errors = 0

    def __len__(self) -> int:
        """Blocks being promoted now."""
        return len(self._promoting)

    def blocks(self) -> list[Block]:
        """The blocks being promoted now."""
        return list(self._promoting)

    def pending(self, block: Block) -> asyncio.Future[bool] | None:
        """The promotion of ``block`` in flight (True once it landed readable), if any."""
        return self._promoting.get(block)

    def _start(self, block: Block, done: asyncio.Future[bool]) -> None:
        self._promoting[block] = done
        block.flags |= PROMOTING
        block.index.changed(block)

    def _end(self, block: Block) -> None:
        if self._promoting.pop(block, None) is not None:
            block.flags &= ~PROMOTING
            block.index.changed(block)

    def in_background(self, hits: list[Block]) -> None:
        """Promote ``hits`` (a cached prefix) without a reader waiting: a prefetch."""
        for block in hits:
            block.pins += 1

        async def run() -> None:
            try:
                await self.ensure_dram(hits)
            finally:
                for block in hits:
                    block.pins -= 1
                for block in reversed(hits):
                    self._placement.remove_if_hollow(block)
        self._background.spawn(run())

    async def ensure_dram(self, blocks: list[Block], ready: Callable[[int], None] | None = None,
                          wanted: Callable[[], bool] | None = None, room_until: float | None = None) -> int:
        """Give every block of a (pinned) prefix a valid DRAM slot, reading SSD copies as needed.

        Returns how many leading blocks are now readable in DRAM: fewer when the arena cannot
        make room or a copy is corrupt (that block becomes hollow and is dropped). ``ready(k)``
        is called each time that leading run grows while reads are outstanding (never past the
        count returned), so that a caller can use the first blocks before the last have landed.
        Other tasks run between steps of PROMOTIONS_PER_STEP reads set up; a block found unpinned
        at its turn (its reader's lease ended meanwhile), or ``wanted()`` false at a step (a busy
        lease doomed: it keeps its pins until its request ends), ends the prefix there. A block
        without an SSD copy never gives its slot up to a promotion: with ``room_until`` (the event
        loop's time) a promotion that finds no other slot waits until then for the write-back or for
        other blocks' promotions (a prefetch's) to land.
        """
        placement = self._placement
        ssd_policy = placement.ssd.policy
        waits: list[tuple[int, asyncio.Future[bool]]] = []
        # and its reuses on SSD, and the hits recorded on it there that had not reached its
        # ancestors (they never will: its parent left the SSD policy before it)
        started: list[tuple[Block, asyncio.Future[bool], int, int]] = []
        cut = len(blocks)
        landed = 0     # waits[:landed] are over (landed, or failed: then cut is at most there)
        reported = 0   # the leading run ready() was told of

        def report(upto: int) -> None:
            """Tell ready() of the leading run that is in DRAM, up to block ``upto``."""
            nonlocal landed, cut, reported
            while landed < len(waits) and waits[landed][1].done():
                if not waits[landed][1].result():
                    cut = min(cut, waits[landed][0])
                landed += 1
            k = min(waits[landed][0] if landed < len(waits) else upto, upto, cut)
            if ready is not None and k > reported:
                reported = k
                ready(k)

        placement.dram.advance()
        loop = asyncio.get_running_loop()
        set_up = 0   # reads started since the last step
        try:
            i = 0
            while i < len(blocks):
                block = blocks[i]
                if set_up == PROMOTIONS_PER_STEP:
                    set_up = 0
                    # Let other clients' calls in: set up in one step, a long prompt's promotions
                    # held the event loop for ~35 us a block (70 ms for 2,048 blocks here); the
                    # reads queued so far go on meanwhile, and the blocks landed are used.
                    await asyncio.sleep(0)
                    report(i)
                    if cut < i:   # a read failed: the blocks past it are of no use
                        break
                    if wanted is not None and not wanted():   # its reader is gone, the pins stay
                        cut = min(cut, i)
                        break
                if block.pins == 0:   # its reader's lease ended during a step: nobody wants the rest
                    cut = min(cut, i)  # (and, unpinned, it may have left the index meanwhile)
                    break
                pending = self._promoting.get(block)
                if pending is not None:
                    waits.append((i, pending))
                    i += 1
                    continue
                if block.in_dram:
                    i += 1
                    continue
                if self._tier is None or not block.on_ssd:
                    cut = min(cut, i)
                    break
                offset = placement.alloc(block.index.slot_bytes)
                if offset is None:
                    # DRAM holds only blocks that may not leave now (leased, or waiting for their
                    # SSD copy, which a promotion never evicts, or being promoted for others, a
                    # prefetch's for one): a reader waits for the write-back or for those to land
                    if room_until is not None and await placement.wait_for_room(
                            room_until, landing=self._landing_elsewhere(blocks)):
                        report(i)
                        if cut < i or (wanted is not None and not wanted()):
                            cut = min(cut, i)
                            break
                        continue   # this block again: another reader may have brought it up meanwhile
                    cut = min(cut, i)
                    break
                reuses = ssd_policy.reuses(block) or 0   # its history goes up with it
                unfolded = ssd_policy.pending_hits(block)
                ssd_policy.removed(block, moved=True)   # up to DRAM; its SSD copy stays
                done: asyncio.Future[bool] = loop.create_future()
                # PROMOTING before it has the slot: sealed and slotted without it, the block would
                # be announced readable there (to SDKs reading without a lease) before its bytes are
                self._start(block, done)
                placement.bind(block, offset)
                read: Future[int]
                try:
                    read = self._tier.read_into(block.index.namespace_id, block.key,
                                                self._arena.view(offset, block.index.block_bytes))
                except Exception as exc:   # it could not start (the tier is closed): a failed read,
                    read = Future()        # so that the slot goes back and the waiters learn of it
                    read.set_exception(exc)
                # a callback, not a task per block: the tasks' set-up cost as much as the rest
                read.add_done_callback(functools.partial(self._read_landed, loop, block, done, reuses))
                waits.append((i, done))
                started.append((block, done, reuses, unfolded))
                set_up += 1
                i += 1
        finally:   # cancelled between steps too: every slot bound here goes to the DRAM policy
            if started:
                self._background.spawn(self._track_promoted(started))
        if not waits:
            return cut
        report(cut)
        while landed < len(waits):
            # shielded: the promotion is shared (other readers, _finish, _track_promoted);
            # a caller that is cancelled (a client gone, a transfer timed out) must not cancel it.
            # One already done is not awaited: a wake-up per block costs as much as its set-up.
            fut = waits[landed][1]
            if not fut.done():
                await asyncio.shield(fut)
            report(cut)
        return cut

    def _landing_elsewhere(self, blocks: list[Block]) -> bool:
        """Whether blocks other than ``blocks`` are being promoted (their slots may free up once
        their reads land and their readers are done)."""
        if len(self._promoting) > len(blocks):
            return True
        mine = set(blocks)
        return any(b not in mine for b in self._promoting)

    def _read_landed(self, loop: asyncio.AbstractEventLoop, block: Block, done: asyncio.Future[bool],
                     reuses: int, read: Future[int]) -> None:
        """A promotion's read ended (on its read thread, or at once if it never started): finish
        the promotion on the event loop. Nothing to finish once the loop is closed (shutdown)."""
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._finish, block, read, done, reuses)

    def _finish(self, block: Block, read: Future[int], done: asyncio.Future[bool], reuses: int) -> None:
        """``reuses``: the block's on SSD, which it takes back there when the read failed."""
        try:
            check = read.result()
        except Exception as exc:
            self._placement.release_slot(block)
            self._end(block)
            self.read_failed(block, exc, reuses)
            done.set_result(False)
            if isinstance(exc, Corrupt):
                self._placement.remove_if_hollow(block)
            return
        self._end(block)
        block.check = check   # verified against these bytes: a peer gets the block unhashed
        self._placement.events.stored((block,), Tier.DRAM)
        self.promotions += 1
        done.set_result(True)

    def read_failed(self, block: Block, exc: Exception, reuses: int | None = None) -> None:
        """Count a failed read of a block's SSD copy (slotless: its DRAM slot, if it had one for
        the read, is already released). A corrupt copy is dropped; after any other error (the
        disk, the pool shutting down) the copy stays and goes back to the SSD policy, with the
        ``reuses`` it had there when a promotion took it out."""
        self.read_errors += 1
        if isinstance(exc, Corrupt):
            self._placement.drop_lost_copy(block, exc)
        else:
            log.warning("SSD read of %s failed: %s", block.key.hex()[:16], exc)
            if block not in self._placement.ssd.policy:
                self._placement.ssd.policy.inserted([block], None if reuses is None else [reuses])

    async def _track_promoted(self, started: list[tuple[Block, asyncio.Future[bool], int, int]]) -> None:
        """Hand a batch of promoted blocks to their DRAM policy once all have landed, parent first
        (batches of one chain, other readers' included, may land in any order: the policy counts
        a child tracked before its parent under it all the same). A task of its own, so that a
        cancelled lookup cannot leave a slot untracked (hence never evicted); the blocks are
        pinned until their readers are done."""
        await asyncio.gather(*(done for _, done, _, _ in started))
        if not started:
            return
        policy = self._placement.dram.policy_for(started[0][0])
        # A batch is one prefix, parent first, and a hit of a block was a hit of its ancestors,
        # which the SSD policy (recording hits on the deepest block only, folded into the parent
        # when the block leaves, but each parent here left first) had not counted: each block
        # adds the pending hits of those below it, and has at least the reuses of any of them.
        counted: list[tuple[Block, asyncio.Future[bool], int]] = []
        below = most = 0
        for block, done, reuses, unfolded in reversed(started):
            most = max(most, reuses + below)
            below += unfolded
            counted.append((block, done, most))
        counted.reverse()
        # not those tracked meanwhile: one that landed early may have lost its slot (its reader
        # gone) and come up again in a later batch, already tracked (and maybe hit) since
        landed = [(block, reuses) for block, done, reuses in counted
                  if done.result() and block.offset != NO_SLOT and block.flags & SEALED
                  and not block.flags & PROMOTING and block not in policy]
        if landed:
            policy.inserted([block for block, _ in landed], [reuses for _, reuses in landed])
        # One that landed early and went back down meanwhile (its reader gone, then evicted to
        # SSD) entered the SSD policy with the DRAM policy's count for it, none: it takes this
        # batch's back, with the hits it has had there since.
        ssd = self._placement.ssd.policy
        for block, _, reuses in counted:
            if block.offset == NO_SLOT and block in ssd and not block.flags & PROMOTING:
                since = ssd.pending_hits(block)
                if reuses + since > (ssd.reuses(block) or 0):
                    ssd.inserted([block], [reuses + since])

    async def read_unslotted(self, block: Block) -> memoryview | None:
        """A (pinned) block that only SSD holds, read into a buffer of its own: DRAM had no slot
        for it (every slot pinned, or being written). None when the block is not such a block,
        or the read failed (a corrupt copy is dropped, as on promotion). The buffer lives as long
        as the view the caller holds."""
        if self._tier is None or not block.readable or block.in_dram or not block.on_ssd:
            return None
        # page aligned (mmap), so that the SSD tier reads it with O_DIRECT as it reads into the arena
        dst = np.frombuffer(mmap.mmap(-1, block.index.block_bytes), dtype=np.uint8)
        try:
            read = self._tier.read_into(block.index.namespace_id, block.key, dst)
            block.check = await asyncio.wrap_future(read)
        except Exception as exc:
            self.read_failed(block, exc)
            return None
        return dst.data
