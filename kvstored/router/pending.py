"""Chains this router sent to a node that the node's events do not show yet: the blocks a request
will have stored there once its prefill is done. Counting them keeps the next turn of a
conversation, arriving while the last one is still queued, on the node that will hold its
history (the events come only after the prefill). Each entry lapses after ``ttl_s`` past the
predicted end of its prefill: by then the events have said what the node kept.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt


class PendingChains:
    def __init__(self, clock: Callable[[], float], ttl_s: float = 2.0) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._keys: dict[str, dict[int, float]] = {}   # node -> key -> lapses at

    def sent(self, node: str, keys: npt.NDArray[np.uint64], prefill_s: float) -> None:
        """A chain (its index keys) went to ``node``, its prefill predicted to take ``prefill_s``
        after the node's queue (included in ``prefill_s`` by the caller)."""
        until = self._clock() + prefill_s + self._ttl
        held = self._keys.setdefault(node, {})
        for key in keys.tolist():
            held[key] = until

    def prefix(self, node: str, keys: npt.NDArray[np.uint64]) -> int:
        """How many leading keys of the chain this router sent to ``node`` and have not lapsed."""
        held = self._keys.get(node)
        if not held:
            return 0
        now = self._clock()
        n = 0
        for key in keys.tolist():
            until = held.get(key)
            if until is None or until < now:
                break
            n += 1
        return n

    def expire(self) -> None:
        """Forget the lapsed entries (called now and then: lookups skip them anyway)."""
        now = self._clock()
        for node, held in list(self._keys.items()):
            live = {k: t for k, t in held.items() if t >= now}
            if live:
                self._keys[node] = live
            else:
                del self._keys[node]
