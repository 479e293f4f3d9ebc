"""The classic eviction orders, leaf-only: LRU and LFU, for comparison with the default policy.

Both admit every block. Recency is a logical counter (one tick per call), not a clock, so runs
are exact and repeatable. ``can_evict`` is the tier's predicate for "may leave now" (see
:mod:`kvstored.policy.leafheap`). Hits are recorded lazily (:mod:`kvstored.policy.usage`): a
lookup costs O(1) here whatever the length of its prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvstored.index import Block
from kvstored.policy.interface import OwnAccessesOnly
from kvstored.policy.leafheap import LeafHeap, Priority, index_leaf, track_stored
from kvstored.policy.usage import Use, UseLog


class _HeapPolicy(OwnAccessesOnly):
    """What LRU and LFU share: an admit-all policy over a heap of evictable leaves, ordered by a
    priority computed from each block's use record."""

    def __init__(self, can_evict: Callable[[Block], bool] = index_leaf) -> None:
        self._uses = UseLog()
        self._heap = LeafHeap(can_evict, refresh=self._current)
        self._tick = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: object) -> bool:
        return block in self._heap

    def _priority(self, use: Use) -> Priority:
        raise AssertionError("subclasses define _priority")

    def _current(self, block: Block) -> Priority:
        use = self._uses.get(block)
        assert use is not None, "a block in the heap has a use record"
        return self._priority(use)

    def admit(self, key: bytes, full: bool) -> bool:
        return True

    def catch_up(self) -> None:
        pass   # nothing put off

    def learned(self) -> dict[str, float]:
        return {}

    def resume(self, learned: Mapping[str, float]) -> None:
        pass   # nothing learned: the order is the records'

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        self._tick += 1
        now = float(self._tick)
        track_stored(self._heap, self._uses, blocks, now, [0] * len(blocks) if reuses is None else reuses,
                     self._priority)

    def reuses(self, block: Block) -> int | None:
        return self._uses.reuses(block)

    def pending_hits(self, block: Block) -> int:
        return self._uses.pending_hits(block)

    def hit(self, blocks: Sequence[Block]) -> None:
        self._tick += 1
        self._uses.hit(blocks, float(self._tick))

    def removed(self, block: Block, moved: bool = False) -> None:
        self._uses.forget(block)
        self._heap.discard(block)

    def victim(self) -> Block | None:
        return self._heap.peek()


class LRUPolicy(_HeapPolicy):
    """Least recently used leaf first; a hit or insert run shares one tick (ties: the leaf reused
    less, as among blocks restored at one moment, then the oldest entry)."""

    name = "lru"

    def _priority(self, use: Use) -> Priority:
        return (use.last_use, float(use.base + use.hits))


class LFUPolicy(_HeapPolicy):
    """Least frequently used leaf first (uses since stored: the storing and each hit, and the
    hits it had in the tier it moved from), least recent among equals."""

    name = "lfu"

    def _priority(self, use: Use) -> Priority:
        return (float(1 + use.base + use.hits), use.last_use)
