"""The glide policy: LRU until its shadow caches show that credit saves more, then a scale that
moves towards credit a step per sampled access (not at once), and back when recency leads; its
decisions are a function of what it was told and the clock."""

from __future__ import annotations

import pytest
from policy_cache import PolicyCache, assert_fresh_policy_is_lru, scan_polluted_loop, zero_clock

from kvstored.index import Block
from kvstored.policy.glide import GlidePolicy
from kvstored.policy.registry import make_policy


def new_cache(capacity: int, **kwargs: float) -> PolicyCache:
    """A one-tier cache under the glide policy."""
    return PolicyCache(capacity, lambda clock, n: GlidePolicy(clock, ghost_entries=3 * n, capacity_blocks=n,
                                                              **kwargs))  # type: ignore[arg-type]


def test_a_fresh_policy_is_lru() -> None:
    assert_fresh_policy_is_lru(new_cache(4))


def test_the_scale_moves_towards_credit_a_step_at_a_time_and_then_keeps_the_hot_keys() -> None:
    cache = new_cache(20, window=50.0, step=0.01)
    scales = []
    for r in range(60):
        scan_polluted_loop(cache, 1, start=r)
        scales.append(cache.policy.scale)
    assert cache.policy.target == 1.0            # the credit shadow leads
    assert 0.0 < scales[2] < 1.0                 # a lead moves it part of the way first
    assert scales == sorted(scales)              # then further, never back, while it lasts
    assert cache.policy.scale == 1.0
    assert scan_polluted_loop(cache, 5, start=60) == [10] * 5   # the live tier keeps the hot keys


def test_a_brief_lead_moves_the_order_only_a_little() -> None:
    """A duel would switch the whole tier to credit on the first lead; here a lead that ends
    soon leaves the scale low, and it goes back to LRU."""
    cache = new_cache(20, window=50.0, step=0.001)
    scan_polluted_loop(cache, 3)
    assert cache.policy.target == 1.0
    assert 0.0 < cache.policy.scale < 0.2
    # The hot keys are never used again; each new key comes back once, 8 keys later (LRU keeps
    # them all, credit does not while the old hot keys hold their credit).
    for i in range(600):
        cache.access(b"new%d" % i)
        if i >= 8:
            cache.access(b"new%d" % (i - 8))
    assert cache.policy.target == 0.0
    assert cache.policy.scale == 0.0


def test_it_goes_back_to_recency_when_credit_stops_paying() -> None:
    cache = new_cache(20, window=50.0, step=0.01)
    scan_polluted_loop(cache, 60)
    assert cache.policy.scale == 1.0
    second_hits = []
    for i in range(1500):
        cache.access(b"new%d" % i)
        if i >= 8:
            second_hits.append(cache.access(b"new%d" % (i - 8)))
    assert cache.policy.target == 0.0 and cache.policy.scale == 0.0
    assert all(second_hits[-100:])


def test_the_registry_builds_it_with_duels_sample() -> None:
    large = make_policy("glide", zero_clock(), 1_000_000)
    assert isinstance(large, GlidePolicy) and large.sample_rate == 64 and large.scale == 0.0


def test_decisions_depend_only_on_what_it_was_told() -> None:
    def run() -> list[bytes]:
        cache = new_cache(20, window=50.0, step=0.01)
        scan_polluted_loop(cache, 12)
        return cache.eviction_order()

    assert run() == run()


def test_bad_parameters_are_refused() -> None:
    for kwargs in ({"step": 0.0}, {"step": -0.1}, {"candidates": ()}, {"window": 0.0}, {"margin": -0.1}):
        with pytest.raises(ValueError):
            GlidePolicy(zero_clock(), 8, capacity_blocks=8, **kwargs)  # type: ignore[arg-type]


