"""The load board: each node's queue, as seconds of prefill work ahead of a new request.

A report (from the node's daemon or engine) sets it; the requests routed since add their
predicted prefill; time drains it at one second per second. So several router replicas agree
as of each report and each only adds its own routing in between.
"""

from __future__ import annotations

from collections.abc import Callable


class LoadBoard:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._clock = clock
        self._backlog: dict[str, tuple[float, float]] = {}   # node -> (seconds, as of)

    def queue_s(self, node: str) -> float:
        seconds, at = self._backlog.get(node, (0.0, 0.0))
        return max(0.0, seconds - (self._clock() - at))

    def report(self, node: str, queued_s: float) -> None:
        """``node`` has ``queued_s`` seconds of prefill work queued or running now."""
        self._backlog[node] = (max(0.0, queued_s), self._clock())

    def routed(self, node: str, seconds: float) -> None:
        """A request predicted to take ``seconds`` of prefill was sent to ``node``."""
        self._backlog[node] = (self.queue_s(node) + max(0.0, seconds), self._clock())

    def forget(self, node: str) -> None:
        self._backlog.pop(node, None)
