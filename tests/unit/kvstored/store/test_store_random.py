"""A model-based randomized test of the whole store: a seeded sequence of operations driven through
its async API the way the servicer calls it (arena saves and reads, saves and loads through
registered buffers, peer streams, prefetch, evict, flush, write-back, lease expiry, session ends,
cancellations at random await points, restarts over the same SSD directory), checked against a
model of the bytes last stored under each key and the store's own bookkeeping after every step.

The op sequence is a function of the seed; the interleaving with the copy and SSD threads is not,
so a failing seed may need a few runs to fail again. Many seeds, outside the suite:

    python tests/unit/kvstored/store/test_store_random.py FIRST COUNT [STEPS]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

if __name__ == "__main__":   # run as a script: find the tests' helpers as pytest does
    sys.path[:0] = [str(Path(__file__).resolve().parents[3] / "tests"), str(Path(__file__).resolve().parents[3])]

from clock import Clock
from random_model import Broken, ClientSession, Tracked, payload, sweep, under_ssd
from store_harness import ROOM_WAIT_S, exchange, streamer

from kvstored import config
from kvstored.buffers import TensorSource
from kvstored.copy import CopyEngine
from kvstored.index import DEMOTING, NO_SLOT, ON_SSD, Block, Tier
from kvstored.peers.chain_streams import Fetched
from kvstored.peers.exchange import PeerLanding
from kvstored.policy.registry import POLICIES
from kvstored.presence import PresenceTable
from kvstored.store import BlockStore, KeyRequest
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import BlockRecord, Corrupt, MapFull, SSDError, SSDTier
from kvstored_client import shm
from kvstored_client.contract import presence as presence_layout
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.layout import TensorLayout
from kvstored_client.contract.namespace import Namespace

PAGE = 16384
SIZES = (4096, 2048)            # block bytes of the two namespaces: 4 and 8 slots a page
MODELS = ("a", "b")
ROWS_PER_OP = 6                 # longest chain
SLOTS_PER_BUFFER = 3            # concurrent ops one session's buffers serve
TTL, RES_TTL = 10.0, 20.0


class Fuzz:
    def __init__(self, tmp: Path, seed: int, steps: int) -> None:
        self.tmp = tmp
        self.rng = random.Random(seed)
        self.seed = seed
        self.steps = steps
        rng = self.rng
        self.cfg = config.build({
            "dram": {"capacity": rng.choice((2, 3)) * PAGE, "page_bytes": PAGE, "prefault": False,
                     "policy": rng.choice(POLICIES), "writeback_watermark": rng.choice((0.25, 0.5)),
                     "room_wait_s": ROOM_WAIT_S},
            "ssd": {"enabled": True, "capacity": rng.choice((8, 12, 16)) * SIZES[0], "policy": rng.choice(POLICIES),
                    "high_watermark": 0.95, "low_watermark": 0.5, "sync": False,
                    "admission": rng.choice(("always", "always", "hit_before"))},
            "leases": {"ttl_s": TTL, "reservation_ttl_s": RES_TTL}})
        self.clock = Clock()
        self.model: dict[tuple[int, bytes], bytes] = {}
        self.version = 0
        self.tracked: dict[int, Tracked] = {}
        self.sessions: list[ClientSession] = []
        self.inflight: dict[asyncio.Task[None], str] = {}
        self.log: list[str] = []
        self.faults = random.Random(seed + 1_000_003)   # its own stream: faults do not shift the ops
        self.fault_rate = rng.choice((0.0, 0.0, 0.03, 0.1))
        self.corrupt: set[tuple[int, bytes]] = set()     # (namespace id, key) whose SSD payload was damaged
        self.landings: list[tuple[int, bytes, bytes, PeerLanding]] = []   # ns, key, bytes, landing
        self.checkouts: list[tuple[int, bytes, bytes, memoryview]] = []   # ns, key, bytes, view
        self.on_ssd: set[tuple[int, bytes]] = set()      # what the last stop left on SSD
        self.chains: list[list[tuple[int, list[bytes]]]] = [[], []]
        for ns in range(2):
            for _ in range(16):
                base = rng.randrange(3)
                toks = list(range(base * 1000, base * 1000 + 16 * rng.randrange(1, 3)))
                for _ in range(rng.randrange(0, 5)):
                    t = rng.randrange(2)
                    toks += [50_000 + t * 100 + len(toks) + j for j in range(16)]
                keys = block_hashes(toks[: 16 * ROWS_PER_OP])
                self.chains[ns].append((ns, keys))
        self.store: BlockStore
        self.ns_ids: list[int] = []
        self.ssd: SSDTier | None = None
        self.arena: Arena
        self.copy: CopyEngine

    # -- the store's life ------------------------------------------------------------------
    def open(self) -> None:
        self.arena = Arena(str(self.tmp), self.cfg.dram.capacity, prefault=False)
        self.copy = CopyEngine(self.arena)
        self.ssd = SSDTier(str(self.tmp / "ssd"), 8 << 20, sync=False)
        self.ssd_read = self.ssd.read_into
        self.inject_faults(self.ssd)
        ids = iter(range(1, 1_000_000))
        # a small table: some buckets overflow, which verify_presence allows for
        self.presence = PresenceTable(self.tmp / "presence", 8, 0o600)
        self.store = BlockStore(self.cfg, self.arena, self.copy, self.ssd, clock=self.clock,
                                new_session_id=lambda: f"s{next(ids)}", presence=self.presence)
        self.watch_slots_handed_out()
        self.store.restore()
        self.ns_ids = [self.store.open_namespace(Namespace(model=m, block_bytes=b)).namespace_id
                       for m, b in zip(MODELS, SIZES)]
        restored = {(self.ns_of(b), b.key) for b in self.blocks()}
        if restored != self.on_ssd:
            self.fail(f"restore brought back {len(restored - self.on_ssd)} blocks that were not on SSD and "
                      f"lost {len(self.on_ssd - restored)} that were")
        # spare slots each session holds: ns -> {offset: the bytes a commit-to-be wrote there, or None}
        self.spares: dict[str, dict[int, dict[int, bytes | None]]] = {}
        # (the default's 1/16 of these few-page arenas is not one slot)
        self.store.spares.limit_bytes = 2 * SIZES[0]
        self.store.spares.total_bytes = 3 * SIZES[0]   # (two sessions: the cap over all binds too)
        self.sessions = [self.new_session() for _ in range(2)]

    def watch_slots_handed_out(self) -> None:
        """Every slot the DRAM tier hands out (to a reservation, a promotion, a landing) is named
        by no where word of the presence table: an SDK reading without a lease must have seen
        its last block's publication end before anything may write the slot."""
        dram = self.store.placement.dram
        take_free, path = dram.take_free, self.presence.path
        n = self.presence.buckets * presence_layout.SLOTS   # slots, then as many where words

        def watched(slot_bytes: int) -> int | None:
            offset = take_free(slot_bytes)
            if offset is not None:
                data = path.read_bytes()
                words = np.frombuffer(data, np.uint64, n, presence_layout.HEADER.size + n * 8).tolist()
                if any(w and presence_layout.where_offset(w) == offset for w in words):
                    self.fail(f"slot {offset} handed out while the presence table still publishes it")
            return offset

        dram.take_free = watched  # type: ignore[method-assign]

    def inject_faults(self, ssd: SSDTier) -> None:
        """Some SSD writes and reads fail (an I/O error, a full map, a checksum mismatch)."""
        put, read = ssd.put, ssd.read_into

        def failed(exc: Exception) -> Future[None]:
            fut: Future[None] = Future()
            fut.set_exception(exc)
            return fut

        def faulty_put(*args: Any, **kwargs: Any) -> Future[None]:
            if self.faults.random() < self.fault_rate:
                return failed(self.faults.choice((SSDError("injected write error"), MapFull("injected"))))
            return put(*args, **kwargs)

        def faulty_read(*args: Any) -> Future[None]:
            if self.faults.random() < self.fault_rate:
                return failed(self.faults.choice((Corrupt("injected checksum mismatch"), OSError(5, "injected"))))
            return read(*args)

        ssd.put = faulty_put             # type: ignore[method-assign]
        ssd.read_into = faulty_read      # type: ignore[method-assign]

    def new_session(self) -> ClientSession:
        s = ClientSession(self.store.open_session("fuzz", 1).session_id)
        for ns, nbytes in enumerate(SIZES):
            rows = ROWS_PER_OP * SLOTS_PER_BUFFER
            engine = shm.empty((rows, nbytes), "uint8")
            buffers = self.store.register_buffers(s.session_id, self.ns_ids[ns], [TensorSource(
                engine.name, 0, TensorLayout((rows, nbytes), (nbytes, 1), "uint8", 0))])
            s.buffers[ns] = (buffers.buffers_id, engine)
            s.free_rows[ns] = list(range(SLOTS_PER_BUFFER))
        return s

    async def close(self, write_back: bool) -> None:
        """As the daemon stops: calls in flight get a while to finish (``quiesce``), sessions end
        (sometimes under calls still running), calls are cancelled, DRAM-only blocks are written
        down (or not), everything closes."""
        if self.inflight and self.rng.random() < 0.5:
            await self.store.quiesce(self.rng.choice((0.0, 0.002, 0.05)))
            for s in self.sessions:
                self.store.close_session(s.session_id)
                s.closed = True
            self.tracked.clear()
            self.spares.clear()
            await self.yield_some()
        await self.cancel_all()
        while self.landings:
            self.end_landing(commit=False)
        while self.checkouts:
            self.op_checkin()
        for s in self.sessions:
            self.store.close_session(s.session_id)
            for _, engine in s.buffers.values():
                engine.close()
        self.sessions = []
        self.tracked.clear()
        self.spares.clear()
        await self.check_quiescent()
        if write_back:
            await self.store.write_back_for_shutdown()
        await self.store.finish_background()
        # restore takes back what is on SSD under parents on SSD (a chain's head only in DRAM is lost)
        self.on_ssd = {(self.ns_of(b), b.key) for b in self.blocks() if b.on_ssd and under_ssd(b)}
        self.copy.close()
        assert self.ssd is not None
        self.ssd.close()
        self.arena.close()
        self.presence.close()

    # -- invariants ------------------------------------------------------------------------
    def blocks(self) -> list[Block]:
        return [b for st in self.store.catalog for b in st.index]

    def fail(self, what: str) -> None:
        tail = self.log[-int(os.environ.get("FUZZ_LOG", "25")):]
        raise Broken(f"seed {self.seed}: {what}\nin flight: {sorted(self.inflight.values())}\nlast ops:\n  "
                     + "\n  ".join(tail))

    def ns_of(self, block: Block) -> int:
        return self.ns_ids.index(block.index.namespace_id)

    def check(self) -> None:
        """What holds at every step, with requests in flight."""
        store = self.store
        if problems := store.verify_presence():
            self.fail(f"the presence table differs from the index: {problems[:3]}")
        blocks = self.blocks()
        used = 0
        offsets: dict[int, Block] = {}
        ssd_bytes = 0
        dirty: set[Block] = set()
        for b in blocks:
            name = f"block {b.key.hex()[:8]} (depth {b.depth}, flags {b.flags}, pins {b.pins})"
            if b.pins < 0:
                self.fail(f"{name} has negative pins")
            if b.parent is not None and b.index.get(b.parent.key) is not b.parent:
                self.fail(f"{name}'s parent is not in the index")
            if b.depth != (0 if b.parent is None else b.parent.depth + 1):
                self.fail(f"{name} has a wrong depth")
            if b.offset != NO_SLOT:
                if b.offset in offsets:
                    self.fail(f"{name} shares slot {b.offset} with {offsets[b.offset].key.hex()[:8]}")
                offsets[b.offset] = b
                used += b.index.slot_bytes
            if b.flags & (ON_SSD | DEMOTING):
                ssd_bytes += b.index.block_bytes
            if b.sealed and b.in_dram and not b.on_ssd:
                dirty.add(b)
            if b.sealed and not b.readable and not b.children and not b.pins and store.promotion.pending(b) is None:
                self.fail(f"{name} is a hollow leaf nothing holds, left in the index")
            if b.flags & ON_SSD and b.flags & DEMOTING:
                self.fail(f"{name} is on SSD and being written there")
        taken = set(offsets)
        for sid, by_ns in self.spares.items():
            for ns, held in by_ns.items():
                for offset, want in held.items():
                    if offset in taken:
                        self.fail(f"spare slot {offset} of session {sid} is also a block's or another's")
                    taken.add(offset)
                    used += store.catalog.get(self.ns_ids[ns]).index.slot_bytes
                    if want is not None and bytes(self.arena.view(offset, SIZES[ns])) != want:
                        self.fail(f"spare slot {offset} of session {sid}: its bytes changed before a commit")
        # an ended session's spares, and the slots of reservations ended under their client: not free yet
        for offset, slot_bytes in store.spares.quarantine.slots() + store.leasing.quarantine.slots():
            if offset in taken:
                self.fail(f"slot {offset} in quarantine is also a block's or a spare")
            taken.add(offset)
            used += slot_bytes
        if store.spares.held_bytes != sum(store.catalog.get(self.ns_ids[ns]).index.slot_bytes * len(held)
                                          for by_ns in self.spares.values() for ns, held in by_ns.items()):
            self.fail(f"spare slots counted as {store.spares.held_bytes} bytes held in all")
        for _, key, _, landing in self.landings:
            if landing.offset in taken:
                self.fail(f"landing of {key.hex()[:8]} shares slot {landing.offset} with another")
            taken.add(landing.offset)
            used += landing.state.index.slot_bytes
        kids = Counter(b.parent for b in blocks if b.parent is not None)
        for b in blocks:
            if b.children != kids.get(b, 0):
                self.fail(f"block {b.key.hex()[:8]} counts {b.children} children, has {kids.get(b, 0)}")
        if store.placement.dram.used_bytes != used:
            self.fail(f"allocator uses {store.placement.dram.used_bytes} bytes; blocks hold {used}")
        if store.placement.ssd.used_bytes != ssd_bytes:
            self.fail(f"SSD used is {store.placement.ssd.used_bytes}; blocks on (or going to) SSD hold {ssd_bytes}")
        on_ssd = sum(1 for b in blocks if b.flags & ON_SSD)
        if store.stats().tiers[1].blocks != on_ssd:
            self.fail(f"stats count {store.stats().tiers[1].blocks} blocks on SSD; {on_ssd} have a copy there")
        if store.placement.ssd.used_bytes > self.cfg.ssd.capacity:
            self.fail(f"SSD used {store.placement.ssd.used_bytes} exceeds capacity {self.cfg.ssd.capacity}")
        if set(store.placement.queue) != dirty:
            self.fail(f"write-back queue {len(store.placement.queue)} blocks, DRAM-only sealed blocks {len(dirty)}")
        if store.placement.queue.bytes != sum(b.index.slot_bytes for b in dirty):
            self.fail(f"dirty bytes {store.placement.queue.bytes} != {sum(b.index.slot_bytes for b in dirty)}")
        for _, key, want, view in self.checkouts:
            if bytes(view) != want:
                self.fail(f"checked-out block {key.hex()[:8]}'s bytes changed while a peer reads them")
        for _, key, want, landing in self.landings:
            if bytes(landing.view) != want:
                self.fail(f"bytes landing for {key.hex()[:8]} changed before the landing was committed")
        for t in self.tracked.values():   # what a client holds stays as it was
            for key, offset, want in zip(t.keys, t.offsets, t.expected):
                block = store.catalog.get(self.ns_ids[t.ns]).index.get(key)
                if block is None or block.offset != offset:
                    self.fail(f"lease {t.lease_id}: block {key.hex()[:8]} left slot {offset}")
                if bytes(self.arena.view(offset, SIZES[t.ns])) != want:
                    self.fail(f"lease {t.lease_id}: block {key.hex()[:8]}'s bytes changed under the lease")

    def expected_pins(self) -> Counter[Block]:
        """The pins of the leases, the landings (their parents) and the checkouts."""
        store = self.store
        want: Counter[Block] = Counter()
        for lease in store.leasing.leases():
            want.update(lease.pinned)
            want.update(lease.new)
        for _, _, _, landing in self.landings:
            if landing.parent is not None:
                want[landing.parent] += 1
        for ns, key, _, _ in self.checkouts:
            block = store.catalog.get(self.ns_ids[ns]).index.get(key)
            assert block is not None
            want[block] += 1
        return want

    async def check_quiescent(self) -> None:
        """Nothing in flight: pins are exactly the leases', policies track exactly their tier's
        blocks, every stored copy holds the model's bytes."""
        assert not self.inflight
        store = self.store
        await store.finish_background()
        # A call cancelled again while its copy to engine buffers runs ends at once; its blocks are
        # unpinned when the copy is done (Handover.close): wait for such copies, a while at most.
        for _ in range(2000):
            pins = self.expected_pins()
            if all(b.pins == pins[b] for b in self.blocks()):
                break
            await asyncio.sleep(0.001)
        self.check()
        leasing = store.leasing
        if leasing.busy_leases() or leasing.doomed_leases() or len(store.promotion) or leasing.lookups_in_flight:
            self.fail(f"idle store with busy {store.leasing.busy_leases()}, doomed {store.leasing.doomed_leases()}, "
                      f"{len(store.promotion)} promoting, {store.leasing.lookups_in_flight} lookups in flight")
        live = {lease.lease_id for lease in store.leasing.leases()}
        if live != set(self.tracked):
            self.fail(f"store holds leases {sorted(live)}; clients hold {sorted(self.tracked)}")
        want = self.expected_pins()
        open_new = {b for lease in store.leasing.leases() for b in lease.new}
        blocks = self.blocks()
        dram_policies = store.placement.dram.policies()
        for b in blocks:
            name = f"block {b.key.hex()[:8]} (depth {b.depth}, flags {b.flags}, slot {b.offset})"
            if b.pins != want[b]:
                self.fail(f"{name} has {b.pins} pins; leases hold {want[b]}")
            if not b.sealed and b not in open_new:
                self.fail(f"{name} is unsealed with no reservation writing it")
            if b.sealed and not b.readable and not b.children and not b.pins:
                self.fail(f"{name} is a hollow leaf left in the index")   # (a reservation may pin one)
            in_dram_policy = [size for size, p in dram_policies.items() if b in p]
            in_ssd_policy = b in store.placement.ssd.policy
            should_dram = b.sealed and b.in_dram
            should_ssd = b.sealed and not b.in_dram and b.on_ssd
            if in_dram_policy != ([b.index.slot_bytes] if should_dram else []):
                self.fail(f"{name} tracked by DRAM policies {in_dram_policy}")
            if in_ssd_policy != should_ssd:
                self.fail(f"{name} {'' if in_ssd_policy else 'not '}tracked by the SSD policy")
            key = (self.ns_of(b), b.key)
            if b.sealed and b.readable and key not in self.model:
                self.fail(f"{name} is stored but was never saved")
            if b.sealed and b.in_dram and bytes(self.arena.view(b.offset, b.index.block_bytes)) != self.model[key]:
                self.fail(f"{name}: DRAM bytes are not the last saved")
        for size, p in dram_policies.items():
            n = sum(1 for b in blocks if b.sealed and b.in_dram and b.index.slot_bytes == size)
            if len(p) != n:
                self.fail(f"DRAM policy of {size}-byte slots tracks {len(p)} blocks; {n} are there")
        n = sum(1 for b in blocks if b.sealed and not b.in_dram and b.on_ssd)
        if len(store.placement.ssd.policy) != n:
            self.fail(f"SSD policy tracks {len(store.placement.ssd.policy)} blocks; {n} are SSD-only")
        # the disk: the writer applies ops in order; a delete of nothing behind them is a barrier
        assert self.ssd is not None
        await asyncio.wrap_future(self.ssd.delete_raw(b"\xff" * 40))
        on_disk = {(r.namespace_id, r.key) for r in self.ssd.scan() if isinstance(r, BlockRecord)}
        indexed = {(b.index.namespace_id, b.key) for b in blocks if b.on_ssd}
        if on_disk != indexed:
            self.fail(f"{len(on_disk - indexed)} SSD records without a block on SSD, "
                      f"{len(indexed - on_disk)} blocks on SSD without a record")
        for b in blocks:
            if b.on_ssd:
                nbytes = b.index.block_bytes
                buf = np.empty(nbytes, np.uint8)
                try:
                    await asyncio.wrap_future(self.ssd_read(b.index.namespace_id, b.key, buf))
                except Corrupt as exc:
                    if (b.index.namespace_id, b.key) in self.corrupt:
                        continue
                    self.fail(f"block {b.key.hex()[:8]}: SSD copy unreadable: {exc}")
                if bytes(buf) != self.model[(self.ns_of(b), b.key)]:
                    self.fail(f"block {b.key.hex()[:8]}: SSD bytes are not the last saved")

    def expect(self, ns: int, keys: list[bytes], got: list[bytes], what: str) -> None:
        for i, (key, data) in enumerate(zip(keys, got)):
            want = self.model.get((ns, key))
            if data != want:
                self.fail(f"{what}: block {i} ({key.hex()[:8]}) has wrong bytes "
                          f"({'never saved' if want is None else 'not the last saved'})")

    # -- operations ------------------------------------------------------------------------
    def pick(self) -> tuple[ClientSession, int, list[bytes]]:
        s = self.rng.choice(self.sessions)
        ns = self.rng.randrange(2)
        _, keys = self.rng.choice(self.chains[ns])
        return s, ns, keys[: self.rng.randrange(1, len(keys) + 1)]

    def new_bytes(self, ns: int, key: bytes) -> bytes:
        self.version += 1
        return payload(key, ns, self.version, SIZES[ns])

    def op_reserve(self) -> None:
        s, ns, keys = self.pick()
        now = self.clock.now
        try:
            r = self.store.reserve(s.session_id, self.ns_ids[ns], KeyRequest(hashes=keys), SIZES[ns])
        except KVStoreError as exc:
            self.log.append(f"  -> {type(exc).__name__}")
            return
        new = keys[r.present: r.present + len(r.offsets)]
        written = [self.new_bytes(ns, k) for k in new]
        for offset, data in zip(r.offsets, written):
            self.arena.view(offset, SIZES[ns])[:] = np.frombuffer(data, np.uint8)
        self.tracked[r.reservation_id] = Tracked(r.reservation_id, s.session_id, ns, new, list(r.offsets),
                                                 written, True, (now, now), RES_TTL)
        self.log.append(f"  -> reservation {r.reservation_id}: present {r.present}, new {len(new)}")

    def op_seal(self) -> None:
        held = [t for t in self.tracked.values() if t.reservation]
        if not held:
            return
        t = self.rng.choice(held)
        del self.tracked[t.lease_id]
        n = self.store.seal(t.session, t.lease_id)
        if n != len(t.keys):
            self.fail(f"seal of reservation {t.lease_id} sealed {n} of {len(t.keys)} blocks")
        for key, data in zip(t.keys, t.expected):
            self.model[(t.ns, key)] = data
        self.log.append(f"  -> sealed {t.lease_id} ({n})")

    def op_commit(self) -> None:
        """A save in one call: rows into the session's spare slots (asking for some first when it
        holds too few), then a commit from where a table would show the chain cached (sometimes
        past a block that is not: nothing may be stored then)."""
        s, ns, keys = self.pick()
        held = self.spares.setdefault(s.session_id, {}).setdefault(ns, {})
        index = self.store.catalog.get(self.ns_ids[ns]).index
        present = len(index.match(keys))
        first = present if self.rng.random() < 0.8 else self.rng.randrange(len(keys) + 1)
        need = len(keys) - first
        try:
            if len(held) < need:
                c = self.store.commit(s.session_id, self.ns_ids[ns], KeyRequest(), 0, [], SIZES[ns], need)
                held.update(dict.fromkeys(c.spare_offsets))
                self.log.append(f"  -> {len(c.spare_offsets)} spare slots")
                return
            offsets = sorted(held)[:need]
            written = [self.new_bytes(ns, k) for k in keys[first:]]
            for offset, data in zip(offsets, written):
                self.arena.view(offset, SIZES[ns])[:] = np.frombuffer(data, np.uint8)
                held[offset] = data
            c = self.store.commit(s.session_id, self.ns_ids[ns], KeyRequest(hashes=keys), first, offsets,
                                  SIZES[ns], self.rng.randrange(3))
        except KVStoreError as exc:
            self.log.append(f"  -> {type(exc).__name__}: {exc}")
            return
        if c.present < first and c.stored:
            self.fail(f"a commit past block {c.present}, not cached, stored {c.stored} blocks")
        used = offsets[c.present - first: c.present - first + c.stored] if c.stored else []
        for i, offset in enumerate(used):
            del held[offset]
            self.model[(ns, keys[c.present + i])] = written[c.present - first + i]
        if not (set(offsets) - set(used)) <= set(c.spare_offsets):
            self.fail("a commit kept slots of rows it did not use that it did not name as spare")
        for offset in c.spare_offsets:
            held.setdefault(offset, None)
        self.log.append(f"  -> commit from {first}: present {c.present}, stored {c.stored}, "
                        f"{len(c.spare_offsets)} spare")

    def op_release(self) -> None:
        if not self.tracked:
            return
        t = self.rng.choice(list(self.tracked.values()))
        del self.tracked[t.lease_id]
        self.store.release(t.session, t.lease_id)
        self.log.append(f"  -> released {t.lease_id}")

    def op_expire(self) -> None:
        self.clock.now += self.rng.choice((TTL + 0.5, RES_TTL + 0.5))
        self.reap()

    def reap(self) -> None:
        n = self.store.reap()
        now = self.clock.now
        gone = [t for t in self.tracked.values() if self.store.leasing.get(t.lease_id) is None]
        for t in gone:
            if t.born[0] + t.ttl > now:
                self.fail(f"lease {t.lease_id} reaped before its deadline")
            del self.tracked[t.lease_id]
        for t in self.tracked.values():
            if t.born[1] + t.ttl <= now:
                self.fail(f"lease {t.lease_id} outlived its deadline")
        self.log.append(f"  -> reaped {n} ({len(gone)} of ours)")

    async def op_lookup(self) -> None:
        s, ns, keys = self.pick()
        lease = self.rng.random() < 0.6
        start = self.clock.now
        r = await self.store.lookup(self.ns_ids[ns], KeyRequest(hashes=keys), lease=lease, session_id=s.session_id)
        if len(r.tiers) != r.blocks or r.blocks > len(keys):
            self.fail(f"lookup answered {r.blocks} blocks with tiers {r.tiers}")
        if not lease or not r.blocks:
            if lease and r.lease_id:
                self.fail("an empty leased lookup named a lease")
            return
        got = [bytes(self.arena.view(o, SIZES[ns])) for o in r.offsets]
        self.expect(ns, keys, got, "leased lookup")
        if self.rng.random() < 0.3 and not s.closed:
            self.store.release(s.session_id, r.lease_id)
        elif not s.closed:
            self.tracked[r.lease_id] = Tracked(r.lease_id, s.session_id, ns, keys[: r.blocks], list(r.offsets),
                                               got, False, (start, self.clock.now), TTL)

    def rows(self, s: ClientSession, ns: int) -> int | None:
        free = s.free_rows[ns]
        return free.pop(self.rng.randrange(len(free))) if free else None

    @contextlib.contextmanager
    def engine_rows(self, s: ClientSession, ns: int, n: int) -> Iterator[tuple[int, Any, list[int]] | None]:
        """``(buffers_id, rows, ids)``: a free range of ``n`` rows of the session's buffers for
        ``ns``, given back afterwards; None when every range is in use."""
        slot = self.rows(s, ns)
        if slot is None:
            yield None
            return
        try:
            buffers_id, engine = s.buffers[ns]
            yield buffers_id, engine.numpy(), list(range(slot * ROWS_PER_OP, slot * ROWS_PER_OP + n))
        finally:
            s.free_rows[ns].append(slot)

    async def op_save_blocks(self) -> None:
        s, ns, keys = self.pick()
        with self.engine_rows(s, ns, len(keys)) as place:
            if place is None:
                return
            buffers_id, rows, ids = place
            written = [self.new_bytes(ns, k) for k in keys]
            for i, data in zip(ids, written):
                rows[i] = np.frombuffer(data, np.uint8)
            present, stored = await self.store.save_blocks(s.session_id, self.ns_ids[ns], buffers_id,
                                                           KeyRequest(hashes=keys), ids)
            for i in range(present, present + stored):
                self.model[(ns, keys[i])] = written[i]
            self.log.append(f"  -> save_blocks present {present} stored {stored}")

    async def op_load_blocks(self) -> None:
        s, ns, keys = self.pick()
        with self.engine_rows(s, ns, len(keys)) as place:
            if place is None:
                return
            buffers_id, rows, ids = place
            rows[ids] = 0
            tiers = await self.store.load_blocks(s.session_id, self.ns_ids[ns], buffers_id,
                                                 KeyRequest(hashes=keys), ids)
            self.expect(ns, keys, [bytes(rows[i]) for i in ids[: len(tiers)]], "load_blocks")
            self.log.append(f"  -> load_blocks {len(tiers)}")

    async def op_stream(self) -> None:
        """stream_blocks with a stand-in peer that sends what is missing (or stops short)."""
        s, ns, keys = self.pick()
        arena_mode = self.rng.random() < 0.5
        slot = None if arena_mode else self.rows(s, ns)
        if not arena_mode and slot is None:
            return
        short = self.rng.choice((None, 0, 1, 2))
        pauses = [self.rng.random() < 0.5 for _ in keys]
        buffers_id, engine = s.buffers[ns]
        ids = list(range(slot * ROWS_PER_OP, slot * ROWS_PER_OP + len(keys))) if slot is not None else []
        rows = engine.numpy()
        if ids:
            rows[ids] = 0
        checked = 0

        def emit(arrival: Any) -> None:
            nonlocal checked
            if arrival.index != checked:
                self.fail(f"stream handed block {arrival.index} after {checked}")
            data = bytes(self.arena.view(arrival.offset, SIZES[ns])) if arena_mode else bytes(rows[ids[arrival.index]])
            self.expect(ns, [keys[arrival.index]], [data], f"stream arrival ({'arena' if arena_mode else 'buffers'})")
            checked += 1

        async def fetcher(namespace_id: int, want: list[bytes], into: Any, landed: Any) -> Fetched:
            for i, key in enumerate(want):
                if short is not None and i >= short:
                    return Fetched(i, "missing", "stand-in peer stops")
                try:
                    view = await into(i, SIZES[ns])
                except KVStoreError as exc:
                    return Fetched(i, "no_room", str(exc))
                data = self.new_bytes(ns, key)
                view[:] = data
                if pauses[i]:
                    await asyncio.sleep(0)
                self.model[(ns, key)] = data   # landed() seals it and hands it over at once
                await landed(i, "peer")
            return Fetched(len(want), "complete")

        try:
            end = await streamer(self.store).stream_blocks(s.session_id, self.ns_ids[ns], KeyRequest(hashes=keys),
                                                 0 if arena_mode else buffers_id, ids, emit, fetcher)
        finally:
            if slot is not None:
                s.free_rows[ns].append(slot)
        if end.blocks != checked:
            self.fail(f"stream ended with {end.blocks} blocks but handed over {checked}")
        self.log.append(f"  -> stream {end.blocks}/{end.requested} {end.stop} lease {end.lease_id}")
        if end.lease_id:
            if s.closed:
                return
            lease = self.store.leasing.get(end.lease_id)
            if lease is None:
                self.fail(f"stream handed lease {end.lease_id}, which is gone")
            offsets = [b.offset for b in lease.pinned]
            got = [bytes(self.arena.view(o, SIZES[ns])) for o in offsets]
            self.expect(ns, keys, got, "stream's lease")
            self.tracked[end.lease_id] = Tracked(end.lease_id, s.session_id, ns, keys[: len(offsets)], offsets, got,
                                                 False, (self.clock.now, self.clock.now), TTL)

    def op_prefetch(self) -> None:
        _, ns, keys = self.pick()
        hit, promoting = self.store.prefetch(self.ns_ids[ns], KeyRequest(hashes=keys))
        self.log.append(f"  -> prefetch hit {hit} promoting {promoting}")

    def op_evict(self) -> None:
        model = self.rng.choice(("", *MODELS))
        tier = self.rng.choice((Tier.DRAM, Tier.SSD, None))
        self.log.append(f"  -> evict {model!r} {tier!r}: {self.store.evict(model, tier)}")

    async def op_flush(self) -> None:
        model = self.rng.choice(("", *MODELS))
        try:
            n = await self.store.flush(model)
        except KVStoreError as exc:
            self.log.append(f"  -> flush {model!r}: {exc}")
            return
        self.log.append(f"  -> flush {model!r}: {n}")

    async def op_write_back(self) -> None:
        """One round of the write-back task (as writeback_loop runs it)."""
        store = self.store
        limit = self.cfg.dram.writeback_watermark * store.placement.dram.capacity
        if store.placement.queue.bytes > limit and self.clock.now >= store.writeback.backoff_until:
            n = await store.writeback.write_back(store.placement.queue.bytes - limit, force=False, models=None)
            self.log.append(f"  -> write-back {n}")

    async def op_shutdown_write_back(self) -> None:
        self.log.append(f"  -> write_back_for_shutdown {await self.store.write_back_for_shutdown()}")

    def op_close_session(self) -> None:
        s = self.rng.choice(self.sessions)
        self.store.close_session(s.session_id)
        self.spares.pop(s.session_id, None)
        s.closed = True
        for t in [t for t in self.tracked.values() if t.session == s.session_id]:
            del self.tracked[t.lease_id]
        # the engine frees its buffers once the calls using them have ended (close_all does)
        self.closed_engines.extend(engine for _, engine in s.buffers.values())
        self.sessions[self.sessions.index(s)] = self.new_session()

    def op_corrupt(self) -> None:
        """Damage the payload of a block on SSD, as a bad sector would."""
        assert self.ssd is not None
        on_ssd = [b for b in self.blocks() if b.on_ssd]
        if not on_ssd:
            return
        b = self.rng.choice(on_ssd)
        rec = next(r for r in self.ssd.scan() if isinstance(r, BlockRecord)
                   and r.namespace_id == b.index.namespace_id and r.key == b.key)
        stride = -(-rec.length // 4096) * 4096
        with open(self.ssd.path / f"payload-{rec.length}.dat", "r+b") as fh:
            fh.seek(rec.slot * stride + 100)
            byte = fh.read(1)
            fh.seek(rec.slot * stride + 100)
            fh.write(bytes([byte[0] ^ 0xFF]))
        self.corrupt.add((b.index.namespace_id, b.key))
        self.log.append(f"  -> corrupted {b.key.hex()[:8]}")

    def peer_block(self) -> tuple[int, bytes, bytes]:
        """A block a peer might push: one of a chain's, under its parent."""
        _, ns, keys = self.pick()
        j = len(keys) - 1
        return ns, keys[j - 1] if j else b"", keys[j]

    def op_adopt(self) -> None:
        ns, parent, key = self.peer_block()
        index = self.store.catalog.get(self.ns_ids[ns]).index
        before = index.get(key)
        had = before is not None and before.readable
        data = self.new_bytes(ns, key)
        ok = exchange(self.store).adopt(self.ns_ids[ns], parent, key, memoryview(data))
        if ok and not had:
            self.model[(ns, key)] = data
        self.log.append(f"  -> adopt {key.hex()[:8]}: {ok}")

    def op_land(self) -> None:
        ns, parent, key = self.peer_block()
        landing = exchange(self.store).land(self.ns_ids[ns], parent, key, SIZES[ns])
        self.log.append(f"  -> land {key.hex()[:8]}: {landing is not None}")
        if landing is not None:
            data = self.new_bytes(ns, key)
            landing.view[:] = data
            self.landings.append((ns, key, data, landing))

    def end_landing(self, commit: bool) -> None:
        ns, key, data, landing = self.landings.pop(self.rng.randrange(len(self.landings)))
        if not commit:
            landing.abort()
            return
        ours = landing.state.index.get(key) is None
        ok = landing.commit()
        if ok and ours:
            self.model[(ns, key)] = data
        self.log.append(f"  -> commit landing {key.hex()[:8]}: {ok}")

    def op_end_landing(self) -> None:
        if self.landings:
            self.end_landing(self.rng.random() < 0.8)

    async def op_checkout(self) -> None:
        _, ns, keys = self.pick()
        key = keys[-1]
        got = await exchange(self.store).checkout(self.ns_ids[ns], key, served=self.rng.random() < 0.7)
        if got is None:
            return
        view, check = got
        data = bytes(view)
        self.expect(ns, [key], [data], "checkout")
        if check is not None and check != xxhash.xxh3_64_intdigest(data):
            self.fail(f"checkout of {key.hex()[:8]} gave a checksum its bytes do not have")
        self.checkouts.append((ns, key, data, view))

    def op_checkin(self) -> None:
        if self.checkouts:
            ns, key, _, _ = self.checkouts.pop(self.rng.randrange(len(self.checkouts)))
            exchange(self.store).checkin(self.ns_ids[ns], key)

    def op_forget(self) -> None:
        _, ns, keys = self.pick()
        self.log.append(f"  -> forget {exchange(self.store).forget(self.ns_ids[ns], keys)}")

    async def op_reregister(self) -> None:
        """An engine unregisters its buffers (calls may still use them) and registers new ones."""
        s = self.rng.choice(self.sessions)
        ns = self.rng.randrange(2)
        buffers_id, engine = s.buffers[ns]
        self.closed_engines.append(engine)
        rows = ROWS_PER_OP * SLOTS_PER_BUFFER
        fresh = shm.empty((rows, SIZES[ns]), "uint8")
        self.closed_engines.append(fresh)
        try:
            await self.store.unregister_buffers(s.session_id, buffers_id)
        finally:
            if not s.closed:
                b = self.store.register_buffers(s.session_id, self.ns_ids[ns], [TensorSource(
                    fresh.name, 0, TensorLayout((rows, SIZES[ns]), (SIZES[ns], 1), "uint8", 0))])
                s.buffers[ns] = (b.buffers_id, fresh)

    # -- driving ---------------------------------------------------------------------------
    closed_engines: list[Any]

    async def cancel_all(self) -> None:
        for task in list(self.inflight):
            task.cancel()
        await self.settle()

    async def settle(self) -> None:
        while self.inflight:
            task = next(iter(self.inflight))
            await self.finish(task)

    async def finish(self, task: asyncio.Task[None]) -> None:
        name = self.inflight.pop(task)
        try:
            await task
        except asyncio.CancelledError:
            self.log.append(f"  {name}: cancelled")
        except KVStoreError as exc:
            self.log.append(f"  {name}: {type(exc).__name__} {exc}")
        except Broken:
            raise
        except Exception as exc:
            self.fail(f"{name} raised {exc!r}")

    def start(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        self.inflight[asyncio.ensure_future(coro)] = name

    async def yield_some(self) -> None:
        """Let tasks in flight go on a little."""
        await self.turns(self.rng.randrange(0, 4))

    async def turns(self, n: int) -> None:
        """``n`` turns of the loop, some of them long enough for a thread's copy or read."""
        for _ in range(n):
            await asyncio.sleep(0.001 if self.rng.random() < 0.25 else 0)

    async def run(self) -> None:
        self.closed_engines = []
        self.open()
        rng = self.rng
        sync_ops: dict[str, Callable[[], None]] = {
            "reserve": self.op_reserve, "seal": self.op_seal, "release": self.op_release,
            "expire": self.op_expire, "prefetch": self.op_prefetch, "evict": self.op_evict,
            "close_session": self.op_close_session, "reap": self.reap, "corrupt": self.op_corrupt,
            "adopt": self.op_adopt, "land": self.op_land, "end_landing": self.op_end_landing,
            "checkin": self.op_checkin, "forget": self.op_forget, "commit": self.op_commit}
        async_ops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {
            "lookup": self.op_lookup, "save_blocks": self.op_save_blocks, "load_blocks": self.op_load_blocks,
            "stream": self.op_stream, "flush": self.op_flush, "write_back": self.op_write_back,
            "shutdown_write_back": self.op_shutdown_write_back, "checkout": self.op_checkout,
            "reregister": self.op_reregister}
        weights = {"reserve": 8, "seal": 6, "release": 4, "expire": 1, "prefetch": 3, "evict": 1,
                   "close_session": 1, "reap": 1, "lookup": 10, "save_blocks": 8, "load_blocks": 6,
                   "stream": 5, "flush": 1, "write_back": 3, "shutdown_write_back": 1,
                   "cancel": 3, "cancel_new": 8, "settle": 3, "restart": 1,
                   "corrupt": 1, "adopt": 3, "land": 2, "end_landing": 2, "checkout": 3, "checkin": 3,
                   "forget": 1, "reregister": 1, "commit": 6}
        names, w = list(weights), list(weights.values())
        try:
            for step in range(self.steps):
                op = rng.choices(names, w)[0]
                self.clock.now += rng.choice((0.0, 0.0, 0.5, 2.0))
                self.log.append(f"{step}: {op} (now {self.clock.now:g}, {len(self.inflight)} in flight)")
                if op in sync_ops:
                    if op == "close_session" and self.inflight and rng.random() < 0.5:
                        await self.yield_some()
                    sync_ops[op]()
                elif op in async_ops:
                    if rng.random() < 0.5:
                        self.start(f"{step}:{op}", async_ops[op]())
                    else:
                        task = asyncio.ensure_future(async_ops[op]())
                        self.inflight[task] = f"{step}:{op}"
                        await self.finish(task)
                elif op == "cancel" and self.inflight:
                    task = rng.choice(list(self.inflight))
                    await self.yield_some()
                    task.cancel()
                    await self.finish(task)
                elif op == "cancel_new":
                    # a call whose client goes away at a random await point, sometimes twice
                    which = rng.choice(list(async_ops))
                    task = asyncio.ensure_future(async_ops[which]())
                    self.inflight[task] = f"{step}:{which} (to cancel)"
                    await self.turns(rng.randrange(0, 12))
                    task.cancel()
                    if rng.random() < 0.3:
                        await self.turns(rng.randrange(0, 4))
                        task.cancel()
                    await self.finish(task)
                elif op == "settle":
                    await self.settle()
                elif op == "restart":
                    await self.close(write_back=rng.random() < 0.7)
                    self.open()
                await self.yield_some()
                self.check()
                if not self.inflight:
                    await self.check_quiescent()
            await self.settle()
            await self.check_quiescent()
            # every chain read back through a lease, after a last restart
            await self.close(write_back=True)
            self.open()
            await self.check_quiescent()
            for ns in range(2):
                for _, keys in self.chains[ns]:
                    r = await self.store.lookup(self.ns_ids[ns], KeyRequest(hashes=keys), lease=True,
                                                session_id=self.sessions[0].session_id)
                    if r.blocks:
                        self.expect(ns, keys, [bytes(self.arena.view(o, SIZES[ns])) for o in r.offsets],
                                    "lookup after restart")
                        self.store.release(self.sessions[0].session_id, r.lease_id)
            await self.check_quiescent()
        finally:
            await self.cancel_all_quietly()

    async def cancel_all_quietly(self) -> None:
        for task in list(self.inflight):
            task.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
        self.inflight.clear()
        try:
            self.copy.close()
            if self.ssd is not None:
                self.ssd.close()
            self.arena.close()
        except Exception:   # closed already
            pass
        for s in self.sessions:
            for _, engine in s.buffers.values():
                engine.close()
        for engine in self.closed_engines:
            engine.close()


def run_seed(tmp: Path, seed: int, steps: int = 300) -> None:
    asyncio.run(Fuzz(tmp, seed, steps).run())


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_store_consistent(tmp_path: Path, seed: int) -> None:
    run_seed(tmp_path, seed)


# Seeds that failed before fixes (their interleaving with the copy and SSD threads varies, so each
# bug is also pinned down by a hand-written test in test_store_faults.py): hollow leaves left in the
# index by a checkout, or a stream, cancelled after an SSD read failed its checksum.
@pytest.mark.parametrize("seed", [47, 64, 388])
def test_random_operations_regressions(tmp_path: Path, seed: int) -> None:
    run_seed(tmp_path, seed, 300)


if __name__ == "__main__":
    sweep(run_seed, 300)
