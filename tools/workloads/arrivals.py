"""Requests and sessions in time: sessions start as a Poisson process; a trace is the first N
requests of all sessions merged by arrival."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass

from tools.workloads.blocks import Segment


@dataclass(frozen=True, slots=True)
class Request:
    time: float                   # arrival, seconds
    prompt: tuple[Segment, ...]
    output: int                   # tokens generated


# A shape's session source: given its start time, a session's requests (each at or after it).
Sessions = Callable[[float], list[Request]]


def arrivals(rng: random.Random, sessions: Sessions, rate: float, n: int) -> list[Request]:
    """The first ``n`` requests, by arrival, of sessions starting at ``rate`` per second.

    Sessions are drawn in order of start until ``n`` requests are known to arrive before the next
    start: no later session can then add one among the first ``n``."""
    if rate <= 0:
        raise ValueError("the arrival rate must be positive")
    drawn: list[Request] = []
    pending: list[float] = []    # arrivals after the last start, as a heap
    before = 0                   # requests known to arrive before the current start
    t = 0.0
    while before < n:
        t += rng.expovariate(rate)
        while pending and pending[0] <= t:
            heapq.heappop(pending)
            before += 1
        if before >= n:
            break
        for request in sessions(t):
            drawn.append(request)
            heapq.heappush(pending, request.time)
    drawn.sort(key=lambda r: r.time)   # stable: ties keep the order they were drawn in
    return drawn[:n]
