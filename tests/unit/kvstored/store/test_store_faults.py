"""The store under faults and cancellations: leases outliving long streams, hollow blocks left
by failed SSD reads, unregistering while a request holds the buffers, placeholder ids."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clock import Clock
from store_harness import chain, exchange, gate_ssd_read, open_store, streamer

from kvstored.copy import CopyEngine
from kvstored.peers.chain_streams import Fetched
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096
NS = Namespace(model="m", block_bytes=BLOCK)


def _engine_buffers(store: BlockStore, session_id: str, ns: int):  # type: ignore[no-untyped-def]
    """Four engine blocks of BLOCK bytes in shared memory, registered with the store."""
    from kvstored.buffers import TensorSource
    from kvstored_client import shm
    from kvstored_client.contract.layout import TensorLayout

    engine = shm.empty((4, BLOCK), "uint8")
    return engine, store.register_buffers(session_id, ns, [TensorSource(
        engine.name, 0, TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0))])


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[BlockStore, Clock]]:
    with open_store(tmp_path, {"dram": {"capacity": 8 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False,
                                        "policy": "lru"},
                               "leases": {"ttl_s": 10.0, "reservation_ttl_s": 20.0}}) as made:
        yield made


def test_an_arena_stream_longer_than_the_ttl_still_hands_over_a_live_lease(env: tuple[BlockStore, Clock]) -> None:
    """Arena-mode stream whose peer transfer takes longer than leases.ttl_s (the reaper runs
    meanwhile, as app.reaper does every reap_interval_s). The handed lease runs ttl from the
    stream's end (store.py renews it), but reap() had already doomed the busy lease, so the
    finally of stream_blocks ended it right after the renew: the StreamEnd named a lease that no
    longer existed, and BlockStream's synchronous Release (the loop took >= ttl/2) got
    FailedPrecondition -> LeaseExpired on a reader that copied every block promptly."""
    store, clock = env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        for i in range(len(want)):
            view = await into(i, BLOCK)
            view[:] = bytes([i + 1]) * BLOCK
            clock.now += 6.0          # a slow peer: 12 s in all, ttl is 10 s
            store.reap()              # the daemon's reaper runs meanwhile
            await landed(i, "peer-a")
        return Fetched(len(want), "complete")

    async def main():  # type: ignore[no-untyped-def]
        return await streamer(store).stream_blocks(s, ns, KeyRequest(hashes=keys), 0, [], lambda a: None, fetcher)

    end = asyncio.run(main())
    assert end.stop == "complete" and end.blocks == 2 and end.lease_id
    assert store.leasing.get(end.lease_id) is not None, (
        "the lease handed to the reader at the stream's end was already ended (reaped while busy)")
    store.release(s, end.lease_id)   # the client's Release right after its loop: must not be 'expired'


def _corrupt_on_disk(store: BlockStore, ns: int, key: bytes) -> None:
    from kvstored.tiers.ssd import BlockRecord
    ssd = store.ssd_tier
    assert ssd is not None
    rec = next(r for r in ssd.scan() if isinstance(r, BlockRecord) and r.namespace_id == ns and r.key == key)
    with open(ssd.path / f"payload-{rec.length}.dat", "r+b") as fh:
        fh.seek(rec.slot * BLOCK + 100)
        b = fh.read(1)
        fh.seek(rec.slot * BLOCK + 100)
        fh.write(bytes([b[0] ^ 0xFF]))


@contextlib.contextmanager
def _store_over_ssd(tmp_path: Path, dram_blocks: int = 8,
                    admission: str = "always") -> Iterator[tuple[BlockStore, Clock, CopyEngine]]:
    """A store of ``dram_blocks`` DRAM blocks (pages of 4) over an SSD tier of 64, both LRU."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": dram_blocks * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": "lru"},
        "ssd": {"enabled": True, "capacity": 64 * BLOCK, "policy": "lru", "high_watermark": 0.95,
                "low_watermark": 0.5, "sync": False, "admission": admission}}
    with open_store(tmp_path, values, ssd=True) as (store, clock):
        yield store, clock, store.copy


@pytest.fixture
def ssd_env(tmp_path: Path) -> Iterator[tuple[BlockStore, Clock]]:
    with _store_over_ssd(tmp_path) as (store, clock, _):
        yield store, clock


@pytest.fixture
def droppable_env(tmp_path: Path) -> Iterator[tuple[BlockStore, Clock]]:
    """:func:`ssd_env` under ``ssd.admission = never``: a block saved without an SSD copy may
    leave DRAM uncopied (with admission, it waits for the write-back), so the blocks saved to fill
    DRAM give their slots up at once."""
    with _store_over_ssd(tmp_path, admission="never") as (store, clock, _):
        yield store, clock


def test_a_corrupt_leaf_read_by_a_streams_second_look_leaves_the_index(droppable_env: tuple[BlockStore, Clock]) -> None:
    """Sibling of 'a corrupt leaf dropped by a load/prefetch leaves the index': stream_blocks'
    _fetch_rest re-reads blocks its lookup stopped short of (``extra``: there was no DRAM room
    for them then). When such a block fails its SSD checksum it becomes hollow, is unpinned
    (store.py _fetch_rest: ``for block in extra[ready:]: block.pins -= 1``) and the reservation's
    end unpins it again, but nobody calls _remove_if_hollow: the hollow leaf stays in the index
    for ever, holding its parent off the SSD policy's leaves."""
    from kvstored.index import Tier
    store, _ = droppable_env
    holder = store.open_session("holder", 1).session_id
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)

    def save(keys: list[bytes]) -> None:
        r = store.reserve(holder, ns, KeyRequest(hashes=keys), BLOCK)
        store.seal(holder, r.reservation_id)

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        return Fetched(0, "missing", "no peer holds it")

    async def main():  # type: ignore[no-untyped-def]
        save(a)
        assert await store.flush() == 2
        assert store.evict("", Tier.DRAM) == 2                 # a lives on SSD only
        _corrupt_on_disk(store, ns, a[1])
        others = chain(7, 10_000)
        save(others)
        held = await store.lookup(ns, KeyRequest(hashes=others), lease=True, session_id=holder)
        assert held.blocks == 7                                # 7 of 8 slots pinned: room for a[0] only
        task = asyncio.ensure_future(streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=a), 0, [],
                                                         lambda arrival: None, fetcher))
        for _ in range(100):
            await asyncio.sleep(0)
            if len(store.promotion) or task.done():
                break
        assert len(store.promotion) and not task.done(), "a[0] should be on its way up from SSD"
        store.release(holder, held.lease_id)                   # room again, while the lookup waits
        end = await task
        await store.finish_background()
        return end

    end = asyncio.run(main())
    assert end.blocks == 1 and end.stop == "corrupt", end
    store.release(reader, end.lease_id)
    index = store.catalog.get(ns).index
    b = index.get(a[1])
    assert b is None, f"hollow leaf left in the index (pins={b.pins}, flags={b.flags})"


