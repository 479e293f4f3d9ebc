"""A restart's restore: the index rebuilt from the SSD tier's records, with the policies' history."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest
from store_harness import chain, open_store

from kvstored.index import Tier
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.registry import DEFAULT_POLICY, POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096


def save(store: BlockStore, sid: str, ns: int, keys: list[bytes]) -> None:
    r = store.reserve(sid, ns, KeyRequest(hashes=keys), BLOCK)
    store.seal(sid, r.reservation_id)


def restart_after_reuse(tmp_path: Path, policy: str) -> tuple[list[int], int, int]:
    """Save a prompt and a newer one never asked for, hit the first three times, stop cleanly and
    restart on the same tier, then overflow it with new blocks. Returns the first prompt's reuse
    counts in the SSD policy right after the restart, and how many blocks of each prompt are left."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 16 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": policy},
        "ssd": {"capacity": 16 * BLOCK, "policy": policy, "high_watermark": 0.95, "low_watermark": 0.7,
                "sync": False}}
    hot, cold = chain(4), chain(4, 50_000)
    with open_store(tmp_path, values, ssd=True) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        save(store, s, ns, hot)
        clock.now += 10
        save(store, s, ns, cold)                  # newer than hot, never reused
        for _ in range(3):
            clock.now += 10
            assert asyncio.run(store.lookup(ns, KeyRequest(hashes=hot))).blocks == 4

        async def stop() -> None:
            assert await store.write_back_for_shutdown() == 8
            await store.finish_background()
            assert await store.record_reuses() == 4   # each block of the prompt the hits went through

        asyncio.run(stop())
    with open_store(tmp_path, values, ssd=True) as (store, clock):   # the restart, on the same tier
        report = store.restore()
        assert report.blocks == 8
        ns = store.open_namespace(Namespace()).namespace_id
        index = store.catalog.get(ns).index
        reuses = [store.placement.ssd.policy.reuses(index.get(k)) for k in hot]  # type: ignore[arg-type]
        s = store.open_session("t", 1).session_id
        for i in range(3):                        # new blocks overflow the SSD tier into evictions
            clock.now += 10
            save(store, s, ns, chain(4, 100_000 + 1000 * i))
            asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
            store.evict(tier=Tier.DRAM)
        left = asyncio.run(store.lookup(ns, KeyRequest(hashes=hot))).blocks
        return reuses, left, asyncio.run(store.lookup(ns, KeyRequest(hashes=cold))).blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restarted_store_keeps_its_blocks_reuse_counts(tmp_path: Path, policy: str) -> None:
    """The policies' records were not persisted: after a restart every block entered the SSD
    policy as never reused. Their reuse counts now go with their SSD records (written with the
    block, raised at shutdown), under every policy, the default included."""
    reuses, _, _ = restart_after_reuse(tmp_path, policy)
    assert reuses == [3] * 4


@pytest.mark.parametrize("policy", [
    "credit", "lfu",
    pytest.param(DEFAULT_POLICY, marks=pytest.mark.xfail(strict=True, reason=(
        "known limit (README): the default policy orders as leaf-only LRU until its shadows show "
        "credit saving more (a 16-block tier's never do here), and it resumes as it stopped: the "
        "restored blocks go least reused first, but all of them before any block saved since")))])
def test_a_restarted_store_keeps_its_most_reused_blocks_over_the_blocks_saved_since(
        tmp_path: Path, policy: str) -> None:
    """With the reuse counts kept, the first saves to fill a restarted tier evict neither the
    blocks reused most (as old, never-hit blocks) nor any of them before the ones nobody had
    asked for, under the policies that order by reuse from the start."""
    _, left, cold_left = restart_after_reuse(tmp_path, policy)
    assert left == 4, "the reused prompt was evicted before the one never asked for"
    assert cold_left < 4


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restarted_store_evicts_the_restored_blocks_nobody_reused_before_the_reused_ones(
        tmp_path: Path, policy: str) -> None:
    """Every block is restored at one moment, so recency cannot tell them apart: the prompt
    nobody had asked for goes before any block of the one reused three times, under every policy
    (it used to go in the order the records were read: the reused prompt's leaf first)."""
    _, left, cold_left = restart_after_reuse(tmp_path, policy)
    assert cold_left == 0 and left > 0


