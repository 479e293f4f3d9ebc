"""LeCaR-style regret: the live tier weighs two experts, leaf-only LRU and credit, by their misses.

``duel`` scores two orders on shadow caches and switches the live tier between them; a tier built
under one order and then run under the other can lose what neither would. Here the live tier
itself is scored (LeCaR, Vietri et al., HotStorage 2018). Its leaves are ordered two ways over
the same records: by last use (leaf-only LRU) and by ``adaptive``'s priority (last use plus a
credit by reuse class times the scale ``adaptive`` learns from its ghost hits; 1, ``credit``'s
own, without ``learn_scale``). Each eviction takes the victim of one expert, drawn by weight (the
heavier one, ties to LRU, or by an injected ``rng``). A victim both experts would pick is no one's
decision; otherwise it goes into the choosing expert's history (``history`` times the tier's
capacity, as the ghost lists) with the time it left. A key stored again while in a history (a
miss that expert caused) moves weight from that expert: the other's is multiplied by
``exp(learning_rate * discount ** age)``, ``age`` the blocks looked up or stored since it left,
the discount fading a regret to ``fade`` over a history's length (LeCaR's 0.45 and 0.005). The
regrets of one request count once per expert (the largest), not once per block of its chain.
Admission is the drawn expert's: LRU takes every block, the credit expert refuses a newcomer
colder than its victim (a refused key that comes back is that expert's regret).

Decisions stay pure: block metadata, the calls it is told about, the injected clock and (when
given) the injected randomness in, a victim out. Time for the regrets is a count of blocks looked
up or stored, not the clock. O(1) per lookup (hits land on the deepest tracked block, as in
``adaptive``); an eviction costs a heap peek in each order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from kvstored.index import Block
from kvstored.policy.adaptive import AdaptivePolicy, learned_value
from kvstored.policy.lanes import Lane
from kvstored.policy.leafheap import index_leaf

# LeCaR's constants (the paper's, not fitted here): BENCHMARKS.md section 3d
DEFAULT_LEARNING_RATE = 0.45
DEFAULT_FADE = 0.005          # a regret's weight after a history's length of accesses
# chosen on the generated shapes (seed 0): histories of 3x the tier's capacity (as the ghost
# lists of credit and adaptive), the credit expert at adaptive's learned scale
DEFAULT_HISTORY = 3.0
_MIN_WEIGHT = 1e-6            # a resumed weight at least this (see resume)
CREDIT, RECENCY = 0, 1        # the experts, and the Lane order each evicts by
_MOVED = 1                    # history record: left for another tier only (its return may be no miss)
_CLASS_SHIFT = 1
_CLASS_MASK = 15
_TIME_SHIFT = 5


class LecarPolicy(AdaptivePolicy):
    """Leaf-only eviction by the victim of the heavier (or randomly drawn) of two experts, LRU and
    ``credit``, weighted by the misses each caused; admission as the drawn expert's.

    ``clock`` gives seconds (monotonic); ``ghost_entries`` bounds the keys remembered for reuse
    classes (as ``adaptive``); ``capacity_blocks`` sizes the histories and the regrets' fading;
    ``can_evict`` and ``lane`` as for ``adaptive``; ``rng``: uniform draws in [0, 1) for a
    randomised choice (None: the heavier expert, ties to LRU); ``history``: each expert's history
    in tier capacities; ``learn_scale``: the credit expert's scale learned as ``adaptive``'s
    (else 1, ``credit``'s own).
    """

    name = "lecar"

    def __init__(self, clock: Callable[[], float], ghost_entries: int, capacity_blocks: int,
                 can_evict: Callable[[Block], bool] = index_leaf, *, lane: int = 0,
                 rng: Callable[[], float] | None = None, learning_rate: float = DEFAULT_LEARNING_RATE,
                 fade: float = DEFAULT_FADE, history: float = DEFAULT_HISTORY,
                 learn_scale: bool = True) -> None:
        if learning_rate <= 0 or not 0 < fade < 1 or history <= 0:
            raise ValueError("need learning_rate > 0, 0 < fade < 1 and history > 0")
        super().__init__(clock, ghost_entries, can_evict=can_evict, lane=lane)
        self._learn_scale = learn_scale
        if not learn_scale:
            self.scale = self._built_scale = 1.0
        self._rng = rng
        self._rate = learning_rate
        self._discount = fade ** (1.0 / max(capacity_blocks * history, 1))
        self.weights = [0.5, 0.5]          # credit, recency; read them to see where it stands
        self._owed = [0.0, 0.0]            # regrets not yet applied (see _pay)
        self._t = 0                        # blocks looked up or stored so far
        self._history_entries = max(int(capacity_blocks * history / 2), 1)
        # per expert, two generations of departed keys (hash -> time << 5 | class << 1 | moved)
        self._history: list[list[dict[int, int]]] = [[{}, {}], [{}, {}]]
        self._draw: int | None = None      # the expert the next eviction follows
        self._chosen: tuple[Block, int] | None = None   # its victim and who chose it (-1: both)

    def _lane(self, lane: int, can_evict: Callable[[Block], bool]) -> Lane:
        return Lane(lane, self._priority, can_evict, orders=(lambda last_use, reuses: last_use,))

    def _learn(self, rec: int) -> None:
        if self._learn_scale:
            super()._learn(rec)

    # -- the experts' histories and weights ----------------------------------------------------

    def _remember(self, expert: int, key: bytes, rec: int) -> None:
        young, _ = gens = self._history[expert]
        young[hash(key)] = rec
        if len(young) >= self._history_entries:
            gens[1], gens[0] = young, {}

    def _regret(self, key: bytes, reuses: int | None = None) -> None:
        """``key`` comes back: if an expert's choice sent it away, move weight from that expert.
        ``reuses``: it moved here from another tier with that many (a block that only moved away
        is a miss when it comes back used, not when merely handed back)."""
        h = hash(key)
        for expert, gens in enumerate(self._history):
            rec = gens[0].pop(h, None)
            old = gens[1].pop(h, None)
            rec = old if rec is None else rec
            if rec is None:
                continue
            if rec & _MOVED and (reuses is None or reuses <= rec >> _CLASS_SHIFT & _CLASS_MASK):
                continue
            regret = self._discount ** (self._t - (rec >> _TIME_SHIFT))
            if regret > self._owed[expert]:
                self._owed[expert] = regret

    def _pay(self) -> None:
        """Apply the regrets owed since the last call: the largest per expert, once, so that a
        request that misses a chain of blocks is one miss, not one per block."""
        owed, w = self._owed, self.weights
        if not owed[0] and not owed[1]:
            return
        for expert in (CREDIT, RECENCY):
            if owed[expert]:
                w[1 - expert] *= math.exp(self._rate * owed[expert])
                owed[expert] = 0.0
        total = w[0] + w[1]
        w[0] /= total
        w[1] /= total

    def _expert(self) -> int:
        """The expert the next eviction follows (drawn once per eviction)."""
        if self._draw is None:
            w_credit, w_recency = self.weights
            if self._rng is None:
                self._draw = CREDIT if w_credit > w_recency else RECENCY
            else:
                self._draw = RECENCY if self._rng() < w_recency else CREDIT
        return self._draw

    # -- BlockPolicy ---------------------------------------------------------------------------

    def learned(self) -> dict[str, float]:
        return {**super().learned(), "weight_credit": self.weights[CREDIT], "weight_recency": self.weights[RECENCY]}

    def resume(self, learned: Mapping[str, float]) -> None:
        if self._learn_scale:
            super().resume(learned)
        credit = learned_value(learned, "weight_credit", self.weights[CREDIT])
        recency = learned_value(learned, "weight_recency", self.weights[RECENCY])
        total = credit + recency
        if 0 < total < math.inf:   # each weight kept off 0: a weight of 0 never comes back
            if abs(total - 1) > 1e-9:
                credit, recency = credit / total, recency / total
            credit, recency = max(credit, _MIN_WEIGHT), max(recency, _MIN_WEIGHT)
            self.weights[CREDIT], self.weights[RECENCY] = credit, recency

    def admit(self, key: bytes, full: bool) -> bool:
        self._regret(key)
        if not full or self._expert() == RECENCY:
            admitted = super().admit(key, False)   # learns from the ghost, takes the block
        else:
            admitted = super().admit(key, True)
        if not admitted:
            self._remember(CREDIT, key, self._t << _TIME_SHIFT)
            self._draw = None
        return admitted

    def inserted(self, blocks: Sequence[Block], reuses: Sequence[int] | None = None) -> None:
        for i, block in enumerate(blocks):
            self._regret(block.key, None if reuses is None else reuses[i])
        self._pay()
        self._t += len(blocks)
        super().inserted(blocks, reuses)

    def hit(self, blocks: Sequence[Block]) -> None:
        self._pay()
        self._t += len(blocks)
        super().hit(blocks)

    def removed(self, block: Block, moved: bool = False) -> None:
        chosen = self._chosen
        if chosen is not None and chosen[0] is block:
            expert = chosen[1]
            if expert >= 0:
                reuses = self._heap.reuses(block)
                cls = min(reuses or 0, _CLASS_MASK)
                self._remember(expert, block.key,
                               self._t << _TIME_SHIFT | cls << _CLASS_SHIFT | (_MOVED if moved else 0))
            self._chosen = None
            self._draw = None
        super().removed(block, moved)

    def victim(self) -> Block | None:
        expert = self._expert()
        mine = self._heap.peek(expert)
        if mine is None:
            return None
        other = self._heap.peek(1 - expert)
        self._chosen = (mine, -1 if other is mine else expert)
        return mine
