"""A seeded, bounded random walk over the DRAM tier with two block sizes: saves (some left
open while "written"), leased and unleased lookups (promotions from SSD in flight across
steps), flushes running beside them, evictions, peer landings held open, adoptions and peer
checkouts. After every step: each page's record of its blocks matches the allocator and the
index, and no block in use (leased, reserved, checked out, being promoted) lost its slot or its
bytes."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from clock import Clock
from store_harness import exchange, open_store

from kvstored.index import Block, Tier
from kvstored.peers.exchange import PeerLanding
from kvstored.policy.registry import POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

BIG, SMALL = 4096, 1024
PAGE = 4 * BIG


@contextlib.contextmanager
def make_store(tmp_path: Path, policy: str, pages: int = 6, ssd_blocks: int = 48) -> Iterator[tuple[BlockStore, Clock]]:
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": pages * PAGE, "page_bytes": PAGE, "prefault": False, "policy": policy},
        "ssd": {"enabled": True, "capacity": ssd_blocks * BIG, "policy": "lru", "high_watermark": 0.95,
                "low_watermark": 0.5, "sync": False, "admission": "always"}}
    with open_store(tmp_path, values, ssd=True) as made:
        yield made


def pattern(key: bytes, n: int) -> np.ndarray:
    return np.resize(np.frombuffer(key, dtype=np.uint8), n)


def check(store: BlockStore, landings: list[PeerLanding], in_use: list[tuple[Block, int]]) -> None:
    """The page record against the allocator and the index; blocks in use kept slot and bytes."""
    pb = store.placement.dram.page_bytes
    landing_pages = Counter(landing.offset // pb for landing in landings)
    offsets: dict[int, object] = {landing.offset: landing for landing in landings}
    in_dram = 0
    for state in store.catalog:
        for block in state.index:
            assert block.parent is None or state.index.get(block.parent.key) is block.parent, "orphan"
            if block.in_dram:
                in_dram += 1
                page = block.offset // pb
                assert block in store.placement.dram.page_blocks(page), "a block in DRAM its page does not know"
                assert store.placement.dram.page_slot_bytes(page) == state.index.slot_bytes, "wrong page size"
                assert block.offset not in offsets, "two holders of one slot"
                offsets[block.offset] = block
    known = sum(len(store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages))
    assert known == in_dram, "a page knows a block that left DRAM or the index"
    for page, blocks in ((p, store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages)):
        for block in blocks:
            assert block.offset // pb == page and block.index.get(block.key) is block
        assert len(blocks) + landing_pages[page] == store.placement.dram.used_slots(page), f"page {page}"
    for block in store.promotion.blocks():
        assert block.in_dram, "a block being promoted lost its slot"
    for block, offset in in_use:
        assert block.index.get(block.key) is block, "a block in use left the index"
        assert block.offset == offset, "a block in use lost its slot"
        assert block.pins > 0


def test_page_drift_fuzz(tmp_path: Path) -> None:
    for seed, policy in enumerate(POLICIES * 2):
        run = tmp_path / f"{seed}"
        run.mkdir()
        asyncio.run(_walk(run, policy, seed, steps=250))


async def _walk(tmp_path: Path, policy: str, seed: int, steps: int, pages: int = 6) -> None:
    rng = random.Random(seed)
    with make_store(tmp_path, policy, pages) as (store, clock):
        s = store.open_session("t", 1).session_id
        small = store.open_namespace(Namespace(model="small")).namespace_id
        big = store.open_namespace(Namespace(model="big")).namespace_id
        sizes = {small: SMALL, big: BIG}
        prefixes = [list(range(p * 1000, p * 1000 + 16 * 4)) for p in range(3)]
        leases: list[tuple[int, list[Block], list[int]]] = []          # (lease id, blocks, offsets)
        open_res: list[tuple[int, list[Block]]] = []                    # reservations being written
        landings: list[PeerLanding] = []
        checked_out: list[Block] = []
        tasks: set[asyncio.Task[object]] = set()

        def keys_for(ns: int) -> list[bytes]:
            tokens = prefixes[rng.randrange(3)][: 16 * rng.randrange(1, 5)]
            return block_hashes(tokens + [rng.randrange(40_000) for _ in range(16 * rng.randrange(0, 3))])

        def reserve(ns: int, keys: list[bytes]) -> tuple[int, list[Block]] | None:
            try:
                r = store.reserve(s, ns, KeyRequest(hashes=keys), sizes[ns])
            except KVStoreError:
                return None
            index = store.catalog.get(ns).index
            new = [index.get(k) for k in keys[r.present: r.present + len(r.offsets)]]
            blocks = [b for b in new if b is not None]
            for block in blocks:
                store.arena.view(block.offset, sizes[ns])[:] = pattern(block.key, sizes[ns])
            return r.reservation_id, blocks

        async def leased_lookup(ns: int, keys: list[bytes]) -> None:
            r = await store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=s)
            if r.blocks:
                index = store.catalog.get(ns).index
                blocks = [index.get(k) for k in keys[: r.blocks]]
                assert all(b is not None for b in blocks)
                leases.append((r.lease_id, blocks, list(r.offsets)))  # type: ignore[arg-type]

        async def checkout(ns: int, key: bytes) -> None:
            got = await exchange(store).checkout(ns, key, served=True)
            if got is not None:
                block = store.catalog.get(ns).index.get(key)
                assert block is not None
                checked_out.append(block)

        async def flush() -> None:
            with contextlib.suppress(KVStoreError):
                await store.flush()

        def spawn(coro: object) -> None:
            task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def in_use() -> list[tuple[Block, int]]:
            out = [(b, o) for _, blocks, offsets in leases for b, o in zip(blocks, offsets)]
            out += [(b, b.offset) for _, blocks in open_res for b in blocks]
            return out

        for _ in range(steps):
            clock.now += rng.random() * 5
            ns = rng.choice((small, big))
            keys = keys_for(ns)
            op = rng.random()
            if op < 0.30:
                got = reserve(ns, keys)
                if got is not None:
                    store.seal(s, got[0])
            elif op < 0.38 and len(open_res) < 2:
                got = reserve(ns, keys)
                if got is not None:
                    open_res.append(got)
            elif op < 0.44 and open_res:
                rid, _ = open_res.pop(rng.randrange(len(open_res)))
                if rng.random() < 0.7:
                    store.seal(s, rid)
                else:
                    store.release(s, rid, reservation_only=True)
            elif op < 0.54 and len(leases) < 3:
                spawn(leased_lookup(ns, keys))
            elif op < 0.60:
                spawn(store.lookup(ns, KeyRequest(hashes=keys)))
            elif op < 0.66 and leases:
                store.release(s, leases.pop(rng.randrange(len(leases)))[0])
            elif op < 0.72:
                spawn(flush())
            elif op < 0.76:
                store.evict(rng.choice(("small", "big")), Tier.DRAM)
            elif op < 0.84 and len(landings) < 2:
                index = store.catalog.get(ns).index
                readable = [b for b in index if b.readable]
                parent = rng.choice(readable).key if readable and rng.random() < 0.7 else b""
                landing = exchange(store).land(ns, parent, bytes(rng.randbytes(len(keys[0]))), sizes[ns])
                if landing is not None:
                    landings.append(landing)
            elif op < 0.90 and landings:
                landing = landings.pop(rng.randrange(len(landings)))
                if rng.random() < 0.7:
                    n = sizes[landing.state.namespace_id]
                    np.frombuffer(landing.view, dtype=np.uint8)[:] = pattern(landing.key, n)
                    landing.commit()
                else:
                    landing.abort()
            elif op < 0.93:
                key = bytes(rng.randbytes(len(keys[0])))
                exchange(store).adopt(ns, b"", key, memoryview(pattern(key, sizes[ns]).tobytes()))
            elif op < 0.97 and len(checked_out) < 2:
                index = store.catalog.get(ns).index
                readable = [b for b in index if b.readable]
                if readable:
                    spawn(checkout(ns, rng.choice(readable).key))
            elif checked_out:
                block = checked_out.pop(rng.randrange(len(checked_out)))
                exchange(store).checkin(block.index.namespace_id, block.key)
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0 if rng.random() < 0.7 else 0.002)
            check(store, landings, in_use())
            for _, blocks, offsets in leases:   # a leased block's bytes are its own
                for block, offset in zip(blocks, offsets):
                    n = sizes[block.index.namespace_id]
                    assert np.array_equal(store.arena.view(offset, n), pattern(block.key, n)), "leased bytes changed"
        for landing in landings:
            landing.abort()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.finish_background()
        check(store, [], in_use())


@pytest.mark.parametrize("policy", POLICIES)
def test_page_drift_fuzz_single(tmp_path: Path, policy: str) -> None:
    asyncio.run(_walk(tmp_path, policy, 100 + POLICIES.index(policy), steps=250))
