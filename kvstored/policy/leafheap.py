"""A priority queue of the leaves of the resident tree: the mechanism under the priority policies.

Only leaves can be evicted, so only leaves sit in the heap. "Leaf" is relative to the tracked
blocks (those resident in the tier the policy orders): a block enters the heap when it is given a
priority while no tracked child hangs below it, or when its last tracked child leaves. Whether a
candidate may actually go now is a predicate, by default ``Block.evictable`` (sealed, unpinned,
no child in the index at all); a tier whose blocks have a copy elsewhere can pass a looser one.
Entries are never updated in place: a new priority pushes a new entry and old ones are dropped
when they surface (lazy deletion); the heap is rebuilt when stale entries pile up. Ties go to the
entry pushed first. A policy whose priorities only grow may also leave them stale on purpose and
pass ``refresh`` (the current priority of a block): an entry is checked against it when it
surfaces and pushed again with the current value when that is higher, so a hit costs nothing here.

Tracking need not follow the tree order in a tier whose blocks come and go one by one (a parent
may lose its slot before its child, or be given one after it, as when reads of one chain land in
batches that finish in any order): tracked children are counted under their parent whether or not
the parent is tracked, so a parent tracked after its children is no leaf while they are, and
``can_evict`` keeps a block safe to evict whatever the counts say.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from kvstored.index import Block
from kvstored.policy.usage import Use, UseLog

Priority = tuple[float, float]


def index_leaf(block: Block) -> bool:
    """The default eviction predicate: the block may leave the index now."""
    return block.evictable


class LeafHeap:
    """Tracked blocks with a priority each; ``peek`` = the tracked leaf of least priority that
    ``can_evict`` accepts."""

    __slots__ = ("_can_evict", "_heap", "_kids", "_prio", "_refresh", "_seq")

    def __init__(self, can_evict: Callable[[Block], bool] = index_leaf,
                 refresh: Callable[[Block], Priority] | None = None) -> None:
        self._can_evict = can_evict
        self._refresh = refresh
        self._prio: dict[Block, Priority] = {}
        # tracked children of a block (tracked or not), when any: every tracked block with a
        # parent is counted under it
        self._kids: dict[Block, int] = {}
        self._heap: list[tuple[Priority, int, Block]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, block: object) -> bool:
        return block in self._prio

    def priority(self, block: Block) -> Priority | None:
        """The priority ``block`` was last pushed with: exact for the block ``peek`` just
        returned, a lower bound of ``refresh(block)`` for the others."""
        return self._prio.get(block)

    def set(self, block: Block, prio: Priority) -> None:
        """Track ``block`` (or re-prioritise it)."""
        if block not in self._prio:
            parent = block.parent
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
        self._prio[block] = prio
        if block not in self._kids:
            self._push(block, prio)

    def set_many(self, entries: Sequence[tuple[Block, Priority]]) -> None:
        """:meth:`set` of each ``(block, priority)`` in turn, except that a block that is no leaf
        once all are tracked (a chain stored parent first) is not pushed: a stored chain leaves
        one heap entry, not one per block that would go stale at once (~100 B each)."""
        prios, kids = self._prio, self._kids
        for block, prio in entries:
            if block not in prios:
                parent = block.parent
                if parent is not None:
                    kids[parent] = kids.get(parent, 0) + 1
            prios[block] = prio
        for block, prio in entries:
            if block not in kids:
                self._push(block, prio)

    def discard(self, block: Block) -> None:
        """Stop tracking ``block`` (no-op if untracked); its parent becomes a candidate once its
        last tracked child is gone."""
        if self._prio.pop(block, None) is None:
            return
        # its own count stays: its tracked children still hang under it should it come back
        parent = block.parent
        if parent is not None:
            left = self._kids.get(parent, 0) - 1
            assert left >= 0, "a tracked child was not counted under its parent"
            if left > 0:
                self._kids[parent] = left
            else:
                del self._kids[parent]
                prio = self._prio.get(parent)
                if prio is not None:
                    self._push(parent, prio)

    def peek(self) -> Block | None:
        """The tracked leaf of least priority that may go now, or None. Does not remove it."""
        heap, prios, kids, refresh = self._heap, self._prio, self._kids, self._refresh
        held: list[tuple[Priority, int, Block]] = []
        found: Block | None = None
        while heap:
            prio, _, block = heap[0]
            if prios.get(block) != prio or block in kids:
                heapq.heappop(heap)  # stale: re-prioritised, untracked, or no longer a leaf
                continue
            if refresh is not None:
                current = refresh(block)
                if current != prio:  # used since pushed (or its policy's weights fell): back in at its place
                    prios[block] = current
                    heapq.heapreplace(heap, (current, next(self._seq), block))
                    continue
            if self._can_evict(block):
                found = block
                break
            held.append(heapq.heappop(heap))  # pinned, unsealed or being written: keep for later
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def reprioritise(self) -> None:
        """Recompute every tracked block's priority with ``refresh`` and rebuild the heap (O(n)):
        for a policy whose priorities may also fall (a learned weight that went down)."""
        refresh = self._refresh
        if refresh is None:
            return
        prios = self._prio
        for block in prios:
            prios[block] = refresh(block)
        self._rebuild()

    def _push(self, block: Block, prio: Priority) -> None:
        heap = self._heap
        heapq.heappush(heap, (prio, next(self._seq), block))
        if len(heap) > 4 * len(self._prio) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(p, next(self._seq), b) for b, p in self._prio.items() if b not in self._kids]
        heapq.heapify(self._heap)


def track_stored(heap: LeafHeap, uses: UseLog, blocks: Sequence[Block], now: float, bases: Sequence[int],
                 priority: Callable[[Use], Priority], share: Callable[[int], int] = lambda base: base) -> None:
    """Start records for ``blocks``, stored at ``now`` with ``bases[i]`` reuses carried in, and
    track them in ``heap`` at ``priority(record)``. Blocks whose ``share(base)`` is equal get one
    priority object between them (their records differ only in that base): ~80 B a block less."""
    assert len(bases) == len(blocks), "one base per block"
    entries: list[tuple[Block, Priority]] = []
    shared: dict[int, Priority] = {}
    for block, base in zip(blocks, bases, strict=True):
        use = uses.stored(block, now, base=base)
        key = share(base)
        prio = shared.get(key)
        if prio is None:
            prio = shared[key] = priority(use)
        entries.append((block, prio))
    heap.set_many(entries)
