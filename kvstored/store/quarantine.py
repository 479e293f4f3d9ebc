"""Quarantine: DRAM slots whose writer may still be copying into them, kept out of use for a grace
period before they are free."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvstored.store.dram_residency import DramResidency


class Quarantine:
    """Slots held by no block (allocated, unbound) until ``grace_s`` after :meth:`hold`; then
    :meth:`release_due` frees them. A client learns that its session ended (or that its
    reservation expired) after the daemon does, and one of its threads may be copying rows into
    the slots it held meanwhile: given to another block at once, that copy would land on it."""

    def __init__(self, dram: DramResidency, clock: Callable[[], float], grace_s: float) -> None:
        self._dram = dram
        self._clock = clock
        self._grace_s = grace_s
        self.bytes = 0   # of the slots held
        self._held: deque[tuple[float, int, list[int]]] = deque()   # (free at, slot bytes, offsets)

    def hold(self, slot_bytes: int, offsets: Iterable[int]) -> None:
        """Keep the slots at ``offsets`` (of ``slot_bytes``, unbound) out of use for the grace period."""
        kept = sorted(offsets)
        if kept:
            self._held.append((self._clock() + self._grace_s, slot_bytes, kept))
            self.bytes += slot_bytes * len(kept)

    def release_due(self) -> int:
        """Free the slots whose grace period is over; how many."""
        now, freed = self._clock(), 0
        while self._held and self._held[0][0] <= now:
            _, slot_bytes, offsets = self._held.popleft()
            self.bytes -= slot_bytes * len(offsets)
            for offset in offsets:
                self._dram.free_unbound(offset)
            freed += len(offsets)
        return freed

    def slots(self) -> list[tuple[int, int]]:
        """(offset, slot bytes) of every slot held."""
        return [(offset, sb) for _, sb, offsets in self._held for offset in offsets]
