"""Eviction/admission policies: leaf-only under random operations, LRU/LFU order, reuse credit."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_cache import PolicyCache, scan_polluted_loop

from kvstored.index import SEALED, Block, PrefixIndex
from kvstored.policy.classic import LFUPolicy, LRUPolicy
from kvstored.policy.credit import DEFAULT_TAU_S, CreditPolicy
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.one_tier import store_chain
from kvstored.policy.registry import DEFAULT_POLICY, POLICIES, make_policy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(index: PrefixIndex, policy: BlockPolicy, keys: Sequence[bytes]) -> list[Block]:
    """Store a chain as the replay does, in a cache with room for it: match, admit and insert the
    rest, seal, tell the policy; the chain's blocks now cached."""
    store_chain(index, policy, keys, index.match(keys), capacity=sys.maxsize)
    return index.match(keys)


def evict(index: PrefixIndex, policy: BlockPolicy) -> Block | None:
    victim = policy.victim()
    if victim is not None:
        assert victim.evictable and victim.children == 0
        index.remove(victim)
        policy.removed(victim)
    return victim


def drain(index: PrefixIndex, policy: BlockPolicy) -> list[bytes]:
    order = []
    while (victim := evict(index, policy)) is not None:
        order.append(victim.key)
    return order


def _policies() -> list[BlockPolicy]:
    return [make_policy(name, FakeClock(), capacity_blocks=8) for name in POLICIES]


# -- leaf-only, whatever happens -------------------------------------------------------------

_key = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(lambda path: bytes(path))
_op = st.one_of(
    st.tuples(st.just("store"), _key),
    st.tuples(st.just("hit"), _key),
    st.tuples(st.just("pin"), _key),
    st.tuples(st.just("unpin"), _key),
    st.tuples(st.just("abort"), _key),
    st.tuples(st.just("evict"), st.just(b"")),
    st.tuples(st.just("tick"), st.just(b"")),
)


def _chain(path: bytes) -> list[bytes]:
    return [path[: i + 1] for i in range(len(path))]  # a key names its whole prefix


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=60))
def test_victims_are_always_evictable_leaves(name: str, ops: list[tuple[str, bytes]]) -> None:
    clock = FakeClock()
    policy = make_policy(name, clock, capacity_blocks=6)
    index = PrefixIndex(1)
    pinned: list[Block] = []
    keys: set[bytes] = set()
    for op, path in ops:
        clock.now += 7.0
        if op == "store":
            keys.update(_chain(path))
            store(index, policy, _chain(path))
        elif op == "hit":
            hits = index.match(_chain(path))
            if hits:
                policy.hit(hits)
        elif op == "pin" and (block := index.get(path)) is not None and block.flags & SEALED:
            block.pins += 1
            pinned.append(block)
        elif op == "unpin" and pinned:
            pinned.pop().pins -= 1
        elif op == "abort":
            # a reservation under the block of ``path`` that never seals: stored, then dropped
            parent = index.get(path)
            if parent is not None and index.get(path + b"x") is None:
                child = index.insert(path + b"x", parent, 0)
                child.pins -= 1
                index.remove(child)
                policy.removed(child)
        elif op == "evict":
            evict(index, policy)
        resident = [b for b in map(index.get, keys) if b is not None]
        # the policy may refuse to answer only when nothing it tracks can go
        if policy.victim() is None:
            assert not any(b.evictable for b in resident if b in policy)
        for block in resident:
            assert block.parent is None or index.get(block.parent.key) is block.parent  # no orphans
    for block in pinned:
        block.pins -= 1
    drain(index, policy)
    assert len(index) == 0 and len(policy) == 0


# -- LRU and LFU order -------------------------------------------------------------------------

def test_lru_order_least_recent_leaf_first() -> None:
    index, policy = PrefixIndex(1), LRUPolicy()
    store(index, policy, [b"a", b"a2"])
    store(index, policy, [b"b"])
    store(index, policy, [b"c"])
    policy.hit(index.match([b"a", b"a2"]))
    assert drain(index, policy) == [b"b", b"c", b"a2", b"a"]


def test_lru_never_evicts_a_parent_before_its_children() -> None:
    index, policy = PrefixIndex(1), LRUPolicy()
    store(index, policy, [b"p"])
    store(index, policy, [b"q"])
    store(index, policy, [b"p", b"p2"])  # p is older than q, but has a child now
    assert drain(index, policy) == [b"q", b"p2", b"p"]


def test_lfu_order_least_used_first_then_least_recent() -> None:
    index, policy = PrefixIndex(1), LFUPolicy()
    for key in (b"x", b"y", b"z"):
        store(index, policy, [key])
    policy.hit(index.match([b"x"]))
    policy.hit(index.match([b"x"]))
    policy.hit(index.match([b"z"]))
    assert drain(index, policy) == [b"y", b"z", b"x"]