def test_a_deferred_policy_decides_as_an_immediate_one_and_replays_its_shadows_when_asked() -> None:
    """``defer`` (the store's) puts a call's shadow replay off until ``catch_up`` or the next
    call: the scale does not move in the call that caused it, and every decision is the same."""
    immediate = new_cache(20, window=50.0, step=0.001)
    deferred = new_cache(20, window=50.0, step=0.001, defer=True)
    assert scan_polluted_loop(immediate, 3) == scan_polluted_loop(deferred, 3)
    assert 0.0 < immediate.policy.scale < 1.0   # still moving: each sampled access moves it
    deferred.policy.catch_up()
    before = deferred.policy.scale
    assert before == immediate.policy.scale
    immediate.access(b"scan-more")
    deferred.access(b"scan-more")
    assert deferred.policy.scale == before < immediate.policy.scale   # the replay waits
    deferred.clock.now += 1000.0   # caught up later, it replays the access at its own time
    deferred.policy.catch_up()
    deferred.clock.now -= 1000.0
    assert deferred.policy.scale == immediate.policy.scale and deferred.policy.scores == immediate.policy.scores
    deferred.access(b"one-more")   # not caught up: the next call replays first
    immediate.access(b"one-more")
    assert deferred.policy.learned() == immediate.policy.learned()
    assert scan_polluted_loop(immediate, 3, start=10) == scan_polluted_loop(deferred, 3, start=10)
    assert deferred.policy.scores == immediate.policy.scores
    assert deferred.eviction_order() == immediate.eviction_order()


def test_a_put_off_access_is_replayed_in_the_shadows_at_its_own_time() -> None:
    """Caught up long after, an access still enters the shadows as used when it happened: a
    shadow of 2 blocks then evicts it before a block used after it, as the immediate one does."""
    def run(defer: bool) -> tuple[float, ...]:
        cache = new_cache(2, defer=defer)
        for key in (b"a", b"b", b"c"):
            cache.access(key)
        cache.clock.now += 1000.0
        cache.policy.catch_up()
        cache.clock.now -= 1000.0
        for key in (b"a", b"d", b"c"):
            cache.access(key)
        return cache.policy.scores
    assert run(defer=True) == run(defer=False)


class _Mirrored:
    """A policy whose own hits and stores are also told to it as the whole store's (``seen_hit``,
    ``seen_stored``): what a lower tier's policy hears when every access reaches it."""

    def __init__(self, policy: GlidePolicy) -> None:
        self._policy = policy

    def __getattr__(self, name: str) -> object:
        return getattr(self._policy, name)

    def __len__(self) -> int:
        return len(self._policy)

    def hit(self, blocks: list[Block]) -> None:
        self._policy.hit(blocks)
        self._policy.seen_hit(blocks)

    def inserted(self, blocks: list[Block], reuses: list[int] | None = None) -> None:
        self._policy.inserted(blocks, reuses)
        self._policy.seen_stored(blocks)


def test_an_observed_policy_learns_from_the_stores_accesses_not_its_own() -> None:
    """A lower tier's own accesses are what the tiers above missed: with ``observed`` its shadows
    are fed only what it is told the whole store saw, and learn from that as a one-tier policy
    learns from its own."""
    alone = new_cache(20, window=50.0, step=0.01, observed=True)
    scan_polluted_loop(alone, 60)
    assert alone.policy.scores == (0.0, 0.0) and alone.policy.scale == 0.0   # its own accesses: nothing
    told = new_cache(20, window=50.0, step=0.01, observed=True)
    told.policy = _Mirrored(told.policy)
    plain = new_cache(20, window=50.0, step=0.01)
    assert scan_polluted_loop(told, 60) == scan_polluted_loop(plain, 60)
    assert told.policy.scale == plain.policy.scale == 1.0
    assert told.policy.scores == plain.policy.scores


def test_resize_sizes_the_shadows_to_the_tier_as_measured() -> None:
    policy = make_policy("glide", zero_clock(), 1024)
    assert isinstance(policy, GlidePolicy) and policy.shadow_capacity == 1024
    policy.resize(7550)
    assert policy.shadow_capacity == 7550
