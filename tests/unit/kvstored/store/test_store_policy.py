"""The store under each eviction policy: per-tier config honoured, leases and pins never evicted,
pages still drift between slot sizes, SSD admission by the policy."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from clock import Clock
from store_harness import chain, exchange, gate_ssd_read, open_store

from kvstored.index import Tier
from kvstored.policy.glide import GlidePolicy
from kvstored.policy.registry import POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import ResourceExhausted
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096  # bytes per block; pages of 16 KiB hold 4 blocks, the arena 8


@contextlib.contextmanager
def make_store(tmp_path: Path, dram: str, ssd: str | None = None, ssd_blocks: int = 8,
               admission: str = "always") -> Iterator[tuple[BlockStore, Clock]]:
    """An 8-block arena under policy ``dram``; with ``ssd``, an SSD tier of ``ssd_blocks`` blocks
    under that policy (evicting above 95% of it, down to 50%)."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 8 * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": dram},
        "ssd": {"enabled": ssd is not None, "capacity": ssd_blocks * BLOCK, "policy": ssd or "lru",
                "high_watermark": 0.95, "low_watermark": 0.5, "sync": False, "admission": admission}}
    with open_store(tmp_path, values, ssd is not None) as made:
        yield made


def save(store: BlockStore, sid: str, ns: int, keys: list[bytes]) -> int:
    r = store.reserve(sid, ns, KeyRequest(hashes=keys), BLOCK)
    return store.seal(sid, r.reservation_id)


def cached(store: BlockStore, ns: int, keys: list[bytes]) -> int:
    return asyncio.run(store.lookup(ns, KeyRequest(hashes=keys))).blocks


# Does a block hit twice survive a burst of never-hit blocks that fills the arena twice over?
SURVIVES = {"lru": False, "lfu": True, "credit": True, "adaptive": False,  # adaptive: LRU until it learns
            "duel": False,  # duel: LRU until its credit shadow is ahead
            "lecar": False,  # lecar: LRU until regrets weigh against it
            "glide": False}  # glide: LRU until its credit shadow is ahead, then a step at a time


@pytest.mark.parametrize("policy", POLICIES)
def test_dram_policy_decides_what_a_burst_evicts(tmp_path: Path, policy: str) -> None:
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        hot = chain(1, 999_000)
        save(store, s, ns, hot)
        for _ in range(2):
            clock.now += 1.0
            assert cached(store, ns, hot) == 1
        for i in range(16):  # one-block prompts, each read never
            clock.now += 1.0
            assert save(store, s, ns, chain(1, 1000 * i)) == 1  # DRAM admits every save
        assert cached(store, ns, hot) == int(SURVIVES[policy])
        assert store.stats().tiers[0].blocks == 8  # the arena stays full, nothing leaks


@pytest.mark.parametrize("policy", POLICIES)
def test_leaf_first_under_every_policy(tmp_path: Path, policy: str) -> None:
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns_state = store.open_namespace(Namespace())
        ns = ns_state.namespace_id
        long = chain(6)
        save(store, s, ns, long)
        clock.now += 1.0
        save(store, s, ns, chain(3, 50_000))  # needs one slot: the long chain's leaf goes
        assert cached(store, ns, long) == 5
        assert all(b.children <= 1 for b in ns_state.index)  # still chains: nothing orphaned


@pytest.mark.parametrize("policy", POLICIES)
def test_pins_and_leases_are_never_evicted(tmp_path: Path, policy: str) -> None:
    """Random saves, leased lookups and releases over a small arena: a leased block is always
    readable at its offset, and the arena never holds more than it can."""
    rng = random.Random(hash(policy) & 0xFFFF)
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns_state = store.open_namespace(Namespace())
        ns = ns_state.namespace_id
        prompts = [chain(rng.randrange(1, 4), 10_000 * p) for p in range(12)]
        held: list[tuple[int, list[bytes], list[int]]] = []
        for _ in range(300):
            clock.now += rng.random() * 50
            keys = rng.choice(prompts)
            op = rng.random()
            if op < 0.45:
                with contextlib.suppress(ResourceExhausted):  # every block that could go is leased
                    save(store, s, ns, keys)
            elif op < 0.75 and len(held) < 3:
                r = asyncio.run(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s))
                if r.blocks:
                    held.append((r.lease_id, keys[: r.blocks], r.offsets))
            elif op < 0.9:
                cached(store, ns, keys)
            elif held:
                store.release(s, held.pop(rng.randrange(len(held)))[0])
            for _, keys_held, offsets in held:
                for key, offset in zip(keys_held, offsets):
                    block = ns_state.index.get(key)
                    assert block is not None and block.offset == offset and block.pins > 0
            assert store.stats().tiers[0].used_bytes <= 8 * BLOCK
            for block in ns_state.index:
                assert block.parent is None or ns_state.index.get(block.parent.key) is block.parent
        assert store.stats().tiers[0].evictions > 20  # the arena was under pressure throughout


@pytest.mark.parametrize("policy", POLICIES)
def test_pages_drift_between_slot_sizes(tmp_path: Path, policy: str) -> None:
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        small = store.open_namespace(Namespace(model="small")).namespace_id
        big = store.open_namespace(Namespace(model="big")).namespace_id
        r = store.reserve(s, small, KeyRequest(hashes=chain(8)), 1024)
        store.seal(s, r.reservation_id)  # 8 x 1 KiB: half of page 0
        for round_ in range(4):  # the big size keeps working; small is never used again
            clock.now += 1.0
            r = store.reserve(s, big, KeyRequest(hashes=chain(4, 1000 * round_)), BLOCK)
            assert len(r.offsets) == 4
            store.seal(s, r.reservation_id)
        assert cached(store, small, chain(8)) == 0  # its page went to big
        assert cached(store, big, chain(4, 3000)) == 4
        assert cached(store, big, chain(4, 2000)) == 4  # two pages of big now


def _small_and_big(store: BlockStore) -> tuple[int, int]:
    small = store.open_namespace(Namespace(model="small")).namespace_id
    big = store.open_namespace(Namespace(model="big")).namespace_id
    return small, big


@pytest.mark.parametrize("policy", POLICIES)
def test_a_page_that_cannot_empty_loses_no_block_to_another_size(tmp_path: Path, policy: str) -> None:
    """Both pages hold big blocks, each page one leased: no page can go to the small size, so a
    small save is refused (nothing else can make room) and no big block is dropped for nothing."""
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        small, big = _small_and_big(store)
        chains = [chain(4, 1000), chain(4, 2000)]   # a page each
        for keys in chains:
            clock.now += 1.0
            save(store, s, big, keys)
        for keys in chains:   # each page's first block leased: its page cannot empty
            assert asyncio.run(store.lookup(big, KeyRequest(hashes=keys[:1]), lease=True, session_id=s)).blocks == 1
        clock.now += 1.0
        with pytest.raises(ResourceExhausted):
            store.reserve(s, small, KeyRequest(hashes=chain(1, 9000)), 1024)
        assert store.stats().dropped_blocks == 0
        assert [cached(store, big, keys) for keys in chains] == [4, 4]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_size_whose_pages_cannot_empty_leaves_the_other_to_evict_its_own(tmp_path: Path, policy: str) -> None:
    """The big page was used longer ago than the small one but holds a leased block: a small save
    evicts a small block, not the big page's unleased ones."""
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        small, big = _small_and_big(store)
        big_keys = chain(4, 1000)
        save(store, s, big, big_keys)
        assert asyncio.run(store.lookup(big, KeyRequest(hashes=big_keys[:1]), lease=True, session_id=s)).blocks == 1
        clock.now += 1.0
        r = store.reserve(s, small, KeyRequest(hashes=chain(16, 5000)), 1024)   # the other page, full
        assert store.seal(s, r.reservation_id) == 16
        clock.now += 1.0
        r = store.reserve(s, small, KeyRequest(hashes=chain(1, 9000)), 1024)
        assert store.seal(s, r.reservation_id) == 1
        assert store.stats().dropped_blocks == 1   # the small chain's leaf
        assert cached(store, big, big_keys) == 4
        assert cached(store, small, chain(16, 5000)) == 15


