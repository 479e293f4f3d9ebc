"""Use records of the blocks a heap policy tracks, kept lazily: O(1) per hit, not O(prefix).

A lookup hits a whole prefix, so a hit on a block is a hit on every ancestor too. Recording it on
every block of a 2,048-block prefix costs a Python step per block on the hot path; instead a hit
is recorded once, on the deepest tracked block of the prefix, and reaches each ancestor when the
descendant that holds it stops being tracked (:meth:`UseLog.forget` folds it into the parent).
Only leaves can be evicted, and a block becomes a leaf of the tier exactly when its last tracked
child leaves, so a block's record is complete whenever its priority can matter.

Records only grow (later hits, more hits), so a priority computed from an older record is a lower
bound of the current one: the heap keeps stale entries and re-prioritises one when it surfaces
(see :mod:`kvstored.policy.leafheap`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstored.index import Block

NEVER = float("-inf")


class Use:
    """When a block was stored, its last hit and how many hits it has had (with those of removed
    descendants folded in), and the reuses it entered with (from a ghost, or carried from the tier
it moved from)."""

    __slots__ = ("base", "hits", "last_hit", "stored")

    def __init__(self, stored: float, base: int = 0) -> None:
        self.stored = stored
        self.last_hit = NEVER
        self.hits = 0
        self.base = base

    @property
    def last_use(self) -> float:
        return self.stored if self.stored > self.last_hit else self.last_hit


class UseLog:
    """The use records of the tracked blocks of one tier."""

    __slots__ = ("_uses",)

    def __init__(self) -> None:
        self._uses: dict[Block, Use] = {}

    def __contains__(self, block: object) -> bool:
        return block in self._uses

    def get(self, block: Block) -> Use | None:
        return self._uses.get(block)

    def stored(self, block: Block, now: float, base: int = 0) -> Use:
        """Start a record: ``block`` was stored at ``now`` (a storing is not a hit of its parent)."""
        use = self._uses[block] = Use(now, base)
        return use

    def hit(self, blocks: Sequence[Block], now: float) -> None:
        """A lookup hit ``blocks``, a parent-first prefix: record it on its deepest tracked block.

        Untracked blocks at the end (another tier's) are skipped; ancestors learn of the hit when
        that block is forgotten.
        """
        uses = self._uses
        for i in range(len(blocks) - 1, -1, -1):
            use = uses.get(blocks[i])
            if use is not None:
                use.last_hit = now
                use.hits += 1
                return

    def reuses(self, block: Block) -> int | None:
        """A tracked block's reuses: those it entered with, and its hits (see BlockPolicy.reuses)."""
        use = self._uses.get(block)
        return None if use is None else use.base + use.hits

    def pending_hits(self, block: Block) -> int:
        """The hits on a tracked block not folded into its ancestors yet (0 when untracked)."""
        use = self._uses.get(block)
        return 0 if use is None else use.hits

    def forget(self, block: Block) -> Use | None:
        """Drop ``block``'s record and fold its hits into its parent's, when the parent is
        tracked (each of those hits went through the parent). Returns the dropped record."""
        use = self._uses.pop(block, None)
        if use is not None and use.hits and block.parent is not None:
            parent = self._uses.get(block.parent)
            if parent is not None:
                parent.hits += use.hits
                if use.last_hit > parent.last_hit:
                    parent.last_hit = use.last_hit
        return use
