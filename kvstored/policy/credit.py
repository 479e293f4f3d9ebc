"""Reuse credit: recency on a clock, with time credit for blocks that have been reused.

The default policy. Measured on the conversation trace, a block's chance of being used again
falls with the time since its last use (over a few minutes) and rises with how often it has been
reused: blocks reused once, twice, three or more times come back about 1.7x, 2.9x and 4x as
often as blocks stored and never hit, and about three quarters of all blocks are never hit. So a
block's priority is

    last use (s) + tau * ln(weight of its reuse class)

and the leaf of least priority is evicted: a block reused twice outlives a newer block that was
never hit for ``tau * ln 2.9`` seconds. A ghost list remembers the reuse class of evicted keys, so
a block that comes back after an eviction is counted as reused, not as new (its history outlives
its bytes, as in ARC or S3-FIFO); a block that moves to another tier takes its reuses along
(``inserted(..., reuses=)``). Admission: when storing a block needs an eviction and the
newcomer's priority would be below the victim's, the newcomer is refused, so a burst of one-off
blocks cannot flush blocks that earned credit.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kvstored.index import Block
from kvstored.policy.interface import OwnAccessesOnly
from kvstored.policy.leafheap import LeafHeap, Priority, index_leaf, track_stored
from kvstored.policy.usage import Use, UseLog

DEFAULT_TAU_S = 300.0
DEFAULT_CLASS_WEIGHTS = (1.0, 1.7, 2.9, 4.0)  # never hit, hit once, twice, three times or more


class CreditPolicy(OwnAccessesOnly):
    """Leaf-only eviction by ``last use + credit(reuse class)`` with a ghost list and admission.

    ``clock`` gives seconds (monotonic); ``ghost_entries`` bounds the remembered evicted keys
    (about three times the tier's capacity in blocks works well); ``can_evict`` is the tier's
    predicate for "may leave now" (see :mod:`kvstored.policy.leafheap`).
    """

    name = "credit"

    def __init__(self, clock: Callable[[], float], ghost_entries: int, tau_s: float = DEFAULT_TAU_S,
                 class_weights: Sequence[float] = DEFAULT_CLASS_WEIGHTS,
                 can_evict: Callable[[Block], bool] = index_leaf) -> None:
        if tau_s <= 0 or not class_weights or min(class_weights) <= 0 or ghost_entries < 0:
            raise ValueError("tau_s and class weights must be positive, ghost_entries not negative")
        self._clock = clock
        self._credit = [tau_s * math.log(w) for w in class_weights]
        self._top = len(class_weights) - 1
        self._uses = UseLog()
        self._heap = LeafHeap(can_evict, refresh=self._current)
        # evicted key -> the class it left with, and whether it only moved to another tier
        self._ghost: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()
        self._ghost_entries = ghost_entries

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: object) -> bool:
        return block in self._heap

    def reuse_class(self, block: Block) -> int | None:
        """0 = never hit since stored (or since it came back), up to ``len(class_weights) - 1``.

        Hits are recorded on the deepest block of each hit prefix (:mod:`kvstored.policy.usage`),
        so a block with tracked children may not count its latest hits yet; a leaf's is exact.
        """
        use = self._uses.get(block)
        return None if use is None else self._class_of(use)

    def _class_of(self, use: Use) -> int:
        return min(use.base + use.hits, self._top)

    def _priority(self, use: Use) -> Priority:
        # Ties (equal times: one request's blocks, or a frozen test clock) go to the entry pushed
        # first, as in the eager policy the trace replay chose, so its figures still hold.
        return (use.last_use + self._credit[self._class_of(use)], 0.0)

    def _current(self, block: Block) -> Priority:
        use = self._uses.get(block)
        assert use is not None, "a block in the heap has a use record"
        return self._priority(use)

    def _returning(self, key: bytes) -> int:
        """The class a block named ``key`` enters with: new; one above its class when it was
        evicted (stored again: it was wanted after it left); its class when it only moved to
        another tier and back (not a use: a round trip must not earn credit)."""
        ghost = self._ghost.get(key)
        if ghost is None:
            return 0
        cls, moved = ghost
        return cls if moved else min(cls + 1, self._top)

    def catch_up(self) -> None:
        pass   # nothing put off

    def learned(self) -> dict[str, float]:
        return {}

    def resume(self, learned: Mapping[str, float]) -> None:
        pass   # fixed weights: nothing learned

    def admit(self, key: bytes, full: bool) -> bool:
        if not full:
            return True
        victim = self._heap.peek()
        if victim is None:
            return True  # nothing to compare with; the caller finds no room by itself
        prio = self._heap.priority(victim)
        assert prio is not None
        return self._clock() + self._credit[self._returning(key)] >= prio[0]

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        now = self._clock()
        if reuses is not None:
            assert len(reuses) == len(blocks), "one reuse count per block"
        bases: list[int] = []
        for i, block in enumerate(blocks):
            base = self._returning(block.key)
            if reuses is not None and reuses[i] > base:   # moved here: its reuses in the other tier count
                base = reuses[i]   # all of them, past the top class: they go back with it (lfu counts on)
            self._ghost.pop(block.key, None)
            bases.append(base)
        top = self._top
        track_stored(self._heap, self._uses, blocks, now, bases, self._priority, share=lambda b: min(b, top))

    def reuses(self, block: Block) -> int | None:
        return self._uses.reuses(block)

    def pending_hits(self, block: Block) -> int:
        return self._uses.pending_hits(block)

    def hit(self, blocks: Sequence[Block]) -> None:
        self._uses.hit(blocks, self._clock())  # untracked blocks (not stored through this policy) are skipped

    def removed(self, block: Block, moved: bool = False) -> None:
        use = self._uses.forget(block)
        if use is not None and self._ghost_entries:
            ghost = self._ghost
            ghost[block.key] = (self._class_of(use), moved)
            ghost.move_to_end(block.key)
            while len(ghost) > self._ghost_entries:
                ghost.popitem(last=False)
        self._heap.discard(block)

    def victim(self) -> Block | None:
        return self._heap.peek()