@pytest.mark.parametrize("policy", POLICIES)
def test_a_page_goes_to_another_size_whole(tmp_path: Path, policy: str) -> None:
    """Big one-block prompts fill both pages, hit alternately page by page: a small save takes the
    page used least recently, in one step, and drops its four blocks only (not the other page's,
    evicted in the policy's order until some page empties)."""
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        small, big = _small_and_big(store)
        prompts = [chain(1, 1000 * i) for i in range(8)]   # 0-3 in one page, 4-7 in the other
        for keys in prompts:
            clock.now += 1.0
            save(store, s, big, keys)
        for i in (0, 4, 1, 5, 2, 6, 3, 7):
            clock.now += 1.0
            assert cached(store, big, prompts[i]) == 1
        clock.now += 1.0
        r = store.reserve(s, small, KeyRequest(hashes=chain(1, 9000)), 1024)
        assert store.seal(s, r.reservation_id) == 1
        assert store.stats().dropped_blocks == 4
        assert [cached(store, big, keys) for keys in prompts] == [0] * 4 + [1] * 4
        assert store.stats().tiers[0].blocks == 5


@pytest.mark.parametrize("policy", POLICIES)
def test_pages_whose_chains_cross_each_other_still_drift(tmp_path: Path, policy: str) -> None:
    """Chain x starts in page 0 and goes on in page 1, chain y the other way round: neither page
    can empty alone, nothing is leased, and a small save still gets a page (block by block, as
    when no page could go whole)."""
    with make_store(tmp_path, dram=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        small, big = _small_and_big(store)
        x, y = chain(2, 1000), chain(2, 2000)
        holes = []
        for page in range(2):   # page 0: x0, a hole, two fillers; page 1: y0, a hole, two fillers
            clock.now += 1.0
            save(store, s, big, (x, y)[page][:1])
            holes.append(store.reserve(s, big, KeyRequest(hashes=chain(1, 5000 + page)), BLOCK).reservation_id)
            for k in range(2):
                save(store, s, big, chain(1, 6000 + 10 * page + k))
        for reservation in holes:
            store.release(s, reservation, reservation_only=True)
        save(store, s, big, y)   # y1 into page 0's hole
        save(store, s, big, x)   # x1 into page 1's
        page_bytes = store.placement.dram.page_bytes
        index = store.catalog.get(big).index
        assert [[index.get(k).offset // page_bytes for k in keys] for keys in (x, y)] == [[0, 1], [1, 0]]  # type: ignore[union-attr]
        clock.now += 1.0
        r = store.reserve(s, small, KeyRequest(hashes=chain(1, 9000)), 1024)
        assert store.seal(s, r.reservation_id) == 1
        assert 4 <= store.stats().dropped_blocks < 8
        _check_pages(store)


def _check_pages(store: BlockStore) -> None:
    """Each page knows the blocks holding its slots, and no others; the index has no orphan."""
    page_bytes = store.placement.dram.page_bytes
    in_dram = 0
    for state in store.catalog:
        for block in state.index:
            assert block.parent is None or state.index.get(block.parent.key) is block.parent
            if block.in_dram:
                in_dram += 1
                assert block in store.placement.dram.page_blocks(block.offset // page_bytes)
    assert sum(len(store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages)) == in_dram
    for page, blocks in ((p, store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages)):
        assert len(blocks) == store.placement.dram.used_slots(page)


@pytest.mark.parametrize("policy", POLICIES)
def test_pages_drift_under_churn_of_two_sizes(tmp_path: Path, policy: str) -> None:
    """Random saves of branching chains of two sizes, leased lookups, releases and write-backs:
    pages change size whole, leased blocks stay where they were read, nothing is orphaned."""
    rng = random.Random(hash(policy) & 0xFFFF)
    with make_store(tmp_path, dram=policy, ssd="lru", ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        small, big = _small_and_big(store)
        sizes = {small: 1024, big: BLOCK}
        held: list[tuple[int, int, list[bytes], list[int]]] = []
        prefixes = [list(range(p * 1000, p * 1000 + 16 * 3)) for p in range(3)]

        async def lookup_and_drain(ns: int, keys: list[bytes], lease: bool) -> tuple[int, int, list[int]]:
            r = await store.lookup(ns, KeyRequest(hashes=keys), lease=lease, session_id=s if lease else "")
            await store.finish_background()
            return r.blocks, r.lease_id, list(r.offsets)

        for _ in range(300):
            clock.now += rng.random() * 10
            ns = rng.choice((small, big))
            tokens = prefixes[rng.randrange(3)][: 16 * rng.randrange(1, 4)]   # shared prefixes: trees
            keys = block_hashes(tokens + [rng.randrange(50_000) for _ in range(16 * rng.randrange(0, 3))])
            op = rng.random()
            if op < 0.5:
                with contextlib.suppress(ResourceExhausted):
                    r = store.reserve(s, ns, KeyRequest(hashes=keys), sizes[ns])
                    store.seal(s, r.reservation_id)
            elif op < 0.7 and len(held) < 2:
                n, lease_id, offsets = asyncio.run(lookup_and_drain(ns, keys, True))
                if n:
                    held.append((ns, lease_id, keys[:n], offsets))
            elif op < 0.8:
                asyncio.run(lookup_and_drain(ns, keys, False))
            elif op < 0.9:
                asyncio.run(store.flush())
            elif held:
                store.release(s, held.pop(rng.randrange(len(held)))[1])
            for ns_held, _, keys_held, offsets in held:
                for key, offset in zip(keys_held, offsets):
                    block = store.catalog.get(ns_held).index.get(key)
                    assert block is not None and block.offset == offset and block.pins > 0
            _check_pages(store)
        stats = store.stats()
        assert stats.tiers[0].evictions > 20  # the arena was under pressure throughout


def _hit_on_ssd(store: BlockStore, ns: int, keys: list[bytes]) -> None:
    """Look ``keys`` up while they are on SSD only: a hit, and a promotion to DRAM, awaited."""
    async def run() -> None:
        await store.lookup(ns, KeyRequest(hashes=keys))
        await store.finish_background()
    asyncio.run(run())
    assert asyncio.run(store.lookup(ns, KeyRequest(hashes=keys))).tiers == [Tier.DRAM] * len(keys)


def _to_ssd_only(store: BlockStore, s: str, ns: int, keys: list[bytes]) -> None:
    """Store ``keys`` and leave them on SSD only (written down, then dropped from DRAM)."""
    save(store, s, ns, keys)
    asyncio.run(store.flush())
    store.evict(tier=Tier.DRAM)


def _reused_then_to_ssd_only(store: BlockStore, clock: Clock, s: str, ns: int, keys: list[bytes]) -> None:
    """Store ``keys``, hit the whole prefix twice in DRAM (a second apart), then leave it on SSD only."""
    save(store, s, ns, keys)
    for _ in range(2):
        clock.now += 1.0
        assert cached(store, ns, keys) == len(keys)
    asyncio.run(store.flush())
    store.evict(tier=Tier.DRAM)


@pytest.mark.parametrize("policy", POLICIES)
def test_ssd_policy_is_its_own(tmp_path: Path, policy: str) -> None:
    """The SSD tier follows ``ssd.policy`` whatever ``dram.policy`` says: a block that came back
    from DRAM after a hit keeps it on SSD under credit and LFU, not under LRU (blind to hits)."""
    with make_store(tmp_path, dram="lru", ssd=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        hot = chain(1, 999_000)
        _to_ssd_only(store, s, ns, hot)
        _hit_on_ssd(store, ns, hot)
        store.evict(tier=Tier.DRAM)  # back on SSD only
        for i in range(10):  # the SSD tier holds 7 blocks at most
            clock.now += 1.0
            _to_ssd_only(store, s, ns, chain(1, 1000 * i))
        assert store.stats().tiers[1].used_bytes <= 0.95 * 8 * BLOCK
        # duel and glide are leaf-only LRU until their shadow caches show credit ahead, lecar until
        # LRU's choices cost it misses: too few blocks here
        assert cached(store, ns, hot) == int(policy not in ("lru", "duel", "lecar", "glide"))


@pytest.mark.parametrize("policy", POLICIES)
def test_ssd_admission_is_the_policys(tmp_path: Path, policy: str) -> None:
    """A write-back round (not a flush) asks the SSD policy: credit refuses a block that would
    evict one worth more, and the refused block just stays in DRAM without a copy."""
    with make_store(tmp_path, dram="lru", ssd=policy, ssd_blocks=2) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        hot = chain(1, 999_000)
        _to_ssd_only(store, s, ns, hot)
        _hit_on_ssd(store, ns, hot)   # credit: reused
        store.evict(tier=Tier.DRAM)  # back on SSD only
        assert store.stats().tiers[1].blocks == 1
        new = chain(1, 5000)
        save(store, s, ns, new)
        clock.now += 1.0
        written = asyncio.run(store.writeback.write_back(float(BLOCK), force=False, models=None))
        # adaptive gives credit too: the hot block came back to this tier after being used in
        # DRAM, a reused block's return, which is what its learned weight counts
        refuses = policy in ("credit", "adaptive")
        assert written == int(not refuses)
        assert cached(store, ns, new) == 1 and cached(store, ns, hot) == int(refuses)


def test_a_cancelled_reader_does_not_cancel_a_shared_promotion(tmp_path: Path) -> None:
    """Regression (code review): two readers waited on one SSD promotion; cancelling one (a peer
    transfer given up, a client gone) cancelled the promotion itself, failed the other reader and
    left the block pinned for ever."""
    with make_store(tmp_path, dram="lru", ssd="lru") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(1, 777_000)
        _to_ssd_only(store, s, ns, keys)

        async def run() -> None:
            first = asyncio.ensure_future(exchange(store).checkout(ns, keys[0]))
            second = asyncio.ensure_future(exchange(store).checkout(ns, keys[0]))
            await asyncio.sleep(0)          # both are waiting on the same read from SSD
            first.cancel()
            served = await second
            assert served is not None and bytes(served[0]) != b"", "the other reader lost its block"
            exchange(store).checkin(ns, keys[0])
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await store.finish_background()

        asyncio.run(run())
        block = store.catalog.get(ns).index.get(keys[0])
        assert block is not None and block.pins == 0 and block.in_dram   # nothing left pinned
        assert store.evict(tier=Tier.DRAM) == 1


def test_flush_waits_for_a_write_back_already_under_way(tmp_path: Path) -> None:
    """Regression (code review): a flush skipped the blocks another write-back was writing and
    then counted them as 'still only in DRAM' (ResourceExhausted on a healthy node)."""
    with make_store(tmp_path, dram="lru", ssd="lru") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        save(store, s, ns, chain(4, 888_000))

        async def run() -> int:
            background = asyncio.ensure_future(store.writeback.write_back(float("inf"), True, {ns}))
            await asyncio.sleep(0)          # the background round has marked its blocks
            flushed = await store.flush()
            return flushed + await background

        assert asyncio.run(run()) == 4
        assert all(b.on_ssd for b in store.catalog.get(ns).index)


def test_a_lease_ended_while_its_blocks_come_up_from_ssd_leaves_no_pin_behind(tmp_path: Path) -> None:
    """A leasing lookup whose blocks come up from SSD, with DRAM room for only part of the prefix,
    while its session closes (the client died) or the lease is reaped: the session close unpins
    the lease's blocks, then the lookup unpins the blocks past the cut a second time (store.py
    _lookup_chain: ``for block in hits[n:]: block.pins -= 1`` without checking that the lease
    is still live). A block left with pins == -1 can never be evicted, and the next lease that
    pins it brings it to 0 (evictable) while that reader still copies it."""
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=64) as (store, _):
        holder = store.open_session("holder", 1).session_id
        reader = store.open_session("reader", 2).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        a = chain(2)
        save(store, holder, ns, a)

        async def main() -> None:
            assert await store.flush() == 2
            assert store.evict("", Tier.DRAM) == 2            # a lives on SSD only
            others = chain(7, 10_000)
            assert save(store, holder, ns, others) == 7
            await store.lookup(ns, KeyRequest(hashes=others), lease=True, session_id=holder)  # 7 of 8 slots pinned
            task = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=a), lease=True, session_id=reader))
            for _ in range(100):
                await asyncio.sleep(0)
                if len(store.promotion) or task.done():
                    break
            assert len(store.promotion) and not task.done(), "block 0 should be on its way up from SSD"
            store.close_session(reader)                       # the client went away meanwhile
            r = await task
            assert r.blocks == 0

        asyncio.run(main())
        pins = [store.catalog.get(ns).index.get(k).pins for k in a]  # type: ignore[union-attr]
        assert pins == [0, 0], f"pins after the lease ended: {pins}"


def test_a_load_blocks_racing_unregister_never_reports_blocks_it_did_not_copy(tmp_path: Path) -> None:
    """load_blocks looks the buffers up, then awaits the SSD promotion of the prefix; an
    unregister_buffers meanwhile finds no copy in flight (busy == 0), closes the buffers (their
    ``tensors`` become []) and returns. The load then 'copies' over no tensors and reports every
    block loaded: the engine computes on KV that was never written."""
    from kvstored.buffers import TensorSource
    from kvstored_client import shm
    from kvstored_client.contract.errors import KVStoreError
    from kvstored_client.contract.layout import TensorLayout

    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=64) as (store, _):
        s = store.open_session("engine", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        src, dst = shm.empty((4, BLOCK), "uint8"), shm.empty((4, BLOCK), "uint8")
        src.numpy()[...] = 9
        layout = TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0)
        b_src = store.register_buffers(s, ns, [TensorSource(src.name, 0, layout)])
        b_dst = store.register_buffers(s, ns, [TensorSource(dst.name, 0, layout)])
        keys = KeyRequest(hashes=chain(2))

        async def main() -> list[object] | None:
            assert await store.save_blocks(s, ns, b_src.buffers_id, keys, [0, 1]) == (0, 2)
            assert await store.flush() == 2
            assert store.evict("", Tier.DRAM) == 2        # the prefix is on SSD only
            task = asyncio.ensure_future(store.load_blocks(s, ns, b_dst.buffers_id, keys, [2, 3]))
            for _ in range(100):
                await asyncio.sleep(0)
                if len(store.promotion) or task.done():
                    break
            assert len(store.promotion) and not task.done(), "the load should be waiting for SSD reads"
            await store.unregister_buffers(s, b_dst.buffers_id)   # returns at once: busy == 0
            try:
                return await task   # type: ignore[return-value]
            except KVStoreError:
                return None          # refusing the load is fine

        try:
            tiers = asyncio.run(main())
            if tiers is not None:
                assert len(tiers) == 2
                assert (dst.numpy()[2:4] == 9).all(), (
                    "load_blocks reported 2 blocks loaded but copied nothing into the buffers")
        finally:
            src.close()
            dst.close()


def test_ssd_admission_refusing_a_parent_does_not_strand_it_in_dram(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ssd.admission = cost judges each block by its depth alone (Llama-3-8B, 16-token blocks:
    admitted from depth 1800, i.e. 28.8k tokens in), so write-back stores the tail of a long
    prompt on SSD and never its head (store.py _write_back: a refused block does not end the
    chain, unlike BlockPolicy.admit's contract). The head then has no SSD copy and children in
    the index, so DramResidency.can_evict refuses it for as long as the tail stays on SSD: long prompts
    fill DRAM with blocks nothing can evict, and saves store less and less (then fail)."""
    from kvstored.policy import cost
    # the cost model's depth threshold, scaled down from 1800 blocks to 1
    monkeypatch.setattr(cost, "admit_block", lambda spec, depth, model=None: depth >= 1)
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=64, admission="cost") as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        for i in range(8):   # long prompts, each read never again
            clock.now += 1.0
            save(store, s, ns, chain(2, 1000 * i))
            asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        clock.now += 1.0
        # the arena holds 8 blocks, all of them long unused: a new 2-block prompt must fit
        assert save(store, s, ns, chain(2, 999_000)) == 2, "DRAM is stuck full of heads nothing can evict"


def test_a_hit_on_a_prefix_that_starts_on_ssd_and_ends_in_dram_reaches_the_policies(tmp_path: Path) -> None:
    """store.py _hit tells the DRAM policy only when the prefix's first block is in DRAM and the
    SSD policy only when its last block is not, assuming a DRAM-resident prefix is closed under
    ancestors. It is not: a peer's checkout brings one deep block up alone (and a stream's
    _drop_clean_slots frees the head of a chain first). A lookup of A, B (SSD only), C (DRAM)
    then reaches neither policy, and C is evicted as if it had not just been read."""
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=64, admission="never") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        abc = chain(3)
        _to_ssd_only(store, s, ns, abc)
        d = chain(1, 5000)

        async def main() -> None:
            assert await exchange(store).checkout(ns, abc[2]) is not None   # a peer reads C: C alone comes up
            exchange(store).checkin(ns, abc[2])
            await store.finish_background()
            save(store, s, ns, d)                                 # D: stored after C came up
            r = await store.lookup(ns, KeyRequest(hashes=abc))     # then A, B, C are read
            assert r.tiers == [Tier.SSD, Tier.SSD, Tier.DRAM]
            await store.finish_background()                                   # (A and B are prefetched)
            save(store, s, ns, chain(4, 9000))                    # the arena is full now
            save(store, s, ns, chain(1, 7000))                    # one leaf must go: D, not C

        asyncio.run(main())
        c = store.catalog.get(ns).index.get(abc[2])
        assert c is not None and c.in_dram, "C was evicted although it was read after D was stored"
        assert cached(store, ns, d) == 0


def test_a_refused_head_too_big_for_the_ssd_tier_does_not_empty_it(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """(review of 1673d75) write-back takes a refused block's ancestors with an admitted
    descendant, so one round's total is no longer bounded by the batch cap (the gap between the
    watermarks): a long chain whose admitted block sits deeper than the SSD tier holds asks
    _make_ssd_room for more than the high watermark. It evicts every SSD-only block trying,
    then fails, and nothing is written: every round wipes the tier again."""
    from kvstored.policy import cost
    monkeypatch.setattr(cost, "admit_block", lambda spec, depth, model=None: depth >= 4)
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=4, admission="cost") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        x = chain(1, 50_000)
        _to_ssd_only(store, s, ns, x)                   # an SSD-only block worth keeping
        assert store.catalog.get(ns).index.get(x[0]).on_ssd
        save(store, s, ns, chain(6))                     # depth 4 and 5 admitted; 0..3 refused
        asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert store.catalog.get(ns).index.get(x[0]) is not None, \
            "write-back emptied the SSD tier for a round it could not make room for"


def test_a_run_whose_ancestors_on_ssd_leave_it_no_room_does_not_empty_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(review of e133f56) the too-big check weighs the run against the whole high watermark, but
    the run's ancestors already on SSD cannot leave it (they are not leaves while the run hangs
    under them): a run that fits the watermark alone but not beside its ancestors still makes
    _make_ssd_room evict every other SSD-only block, then fail, and nothing is written."""
    from kvstored.policy import cost
    monkeypatch.setattr(cost, "admit_block", lambda spec, depth, model=None: depth >= 7)
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=8, admission="cost") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        long = chain(8)
        x = chain(1, 50_000)
        save(store, s, ns, long[:3])
        _to_ssd_only(store, s, ns, x)                    # the head (3 blocks) and x: SSD only
        idx = store.catalog.get(ns).index
        assert idx.get(x[0]).on_ssd and all(idx.get(k).on_ssd and not idx.get(k).in_dram for k in long[:3])
        save(store, s, ns, long)                         # depth 3..7 in DRAM; 7 admitted, 3..6 refused
        # 3 (ancestors, stay) + 5 (the run) blocks > 7.6 (95% of 8): the run can never be written
        asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert idx.get(x[0]) is not None, \
            "write-back emptied the SSD tier for a round it could not make room for"


