"""Prefix index, leaf-only LRU order and the slot allocator."""

from __future__ import annotations

import tracemalloc

import pytest

from kvstored.index import SEALED, PrefixIndex
from kvstored.policy.eviction import LRUOrder
from kvstored.tiers.dram import SlotAllocator, slot_size


def _chain(index: PrefixIndex, keys: list[bytes], parent=None, seal: bool = True):  # type: ignore[no-untyped-def]
    out = []
    for i, k in enumerate(keys):
        parent = index.insert(k, parent, offset=i * 64)
        if seal:
            parent.flags = SEALED
            parent.pins = 0
        out.append(parent)
    return out


def test_match_longest_sealed_prefix() -> None:
    idx = PrefixIndex(1)
    blocks = _chain(idx, [b"a", b"b", b"c"])
    assert idx.match([b"a", b"b", b"x", b"c"]) == blocks[:2]
    assert idx.match([b"z"]) == []
    blocks[2].flags = 0
    assert idx.match([b"a", b"b", b"c"]) == blocks[:2]  # reserved blocks are invisible
    blocks[2].flags = SEALED
    blocks[2].offset = -1
    assert idx.match([b"a", b"b", b"c"]) == blocks[:2]  # so are hollow ones (bytes lost)


def test_remove_interior_block_is_refused() -> None:
    idx = PrefixIndex(1)
    a, b = _chain(idx, [b"a", b"b"])
    with pytest.raises(AssertionError, match="orphan"):
        idx.remove(a)
    idx.remove(b)
    idx.remove(a)
    assert len(idx) == 0


def test_lru_victims_are_leaves_least_recent_first() -> None:
    idx = PrefixIndex(1)
    lru = LRUOrder()
    a, b, c = _chain(idx, [b"a", b"b", b"c"])
    d, = _chain(idx, [b"d"])
    for blk in (c, b, a, d):  # a chain touched deepest first, then d
        lru.touch(blk)
    assert [v.key for v in lru.victims()] == [b"c", b"d"]  # a and b have children
    idx.remove(c)
    lru.discard(c)
    assert [v.key for v in lru.victims()] == [b"b", b"d"]
    b.pins = 1  # leased blocks are never victims
    assert [v.key for v in lru.victims()] == [b"d"]
    lru.touch(d)
    assert len(lru) == 3


def test_allocator_pages_are_per_size_and_return_when_empty() -> None:
    alloc = SlotAllocator(capacity=4 * 4096, page_bytes=4096)
    small = [alloc.alloc(1024) for _ in range(4)]
    assert None not in small and len({o // 4096 for o in small}) == 1  # one page
    big = [alloc.alloc(4096) for _ in range(3)]
    assert None not in big
    assert alloc.alloc(4096) is None and alloc.alloc(1024) is None
    for off in small:
        alloc.free(off)  # type: ignore[arg-type]
    assert alloc.alloc(4096) is not None  # the emptied page went back to the pool
    assert alloc.used_bytes == 4 * 4096


def test_slot_size_alignment() -> None:
    assert slot_size(1) == 64 and slot_size(64) == 64 and slot_size(65) == 128


def test_index_memory_per_block() -> None:
    """DESIGN target: at most 300 bytes of index per cached block (measured at 200k blocks)."""
    n = 200_000
    keys = [i.to_bytes(32, "big") for i in range(n)]  # allocated before measuring: hashes arrive anyway
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(1)
    lru = LRUOrder()
    parent = None
    for i, k in enumerate(keys):
        parent = idx.insert(k, parent if i % 64 else None, offset=i * 2_097_152)
        parent.flags = SEALED
        lru.touch(parent)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_block = (used + 65 * n) / n  # count the 32-byte key objects too
    assert per_block <= 300, f"{per_block:.0f} bytes per block"


def test_touch_run_splices_a_contiguous_chain_and_keeps_order() -> None:
    idx = PrefixIndex(1)
    lru = LRUOrder()
    a = _chain(idx, [b"a0", b"a1", b"a2", b"a3"])
    b = _chain(idx, [b"b0", b"b1"])
    for blk in reversed(a):
        lru.touch(blk)
    for blk in reversed(b):
        lru.touch(blk)
    lru.touch_run(list(reversed(a[:3])))  # a hit of a0..a2: contiguous, spliced to the end
    assert [x.key for x in lru.oldest()] == [b"a3", b"b1", b"b0", b"a2", b"a1", b"a0"]
    lru.touch_run([b[1], a[3], b[0]])  # not contiguous: touched one by one, same result
    assert [x.key for x in lru.oldest()] == [b"a2", b"a1", b"a0", b"b1", b"a3", b"b0"]
    assert len(lru) == 6
