"""The duel policy: LRU until its shadow caches show that credit saves more, credit while it does,
back to LRU when it stops; a large tier replays a sample of whole chains; its decisions are a
function of what it was told and the clock."""

from __future__ import annotations

import pytest
from policy_cache import PolicyCache, assert_fresh_policy_is_lru, scan_polluted_loop, zero_clock

from kvstored.policy.duel import DuelPolicy
from kvstored.policy.registry import make_policy


def new_cache(capacity: int, **kwargs: float) -> PolicyCache:
    """A one-tier cache under the duel policy."""
    return PolicyCache(capacity, lambda clock, n: DuelPolicy(clock, ghost_entries=3 * n, capacity_blocks=n,
                                                             **kwargs))  # type: ignore[arg-type]


def test_a_fresh_policy_is_lru() -> None:
    assert_fresh_policy_is_lru(new_cache(4))


def test_it_takes_credit_when_its_shadow_saves_more_on_a_scan_polluted_loop() -> None:
    cache = new_cache(20, window=50.0)
    hits = scan_polluted_loop(cache, 30)
    assert hits[:2] == [0, 0]        # as LRU: the scan flushes the hot keys every round
    assert cache.policy.scale == 1.0
    lru, credit = cache.policy.scores
    assert credit > lru              # the credit shadow kept the hot keys, the LRU shadow did not
    assert hits[-10:] == [10] * 10   # and now the live tier keeps them too


def test_it_goes_back_to_recency_when_credit_stops_paying() -> None:
    cache = new_cache(20, window=50.0)
    scan_polluted_loop(cache, 30)
    assert cache.policy.scale == 1.0
    # The hot keys are never used again; each new key comes back once, 8 keys later (LRU keeps
    # them all), which the old hot keys' credit prevents for a while.
    second_hits = []
    for i in range(600):
        cache.access(b"new%d" % i)
        if i >= 8:
            second_hits.append(cache.access(b"new%d" % (i - 8)))
    assert cache.policy.scale == 0.0
    assert all(second_hits[-100:])


def test_a_large_tier_replays_a_sample_of_whole_chains() -> None:
    small = DuelPolicy(zero_clock(), 0, capacity_blocks=1000)
    assert small.sample_rate == 1             # smaller than a shadow's minimum: every chain, exactly
    large = make_policy("duel", zero_clock(), 1_000_000)
    assert isinstance(large, DuelPolicy) and large.sample_rate == 64
    # At one chain in four, chains of eight blocks behind one shared system-prompt block: the
    # chains below it are sampled one by one (not all or none by their common root), and the
    # policy learns from the sample that credit keeps the hot chains through the scans.
    cache = new_cache(80, min_shadow=20)
    assert cache.policy.sample_rate == 4
    hot = [[b"sys", *(b"hot%d/%d" % (c, i) for i in range(7))] for c in range(5)]
    for r in range(40):
        for chain in hot:
            cache.chain(chain)
        for c in range(15):
            cache.chain([b"sys", *(b"scan%d/%d/%d" % (r, c, i) for i in range(7))])
    assert any(cache.policy.scores)
    assert cache.policy.scale == 1.0
    assert sum(cache.chain(chain) for chain in hot) == 40


def test_decisions_depend_only_on_what_it_was_told() -> None:
    def run() -> list[bytes]:
        cache = new_cache(20, window=50.0)
        scan_polluted_loop(cache, 12)
        return cache.eviction_order()

    assert run() == run()


def test_bad_parameters_are_refused() -> None:
    for kwargs in ({"candidates": ()}, {"candidates": (-1.0, 1.0)}, {"min_shadow": 0}, {"max_rate": 0},
                   {"window": 0.0}, {"margin": -0.1}):
        with pytest.raises(ValueError):
            DuelPolicy(zero_clock(), 8, capacity_blocks=8, **kwargs)  # type: ignore[arg-type]