def test_a_round_counts_the_blocks_it_picked_above_a_run_as_held(tmp_path: Path) -> None:
    """(review of ca0006f) under the default admission a chain's DRAM blocks go one run each, and
    each run is weighed beside its ancestors already on SSD but not beside those picked earlier in
    the same round: 5 on SSD + 3 picked = 8 blocks > 7.6 (95% of 8), so _make_ssd_room evicts the
    other SSD-only block, fails, and nothing is written (every round again)."""
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=8) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        long = chain(8)
        x = chain(1, 50_000)
        save(store, s, ns, long[:5])
        _to_ssd_only(store, s, ns, x)                    # long[:5] and x: SSD only (6 blocks)
        idx = store.catalog.get(ns).index
        save(store, s, ns, long)                         # long[5:]: 3 blocks in DRAM, one run each
        written = asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert written or idx.get(x[0]) is not None, \
            "write-back emptied the SSD tier for a round it could not make room for"


def test_a_round_counts_the_ssd_ancestors_of_all_its_runs(tmp_path: Path) -> None:
    """(review of ca0006f) two chains, each with 3 blocks on SSD and 1 in DRAM: each run fits
    beside its own ancestors (1 + 3 <= 7.6), but the round needs 3 + 3 + 2 = 8 blocks."""
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=8) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        a, b = chain(4, 10_000), chain(4, 20_000)
        x = chain(1, 50_000)
        save(store, s, ns, a[:3])
        save(store, s, ns, b[:3])
        _to_ssd_only(store, s, ns, x)                    # 7 blocks on SSD only
        idx = store.catalog.get(ns).index
        save(store, s, ns, a)
        save(store, s, ns, b)
        written = asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert written or idx.get(x[0]) is not None, \
            "write-back emptied the SSD tier for a round it could not make room for"


