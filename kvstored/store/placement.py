"""Placement: where each block's bytes are (a DRAM slot, an SSD copy, both), and the moves that
change it: binding and releasing slots, evicting to make room, dropping copies, and taking a
block out of the index with everything it held.

Tiers are exclusive in their eviction policies and inclusive in their bytes: a sealed block with a
DRAM slot is tracked by its slot size's DRAM policy, one without by the SSD policy; a block may
have both a slot and an SSD copy ("clean"), which makes evicting it from DRAM free. The DRAM
blocks without an SSD copy wait in the write-back queue, oldest first; one the SSD tier admits
never leaves DRAM before it has its copy (see ``DramResidency``'s ``keep``): a save that needs its
slot waits for the write-back (:meth:`Placement.wait_for_room`). A block's last copy goes only
for a reason, counted in :attr:`Placement.dropped_by`:

- ``refused``: ``ssd.admission`` refused it; ``ssd_off``: there is no SSD tier;
- ``ssd_full``: the SSD tier's policy refused it (full of blocks worth more);
- ``write_error``: its write to the SSD tier failed;
- ``ssd_evicted``: the SSD tier's policy evicted it (its only copy was there);
- ``corrupt``: its SSD copy failed its checksum; ``unreadable``: its record did not restore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence

from kvstored.index import DEMOTING, NO_SLOT, ON_SSD, PROMOTING, SEALED, SSD_DECLINED, WRITE_FAILED, Block, Tier
from kvstored.store.dram_residency import DramResidency
from kvstored.store.events import NO_EVENTS, TierEvents
from kvstored.store.ssd_residency import SsdResidency
from kvstored.tiers.ssd import PROGRESS_EVERY, Progress

log = logging.getLogger("kvstored.store")

ROOM_POLL_S = 0.01   # how often a save waiting for room looks again
DROP_REASONS = ("refused", "ssd_off", "ssd_full", "write_error", "ssd_evicted", "corrupt", "unreadable")


class WriteBackQueue:
    """The sealed DRAM blocks without an SSD copy in the order they were queued (the write-back
    order; a block's parent is queued before it), when each was queued, their slot bytes, the
    signal that wakes the write-back task, and how many saves wait for it."""

    def __init__(self) -> None:
        self._blocks: dict[Block, float] = {}
        self.bytes = 0
        self.wanted = asyncio.Event()
        self.waiters = 0   # saves waiting for the write-back to make room (it writes at once then)

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks)

    def add(self, block: Block, now: float) -> None:
        self.bytes += block.index.slot_bytes
        self._blocks[block] = now

    def oldest(self, keep: Callable[[Block], bool], scan: int = 256) -> float | None:
        """When the oldest of the first ``scan`` queued blocks that ``keep`` keeps for the SSD
        tier was queued (None: none of them); blocks the tier will not take are passed over."""
        for n, (block, queued) in enumerate(self._blocks.items()):
            if n == scan:
                return None
            if not block.flags & DEMOTING and keep(block):
                return queued
        return None

    def discard(self, block: Block) -> None:
        """``block`` got an SSD copy or lost its slot."""
        self.bytes -= block.index.slot_bytes
        self._blocks.pop(block, None)


def _nothing() -> None:
    pass


class Placement:
    """A block's copies across the DRAM and SSD tiers, kept consistent with the index, both
    residencies' policies and the write-back queue. Counts evictions and blocks dropped."""

    def __init__(self, dram: DramResidency, ssd: SsdResidency, writeback_watermark_bytes: float,
                 clock: Callable[[], float]) -> None:
        self.dram = dram
        self.ssd = ssd
        self.queue = WriteBackQueue()
        self._watermark = writeback_watermark_bytes
        self._clock = clock
        self.dram_evictions = 0
        self.ssd_evictions = 0
        # blocks whose last copy went, by reason (see the module docstring)
        self.dropped_by: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.events: TierEvents = NO_EVENTS   # told of every copy a block gains or loses
        # called when a policy may have put work off (see catch_up): the store runs it once idle
        self.deferred: Callable[[], None] = _nothing

    @property
    def dropped(self) -> int:
        """Blocks whose last copy went, for any reason."""
        return sum(self.dropped_by.values())

    def count_dropped(self, reason: str, n: int = 1) -> None:
        assert reason in self.dropped_by, f"unknown drop reason {reason!r}"
        self.dropped_by[reason] += n

    def catch_up(self) -> None:
        """Let the tiers' policies do the work they put off (their shadows' replay), now."""
        for policy in self.dram.policies().values():
            policy.catch_up()
        self.ssd.policy.catch_up()

    def hit(self, blocks: Sequence[Block]) -> None:
        """Tell the tiers' policies that a lookup hit ``blocks``, a prefix of one namespace's chain.

        O(1) whatever the prefix length: the policies record a hit on the deepest block they track
        (:mod:`kvstored.policy.usage`). A DRAM-resident prefix is closed under ancestors (only
        leaves leave a tier), so the common case is a DRAM run, then an SSD-only run; the SSD
        policy records a hit only when the prefix ends off DRAM. It is told of every hit (and
        every store) all the same, as the store's (``seen_hit``): an SSD tier's worth is judged
        on every access (``glide``'s shadows; O(1) to classify, their replay deferred).
        """
        if not blocks:
            return
        # Usually a DRAM run, then an SSD-only run; but a block may come up alone (a peer's
        # checkout) or a chain's head lose its slots first (a stream's drop_clean_slots), so a
        # prefix may also start on SSD and end in DRAM: the DRAM policy is asked then, and not the
        # SSD policy. Its record on the deepest DRAM block reaches the SSD-only blocks above once
        # they come up (this lookup brings them up) and are tracked above it; recorded on SSD too,
        # the hit came up with them in their reuses and was counted twice when that record did.
        first, last = blocks[0].offset != NO_SLOT, blocks[-1].offset != NO_SLOT
        if first or last:
            self.dram.policy_for(blocks[0]).hit(blocks)
        if not last:
            self.ssd.policy.hit(blocks)
        if self.ssd.enabled:
            self.ssd.policy.seen_hit(blocks)
        self.dram.mark_pages(blocks)
        self.deferred()

    # -- DRAM slots ---------------------------------------------------------------------------
    def alloc(self, sb: int) -> int | None:
        """A slot of ``sb`` bytes, evicting what the DRAM policies pick to make room (a block
        with an SSD copy just loses its slot and joins the SSD policy; one without leaves the
        index); None when nothing may leave."""
        offset = self.dram.take_free(sb)
        while offset is None:
            self.queue.wanted.set()
            room = self.dram.room_for(sb)
            if room is None:
                return None
            for block in room.victims:
                self.evict_slot(block)
            assert room.page is None or self.dram.page_emptied(room.page), "page not emptied"
            offset = self.dram.take_free(sb)
        return offset

    def bind(self, block: Block, offset: int) -> Block:
        return self.dram.bind(block, offset)

    def release_slot(self, block: Block, leaving: bool = False, free: bool = True) -> int | None:
        """Give back a block's DRAM slot (its bytes stay wherever else they are); ``leaving``:
        the block leaves the index too; ``free``: as for :meth:`DramResidency.release`. Returns
        the slot's offset (None when the block had none)."""
        if block.offset == NO_SLOT:
            return None
        if block.sealed and not block.on_ssd:
            self.queue.discard(block)
        if block.sealed and not block.flags & PROMOTING:   # a promotion that failed was never announced
            self.events.removed((block,), Tier.DRAM)
        # to the SSD tier (a move, not an eviction of its bytes), or gone
        return self.dram.release(block, moved=block.on_ssd and not leaving, leaving=leaving, free=free)

    def evict_slot(self, block: Block) -> None:
        """Evict ``block`` from DRAM: with an SSD copy it only loses its slot, else it is dropped
        (counted by why it had no copy)."""
        if block.on_ssd:
            self.leave_dram_for_ssd(block)
        else:
            self.count_dropped(self._why_uncopied(block))
            self.remove(block)
        self.dram_evictions += 1

    def _why_uncopied(self, block: Block) -> str:
        if not self.ssd.enabled:
            return "ssd_off"
        if block.flags & WRITE_FAILED:
            return "write_error"
        if block.flags & SSD_DECLINED:
            return "ssd_full"
        return "refused"

    async def wait_for_room(self, until: float, landing: bool = False) -> bool:
        """A save or a read found no slot: DRAM holds only blocks that may not leave now. When
        some wait for their SSD copy (or are being written), have the write-back write at once
        and wait a moment (at most until ``until``, the event loop's time) for it; with
        ``landing`` (reads from SSD into slots are in flight: their blocks may leave once they
        land) wait a moment all the same. True: try again. False when waiting cannot help (no
        SSD tier, nothing the write-back would free, nothing landing) or the time is up."""
        loop = asyncio.get_running_loop()
        left = until - loop.time()
        if left <= 0 or not self.ssd.enabled:
            return False
        writer = self._writer_can_help()
        if not writer and not landing:
            return False
        if writer:
            self.queue.waiters += 1
            self.queue.wanted.set()
        try:
            # polled: a write-back round takes milliseconds to seconds, and other slots free up
            # as leases end; an event per change would cost every one of those paths
            await asyncio.sleep(min(left, ROOM_POLL_S))
        finally:
            if writer:
                self.queue.waiters -= 1
        return True

    def _writer_can_help(self, scan: int = 256) -> bool:
        """Whether the write-back will free a slot: among the first ``scan`` queued blocks, one
        is being written, or waits for its SSD copy (it may leave once it has it)."""
        for n, block in enumerate(self.queue):
            if n == scan:
                return False
            if block.flags & DEMOTING or self.dram.keeps(block):
                return True
        return False

    def leave_dram_for_ssd(self, block: Block) -> None:
        """Give up the DRAM slot of ``block`` (sealed, with an SSD copy): it stays on SSD only,
        tracked by the SSD policy with the reuses the DRAM policy had counted for it."""
        reuses = self.dram.policy_for(block).reuses(block)
        self.release_slot(block)
        self.ssd.policy.inserted([block], None if reuses is None else [reuses])

    def drop_clean_slots(self, blocks: Sequence[Block], most: int) -> int:
        """Free the DRAM slots of up to ``most`` of ``blocks`` (in order) that have an SSD copy and
        nothing holding them; their bytes stay on SSD. Returns how many were freed."""
        freed = 0
        for block in blocks:
            if freed == most:
                break
            if block.in_dram and block.on_ssd and not block.pins and not block.flags & (DEMOTING | PROMOTING):
                self.leave_dram_for_ssd(block)
                self.dram_evictions += 1
                freed += 1
        return freed

    def sealed_now(self, blocks: list[Block]) -> None:
        """Blocks of one chain whose bytes just landed in their DRAM slots become visible."""
        if not blocks:
            return
        now = self._clock()
        for block in blocks:
            block.flags |= SEALED
            self.queue.add(block, now)
        blocks[0].index.changed_many(blocks)
        self.dram.policy_for(blocks[0]).inserted(blocks)  # one chain: one namespace, one slot size
        if self.ssd.enabled:
            self.ssd.policy.seen_stored(blocks)
        self.events.stored(blocks, Tier.DRAM)
        self.dram.mark_pages(blocks)
        self.deferred()
        if self.queue.bytes > self._watermark:
            self.queue.wanted.set()

    # -- SSD copies ---------------------------------------------------------------------------
    def ssd_written(self, block: Block, check: int) -> None:
        """``block``'s SSD copy (reserved in the SSD residency) is written."""
        block.flags &= ~(SSD_DECLINED | WRITE_FAILED)
        self.ssd.written(block, check)
        self.events.stored((block,), Tier.SSD)
        if block.in_dram:
            self.queue.discard(block)

    def drop_ssd_copy(self, block: Block, leaving: bool = False) -> None:
        if not block.on_ssd:
            return
        self.ssd.dropped(block, leaving)
        self.events.removed((block,), Tier.SSD)
        if block.in_dram and block.sealed:
            self.queue.add(block, self._clock())

    def drop_lost_copy(self, block: Block, why: object) -> None:
        """``block``'s SSD copy failed its checksum: drop it (counted once, however many reads
        of the copy fail: peers reading it at once into buffers of their own)."""
        if block.on_ssd:   # else an earlier failed read of this copy dropped it (and counted it)
            log.warning("dropping block %s: %s", block.key.hex()[:16], why)
            self.drop_ssd_copy(block)
            self.count_dropped("corrupt")

    def make_ssd_room(self, nbytes: float, progress: Progress | None = None) -> bool:
        """Evict SSD-only leaves (the SSD policy's victims) so ``nbytes`` more fit under the high
        watermark; ``progress(what, evicted, 0)`` is called every PROGRESS_EVERY evictions."""
        if self.ssd.fits(nbytes):
            return True
        target = self.ssd.low_target(nbytes)
        evicted = 0
        while self.ssd.used_bytes > target:
            victim = self.ssd.policy.victim()
            if victim is None:
                break
            self.remove(victim)  # untracks it: the next victim is another block
            self.ssd_evictions += 1
            self.count_dropped("ssd_evicted")   # SSD-only: its last copy
            evicted += 1
            if progress is not None and evicted % PROGRESS_EVERY == 0:
                progress("restoring blocks from SSD: evicting to fit ssd.capacity", evicted, 0)
        return self.ssd.fits(nbytes)

    # -- the index ----------------------------------------------------------------------------
    def remove(self, block: Block) -> None:
        """Take a leaf out of the index and out of every tier; hollow ancestors follow."""
        self.release_slot(block, leaving=True)
        self.drop_ssd_copy(block, leaving=True)
        block.index.remove(block)
        self.remove_if_hollow(block.parent)

    def remove_if_hollow(self, block: Block | None) -> None:
        """Take ``block`` out of the index if it is hollow (sealed, its bytes lost), childless and
        unheld; then its parent, likewise."""
        # a block may have gone already: callers walk a prefix deepest first, and a hollow child's
        # removal takes its hollow parent along
        while block is not None and block.sealed and not block.readable and block.children == 0 \
                and block.pins == 0 and not block.flags & PROMOTING and block.index.get(block.key) is block:
            parent = block.parent
            block.index.remove(block)
            block = parent

    def evict_blocks(self, blocks: Sequence[Block], tier: Tier | None) -> int:
        """Drop ``blocks`` from ``tier`` (all when None); pinned blocks stay, and so does the SSD
        copy of a block with a child that keeps one. Returns how many blocks lost a copy or left
        the index."""
        count = 0
        # Blocks with a child that keeps an SSD copy (or is being written to SSD): theirs stays,
        # or a restart would drop the child, its record hanging under no parent record.
        under_ssd: set[Block] = set()
        for block in sorted(blocks, key=lambda b: -b.depth):
            if block.index.get(block.key) is not block:
                continue   # left with a child removed before it (a hollow parent goes with its last child)
            if block.pins or block.flags & (SEALED | DEMOTING | PROMOTING) != SEALED:
                pass
            elif tier is Tier.DRAM and block.in_dram:
                if block.on_ssd:
                    self.leave_dram_for_ssd(block)
                    count += 1
                elif block.children == 0:
                    self.remove(block)
                    count += 1
            elif tier is Tier.SSD and block.on_ssd:
                if block.in_dram and block not in under_ssd:
                    self.drop_ssd_copy(block)
                    count += 1
                elif block.children == 0:
                    self.remove(block)
                    count += 1
            elif tier is None and block.children == 0:
                self.remove(block)
                count += 1
            if block.flags & (ON_SSD | DEMOTING) and block.parent is not None \
                    and block.index.get(block.key) is block:
                under_ssd.add(block.parent)
        return count

    def dram_only(self, namespace_ids: set[int] | None = None) -> int:
        """Sealed blocks (of these namespaces; None: all) whose only copy is in DRAM."""
        return sum(1 for b in self.queue if (namespace_ids is None or b.index.namespace_id in namespace_ids)
                   and b.sealed and b.in_dram and not b.on_ssd)
