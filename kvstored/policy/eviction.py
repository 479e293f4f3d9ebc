"""Recency order for the blocks of one tier (LRU), leaf-aware.

Recency is an intrusive doubly linked list through the blocks (two pointers each, no per-block
container entry). Callers touch a hit prefix deepest block first, so a parent is always more
recent than its children and the least recent blocks are leaves of the resident tree; the
store's eviction still checks each candidate, so a broken ordering can never orphan a block.
A chain's blocks usually sit side by side in the list (they were stored and hit together), so
``touch_run`` moves such a run to the recent end in one splice: exact LRU at a pointer check per
block rather than a relink.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstored.index import Block


class LRUOrder:
    """Recency list; head = least recently used."""

    __slots__ = ("_head", "_len", "_tail")

    def __init__(self) -> None:
        self._head: Block | None = None
        self._tail: Block | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _unlink(self, block: Block) -> None:
        prev, nxt = block.lru_prev, block.lru_next
        if prev is None:
            self._head = nxt
        else:
            prev.lru_next = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.lru_prev = prev
        block.lru_prev = block.lru_next = None
        self._len -= 1

    def _append(self, block: Block) -> None:
        block.lru_prev = self._tail
        block.lru_next = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.lru_next = block
        self._tail = block
        self._len += 1

    def contains(self, block: Block) -> bool:
        return block.lru_prev is not None or self._head is block

    def touch(self, block: Block) -> None:
        """Mark ``block`` most recently used (adds it if absent)."""
        if self.contains(block):
            self._unlink(block)
        self._append(block)

    def touch_run(self, run: list[Block]) -> None:
        """``touch`` each block of ``run`` in order (the last ends most recent); one splice when
        the run is already contiguous in the list in that order."""
        if len(run) > 2 and self.contains(run[0]):
            prev = run[0]
            for block in run[1:]:
                if block.lru_prev is not prev:
                    break
                prev = block
            else:
                first, last = run[0], run[-1]
                if last is self._tail:
                    return
                # unlink [first..last] ...
                before, after = first.lru_prev, last.lru_next
                if before is None:
                    self._head = after
                else:
                    before.lru_next = after
                assert after is not None, "a run that is not at the tail has a successor"
                after.lru_prev = before
                # ... and append it
                first.lru_prev = self._tail
                assert self._tail is not None, "non-empty list without a tail"
                self._tail.lru_next = first
                last.lru_next = None
                self._tail = last
                return
        for block in run:
            self.touch(block)

    def discard(self, block: Block) -> None:
        if self.contains(block):
            self._unlink(block)

    def oldest(self) -> Iterator[Block]:
        """Blocks from least to most recently used; safe against removal of the yielded block."""
        block = self._head
        while block is not None:
            nxt = block.lru_next
            yield block
            block = nxt

    def victims(self) -> Iterator[Block]:
        """Blocks that may leave the index now, least recently used first."""
        return (b for b in self.oldest() if b.evictable)
