"""Prefix index and the slot allocator."""

from __future__ import annotations

import tracemalloc

import pytest

from kvstored.index import HIT, NO_SLOT, ON_SSD, PROMOTING, SEALED, PrefixIndex
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


def test_match_marking_agrees_with_match_and_marks_only_the_prefix() -> None:
    idx = PrefixIndex(1)
    blocks = _chain(idx, [b"a", b"b", b"c", b"d"])
    found = idx.match_marking([b"a", b"b", b"c", b"d"], HIT)
    assert found.blocks == blocks and found.settled
    assert all(b.flags == SEALED | HIT for b in blocks)
    for b in blocks:
        b.flags = SEALED
    blocks[2].flags = 0   # reserved: the prefix ends before it, and nothing after it is marked
    found = idx.match_marking([b"a", b"b", b"c", b"d"], HIT)
    assert found.blocks == idx.match([b"a", b"b", b"c", b"d"]) == blocks[:2]
    assert [b.flags & HIT for b in blocks] == [HIT, HIT, 0, 0]
    blocks[2].flags = SEALED
    blocks[3].offset = NO_SLOT   # hollow: neither in DRAM nor on SSD
    assert idx.match_marking([b"a", b"b", b"c", b"d"], 0).blocks == blocks[:3]
    assert idx.match_marking([b"a", b"x", b"c"], 0).blocks == blocks[:1]   # a key not cached
    assert idx.match_marking([], HIT).blocks == []


def test_match_marking_settled_only_when_every_block_is_in_dram_unpromoted() -> None:
    idx = PrefixIndex(1)
    blocks = _chain(idx, [b"a", b"b", b"c"])
    keys = [b"a", b"b", b"c"]
    assert idx.match_marking(keys, 0).settled
    blocks[1].offset, blocks[1].flags = NO_SLOT, SEALED | ON_SSD   # on SSD only: still a hit
    found = idx.match_marking(keys, 0)
    assert found.blocks == blocks and not found.settled
    blocks[1].offset, blocks[1].flags = 64, SEALED | ON_SSD | PROMOTING   # its read still in flight
    found = idx.match_marking(keys, 0)
    assert found.blocks == blocks and not found.settled
    blocks[1].flags = SEALED | ON_SSD
    assert idx.match_marking(keys, 0).settled


def test_remove_interior_block_is_refused() -> None:
    idx = PrefixIndex(1)
    a, b = _chain(idx, [b"a", b"b"])
    with pytest.raises(AssertionError, match="orphan"):
        idx.remove(a)
    idx.remove(b)
    idx.remove(a)
    assert len(idx) == 0


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
    parent = None
    for i, k in enumerate(keys):
        parent = idx.insert(k, parent if i % 64 else None, offset=i * 2_097_152)
        parent.flags = SEALED
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_block = (used + 65 * n) / n  # count the 32-byte key objects too
    assert per_block <= 300, f"{per_block:.0f} bytes per block"