def test_a_corrupt_leaf_found_before_a_leasing_lookup_is_cancelled_leaves_the_index(
        ssd_env: tuple[BlockStore, Clock]) -> None:
    """Sibling of the hollow-leaf fix in _lookup_chain: the fix covers the path where the lookup
    returns, not the one where it is cancelled (client deadline / gone) while it still waits for
    an earlier block's SSD read. The leaf's read already failed its checksum (the block is
    hollow, but pinned by the lease, so _finish_promotion's _remove_if_hollow kept it); the
    cancelled lookup's ``except BaseException`` ends the lease (unpinning it) and never calls
    _remove_if_hollow: the hollow leaf stays in the index for ever."""
    import concurrent.futures

    from kvstored.index import Tier
    store, _ = ssd_env
    s = store.open_session("holder", 1).session_id
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)
    ssd = store.ssd_tier
    assert ssd is not None
    real_read = ssd.read_into
    slow: dict[str, object] = {}

    def read_into(namespace_id, key, view):  # type: ignore[no-untyped-def]
        if key == a[0]:      # block 0's read is slow: it completes when the test says so
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            slow.update(fut=fut, args=(namespace_id, key, view))
            return fut
        return real_read(namespace_id, key, view)

    async def main() -> None:
        r = store.reserve(s, ns, KeyRequest(hashes=a), BLOCK)
        store.seal(s, r.reservation_id)
        assert await store.flush() == 2
        assert store.evict("", Tier.DRAM) == 2
        _corrupt_on_disk(store, ns, a[1])
        ssd.read_into = read_into  # type: ignore[method-assign]
        block1 = store.catalog.get(ns).index.get(a[1])
        task = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=reader))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if store.promotion.pending(block1) is None:
                break
        assert store.promotion.pending(block1) is None, "block 1's read should have failed by now"
        task.cancel()                                   # the client's deadline
        with contextlib.suppress(asyncio.CancelledError):
            await task
        fut = slow["fut"]
        real_read(*slow["args"]).result(5)              # block 0's read completes after all
        fut.set_result(None)                            # type: ignore[union-attr]
        await asyncio.sleep(0.05)
        await store.finish_background()

    asyncio.run(main())
    b = store.catalog.get(ns).index.get(a[1])
    assert b is None, f"hollow leaf left in the index (pins={b.pins}, readable={b.readable})"


def test_an_unregister_cancelled_while_a_stream_holds_the_buffers_still_unmaps_them(
        env: tuple[BlockStore, Clock]) -> None:
    """unregister_buffers now waits for every request holding the buffers (in_use), which for a
    stream includes its whole peer transfer. It takes the buffers out of the store's table and the
    session's set first, then awaits _close_when_idle in the handler: when that handler is
    cancelled (the engine is killed while it unregisters, or its deadline passes), nobody closes
    the buffers any more (close_session no longer knows them): the mmaps, or for CUDA buffers the
    IPC mappings of the dead engine's GPU memory, stay open in the daemon for good."""

    store, _ = env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    keys = chain(2)

    async def main() -> None:
        peer_answers = asyncio.Event()

        async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
            await peer_answers.wait()     # a slow peer
            return Fetched(0, "missing", "no peer holds it")

        stream = asyncio.ensure_future(streamer(store).stream_blocks(s, ns, KeyRequest(hashes=keys), buffers.buffers_id,
                                                           [0, 1], lambda a: None, fetcher))
        await asyncio.sleep(0.01)
        unregister = asyncio.ensure_future(store.unregister_buffers(s, buffers.buffers_id))
        await asyncio.sleep(0.05)
        assert not unregister.done()          # waiting for the stream, as the commit intends
        unregister.cancel()                   # ... but its caller went away
        with contextlib.suppress(asyncio.CancelledError):
            await unregister
        store.close_session(s)                # the engine's session ends too
        peer_answers.set()
        await stream
        await asyncio.sleep(0.05)
        await store.finish_background()

    try:
        asyncio.run(main())
        assert buffers.busy == 0
        assert buffers.tensors == [], "the buffers were never unmapped"
    finally:
        engine.close()


def test_a_save_may_name_its_cached_prefix_with_placeholder_ids(env: tuple[BlockStore, Clock]) -> None:
    """save_blocks never reads the ids of the chain's already-cached prefix, so an engine that no
    longer holds those blocks (chunked prefill after the early blocks were freed, a sliding-window
    group whose table holds the null block there) may name them by one placeholder; only the ids
    of blocks it copies must differ (the duplicate-id check refused the whole save)."""

    store, _ = env
    s = store.open_session("engine", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    keys = chain(3)

    async def main() -> tuple[int, int]:
        assert await store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys[:2]), [0, 1]) == (0, 2)
        return await store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys), [0, 0, 2])

    try:
        assert asyncio.run(main()) == (2, 1)
    finally:
        engine.close()


