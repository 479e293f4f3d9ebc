"""Adaptive credit: ``credit``'s order with the credit scaled by a weight learned from ghost hits.

The default before ``glide`` (which runs this order at a scale set by shadow replay instead).
``credit`` (last use + ``tau * ln w(reuse class)``) wins where reused blocks
come back more often than new ones (the conversation trace) and loses where they do not (agent
loops, drifting documents): there it keeps finished work for minutes and refuses the new blocks
that come back seconds later. Here a leaf's priority is

    last use (s) + scale * tau * ln(weight of its reuse class)

with ``scale`` in ``[0, max_scale]``: 0 is leaf-only LRU (and admits everything), 1 is ``credit``.
The scale is learned online from the policy's own ghost hits. Every block that leaves (evicted,
moved to another tier, or refused at admission) is remembered in a bounded ghost list with its
side: new (never hit) or reused. A key that comes back while its ghost is remembered was wanted
after it left. Per side the policy keeps decayed counts of departures and of such returns (over
about ``window`` departures); the scale is ``ln(ratio) / ln(unit_ratio)``, where ``ratio`` is how
much more often a departed reused block comes back than a departed new one (0 when it does not):
credit is given as far as reuse predicts return among the blocks the cache is letting go. A
block that only moved to another tier and back counts as a return when it was used meanwhile
(brought up by a hit), not when the other tier merely handed it back. ``prior`` pseudo-returns
per side (at one in ten departures) keep the ratio near 1, hence the scale near LRU, until the
evidence is in: a fresh policy starts as LRU.

Decisions stay pure: block metadata, the hits and departures it is told about and an injected
clock in, a victim out; no randomness. Leaf-only, as every policy here (``can_evict``). A fall of
the scale leaves priorities in the heap too high; the heap is recomputed once the scale has moved
by 5% and as many blocks have come and gone as it holds (O(1) amortised).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from kvstored.index import Block
from kvstored.policy.credit import DEFAULT_CLASS_WEIGHTS, DEFAULT_TAU_S
from kvstored.policy.interface import OwnAccessesOnly
from kvstored.policy.lanes import Lane
from kvstored.policy.leafheap import Priority, index_leaf

# Chosen on the generated shapes (tools.workloads, seed 0), checked on other seeds and the
# conversation trace: BENCHMARKS.md section 3b.
DEFAULT_MAX_SCALE = 2.0
DEFAULT_WINDOW = 20_000.0     # departures the return rates are averaged over
DEFAULT_PRIOR = 5.0           # pseudo-returns per side
DEFAULT_UNIT_RATIO = 1.7      # a ratio this high gives credit's own scale (its class-1 weight)

# ghost record: reuse class in the low bits, then how it left
_CLASS = (1 << 4) - 1
_MOVED = 1 << 4       # only moved to another tier (its return is no reuse)
_REFUSED = 1 << 5     # never stored: refused at admission
_LEARNED = 1 << 6     # its return already counted (seen at admission, then stored)


def learned_value(learned: Mapping[str, float], name: str, default: float) -> float:
    """``learned[name]`` if it is a finite number >= 0 (what a policy's records hold), else
    ``default``: a record written by another version or damaged is not taken on trust."""
    value = learned.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return default
    return float(value)


class AdaptivePolicy(OwnAccessesOnly):
    """Leaf-only eviction by ``last use + scale * credit(reuse class)``, the scale learned from
    ghost hits; admission as ``credit`` at the current scale.

    ``clock`` gives seconds (monotonic); ``ghost_entries`` bounds the remembered departed keys
    (about three times the tier's capacity in blocks); ``can_evict`` is the tier's predicate for
    "may leave now" (see :mod:`kvstored.policy.leafheap`); ``lane``: where on the blocks its
    records live (:mod:`kvstored.policy.lanes`; one per tier: DRAM 0, SSD 1).
    """

    name = "adaptive"

    def __init__(self, clock: Callable[[], float], ghost_entries: int, tau_s: float = DEFAULT_TAU_S,
                 class_weights: Sequence[float] = DEFAULT_CLASS_WEIGHTS,
                 can_evict: Callable[[Block], bool] = index_leaf, *,
                 max_scale: float = DEFAULT_MAX_SCALE, window: float = DEFAULT_WINDOW,
                 prior: float = DEFAULT_PRIOR, unit_ratio: float = DEFAULT_UNIT_RATIO, lane: int = 0) -> None:
        if tau_s <= 0 or not class_weights or min(class_weights) < 1 or ghost_entries < 0:
            raise ValueError("tau_s must be positive, class weights >= 1, ghost_entries not negative")
        if max_scale < 0 or window < 1 or prior <= 0 or unit_ratio <= 1:
            raise ValueError("need max_scale >= 0, window >= 1, prior > 0 and unit_ratio > 1")
        self._clock = clock
        self._credit = [tau_s * math.log(w) for w in class_weights]
        self._top = len(class_weights) - 1
        self._max_scale = max_scale
        self._decay = 1 - 1 / window
        self._prior = prior
        self._unit = math.log(unit_ratio)
        self.scale = 0.0                  # learned; read it to see where the policy stands
        self._dep = [0.0, 0.0]            # decayed departures: new, reused
        self._ret = [0.0, 0.0]            # decayed returns of those
        self._built_scale = 0.0           # the scale the heap's priorities were computed at
        self._since_build = 0
        self._heap = self._lane(lane, can_evict)
        # Two generations of departed keys (hash -> record), each up to ghost_entries: a bounded
        # FIFO of small ints without per-entry links; the older half is dropped whole.
        self._ghost: dict[int, int] = {}
        self._old_ghost: dict[int, int] = {}
        self._ghost_entries = ghost_entries

    def _lane(self, lane: int, can_evict: Callable[[Block], bool]) -> Lane:
        """The records and the heap of leaves (a subclass may order them more ways)."""
        return Lane(lane, self._priority, can_evict)

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, block: object) -> bool:
        return block in self._heap

    def reuse_class(self, block: Block) -> int | None:
        """0 = never hit since stored (or since it came back), up to ``len(class_weights) - 1``."""
        reuses = self._heap.reuses(block)
        return None if reuses is None else min(reuses, self._top)

    def _priority(self, last_use: float, reuses: int) -> float:
        return last_use + self.scale * self._credit[min(reuses, self._top)]

    def _current(self, block: Block) -> Priority:
        return self._heap.current(block)

    # -- the ghost list and learning ---------------------------------------------------------

    def set_ghost_entries(self, entries: int) -> None:
        """Remember up to ``entries`` departed keys per generation from now on."""
        self._ghost_entries = max(0, entries)

    def _ghost_get(self, key: bytes) -> int | None:
        h = hash(key)
        rec = self._ghost.get(h)
        return self._old_ghost.get(h) if rec is None else rec

    def _ghost_put(self, key: bytes, rec: int) -> None:
        if not self._ghost_entries:
            return
        ghost = self._ghost
        ghost[hash(key)] = rec
        if len(ghost) >= self._ghost_entries:
            self._old_ghost, self._ghost = ghost, {}

    def _ghost_pop(self, key: bytes) -> int | None:
        h = hash(key)
        rec = self._ghost.pop(h, None)
        old = self._old_ghost.pop(h, None)
        return old if rec is None else rec

    def _departed(self, cls: int) -> None:
        side = 1 if cls else 0
        d = self._decay
        self._dep[0] *= d
        self._dep[1] *= d
        self._ret[0] *= d
        self._ret[1] *= d
        self._dep[side] += 1.0

    def _learn(self, rec: int) -> None:
        """A departed key came back: count it for its side and set the scale from the sides'
        return rates."""
        self._ret[1 if rec & _CLASS else 0] += 1.0
        dep, ret, prior = self._dep, self._ret, self._prior
        ratio = ((ret[1] + prior) / (dep[1] + 10 * prior)) / ((ret[0] + prior) / (dep[0] + 10 * prior))
        self.scale = min(math.log(ratio) / self._unit, self._max_scale) if ratio > 1 else 0.0

    def _returning(self, rec: int | None) -> int:
        """The class a block whose ghost record is ``rec`` enters with (see ``credit``)."""
        if rec is None or rec & _REFUSED:
            return 0
        cls = rec & _CLASS
        return cls if rec & _MOVED else min(cls + 1, self._top)

    def _settle(self) -> None:
        """Recompute the heap once the scale has drifted since it was built, at most once per
        ``len`` departures and arrivals (O(1) amortised): a lower scale leaves reused blocks'
        priorities too high until then, a higher one is caught as entries surface."""
        if abs(self.scale - self._built_scale) < 0.05 * self._built_scale or self._since_build < len(self._heap):
            return
        self._heap.reprioritise()
        self._built_scale = self.scale
        self._since_build = 0

    # -- BlockPolicy ---------------------------------------------------------------------------

    def catch_up(self) -> None:
        pass   # nothing put off (a subclass with shadows may)

    def learned(self) -> dict[str, float]:
        return {"scale": self.scale, "departed_new": self._dep[0], "departed_reused": self._dep[1],
                "returned_new": self._ret[0], "returned_reused": self._ret[1]}

    def resume(self, learned: Mapping[str, float]) -> None:
        for i, side in enumerate(("new", "reused")):
            self._dep[i] = learned_value(learned, f"departed_{side}", self._dep[i])
            self._ret[i] = learned_value(learned, f"returned_{side}", self._ret[i])
        self.scale = self._built_scale = min(learned_value(learned, "scale", self.scale), self._max_scale)

    def admit(self, key: bytes, full: bool) -> bool:
        rec = self._ghost_get(key)
        if rec is not None and not rec & (_LEARNED | _MOVED):
            self._learn(rec)
            self._ghost[hash(key)] = rec | _LEARNED   # its storing must not count it again
        if not full:
            return True
        self._settle()
        if not self.scale:
            return True   # LRU admits everything: a newcomer is never older than the victim
        victim = self._heap.peek()
        if victim is None:
            return True  # nothing to compare with; the caller finds no room by itself
        prio = self._current(victim)
        cls = self._returning(rec)
        if self._clock() + self.scale * self._credit[cls] >= prio[0]:
            return True
        if rec is None:
            self._departed(cls)
            self._ghost_put(key, cls | _REFUSED)
        return False

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        now = self._clock()
        if reuses is not None:
            assert len(reuses) == len(blocks), "one reuse count per block"
        bases: list[int] = []
        for i, block in enumerate(blocks):
            rec = self._ghost_pop(block.key)
            if rec is not None and not rec & _LEARNED and (
                    not rec & _MOVED or (reuses is not None and reuses[i] > rec & _CLASS)):
                self._learn(rec)   # a move back counts only if it was used meanwhile (a promotion by a hit)
            base = self._returning(rec)
            if reuses is not None and reuses[i] > base:   # moved here: its reuses in the other tier count
                base = reuses[i]
            bases.append(base)
        self._since_build += len(blocks)
        self._settle()
        self._heap.stored(blocks, now, bases)

    def reuses(self, block: Block) -> int | None:
        return self._heap.reuses(block)

    def pending_hits(self, block: Block) -> int:
        return self._heap.pending_hits(block)

    def hit(self, blocks: Sequence[Block]) -> None:
        self._heap.hit(blocks, self._clock())

    def removed(self, block: Block, moved: bool = False) -> None:
        reuses = self._heap.forget(block)
        if reuses is not None:
            cls = min(reuses, self._top)
            self._departed(cls)
            self._ghost_put(block.key, cls | (_MOVED if moved else 0))
            self._since_build += 1

    def victim(self) -> Block | None:
        return self._heap.peek()
