"""Write-back: DRAM blocks without an SSD copy written down to the SSD tier, in the background
(within ``ssd.max_dirty_s`` of their sealing, at once for a save waiting for room, and under
``dram.writeback_watermark``), on demand (flush) and at shutdown, with room made on the tier by
its policy's victims."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncGenerator, Callable, Sequence

from kvstored.config import Config
from kvstored.index import DEMOTING, HIT, ON_SSD, PROMOTING, SEALED, SSD_DECLINED, WRITE_FAILED, Block
from kvstored.policy.admission import admit
from kvstored.store.background import Background
from kvstored.store.catalog import Catalog
from kvstored.store.learned import learned_records
from kvstored.store.placement import Placement
from kvstored.store.values import FlushProgress
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import MapFull, SSDError, SSDTier
from kvstored_client.contract.errors import FailedPrecondition, Reason, ResourceExhausted

log = logging.getLogger("kvstored.store")

WAITED_ROUNDS = 16     # a round written for waiting saves is this share of the arena
LEARNED_EVERY_S = 60.0   # what the policies learned is recorded this often (and at shutdown)
_FLUSH_ROUNDS = 6000   # write-back rounds (or 10 ms waits for other write-backs) a flush takes at most


def keep_for_ssd(config: Config, catalog: Catalog) -> Callable[[Block], bool]:
    """The rule for a sealed DRAM block without an SSD copy: True when it must not leave DRAM
    before it has one, that is when ``ssd.admission`` accepts it and the SSD tier has neither
    declined it (its policy: full of blocks worth more) nor failed to write it."""
    mode = config.ssd.admission

    def keep(block: Block) -> bool:
        return not block.flags & (SSD_DECLINED | WRITE_FAILED) and \
            admit(mode, block.depth, bool(block.flags & HIT), catalog.get(block.index.namespace_id).spec)
    return keep


class WriteBack:
    """Writes of DRAM blocks to the SSD tier, and their counts. While the disk fails, the
    background rounds back off for a second."""

    def __init__(self, config: Config, clock: Callable[[], float], catalog: Catalog, placement: Placement,
                 arena: Arena, tier: SSDTier | None, background: Background,
                 keep: Callable[[Block], bool]) -> None:
        """``keep``: the rule of :func:`keep_for_ssd` (which blocks must reach SSD)."""
        self._config = config
        self._keep = keep
        self._clock = clock
        self._catalog = catalog
        self._placement = placement
        self._arena = arena
        self._tier = tier
        self._background = background
        self._backoff_until = 0.0
        self._learned_at = clock()
        self.demotions = 0
        self.write_errors = 0

    @property
    def backoff_until(self) -> float:
        """The clock's time before which background rounds do not write (a write failed)."""
        return self._backoff_until

    def watermark_bytes(self) -> float:
        """The DRAM bytes without an SSD copy above which the background task writes."""
        return self._config.dram.writeback_watermark * self._placement.dram.capacity

    def due(self) -> float:
        """How many bytes a background round should write now: all it may when a save waits for
        room or a block the tier takes has waited half of ``ssd.max_dirty_s`` (its write must end
        within the window), else what exceeds the watermark (0: nothing is due)."""
        queue = self._placement.queue
        if not len(queue):
            return 0.0
        if queue.waiters:
            # a round's blocks become evictable only when all of it is written: short rounds
            # make room for the waiting saves sooner (the writer batches them all the same)
            return self._placement.dram.capacity / WAITED_ROUNDS
        oldest = queue.oldest(self._keep)
        if oldest is not None and self._clock() - oldest >= self._config.ssd.max_dirty_s / 2:
            return math.inf
        return max(0.0, queue.bytes - self.watermark_bytes())

    async def loop(self, interval_s: float = 0.5) -> None:
        """Background task: write what is :meth:`due`, looking at least every ``interval_s`` (and
        every quarter of ``ssd.max_dirty_s``)."""
        queue = self._placement.queue
        interval_s = min(interval_s, self._config.ssd.max_dirty_s / 4)
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns the event's result when a
            # cancel arrives as it is set (often, here), and the task would outlive its cancel
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await queue.wanted.wait()
            queue.wanted.clear()
            if self._tier is None or self._clock() < self._backoff_until:
                continue
            if self._clock() - self._learned_at >= LEARNED_EVERY_S:
                try:   # so that a kill -9 loses at most a minute of it
                    self.record_learned()
                except Exception:   # a bug here must not stop write-back for good
                    log.exception("recording what the policies learned failed")
            nbytes = self.due()
            if not nbytes:
                continue
            try:
                wrote = await self.write_back(nbytes, force=False, models=None)
            except Exception:  # a bug here must not stop write-back for good
                log.exception("write-back round failed")
                wrote = 0
            if wrote:
                queue.wanted.set()  # more to do: go again at once
            else:
                # Nothing could go (ssd.admission refused it all, no room): every save and every
                # reclaim asks again, and a round scans every DRAM-only block, so wait a while.
                await asyncio.sleep(interval_s)

    async def write_back(self, nbytes: float, force: bool, models: set[int] | None,
                         among: Sequence[Block] | None = None) -> int:
        """Copy the DRAM blocks without an SSD copy to SSD, longest without first (a chain's parents
        are sealed, hence queued, before their children), up to ``nbytes``; with ``among``, only
        those of these blocks (in their order, parents first) and the parents they hang under.
        Returns how many were written.

        Without ``force``, ``ssd.admission`` and the SSD policy's ``admit`` (asked when the block
        would need an eviction) may pass a block over: it stays in DRAM without a copy.
        """
        if self._tier is None:
            return 0
        placement = self._placement
        ssd = placement.ssd
        chosen: list[Block] = []
        picked: set[Block] = set()
        too_big: set[Block] = set()
        held_above: dict[Block, int] = {}   # _ssd_bytes_above's memo for this round
        total = 0
        cfg = self._config.ssd
        # One round writes at most the gap between the watermarks, so room can always be made.
        batch_cap = min(256 << 20, max(1, (cfg.high_watermark - cfg.low_watermark) * cfg.capacity))
        room = ssd.high_bytes
        for block in placement.queue if among is None else among:  # not changed before the awaits below
            if total >= nbytes or total >= batch_cap:
                break
            if block.flags & (SEALED | ON_SSD | DEMOTING | PROMOTING) != SEALED or block in picked:
                continue
            if models is not None and block.index.namespace_id not in models:
                continue
            size = block.index.block_bytes
            if not force:
                if not admit(cfg.admission, block.depth, bool(block.flags & HIT),
                             self._catalog.get(block.index.namespace_id).spec):
                    continue   # ssd.admission refuses it: it may leave DRAM uncopied (keep_for_ssd)
                if not ssd.policy.admit(block.key, ssd.used_bytes + total + size > room):
                    block.flags |= SSD_DECLINED   # the tier is full of blocks worth more
                    continue
            # A block is of use on SSD only under its parents: those passed over earlier (refused)
            # go down with it. Left in DRAM without a copy, they could never leave it while it is
            # in the index (only leaves leave), nor be rebuilt at restart.
            run = [block]
            parent = block.parent
            while parent is not None and parent.flags & (SEALED | ON_SSD | DEMOTING | PROMOTING) == SEALED \
                    and parent.in_dram and parent not in picked and parent not in too_big:
                run.append(parent)
                parent = parent.parent
            if parent in too_big or size * len(run) + self._ssd_bytes_above(parent, held_above) > room:
                # could never fit under the high watermark (beside its ancestors on SSD, which
                # cannot leave it while the run hangs under them): leave the chain in DRAM, whole
                # (its blocks stay evictable leaves first), rather than fail the round after
                # make_ssd_room emptied the tier trying
                too_big.update(run)
                for b in run:
                    b.flags |= SSD_DECLINED
                continue
            if chosen and total + size * len(run) > batch_cap:
                break   # this run goes first in a round of its own
            for b in reversed(run):
                chosen.append(b)
                picked.add(b)
            total += size * len(run)
        if not chosen:
            return 0
        if not placement.make_ssd_room(total):
            # SSD bytes that cannot leave (ancestors of this round's other runs, of blocks left in
            # DRAM, pinned ones) were more than the runs were weighed against. What could leave
            # has left: write the part of the round that fits now rather than nothing. Any prefix
            # of ``chosen`` holds each block's parent before it (runs go parent first, under
            # blocks on SSD or picked before them).
            free = room - ssd.used_bytes
            keep = 0
            for block in chosen:
                free -= block.index.block_bytes
                if free < 0:
                    break
                keep += 1
            if not keep:
                return 0
            del chosen[keep:]
        for namespace_id in {block.index.namespace_id for block in chosen}:
            state = self._catalog.find(namespace_id)
            if state is not None and not state.on_ssd:
                # its record failed to reach the disk: blocks without one are dropped at restart
                self._catalog.persist(state)
        futures = []
        for block in chosen:
            block.flags |= DEMOTING
            block.pins += 1
            parent_key = block.parent.key if block.parent is not None else b""
            futures.append(asyncio.wrap_future(self._tier.put(
                block.index.namespace_id, block.key, parent_key, block.depth,
                self._arena.view(block.offset, block.index.block_bytes), block.check,
                reuses=placement.dram.policy_for(block).reuses(block) or 0)))
            ssd.reserve(block.index.block_bytes)  # returned on failure
        # A task of its own: a cancelled caller (a flush past its deadline) must not leave the
        # blocks DEMOTING and pinned, nor their bytes reserved on SSD.
        return await asyncio.shield(self._background.spawn(self._demoted(chosen, futures)))

    def _ssd_bytes_above(self, block: Block | None, memo: dict[Block, int]) -> int:
        """The SSD bytes of ``block`` and its ancestors (written or being written): none of them
        can leave the tier while a chain hangs under them."""
        path: list[Block] = []
        while block is not None and block not in memo:
            path.append(block)
            block = block.parent
        acc = memo[block] if block is not None else 0
        for b in reversed(path):
            if b.flags & (ON_SSD | DEMOTING):
                acc += b.index.block_bytes
            memo[b] = acc
        return acc

    async def _demoted(self, chosen: list[Block], futures: list[asyncio.Future[int]]) -> int:
        results = await asyncio.gather(*futures, return_exceptions=True)
        written = 0
        for block, result in zip(chosen, results):
            block.flags &= ~DEMOTING
            block.pins -= 1
            if isinstance(result, BaseException):
                self._placement.ssd.unreserve(block.index.block_bytes)
                self.write_errors += 1
                block.flags |= WRITE_FAILED   # it may leave DRAM uncopied; a later round tries again
                if isinstance(result, MapFull):
                    self._placement.make_ssd_room(self._config.ssd.capacity * 0.05)
                elif isinstance(result, SSDError):
                    self._backoff_until = self._clock() + 1.0
                continue
            # the bytes it has in DRAM too (pinned meanwhile): a peer gets it unhashed
            self._placement.ssd_written(block, result)
            written += 1
        self.demotions += written
        return written

    async def flushing(self, model: str = "") -> AsyncGenerator[FlushProgress, None]:
        """Write every DRAM block of ``model`` (all when empty) without an SSD copy to SSD now,
        yielding progress before the first write round, after each (at most 256 MiB), and, done,
        at the end. ResourceExhausted, saying how many were written and how many were not, when
        some could not be (the tier is full of blocks that cannot leave, or writes failed): those
        blocks would not survive a restart. FailedPrecondition without an SSD tier; NotFound for
        a model never seen."""
        if self._tier is None:
            raise FailedPrecondition("the SSD tier is disabled (ssd.enabled = false)", Reason.SSD_DISABLED)
        ids = self._catalog.ids_of(model)
        total = 0
        yield FlushProgress(0, self._placement.dram_only(ids))
        for _ in range(_FLUSH_ROUNDS):
            written = await self.write_back(float("inf"), force=True, models=ids)
            total += written
            if written:
                yield FlushProgress(total, self._placement.dram_only(ids))
                continue
            # Blocks another write-back is writing now are skipped above: wait for them to land
            # (or fail) rather than count them as left.
            if not any(b.flags & DEMOTING for ns_id in ids for b in self._catalog.get(ns_id).index):
                break
            await asyncio.sleep(0.01)
        left = sum(1 for ns_id in ids for b in self._catalog.get(ns_id).index
                   if b.sealed and b.in_dram and not b.on_ssd)
        if left:
            raise ResourceExhausted(f"wrote {total} block(s) to SSD, but {left} block(s) are still only in DRAM "
                                    f"(SSD tier of {self._config.ssd.capacity >> 20} MiB full, or write errors: "
                                    "see kvctl stats)")
        yield FlushProgress(total, 0, done=True)

    def record_learned(self) -> int:
        """Queue what the policies have learned for the SSD tier to keep (see
        :mod:`kvstored.store.learned`); how many policies' states. Done every LEARNED_EVERY_S by
        the background task and at shutdown."""
        self._learned_at = self._clock()
        if self._tier is None:
            return 0
        records = learned_records(self._placement)
        for name, state in records.items():
            self._tier.put_learned(name, state)
        return len(records)

    async def record_reuses(self) -> int:
        """Shutdown: write the reuse count each reused block with an SSD copy has now into its
        record (written with the count it had then), so that a restart's policies do not take
        the most reused blocks for new ones, and what the policies learned (:meth:`record_learned`);
        returns how many records were updated. A kill -9 keeps the counts of the last writes."""
        if self._tier is None:
            return 0
        dram, ssd = self._placement.dram, self._placement.ssd
        updated = 0
        # A hit is recorded on the deepest block of its prefix and reaches the ancestors only as
        # that block leaves (kvstored.policy.usage): each block counts the hits pending below it.
        below: dict[Block, int] = {}
        for block in sorted(self._catalog.blocks(), key=lambda b: -b.depth):
            policy = dram.policy_for(block) if block.in_dram else ssd.policy
            under = below.pop(block, 0)
            if block.parent is not None:
                below[block.parent] = below.get(block.parent, 0) + under + policy.pending_hits(block)
            reuses = (policy.reuses(block) or 0) + under
            if reuses and block.on_ssd:
                self._tier.set_reuses(block.index.namespace_id, block.key, reuses)
                updated += 1
        self.record_learned()
        await asyncio.wrap_future(self._tier.barrier())
        return updated

    async def for_shutdown(self) -> int:
        """Shutdown: write DRAM blocks without an SSD copy to SSD (as the background rounds would,
        under ``ssd.admission`` and the SSD policy) until none is left that may go; returns how
        many were written. Cancelling it (a deadline) leaves the writes under way to finish."""
        written = 0
        while self._tier is not None:
            n = await self.write_back(float("inf"), force=False, models=None)
            if not n:
                break
            written += n
        return written
