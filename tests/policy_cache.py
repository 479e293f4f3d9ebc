"""A one-tier cache around an eviction policy, driven as the trace replay drives one: look a chain
up (a hit is recorded), admit, evict leaves until there is room, store what missed; one second of
the injected clock per access. For the policies' own tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from clock import Clock

from kvstored.index import Block, PrefixIndex
from kvstored.policy.one_tier import store_chain


def zero_clock() -> Clock:
    """A hand-moved clock that starts at 0 (the policies' tests count seconds from there)."""
    clock = Clock()
    clock.now = 0.0
    return clock


class PolicyCache:
    """``make(clock, capacity)`` builds the policy under test."""

    def __init__(self, capacity: int, make: Callable[[Clock, int], Any]) -> None:
        self.clock = zero_clock()
        self.index = PrefixIndex(1)
        self.policy = make(self.clock, capacity)
        self.capacity = capacity

    def access(self, key: bytes) -> bool:
        """Look up or store the one-block chain ``key``; whether it hit."""
        return self.chain([key]) == 1

    def chain(self, keys: Sequence[bytes]) -> int:
        """Look up ``keys`` (a hit is recorded), store what missed; the blocks that hit."""
        self.clock.now += 1.0
        hits = self.index.match(keys)
        if hits:
            self.policy.hit(hits)
        store_chain(self.index, self.policy, keys, hits, self.capacity)
        return len(hits)

    def eviction_order(self) -> list[bytes]:
        """Evict every block the policy will give up, one victim at a time; their keys in order."""
        order = []
        while (victim := self.policy.victim()) is not None:
            order.append(victim.key)
            self.index.remove(victim)
            self.policy.removed(victim)
        return order

    def block(self, key: bytes) -> Block:
        block = self.index.get(key)
        assert block is not None
        return block


def assert_fresh_policy_is_lru(cache: PolicyCache) -> None:
    """A learning policy that has learned nothing (a cache of 4 blocks, fresh) evicts and admits
    as leaf-only LRU: a block reused twice is still the first to go once four newer ones came."""
    assert cache.policy.scale == 0.0
    cache.access(b"r")
    cache.access(b"r")          # reused: credit would keep it over newer blocks
    for key in (b"a", b"b", b"c"):
        cache.access(key)
    assert cache.policy.admit(b"d", full=True)   # LRU admits everything
    assert cache.policy.victim() is cache.block(b"r")   # the least recent, reused or not


def scan_polluted_loop(cache: PolicyCache, rounds: int, start: int = 0) -> list[int]:
    """Ten hot keys, then thirty keys seen once, per round (the scan alone overflows a cache of
    20 under LRU); the hot keys' hits per round."""
    hot_hits = []
    for r in range(start, start + rounds):
        hot_hits.append(sum(cache.access(b"hot%d" % i) for i in range(10)))
        for i in range(30):
            cache.access(b"scan%d/%d" % (r, i))
    return hot_hits