def test_a_restarted_store_resumes_its_policies_from_what_they_had_learned(tmp_path: Path) -> None:
    """What the default policy of each tier learned (its scale, which shadow leads) is kept with
    the SSD tier at a clean stop and every minute by the write-back task (so a kill -9 loses at
    most that minute of it), and the restarted tiers start from it, not from LRU."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 16 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False},
        "ssd": {"capacity": 64 * BLOCK, "sync": False}}
    learned = {"scale": 0.75, "target": 1.0}

    def policies(store: BlockStore) -> list[BlockPolicy]:
        return [store.placement.ssd.policy, store.placement.dram.policy_of_size(BLOCK)]

    with open_store(tmp_path, values, ssd=True) as (store, _):
        store.open_namespace(Namespace())
        for policy in policies(store):
            assert policy.learned() == {"scale": 0.0, "target": 0.0}
            policy.resume(learned)
        assert asyncio.run(store.record_reuses()) == 0   # the clean stop's records
    with open_store(tmp_path, values, ssd=True) as (store, clock):
        store.restore()
        assert [p.learned() for p in policies(store)] == [learned, learned]
        moved = {"scale": 0.25, "target": 0.0}
        for policy in policies(store):
            policy.resume(moved)

        async def a_minute_of_write_back() -> None:
            task = asyncio.create_task(store.writeback_loop(interval_s=0.01))
            await asyncio.sleep(0.05)
            clock.now += 61.0
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        asyncio.run(a_minute_of_write_back())
        # no clean stop: the tier's writer commits what was queued, as before a kill -9
    with open_store(tmp_path, values, ssd=True) as (store, _):
        store.restore()
        assert [p.learned() for p in policies(store)] == [moved, moved]


def test_damaged_or_foreign_policy_records_are_skipped_at_restore(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A record written by another version or damaged is not taken on trust, nor one another
    policy learned (the tier's policy changed since): the restore goes on, says which it
    skipped, and the policies start as fresh ones."""
    caplog.set_level(logging.INFO, logger="kvstored.store")
    values: dict[str, dict[str, object]] = {"dram": {"capacity": 16 * BLOCK, "page_bytes": 4 * BLOCK,
                                                     "prefault": False}}
    with open_store(tmp_path, values, ssd=True) as (store, _):
        assert store.ssd_tier is not None
        for name, raw in (("ssd", b"not json"), ("dram/4096", b'{"policy": "glide", "state": {"scale": "high"}}'),
                          ("dram/x", b'{"policy": "glide", "state": {}}'), ("hbm", b'{"policy": "glide", "state": {}}'),
                          ("dram/8192", b'{"policy": "glide", "state": {"scale": NaN}}'),
                          ("dram/16384", b'{"policy": "adaptive", "state": {"scale": 1.0}}')):
            store.ssd_tier.put_learned(name, raw)
        store.ssd_tier.barrier().result(10)
    with open_store(tmp_path, values, ssd=True) as (store, _):
        assert store.restore().blocks == 0
        assert store.placement.ssd.policy.learned() == {"scale": 0.0, "target": 0.0}
        assert store.placement.dram.policy_of_size(BLOCK).learned() == {"scale": 0.0, "target": 0.0}
        assert store.placement.dram.policy_of_size(4 * BLOCK).learned() == {"scale": 0.0, "target": 0.0}
    skipped = [r.getMessage() for r in caplog.records if "not resuming" in r.getMessage()]
    assert len(skipped) == 6 and any("from what adaptive learned" in m for m in skipped), skipped