def test_ssd_ancestors_held_by_another_chain_do_not_make_a_round_empty_the_tier(
        tmp_path: Path) -> None:
    """(review of ca0006f) under hit_before a chain's new, never-hit suffix stays in DRAM and holds
    its ancestors on SSD (not leaves): a round of another chain that fits beside its own ancestors
    does not fit beside those, and _make_ssd_room evicts every other SSD-only block, then fails."""
    with make_store(tmp_path, dram="lru", ssd="lru", ssd_blocks=8, admission="hit_before") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        held = chain(6, 10_000)
        x = chain(1, 50_000)
        save(store, s, ns, held[:5])
        _to_ssd_only(store, s, ns, x)                    # held[:5] and x: SSD only (6 blocks)
        idx = store.catalog.get(ns).index
        save(store, s, ns, held)                         # held[5]: DRAM, never hit (refused)
        y = chain(3, 30_000)
        save(store, s, ns, y)
        hit = asyncio.run(store.lookup(ns, KeyRequest(hashes=y)))   # y: hit, admitted
        assert hit.blocks == 3
        written = asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert written or idx.get(x[0]) is not None, \
            "write-back emptied the SSD tier for a round it could not make room for"


def test_a_promotion_whose_read_cannot_start_frees_its_slot_and_its_waiters(tmp_path: Path) -> None:
    """SSDTier.read_into raises at once once its reads are stopped (the daemon stopping):
    _ensure_dram had already given the block a slot and registered the promotion, so the block
    stayed 'promoting' for ever with the slot: the next reader waited on it for ever, and the
    block could never be evicted again. The read counts as failed: the slot goes back, the block
    stays on SSD."""
    with make_store(tmp_path, dram="lru", ssd="lru") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(2, 555_000)
        _to_ssd_only(store, s, ns, keys)
        assert store.ssd_tier is not None
        store.ssd_tier.stop_reads()

        async def run() -> None:
            r = await asyncio.wait_for(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s), 30)
            assert r.blocks == 0
            second = await asyncio.wait_for(exchange(store).checkout(ns, keys[0]), 30)   # was: waited for ever
            assert second is None
            await asyncio.wait_for(store.finish_background(), 30)

        asyncio.run(run())
        assert not len(store.promotion)
        blocks = [store.catalog.get(ns).index.get(k) for k in keys]
        assert all(b is not None and b.pins == 0 and not b.in_dram and b.on_ssd for b in blocks)
        assert store.stats().tiers[0].used_bytes == 0, "a slot was kept by a promotion that never started"
        assert store.stats().tiers[1].blocks == 2 and store.evict(tier=Tier.SSD) == 2


