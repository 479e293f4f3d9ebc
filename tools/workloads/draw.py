"""The random draws the shapes are made of; every one takes the generator it draws from."""

from __future__ import annotations

import bisect
import itertools
import math
import random


def lognormal(rng: random.Random, median: float, sigma: float, low: int = 1, high: int | None = None) -> int:
    """A log-normal integer with the given median and log-space sigma, clipped to [low, high]."""
    value = round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))
    value = max(low, value)
    return value if high is None else min(high, value)


def lognormal_s(rng: random.Random, median: float, sigma: float) -> float:
    """A log-normal duration in seconds with the given median and log-space sigma."""
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


class Zipf:
    """Ranks 0..n-1 drawn with probability proportional to 1 / (rank + 1) ** s."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise ValueError("Zipf needs at least one rank")
        self._cumulative: list[float] = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))

    def __len__(self) -> int:
        return len(self._cumulative)

    def share(self, top: int) -> float:
        """The probability that a draw is one of the ``top`` first ranks."""
        return self._cumulative[min(top, len(self)) - 1] / self._cumulative[-1]

    def draw(self, rng: random.Random) -> int:
        # bisect_right can land on len() only when random() rounds up to the total; clamp
        return min(bisect.bisect_right(self._cumulative, rng.random() * self._cumulative[-1]), len(self) - 1)


class Labels:
    """Fresh content labels, shared by every shape of one trace so that no two contents collide."""

    def __init__(self) -> None:
        self._next = 0

    def new(self) -> int:
        self._next += 1
        return self._next - 1


def geometric(rng: random.Random, mean: float) -> int:
    """A geometric count >= 1 with the given mean (1 when ``mean`` <= 1)."""
    if mean <= 1:
        return 1
    # inverse CDF of the number of trials up to the first success, success probability 1 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / mean))