def test_a_placeholder_id_is_never_stored_as_a_blocks_bytes(env: tuple[BlockStore, Clock]) -> None:
    """Chunked prefill as README recommends: chunk 1 saves blocks 0-1; the engine frees them and
    names them by its null block 0 in chunk 2's save. Meanwhile the daemon evicted block 1 (a
    leaf). present is then 1, so the placeholder at index 1 is *copied*: the null block's bytes
    are sealed as block 1 and served to every later load of the prompt. README: such a save is
    refused (InvalidArgument), and nothing of it is stored."""
    from kvstored.buffers import TensorSource
    from kvstored_client import shm
    from kvstored_client.contract.errors import InvalidArgument
    from kvstored_client.contract.layout import TensorLayout

    store, _ = env
    s = store.open_session("engine", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine = shm.empty((4, BLOCK), "uint8")
    try:
        arr = engine.numpy()
        buffers = store.register_buffers(s, ns, [TensorSource(
            engine.name, 0, TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0))])
        keys = block_hashes(list(range(16 * 3)))
        arr[1], arr[2] = 11, 22                 # chunk 1: blocks 0, 1 in engine blocks 1, 2

        async def main() -> tuple[int, int] | str:
            assert await store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys[:2]), [1, 2]) == (0, 2)
            arr[0] = 0                          # engine block 0: the null block
            arr[1], arr[2] = 0, 33              # engine reuses its blocks: block 2 of the prompt in engine block 2
            assert exchange(store).forget(ns, keys[1:2]) == 1   # the daemon evicted leaf block 1 (LRU, under pressure)
            try:
                return await store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys), [0, 0, 2])
            except InvalidArgument as exc:
                return str(exc)

        outcome = asyncio.run(main())
        assert isinstance(outcome, str), f"the save that would copy the placeholder was taken: {outcome}"
        assert "block_ids[1] = 0" in outcome and "placeholder" in outcome, outcome
        block1 = store.catalog.get(ns).index.get(keys[1])
        assert block1 is None or not block1.readable, "the refused save left block 1 readable"
        assert store.catalog.get(ns).index.get(keys[2]) is None, "the refused save left block 2 behind"
    finally:
        engine.close()


def test_a_stream_cancelled_during_its_peer_fetch_leaves_no_reservation(env: tuple[BlockStore, Clock]) -> None:
    """The client of a StreamBlocks(peers=True) goes away (deadline, killed) while a peer sends
    block 1: the servicer cancels stream_blocks inside _fetch_rest; the reservation never reaches
    stream_blocks' finally, stays in _busy for ever, so neither reap() nor close_session ends it."""
    """A client that leaves (or hits its deadline) while a peer still sends: the reservation of
    the blocks being fetched stayed busy for ever (never reaped), its unsealed block pinned in the
    index, and every other writer of that prompt was told it was being written."""
    store, clock = env
    s = store.open_session("decode", 1).session_id
    other = store.open_session("other", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)

    async def main() -> None:
        stuck = asyncio.Event()

        async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
            view = await into(0, BLOCK)
            view[:] = b"\x01" * BLOCK
            await landed(0, "peer-a")
            await into(1, BLOCK)
            await stuck.wait()            # the peer is slow with block 1
            return Fetched(2, "complete")

        task = asyncio.ensure_future(streamer(store).stream_blocks(s, ns, KeyRequest(hashes=keys), 0, [],
                                                         lambda a: None, fetcher))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()                     # the servicer cancels on the client's disconnect
        with contextlib.suppress(asyncio.CancelledError):
            await task
        store.close_session(s)            # and the client's session ends too
        clock.now += 100.0
        store.reap()

    asyncio.run(main())
    assert not store.leasing.busy_leases(), f"leases busy for ever: {store.leasing.busy_leases()}"
    assert len(store.leasing.leases()) == 0
    b1 = store.catalog.get(ns).index.get(keys[1])
    assert b1 is None, f"block 1's reservation left in the index (pins={b1.pins}, flags={b1.flags})"
    r = store.reserve(other, ns, KeyRequest(hashes=keys), BLOCK)   # another writer may store it
    assert r.present == 1 and len(r.offsets) == 1, r


def test_rewriting_a_hollow_block_does_not_evict_it_from_under_its_reservation(
        droppable_env: tuple[BlockStore, Clock]) -> None:
    """A hollow block (its SSD copy failed its checksum; kept for its child) is written again in
    place by the next reservation of its key. Making room for its slot evicted its last child
    (a DRAM-only leaf), and the hollow block, left childless and unpinned, followed it out of
    the index: the reservation then wrote and sealed a block the index no longer held (the save
    was reported stored, no lookup found it, and evicting it later tripped the index's assert)."""
    from kvstored.index import Tier
    store, _ = droppable_env
    s = store.open_session("engine", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)

    def save(keys: list[bytes]) -> int:
        r = store.reserve(s, ns, KeyRequest(hashes=keys), BLOCK)
        return store.seal(s, r.reservation_id)

    async def main() -> None:
        save(a)
        assert await store.flush() == 2
        assert store.evict("", Tier.DRAM) == 2                 # a lives on SSD only
        _corrupt_on_disk(store, ns, a[0])
        r = await store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=s)
        assert r.blocks == 0                                   # a[0] is hollow now, a[1] came up
        await store.finish_background()
        assert store.evict("", Tier.SSD) == 1                  # a[1]: in DRAM only, a leaf
        others = chain(7, 10_000)
        save(others)
        held = await store.lookup(ns, KeyRequest(hashes=others), lease=True, session_id=s)
        assert held.blocks == 7                                # a[1] is the only block that may go

    asyncio.run(main())
    index = store.catalog.get(ns).index
    hollow = index.get(a[0])
    assert hollow is not None and hollow.sealed and not hollow.readable and hollow.children == 1
    assert save(a) == 1                                        # a[0] again; no room for a[1]
    assert index.get(a[0]) is not None, "the rewritten block left the index"
    assert asyncio.run(store.lookup(ns, KeyRequest(hashes=a))).blocks == 1


async def _on_ssd_with_dram_leased(store: BlockStore, ns: int, a: list[bytes], leased: int) -> tuple[str, int]:
    """``a`` on SSD only, then ``leased`` other blocks saved and leased (DRAM slots nothing frees);
    the holder's session and lease."""
    from kvstored.index import Tier
    holder = store.open_session("holder", 1).session_id
    r = store.reserve(holder, ns, KeyRequest(hashes=a), BLOCK)
    store.seal(holder, r.reservation_id)
    assert await store.flush() == len(a)
    assert store.evict("", Tier.DRAM) == len(a)            # a lives on SSD only
    others = chain(leased, 10_000)
    r = store.reserve(holder, ns, KeyRequest(hashes=others), BLOCK)
    store.seal(holder, r.reservation_id)
    held = await store.lookup(ns, KeyRequest(hashes=others), lease=True, session_id=holder)
    assert held.blocks == leased
    return holder, held.lease_id


