"""DRAM residency: which block holds which arena slot, the pages those slots lie in and how they
drift between block sizes, and the DRAM eviction policies (one per slot size).

Metadata and decisions only: the bytes live in the arena, and carrying out an eviction (which
may move a block to the SSD tier or out of the index) is :class:`~kvstored.store.placement.Placement`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstored.config import Config
from kvstored.index import DEMOTING, NO_SLOT, ON_SSD, PROMOTING, SEALED, Block
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.registry import make_policy
from kvstored.tiers.dram import SlotAllocator

# A policy's ghost list remembers at least this many blocks (a small tier of large blocks still
# remembers some).
MIN_GHOST_BLOCKS = 1024


def never(block: Block) -> bool:
    """A keep rule under which every block may leave DRAM without a copy (no SSD tier)."""
    return False


@dataclass(frozen=True, slots=True)
class Room:
    """What must give up its slot to make room: ``victims`` in this order; ``page``: the page
    they empty together (None: a single victim)."""

    victims: list[Block]
    page: int | None = None


class DramResidency:
    """Slots, pages and the per-size DRAM policies. Pages drift to the block sizes in use: each
    page remembers when it was last used (sealed into, hit), and making room for one size may
    take a whole page of another (see :meth:`room_for`)."""

    def __init__(self, config: Config, capacity: int, clock: Callable[[], float],
                 keep: Callable[[Block], bool] = never) -> None:
        """``capacity``: the arena's bytes. ``keep(block)``: a sealed block without an SSD copy
        must not leave DRAM until it has one (the SSD tier admits it): it waits for the write-back
        instead of being dropped."""
        self._config = config
        self._clock = clock
        self._keep = keep
        self._allocator = SlotAllocator(capacity, config.dram.page_bytes)
        self._tick = 0                                      # advances with every request that allocates
        self._page_tick = [0] * self._allocator.num_pages   # when each page was last used (sealed or hit)
        # the blocks holding a slot in each page (see bind); a used slot of none: a landing
        self._page_blocks: list[dict[Block, None]] = [{} for _ in range(self._allocator.num_pages)]
        self._policies: dict[int, BlockPolicy] = {}   # one per slot size

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    @property
    def page_bytes(self) -> int:
        return self._allocator.page_bytes

    def blocks(self) -> int:
        """Blocks holding a sealed slot (tracked by a DRAM policy)."""
        return sum(len(policy) for policy in self._policies.values())

    def policies(self) -> dict[int, BlockPolicy]:
        """The DRAM policy of each slot size in use (a copy of the mapping)."""
        return dict(self._policies)

    @property
    def num_pages(self) -> int:
        return self._allocator.num_pages

    def page_slot_bytes(self, page: int) -> int:
        """The slot size page ``page`` is carved into (0: a free page)."""
        return dict(self._allocator.pages()).get(page, 0)

    def page_blocks(self, page: int) -> list[Block]:
        return list(self._page_blocks[page])

    def used_slots(self, page: int) -> int:
        return self._allocator.used_slots(page)

    def advance(self) -> None:
        """A request that may allocate or use pages began: later marks count as more recent."""
        self._tick += 1

    def mark_pages(self, blocks: Sequence[Block]) -> None:
        """Mark the arena pages of ``blocks`` used now (sampled: a chain's blocks share pages), so
        that pages drift to the slot sizes in use (see :meth:`room_for`)."""
        page_bytes, tick, page_tick = self._allocator.page_bytes, self._tick, self._page_tick
        for block in blocks[:: max(1, len(blocks) // 8)]:
            if block.offset != NO_SLOT:
                page_tick[block.offset // page_bytes] = tick

    def policy_for(self, block: Block) -> BlockPolicy:
        return self.policy_of_size(block.index.slot_bytes)

    def policy_of_size(self, slot_bytes: int) -> BlockPolicy:
        policy = self._policies.get(slot_bytes)
        if policy is None:
            policy = self._policies[slot_bytes] = make_policy(
                self._config.dram.policy, self._clock, max(self._allocator.capacity // slot_bytes, MIN_GHOST_BLOCKS),
                can_evict=self.can_evict, defer=True)
        return policy

    def keeps(self, block: Block) -> bool:
        """Whether ``block`` (sealed, without an SSD copy) must stay until it has one."""
        return self._keep(block)

    def can_evict(self, block: Block) -> bool:
        """May ``block`` give up its DRAM slot now? Not while pinned, being written out, promoted
        or unsealed; with an SSD copy it just loses the slot, so it may have children in the index
        (the policy still offers only leaves of the DRAM-resident tree); without one it would
        leave the index, which only leaves may, and only when ``keep`` lets it go uncopied."""
        if block.pins or block.flags & (SEALED | DEMOTING | PROMOTING) != SEALED:
            return False
        return bool(block.flags & ON_SSD) or (block.children == 0 and not self._keep(block))

    def take_free(self, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes`` (its offset), or None when none is free."""
        return self._allocator.alloc(slot_bytes)

    def free_unbound(self, offset: int) -> None:
        """Give back a slot that no block was bound to (a landing that did not land)."""
        self._allocator.free(offset)

    def bind(self, block: Block, offset: int) -> Block:
        """Give ``block`` (slotless) the slot at ``offset``, just allocated: every slot a block
        holds is bound here and given back by :meth:`release`, so that each page knows its
        blocks (see :meth:`page_leavers`). A sealed block not PROMOTING is readable in the slot
        from here on, by SDKs without a lease too (the presence table): its bytes must be there
        already (a promotion marks its block PROMOTING first, a rewrite clears SEALED first)."""
        assert block.offset == NO_SLOT, "a block holds one slot at most"
        block.offset = offset
        self._page_blocks[offset // self._allocator.page_bytes][block] = None
        if block.flags & SEALED:   # (an unsealed block is no more readable with a slot than without)
            block.index.changed(block)
        return block

    def order_slots(self, blocks: Sequence[Block]) -> None:
        """Deal the slots of ``blocks`` (just reserved, unsealed: nobody reads or writes them yet)
        out again in ascending order along the list. Making room evicts a chain leaf first, so a
        chain saved into an old chain's slots got them in descending order, and every copy into or
        out of them took a step per block; side by side in order they are one run."""
        offsets = [b.offset for b in blocks]
        ordered = sorted(offsets)
        if offsets == ordered:
            return
        page_bytes, page_blocks = self._allocator.page_bytes, self._page_blocks
        for block in blocks:
            assert not block.flags & SEALED, "a sealed block's slot is readable: it cannot move"
            del page_blocks[block.offset // page_bytes][block]
        for block, offset in zip(blocks, ordered):
            block.offset = offset
            page_blocks[offset // page_bytes][block] = None

    def release(self, block: Block, moved: bool, leaving: bool = False, free: bool = True) -> int:
        """Give back ``block``'s slot; its policy forgets it (``moved``: its bytes stay on SSD).
        The presence table learns it first: no SDK reads the slot as this block's once another
        may take it. ``leaving``: the block leaves the index before anything else runs, which
        tells the table (so it is not told twice). Without ``free`` the slot stays allocated,
        bound to no block (the caller frees it later: :meth:`free_unbound`). Returns its offset."""
        self.policy_for(block).removed(block, moved=moved)
        offset = block.offset
        del self._page_blocks[offset // self._allocator.page_bytes][block]   # KeyError: never bound
        block.offset = NO_SLOT
        if block.flags & SEALED and not leaving:
            block.index.changed(block)
        if free:
            self._allocator.free(offset)
        return offset

    def room_for(self, sb: int) -> Room | None:
        """What to evict for a slot of ``sb`` bytes: the victim of this size's policy, or a whole
        page of another size (see :meth:`_page_to_take`). None when nothing may leave.

        DRAM admits every block (``admit`` is not asked): a block refused here would never reach
        the SSD tier, usually far larger, through write-back, and an engine's save would store
        less at a time when the arena is merely full of blocks that already have SSD copies.
        The policy's admission guards the SSD tier instead (see the write-back)."""
        own = self._policies.get(sb)
        victim = own.victim() if own is not None else None
        if len(self._policies) > (own is not None):   # other sizes
            room = self._page_to_take(sb, victim)
            if room is not None:
                return room
        return None if victim is None else Room([victim])

    def _page_to_take(self, sb: int, victim: Block | None) -> Room | None:
        """Room from another slot size than ``sb``, so that pages drift to the sizes in use,
        when another size's policy victim sits in a page used less recently than the page of
        ``victim`` (this size's own; None: than any). In this order:

        - the least recently used such page whose blocks can all leave now, emptied at once;
        - else another size's page that can, used less recently than ``victim``'s (the policy
          orders blocks, not pages: its victim's page may hold a leased block, another not);
        - else, when the least recently used such page holds no block that must stay (it only
          has blocks whose children sit in other pages), that size's victim alone, as a step
          towards emptying it (chains that cross between pages free none whole).

        None when nothing may go: no block leaves for a page that cannot empty."""
        page_bytes, page_tick = self._allocator.page_bytes, self._page_tick
        bound = page_tick[victim.offset // page_bytes] if victim is not None else None
        older: list[tuple[int, Block]] = []   # (page, victim in it) of the other sizes
        for size, policy in self._policies.items():
            if size == sb or not len(policy):
                continue
            other = policy.victim()
            if other is not None:
                page = other.offset // page_bytes
                if bound is None or page_tick[page] < bound:
                    older.append((page, other))
        if not older:
            return None   # no other size's victim is older than this size's own
        older.sort(key=lambda pv: page_tick[pv[0]])
        step: Block | None = None   # a victim whose page may empty once its children's pages do
        for page, other in older:
            held, leavers = self.page_leavers(page)
            if leavers is not None:
                return _emptying(page, leavers)
            if not held and step is None:
                step = other
        tried = {page for page, _ in older}
        rest = [page for page, size in self._allocator.pages()
                if size != sb and page not in tried and (bound is None or page_tick[page] < bound)]
        for page in sorted(rest, key=page_tick.__getitem__):
            leavers = self.page_leavers(page)[1]
            if leavers is not None:
                return _emptying(page, leavers)
        return None if step is None else Room([step])

    def page_leavers(self, page: int) -> tuple[bool, list[Block] | None]:
        """``(held, leavers)`` of ``page``: ``held`` when a slot in it cannot be given up now,
        whatever else leaves; ``leavers``: its blocks, deepest first, when all may give up their
        slots now (else None). As :meth:`can_evict` asks of a victim: unpinned, sealed, not
        being written out or promoted; a slot held by no block (a peer's block landing) is held,
        and so is a block without an SSD copy that ``keep`` keeps until it has one. A block with
        an SSD copy only loses its slot; one without leaves the index, so its children must too:
        all in this page and leaving as well (leaf-first within the page)."""
        blocks = self._page_blocks[page]
        used = self._allocator.used_slots(page)
        assert len(blocks) <= used, f"page {page}: {len(blocks)} blocks in {used} used slots"
        if len(blocks) < used:
            return True, None
        keep = self._keep
        for block in blocks:   # before sorting: pages of other sizes are scanned while none can empty
            if block.pins or block.flags & (SEALED | DEMOTING | PROMOTING) != SEALED \
                    or (not block.flags & ON_SSD and keep(block)):
                return True, None
        order = sorted(blocks, key=lambda b: -b.depth)   # children before their parents
        leaving: dict[Block, int] = {}   # children of a block leaving the index with it
        stuck = False   # a block with a child outside this page or staying in the index
        for block in order:
            if block.flags & ON_SSD:
                continue
            if block.children != leaving.get(block, 0):
                stuck = True
                continue
            parent = block.parent
            if parent is not None and parent in blocks:
                leaving[parent] = leaving.get(parent, 0) + 1
        return False, None if stuck else order

    def page_emptied(self, page: int) -> bool:
        return not self._page_blocks[page] and self._allocator.used_slots(page) == 0


def _emptying(page: int, leavers: list[Block]) -> Room:
    """The room a whole page gives (``leavers``: its blocks, deepest first): those without an SSD
    copy leave the index deepest first (a block after its children), then the others lose their
    slots parent first (the order the SSD policy is told of a run)."""
    return Room([b for b in leavers if not b.on_ssd] + [b for b in reversed(leavers) if b.on_ssd], page)
