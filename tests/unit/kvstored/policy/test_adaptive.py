"""The adaptive policy: LRU until its ghost hits say reuse predicts return, credit while they do,
back to LRU when they stop; its decisions are a function of what it was told and the clock."""

from __future__ import annotations

import pytest

from kvstored.index import SEALED, Block, PrefixIndex
from kvstored.policy.adaptive import AdaptivePolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cache:
    """A one-tier cache of single-block prompts driven as the trace replay drives a policy: look
    up, admit, evict leaves until there is room, store; one second per access."""

    def __init__(self, capacity: int, window: float = 200.0) -> None:
        self.clock = FakeClock()
        self.index = PrefixIndex(1)
        self.policy = AdaptivePolicy(self.clock, ghost_entries=3 * capacity, window=window)
        self.capacity = capacity

    def access(self, key: bytes) -> bool:
        """Look ``key`` up (a hit is recorded) or store it; whether it hit."""
        self.clock.now += 1.0
        hits = self.index.match([key])
        if hits:
            self.policy.hit(hits)
            return True
        if not self.policy.admit(key, len(self.index) >= self.capacity):
            return False
        while len(self.index) >= self.capacity:
            victim = self.policy.victim()
            assert victim is not None and victim.evictable
            self.index.remove(victim)
            self.policy.removed(victim)
        block = self.index.insert(key, None, 0)
        block.flags |= SEALED
        block.pins -= 1
        self.policy.inserted([block])
        return False

    def block(self, key: bytes) -> Block:
        block = self.index.get(key)
        assert block is not None
        return block


def scan_polluted_loop(cache: Cache, rounds: int, start: int = 0) -> list[int]:
    """Ten hot keys, then thirty keys seen once, per round (the scan alone overflows a cache of
    20 under LRU); the hot keys' hits per round."""
    hot_hits = []
    for r in range(start, start + rounds):
        hot_hits.append(sum(cache.access(b"hot%d" % i) for i in range(10)))
        for i in range(30):
            cache.access(b"scan%d/%d" % (r, i))
    return hot_hits


def test_a_fresh_policy_is_lru() -> None:
    cache = Cache(4)
    assert cache.policy.scale == 0.0
    cache.access(b"r")
    cache.access(b"r")          # reused: credit would keep it over newer blocks
    for key in (b"a", b"b", b"c"):
        cache.access(key)
    assert cache.policy.admit(b"d", full=True)   # LRU admits everything
    assert cache.policy.victim() is cache.block(b"r")   # the least recent, reused or not


def test_it_converges_to_frequency_on_a_scan_polluted_loop() -> None:
    cache = Cache(20)
    hits = scan_polluted_loop(cache, 40)
    assert hits[:3] == [0, 0, 0]     # as LRU: the scan flushes the hot keys every round
    assert cache.policy.scale > 0.5  # their returns from the ghost list taught it that reuse pays
    assert hits[-10:] == [10] * 10   # and now the scan no longer flushes them


def test_it_converges_back_to_recency_when_reuse_stops_predicting_return() -> None:
    cache = Cache(20)
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
    cache = Cache(2, window=1e9)
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
        cache = Cache(20)
        scan_polluted_loop(cache, 12)
        order = []
        while (victim := cache.policy.victim()) is not None:
            order.append(victim.key)
            cache.index.remove(victim)
            cache.policy.removed(victim)
        return order

    assert run() == run()


def test_bad_parameters_are_refused() -> None:
    for kwargs in ({"tau_s": 0.0}, {"class_weights": (1.0, 0.5)}, {"window": 0.0}, {"prior": 0.0},
                   {"unit_ratio": 1.0}, {"max_scale": -1.0}):
        with pytest.raises(ValueError):
            AdaptivePolicy(FakeClock(), 8, **kwargs)  # type: ignore[arg-type]