def test_pinned_leaf_is_skipped_until_released() -> None:
    for policy in _policies():
        index = PrefixIndex(1)
        _a, b = store(index, policy, [b"a", b"b"])
        b.pins += 1
        assert policy.victim() is None  # a has a child, b is pinned
        b.pins -= 1
        assert policy.victim() is b


@pytest.mark.parametrize("name", POLICIES)
def test_tier_predicate_and_tier_relative_leaves(name: str) -> None:
    # A DRAM-like tier: a block with a copy elsewhere may leave the tier while its children stay
    # in the index, but never before a child that is resident in this tier.
    copied: set[Block] = set()
    policy = make_policy(name, FakeClock(), 8, can_evict=lambda b: b.pins == 0 and b in copied)
    index = PrefixIndex(1)
    a, b = store(index, policy, [b"a", b"b"])
    assert policy.victim() is None  # nothing has a copy yet
    copied.update((a, b))
    assert policy.victim() is b     # leaf of the tier first
    policy.removed(b)               # b leaves the tier but stays in the index (on the slow tier)
    assert index.get(b"b") is b and policy.victim() is a  # a is now a leaf of this tier
    a.pins += 1
    assert policy.victim() is None
    a.pins -= 1
    assert policy.victim() is a


@pytest.mark.parametrize("name", POLICIES)
def test_a_parent_tracked_after_its_children_is_no_leaf_while_they_are_tracked(name: str) -> None:
    """Reads of one chain coming up from SSD land in batches that finish in any order: a tier
    told of a child before its parent took the parent for a leaf, and the chain's middle left
    DRAM before its tail. Also when the parent leaves the tier and comes back meanwhile."""
    policy = make_policy(name, FakeClock(), 8, can_evict=lambda b: b.pins == 0)
    index = PrefixIndex(1)
    blocks = []
    parent = None
    for key in (b"a", b"b", b"c", b"d", b"e"):
        parent = index.insert(key, parent, 0)
        parent.flags |= SEALED
        parent.pins -= 1
        blocks.append(parent)
    a, b, c, d, e = blocks
    policy.inserted([c, d])      # one reader's batch lands first
    policy.inserted([a, b, e])   # another's (two runs, parent first), b before e
    assert policy.victim() is e
    policy.removed(c)            # c leaves the tier and comes back while d stays
    policy.inserted([c])
    order = []
    while (victim := policy.victim()) is not None:
        order.append(victim.key)
        policy.removed(victim)
    assert order == [b"e", b"d", b"c", b"b", b"a"]


# -- reuse credit ---------------------------------------------------------------------------

def credit(clock: FakeClock, ghost: int = 16) -> CreditPolicy:
    return CreditPolicy(clock, ghost_entries=ghost)


def test_reused_block_outlives_newer_unused_one() -> None:
    clock = FakeClock()
    index, policy = PrefixIndex(1), credit(clock)
    store(index, policy, [b"r"])
    clock.now = 10.0
    policy.hit(index.match([b"r"]))  # reused once: priority 10 + tau*ln(1.7), about 169
    clock.now = 100.0
    store(index, policy, [b"n"])     # never hit: priority 100
    clock.now = 200.0
    store(index, policy, [b"m"])     # priority 200
    assert policy.reuse_class(index.get(b"r")) == 1  # type: ignore[arg-type]
    assert drain(index, policy) == [b"n", b"r", b"m"]


def test_credit_is_leaf_only_even_when_the_parent_ranks_lower() -> None:
    clock = FakeClock()
    index, policy = PrefixIndex(1), credit(clock)
    store(index, policy, [b"p"])
    clock.now = 500.0
    store(index, policy, [b"p", b"c"])  # the child is newer, the parent older: the child goes first
    assert drain(index, policy) == [b"c", b"p"]


def test_ghost_remembers_reuse_class_of_evicted_blocks() -> None:
    clock = FakeClock()
    index, policy = PrefixIndex(1), credit(clock)
    store(index, policy, [b"k"])
    policy.hit(index.match([b"k"]))
    assert drain(index, policy) == [b"k"]
    (k,) = store(index, policy, [b"k"])  # back after an eviction: counted as reused again
    assert policy.reuse_class(k) == 2
    drain(index, policy)
    (k,) = store(index, policy, [b"k"])
    assert policy.reuse_class(k) == 3  # capped at the top class
    # a ghost list of size 0 remembers nothing
    index2, forgetful = PrefixIndex(1), credit(clock, ghost=0)
    store(index2, forgetful, [b"k"])
    drain(index2, forgetful)
    (k2,) = store(index2, forgetful, [b"k"])
    assert forgetful.reuse_class(k2) == 0


