"""The store's peer side, in process: blocks adopted from a peer, namespaces learned from a peer's
description, held/checkout/checkin for serving, forget for draining, and the parent-first chains
a migration pushes (BlockStore.namespace_chains and PrefixIndex.chains)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from store_harness import chain, exchange, open_store, streamer

from kvstored.index import SEALED, PrefixIndex
from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import NotFound
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096          # bytes per block; the arena holds 8 of them (two pages of 4)
SLOTS = 8
NS = Namespace(model="m", block_bytes=BLOCK)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlockStore]:
    # LRU: these tests are about pins and structure; with the default credit policy and a frozen
    # clock (the harness's, never moved here: stats compare equal), a block once served to a peer
    # would outlive every newcomer by design.
    with open_store(tmp_path, {"dram": {"capacity": SLOTS * BLOCK, "page_bytes": 4 * BLOCK, "prefault": False,
                                        "policy": "lru"}}) as (made, _):
        yield made


def payload(i: int, size: int = BLOCK) -> memoryview:
    return memoryview(bytes([i % 251 + 1]) * size)


def adopt_chain(store: BlockStore, ns: int, keys: list[bytes], parent: bytes = b"", seed: int = 0) -> None:
    for i, key in enumerate(keys):
        assert exchange(store).adopt(ns, parent, key, payload(seed + i)), f"block {i} refused"
        parent = key


def read(store: BlockStore, ns: int, key: bytes) -> bytes:
    """The block's bytes as a peer would read them (checkout + copy + checkin)."""
    async def main() -> bytes:
        served = await exchange(store).checkout(ns, key)
        assert served is not None, "block not held"
        try:
            view, check = served
            assert check == xxhash.xxh3_64_intdigest(view), "the checksum served is not the bytes'"
            return bytes(view)
        finally:
            exchange(store).checkin(ns, key)
    return asyncio.run(main())


def _present(store: BlockStore, ns: int, key: bytes) -> bool:
    return store.catalog.get(ns).index.get(key) is not None


def fill_with_other_blocks(store: BlockStore, ns: int, n: int, start: int = 500_000) -> None:
    """Save ``n`` one-block prompts through the normal client path (reserve + seal), evicting as needed."""
    s = store.open_session("filler", 1)
    for i in range(n):
        r = store.reserve(s.session_id, ns, KeyRequest(hashes=chain(1, start + 1000 * i)), BLOCK)
        store.seal(s.session_id, r.reservation_id)


