"""Policies by name, as the configuration names them; ``DEFAULT_POLICY`` is the one that held up
best across the replayed workloads (``python -m tools.trace_replay``, BENCHMARKS.md section 3e)."""

from __future__ import annotations

from collections.abc import Callable

from kvstored.index import Block
from kvstored.policy.adaptive import AdaptivePolicy
from kvstored.policy.classic import LFUPolicy, LRUPolicy
from kvstored.policy.credit import CreditPolicy
from kvstored.policy.duel import DuelPolicy
from kvstored.policy.glide import GlidePolicy
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.leafheap import index_leaf
from kvstored.policy.lecar import LecarPolicy

POLICIES = ("lru", "lfu", "credit", "adaptive", "duel", "lecar", "glide")
DEFAULT_POLICY = "glide"
GHOST_PER_BLOCK = 3  # ghost entries per block of capacity, for the policies that keep ghosts


def make_policy(name: str, clock: Callable[[], float], capacity_blocks: int,
                can_evict: Callable[[Block], bool] = index_leaf, lane: int = 0, defer: bool = False,
                observed: bool = False) -> BlockPolicy:
    """A fresh policy for one tier holding about ``capacity_blocks`` blocks; ``clock`` in seconds;
    ``can_evict``: may a tracked leaf leave this tier now (default: it may leave the index);
    ``lane``: the tier's lane for the policies that keep their records on the blocks (DRAM 0,
    SSD 1: a block is tracked by one policy per lane at most); ``defer``: the work a policy can
    put off until :meth:`~kvstored.policy.interface.BlockPolicy.catch_up` waits for it (a store's);
    ``observed``: the policies that learn from shadow caches (``duel``, ``glide``) feed them the
    whole store's accesses (``seen_hit``, ``seen_stored``), not the tier's own (a lower tier's).

    Raises ValueError naming the known policies for an unknown ``name``.
    """
    if name == "lru":
        return LRUPolicy(can_evict)
    if name == "lfu":
        return LFUPolicy(can_evict)
    if name == "credit":
        return CreditPolicy(clock, ghost_entries=GHOST_PER_BLOCK * max(capacity_blocks, 0),
                            can_evict=can_evict)
    if name == "adaptive":
        return AdaptivePolicy(clock, ghost_entries=GHOST_PER_BLOCK * max(capacity_blocks, 0),
                              can_evict=can_evict, lane=lane)
    if name == "duel":
        return DuelPolicy(clock, ghost_entries=GHOST_PER_BLOCK * max(capacity_blocks, 0),
                          capacity_blocks=capacity_blocks, can_evict=can_evict, lane=lane, defer=defer,
                          observed=observed)
    if name == "lecar":
        return LecarPolicy(clock, ghost_entries=GHOST_PER_BLOCK * max(capacity_blocks, 0),
                           capacity_blocks=capacity_blocks, can_evict=can_evict, lane=lane)
    if name == "glide":
        return GlidePolicy(clock, ghost_entries=GHOST_PER_BLOCK * max(capacity_blocks, 0),
                           capacity_blocks=capacity_blocks, can_evict=can_evict, lane=lane, defer=defer,
                           observed=observed)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