def test_a_stream_short_of_dram_for_blocks_on_ssd_says_no_room_not_corrupt(
        ssd_env: tuple[BlockStore, Clock]) -> None:
    """A stream with peers whose prompt is on this node's SSD while every DRAM slot is leased:
    its lookup cannot bring the blocks up, nor can the second look of _fetch_rest. The stream
    stopped with "corrupt" ("block 0 could not be read here"), though no copy failed its
    checksum and nothing was dropped: the client and the operator chased a disk fault that was a
    full DRAM tier."""
    store, _ = ssd_env
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        raise AssertionError("no slot to receive into: the peers are not asked")

    async def main():  # type: ignore[no-untyped-def]
        await _on_ssd_with_dram_leased(store, ns, a, 8)       # every slot leased
        return await streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=a), 0, [], lambda arrival: None,
                                                   fetcher)

    end = asyncio.run(main())
    assert end.blocks == 0 and end.stop == "no_room", end
    assert store.stats().dropped_blocks == 0 and exchange(store).held(ns, a) == 2   # still on SSD, intact


def test_blocks_a_streams_second_look_brings_up_from_ssd_are_reported_as_ssd(
        droppable_env: tuple[BlockStore, Clock]) -> None:
    """The blocks _fetch_rest's second look reads from SSD (the lookup had no DRAM room for them
    then) were handed over as DRAM blocks: their tier was taken after the read brought them up,
    while the lookup's own blocks report the tier they were found in (SSD)."""
    from kvstored.handover import Arrival
    from kvstored.index import Tier
    store, _ = droppable_env
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)
    arrivals: list[Arrival] = []

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        raise AssertionError("every block is held here")

    async def main():  # type: ignore[no-untyped-def]
        holder, lease = await _on_ssd_with_dram_leased(store, ns, a, 7)   # 7 of 8 leased: room for a[0] only
        task = asyncio.ensure_future(streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=a), 0, [],
                                                         arrivals.append, fetcher))
        for _ in range(100):
            await asyncio.sleep(0)
            if len(store.promotion) or task.done():
                break
        assert len(store.promotion) and not task.done(), "a[0] should be on its way up from SSD"
        store.release(holder, lease)                           # room again, while the lookup waits
        return await task

    end = asyncio.run(main())
    assert end.blocks == 2 and end.stop == "complete", end
    assert [(x.index, x.tier) for x in arrivals] == [(0, Tier.SSD), (1, Tier.SSD)]


def test_a_stream_cancelled_twice_while_its_copy_runs_leaves_no_busy_lease(env: tuple[BlockStore, Clock]) -> None:
    """A stream into engine buffers is cancelled (the client left) while a batch is being copied
    into the buffers, and cancelled again while Handover.close() waits for that copy (the handler
    is cancelled once more, at shutdown say). close() raised before it unpinned anything, so
    stream_blocks' finally never ended its leases: the read lease stayed in _busy for good (never
    reaped, never ended with the session) and its blocks stayed pinned, never evicted again."""
    store, clock = env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    keys = chain(2)
    copy_started = asyncio.Event()
    copy_may_end = asyncio.Event()

    async def slow_from_arena(*args, **kwargs):  # type: ignore[no-untyped-def]
        copy_started.set()          # a copy on a worker thread: it cannot be stopped halfway
        await asyncio.shield(asyncio.ensure_future(copy_may_end.wait()))

    async def main() -> None:
        r = store.reserve(s, ns, KeyRequest(hashes=keys), BLOCK)
        store.seal(s, r.reservation_id)
        store.copy.from_arena = slow_from_arena  # type: ignore[method-assign]
        task = asyncio.ensure_future(streamer(store).stream_blocks(s, ns, KeyRequest(hashes=keys), buffers.buffers_id,
                                                         [0, 1], lambda a: None, None))
        await asyncio.wait_for(copy_started.wait(), 5)
        task.cancel()                     # the client left
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done(), "the stream waits for the copy in flight"
        task.cancel()                     # and once more
        with contextlib.suppress(asyncio.CancelledError):
            await task
        copy_may_end.set()                # the copy thread is done with the slots
        for _ in range(20):
            await asyncio.sleep(0)
        store.close_session(s)
        clock.now += 100.0
        store.reap()

    try:
        asyncio.run(main())
        assert not store.leasing.busy_leases(), f"leases busy for ever: {store.leasing.busy_leases()}"
        assert len(store.leasing.leases()) == 0
        pins = [store.catalog.get(ns).index.get(k).pins for k in keys]  # type: ignore[union-attr]
        assert pins == [0, 0], f"blocks left pinned: {pins}"
    finally:
        engine.close()


def _register_rows(store: BlockStore, session_id: str, ns: int, engine: Any, rows: int) -> Any:
    """Register ``engine`` (``rows`` rows of one block each) as one tensor."""
    from kvstored.buffers import TensorSource
    from kvstored_client.contract.layout import TensorLayout
    return store.register_buffers(session_id, ns, [TensorSource(
        engine.name, 0, TensorLayout((rows, BLOCK), (BLOCK, 1), "uint8", 0))])


def _peer(first_byte: int, pause: bool) -> Any:
    """A fetcher standing in for PeerNode.fetch: block i is filled with ``first_byte + i``; with
    ``pause`` it yields to the loop after each block (a socket that is not always ready)."""
    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        for i in range(len(want)):
            try:
                view = await into(i, BLOCK)
            except KVStoreError as exc:            # as PeerNode.fetch reports it
                return Fetched(i, "no_room", str(exc))
            view[:] = bytes([i + first_byte]) * BLOCK
            await landed(i, "peer-a")
            if pause:
                await asyncio.sleep(0)
        return Fetched(len(want), "complete")
    return fetcher