LONG = 100   # blocks of a prompt whose promotions take several steps to set up (32 a step)


@contextlib.contextmanager
def long_prompt_on_ssd(tmp_path: Path) -> Iterator[tuple[BlockStore, str, int, list[bytes], list[bytes]]]:
    """A store holding a LONG-block prompt on SSD only; the reads its SSD tier is asked for are
    listed (by key) as they are queued: (store, session, namespace, the prompt's keys, reads)."""
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": 2 * LONG * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False, "policy": "lru"},
        "ssd": {"enabled": True, "capacity": 4 * LONG * BLOCK, "policy": "lru", "sync": False}}
    with open_store(tmp_path, values, True) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(LONG, 700_000)
        _to_ssd_only(store, s, ns, keys)
        assert store.ssd_tier is not None
        real, queued = store.ssd_tier.read_into, []

        def counted(namespace_id, key, view):  # type: ignore[no-untyped-def]
            queued.append(key)
            return real(namespace_id, key, view)
        store.ssd_tier.read_into = counted  # type: ignore[method-assign]
        yield store, s, ns, keys, queued


def test_other_calls_run_while_a_long_prompt_is_set_up_to_come_up_from_ssd(tmp_path: Path) -> None:
    """Setting up every promotion of a long prompt in one step held the event loop (~35 us a block
    here: 70 ms for 2,048 blocks), and every other client's call waited; it now yields between
    steps while the reads queued so far go on."""
    with long_prompt_on_ssd(tmp_path) as (store, s, ns, keys, queued):
        async def run() -> tuple[int, int]:
            lookup = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s))
            seen: list[int] = []

            async def other_client() -> None:   # a call that arrives as the lookup starts
                seen.append(len(queued))
            await asyncio.gather(lookup, other_client())
            return lookup.result().blocks, seen[0]
        found, queued_when_other_ran = asyncio.run(run())
        assert found == LONG
        assert 0 < queued_when_other_ran < LONG, f"the other call ran after {queued_when_other_ran} reads"
        assert len(queued) == LONG


@pytest.mark.parametrize("how", ["lease ended", "cancelled"])
def test_a_lookup_that_ends_between_set_up_steps_queues_no_more_reads_and_leaves_its_slots_evictable(
        tmp_path: Path, how: str) -> None:
    """Its session closed (its lease ended) or the lookup cancelled while it yields between steps:
    no more reads are queued, and the blocks already coming up are handed to the DRAM policy
    all the same (a slot the policy never learns of could never be evicted)."""
    with long_prompt_on_ssd(tmp_path) as (store, s, ns, keys, queued):
        async def run() -> int | None:
            lookup = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s))

            async def meanwhile() -> None:
                if how == "cancelled":
                    lookup.cancel()
                else:
                    store.close_session(s)
            await asyncio.gather(meanwhile(), return_exceptions=True)
            found = None
            try:
                found = (await lookup).blocks
            except asyncio.CancelledError:
                pass
            await asyncio.wait_for(store.finish_background(), 30)
            return found
        found = asyncio.run(run())
        assert found == (None if how == "cancelled" else 0)
        assert 0 < len(queued) < LONG, f"{len(queued)} reads were queued"
        blocks = [store.catalog.get(ns).index.get(k) for k in keys]
        assert all(b is not None and b.pins == 0 and b.on_ssd for b in blocks)
        assert not len(store.promotion)
        promoted = [b for b in blocks if b is not None and b.in_dram]
        assert len(promoted) == len(queued)
        assert all(b in store.placement.dram.policy_for(b) for b in promoted), \
            "a promoted block is not in the DRAM policy"
        assert store.evict(tier=Tier.DRAM) == len(queued)
        assert store.stats().tiers[0].used_bytes == 0


