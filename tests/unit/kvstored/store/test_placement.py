"""What the tiers keep: a block the SSD tier admits never leaves DRAM before it has its SSD copy
(saves wait for the write-back instead, reads take other slots), and every block whose last copy
goes is counted by why."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from clock import Clock
from store_harness import chain, open_store

from kvstored.index import Tier
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import LeaseExpired
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096   # pages of 4 blocks, an arena of 8


@contextlib.contextmanager
def make_store(tmp_path: Path, ssd: bool = True, admission: str = "always", ssd_blocks: int = 64,
               policy: str = "lru", **dram: object) -> Iterator[tuple[BlockStore, Clock]]:
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 8 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": "lru", **dram},
        "ssd": {"enabled": ssd, "capacity": ssd_blocks * BLOCK, "policy": policy, "high_watermark": 0.95,
                "low_watermark": 0.5, "sync": False, "admission": admission}}
    with open_store(tmp_path, values, ssd) as made:
        yield made


def fill(store: BlockStore, offsets: list[int], keys: list[bytes]) -> None:
    for off, key in zip(offsets, keys):
        store.arena.view(off, BLOCK)[:] = key[0]


def save_now(store: BlockStore, sid: str, ns: int, keys: list[bytes]) -> int:
    """Reserve without waiting, write, seal: the blocks stored."""
    r = store.reserve(sid, ns, KeyRequest(hashes=keys), BLOCK)
    fill(store, r.offsets, keys[r.present:])
    return store.seal(sid, r.reservation_id)


async def save_waiting(store: BlockStore, sid: str, ns: int, keys: list[bytes]) -> int:
    r = await store.reserve_waiting(sid, ns, KeyRequest(hashes=keys), BLOCK)
    fill(store, r.offsets, keys[r.present:])
    return r.present + store.seal(sid, r.reservation_id)


def test_saves_faster_than_the_write_back_wait_for_it_and_drop_nothing(tmp_path: Path) -> None:
    """The user's report: prompts saved one after another into a DRAM tier smaller than them, with
    an SSD tier that had room, were lost (DRAM's victims had no SSD copy yet: the write-back had
    not reached them). Now each save that finds DRAM full of such blocks waits for the write-back,
    and every prompt is found afterwards, nothing dropped."""
    with make_store(tmp_path, room_wait_s=5.0) as (store, _):
        async def main() -> None:
            writer = asyncio.ensure_future(store.writeback_loop(0.05))
            try:
                s = store.open_session("t", 1).session_id
                ns = store.open_namespace(Namespace()).namespace_id
                prompts = [chain(4, 10_000 * i) for i in range(6)]   # 24 blocks through 8 slots
                for keys in prompts:
                    assert await save_waiting(store, s, ns, keys) == 4
                for keys in prompts:
                    assert (await store.lookup(ns, KeyRequest(hashes=keys))).blocks == 4
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                await store.finish_background()

        asyncio.run(main())
        stats = store.stats()
        assert stats.dropped_blocks == 0, stats.dropped_by_reason
        assert stats.room_waits is not None and stats.room_waits.count >= 1


def test_a_save_waits_no_longer_than_its_bound_then_stores_what_fits(tmp_path: Path) -> None:
    """With no write-back running (a stuck disk, say), a save does not wait for ever: after
    dram.room_wait_s it is told the tier is full, and the blocks waiting for SSD stay."""
    with make_store(tmp_path, room_wait_s=0.2) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        first = chain(8)
        assert save_now(store, s, ns, first) == 8   # DRAM full of blocks without an SSD copy

        async def main() -> None:
            from kvstored_client.contract.errors import ResourceExhausted
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(ResourceExhausted):
                await save_waiting(store, s, ns, chain(2, 50_000))
            assert loop.time() - began >= 0.2

        asyncio.run(main())
        assert asyncio.run(store.lookup(ns, KeyRequest(hashes=first))).blocks == 8
        assert store.stats().dropped_blocks == 0


def test_reads_never_evict_blocks_waiting_for_their_ssd_copy(tmp_path: Path) -> None:
    """The user's second report: looking prompts up that lived on SSD (a lookup starts their
    promotion) evicted prompts held only in DRAM, with the SSD nearly empty: a read destroyed the
    only copy of other blocks. A promotion takes only slots that can be given up without loss
    (here none, with no write-back running: the read waits dram.room_wait_s, then finds none)."""
    with make_store(tmp_path, room_wait_s=0.2) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        old = chain(4)
        assert save_now(store, s, ns, old) == 4
        assert asyncio.run(store.flush()) == 4
        assert store.evict(tier=Tier.DRAM) == 4                   # old lives on SSD only
        fresh = chain(8, 50_000)
        assert save_now(store, s, ns, fresh) == 8                 # DRAM full, nothing on SSD yet

        async def read_old() -> int:
            r = await store.lookup(ns, KeyRequest(hashes=old), lease=True, session_id=s)
            if r.lease_id:
                store.release(s, r.lease_id)
            await store.finish_background()
            return r.blocks

        assert asyncio.run(read_old()) == 0                       # no slot that may be given up
        assert asyncio.run(store.lookup(ns, KeyRequest(hashes=fresh))).tiers == [Tier.DRAM] * 8
        assert store.stats().dropped_blocks == 0


def test_a_read_waits_for_the_write_back_rather_than_evict(tmp_path: Path) -> None:
    """The same read with the write-back running: it waits until the blocks saved last have
    their SSD copies, then their slots go to the promotion (as clean evictions: nothing lost)."""
    with make_store(tmp_path, room_wait_s=5.0) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        old = chain(4)
        assert save_now(store, s, ns, old) == 4
        assert asyncio.run(store.flush()) == 4
        assert store.evict(tier=Tier.DRAM) == 4
        fresh = chain(8, 50_000)
        assert save_now(store, s, ns, fresh) == 8

        async def main() -> int:
            writer = asyncio.ensure_future(store.writeback_loop(0.05))
            try:
                r = await store.lookup(ns, KeyRequest(hashes=old), lease=True, session_id=s)
                store.release(s, r.lease_id)
                return r.blocks
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                await store.finish_background()

        assert asyncio.run(main()) == 4
        assert asyncio.run(store.lookup(ns, KeyRequest(hashes=fresh))).blocks == 8   # on SSD now
        assert store.stats().dropped_blocks == 0


def test_a_save_whose_session_ends_while_it_waits_keeps_no_slot(tmp_path: Path) -> None:
    """(found by the randomized store test) A save waiting for room went on reserving under a
    reservation its session's end had already aborted: the slots it took then belonged to no
    lease and no block of the index ever gave them back."""
    with make_store(tmp_path, room_wait_s=5.0) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        assert save_now(store, s, ns, chain(8)) == 8

        async def main() -> None:
            waiting = asyncio.ensure_future(save_waiting(store, s, ns, chain(2, 50_000)))
            await asyncio.sleep(0.05)
            store.close_session(s)
            assert await store.write_back_for_shutdown() == 8     # room now, for a lease gone
            with pytest.raises(LeaseExpired):
                await waiting

        asyncio.run(main())
        in_dram = sum(1 for b in store.catalog.get(ns).index if b.in_dram)
        assert store.placement.dram.used_bytes == in_dram * BLOCK, "a slot no block holds"


@pytest.mark.parametrize("how", ["refused", "ssd_off", "write_error", "ssd_full"])
def test_every_block_leaving_dram_without_a_copy_is_counted_by_why(tmp_path: Path, how: str) -> None:
    """A block leaves DRAM uncopied only when the SSD tier will not have it: admission refuses it
    (refused), there is none (ssd_off), its write failed (write_error), or the tier's policy keeps
    blocks worth more (ssd_full); kvctl stats and kvstored_dropped_blocks_total{reason} say which."""
    options: dict[str, object] = {"refused": {"admission": "never"}, "ssd_off": {"ssd": False},
                                  "write_error": {}, "ssd_full": {"ssd_blocks": 4, "policy": "credit"}}[how]
    with make_store(tmp_path, **options) as (store, _):   # type: ignore[arg-type]
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        if how == "write_error":
            def failing(*args: object, **kwargs: object) -> Future[int]:
                out: Future[int] = Future()
                out.set_exception(OSError(5, "Input/output error"))
                return out
            assert store.ssd_tier is not None
            store.ssd_tier.put = failing   # type: ignore[method-assign]
        if how == "ssd_full":
            # a tier of 4 full of blocks reused (hit) lately: the policy will not take never-hit ones
            hot = chain(3, 90_000)
            assert save_now(store, s, ns, hot) == 3
            assert asyncio.run(store.flush()) == 3
            assert asyncio.run(store.lookup(ns, KeyRequest(hashes=hot))).blocks == 3
            store.evict(tier=Tier.DRAM)
        first = chain(8)
        assert save_now(store, s, ns, first) == 8
        if how in ("write_error", "ssd_full"):
            asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
            assert store.stats().dropped_blocks == 0
        assert save_now(store, s, ns, chain(4, 50_000)) == 4         # four of the first leave
        stats = store.stats()
        assert stats.dropped_by_reason[how] == 4 and stats.dropped_blocks == 4, stats.dropped_by_reason


def test_blocks_sealed_longer_ago_than_the_window_are_on_ssd(tmp_path: Path) -> None:
    """ssd.max_dirty_s bounds what a kill -9 loses: the write-back copies a block within it of its
    sealing, even with DRAM far under the write-back watermark (which alone used to leave a few
    saved prompts in DRAM only for as long as the daemon ran)."""
    with make_store(tmp_path, capacity=64 * BLOCK, room_wait_s=5.0) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id

        async def main() -> list[Tier]:
            writer = asyncio.ensure_future(store.writeback_loop(0.05))
            try:
                keys = chain(2)
                assert await save_waiting(store, s, ns, keys) == 2
                await asyncio.sleep(0.3)
                assert store.stats().tiers[1].blocks == 0            # young, and DRAM is nearly empty
                clock.now += store.config.ssd.max_dirty_s             # the window passes
                for _ in range(100):
                    await asyncio.sleep(0.02)
                    if store.stats().tiers[1].blocks == 2:
                        break
                store.evict(tier=Tier.DRAM)
                return (await store.lookup(ns, KeyRequest(hashes=keys))).tiers
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                await store.finish_background()

        assert asyncio.run(main()) == [Tier.SSD, Tier.SSD]


def test_a_save_from_buffers_unregistered_while_it_waits_for_room_stores_the_bytes_it_was_given(
        tmp_path: Path) -> None:
    """save_blocks held the engine's buffers (``in_use``) only for its copy, not while it waited
    for room: an engine that unregistered them meanwhile got its unregister back at once, the
    buffers were unmapped, and the copy that followed stored other bytes than the engine's under
    its keys (found by tests/unit/kvstored/store/test_store_random.py, seed 1). Now unregister
    waits for the save, which copies what the engine gave it."""
    from kvstored.buffers import TensorSource
    from kvstored_client import shm
    from kvstored_client.contract.layout import TensorLayout

    with make_store(tmp_path, room_wait_s=5.0) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace(block_bytes=BLOCK)).namespace_id
        for i in range(2):   # DRAM full of blocks without an SSD copy (no write-back running)
            assert save_now(store, s, ns, chain(4, 10_000 * (i + 1))) == 4
        engine = shm.empty((4, BLOCK), "uint8")
        buffers = store.register_buffers(s, ns, [TensorSource(
            engine.name, 0, TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0))])
        rows = engine.numpy()
        rows[:2] = [[7], [9]]
        keys = chain(2, 90_000)

        async def main() -> tuple[int, int]:
            save = asyncio.ensure_future(store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys), [0, 1]))
            await asyncio.sleep(0.05)
            assert not save.done()          # waiting for room
            unregister = asyncio.ensure_future(store.unregister_buffers(s, buffers.buffers_id))
            await asyncio.sleep(0.05)
            assert not unregister.done()    # waits for the save holding the buffers
            await store.flush()             # room: the waiting save goes on
            result = await save
            await unregister
            await store.finish_background()
            return result

        try:
            assert asyncio.run(main()) == (0, 2)
            assert buffers.tensors == []    # unmapped once the save was done
            index = store.catalog.get(ns).index
            for key, value in zip(keys, (7, 9)):
                block = index.get(key)
                assert block is not None and block.in_dram
                assert bytes(store.arena.view(block.offset, BLOCK)) == bytes([value]) * BLOCK
        finally:
            engine.close()


@pytest.mark.parametrize("waiting", [False, True])
def test_a_chain_saved_into_an_evicted_chains_slots_gets_them_side_by_side_in_order(
        tmp_path: Path, waiting: bool) -> None:
    """Making room evicts a chain leaf first, so a chain reserved into an older chain's slots got
    them in descending order: the SDK's and the engine copies took a step per block instead of one
    copy for the chain. The slots of a reservation ascend along its chain, whatever freed them."""
    with make_store(tmp_path, ssd=False) as (store, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        first = store.reserve(sid, ns, KeyRequest(hashes=chain(8)), BLOCK)   # the whole arena
        assert first.offsets == sorted(first.offsets)
        fill(store, first.offsets, chain(8))
        store.seal(sid, first.reservation_id)
        again = chain(4, start=10_000)
        if waiting:
            r = asyncio.run(store.reserve_waiting(sid, ns, KeyRequest(hashes=again), BLOCK))
        else:
            r = store.reserve(sid, ns, KeyRequest(hashes=again), BLOCK)
        assert len(r.offsets) == 4 and set(r.offsets) <= set(first.offsets)   # the evicted leaves' slots
        assert r.offsets == [r.offsets[0] + i * BLOCK for i in range(4)]   # one run, in chain order
        fill(store, r.offsets, again)
        assert store.seal(sid, r.reservation_id) == 4
        loaded = asyncio.run(store.lookup(ns, KeyRequest(hashes=again), lease=True, session_id=sid))
        assert loaded.blocks == 4
        assert [bytes(store.arena.view(off, 1)) for off in loaded.offsets] == [bytes([k[0]]) for k in again]


def test_a_chain_that_waited_for_room_still_gets_its_slots_in_order(tmp_path: Path) -> None:
    """A save that finds DRAM full of blocks waiting for their SSD copies waits for the write-back
    to copy some, then takes their slots: side by side in chain order, however the evictions freed
    them, and the blocks read back as written."""
    with make_store(tmp_path, room_wait_s=5.0) as (store, _):
        async def main() -> None:
            sid = store.open_session("t", 1).session_id
            ns = store.open_namespace(Namespace()).namespace_id
            assert await save_waiting(store, sid, ns, chain(8)) == 8   # DRAM full, nothing on SSD yet
            writer = asyncio.ensure_future(store.writeback_loop(0.01))
            try:
                again = chain(4, start=10_000)
                r = await store.reserve_waiting(sid, ns, KeyRequest(hashes=again), BLOCK)
                assert store.reservations.room_waits.snapshot().count >= 1, "it never waited"
                assert len(r.offsets) == 4 and r.offsets == [r.offsets[0] + i * BLOCK for i in range(4)]
                fill(store, r.offsets, again)
                assert store.seal(sid, r.reservation_id) == 4
                found = await store.lookup(ns, KeyRequest(hashes=again), lease=True, session_id=sid)
                assert [bytes(store.arena.view(o, 1)) for o in found.offsets] == [bytes([k[0]]) for k in again]
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        asyncio.run(main())