def test_a_stream_longer_than_dram_sinks_its_own_blocks_not_other_clients(tmp_path: Path) -> None:
    """A stream into engine buffers of a prompt longer than what DRAM has left: _fill_reservation
    makes room by writing the stream's delivered blocks to SSD and dropping their slots. It wrote
    back the 8 oldest DRAM-only blocks of the whole namespace instead, here another client's
    leased prompt, then found none of its own blocks clean and gave up without retrying: the
    stream stopped with no_room at block 8 while the SSD tier had room for all of it."""
    from kvstored_client import shm

    with _store_over_ssd(tmp_path, 16) as (store, _, _), \
            contextlib.closing(shm.empty((12, BLOCK), "uint8")) as engine:
        holder = store.open_session("holder", 1).session_id
        reader = store.open_session("decode", 2).session_id
        ns = store.open_namespace(NS).namespace_id
        buffers = _register_rows(store, reader, ns, engine, 12)
        others, keys = chain(8, 10_000), chain(12)
        fetcher = _peer(first_byte=1, pause=True)

        async def main():  # type: ignore[no-untyped-def]
            r = store.reserve(holder, ns, KeyRequest(hashes=others), BLOCK)
            store.seal(holder, r.reservation_id)
            held = await store.lookup(ns, KeyRequest(hashes=others), lease=True, session_id=holder)
            assert held.blocks == 8                   # half of DRAM: leased, not written to SSD yet
            try:
                return await streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=keys), buffers.buffers_id,
                                                 list(range(12)), lambda a: None, fetcher)
            finally:
                await store.unregister_buffers(reader, buffers.buffers_id)
                await store.finish_background()

        end = asyncio.run(main())
        assert end.stop == "complete" and end.blocks == 12, end
        rows = engine.numpy()
        assert [int(rows[i][0]) for i in range(12)] == list(range(1, 13))


def test_a_block_a_stream_just_fetched_stays_under_the_next_one(env: tuple[BlockStore, Clock]) -> None:
    """A pull (or a stream into engine buffers, once the copy is done) leaves the block it just
    sealed unpinned while the peer sends the next one: a DRAM-only leaf, the first victim of
    another client's save on a full arena. The next block was then reserved under a parent no
    longer in the index: an AssertionError out of the store (the client saw an internal error)
    and a DRAM slot allocated for it and never freed."""
    from kvstored_client.contract.errors import ResourceExhausted
    store, _ = env
    holder = store.open_session("holder", 1).session_id
    reader = store.open_session("decode", 2).session_id
    other = store.open_session("prefill", 3).session_id
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    refused: list[str] = []

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        for i in range(len(want)):
            try:
                view = await into(i, BLOCK)
            except KVStoreError as exc:                # as PeerNode.fetch reports it
                return Fetched(i, "no_room", str(exc))
            view[:] = bytes([i + 1]) * BLOCK
            await landed(i, "peer-a")
            if i == 0:                            # meanwhile another client saves a prompt
                try:
                    r = store.reserve(other, ns, KeyRequest(hashes=chain(1, 50_000)), BLOCK)
                    store.seal(other, r.reservation_id)
                except ResourceExhausted as exc:
                    refused.append(str(exc))
        return Fetched(len(want), "complete")

    async def main():  # type: ignore[no-untyped-def]
        r = store.reserve(holder, ns, KeyRequest(hashes=chain(7, 10_000)), BLOCK)
        store.seal(holder, r.reservation_id)
        held = await store.lookup(ns, KeyRequest(hashes=chain(7, 10_000)), lease=True, session_id=holder)
        assert held.blocks == 7                   # one slot left: the stream's block 0 takes it
        return await streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=keys), 0, [], None, fetcher)

    end = asyncio.run(main())
    assert refused, "block 0 was evicted from under the stream"
    assert end.blocks == 1 and end.stop == "no_room", end
    assert exchange(store).held(ns, keys) == 1
    used = store.stats().tiers[0].used_bytes
    assert used == 8 * BLOCK and store.stats().index_blocks == 8, "a DRAM slot leaked"


def test_a_stream_hands_over_blocks_another_client_stored_while_it_asked_the_peers(
        env: tuple[BlockStore, Clock]) -> None:
    """Two decode requests stream the same prompt from a peer; the first one's blocks are sealed
    here while the second asks the peers who holds the rest. The second stream's next block
    was then found sealed in the index and taken for one "another client is writing": it
    stopped with no_room although the blocks were cached here, and the engine recomputed them."""
    from kvstored.handover import Arrival
    from kvstored.index import Tier
    store, _ = env
    other = store.open_session("first-request", 1).session_id
    reader = store.open_session("decode", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    keys = chain(3)
    asked: list[int] = []
    arrivals: list[Arrival] = []

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        asked.append(len(want))
        if len(asked) == 1:      # the peers are asked; meanwhile the other stream stores blocks 0-1
            r = store.reserve(other, ns, KeyRequest(hashes=keys[:2]), BLOCK)
            store.seal(other, r.reservation_id)
        for i in range(len(want)):
            try:
                view = await into(i, BLOCK)
            except KVStoreError as exc:                # as PeerNode.fetch reports it
                return Fetched(i, "no_room", str(exc))
            view[:] = bytes([i + 1]) * BLOCK
            await landed(i, "peer-a")
        return Fetched(len(want), "complete")

    async def main():  # type: ignore[no-untyped-def]
        return await streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=keys), 0, [], arrivals.append, fetcher)

    end = asyncio.run(main())
    assert end.stop == "complete" and end.blocks == 3, end
    assert [(a.index, a.tier) for a in arrivals] == [(0, Tier.DRAM), (1, Tier.DRAM), (2, Tier.PEER)]
    assert asked == [3, 1]                        # the peer is asked only for what is not here
    assert store.stats().peer_fetched_blocks == 1
    store.release(reader, end.lease_id)
    assert len(store.leasing.leases()) == 0 and not store.leasing.busy_leases()
    assert [store.catalog.get(ns).index.get(k).pins for k in keys] == [0, 0, 0]  # type: ignore[union-attr]


def test_a_stream_longer_than_dram_waits_for_its_blocks_copies_before_dropping_them(tmp_path: Path) -> None:
    """The blocks a stream into engine buffers would sink to SSD to make room may still be
    queued for, or in, their copy into the engine's buffers (a peer's blocks arrive faster than
    one batch is copied), hence pinned: none could give up its slot, and the stream stopped with
    no_room instead of waiting the moment it takes for the copy to end."""
    from kvstored_client import shm

    with _store_over_ssd(tmp_path, 8) as (store, _, copy), \
            contextlib.closing(shm.empty((10, BLOCK), "uint8")) as engine:
        reader = store.open_session("decode", 2).session_id
        ns = store.open_namespace(NS).namespace_id
        buffers = _register_rows(store, reader, ns, engine, 10)
        keys = chain(10)
        written_back = asyncio.Event()
        real_write_back, real_from_arena = store.writeback.write_back, copy.from_arena

        async def write_back(*args, **kwargs):  # type: ignore[no-untyped-def]
            try:
                return await real_write_back(*args, **kwargs)
            finally:
                written_back.set()

        async def from_arena(*args, **kwargs):  # type: ignore[no-untyped-def]
            await written_back.wait()   # the copy of the first batch ends after the blocks went to SSD
            return await real_from_arena(*args, **kwargs)

        store.writeback.write_back = write_back  # type: ignore[method-assign]
        copy.from_arena = from_arena  # type: ignore[method-assign]

        fetcher = _peer(first_byte=2, pause=False)   # the socket holds every block: no pause between them

        async def main():  # type: ignore[no-untyped-def]
            r = store.reserve(reader, ns, KeyRequest(hashes=keys[:1]), BLOCK)   # block 0 is local
            store.seal(reader, r.reservation_id)
            try:
                return await streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=keys), buffers.buffers_id,
                                                 list(range(10)), lambda a: None, fetcher)
            finally:
                await store.unregister_buffers(reader, buffers.buffers_id)
                await store.finish_background()

        end = asyncio.run(main())
        assert end.stop == "complete" and end.blocks == 10, end
        rows = engine.numpy()
        assert [int(rows[i][0]) for i in range(1, 10)] == list(range(2, 11))


