"""Restore: the catalog and the SSD residency rebuilt from the SSD tier's records at start."""

from __future__ import annotations

from kvstored.index import NO_SLOT, ON_SSD, SEALED, Block, PrefixIndex, Tier
from kvstored.store.catalog import Catalog
from kvstored.store.learned import resume_learned
from kvstored.store.placement import Placement
from kvstored.store.values import RestoreReport
from kvstored.tiers.ssd import PROGRESS_EVERY, BlockRecord, Progress, SSDTier


def restore(catalog: Catalog, placement: Placement, tier: SSDTier | None,
            progress: Progress | None = None) -> RestoreReport:
    """Rebuild namespaces and the index from the SSD tier (at start, before serving);
    ``progress(what, done, total)`` is called every PROGRESS_EVERY records.

    Records that do not decode, whose namespace is unknown (or one this config refuses:
    blocks larger than ``dram.page_bytes``, a fast hash not allowed), whose parent is missing
    or whose length is wrong are deleted from disk and counted; payload checksums are
    verified when a block is read, so a corrupt payload is still never served. Each block enters
    the SSD policy with the reuse count its record kept, the policies resumed from what they had
    learned (:mod:`kvstored.store.learned`).
    """
    if tier is None:
        return RestoreReport(0, 0, 0)
    resume_learned(placement, tier.learned())
    catalog.restore_records()
    records: list[BlockRecord] = []
    dropped = 0
    for n, item in enumerate(tier.scan(), 1):
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress("restoring blocks from SSD: reading records", n, 0)
        if isinstance(item, BlockRecord):
            records.append(item)
        else:
            tier.delete_raw(item[0])
            dropped += 1
    restored: list[Block] = []
    reuses: list[int] = []
    for n, rec in enumerate(sorted(records, key=lambda r: r.depth), 1):
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress("restoring blocks from SSD: indexing", n, len(records))
        state = catalog.find(rec.namespace_id)
        parent = state.index.get(rec.parent) if state is not None and rec.depth else None
        if state is None or rec.length != state.spec.block_bytes or (rec.depth and parent is None) \
                or state.index.get(rec.key) is not None:
            tier.delete(rec.namespace_id, rec.key)
            dropped += 1
            continue
        block = state.index.insert(rec.key, parent, NO_SLOT)
        block.flags = SEALED | ON_SSD
        block.pins = 0
        restored.append(block)
        reuses.append(rec.reuses)
    by_index: dict[PrefixIndex, list[Block]] = {}
    for block in restored:   # into the presence table, fingerprinted a namespace at a time
        by_index.setdefault(block.index, []).append(block)
    for index, blocks in by_index.items():
        index.changed_many(blocks)
    placement.ssd.restored(restored, reuses)
    placement.events.stored(restored, Tier.SSD)
    placement.count_dropped("unreadable", dropped)
    before = placement.ssd_evictions
    # The capacity may have been lowered since: back under it now (a minute for a million
    # blocks here, told as the other steps are, or systemd takes the start for hung)
    placement.make_ssd_room(0, progress)
    placement.catch_up()   # the restored blocks' shadow replay, before serving rather than in a request
    evicted = placement.ssd_evictions - before
    return RestoreReport(len(catalog), len(restored) - evicted, dropped, evicted)
