"""The LeCaR-style policy: the live tier's two experts (LRU, credit) weighed by the misses each
one's evictions caused; a fresh policy is LRU; its decisions are a function of what it was told,
the clock and the injected randomness."""

from __future__ import annotations

import random

import pytest
from policy_cache import PolicyCache, scan_polluted_loop, zero_clock

from kvstored.policy.lecar import CREDIT, RECENCY, LecarPolicy
from kvstored.policy.registry import make_policy


def new_cache(capacity: int, **kwargs: object) -> PolicyCache:
    """A one-tier cache of single-block prompts under the LeCaR-style policy."""
    return PolicyCache(capacity, lambda clock, n: LecarPolicy(clock, ghost_entries=3 * n, capacity_blocks=n,
                                                              **kwargs))  # type: ignore[arg-type]


def test_a_fresh_policy_is_lru() -> None:
    cache = new_cache(4)
    cache.access(b"r")
    cache.access(b"r")          # reused: credit would keep it over newer blocks
    for key in (b"a", b"b", b"c"):
        cache.access(key)
    assert cache.policy.weights == [0.5, 0.5]
    assert cache.policy.admit(b"d", full=True)   # LRU admits everything
    assert cache.policy.victim() is cache.block(b"r")   # the least recent, reused or not


def test_lrus_regrets_hand_the_tier_to_credit_on_a_scan_polluted_loop() -> None:
    cache = new_cache(20)
    hits = scan_polluted_loop(cache, 30)
    assert hits[0] == 0              # as LRU: the scan flushes the hot keys
    credit, recency = cache.policy.weights
    assert credit > recency          # the hot keys LRU let go came back soon after
    assert hits[-10:] == [10] * 10   # and the credit expert keeps them now


def test_credits_regrets_hand_the_tier_back_to_recency() -> None:
    cache = new_cache(20)
    scan_polluted_loop(cache, 30)
    assert cache.policy.weights[CREDIT] > cache.policy.weights[RECENCY]
    # The hot keys are never used again; each new key comes back once, 8 keys later (LRU keeps
    # them all), which the old hot keys' credit prevents for a while.
    second_hits = []
    for i in range(600):
        cache.access(b"new%d" % i)
        if i >= 8:
            second_hits.append(cache.access(b"new%d" % (i - 8)))
    assert cache.policy.weights[RECENCY] > cache.policy.weights[CREDIT]
    assert all(second_hits[-100:])


def test_a_victim_both_experts_would_pick_costs_neither() -> None:
    cache = new_cache(3)
    for key in (b"a", b"b", b"c", b"d"):   # all new: both orders evict the least recent
        cache.access(key)
    cache.access(b"a")                      # comes back: a miss, but no expert's own choice
    assert cache.policy.weights == [0.5, 0.5]


def test_decisions_depend_only_on_what_it_was_told_and_the_injected_draws() -> None:
    def run(seed: int | None) -> list[bytes]:
        cache = new_cache(20, rng=None if seed is None else random.Random(seed).random)
        scan_polluted_loop(cache, 12)
        return cache.eviction_order()

    assert run(1) == run(1)
    assert run(None) == run(None)   # no rng: the heavier expert, deterministically


def test_bad_parameters_are_refused() -> None:
    for kwargs in ({"learning_rate": 0.0}, {"fade": 0.0}, {"fade": 1.0}, {"history": 0.0}):
        with pytest.raises(ValueError):
            LecarPolicy(zero_clock(), 8, 8, **kwargs)  # type: ignore[arg-type]


def test_resumed_weights_stay_positive_and_finite_whatever_the_record_says() -> None:
    """A weight of 0 never comes back (regrets only multiply), and two huge ones summed to inf."""
    for credit, recency in ((0.0, 1.0), (1.0, 0.0), (1e308, 1e308), (3.0, 1.0)):
        policy = make_policy("lecar", zero_clock(), 64)
        policy.resume({"weight_credit": credit, "weight_recency": recency})
        weights = policy.learned()
        w = (weights["weight_credit"], weights["weight_recency"])
        assert all(0 < x <= 1 for x in w) and abs(sum(w) - 1) < 1e-5, (credit, recency, w)
    assert make_policy("lecar", zero_clock(), 64).learned()["weight_credit"] == 0.5