# -- adopt ---------------------------------------------------------------------------------------
def test_adopt_stores_a_chain_under_its_parents(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(3)
    adopt_chain(store, ns, keys, seed=10)
    assert exchange(store).held(ns, keys) == 3
    assert [read(store, ns, k) for k in keys] == [bytes(payload(10 + i)) for i in range(3)]
    assert asyncio.run(store.lookup(ns, KeyRequest(hashes=keys))).blocks == 3
    index = store.catalog.get(ns).index
    assert index.get(keys[1]).parent is index.get(keys[0])   # type: ignore[union-attr]
    assert index.get(keys[2]).parent is index.get(keys[1])   # type: ignore[union-attr]
    st = store.stats()
    assert st.peer_received_blocks == 3 and st.index_blocks == 3 and st.tiers[0].used_bytes == 3 * BLOCK


def test_adopt_refuses_and_stores_nothing(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    unknown_ns = Namespace(model="never-opened").identity()
    before = store.stats()
    assert exchange(store).adopt(unknown_ns, b"", keys[0], payload(0)) is False
    assert exchange(store).adopt(ns, b"", keys[0], payload(0, BLOCK - 1)) is False        # short
    assert exchange(store).adopt(ns, b"", keys[0], payload(0, BLOCK + 16)) is False       # long
    assert exchange(store).adopt(ns, keys[0], keys[1], payload(1)) is False               # parent not here
    assert exchange(store).adopt(ns, b"\x07" * 32, keys[0], payload(0)) is False          # parent unknown
    assert store.stats() == before
    assert exchange(store).held(ns, keys) == 0 and not _present(store, ns, keys[0]) and not _present(store, ns, keys[1])
    assert exchange(store).held(unknown_ns, keys) == 0


def test_adopt_into_a_namespace_without_a_block_size_is_refused(store: BlockStore) -> None:
    ns = store.open_namespace(Namespace(model="sizeless")).namespace_id   # block_bytes not fixed yet
    assert exchange(store).adopt(ns, b"", chain(1)[0], payload(0)) is False
    assert store.stats().index_blocks == 0 and store.stats().tiers[0].used_bytes == 0


def test_adopt_of_a_held_block_is_true_and_idempotent(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    adopt_chain(store, ns, keys, seed=1)
    before = store.stats()
    for _ in range(3):
        assert exchange(store).adopt(ns, b"", keys[0], payload(99)) is True
        assert exchange(store).adopt(ns, keys[0], keys[1], payload(99)) is True
    after = store.stats()
    assert after.index_blocks == 2 and after.tiers[0].used_bytes == before.tiers[0].used_bytes
    assert after.peer_received_blocks == before.peer_received_blocks                     # nothing stored twice
    assert read(store, ns, keys[0]) == bytes(payload(1))                   # the first copy stays
    # a block saved locally counts as held too
    local = chain(1, 9000)
    s = store.open_session("t", 1)
    r = store.reserve(s.session_id, ns, KeyRequest(hashes=local), BLOCK)
    store.seal(s.session_id, r.reservation_id)
    assert exchange(store).adopt(ns, b"", local[0], payload(5)) is True
    assert store.stats().index_blocks == 3


def test_adopt_does_not_evict_the_parent_it_hangs_under(store: BlockStore) -> None:
    """A full arena: making room for the pushed block must evict something else, never its parent."""
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    assert exchange(store).adopt(ns, b"", keys[0], payload(0))
    fill_with_other_blocks(store, ns, SLOTS - 1)                 # the arena is full now; keys[0] is the oldest
    assert exchange(store).adopt(ns, keys[0], keys[1], payload(1)) is True
    assert exchange(store).held(ns, keys) == 2
    assert read(store, ns, keys[1]) == bytes(payload(1))


def test_adopt_with_no_room_is_refused(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    others = chain(SLOTS, 100_000)
    adopt_chain(store, ns, others)              # one chain: only its leaf could be evicted ...
    views = []

    async def pin_all() -> None:
        for k in others:
            views.append(await exchange(store).checkout(ns, k))
    asyncio.run(pin_all())                      # ... and every block is checked out
    before = store.stats()
    assert exchange(store).adopt(ns, b"", chain(1)[0], payload(0)) is False
    assert store.stats().index_blocks == before.index_blocks
    for k in others:
        exchange(store).checkin(ns, k)
    assert exchange(store).adopt(ns, b"", chain(1)[0], payload(0)) is True   # the leaf of the pinned chain made room


# -- land: a pushed block received straight into its slot -----------------------------------------
def test_land_then_commit_stores_the_bytes_received_into_the_slot(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    for i, (parent, key) in enumerate(zip([b"", keys[0]], keys)):
        landing = exchange(store).land(ns, parent, key, BLOCK)
        assert landing is not None and landing.view.nbytes == BLOCK
        assert exchange(store).held(ns, [key]) == 0                  # invisible while its bytes arrive
        landing.view[:] = payload(20 + i)
        assert landing.commit(xxhash.xxh3_64_intdigest(landing.view)) is True
    assert exchange(store).held(ns, keys) == 2
    assert [read(store, ns, k) for k in keys] == [bytes(payload(20)), bytes(payload(21))]
    st = store.stats()
    assert st.peer_received_blocks == 2 and st.tiers[0].used_bytes == 2 * BLOCK


def test_abort_frees_the_slot_and_stores_nothing(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    before = store.stats()
    for _ in range(3 * SLOTS):                  # would run out of slots if an abort leaked one
        landing = exchange(store).land(ns, b"", chain(1)[0], BLOCK)
        assert landing is not None
        landing.abort()
    assert store.stats() == before and not _present(store, ns, chain(1)[0])


def test_land_leaves_the_odd_cases_to_adopt(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    assert exchange(store).land(Namespace(model="never-opened").identity(), b"", keys[0], BLOCK) is None
    assert exchange(store).land(ns, b"", keys[0], BLOCK - 1) is None           # wrong size
    assert exchange(store).land(ns, keys[0], keys[1], BLOCK) is None           # parent not here
    adopt_chain(store, ns, keys[:1])
    assert exchange(store).land(ns, b"", keys[0], BLOCK) is None               # already held: adopt answers
    assert store.stats().tiers[0].used_bytes == BLOCK


def test_landing_pins_its_parent_until_it_ends(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    adopt_chain(store, ns, keys[:1])
    landing = exchange(store).land(ns, keys[0], keys[1], BLOCK)
    assert landing is not None
    fill_with_other_blocks(store, ns, 3 * SLOTS)        # heavy churn while the bytes "arrive"
    assert exchange(store).held(ns, keys[:1]) == 1                # the parent survived it
    landing.view[:] = payload(7)
    assert landing.commit(xxhash.xxh3_64_intdigest(landing.view)) is True
    assert exchange(store).held(ns, keys) == 2 and read(store, ns, keys[1]) == bytes(payload(7))
    assert store.catalog.get(ns).index.get(keys[0]).pins == 0   # type: ignore[union-attr]


def test_commit_after_another_push_stored_the_block_keeps_one_copy(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    key = chain(1)[0]
    landing = exchange(store).land(ns, b"", key, BLOCK)
    assert landing is not None
    assert exchange(store).adopt(ns, b"", key, payload(1))        # a second push of the same block won the race
    landing.view[:] = payload(2)
    assert landing.commit(xxhash.xxh3_64_intdigest(landing.view)) is True   # held: the push goes on
    st = store.stats()
    assert st.index_blocks == 1 and st.tiers[0].used_bytes == BLOCK and read(store, ns, key) == bytes(payload(1))


def test_a_landed_block_keeps_the_checksum_it_arrived_with(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    key = chain(1)[0]
    landing = exchange(store).land(ns, b"", key, BLOCK)
    assert landing is not None
    landing.view[:] = payload(3)
    assert landing.commit(xxhash.xxh3_64_intdigest(payload(3)))
    assert store.catalog.get(ns).index.get(key).check == xxhash.xxh3_64_intdigest(payload(3))  # type: ignore[union-attr]
    assert read(store, ns, key) == bytes(payload(3))   # and what a peer is served matches it


def test_an_aborted_landing_does_not_strand_a_hollow_parent(store: BlockStore) -> None:
    # Regression: the landing pinned its parent while the bytes arrived; a hollow parent (kept
    # only for its children) whose last child left meanwhile stayed in the index for good.
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    adopt_chain(store, ns, keys)
    make_hollow(store, ns, keys[0])
    landing = exchange(store).land(ns, keys[0], chain(1, 7000)[0], BLOCK)
    assert landing is not None
    assert store.evict() == 1                    # the child goes; the pinned hollow parent stays
    landing.abort()
    assert store.stats().index_blocks == 0 and store.stats().tiers[0].used_bytes == 0


def make_hollow(store: BlockStore, ns: int, key: bytes) -> None:
    """The block loses its bytes but keeps its children, as after a corrupt SSD read of an interior
    block (reached through the store's internals: a unit test has no SSD to corrupt)."""
    block = store.catalog.get(ns).index.get(key)
    assert block is not None and block.children and not block.on_ssd
    store.placement.release_slot(block)
    assert block.sealed and not block.readable


def test_adopt_refills_a_hollow_block(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(3)
    adopt_chain(store, ns, keys, seed=0)
    make_hollow(store, ns, keys[0])
    assert exchange(store).held(ns, keys) == 0
    assert exchange(store).adopt(ns, b"", keys[0], payload(7)) is True
    assert exchange(store).held(ns, keys) == 3 and read(store, ns, keys[0]) == bytes(payload(7))


def test_served_checksum_is_recomputed_after_a_refill(store: BlockStore) -> None:
    """The checksum cached when a block is first served must not outlive the bytes it was taken of."""
    ns = store.open_namespace(NS).namespace_id
    keys = chain(3)
    adopt_chain(store, ns, keys, seed=0)
    assert read(store, ns, keys[0]) == bytes(payload(0))       # served: its checksum is cached
    make_hollow(store, ns, keys[0])
    assert exchange(store).adopt(ns, b"", keys[0], payload(7)) is True   # other bytes under the same key
    assert read(store, ns, keys[0]) == bytes(payload(7))       # read() checks the served checksum


def test_adopt_refill_under_pressure_keeps_the_block_indexed(store: BlockStore) -> None:
    """A full arena whose least recently used block is the hollow block's only child: making room
    for the refill evicts that child. The refilled block must stay in the index (or be refused),
    never be returned as stored while nothing holds it, and the store must stay usable."""
    ns = store.open_namespace(NS).namespace_id
    keys = chain(2)
    adopt_chain(store, ns, keys)
    fill_with_other_blocks(store, ns, SLOTS - 2)
    make_hollow(store, ns, keys[0])
    fill_with_other_blocks(store, ns, 1, start=800_000)           # the arena is full again; keys[1] is oldest
    assert store.stats().tiers[0].used_bytes == SLOTS * BLOCK
    stored = exchange(store).adopt(ns, b"", keys[0], payload(3))
    assert exchange(store).held(ns, keys[:1]) == (1 if stored else 0), "adopt said stored, but the block is not held"
    st = store.stats()
    assert st.tiers[0].used_bytes == st.index_blocks * BLOCK, "a DRAM slot belongs to no indexed block"
    fill_with_other_blocks(store, ns, 3 * SLOTS, start=600_000)   # later evictions must not trip over it


# -- learn_namespace -----------------------------------------------------------------------------
def describe(spec: Namespace) -> bytes:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()


def test_learn_namespace_checks_the_identity(store: BlockStore) -> None:
    spec = Namespace(model="pushed", kv_dtype="float16", block_bytes=BLOCK)
    other = dataclasses.replace(spec, kv_dtype="bfloat16")
    why = exchange(store).learn_namespace(other.identity(), describe(spec))
    assert why and "does not match" in why
    assert store.stats().namespaces == 0
    assert exchange(store).adopt(other.identity(), b"", chain(1)[0], payload(0)) is False
    assert exchange(store).adopt(spec.identity(), b"", chain(1)[0], payload(0)) is False

    assert exchange(store).learn_namespace(spec.identity(), describe(spec)) == ""
    assert store.stats().namespaces == 1
    assert exchange(store).adopt(spec.identity(), b"", chain(1)[0], payload(0)) is True
    assert exchange(store).learn_namespace(spec.identity(), describe(spec)) == ""          # again: fine
    assert store.stats().namespaces == 1 and exchange(store).held(spec.identity(), chain(1)) == 1


def test_learn_namespace_describes_what_another_store_sends(store: BlockStore, tmp_path: Path) -> None:
    """The description one store gives (namespace_description) is what another learns from."""
    ns = store.open_namespace(NS).namespace_id
    text = exchange(store).describe_namespace(ns)
    (tmp_path / "b").mkdir()
    with open_store(tmp_path / "b", {"dram": {"capacity": SLOTS * BLOCK, "page_bytes": 4 * BLOCK,
                                              "prefault": False}}) as (other, _):
        assert exchange(other).learn_namespace(ns, text) == ""
        assert exchange(other).describe_namespace(ns) == text
        assert exchange(other).adopt(ns, b"", chain(1)[0], payload(0)) is True


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b'{"model": "m", "colour": "blue"}',
                                  b'{"model": "", "block_bytes": 4096}',
                                  b'{"model": "m", "block_size": "16"}'])   # was: TypeError out of the store
def test_learn_namespace_refuses_garbage(store: BlockStore, body: bytes) -> None:
    why = exchange(store).learn_namespace(Namespace(model="m").identity(), body)
    assert isinstance(why, str) and why != ""
    assert store.stats().namespaces == 0


def test_learn_namespace_refuses_what_the_daemon_does_not_allow(store: BlockStore) -> None:
    fast = Namespace(model="m", hash_algo="xxh3_128", block_bytes=BLOCK)     # keys.allow_fast_hash is off
    why = exchange(store).learn_namespace(fast.identity(), describe(fast))
    assert "hash_algo" in why and store.stats().namespaces == 0
    huge = Namespace(model="huge", block_bytes=1 << 30)                      # bigger than a DRAM page
    assert "page_bytes" in exchange(store).learn_namespace(huge.identity(), describe(huge))
    assert store.stats().namespaces == 0


# -- held, checkout, checkin ---------------------------------------------------------------------
def test_held_counts_leading_keys(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(5)
    adopt_chain(store, ns, keys[:3])
    assert exchange(store).held(ns, keys) == 3
    assert exchange(store).held(ns, keys[:2]) == 2
    assert exchange(store).held(ns, []) == 0
    assert exchange(store).held(ns, [chain(1, 777)[0], *keys]) == 0          # the first key is not here
    assert exchange(store).held(ns, [keys[0], keys[3], keys[2]]) == 1        # stops at the first gap
    assert exchange(store).held(Namespace(model="nope").identity(), keys) == 0


def test_checkout_of_a_missing_block_is_none(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id

    async def main() -> None:
        assert await exchange(store).checkout(ns, chain(1)[0]) is None
        assert await exchange(store).checkout(Namespace(model="nope").identity(), chain(1)[0]) is None
        s = store.open_session("t", 1)                # reserved but not sealed: not served
        store.reserve(s.session_id, ns, KeyRequest(hashes=chain(1, 50)), BLOCK)
        assert await exchange(store).checkout(ns, chain(1, 50)[0]) is None
    asyncio.run(main())
    assert store.stats().peer_served_blocks == 0


def test_checkout_pins_the_block_until_checkin(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    key = chain(1)[0]
    assert exchange(store).adopt(ns, b"", key, payload(42))

    async def checkout() -> memoryview:
        served = await exchange(store).checkout(ns, key)
        assert served is not None
        return served[0]

    view = asyncio.run(checkout())
    assert store.stats().peer_served_blocks == 1
    fill_with_other_blocks(store, ns, 3 * SLOTS)                 # the oldest block would go first
    assert exchange(store).held(ns, [key]) == 1 and bytes(view) == bytes(payload(42))
    assert store.stats().tiers[0].evictions > 0
    exchange(store).checkin(ns, key)
    fill_with_other_blocks(store, ns, 3 * SLOTS, start=900_000)
    assert exchange(store).held(ns, [key]) == 0                            # unpinned: evicted like any other


def test_checkout_twice_needs_two_checkins(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    key = chain(1)[0]
    assert exchange(store).adopt(ns, b"", key, payload(1))

    async def twice() -> None:
        assert await exchange(store).checkout(ns, key) is not None
        assert await exchange(store).checkout(ns, key) is not None
    asyncio.run(twice())
    exchange(store).checkin(ns, key)
    fill_with_other_blocks(store, ns, 3 * SLOTS)
    assert exchange(store).held(ns, [key]) == 1                            # still one reader
    exchange(store).checkin(ns, key)
    fill_with_other_blocks(store, ns, 3 * SLOTS, start=900_000)
    assert exchange(store).held(ns, [key]) == 0


# -- forget --------------------------------------------------------------------------------------
def test_forget_drops_a_chain_deepest_first(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(4)
    adopt_chain(store, ns, keys)
    assert exchange(store).forget(ns, keys) == 4
    st = store.stats()
    assert st.index_blocks == 0 and st.tiers[0].used_bytes == 0 and exchange(store).held(ns, keys) == 0
    assert exchange(store).forget(ns, keys) == 0                                         # nothing left: no-op
    assert exchange(store).forget(Namespace(model="nope").identity(), keys) == 0


def test_forget_keeps_pinned_blocks_and_their_ancestors(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(4)
    adopt_chain(store, ns, keys)

    async def pin() -> None:
        assert await exchange(store).checkout(ns, keys[2]) is not None
    asyncio.run(pin())
    assert exchange(store).forget(ns, keys) == 1          # only the leaf below the pinned block
    assert exchange(store).held(ns, keys) == 3
    exchange(store).checkin(ns, keys[2])
    assert exchange(store).forget(ns, keys) == 3
    assert store.stats().index_blocks == 0


def test_forget_keeps_blocks_with_children_outside_the_list(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    trunk = chain(3)
    adopt_chain(store, ns, trunk)
    branch = chain(2, 70_000)
    adopt_chain(store, ns, branch, parent=trunk[1], seed=50)        # a second child of trunk[1]
    assert exchange(store).forget(ns, trunk) == 1                              # trunk[2] only
    assert exchange(store).held(ns, trunk) == 2
    assert exchange(store).held(ns, [*trunk[:2], *branch]) == 4
    assert read(store, ns, branch[1]) == bytes(payload(51))
    assert exchange(store).forget(ns, [*trunk[:2], *branch]) == 4
    assert store.stats().index_blocks == 0 and store.stats().tiers[0].used_bytes == 0


# -- chains --------------------------------------------------------------------------------------
def check_runs(runs: list[tuple[bytes, list[bytes]]], parent_of: dict[bytes, bytes]) -> None:
    """Every block of ``parent_of`` exactly once; each run hangs under its parent (b"" = root),
    consecutive keys in a run are parent and child, and a parent comes before its children."""
    flat = [k for _, run in runs for k in run]
    assert sorted(flat) == sorted(parent_of), "not every block exactly once"
    assert len(flat) == len(set(flat))
    seen: set[bytes] = set()
    for parent, run in runs:
        assert run, "empty run"
        assert parent_of[run[0]] == parent
        assert parent == b"" or parent in seen, "run before its parent"
        for above, below in itertools.pairwise(run):
            assert parent_of[below] == above
        seen.update(run)


def test_namespace_chains_cover_a_branching_tree_parent_first(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    parent_of: dict[bytes, bytes] = {}

    def grow(keys: list[bytes], parent: bytes = b"") -> None:
        adopt_chain(store, ns, keys, parent)
        for k in keys:
            parent_of[k] = parent
            parent = k

    trunk = chain(3)
    grow(trunk)
    grow(chain(1, 10_000), trunk[0])       # a branch under the root block
    grow(chain(2, 20_000), trunk[1])       # two branches under the middle block
    grow(chain(1, 30_000), trunk[1])
    assert len(parent_of) == 7
    runs = exchange(store).namespace_chains()
    assert {r[0] for r in runs} == {ns}
    check_runs([(parent, keys) for _, parent, keys in runs], parent_of)
    assert exchange(store).namespace_chains("m") == runs
    with pytest.raises(NotFound, match="no namespace of model"):   # a mistyped model is an error
        exchange(store).namespace_chains("some other model")


def test_namespace_chains_span_namespaces_and_filter_by_model(store: BlockStore) -> None:
    a = store.open_namespace(NS).namespace_id
    b = store.open_namespace(Namespace(model="m", tp_rank=1, tp_size=2, block_bytes=BLOCK)).namespace_id
    c = store.open_namespace(Namespace(model="other", block_bytes=BLOCK)).namespace_id
    adopt_chain(store, a, chain(2))
    adopt_chain(store, b, chain(2))            # the same keys in another namespace
    adopt_chain(store, c, chain(1, 5))
    by_ns: dict[int, list[bytes]] = {}
    for ns_id, _parent, keys in exchange(store).namespace_chains():
        by_ns.setdefault(ns_id, []).extend(keys)
    assert by_ns == {a: chain(2), b: chain(2), c: chain(1, 5)}
    assert {ns_id for ns_id, _, _ in exchange(store).namespace_chains("m")} == {a, b}
    assert [(ns_id, keys) for ns_id, _, keys in exchange(store).namespace_chains("other")] == [(c, chain(1, 5))]


def test_namespace_chains_skip_blocks_still_being_written(store: BlockStore) -> None:
    ns = store.open_namespace(NS).namespace_id
    keys = chain(3)
    adopt_chain(store, ns, keys[:1])
    s = store.open_session("t", 1)
    store.reserve(s.session_id, ns, KeyRequest(hashes=keys), BLOCK)   # blocks 1, 2 reserved, unsealed
    assert [k for _, _, run in exchange(store).namespace_chains() for k in run] == keys[:1]


def test_prefix_index_chains_on_a_wide_tree() -> None:
    """Many siblings at several levels: still every block once, parents first."""
    idx = PrefixIndex(1)
    parent_of: dict[bytes, bytes] = {}
    counter = iter(range(1, 10_000))

    def add(parent: bytes, depth: int) -> None:
        if depth == 4:
            return
        for _ in range(3 if depth < 3 else 1):
            key = next(counter).to_bytes(4, "big")
            above = idx.get(parent) if parent else None
            block = idx.insert(key, above, offset=0)
            block.flags = SEALED
            block.pins = 0
            parent_of[key] = parent
            add(key, depth + 1)

    add(b"", 0)
    assert len(parent_of) == 3 + 9 + 27 + 27
    check_runs(idx.chains(), parent_of)


def test_prefix_index_chains_leave_out_unreadable_blocks() -> None:
    idx = PrefixIndex(1)
    a = idx.insert(b"a", None, 0)
    b = idx.insert(b"b", a, 64)
    c = idx.insert(b"c", b, 128)
    for blk in (a, b, c):
        blk.flags, blk.pins = SEALED, 0
    d = idx.insert(b"d", a, 192)           # reserved, not sealed
    assert d.flags == 0
    assert idx.chains() == [(b"", [b"a", b"b", b"c"])]
    assert PrefixIndex(2).chains() == []


# -- stream_blocks from a peer --------------------------------------------------------------------
def test_a_fetched_first_block_reaches_the_reader_before_the_next_is_received(store: BlockStore) -> None:
    """Into engine buffers, block 0's copy and event go out before the fetch lands block 1: while a
    long prompt streams in, the first block's copy would otherwise queue behind the receiving."""
    from kvstored.buffers import TensorSource
    from kvstored.peers.chain_streams import Fetched
    from kvstored_client import shm
    from kvstored_client.contract.layout import TensorLayout

    engine = shm.empty((4, BLOCK), "uint8")
    session = store.open_session("decode", 1)
    ns = store.open_namespace(NS).namespace_id
    buffers = store.register_buffers(session.session_id, ns, [TensorSource(
        engine.name, 0, TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0))])
    keys = chain(3)
    emitted: list[int] = []
    seen_before_landing: list[list[int]] = []

    async def fetcher(namespace_id: int, want: list[bytes], into, landed) -> Fetched:  # type: ignore[no-untyped-def]
        for i in range(len(want)):
            view = await into(i, BLOCK)
            seen_before_landing.append(list(emitted))   # what the reader had as block i comes in
            view[:] = bytes(payload(i))
            await landed(i, "peer-a")
        return Fetched(len(want), "complete")

    async def main() -> object:
        try:
            return await streamer(store).stream_blocks(session.session_id, ns, KeyRequest(hashes=keys),
                                                       buffers.buffers_id, [2, 0, 1], lambda a: emitted.append(a.index),
                                                       fetcher)
        finally:
            await store.unregister_buffers(session.session_id, buffers.buffers_id)

    try:
        end = asyncio.run(main())
        assert end.stop == "complete" and emitted == [0, 1, 2]   # type: ignore[attr-defined]
        assert seen_before_landing[1] == [0], "block 1 was received before block 0 reached the reader"
        rows = engine.numpy()
        assert bytes(rows[2]) == bytes(payload(0)) and bytes(rows[1]) == bytes(payload(2))
    finally:
        engine.close()
