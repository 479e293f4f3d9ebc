"""The classic eviction orders, leaf-only: LRU and LFU, for comparison with the default policy.

Both admit every block. Recency is a logical counter (one tick per call), not a clock, so runs
are exact and repeatable. ``can_evict`` is the tier's predicate for "may leave now" (see
:mod:`kvstored.policy.leafheap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstored.index import Block
from kvstored.policy.leafheap import LeafHeap, index_leaf


class _HeapPolicy:
    """What LRU and LFU share: an admit-all policy over a heap of evictable leaves."""

    def __init__(self, can_evict: Callable[[Block], bool] = index_leaf) -> None:
        self._heap = LeafHeap(can_evict)
        self._tick = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: object) -> bool:
        return block in self._heap

    def admit(self, key: bytes, full: bool) -> bool:
        return True

    def inserted(self, blocks: Sequence[Block]) -> None:
        self.hit(blocks)

    def hit(self, blocks: Sequence[Block]) -> None:
        raise AssertionError("subclasses define hit")

    def removed(self, block: Block) -> None:
        self._heap.discard(block)

    def victim(self) -> Block | None:
        return self._heap.peek()


class LRUPolicy(_HeapPolicy):
    """Least recently used leaf first; a hit or insert run shares one tick (ties: oldest entry)."""

    name = "lru"

    def hit(self, blocks: Sequence[Block]) -> None:
        self._tick += 1
        prio = (float(self._tick), 0.0)
        for block in blocks:
            self._heap.set(block, prio)


class LFUPolicy(_HeapPolicy):
    """Least frequently used leaf first (uses since stored), least recent among equals."""

    name = "lfu"

    def __init__(self, can_evict: Callable[[Block], bool] = index_leaf) -> None:
        super().__init__(can_evict)
        self._uses: dict[Block, int] = {}

    def hit(self, blocks: Sequence[Block]) -> None:
        self._tick += 1
        uses = self._uses
        for block in blocks:
            n = uses[block] = uses.get(block, 0) + 1
            self._heap.set(block, (float(n), float(self._tick)))

    def removed(self, block: Block) -> None:
        self._uses.pop(block, None)
        super().removed(block)
