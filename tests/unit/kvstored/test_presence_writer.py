"""The daemon's presence table as the store keeps it: a block's where word (its bytes readable
without a lease, see the table's layout) is set only once its slot holds its final bytes, and
is gone before anything may write the slot again: another block taking it after an eviction, a
promotion from SSD reading into it, a hollow block's rewrite."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from clock import Clock
from store_harness import chain, gate_ssd_read, open_store

from kvstored.index import Tier
from kvstored.presence import PresenceTable
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract import presence as layout
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096   # pages of 16 KiB hold 4 blocks


class Watched(PresenceTable):
    """A table that logs the arena offset of every where word it publishes."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, 64, 0o600)
        self.log: list[int] = []

    def _publish(self, offset: int) -> int:
        self.log.append(offset)
        return super()._publish(offset)

    def published(self) -> set[int]:
        """The offsets the file's where words name now (read as an SDK reads the file)."""
        data = self.path.read_bytes()
        n = self.buckets * layout.SLOTS
        words = np.frombuffer(data, np.uint64, n, layout.HEADER.size + n * 8).tolist()
        return {layout.where_offset(w) for w in words if w}


@contextlib.contextmanager
def _store(tmp_path: Path, ssd: bool = False) -> Iterator[tuple[BlockStore, Watched, Clock]]:
    """An 8-block arena (two pages of 4 blocks) under LRU, with an SSD tier of 16 blocks if ``ssd``."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 8 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": "lru"}}
    if ssd:
        values["ssd"] = {"enabled": True, "capacity": 16 * BLOCK, "policy": "lru", "high_watermark": 0.95,
                         "low_watermark": 0.5, "sync": False}
    table = Watched(tmp_path / "t.presence")
    try:
        with open_store(tmp_path, values, ssd, presence=table) as (store, clock):
            yield store, table, clock
    finally:
        table.close()


def _save(store: BlockStore, sid: str, ns: int, keys: list[bytes], fill: int) -> list[int]:
    r = store.reserve(sid, ns, KeyRequest(hashes=keys), BLOCK)
    for offset in r.offsets:
        store.arena.view(offset, BLOCK)[:] = fill
    store.seal(sid, r.reservation_id)
    return list(r.offsets)


def test_a_slot_another_block_takes_is_unpublished_before_it_is_handed_out(tmp_path: Path) -> None:
    with _store(tmp_path) as (store, table, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        first = _save(store, sid, ns, chain(8), 1)
        assert table.published() == set(first)
        handed: list[tuple[int, set[int]]] = []
        take_free = store.placement.dram.take_free

        def watched(slot_bytes: int) -> int | None:
            offset = take_free(slot_bytes)
            if offset is not None:
                handed.append((offset, table.published()))
            return offset

        store.placement.dram.take_free = watched  # type: ignore[method-assign]
        r = store.reserve(sid, ns, KeyRequest(hashes=chain(4, start=10_000)), BLOCK)
        assert len(r.offsets) == 4 and set(r.offsets) <= set(first)   # evicted blocks' slots, reused
        # each slot went to the reservation unpublished, and none is published while it is written
        assert [offset for offset, published in handed if offset in published] == []
        assert not table.published() & set(r.offsets)
        assert store.verify_presence() == []
        store.seal(sid, r.reservation_id)
        assert set(r.offsets) <= table.published()
        assert store.verify_presence() == []


def test_a_promotion_publishes_its_slot_only_once_its_bytes_are_read(tmp_path: Path) -> None:
    with _store(tmp_path, ssd=True) as (store, table, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(2)
        _save(store, sid, ns, keys, 7)
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)
        assert table.published() == set()
        gate = gate_ssd_read(store, keys[1])
        table.log.clear()

        async def load() -> None:
            looking = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=sid))
            for _ in range(100):   # until the gated read has its slot
                await asyncio.sleep(0.01)
                block = store.catalog.get(ns).index.get(keys[1])  # type: ignore[union-attr]
                if block is not None and block.in_dram:
                    break
            slot = store.catalog.get(ns).index.get(keys[1]).offset  # type: ignore[union-attr]
            # its slot holds the SSD read's bytes-to-be: never published meanwhile
            assert slot not in table.log and slot not in table.published()
            assert store.verify_presence() == []
            gate.set()
            found = await looking
            assert found.blocks == 2
            assert slot in table.published()
            assert bytes(store.arena.view(slot, BLOCK)) == bytes([7]) * BLOCK
            store.release(sid, found.lease_id)

        asyncio.run(load())
        assert store.verify_presence() == []


def test_a_hollow_block_rewritten_is_published_only_when_its_new_bytes_are_sealed(tmp_path: Path) -> None:
    from kvstored.tiers.ssd import BlockRecord

    with _store(tmp_path, ssd=True) as (store, table, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(2)
        _save(store, sid, ns, keys, 3)
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)
        ssd = store.ssd_tier
        assert ssd is not None
        rec = next(r for r in ssd.scan() if isinstance(r, BlockRecord) and r.key == keys[0])
        with open(ssd.path / f"payload-{rec.length}.dat", "r+b") as fh:   # its SSD copy damaged
            fh.seek(rec.slot * BLOCK + 100)
            fh.write(b"\xaa")
        found = asyncio.run(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=sid))
        assert found.blocks == 0   # the parent's bytes are lost: hollow, kept for its child
        table.log.clear()
        r = store.reserve(sid, ns, KeyRequest(hashes=keys[:1]), BLOCK)
        assert len(r.offsets) == 1
        (slot,) = r.offsets
        assert slot not in table.log and slot not in table.published()   # not until sealed
        store.arena.view(slot, BLOCK)[:] = 4
        store.seal(sid, r.reservation_id)
        assert slot in table.published()
        assert store.verify_presence() == []


def test_a_block_leaving_the_index_with_both_copies_leaves_the_table_and_its_slot_unpublished(
        tmp_path: Path) -> None:
    """A block in DRAM with an SSD copy that leaves the index (``kvctl evict``, all tiers) is told
    to the table once, at its removal: nothing of it stays there, no where word names its slot,
    and the slot, taken by the next save, is published only with the new block's bytes."""
    with _store(tmp_path, ssd=True) as (store, table, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(4)
        slots = _save(store, sid, ns, keys, 5)
        asyncio.run(store.flush())
        assert set(slots) <= table.published()
        assert store.evict() == 4
        assert not table.published() & set(slots)
        assert store.verify_presence() == []    # no slot of the table names a block that left
        table.log.clear()
        again = _save(store, sid, ns, chain(4, start=5_000), 6)
        assert set(again) & set(slots) and table.log == again   # reused, published once sealed
        assert store.verify_presence() == []
