"""Policy records on the blocks: each policy of a lane knows its own blocks, the two lanes (tiers)
are independent, and the default policy costs the index a few bytes a block on top of its slots."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from kvstored.index import SEALED, Block, PrefixIndex
from kvstored.policy.lanes import Lane
from kvstored.policy.registry import DEFAULT_POLICY, make_policy


def chain(index: PrefixIndex, prefix: str, n: int) -> list[Block]:
    parent = None
    out = []
    for i in range(n):
        parent = index.insert(f"{prefix}/{i}".encode(), parent, 0)
        parent.flags |= SEALED
        parent.pins = 0
        out.append(parent)
    return out


def test_policies_of_one_lane_know_their_own_blocks_and_lanes_are_independent() -> None:
    index = PrefixIndex(1)
    a, b = chain(index, "a", 2), chain(index, "b", 2)
    def anywhere(block: Block) -> bool:
        return True   # a tier whose blocks have a copy elsewhere: tier-relative leaves may go

    small = Lane(0, lambda t, reuses: t, anywhere)   # e.g. DRAM's policies of two slot sizes
    large = Lane(0, lambda t, reuses: t, anywhere)
    ssd = Lane(1, lambda t, reuses: t, anywhere)
    small.stored(a, 1.0, [0, 0])
    large.stored(b, 2.0, [3, 0])
    ssd.stored(a, 5.0, [7, 7])
    assert all(x in small for x in a) and not any(x in small for x in b)
    assert all(x in large for x in b) and not any(x in large for x in a)
    assert len(small) == len(large) == len(ssd) == 2
    assert small.peek() is a[1] and large.peek() is b[1] and ssd.peek() is a[1]
    assert small.reuses(a[0]) == 0 and ssd.reuses(a[0]) == 7 and large.reuses(b[0]) == 3
    small.hit(a, 9.0)                      # recorded on the deepest block of the prefix
    assert small.pending_hits(a[1]) == 1 and small.pending_hits(a[0]) == 0 and ssd.pending_hits(a[1]) == 0
    assert small.forget(a[1]) == 1         # its hit folds into its parent, which is a leaf now
    assert small.reuses(a[0]) == 1 and small.last_use(a[0]) == 9.0 and small.peek() is a[0]
    assert a[1] in ssd and ssd.reuses(a[0]) == 7   # the other lane saw none of it
    with pytest.raises(ValueError):
        Lane(2, lambda t, reuses: t)


def test_the_default_policy_keeps_its_records_on_the_blocks() -> None:
    """Was: 190 B of dicts and records per block beside the index (461 B together at 1M blocks);
    now the live tier's records are two slots a lane on the block, counted with the index, and
    the default's shadow caches hold a sample of the chains (one in 64 at this size, the largest
    rate), so the policy adds a few bytes a block in all."""
    index = PrefixIndex(1)
    chains = [chain(index, str(c), 64) for c in range(4096)]   # 262,144 blocks: sampled 1 in 64
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        policy = make_policy(DEFAULT_POLICY, lambda: 0.0, capacity_blocks=len(index))
        for c in chains:
            policy.inserted(c)
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(policy) == len(index)
    assert (after - before) / len(index) < 12, f"{(after - before) / len(index):.1f} B per block"