def test_admission_refuses_newcomers_below_the_victim() -> None:
    clock = FakeClock()
    index, policy = PrefixIndex(1), credit(clock)
    store(index, policy, [b"hot"])
    policy.hit(index.match([b"hot"]))
    policy.hit(index.match([b"hot"]))  # class 2: priority 0 + tau*ln(2.9), about 319 s
    assert policy.admit(b"new", full=False)  # free room is always used
    assert not policy.admit(b"new", full=True)  # it would have to evict a block worth more
    clock.now = DEFAULT_TAU_S * math.log(2.9) + 1.0
    assert policy.admit(b"new", full=True)  # the credit has run out
    # a block coming back from the ghost list enters with its earned class
    clock.now = 0.0
    store(index, policy, [b"old"])
    policy.hit(index.match([b"old"]))
    policy.hit(index.match([b"old"]))
    index.remove(old := index.get(b"old"))  # type: ignore[arg-type]
    policy.removed(old)  # type: ignore[arg-type]
    assert policy.admit(b"old", full=True)  # class 3 credit (ln 4) beats the victim's (ln 2.9)


def test_admission_when_nothing_can_be_evicted() -> None:
    policy = credit(FakeClock())
    assert policy.admit(b"x", full=True)  # nothing to compare with; the caller finds no room


def test_credit_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        CreditPolicy(FakeClock(), ghost_entries=1, tau_s=0)
    with pytest.raises(ValueError):
        CreditPolicy(FakeClock(), ghost_entries=1, class_weights=(1.0, 0.0))


def test_registry() -> None:
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert make_policy(name, FakeClock(), 10).name == name
    with pytest.raises(ValueError, match="known: lru, lfu, credit, adaptive"):
        make_policy("fifo", FakeClock(), 10)


@pytest.mark.parametrize("name", POLICIES)
def test_a_policy_tracking_long_chains_costs_little_memory_per_block(name: str) -> None:
    """Was: every block of a stored chain left a heap entry that went stale as its child came in
    (~100 B each, up to four per tracked block before a rebuild), and each block had a priority
    object of its own: 443 B of policy records per block under credit, 675 B with the index."""
    import gc
    import tracemalloc

    index = PrefixIndex(1)
    chains = []
    for c in range(10):   # ten 32k-token prompts of 2,048 blocks
        parent = None
        chain = []
        for i in range(2048):
            parent = index.insert(f"{c}/{i}".encode(), parent, 0)
            parent.flags |= SEALED
            parent.pins = 0
            chain.append(parent)
        chains.append(chain)
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        policy = make_policy(name, FakeClock(), capacity_blocks=len(index))
        for chain in chains:
            policy.inserted(chain)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_block = (after - before) / len(index)
    assert len(policy) == len(index)
    assert per_block < 300, f"{name}: {per_block:.0f} B of policy records per block"
    order = drain(index, policy)   # every victim a leaf (drain checks), the oldest chain's first
    assert len(order) == 10 * 2048 and order[0] == b"0/2047"


# -- what a policy learned, across a restart ------------------------------------------------

@pytest.mark.parametrize("name", POLICIES)
def test_a_policy_resumed_from_what_another_learned_orders_as_it_did(name: str) -> None:
    """``learned`` is what the SSD tier keeps at a stop; a fresh policy ``resume``d from it has
    learned the same, so a restarted tier keeps the hot keys of a scan-polluted loop from its
    third round on, where a fresh learner (LRU at first) loses them for longer; damaged or foreign entries
    change nothing."""
    def cache() -> PolicyCache:
        return PolicyCache(20, lambda clock, n: make_policy(name, clock, n))
    taught = cache()
    scan_polluted_loop(taught, 60)
    state = taught.policy.learned()
    assert all(isinstance(v, float) and math.isfinite(v) for v in state.values())
    fresh, resumed = cache(), cache()
    before = resumed.policy.learned()
    resumed.policy.resume({k: math.nan for k in state} | {"unknown": 1.0})
    resumed.policy.resume({k: "1" for k in state})
    assert resumed.policy.learned() == before
    resumed.policy.resume(state)
    assert resumed.policy.learned() == state
    if state:   # the policies that learn: they had moved towards credit
        assert state != before
        assert scan_polluted_loop(fresh, 3) == [0, 0, 0]
        assert scan_polluted_loop(resumed, 3) == [0, 0, 10]   # (a hot key earns credit by its first reuse)


@pytest.mark.parametrize("name", POLICIES)
def test_blocks_stored_at_one_moment_go_least_reused_first(name: str) -> None:
    """A restart restores every block at one moment with the reuse count its record kept: the
    leaves nobody reused leave before the reused ones, under every policy (LRU's tie included)."""
    index, policy = PrefixIndex(0), make_policy(name, FakeClock(), capacity_blocks=8)
    leaves = []
    for i, reuses in enumerate((2, 0, 5, 1)):
        block = index.insert(b"leaf%d" % i, None, 0)
        block.flags |= SEALED
        block.pins = 0
        leaves.append((reuses, block.key, block))
    policy.inserted([b for _, _, b in leaves], [r for r, _, _ in leaves])
    assert drain(index, policy) == [key for _, key, _ in sorted(leaves, key=lambda e: e[0])]