def test_the_first_blocks_of_a_long_prompt_are_reported_in_dram_while_later_reads_are_set_up(tmp_path: Path) -> None:
    """A load or a stream into engine buffers copies blocks out as they land (``prefix_up``);
    with the set-up in steps, the blocks landed by the end of a step are reported then, not
    only once the last read is set up."""
    with long_prompt_on_ssd(tmp_path) as (store, s, ns, keys, queued):
        assert store.ssd_tier is not None
        counted = store.ssd_tier.read_into

        def landed_at_once(namespace_id, key, view):  # type: ignore[no-untyped-def]
            read = counted(namespace_id, key, view)
            read.result(10)   # in place before the lookup's next step
            return read
        store.ssd_tier.read_into = landed_at_once  # type: ignore[method-assign]
        reports: list[tuple[int, int]] = []

        async def run() -> int:
            found = await store.reads.lookup_chain(store.catalog.get(ns), keys, store.leasing.session(s),
                                              lambda hits, tiers, k: reports.append((k, len(queued))))
            store.release(s, found.lease_id)
            await asyncio.wait_for(store.finish_background(), 30)
            return found.blocks
        assert asyncio.run(run()) == LONG
        assert reports and reports[0][1] < LONG, f"the first report came after {reports[0][1]} reads were set up"
        assert [k for k, _ in reports] == sorted({k for k, _ in reports}) and reports[-1][0] <= LONG, reports


def test_a_read_found_failed_at_a_set_up_step_stops_the_set_up_there(tmp_path: Path) -> None:
    """Block 5's copy is corrupt: the lookup ends at block 5, so reading the blocks past the next
    step would only fill DRAM with blocks hanging under a hollow one."""
    from concurrent.futures import Future

    from kvstored.tiers.ssd import Corrupt
    with long_prompt_on_ssd(tmp_path) as (store, s, ns, keys, queued):
        assert store.ssd_tier is not None
        counted = store.ssd_tier.read_into

        def fifth_corrupt(namespace_id, key, view):  # type: ignore[no-untyped-def]
            if key == keys[5]:
                queued.append(key)
                failed: Future[int] = Future()
                failed.set_exception(Corrupt("checksum mismatch"))
                return failed
            read = counted(namespace_id, key, view)
            read.result(10)
            return read
        store.ssd_tier.read_into = fifth_corrupt  # type: ignore[method-assign]

        async def run() -> int:
            found = await store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s)
            store.release(s, found.lease_id)
            await asyncio.wait_for(store.finish_background(), 30)
            return found.blocks
        assert asyncio.run(run()) == 5
        assert len(queued) < LONG, f"{len(queued)} reads were set up past the failed one"
        assert not len(store.promotion)


def test_two_lookups_of_a_long_prompt_coming_up_from_ssd_leave_it_to_be_evicted_tail_first(tmp_path: Path) -> None:
    """Two clients look up the same prompt on SSD only; their set-up steps interleave, each
    starting the reads of some runs and waiting on the other's. Tracked per reader, the batch
    that landed first named a block whose parent was in the other batch: the parent sat in the
    policy as a leaf, and the prompt's middle left DRAM before its tail."""
    with long_prompt_on_ssd(tmp_path) as (store, s, ns, keys, queued):
        t = store.open_session("u", 2).session_id

        async def run() -> None:
            found = await asyncio.gather(*(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=sid)
                                           for sid in (s, t)))
            assert [r.blocks for r in found] == [LONG, LONG]
            for sid, r in zip((s, t), found):
                store.release(sid, r.lease_id)
            await asyncio.wait_for(store.finish_background(), 30)
        asyncio.run(run())
        assert len(queued) == LONG, "each block is read once, by one of the two"
        blocks = [store.catalog.get(ns).index.get(k) for k in keys]
        policy = store.placement.dram.policy_for(blocks[0])   # type: ignore[arg-type]
        assert all(b in policy for b in blocks)
        assert policy.victim() is blocks[-1], "the first block to leave DRAM is not the prompt's last"


def test_a_block_promoted_twice_meanwhile_keeps_its_hits_when_the_first_batch_lands(tmp_path: Path) -> None:
    """A promotion batch hands its blocks to the DRAM policy only once all of them landed. A block
    that landed early, whose reader gave up, may lose its slot and come up again in a second batch
    (tracked when that one lands, then hit); when the first batch finally lands it inserted the
    block a second time: its use record started afresh, the hits it earned since forgotten (under
    LFU and credit it became the first to go)."""
    import concurrent.futures
    with make_store(tmp_path, dram="lfu", ssd="lru") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(2, 333_000)
        _to_ssd_only(store, s, ns, keys)
        ssd = store.ssd_tier
        assert ssd is not None
        real_read = ssd.read_into
        held: dict[str, object] = {}

        def read_into(namespace_id, key, view):  # type: ignore[no-untyped-def]
            if key == keys[1] and not held:     # the first read of block 1 waits for the test
                fut: concurrent.futures.Future[None] = concurrent.futures.Future()
                held.update(fut=fut, args=(namespace_id, key, view))
                return fut
            return real_read(namespace_id, key, view)

        ssd.read_into = read_into  # type: ignore[method-assign]
        a = store.catalog.get(ns).index.get(keys[0])
        assert a is not None

        async def run() -> None:
            first = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s))
            for _ in range(500):
                await asyncio.sleep(0.01)
                if a.in_dram and store.promotion.pending(a) is None:
                    break
            assert a.in_dram and store.promotion.pending(a) is None, "block 0 should have landed"
            first.cancel()                                  # the reader gives up
            with contextlib.suppress(asyncio.CancelledError):
                await first
            assert store.evict(tier=Tier.DRAM) == 1         # block 0 back on SSD only
            again = await store.lookup(ns, KeyRequest(hashes=keys[:1]), lease=True, session_id=s)
            assert again.blocks == 1
            store.release(s, again.lease_id)
            policy = store.placement.dram.policy_for(a)
            for _ in range(100):                            # the second batch is tracked
                await asyncio.sleep(0)
                if a in policy:
                    break
            assert a in policy
            for _ in range(2):
                assert (await store.lookup(ns, KeyRequest(hashes=keys[:1]))).blocks == 1
            assert policy._uses.get(a).hits == 2            # type: ignore[attr-defined]
            fut = held["fut"]
            real_read(*held["args"]).result(5)              # type: ignore[misc]
            fut.set_result(None)                            # type: ignore[union-attr]
            await asyncio.sleep(0.05)
            await store.finish_background()                             # the first batch lands at last
            use = policy._uses.get(a)                       # type: ignore[attr-defined]
            assert use is not None and use.hits == 2, "block 0's hits were forgotten"

        asyncio.run(run())


