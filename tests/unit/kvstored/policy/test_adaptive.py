"""The adaptive policy: LRU until its ghost hits say reuse predicts return, credit while they do,
back to LRU when they stop; its decisions are a function of what it was told and the clock."""

from __future__ import annotations

import pytest
from policy_cache import PolicyCache, assert_fresh_policy_is_lru, scan_polluted_loop, zero_clock

from kvstored.policy.adaptive import AdaptivePolicy


def new_cache(capacity: int, window: float = 200.0) -> PolicyCache:
    """A one-tier cache of single-block prompts under the adaptive policy."""
    return PolicyCache(capacity, lambda clock, n: AdaptivePolicy(clock, ghost_entries=3 * n, window=window))


def test_a_fresh_policy_is_lru() -> None:
    assert_fresh_policy_is_lru(new_cache(4))


def test_it_converges_to_frequency_on_a_scan_polluted_loop() -> None:
    cache = new_cache(20)
    hits = scan_polluted_loop(cache, 40)
    assert hits[:3] == [0, 0, 0]     # as LRU: the scan flushes the hot keys every round
    assert cache.policy.scale > 0.5  # their returns from the ghost list taught it that reuse pays
    assert hits[-10:] == [10] * 10   # and now the scan no longer flushes them


def test_it_converges_back_to_recency_when_reuse_stops_predicting_return() -> None:
    cache = new_cache(20)
    scan_polluted_loop(cache, 40)
    assert cache.policy.scale > 0.5
    # The hot keys are never used again; each new key comes back once, 8 keys later (LRU keeps
    # them all: 8 new and 8 reread < 20), which the old hot keys' credit prevents at first.
    second_hits = []
    for i in range(600):
        cache.access(b"new%d" % i)
        if i >= 8:
            second_hits.append(cache.access(b"new%d" % (i - 8)))
    assert cache.policy.scale == 0.0
    assert all(second_hits[-100:])
    assert not all(second_hits[:100])


def test_ghost_hits_move_the_scale_their_way() -> None:
    cache = new_cache(2, window=1e9)
    policy = cache.policy
    cache.access(b"reused")
    cache.access(b"reused")
    cache.access(b"new")
    cache.access(b"x")     # evicts "reused" (least recent): a departure of the reused side
    cache.access(b"y")     # evicts "new": of the new side
    assert policy.scale == 0.0
    cache.access(b"reused")  # a reused block came back from the ghost list: scale up
    up = policy.scale
    assert up > 0
    cache.access(b"new")     # so did a new one (the sides now return alike): scale down again
    assert policy.scale < up


def test_decisions_depend_only_on_what_it_was_told() -> None:
    def run() -> list[bytes]:
        cache = new_cache(20)
        scan_polluted_loop(cache, 12)
        return cache.eviction_order()

    assert run() == run()


def test_bad_parameters_are_refused() -> None:
    for kwargs in ({"tau_s": 0.0}, {"class_weights": (1.0, 0.5)}, {"window": 0.0}, {"prior": 0.0},
                   {"unit_ratio": 1.0}, {"max_scale": -1.0}):
        with pytest.raises(ValueError):
            AdaptivePolicy(zero_clock(), 8, **kwargs)  # type: ignore[arg-type]
