"""Spare slots and commits: a save in one call stores exactly the blocks whose rows were copied
into the session's spare slots, keeps the slots it did not use spare, never hands a spare slot to
anything else, and gives them all back when the session ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from clock import Clock
from store_harness import chain, open_store

from kvstored.store import BlockStore, KeyRequest
from kvstored_client.contract.errors import FailedPrecondition, InvalidArgument
from kvstored_client.contract.namespace import Namespace

BLOCK = 4096
SLOTS = 128   # pages of 32 blocks; a session holds at most 1/16 of the arena: 8 spare slots


@contextlib.contextmanager
def make_store(tmp_path: Path, **dram: object) -> Iterator[tuple[BlockStore, Clock]]:
    values: dict[str, dict[str, object]] = {
        "dram": {"capacity": SLOTS * BLOCK, "page_bytes": 32 * BLOCK, "prefault": False, "policy": "lru", **dram},
        "ssd": {"enabled": False}}
    with open_store(tmp_path, values) as made:
        yield made


def fill(store: BlockStore, offsets: list[int], keys: list[bytes]) -> None:
    for off, key in zip(offsets, keys):
        store.arena.view(off, BLOCK)[:] = key[0]


def readback(store: BlockStore, sid: str, ns: int, keys: list[bytes]) -> list[bytes]:
    """The first byte of each block of the cached prefix of ``keys``, read under a lease."""
    found = asyncio.run(store.lookup(ns, KeyRequest(hashes=keys), lease=True, session_id=sid))
    out = [bytes(store.arena.view(off, BLOCK))[:1] for off in found.offsets]
    store.release(sid, found.lease_id)
    return out


def spares(store: BlockStore, sid: str, ns: int, n: int) -> list[int]:
    return store.commit(sid, ns, KeyRequest(), 0, [], BLOCK, n).spare_offsets


def test_a_commit_stores_the_rows_copied_into_spare_slots_and_tops_the_spares_up(tmp_path: Path) -> None:
    with make_store(tmp_path) as (store, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        held = spares(store, sid, ns, 4)
        assert len(held) == 4 and held == sorted(held)
        assert store.stats().tiers[0].used_bytes == 4 * BLOCK and store.stats().tiers[0].blocks == 0
        keys = chain(4)
        fill(store, held, keys)
        done = store.commit(sid, ns, KeyRequest(hashes=keys), 0, held, BLOCK, 6)
        assert (done.present, done.stored) == (0, 4)
        assert len(done.spare_offsets) == 6 and not set(done.spare_offsets) & set(held)
        assert readback(store, sid, ns, keys) == [k[:1] for k in keys]
        assert store.stats().saved_blocks == 4
        # blocks cached already: their rows' slots stay spare (and come back in the answer)
        more = chain(6)
        rows = done.spare_offsets[:4]
        fill(store, rows, more[2:])
        again = store.commit(sid, ns, KeyRequest(hashes=more), 2, rows, BLOCK, 0)
        assert (again.present, again.stored) == (4, 2)
        assert again.spare_offsets == sorted(rows[:2])
        assert readback(store, sid, ns, more) == [k[:1] for k in more]


def test_a_commit_past_a_block_that_is_not_cached_stores_nothing(tmp_path: Path) -> None:
    """The rows start at ``first``: a block before it that is not cached (it left since the
    client saw it) would leave a hole in the chain, so nothing is stored, every slot stays spare."""
    with make_store(tmp_path) as (store, _):
        sid = store.open_session("t", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        held = spares(store, sid, ns, 2)
        keys = chain(4)
        done = store.commit(sid, ns, KeyRequest(hashes=keys), 2, held, BLOCK, 2)
        assert (done.present, done.stored, done.spare_offsets) == (0, 0, held)
        assert asyncio.run(store.lookup(ns, KeyRequest(hashes=keys))).blocks == 0


def test_a_commit_stops_at_a_block_another_client_is_writing(tmp_path: Path) -> None:
    with make_store(tmp_path) as (store, _):
        sid = store.open_session("a", 1).session_id
        other = store.open_session("b", 2).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        keys = chain(4)
        writing = store.reserve(other, ns, KeyRequest(hashes=keys[:3]), BLOCK)   # blocks 0-2, unsealed
        held = spares(store, sid, ns, 4)
        fill(store, held, keys)
        done = store.commit(sid, ns, KeyRequest(hashes=keys), 0, held, BLOCK, 0)
        assert (done.present, done.stored, done.spare_offsets) == (0, 0, held)
        fill(store, writing.offsets, keys)
        assert store.seal(other, writing.reservation_id) == 3
        done = store.commit(sid, ns, KeyRequest(hashes=keys), 0, held, BLOCK, 0)
        assert (done.present, done.stored, done.spare_offsets) == (3, 1, held[:3])
        assert readback(store, sid, ns, keys) == [k[:1] for k in keys]


@pytest.mark.parametrize("whose", ["unknown", "other session's", "twice", "count"])
def test_a_commit_naming_slots_that_are_not_its_spares_is_refused_and_changes_nothing(
        tmp_path: Path, whose: str) -> None:
    with make_store(tmp_path) as (store, _):
        sid = store.open_session("a", 1).session_id
        other = store.open_session("b", 2).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        mine = spares(store, sid, ns, 2)
        theirs = spares(store, other, ns, 2)
        offsets = {"unknown": [mine[0], (SLOTS - 1) * BLOCK], "other session's": [mine[0], theirs[0]],
                   "twice": [mine[0], mine[0]], "count": mine[:1]}[whose]
        with pytest.raises(InvalidArgument):
            store.commit(sid, ns, KeyRequest(hashes=chain(2)), 0, offsets, BLOCK, 0)
        assert asyncio.run(store.lookup(ns, KeyRequest(hashes=chain(2)))).blocks == 0
        fill(store, mine, chain(2))   # the refused commit took nothing: both slots still spare
        assert store.commit(sid, ns, KeyRequest(hashes=chain(2)), 0, mine, BLOCK, 0).stored == 2


def test_spare_slots_are_never_evicted_nor_reserved_and_go_back_when_the_session_ends(tmp_path: Path) -> None:
    """...once their quarantine (``dram.quarantine_s``) is over: the client learns of its session's
    end after the daemon, and one of its threads may still be copying rows into its spares."""
    with make_store(tmp_path) as (store, clock):
        sid = store.open_session("a", 1).session_id
        other = store.open_session("b", 2).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        held = spares(store, sid, ns, 8)
        assert len(held) == 8
        for i in range(40):   # 160 blocks through the other 120 slots
            keys = chain(4, 100_000 * i)
            r = store.reserve(other, ns, KeyRequest(hashes=keys), BLOCK)
            assert len(r.offsets) == 4 and not set(r.offsets) & set(held)
            fill(store, r.offsets, keys)
            store.seal(other, r.reservation_id)
        with pytest.raises(InvalidArgument):   # past the limit: the 9th is not given
            store.commit(sid, ns, KeyRequest(hashes=chain(9)), 0, [*held, held[-1] + BLOCK], BLOCK, 0)
        assert spares(store, sid, ns, 20) == []   # at most 1/16 of the arena
        assert store.stats().tiers[0].used_bytes == SLOTS * BLOCK
        store.close_session(sid)
        assert store.stats().tiers[0].used_bytes == SLOTS * BLOCK, "free before the quarantine is over"
        r = store.reserve(other, ns, KeyRequest(hashes=chain(8, 800_000)), BLOCK)
        assert len(r.offsets) == 8 and not set(r.offsets) & set(held), "a quarantined slot was handed out"
        store.release(other, r.reservation_id)   # (its 8 slots free: 120 used)
        clock.now += store.config.dram.quarantine_s
        store.reap()
        assert store.stats().tiers[0].used_bytes == 112 * BLOCK   # the 8 spare slots are free again
        with pytest.raises(FailedPrecondition):
            store.commit(sid, ns, KeyRequest(hashes=chain(1)), 0, held[:1], BLOCK, 0)
        r = store.reserve(other, ns, KeyRequest(hashes=chain(8, 900_000)), BLOCK)
        assert sorted(r.offsets) == held   # free slots are taken before anything is evicted


def test_no_spares_when_the_config_gives_none(tmp_path: Path) -> None:
    with make_store(tmp_path, spare_bytes=0) as (store, _):
        sid = store.open_session("a", 1).session_id
        ns = store.open_namespace(Namespace()).namespace_id
        assert spares(store, sid, ns, 4) == []
        assert store.spares.limit_bytes == 0


def test_all_sessions_together_hold_at_most_an_eighth_of_the_arena(tmp_path: Path) -> None:
    """Every engine process is a session: without a cap over them all, sixteen sessions could hold
    the whole arena in slots no block uses, evicting every cached block for them. The sessions
    past an eighth get none (their saves take reservations) until another gives its slots up."""
    with make_store(tmp_path) as (store, clock):
        ns = store.open_namespace(Namespace()).namespace_id
        sids = [store.open_session(f"s{i}", i + 1).session_id for i in range(3)]
        got = [len(spares(store, sid, ns, 8)) for sid in sids]
        assert got == [8, 8, 0], "two sessions' worth (1/8 of 128 slots) in all"
        assert store.stats().tiers[0].used_bytes == 16 * BLOCK
        store.close_session(sids[0])
        assert spares(store, sids[2], ns, 8) == [], "in quarantine, still counted"
        clock.now += store.config.dram.quarantine_s
        assert len(spares(store, sids[2], ns, 8)) == 8, "the slots an ended session gave up go to another"
        assert spares(store, sids[1], ns, 8) == [] and store.spares.held_bytes == 16 * BLOCK
