"""Durations of waits, counted in buckets as a Prometheus histogram counts them (seconds)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# upper bounds, seconds: a wait for the write-back is a few milliseconds to a few seconds
BOUNDS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class WaitSnapshot:
    """``counts[i]``: waits of at most ``bounds[i]`` seconds (not cumulative); the last count is
    the waits above every bound. ``sum_s``: their total."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class WaitHistogram:
    """Waits observed so far, bucketed by :data:`BOUNDS_S`."""

    def __init__(self, bounds: tuple[float, ...] = BOUNDS_S) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> WaitSnapshot:
        return WaitSnapshot(self._bounds, tuple(self._counts), self._sum)