@pytest.mark.parametrize("how", ["lease", "prefetch"])
def test_two_adjacent_corrupt_blocks_leave_the_index_without_an_error(ssd_env: tuple[BlockStore, Clock],
                                                                     how: str) -> None:
    """Two blocks of a prefix, parent and child, whose SSD copies both fail their checksum (a
    damaged stretch of the payload file). The lookup's clean-up walks the failed blocks deepest
    first: _remove_if_hollow(child) removes the child, then its hollow parent; the next step's
    _remove_if_hollow(parent) then removed a block no longer in the index: AssertionError (an
    internal error for the reader, the rest of the clean-up skipped)."""
    from kvstored.index import Tier
    store, _ = ssd_env
    s = store.open_session("holder", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)

    async def main() -> int:
        r = store.reserve(s, ns, KeyRequest(hashes=a), BLOCK)
        store.seal(s, r.reservation_id)
        assert await store.flush() == 2
        assert store.evict("", Tier.DRAM) == 2
        for key in a:
            _corrupt_on_disk(store, ns, key)
        if how == "lease":
            blocks = (await store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=s)).blocks
        else:
            blocks = (await store.lookup(ns, KeyRequest(hashes=a))).blocks   # prefetches in the background
        errors = [r for r in await asyncio.gather(*store.background.tasks(), return_exceptions=True)
                  if isinstance(r, BaseException)]
        assert not errors, errors
        await store.finish_background()
        return blocks

    blocks = asyncio.run(main())
    assert blocks == (0 if how == "lease" else 2)
    assert len(store.catalog.get(ns).index) == 0
    assert store.stats().dropped_blocks == 2 and store.stats().tiers[1].used_bytes == 0


@pytest.mark.parametrize("how", ["load", "lookup"])
def test_shutdown_waits_for_a_load_still_reading_from_ssd(ssd_env: tuple[BlockStore, Clock], how: str) -> None:
    """(review of the SIGTERM fix) Shutdown ends the sessions once quiesce() says no request is
    in flight, and it only looked at busy leases: a LoadBlocks (or a leased Lookup) whose blocks
    were still coming up from SSD holds a lease that is not busy yet, so quiesce() returned at
    once, the session's end took the lease, and the call that was in flight at SIGTERM reported
    a miss (0 blocks) instead of finishing, as the README promises in-flight calls do."""
    import threading

    from kvstored.index import Tier
    store, _ = ssd_env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    a = chain(2)
    gates: list[threading.Event] = []   # the SSD reads held (gate_ssd_read), set when they may end

    async def main() -> int:
        r = store.reserve(s, ns, KeyRequest(hashes=a), BLOCK)
        store.seal(s, r.reservation_id)
        assert await store.flush() == 2
        assert store.evict("", Tier.DRAM) == 2                 # on SSD only
        gates.append(gate_ssd_read(store))
        if how == "load":
            call = asyncio.ensure_future(store.load_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=a), [0, 1]))
        else:
            call = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=s))
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(store.promotion) and not call.done(), "the blocks should be on their way up from SSD"
        # SIGTERM, as app.serve does it: wait for the calls in flight, then end the sessions
        quiesce = asyncio.ensure_future(store.quiesce(5.0))
        await asyncio.sleep(0.05)
        gates[0].set()                                         # the SSD reads end
        assert await quiesce, "calls still in flight after the grace period"
        store.close_session(s)
        result = await call
        await store.finish_background()
        return len(result) if how == "load" else result.blocks  # type: ignore[union-attr, arg-type]

    try:
        assert asyncio.run(main()) == 2, "the call in flight at shutdown was cut off"
    finally:
        for gate in gates:
            gate.set()
        engine.close()


