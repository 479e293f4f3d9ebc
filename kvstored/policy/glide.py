"""Glide: ``duel``'s shadow caches, with the live tier's credit scale moved gradually, not switched.

``duel`` replays a sample of chains through two shadow caches (leaf-only LRU and ``credit``), each
scoring the prefill its hits save, and switches the tier to the scale of the shadow ahead. Its
misses came from the switch: on a short chat trace one long prompt that only the LRU shadow kept
(a few hundred blocks, weighing more than all else in the window) flipped a tier whose content
had been built under credit, and the tier then lost what neither order would have. Here the
leader is chosen as in ``duel`` (another shadow must lead by the margin), but the tier's scale
only moves towards the leader's by ``step`` per sampled access (``DEFAULT_STEP``: all the way
from LRU to ``credit`` in 1,000 sampled accesses, half the scores' window): a brief lead moves
the order a little, a lasting one all the way. A fresh policy is LRU.

Everything else is ``duel``'s: the sample, the shadows, the memory (BENCHMARKS.md section 3e), and
``adaptive``'s order and admission at the current scale. Decisions stay pure: block metadata, the
calls it is told about and the injected clock in, a victim out; no randomness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstored.index import Block
from kvstored.policy.duel import CANDIDATES, DEFAULT_MARGIN, DEFAULT_WINDOW, DuelPolicy
from kvstored.policy.leafheap import index_leaf

# Chosen on the generated shapes (tools.workloads, seed 0, and their 1,500-request traces),
# checked on seeds 1-2 and the conversation trace: BENCHMARKS.md section 3e.
DEFAULT_STEP = 0.001   # scale moved per sampled access: LRU to credit in 1,000 of them


class GlidePolicy(DuelPolicy):
    """Leaf-only eviction by ``last use + scale * credit(reuse class)`` and ``credit``'s
    admission at that scale, the scale gliding towards the candidate whose sampled shadow saves
    most (by ``step`` per sampled access).

    ``clock`` gives seconds (monotonic); ``ghost_entries`` bounds the remembered departed keys;
    ``capacity_blocks`` sizes the shadows; ``can_evict`` and ``lane`` as for ``adaptive``; the
    rest (``defer`` included) as for ``duel``.
    """

    name = "glide"

    def __init__(self, clock: Callable[[], float], ghost_entries: int, capacity_blocks: int,
                 can_evict: Callable[[Block], bool] = index_leaf, *, lane: int = 0,
                 candidates: Sequence[float] = CANDIDATES, window: float = DEFAULT_WINDOW,
                 margin: float = DEFAULT_MARGIN, step: float = DEFAULT_STEP, defer: bool = False,
                 observed: bool = False) -> None:
        if step <= 0:
            raise ValueError("need step > 0")
        super().__init__(clock, ghost_entries, capacity_blocks, can_evict, lane=lane, candidates=candidates,
                         window=window, margin=margin, defer=defer, observed=observed)
        self._step = step

    @property
    def target(self) -> float:
        """The leading candidate's scale, which the tier's scale is moving towards."""
        return self._candidates[self._leader]

    def _steer(self, target: float) -> None:
        scale = self.scale
        if scale < target:
            self.scale = min(target, scale + self._step)
        elif scale > target:
            self.scale = max(target, scale - self._step)