def test_write_back_that_admission_refuses_is_not_rescanned_on_every_save(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: under ssd.admission = never (or hit_before, cost refusing most blocks) DRAM stays above
    the write-back watermark, every save and every reclaim woke the write-back loop, and each
    round scanned every DRAM-only block on the event loop: a pass over the arena per save."""
    with make_store(tmp_path, dram="lru", ssd="lru", admission="never") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        rounds = 0
        real = store.writeback.write_back

        async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal rounds
            rounds += 1
            return await real(*args, **kwargs)

        monkeypatch.setattr(store.writeback, "write_back", counted)

        async def main() -> None:
            loop = asyncio.ensure_future(store.writeback_loop(interval_s=30.0))
            try:
                for i in range(40):     # 40 saves of one block each, arena of 8: all over the watermark
                    assert save(store, s, ns, chain(1, 1000 * i)) == 1
                    await asyncio.sleep(0.001)
            finally:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop

        asyncio.run(main())
        assert store.stats().tiers[1].used_bytes == 0        # never admitted, as configured
        assert 1 <= rounds <= 2, f"{rounds} write-back rounds for 40 saves"


def test_moving_between_tiers_is_not_a_reuse(tmp_path: Path) -> None:
    """Was: a block moved between DRAM and SSD (prefetch up, evicted down) left a ghost in each
    tier's credit policy and came back one class higher every time, so a block never hit reached
    the top class (+416 s of credit) by moving around, and outlived blocks really reused."""
    with make_store(tmp_path, dram="credit", ssd="credit") as (store, _):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        keys = chain(1)
        save(store, s, state.namespace_id, keys)
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)                     # SSD only now
        block = state.index.get(keys[0])
        assert block is not None
        classes = []
        for _ in range(3):
            async def up() -> None:
                store.prefetch(state.namespace_id, KeyRequest(hashes=keys))   # not a hit
                await store.finish_background()
            asyncio.run(up())
            classes.append(store.placement.dram.policy_for(block).reuse_class(block))
            store.evict(tier=Tier.DRAM)
            classes.append(store.placement.ssd.policy.reuse_class(block))
        assert classes == [0] * 6, classes


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_reused_in_dram_keeps_its_reuses_on_ssd(tmp_path: Path, policy: str) -> None:
    """Was: a block evicted from DRAM to SSD entered the SSD policy as never hit, so a block
    reused twice in DRAM was the first to go when later never-hit blocks filled the SSD tier."""
    with make_store(tmp_path, dram=policy, ssd=policy) as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        hot = chain(1, 999_000)
        _reused_then_to_ssd_only(store, clock, s, ns, hot)   # SSD only now, with its two reuses
        for i in range(16):                             # never-hit blocks through SSD, twice its size
            clock.now += 1.0
            assert save(store, s, ns, chain(1, 1000 * i)) == 1
            asyncio.run(store.flush())
            store.evict(tier=Tier.DRAM)
        assert store.stats().tiers[1].blocks <= 8
        assert cached(store, ns, hot) == int(SURVIVES[policy])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_hit_on_ssd_keeps_the_hit_when_it_comes_up_to_dram(tmp_path: Path, policy: str) -> None:
    """Was: the lookup that found a block on SSD recorded its hit in the SSD policy, which let the
    block go as it came up; DRAM tracked it as never hit and a burst of saves evicted it first."""
    with make_store(tmp_path, dram=policy, ssd=policy, ssd_blocks=64, admission="never") as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        ns = state.namespace_id
        hot = chain(3, 999_000)                         # a prefix of three blocks
        save(store, s, ns, hot)
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)

        async def hit_on_ssd() -> None:
            clock.now += 1.0
            assert (await store.lookup(ns, KeyRequest(hashes=hot))).blocks == 3   # a hit, then up
            await store.finish_background()

        asyncio.run(hit_on_ssd())
        blocks = [state.index.get(k) for k in hot]
        assert all(b is not None and b.in_dram for b in blocks)
        dram = store.placement.dram.policy_for(blocks[0])               # type: ignore[arg-type]
        # the SSD policy had the hit on the deepest block only; its ancestors were hit too
        assert [dram.reuses(b) for b in blocks] == [1, 1, 1]   # type: ignore[arg-type]
        for i in range(16):                             # never-hit saves, twice the arena
            clock.now += 1.0
            assert save(store, s, ns, chain(1, 1000 * i)) == 1
        resident = [b is not None and b.in_dram for b in map(state.index.get, hot)]
        # LFU and credit keep the whole prefix the hit went through (its ancestors too); LRU, and
        # adaptive, duel, lecar and glide before they have learned anything (all start as LRU),
        # have evicted it to SSD by now
        assert resident == [policy not in ("lru", "adaptive", "duel", "lecar", "glide")] * 3, resident


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_brought_up_by_an_ssd_hit_adds_its_childs_hits_to_its_own(tmp_path: Path, policy: str) -> None:
    """Was: a promoted batch gave each block the largest reuse count at or below it (a suffix
    max), so a parent reused once before (hit alone: up to DRAM and back down with that reuse)
    and then through its child came up with max(1, 1) reuses, not 1 + 1. The child's hit was
    recorded on the child only and reaches the parent when the child leaves the SSD policy, but
    the promotion takes the parent out of it first."""
    with make_store(tmp_path, dram=policy, ssd=policy, ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        ns = state.namespace_id
        hot = chain(2, 999_000)                         # parent, child
        save(store, s, ns, hot)
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)

        async def hit_on_ssd(keys: list[bytes]) -> None:
            clock.now += 1.0
            assert (await store.lookup(ns, KeyRequest(hashes=keys))).blocks == len(keys)
            await store.finish_background()

        asyncio.run(hit_on_ssd(hot[:1]))                # the parent alone: up, with one reuse
        parent, child = (state.index.get(k) for k in hot)
        assert parent is not None and child is not None
        dram = store.placement.dram.policy_for(parent)
        assert parent.in_dram and not child.in_dram and dram.reuses(parent) == 1
        store.evict(tier=Tier.DRAM)                     # back down, its reuse with it
        assert store.placement.ssd.policy.reuses(parent) == 1
        asyncio.run(hit_on_ssd(hot))                    # the whole prefix: a reuse of both
        assert parent.in_dram and child.in_dram
        assert [dram.reuses(parent), dram.reuses(child)] == [2, 1]


def test_a_round_trip_through_a_credit_tier_keeps_an_lfu_count(tmp_path: Path) -> None:
    """Was: credit kept a block's carried reuses capped at its top class (3), so a block reused
    five times in an LFU DRAM tier came back from a credit SSD tier (a move, not a use) with 3."""
    with make_store(tmp_path, dram="lfu", ssd="credit", ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        keys = chain(1)
        save(store, s, state.namespace_id, keys)
        for _ in range(5):
            clock.now += 1.0
            assert cached(store, state.namespace_id, keys) == 1
        block = state.index.get(keys[0])
        assert block is not None
        assert store.placement.dram.policy_for(block).reuses(block) == 5
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)                     # SSD only now
        assert store.placement.ssd.policy.reuses(block) == 5
        assert store.placement.ssd.policy.reuse_class(block) == 3   # type: ignore[attr-defined]

        async def up() -> None:
            store.prefetch(state.namespace_id, KeyRequest(hashes=keys))   # not a hit
            await store.finish_background()

        asyncio.run(up())
        assert block.in_dram and store.placement.dram.policy_for(block).reuses(block) == 5


@pytest.mark.parametrize("policy", POLICIES)
def test_a_block_whose_promotion_read_fails_keeps_its_reuses_on_ssd(tmp_path: Path, policy: str) -> None:
    """Was: a promotion takes a block out of the SSD policy (its reuses read for DRAM); when the
    read failed (a disk error, not a corrupt copy) the block went back to the SSD policy as never
    hit, so under lru and lfu it lost every reuse it had brought down from DRAM."""
    with make_store(tmp_path, dram=policy, ssd=policy, ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        keys = chain(1)
        _reused_then_to_ssd_only(store, clock, s, state.namespace_id, keys)   # with its two reuses
        block = state.index.get(keys[0])
        assert block is not None and store.placement.ssd.policy.reuses(block) == 2
        ssd = store.ssd_tier
        assert ssd is not None

        def failing(namespace_id: int, key: bytes, view: object) -> None:
            raise OSError("injected: the disk is gone")

        ssd.read_into = failing  # type: ignore[method-assign,assignment]

        async def hit_on_ssd() -> None:
            clock.now += 1.0
            assert (await store.lookup(state.namespace_id, KeyRequest(hashes=keys))).blocks == 1
            await store.finish_background()                         # its promotion in the background failed

        asyncio.run(hit_on_ssd())
        assert store.promotion.read_errors == 1
        assert not block.in_dram and block.on_ssd and block in store.placement.ssd.policy
        assert store.placement.ssd.policy.reuses(block) == 3     # its two, and the lookup that found it


@pytest.mark.parametrize("policy", POLICIES)
def test_a_hit_of_a_prefix_from_ssd_into_dram_counts_once(tmp_path: Path, policy: str) -> None:
    """Was: a lookup of a prefix whose head is on SSD only and whose tail is in DRAM recorded its
    hit in both policies (on the head in the SSD policy, on the tail in the DRAM policy); the
    head came up with that hit in its reuses, then the tail's record reached it too when the
    tail left: one lookup, two reuses (two such lookups put a block in credit's top class)."""
    with make_store(tmp_path, dram=policy, ssd=policy, ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        ns = state.namespace_id
        keys = chain(2)
        save(store, s, ns, keys[:1])
        asyncio.run(store.flush())
        store.evict(tier=Tier.DRAM)                  # the head on SSD only
        clock.now += 1.0
        save(store, s, ns, keys)                     # its child stored in DRAM under it
        head, tail = (state.index.get(k) for k in keys)
        assert head is not None and tail is not None and not head.in_dram and tail.in_dram
        clock.now += 1.0

        async def look() -> None:
            assert (await store.lookup(ns, KeyRequest(hashes=keys))).blocks == 2   # one hit of both
            await store.finish_background()

        asyncio.run(look())
        dram = store.placement.dram.policy_for(head)
        assert head.in_dram and dram.reuses(head) == 0 and dram.pending_hits(tail) == 1
        store.evict(tier=Tier.DRAM)                  # the tail goes (no SSD copy), the head down
        assert state.index.get(keys[1]) is None
        assert store.placement.ssd.policy.reuses(head) == 1       # the one lookup


@pytest.mark.parametrize("policy", POLICIES)
def test_a_promoted_block_that_goes_back_down_before_its_batch_lands_keeps_its_reuses(
        tmp_path: Path, policy: str) -> None:
    """Was: a promoted block enters its DRAM policy only once its whole batch has landed; one
    that landed early and lost its slot meanwhile (its lookup cancelled, then evicted to SSD)
    went back to the SSD policy with the DRAM policy's count, None: as never hit under lru and
    lfu, and without the hit of the lookup that brought it up under credit."""
    with make_store(tmp_path, dram=policy, ssd=policy, ssd_blocks=64) as (store, clock):
        s = store.open_session("t", 1).session_id
        state = store.open_namespace(Namespace())
        ns = state.namespace_id
        keys = chain(2)
        _reused_then_to_ssd_only(store, clock, s, ns, keys)
        head, tail = (state.index.get(k) for k in keys)
        assert head is not None and tail is not None
        assert store.placement.ssd.policy.reuses(head) == 2
        gate = gate_ssd_read(store, keys[1])

        async def main() -> None:
            clock.now += 1.0
            task = asyncio.ensure_future(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s))
            for _ in range(2000):   # bounded: 2 s
                if head.in_dram and store.promotion.pending(head) is None:
                    break
                await asyncio.sleep(0.001)
            assert head.in_dram and store.promotion.pending(head) is None and store.promotion.pending(tail) is not None
            task.cancel()                               # its lease ends: the head is unpinned
            with contextlib.suppress(asyncio.CancelledError):
                await task
            store.evict(tier=Tier.DRAM)                 # the head back down; the tail still read
            assert not head.in_dram and head in store.placement.ssd.policy
            gate.set()
            await store.finish_background()

        try:
            asyncio.run(main())
        finally:
            gate.set()
        assert store.placement.ssd.policy.reuses(head) == 3      # its two, and the lookup through its child


def test_a_block_evicted_from_ssd_with_no_copy_elsewhere_counts_as_dropped(tmp_path: Path) -> None:
    """(review) ``dropped_blocks`` ("blocks lost: evicted with no copy elsewhere, or corrupt")
    counted DRAM-only blocks evicted from DRAM, but not SSD-only blocks evicted from SSD, which
    lose their last copy just the same: a node shedding its SSD tier under churn said 0 lost."""
    with make_store(tmp_path, dram="lru", ssd="lru") as (store, clock):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        for i in range(16):   # through an SSD tier of 8 blocks, each moved down to SSD only
            clock.now += 1.0
            _to_ssd_only(store, s, ns, chain(1, 1000 * i))
        st = store.stats()
        assert st.tiers[1].evictions > 0
        assert st.dropped_blocks == st.tiers[1].evictions   # moves to SSD are no loss; these are
        assert st.index_blocks == 16 - st.dropped_blocks


def test_the_default_policys_shadow_replay_runs_after_the_seal_and_lookup_are_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's or a hit's shadow replay (the default policy samples every chain of a small tier)
    is not part of the call: the store runs it on the event loop's next turn, once, however
    many calls came in that turn."""
    with make_store(tmp_path, "glide") as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        caught_up: list[int] = []
        catch_up = store.placement.catch_up

        def counted() -> None:
            caught_up.append(1)
            catch_up()
        monkeypatch.setattr(store.placement, "catch_up", counted)

        async def calls() -> None:
            assert save(store, s, ns, chain(2)) == 2
            assert caught_up == []   # not within the call
            await asyncio.sleep(0)
            assert caught_up == [1]
            assert (await store.lookup(ns, KeyRequest(hashes=chain(2)))).blocks == 2
            await asyncio.sleep(0)
            assert caught_up == [1, 1]
            assert save(store, s, ns, chain(1, 70_000)) == save(store, s, ns, chain(1, 80_000)) == 1
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert caught_up == [1, 1, 1]
        asyncio.run(calls())


def test_the_ssd_tiers_default_policy_learns_from_every_access_and_is_sized_as_the_tier(tmp_path: Path) -> None:
    """The SSD tier's own hits are only what DRAM missed, and the blocks it gains only what DRAM
    evicted: its shadows, fed those, judged a cache that never saw the prompts DRAM served (whose
    copies the tier keeps all the same), and stayed LRU on a chat trace through the store where
    credit saves 4% more (BENCHMARKS.md section 3h). They are now fed every lookup's hit and every
    save, whichever tier serves them, and hold as many blocks as the tier does at its blocks'
    mean size (the policy was made for a nominal size: the tier holds blocks of every size)."""
    with make_store(tmp_path, "glide", ssd="glide", ssd_blocks=40) as (store, _):
        s = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        policy = store.placement.ssd.policy
        assert isinstance(policy, GlidePolicy)
        keys = chain(4)
        save(store, s, ns, keys)
        asyncio.run(store.writeback.write_back(float("inf"), force=False, models=None))
        assert policy.shadow_capacity == 38   # 95% of 40 blocks of 4 KiB (made for 1 MiB blocks: 1,024)
        for _ in range(3):
            assert asyncio.run(store.lookup(ns, KeyRequest(hashes=keys))).tiers == [Tier.DRAM] * 4
        assert policy.reuses(store.catalog.get(ns).index.get(keys[-1])) is None   # in DRAM: not the tier's
        assert policy.scores[0] > 0 and policy.scores[1] > 0   # the shadows saw the hits all the same