def test_a_checkout_cancelled_after_its_blocks_read_failed_leaves_no_hollow_leaf(
        ssd_env: tuple[BlockStore, Clock]) -> None:
    """(found by test_store_random) A peer's checkout of an SSD-only leaf whose read fails its
    checksum, cancelled (the peer gave up) once the read has failed but before the checkout
    resumed: _finish_promotion's _remove_if_hollow kept the block (the checkout's pin), and the
    checkout's ``except BaseException`` only dropped the pin: a hollow leaf stayed in the index
    for ever (never evicted: no tier's policy tracks it), as in _lookup_chain's fix above."""
    import concurrent.futures

    from kvstored.index import Tier
    from kvstored.tiers.ssd import Corrupt
    store, _ = ssd_env
    s = store.open_session("holder", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(1)
    ssd = store.ssd_tier
    assert ssd is not None
    read: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def main() -> None:
        r = store.reserve(s, ns, KeyRequest(hashes=a), BLOCK)
        store.seal(s, r.reservation_id)
        assert await store.flush() == 1
        assert store.evict("", Tier.DRAM) == 1
        ssd.read_into = lambda *args: read  # type: ignore[method-assign]
        block = store.catalog.get(ns).index.get(a[0])
        task = asyncio.ensure_future(exchange(store).checkout(ns, a[0]))
        for _ in range(100):
            await asyncio.sleep(0)
            if store.promotion.pending(block) is not None:
                break
        read.set_exception(Corrupt("checksum mismatch"))
        for _ in range(100):
            await asyncio.sleep(0)
            if store.promotion.pending(block) is None:
                break
        assert store.promotion.pending(block) is None and not task.done()
        task.cancel()                                   # the peer gave up
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.finish_background()

    asyncio.run(main())
    b = store.catalog.get(ns).index.get(a[0])
    assert b is None, f"hollow leaf left in the index (pins={b.pins}, readable={b.readable})"


def test_a_stream_cancelled_after_its_second_looks_read_failed_leaves_no_hollow_leaf(
        droppable_env: tuple[BlockStore, Clock]) -> None:
    """(found by test_store_random) Sibling of the test above: the stream is cancelled (the
    client left) once block 1's read from SSD, started by _fill_reservation's second look, has
    failed its checksum but before the stream resumed. The block is hollow, kept by the read
    lease's and the reservation's pins; the ends of both leases (_fetch_rest's ``except``,
    stream_blocks' ``finally``) only unpinned it: a hollow leaf stayed in the index for ever."""
    import concurrent.futures

    from kvstored.tiers.ssd import Corrupt
    store, _ = droppable_env
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)
    ssd = store.ssd_tier
    assert ssd is not None
    real_read = ssd.read_into
    read1: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        raise AssertionError("every block is held here")

    async def main() -> None:
        holder, lease = await _on_ssd_with_dram_leased(store, ns, a, 7)   # 7 of 8 leased: room for a[0] only
        ssd.read_into = lambda namespace_id, key, view: (  # type: ignore[method-assign]
            read1 if key == a[1] else real_read(namespace_id, key, view))
        block1 = store.catalog.get(ns).index.get(a[1])
        task = asyncio.ensure_future(streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=a), 0, [],
                                                         lambda arrival: None, fetcher))
        for _ in range(100):
            await asyncio.sleep(0)
            if len(store.promotion) or task.done():
                break
        assert len(store.promotion) and not task.done(), "a[0] should be on its way up from SSD"
        store.release(holder, lease)                           # room again, while the lookup waits
        for _ in range(500):
            await asyncio.sleep(0.001)
            if store.promotion.pending(block1) is not None or task.done():
                break
        assert store.promotion.pending(block1) is not None and not task.done(), "the second look should read a[1]"
        read1.set_exception(Corrupt("checksum mismatch"))
        for _ in range(100):
            await asyncio.sleep(0)
            if store.promotion.pending(block1) is None:
                break
        assert store.promotion.pending(block1) is None and not task.done()
        task.cancel()                                          # the client left
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.finish_background()

    asyncio.run(main())
    b = store.catalog.get(ns).index.get(a[1])
    assert b is None, f"hollow leaf left in the index (pins={b.pins}, readable={b.readable})"
    assert len(store.leasing.leases()) == 0 and not store.leasing.busy_leases()


def test_a_stream_whose_session_ends_during_its_lookup_leaves_no_lease(ssd_env: tuple[BlockStore, Clock]) -> None:
    """(found by test_store_random) An arena stream whose client's session ends while its lookup
    waits for a block to come up from SSD: the session's end takes the lookup's lease, so the
    stream pinned a fresh read lease on the ended session, leased the blocks the peer sent in
    it and kept it as the one handed over: nobody could release it (the session is gone), and
    its blocks stayed pinned until the reaper ended it a TTL later. Now the stream raises
    FailedPrecondition once its lookup returns, and asks no peer for the rest."""
    import concurrent.futures

    from kvstored.index import Tier
    from kvstored_client.contract.errors import FailedPrecondition
    store, _ = ssd_env
    s = store.open_session("holder", 1).session_id
    reader = store.open_session("reader", 2).session_id
    ns = store.open_namespace(NS).namespace_id
    a = chain(2)
    ssd = store.ssd_tier
    assert ssd is not None
    real_read = ssd.read_into
    read0: concurrent.futures.Future[None] = concurrent.futures.Future()
    held: dict[str, object] = {}
    asked: list[int] = []

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        asked.append(len(want))
        for i in range(len(want)):
            view = await into(i, BLOCK)
            view[:] = bytes([i + 7]) * BLOCK
            await landed(i, "peer-a")
        return Fetched(len(want), "complete")

    async def main():  # type: ignore[no-untyped-def]
        r = store.reserve(s, ns, KeyRequest(hashes=a[:1]), BLOCK)
        store.seal(s, r.reservation_id)
        assert await store.flush() == 1
        assert store.evict("", Tier.DRAM) == 1                 # a[0] lives on SSD only

        def read_into(namespace_id, key, view):  # type: ignore[no-untyped-def]
            held.update(args=(namespace_id, key, view))
            return read0
        ssd.read_into = read_into  # type: ignore[method-assign]
        task = asyncio.ensure_future(streamer(store).stream_blocks(reader, ns, KeyRequest(hashes=a), 0, [],
                                                         lambda arrival: None, fetcher))
        for _ in range(100):
            await asyncio.sleep(0)
            if len(store.promotion) or task.done():
                break
        assert len(store.promotion) and not task.done(), "a[0] should be on its way up from SSD"
        store.close_session(reader)                            # the client went away
        real_read(*held["args"]).result(5)                     # type: ignore[misc]
        read0.set_result(None)
        with pytest.raises(FailedPrecondition, match="closed during the stream"):
            await task
        await store.finish_background()

    asyncio.run(main())
    assert asked == [], f"a peer was asked for {asked} blocks for a session that had ended"
    assert len(store.leasing.leases()) == 0, "a lease of an ended session was left behind"
    assert all(b.pins == 0 for b in store.catalog.get(ns).index)


