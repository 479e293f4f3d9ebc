"""Policy records kept on the block itself, and a heap of leaves over them: no per-block dicts.

A dict entry costs ~42 B a block and a record object ~70 B more, which put the default policy's
records at ~190 B a block beside the index's ~270 B. Here each :class:`~kvstored.index.Block`
carries two slots per *lane* (``lane0_t``/``lane0_n``, ``lane1_t``/``lane1_n``): a lane is one
tier's policy (DRAM's is lane 0, SSD's lane 1), and a block is tracked by at most one policy per
tier. ``t`` is the block's last use (seconds; a float shared by every block of one store or
lookup), ``n`` packs which policy of the lane tracks it (a tag: a DRAM tier has one policy per
slot size), how many tracked children hang under it, the reuses it came in with and its hits: a
small int (cached by Python, so free) for the common block (tracked, one child, no reuses).
Semantics as :mod:`kvstored.policy.usage` (hits recorded on the deepest tracked block of a
prefix, folded into the parent when it stops being tracked) and
:mod:`kvstored.policy.leafheap` (only tracked leaves in the heap, lazy deletion, ties to the block
reused less, then to the entry pushed first, ``can_evict`` decides whether a candidate may go now).

A lane may order its leaves more than one way (``orders``: a policy that weighs experts against
each other, each with its own order over the same records): one heap per order, each fed the same
leaves; ``peek(order)`` and ``current(block, order)`` name the order (0 by default).

One difference: a block may sit in the heap more than once (it stops being a leaf and becomes one
again before its old entry surfaces); the entry that surfaces first stands for it, the others are
dropped when they surface after it left, and a rebuild keeps one each.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable, Sequence

from kvstored.index import Block
from kvstored.policy.leafheap import Priority, index_leaf

# n: tracked (1 bit) | the tracking policy's tag (6 bits) | tracked children (24 bits) | reuses
# carried in (8 bits, capped) | hits. A tracked leaf of tag <= 63 with one child or none is < 256.
_TRACKED = 1
_TAG_SHIFT = 1
_TAGS = 63
_KIDS_SHIFT = 7
_KIDS_MASK = (1 << 24) - 1
_KID = 1 << _KIDS_SHIFT
_BASE_SHIFT = 31
_BASE_MAX = (1 << 8) - 1
_HITS_SHIFT = 39
_HIT = 1 << _HITS_SHIFT
_OWNER = (1 << _KIDS_SHIFT) - 1   # tracked bit and tag
LANES = 2
_next_tag = [itertools.count() for _ in range(LANES)]


class Lane:
    """The per-block records of one tier's policy, on the blocks, and the heap of its leaves.

    ``priority(last_use, reuses)`` orders the leaves (least first); it may change over time (a
    learned weight): :meth:`reprioritise` then recomputes the heap. ``can_evict``: may a tracked
    leaf go now (default: it may leave the index). ``orders``: more priorities over the same
    leaves, orders 1, 2, ... (a heap each; their priorities must not fall over time).
    """

    __slots__ = ("_can_evict", "_get_n", "_get_t", "_heap", "_heaps", "_n_name", "_orders", "_owner",
                 "_priority", "_seq", "_t_name", "_tracked")

    def __init__(self, lane: int, priority: Callable[[float, int], float],
                 can_evict: Callable[[Block], bool] = index_leaf,
                 orders: Sequence[Callable[[float, int], float]] = ()) -> None:
        if not 0 <= lane < LANES:
            raise ValueError(f"lane must be in 0..{LANES - 1}")
        # which policy of the lane tracks a block (a DRAM tier has one per slot size): tags go
        # round, so two policies share one only 63 policies apart on the same lane
        self._owner = _TRACKED | (next(_next_tag[lane]) % _TAGS + 1) << _TAG_SHIFT
        self._t_name = f"lane{lane}_t"
        self._n_name = f"lane{lane}_n"
        self._get_t = operator.attrgetter(self._t_name)
        self._get_n = operator.attrgetter(self._n_name)
        self._priority = priority
        self._can_evict = can_evict
        self._orders = (priority, *orders)
        self._heaps: list[list[tuple[Priority, int, Block]]] = [[] for _ in self._orders]
        self._heap = self._heaps[0]
        self._seq = itertools.count()
        self._tracked = 0

    def __len__(self) -> int:
        return self._tracked

    def __contains__(self, block: object) -> bool:
        return isinstance(block, Block) and self._get_n(block) & _OWNER == self._owner

    # -- records ------------------------------------------------------------------------------

    def reuses(self, block: Block) -> int | None:
        n = self._get_n(block)
        if n & _OWNER != self._owner:
            return None
        return (n >> _BASE_SHIFT & _BASE_MAX) + (n >> _HITS_SHIFT)

    def pending_hits(self, block: Block) -> int:
        n = self._get_n(block)
        return n >> _HITS_SHIFT if n & _OWNER == self._owner else 0

    def last_use(self, block: Block) -> float | None:
        return self._get_t(block) if self._get_n(block) & _OWNER == self._owner else None

    def current(self, block: Block, order: int = 0) -> Priority:
        """A tracked block's priority now (in ``order``); of two equal ones the block reused less
        goes first (blocks restored at one moment, with the reuse counts their records kept)."""
        n = self._get_n(block)
        reuses = (n >> _BASE_SHIFT & _BASE_MAX) + (n >> _HITS_SHIFT)
        return (self._orders[order](self._get_t(block), reuses), float(reuses))

    def stored(self, blocks: Sequence[Block], now: float, bases: Sequence[int]) -> None:
        """Track ``blocks`` (a parent's run before its children's, any order across runs), stored
        or brought in at ``now`` with ``bases[i]`` reuses; a re-tracked block starts afresh."""
        t_name, n_name, get_n, owner = self._t_name, self._n_name, self._get_n, self._owner
        for block, base in zip(blocks, bases, strict=True):
            n = get_n(block)
            if not n & _TRACKED:
                self._tracked += 1
                parent = block.parent
                if parent is not None:
                    setattr(parent, n_name, get_n(parent) + _KID)
            else:
                assert n & _OWNER == owner, "a block tracked by two policies of one lane"
            kids = n & (_KIDS_MASK << _KIDS_SHIFT)
            setattr(block, t_name, now)
            setattr(block, n_name, owner | kids | min(base, _BASE_MAX) << _BASE_SHIFT)
        for block in blocks:
            if not get_n(block) & (_KIDS_MASK << _KIDS_SHIFT):
                self._push(block)

    def hit(self, blocks: Sequence[Block], now: float) -> None:
        """A lookup hit ``blocks`` (a parent-first prefix): recorded on the deepest tracked one."""
        get_n = self._get_n
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            n = get_n(block)
            if n & _OWNER == self._owner:
                setattr(block, self._t_name, now)
                setattr(block, self._n_name, n + _HIT)
                return

    def forget(self, block: Block) -> int | None:
        """Stop tracking ``block``; its hits (and their time) fold into its tracked parent, and
        the parent becomes a candidate once its last tracked child is gone. Returns the block's
        reuses (None when it was not tracked)."""
        n = self._get_n(block)
        if n & _OWNER != self._owner:
            return None
        self._tracked -= 1
        setattr(block, self._n_name, n & (_KIDS_MASK << _KIDS_SHIFT))   # its own children still count
        hits = n >> _HITS_SHIFT
        parent = block.parent
        if parent is not None:
            pn = self._get_n(parent)
            assert pn & (_KIDS_MASK << _KIDS_SHIFT), "a tracked child was not counted under its parent"
            pn -= _KID
            if hits and pn & _OWNER == self._owner:
                pn += hits << _HITS_SHIFT
                t = self._get_t(block)   # with hits, its last use is its last hit
                if t > self._get_t(parent):
                    setattr(parent, self._t_name, t)
            setattr(parent, self._n_name, pn)
            if pn & _OWNER == self._owner and not pn & (_KIDS_MASK << _KIDS_SHIFT):
                self._push(parent)
        return (n >> _BASE_SHIFT & _BASE_MAX) + hits

    # -- the heap -----------------------------------------------------------------------------

    def _leaf(self, block: Block) -> bool:
        n = self._get_n(block)
        return n & _OWNER == self._owner and not n & (_KIDS_MASK << _KIDS_SHIFT)

    def _push(self, block: Block) -> None:
        for order, heap in enumerate(self._heaps):
            heapq.heappush(heap, (self.current(block, order), next(self._seq), block))
        if len(self._heap) > 4 * self._tracked + 1024:
            self.reprioritise()

    def peek(self, order: int = 0) -> Block | None:
        """The tracked leaf of least priority (in ``order``) that may go now, or None. Does not
        remove it."""
        heap = self._heaps[order]
        held: list[tuple[Priority, int, Block]] = []
        found: Block | None = None
        while heap:
            prio, _, block = heap[0]
            if not self._leaf(block):
                heapq.heappop(heap)   # untracked, or no leaf any more
                continue
            current = self.current(block, order)
            if current != prio:       # used since pushed, or the weights moved: back in at its place
                heapq.heapreplace(heap, (current, next(self._seq), block))
                continue
            if self._can_evict(block):
                found = block
                break
            held.append(heapq.heappop(heap))   # pinned, unsealed or being written: keep for later
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def reprioritise(self) -> None:
        """Rebuild the heaps: one entry per tracked leaf, at its current priority (O(heap))."""
        for order, heap in enumerate(self._heaps):
            seen: set[Block] = set()
            entries = []
            for _, seq, block in heap:
                if block not in seen and self._leaf(block):
                    seen.add(block)
                    entries.append((self.current(block, order), seq, block))
            heapq.heapify(entries)
            self._heaps[order] = entries
        self._heap = self._heaps[0]