def test_a_call_that_starts_after_shutdown_quiesced_is_refused_not_cut_off(env: tuple[BlockStore, Clock]) -> None:
    """Found by tests/integration/test_sdk_random.py. Was: a SaveBlocks the server had taken
    before SIGTERM but whose handler ran only after quiesce() found nothing in flight started
    its copy, the session ended under it, and the engine got FailedPrecondition ("session closed
    or reservation expired during the copy"), a LeaseExpired to the SDK, for a daemon that was
    merely stopping; a leased lookup likewise lost its lease to the session's end. Now work
    that starts once shutdown began is refused: DaemonNotRunning (reason DAEMON_STOPPING), as the
    SDK raises it."""
    from kvstored_client.contract.errors import DaemonNotRunning
    store, _ = env
    s = store.open_session("engine", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    a = chain(2)

    async def main() -> None:
        assert await store.quiesce(1.0)   # SIGTERM with nothing in flight: the wait ends at once
        save = asyncio.ensure_future(store.save_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=a), [0, 1]))
        await asyncio.sleep(0)            # the handler runs before the sessions end
        store.close_session(s)
        with pytest.raises(DaemonNotRunning, match="stopping"):
            await save
        with pytest.raises(DaemonNotRunning, match="stopping"):
            store.reserve(s, ns, KeyRequest(hashes=a), BLOCK)
        with pytest.raises(DaemonNotRunning, match="stopping"):
            await store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=s)

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_no_copy_into_engine_buffers_starts_after_the_callers_deadline(env: tuple[BlockStore, Clock]) -> None:
    """Found by tests/integration/test_cluster_random.py. Was: a daemon frozen (SIGSTOP) or
    starved past a stream's deadline went on copying the blocks it had fetched into the engine's
    buffers once it ran again, after the engine's call had failed with DeadlineExceeded and the
    engine could be reusing those blocks for another request (its KV silently overwritten). Now
    the caller's deadline (``copy_until``) is checked right before each copy starts: a stream
    ends with DeadlineExceeded and the late block is not written; a load_blocks past it writes
    nothing; nothing stays leased."""
    from kvstored_client.contract.errors import DeadlineExceeded

    store, _ = env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    engine, buffers = _engine_buffers(store, s, ns)
    keys = chain(2)
    arrivals: list[int] = []

    async def fetcher(namespace_id, want, into, landed):  # type: ignore[no-untyped-def]
        for i in range(len(want)):
            view = await into(i, BLOCK)
            view[:] = bytes([i + 1]) * BLOCK
            if i == 1:
                await asyncio.sleep(0.3)   # the daemon stops running here, past the caller's deadline
            await landed(i, "peer-a")
        return Fetched(len(want), "complete")

    async def stream() -> None:
        until = asyncio.get_running_loop().time() + 0.15
        await streamer(store).stream_blocks(s, ns, KeyRequest(hashes=keys), buffers.buffers_id, [2, 3],
                                  lambda a: arrivals.append(a.index), fetcher, copy_until=until)

    async def load() -> None:   # both blocks are cached here now
        until = asyncio.get_running_loop().time() - 0.01
        await store.load_blocks(s, ns, buffers.buffers_id, KeyRequest(hashes=keys), [0, 1], copy_until=until)

    try:
        with pytest.raises(DeadlineExceeded):
            asyncio.run(stream())
        assert arrivals == [0] and (engine.numpy()[2] == 1).all()   # copied in time
        assert not engine.numpy()[3].any(), "block 1 was copied into the engine's buffers after the deadline"
        with pytest.raises(DeadlineExceeded):
            asyncio.run(load())
        assert not engine.numpy()[:2].any(), "load_blocks wrote the engine's buffers after the deadline"
        assert store.stats().active_leases == 0 and not store.leasing.busy_leases()
        assert buffers.busy == 0
    finally:
        engine.close()


def test_a_corrupt_block_two_peers_read_at_once_is_dropped_and_counted_once(
        ssd_env: tuple[BlockStore, Clock]) -> None:
    """Two peers fetch the same block while every DRAM slot is leased: each checkout reads its
    SSD copy into a buffer of its own, and both reads fail its checksum. The block is one block
    lost, but each failed read counted it as dropped again: `kvctl stats` said 2 dropped blocks
    (and any read more, one more) for one copy gone."""
    store, _ = ssd_env
    ns = store.open_namespace(NS).namespace_id
    a = chain(1)

    async def main() -> list[Any]:
        await _on_ssd_with_dram_leased(store, ns, a, 8)   # no DRAM slot: read into buffers of their own
        _corrupt_on_disk(store, ns, a[0])
        return list(await asyncio.gather(exchange(store).checkout(ns, a[0]), exchange(store).checkout(ns, a[0])))

    assert asyncio.run(main()) == [None, None]
    stats = store.stats()
    assert stats.tiers[1].read_errors == 2                       # two reads did fail ...
    assert stats.dropped_blocks == 1, stats.dropped_blocks        # ... of one block, lost once
    assert stats.tiers[1].blocks == 0 and stats.tiers[1].used_bytes == 0
    assert exchange(store).held(ns, a) == 0


@pytest.mark.parametrize("how", ["load", "save"])
def test_a_load_or_save_waits_for_a_prefetch_that_holds_every_dram_slot(ssd_env: tuple[BlockStore, Clock],
                                                                         how: str) -> None:
    """(found by the burst benchmark's restart check) Lookups of many prompts on SSD start
    promoting them in the background; while their reads were in flight they held every DRAM
    slot, and a load then found no slot, no write-back that could make one, and returned 0
    blocks of a prompt that lookup reported cached (a save, likewise, stored nothing). Both now
    wait for the prefetch to land (its blocks, with SSD copies, then give their slots up)."""
    import threading

    from kvstored.index import Tier
    store, _ = ssd_env
    s = store.open_session("decode", 1).session_id
    ns = store.open_namespace(NS).namespace_id
    a, b = chain(8), chain(2, start=100)
    gates: list[threading.Event] = []   # the SSD reads held (gate_ssd_read), set when they may end

    async def main() -> int:
        for keys in (a, b) if how == "load" else (a,):
            r = store.reserve(s, ns, KeyRequest(hashes=keys), BLOCK)
            store.seal(s, r.reservation_id)
            await store.flush()
            store.evict("", Tier.DRAM)
        assert store.stats().tiers[0].used_bytes == 0
        gates.append(gate_ssd_read(store, *a))
        assert (await store.lookup(ns, KeyRequest(hashes=a))).blocks == 8   # a prefetch of all 8 slots
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(store.promotion) == 8, "the prefetch should hold every DRAM slot"
        if how == "load":
            call = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=b), lease=True, session_id=s))
        else:
            call = asyncio.ensure_future(store.reserve_waiting(s, ns, KeyRequest(hashes=b), BLOCK))
        await asyncio.sleep(0.02)                               # (the harness's room wait: 0.05 s)
        gates[0].set()                                          # the prefetch's reads land
        result = await call
        await store.finish_background()
        return result.blocks if how == "load" else len(result.offsets)  # type: ignore[union-attr]

    try:
        assert asyncio.run(main()) == 2, f"the {how} gave up while a prefetch's reads were in flight"
    finally:
        for gate in gates:
            gate.set()
