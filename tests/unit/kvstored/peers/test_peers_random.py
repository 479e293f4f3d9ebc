"""A model-based randomized test of a small cluster in one process: two or three BlockStores, each
with its PeerNode listening on loopback (static peers, a shared token), driven by a seeded sequence
of operations: saves on any node (some pushed on to another), streams that fetch what is missing
from peers (arena and engine-buffer mode), pulls, lookups, migrations and drains (sometimes
abandoned midway), evictions, flushes and write-back while blocks are served, lease expiry,
session ends, cancellations at random await points, and faults on the wire (connections cut, a
listener closed and reopened, a peer that stops answering, payloads damaged in flight, a node
restarted over its SSD directory). Checked after every step against a model of the bytes saved
under each key (no node ever serves, and no stream or pull ever delivers, other bytes) and each
node's bookkeeping; with nothing in flight, nothing is left pinned, busy or connected.

The op sequence is a function of the seed; the interleaving with the copy and SSD threads and the
sockets is not, so a failing seed may need a few runs to fail again. Many seeds, outside the suite:

    python tests/unit/kvstored/peers/test_peers_random.py FIRST COUNT [STEPS]
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import random
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import xxhash

if __name__ == "__main__":   # run as a script: find the tests' helpers as pytest does
    sys.path[:0] = [str(Path(__file__).resolve().parents[4] / "tests"), str(Path(__file__).resolve().parents[4])]

from clock import Clock
from loopback import free_ports
from random_model import Broken, ClientSession, Tracked, payload, sweep, under_ssd
from store_harness import ROOM_WAIT_S, exchange, streamer

from kvstored import config
from kvstored.buffers import TensorSource
from kvstored.copy import CopyEngine
from kvstored.index import DEMOTING, NO_SLOT, ON_SSD, Block, Tier
from kvstored.peers.exchange import PeerLanding
from kvstored.peers.node import IDLE_CONNECTIONS, PeerNode
from kvstored.peers.server import CheckedOut
from kvstored.policy.registry import POLICIES
from kvstored.store import BlockStore, KeyRequest
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import BlockRecord, Corrupt, SSDTier
from kvstored_client import shm
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.layout import TensorLayout
from kvstored_client.contract.namespace import Namespace

T = TypeVar("T")

PAGE = 16384
SIZES = (4096, 2048)            # block bytes of the two namespaces: 4 and 8 slots a page
MODELS = ("a", "b")
SPECS = [Namespace(model=m, block_bytes=b) for m, b in zip(MODELS, SIZES)]
NS_IDS = [spec.identity() for spec in SPECS]
ROWS_PER_OP = 6                 # longest chain
SLOTS_PER_BUFFER = 3            # concurrent ops one session's buffers serve
TTL, RES_TTL = 10.0, 20.0
DEADLINE_S, LOOKUP_S = 0.5, 0.2  # peers.deadline_s, peers.lookup_timeout_s
HANG_S = 15.0                   # no single await of the harness may take longer: a hang


@dataclass(eq=False)
class Node:
    """One daemon: its store, its PeerNode, and what the test (as its clients) holds there."""

    name: str
    port: int
    tmp: Path
    cfg: config.Config
    store: BlockStore = field(init=False)
    peers: PeerNode = field(init=False)
    arena: Arena = field(init=False)
    copy: CopyEngine = field(init=False)
    ssd: SSDTier = field(init=False)
    sessions: list[ClientSession] = field(default_factory=list)
    tracked: dict[int, Tracked] = field(default_factory=dict)
    landings: list[PeerLanding] = field(default_factory=list)   # pushed blocks being received here
    on_ssd: set[tuple[int, bytes]] = field(default_factory=set)  # what the last stop left on SSD
    gate: asyncio.Event = field(default_factory=asyncio.Event)   # cleared: its listener stops answering
    corrupting: bool = False      # blocks it sends are damaged in flight (their checksum is the original's)
    server_down: bool = False
    up: bool = False


class Fuzz:
    def __init__(self, tmp: Path, seed: int, steps: int) -> None:
        self.rng = random.Random(seed)
        self.faults = random.Random(seed + 1_000_003)
        self.seed = seed
        self.steps = steps
        rng = self.rng
        self.clock = Clock()
        self.versions: dict[tuple[int, bytes], set[bytes]] = {}   # every payload stored under a key
        self.fresh = 0
        self.log: list[str] = []
        self.inflight: dict[asyncio.Task[None], str] = {}
        self.closed_engines: list[Any] = []
        n = rng.choice((2, 3))
        names = [chr(ord("x") + i) for i in range(n)]
        ports = free_ports(n)
        static = [f"{nm}=127.0.0.1:{p}" for nm, p in zip(names, ports)]
        self.nodes: list[Node] = []
        for name, port in zip(names, ports):
            cfg = config.build({
                "dram": {"capacity": rng.choice((2, 3)) * PAGE, "page_bytes": PAGE, "prefault": False,
                         "policy": rng.choice(POLICIES), "writeback_watermark": rng.choice((0.25, 0.5)),
                         "room_wait_s": ROOM_WAIT_S},
                "ssd": {"enabled": True, "capacity": rng.choice((8, 12, 16)) * SIZES[0],
                        "policy": rng.choice(POLICIES), "high_watermark": 0.95, "low_watermark": 0.5,
                        "sync": False, "admission": rng.choice(("always", "always", "hit_before"))},
                "leases": {"ttl_s": TTL, "reservation_ttl_s": RES_TTL},
                "peers": {"listen": f"127.0.0.1:{port}", "node_id": name, "static": static, "token": "t",
                          "deadline_s": DEADLINE_S, "lookup_timeout_s": LOOKUP_S}})
            d = tmp / name
            d.mkdir()
            self.nodes.append(Node(name, port, d, cfg))
        # chains shared by every node (a prompt any node may be asked for)
        self.chains: list[list[list[bytes]]] = [[], []]
        for ns in range(2):
            for _ in range(12):
                base = rng.randrange(3)
                toks = list(range(base * 1000, base * 1000 + 16 * rng.randrange(1, 3)))
                for _ in range(rng.randrange(0, 5)):
                    t = rng.randrange(2)
                    toks += [50_000 + t * 100 + len(toks) + j for j in range(16)]
                self.chains[ns].append(block_hashes(toks[: 16 * ROWS_PER_OP]))

    # -- bounded awaits --------------------------------------------------------------------
    async def bounded(self, aw: Awaitable[T], what: str) -> T:
        try:
            async with asyncio.timeout(HANG_S):
                return await aw
        except TimeoutError:
            self.fail(f"{what} hung (over {HANG_S:g}s)")
            raise

    def fail(self, what: str) -> None:
        tail = self.log[-int(os.environ.get("FUZZ_LOG", "30")):]
        raise Broken(f"seed {self.seed}: {what}\nin flight: {sorted(self.inflight.values())}\nlast ops:\n  "
                     + "\n  ".join(tail))

    # -- a node's life ---------------------------------------------------------------------
    async def open(self, node: Node) -> None:
        node.arena = Arena(str(node.tmp), node.cfg.dram.capacity, prefault=False)
        node.copy = CopyEngine(node.arena)
        node.ssd = SSDTier(str(node.tmp / "ssd"), 8 << 20, sync=False)
        ids = iter(range(1, 1_000_000))
        node.store = BlockStore(node.cfg, node.arena, node.copy, node.ssd, clock=self.clock,
                                new_session_id=lambda: f"{node.name}{next(ids)}")
        node.store.restore()
        for spec in SPECS:
            node.store.open_namespace(spec)
        restored = {(self.ns_of(b), b.key) for b in self.blocks(node)}
        if restored != node.on_ssd:
            self.fail(f"{node.name}: restore brought back {len(restored - node.on_ssd)} blocks that were not on "
                      f"SSD and lost {len(node.on_ssd - restored)} that were")
        node.peers = PeerNode(node.cfg, node.store)
        self.wrap_exchange(node)
        await self.bounded(node.peers.start(), f"{node.name}: PeerNode.start")
        self.wrap_server(node)
        node.gate.set()
        node.corrupting = False
        node.server_down = False
        node.sessions = [self.new_session(node) for _ in range(2)]
        node.up = True

    def wrap_exchange(self, node: Node) -> None:
        """Blocks a corrupting node hands out (to serve or push) are damaged copies that keep the
        original's checksum: what a bit flipped on the wire looks like to the receiver."""
        ex = node.peers.exchange
        checkout, serve = ex.checkout, ex.serve

        def damaged(got: CheckedOut | None) -> CheckedOut | None:
            if got is None or not node.corrupting or self.faults.random() < 0.5:
                return got
            view, check = got
            bad = bytearray(view)
            bad[self.faults.randrange(len(bad))] ^= 0x40
            return memoryview(bad), xxhash.xxh3_64_intdigest(view) if check is None else check

        async def damaged_checkout(namespace_id: int, key: bytes, *, served: bool = True) -> CheckedOut | None:
            return damaged(await checkout(namespace_id, key, served=served))

        def damaged_serve(namespace_id: int, key: bytes) -> CheckedOut | Awaitable[CheckedOut | None] | None:
            got = serve(namespace_id, key)   # an awaitable is the (damaged) checkout's
            return got if inspect.isawaitable(got) else damaged(got)

        ex.checkout = damaged_checkout   # type: ignore[method-assign]
        ex.serve = damaged_serve   # type: ignore[method-assign]

    def wrap_server(self, node: Node) -> None:
        """A node whose gate is closed stops answering (its listener reads requests, then waits);
        landings are recorded for the bookkeeping checks."""
        server = node.peers._server
        assert server is not None
        serve, count, store_block = server._serve_block, server._count_blocks, server._store_block
        land, opened = server._land_block, server._open_namespace
        assert count is not None and store_block is not None and land is not None and opened is not None

        async def gated_serve(namespace_id: int, key: bytes) -> Any:
            await node.gate.wait()
            served = serve(namespace_id, key)
            return await served if inspect.isawaitable(served) else served

        async def gated_count(namespace_id: int, keys: list[bytes]) -> int:
            await node.gate.wait()
            held = count(namespace_id, keys)
            return await held if asyncio.iscoroutine(held) else held   # type: ignore[no-any-return]

        async def gated_store(namespace_id: int, parent: bytes, key: bytes, payload: memoryview) -> bool:
            await node.gate.wait()
            ok = store_block(namespace_id, parent, key, payload)
            return await ok if asyncio.iscoroutine(ok) else ok   # type: ignore[no-any-return]

        def recorded_land(namespace_id: int, parent: bytes, key: bytes, length: int) -> Any:
            if not node.gate.is_set():
                return None   # received into a buffer, then offered to the (waiting) store_block
            landing = land(namespace_id, parent, key, length)
            if landing is not None:
                node.landings.append(landing)   # type: ignore[arg-type]
            return landing

        async def gated_open(namespace_id: int, description: bytes) -> str:
            await node.gate.wait()
            why = opened(namespace_id, description)
            return await why if asyncio.iscoroutine(why) else why   # type: ignore[no-any-return]

        server._serve_block = gated_serve
        server._count_blocks = gated_count
        server._store_block = gated_store
        server._land_block = recorded_land
        server._open_namespace = gated_open

    def new_session(self, node: Node) -> ClientSession:
        s = ClientSession(node.store.open_session("fuzz", 1).session_id)
        for ns, nbytes in enumerate(SIZES):
            rows = ROWS_PER_OP * SLOTS_PER_BUFFER
            engine = shm.empty((rows, nbytes), "uint8")
            buffers = node.store.register_buffers(s.session_id, NS_IDS[ns], [TensorSource(
                engine.name, 0, TensorLayout((rows, nbytes), (nbytes, 1), "uint8", 0))])
            s.buffers[ns] = (buffers.buffers_id, engine)
            s.free_rows[ns] = list(range(SLOTS_PER_BUFFER))
        return s

    async def close(self, node: Node, write_back: bool) -> None:
        """As the daemon stops: its calls are cancelled, the PeerNode closes (its listener and its
        transfers end), sessions end, DRAM-only blocks are written down (or not), all closes."""
        await self.cancel_all(node.name)
        node.gate.set()
        await self.bounded(node.peers.close(), f"{node.name}: PeerNode.close")
        node.up = False
        node.landings = [landing for landing in node.landings if not landing.done]
        if node.landings:
            self.fail(f"{node.name}: {len(node.landings)} landing(s) neither committed nor aborted after close")
        for s in node.sessions:
            node.store.close_session(s.session_id)
            for _, engine in s.buffers.values():
                engine.close()
        node.sessions = []
        node.tracked.clear()
        await self.check_quiescent(node)
        if write_back:
            await self.bounded(node.store.write_back_for_shutdown(), f"{node.name}: write_back_for_shutdown")
        await self.bounded(node.store.finish_background(), f"{node.name}: drain")
        node.on_ssd = {(self.ns_of(b), b.key) for b in self.blocks(node) if b.on_ssd and under_ssd(b)}
        node.copy.close()
        node.ssd.close()
        node.arena.close()

    # -- invariants ------------------------------------------------------------------------
    @staticmethod
    def blocks(node: Node) -> list[Block]:
        return [b for st in node.store.catalog for b in st.index]

    @staticmethod
    def ns_of(block: Block) -> int:
        return NS_IDS.index(block.index.namespace_id)

    def expect(self, what: str, ns: int, keys: list[bytes], got: list[bytes]) -> None:
        for i, (key, data) in enumerate(zip(keys, got)):
            versions = self.versions.get((ns, key))
            if versions is None or data not in versions:
                self.fail(f"{what}: block {i} ({key.hex()[:8]}) has wrong bytes "
                          f"({'never saved' if versions is None else 'not any saved'})")

    def check(self, node: Node) -> None:
        """What holds on a running node at every step, with requests in flight."""
        store = node.store
        name = node.name
        blocks = self.blocks(node)
        node.landings = [landing for landing in node.landings if not landing.done]
        used = 0
        offsets: dict[int, Block] = {}
        ssd_bytes = 0
        dirty: set[Block] = set()
        pb = store.placement.dram.page_bytes
        in_dram = 0
        for b in blocks:
            what = f"{name}: block {b.key.hex()[:8]} (depth {b.depth}, flags {b.flags}, pins {b.pins})"
            if b.pins < 0:
                self.fail(f"{what} has negative pins")
            if b.parent is not None and b.index.get(b.parent.key) is not b.parent:
                self.fail(f"{what}'s parent is not in the index")
            if b.depth != (0 if b.parent is None else b.parent.depth + 1):
                self.fail(f"{what} has a wrong depth")
            if b.offset != NO_SLOT:
                if b.offset in offsets:
                    self.fail(f"{what} shares slot {b.offset} with {offsets[b.offset].key.hex()[:8]}")
                offsets[b.offset] = b
                used += b.index.slot_bytes
                in_dram += 1
                if b not in store.placement.dram.page_blocks(b.offset // pb):
                    self.fail(f"{what} is in DRAM but its page does not know it")
            if b.flags & (ON_SSD | DEMOTING):
                ssd_bytes += b.index.block_bytes
            if b.sealed and b.in_dram and not b.on_ssd:
                dirty.add(b)
            if b.sealed and not b.readable and not b.children and not b.pins and store.promotion.pending(b) is None:
                self.fail(f"{what} is a hollow leaf nothing holds, left in the index")
            if b.flags & ON_SSD and b.flags & DEMOTING:
                self.fail(f"{what} is on SSD and being written there")
        landing_pages: Counter[int] = Counter()
        for landing in node.landings:
            if landing.offset in offsets:
                self.fail(f"{name}: a landing shares slot {landing.offset} with a block")
            used += landing.state.index.slot_bytes
            landing_pages[landing.offset // pb] += 1
        # slots bound to no block whose client may still write them (an ended session's reservations)
        for offset, slot_bytes in store.leasing.quarantine.slots() + store.spares.quarantine.slots():
            if offset in offsets:
                self.fail(f"{name}: slot {offset} in quarantine is also a block's")
            used += slot_bytes
            landing_pages[offset // pb] += 1
        if sum(len(store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages)) != in_dram:
            known = sum(len(store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages))
            self.fail(f"{name}: pages know {known} blocks; {in_dram} are in DRAM")
        for page, held in ((p, store.placement.dram.page_blocks(p)) for p in range(store.placement.dram.num_pages)):
            if len(held) + landing_pages[page] != store.placement.dram.used_slots(page):
                self.fail(f"{name}: page {page} knows {len(held)} blocks and {landing_pages[page]} landings "
                          "or quarantined slots; "
                          f"the allocator counts {store.placement.dram.used_slots(page)} used slots")
        kids = Counter(b.parent for b in blocks if b.parent is not None)
        for b in blocks:
            if b.children != kids.get(b, 0):
                self.fail(f"{name}: block {b.key.hex()[:8]} counts {b.children} children, has {kids.get(b, 0)}")
        if store.placement.dram.used_bytes != used:
            self.fail(f"{name}: allocator uses {store.placement.dram.used_bytes} bytes; "
                      f"blocks and landings hold {used}")
        if store.placement.ssd.used_bytes != ssd_bytes:
            self.fail(f"{name}: SSD used is {store.placement.ssd.used_bytes}; "
                      f"blocks on (or going to) SSD hold {ssd_bytes}")
        on_ssd = sum(1 for b in blocks if b.flags & ON_SSD)
        if store.stats().tiers[1].blocks != on_ssd:
            self.fail(f"{name}: stats count {store.stats().tiers[1].blocks} blocks on SSD; {on_ssd} have a copy there")
        if set(store.placement.queue) != dirty:
            self.fail(f"{name}: write-back queue {len(store.placement.queue)} blocks, "
                      f"DRAM-only sealed blocks {len(dirty)}")
        for t in node.tracked.values():
            for key, offset, want in zip(t.keys, t.offsets, t.expected):
                block = store.catalog.get(NS_IDS[t.ns]).index.get(key)
                if block is None or block.offset != offset:
                    self.fail(f"{name}: lease {t.lease_id}: block {key.hex()[:8]} left slot {offset}")
                if bytes(node.arena.view(offset, SIZES[t.ns])) != want:
                    self.fail(f"{name}: lease {t.lease_id}: block {key.hex()[:8]}'s bytes changed under the lease")
        peers = node.peers
        for peer in peers._peers.values():
            if len(peer.idle) > IDLE_CONNECTIONS or len(set(map(id, peer.idle))) != len(peer.idle):
                self.fail(f"{name}: {len(peer.idle)} idle connections to {peer.member.node_id}")
            for conn in peer.idle:
                if conn._busy.locked():
                    self.fail(f"{name}: an idle connection to {peer.member.node_id} is in use")

    def expected_pins(self, node: Node) -> Counter[Block]:
        want: Counter[Block] = Counter()
        for lease in node.store.leasing.leases():
            want.update(lease.pinned)
            want.update(lease.new)
        for landing in node.landings:
            if not landing.done and landing.parent is not None:
                want[landing.parent] += 1
        return want

    def pushes_idle(self) -> bool:
        return all(peer.queue is None or (peer.queue.empty() and not peer.pushing)
                   for node in self.nodes if node.up for peer in node.peers._peers.values())

    def connections_settled(self) -> bool:
        """Every listener's open connections are the pooled, usable connections to it."""
        for node in self.nodes:
            if not node.up or node.server_down:
                continue
            server = node.peers._server
            assert server is not None
            pooled = sum(1 for other in self.nodes if other.up and other is not node
                         for conn in other.peers._peers[node.name].idle if conn.usable)
            if self.live_streams(node) != pooled:
                return False
        return True

    @staticmethod
    def live_streams(node: Node) -> int:
        """Connections the node's listener serves (a listener the test closed and started again
        may still list connections it closed then, whose serving task never began)."""
        server = node.peers._server
        return -1 if server is None else sum(1 for stream in server._streams if not stream.closed.done())

    async def quiet(self) -> None:
        """Wait (a while at most) until what runs on its own has ended: pushes queued after saves,
        transfers the listeners serve, copies to engine buffers of cancelled calls."""
        for _ in range(1000):
            if self.pushes_idle() and all(
                    all(b.pins == self.expected_pins(n)[b] for b in self.blocks(n)) for n in self.nodes if n.up) \
                    and (not all(n.gate.is_set() for n in self.nodes) or self.connections_settled()):
                return
            await asyncio.sleep(0.005)

    async def check_all_quiescent(self) -> None:
        assert not self.inflight
        await self.quiet()
        if not self.pushes_idle():
            self.fail("pushes still queued or running long after the last save")
        if all(n.gate.is_set() for n in self.nodes) and not self.connections_settled():
            counts = {n.name: (self.live_streams(n),
                               sum(1 for o in self.nodes if o.up and o is not n
                                   for c in o.peers._peers[n.name].idle if c.usable))
                      for n in self.nodes if n.up and not n.server_down}
            pooled = [(o.name, n.name, c._stream.transport.is_closing() if c._stream.transport else None,
                       c._stream._read_paused, c._stream._eof, len(c._stream._pending), c._busy.locked())
                      for n in self.nodes if n.up for o in self.nodes if o.up and o is not n
                      for c in o.peers._peers[n.name].idle if c.usable]
            self.fail(f"listener connections (open, pooled by peers) do not match: {counts}; pooled (holder, "
                      f"to, closing, read paused, eof, pending, busy): {pooled}")
        for node in self.nodes:
            if node.up:
                await self.check_quiescent(node)

    async def check_quiescent(self, node: Node) -> None:
        """Nothing in flight on ``node``: pins are exactly the leases', policies track exactly
        their tier's blocks, every stored copy holds saved bytes."""
        store = node.store
        name = node.name
        await self.bounded(store.finish_background(), f"{name}: drain")
        for _ in range(400):
            pins = self.expected_pins(node)
            if all(b.pins == pins[b] for b in self.blocks(node)):
                break
            await asyncio.sleep(0.005)
        self.check(node)
        if node.landings:
            self.fail(f"{name}: {len(node.landings)} landing(s) left open")
        leasing = store.leasing
        if leasing.busy_leases() or leasing.doomed_leases() or len(store.promotion) or leasing.lookups_in_flight:
            self.fail(f"{name}: idle store with busy {leasing.busy_leases()}, doomed {leasing.doomed_leases()}, "
                      f"{len(store.promotion)} promoting, {leasing.lookups_in_flight} lookups in flight")
        live = {lease.lease_id for lease in store.leasing.leases()}
        if live != set(node.tracked):
            self.fail(f"{name}: store holds leases {sorted(live)}; clients hold {sorted(node.tracked)}")
        want = self.expected_pins(node)
        open_new = {b for lease in store.leasing.leases() for b in lease.new}
        blocks = self.blocks(node)
        for b in blocks:
            what = f"{name}: block {b.key.hex()[:8]} (depth {b.depth}, flags {b.flags}, slot {b.offset})"
            if b.pins != want[b]:
                self.fail(f"{what} has {b.pins} pins; leases hold {want[b]}")
            if not b.sealed and b not in open_new:
                self.fail(f"{what} is unsealed with no reservation writing it")
            if b.sealed and not b.readable and not b.children and not b.pins:
                self.fail(f"{what} is a hollow leaf left in the index")
            in_dram_policy = [size for size, p in store.placement.dram.policies().items() if b in p]
            should_dram = b.sealed and b.in_dram
            should_ssd = b.sealed and not b.in_dram and b.on_ssd
            if in_dram_policy != ([b.index.slot_bytes] if should_dram else []):
                self.fail(f"{what} tracked by DRAM policies {in_dram_policy}")
            if (b in store.placement.ssd.policy) != should_ssd:
                self.fail(f"{what} {'' if should_ssd else 'not '}expected in the SSD policy")
            if b.sealed and b.in_dram:
                self.expect(f"{name}: DRAM copy", self.ns_of(b), [b.key],
                            [bytes(node.arena.view(b.offset, b.index.block_bytes))])
        for size, p in store.placement.dram.policies().items():
            n = sum(1 for b in blocks if b.sealed and b.in_dram and b.index.slot_bytes == size)
            if len(p) != n:
                self.fail(f"{name}: DRAM policy of {size}-byte slots tracks {len(p)} blocks; {n} are there")
        n = sum(1 for b in blocks if b.sealed and not b.in_dram and b.on_ssd)
        if len(store.placement.ssd.policy) != n:
            self.fail(f"{name}: SSD policy tracks {len(store.placement.ssd.policy)} blocks; {n} are SSD-only")
        await asyncio.wrap_future(node.ssd.delete_raw(b"\xff" * 40))   # a barrier behind the writer's ops
        on_disk = {(r.namespace_id, r.key) for r in node.ssd.scan() if isinstance(r, BlockRecord)}
        indexed = {(b.index.namespace_id, b.key) for b in blocks if b.on_ssd}
        if on_disk != indexed:
            self.fail(f"{name}: {len(on_disk - indexed)} SSD records without a block on SSD, "
                      f"{len(indexed - on_disk)} blocks on SSD without a record")
        for b in blocks:
            if b.on_ssd:
                buf = np.empty(b.index.block_bytes, np.uint8)
                try:
                    await asyncio.wrap_future(node.ssd.read_into(b.index.namespace_id, b.key, buf))
                except Corrupt as exc:
                    self.fail(f"{name}: block {b.key.hex()[:8]}: SSD copy unreadable: {exc}")
                self.expect(f"{name}: SSD copy", self.ns_of(b), [b.key], [bytes(buf)])

    # -- operations ------------------------------------------------------------------------
    def up_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.up]

    def pick(self, node: Node) -> tuple[ClientSession, int, list[bytes]]:
        s = self.rng.choice(node.sessions)
        ns = self.rng.randrange(2)
        keys = self.rng.choice(self.chains[ns])
        return s, ns, keys[: self.rng.randrange(1, len(keys) + 1)]

    def other(self, node: Node) -> Node:
        return self.rng.choice([n for n in self.nodes if n is not node])

    def new_bytes(self, ns: int, key: bytes) -> bytes:
        """Mostly the key's usual bytes; now and then different ones (saved on a node that does
        not hold the key, they are what that node holds from then on)."""
        if self.rng.random() < 0.1:
            self.fresh += 1
            return payload(key, ns, self.fresh, SIZES[ns])
        return payload(key, ns, 0, SIZES[ns])

    def stored(self, ns: int, key: bytes, data: bytes) -> None:
        self.versions.setdefault((ns, key), set()).add(data)

    def push_maybe(self, node: Node, ns: int, chain: list[bytes]) -> None:
        if chain and self.rng.random() < 0.4:
            to = self.other(node)
            node.peers.push_later(to.name, NS_IDS[ns], chain)
            self.log.append(f"  -> push_later {len(chain)} to {to.name}")

    def op_save(self, node: Node) -> None:
        """reserve + write + seal (the arena path), as the servicer's Seal does, push_to included."""
        s, ns, keys = self.pick(node)
        now = self.clock.now
        try:
            r = node.store.reserve(s.session_id, NS_IDS[ns], KeyRequest(hashes=keys), SIZES[ns])
        except KVStoreError as exc:
            self.log.append(f"  -> {type(exc).__name__}")
            return
        new = keys[r.present: r.present + len(r.offsets)]
        written = [self.new_bytes(ns, k) for k in new]
        for offset, data in zip(r.offsets, written):
            node.arena.view(offset, SIZES[ns])[:] = np.frombuffer(data, np.uint8)
        if self.rng.random() < 0.3:   # sealed later (a reservation held across steps)
            node.tracked[r.reservation_id] = Tracked(r.reservation_id, s.session_id, ns, new, list(r.offsets),
                                                     written, True, (now, now), RES_TTL)
            self.log.append(f"  -> reservation {r.reservation_id}: present {r.present}, new {len(new)}")
            return
        self.seal(node, Tracked(r.reservation_id, s.session_id, ns, new, list(r.offsets), written, True,
                                (now, now), RES_TTL), keys[: r.present + len(new)])

    def seal(self, node: Node, t: Tracked, chain: list[bytes]) -> None:
        n = node.store.seal(t.session, t.lease_id)
        if n != len(t.keys):
            self.fail(f"{node.name}: seal of reservation {t.lease_id} sealed {n} of {len(t.keys)} blocks")
        for key, data in zip(t.keys, t.expected):
            self.stored(t.ns, key, data)
        self.log.append(f"  -> sealed {t.lease_id} ({n})")
        self.push_maybe(node, t.ns, chain)

    def op_seal(self, node: Node) -> None:
        held = [t for t in node.tracked.values() if t.reservation]
        if not held:
            return
        t = self.rng.choice(held)
        del node.tracked[t.lease_id]
        _, chain = node.store.reservation_chain(t.session, t.lease_id)
        self.seal(node, t, chain)

    def op_release(self, node: Node) -> None:
        if node.tracked:
            t = self.rng.choice(list(node.tracked.values()))
            del node.tracked[t.lease_id]
            node.store.release(t.session, t.lease_id)
            self.log.append(f"  -> released {t.lease_id}")

    def op_expire(self, node: Node) -> None:
        self.clock.now += self.rng.choice((TTL + 0.5, RES_TTL + 0.5))
        for n in self.up_nodes():
            self.reap(n)

    def reap(self, node: Node) -> None:
        n = node.store.reap()
        now = self.clock.now
        gone = [t for t in node.tracked.values() if node.store.leasing.get(t.lease_id) is None]
        for t in gone:
            if t.born[0] + t.ttl > now:
                self.fail(f"{node.name}: lease {t.lease_id} reaped before its deadline")
            del node.tracked[t.lease_id]
        for t in node.tracked.values():
            if t.born[1] + t.ttl <= now:
                self.fail(f"{node.name}: lease {t.lease_id} outlived its deadline")
        self.log.append(f"  -> {node.name} reaped {n} ({len(gone)} of ours)")

    def rows(self, s: ClientSession, ns: int) -> int | None:
        free = s.free_rows[ns]
        return free.pop(self.rng.randrange(len(free))) if free else None

    async def op_save_blocks(self, node: Node) -> None:
        s, ns, keys = self.pick(node)
        slot = self.rows(s, ns)
        if slot is None:
            return
        try:
            buffers_id, engine = s.buffers[ns]
            ids = list(range(slot * ROWS_PER_OP, slot * ROWS_PER_OP + len(keys)))
            rows = engine.numpy()
            written = [self.new_bytes(ns, k) for k in keys]
            for i, data in zip(ids, written):
                rows[i] = np.frombuffer(data, np.uint8)
            present, stored = await node.store.save_blocks(s.session_id, NS_IDS[ns], buffers_id,
                                                           KeyRequest(hashes=keys), ids)
            for i in range(present, present + stored):
                self.stored(ns, keys[i], written[i])
            self.log.append(f"  -> save_blocks present {present} stored {stored}")
            self.push_maybe(node, ns, keys[: present + stored])
        finally:
            s.free_rows[ns].append(slot)

    async def op_stream(self, node: Node, pull: bool = False) -> None:
        """stream_blocks with the node's PeerNode as the fetcher, as StreamBlocks runs it."""
        s, ns, keys = self.pick(node)
        arena_mode = pull or self.rng.random() < 0.5
        slot = None if arena_mode else self.rows(s, ns)
        if not arena_mode and slot is None:
            return
        buffers_id, engine = s.buffers[ns]
        ids = list(range(slot * ROWS_PER_OP, slot * ROWS_PER_OP + len(keys))) if slot is not None else []
        rows = engine.numpy()
        if ids:
            rows[ids] = 0
        checked = 0
        mode = "pull" if pull else "arena" if arena_mode else "buffers"

        def emit(arrival: Any) -> None:
            nonlocal checked
            if arrival.index != checked:
                self.fail(f"{node.name}: stream handed block {arrival.index} after {checked}")
            data = bytes(node.arena.view(arrival.offset, SIZES[ns])) if arena_mode else bytes(rows[ids[arrival.index]])
            self.expect(f"{node.name}: stream arrival ({mode}, from {arrival.peer or 'here'})", ns,
                        [keys[arrival.index]], [data])
            checked += 1

        fetcher: Any = node.peers.fetch
        if self.rng.random() < 0.2:   # the caller's own deadline, sometimes shorter than the peers'
            until = asyncio.get_running_loop().time() + self.rng.choice((0.0, 0.02, 0.2))
            fetcher = functools.partial(node.peers.fetch, until=until)
        try:
            end = await streamer(node.store).stream_blocks(s.session_id, NS_IDS[ns], KeyRequest(hashes=keys),
                                                 0 if arena_mode else buffers_id, ids,
                                                 None if pull else emit, fetcher)
        finally:
            if slot is not None:
                s.free_rows[ns].append(slot)
        self.log.append(f"  -> {node.name} {mode} {end.blocks}/{end.requested} {end.stop} {end.detail[:80]!r} "
                        f"lease {end.lease_id}")
        if end.requested != len(keys) or end.blocks > end.requested:
            self.fail(f"{node.name}: {mode} of {len(keys)} blocks ended {end}")
        if (end.stop == "complete") != (end.blocks == end.requested):
            self.fail(f"{node.name}: {mode} ended {end.stop!r} with {end.blocks} of {end.requested} blocks")
        if not pull and end.blocks != checked:
            self.fail(f"{node.name}: stream ended with {end.blocks} blocks but handed over {checked}")
        if pull:
            if end.lease_id:
                self.fail(f"{node.name}: a pull handed lease {end.lease_id}")
            return
        if end.lease_id:
            if s.closed:
                return
            lease = node.store.leasing.get(end.lease_id)
            if lease is None:
                self.fail(f"{node.name}: stream handed lease {end.lease_id}, which is gone")
                return
            offsets = [b.offset for b in lease.pinned]
            if len(offsets) != end.blocks:
                self.fail(f"{node.name}: stream's lease pins {len(offsets)} blocks; {end.blocks} arrived")
            got = [bytes(node.arena.view(o, SIZES[ns])) for o in offsets]
            self.expect(f"{node.name}: stream's lease", ns, keys, got)
            node.tracked[end.lease_id] = Tracked(end.lease_id, s.session_id, ns, keys[: len(offsets)], offsets, got,
                                                 False, (self.clock.now, self.clock.now), TTL)
        elif arena_mode and end.blocks:
            self.fail(f"{node.name}: an arena stream of {end.blocks} blocks handed no lease")

    async def op_pull(self, node: Node) -> None:
        await self.op_stream(node, pull=True)

    async def op_lookup(self, node: Node) -> None:
        _, ns, keys = self.pick(node)
        local, holders = await node.peers.lookup(NS_IDS[ns], KeyRequest(hashes=keys))
        if local.blocks > len(keys) or any(not 0 < h <= len(keys) - local.blocks for h in holders.values()):
            self.fail(f"{node.name}: lookup of {len(keys)} answered {local.blocks} here, peers {holders}")
        self.log.append(f"  -> {node.name} lookup {local.blocks} here, peers {holders}")

    async def op_load(self, node: Node) -> None:
        """A leased lookup: what is here is read through the arena."""
        s, ns, keys = self.pick(node)
        start = self.clock.now
        r = await node.store.lookup(NS_IDS[ns], KeyRequest(hashes=keys), lease=True, session_id=s.session_id)
        if not r.blocks:
            return
        got = [bytes(node.arena.view(o, SIZES[ns])) for o in r.offsets]
        self.expect(f"{node.name}: leased lookup", ns, keys, got)
        if self.rng.random() < 0.5 or s.closed:
            if not s.closed:
                node.store.release(s.session_id, r.lease_id)
        else:
            node.tracked[r.lease_id] = Tracked(r.lease_id, s.session_id, ns, keys[: r.blocks], list(r.offsets),
                                               got, False, (start, self.clock.now), TTL)

    async def op_migrate(self, node: Node) -> None:
        """migrate (or drain) as the servicer runs it, its consumer sometimes leaving midway."""
        rng = self.rng
        drain = rng.random() < 0.4
        to = "" if drain and rng.random() < 0.5 else self.other(node).name
        prefix = None
        ns_id = 0
        if rng.random() < 0.4:
            _, ns, keys = self.pick(node)
            prefix, ns_id = KeyRequest(hashes=keys), NS_IDS[ns]
        model = rng.choice(("", *MODELS))
        leave_after = rng.choice((None, None, 0, 1, 2))
        gen = node.peers.migrate(to, model, ns_id, prefix, drain)
        seen = 0
        last = None
        try:
            async for p in gen:
                if p.pushed + p.failed > p.total or (last is not None and (p.pushed < last.pushed
                                                                           or p.failed < last.failed)):
                    self.fail(f"{node.name}: migrate progress {p} after {last}")
                last = p
                seen += 1
                if leave_after is not None and seen > leave_after:
                    break
                await asyncio.sleep(0)
        finally:
            await gen.aclose()
        self.log.append(f"  -> {node.name} {'drain' if drain else 'migrate'} to {to or '*'}: {last}")
        if last is not None and last.done and last.pushed + last.failed != last.total:
            self.fail(f"{node.name}: migrate ended {last}")

    def op_evict(self, node: Node) -> None:
        model = self.rng.choice(("", *MODELS))
        tier = self.rng.choice((Tier.DRAM, Tier.SSD, None))
        self.log.append(f"  -> {node.name} evict {model!r} {tier!r}: {node.store.evict(model, tier)}")

    async def op_flush(self, node: Node) -> None:
        try:
            n = await node.store.flush(self.rng.choice(("", *MODELS)))
        except KVStoreError as exc:
            self.log.append(f"  -> flush: {exc}")
            return
        self.log.append(f"  -> {node.name} flush {n}")

    async def op_write_back(self, node: Node) -> None:
        store = node.store
        limit = node.cfg.dram.writeback_watermark * store.placement.dram.capacity
        if store.placement.queue.bytes > limit and self.clock.now >= store.writeback.backoff_until:
            n = await store.writeback.write_back(store.placement.queue.bytes - limit, force=False, models=None)
            self.log.append(f"  -> {node.name} write-back {n}")

    def op_close_session(self, node: Node) -> None:
        s = self.rng.choice(node.sessions)
        node.store.close_session(s.session_id)
        s.closed = True
        for t in [t for t in node.tracked.values() if t.session == s.session_id]:
            del node.tracked[t.lease_id]
        self.closed_engines.extend(engine for _, engine in s.buffers.values())
        node.sessions[node.sessions.index(s)] = self.new_session(node)

    def op_forget(self, node: Node) -> None:
        _, ns, keys = self.pick(node)
        self.log.append(f"  -> {node.name} forget {exchange(node.store).forget(NS_IDS[ns], keys)}")

    # -- faults ----------------------------------------------------------------------------
    def op_cut(self, node: Node) -> None:
        """Reset the connections ``node`` serves (and those it keeps idle), mid-transfer or not."""
        server = node.peers._server
        n = 0
        if server is not None:
            for stream in list(server._streams):
                stream.close(abort=True)
                n += 1
        for peer in node.peers._peers.values():
            for conn in peer.idle:
                conn._stream.close(abort=True)
                n += 1
        self.log.append(f"  -> {node.name}: cut {n} connection(s)")

    async def op_server_bounce(self, node: Node) -> None:
        """Close the node's listener abruptly (transfers in flight end); it reopens at a later step."""
        server = node.peers._server
        assert server is not None
        if node.server_down:
            await self.bounded(server.start(), f"{node.name}: BlockServer.start")
            node.server_down = False
            self.log.append(f"  -> {node.name}: listener up")
        else:
            await self.bounded(server.close(), f"{node.name}: BlockServer.close")
            node.server_down = True
            self.log.append(f"  -> {node.name}: listener down")

    def op_pause(self, node: Node) -> None:
        if node.gate.is_set():
            node.gate.clear()
            self.log.append(f"  -> {node.name}: stops answering")
        else:
            node.gate.set()
            self.log.append(f"  -> {node.name}: answers again")

    def op_corrupt(self, node: Node) -> None:
        node.corrupting = not node.corrupting
        self.log.append(f"  -> {node.name}: {'damages' if node.corrupting else 'stops damaging'} what it sends")

    async def op_restart(self, node: Node) -> None:
        await self.close(node, write_back=self.rng.random() < 0.7)
        await self.open(node)

    # -- driving ---------------------------------------------------------------------------
    async def cancel_all(self, node_name: str | None = None) -> None:
        for task, name in list(self.inflight.items()):
            if node_name is None or name.split(":")[1] == node_name:
                task.cancel()
                await self.finish(task)

    async def settle(self) -> None:
        while self.inflight:
            await self.finish(next(iter(self.inflight)))

    async def finish(self, task: asyncio.Task[None]) -> None:
        name = self.inflight.pop(task)
        done, _ = await asyncio.wait({task}, timeout=HANG_S)
        if not done:
            self.fail(f"{name} hung (over {HANG_S:g}s)")
        try:
            task.result()
        except asyncio.CancelledError:
            self.log.append(f"  {name}: cancelled")
        except KVStoreError as exc:
            self.log.append(f"  {name}: {type(exc).__name__} {exc}")
        except Broken:
            raise
        except Exception as exc:
            self.fail(f"{name} raised {exc!r}")

    async def turns(self, n: int) -> None:
        for _ in range(n):
            await asyncio.sleep(0.001 if self.rng.random() < 0.25 else 0)

    def unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """A task of the product that died of an exception nobody handles (or another error
        the loop reports): a failure of the run, found at the next check."""
        self.errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    async def run(self) -> None:
        self.errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(self.unhandled)
        for node in self.nodes:
            await self.open(node)
        rng = self.rng
        sync_ops: dict[str, Callable[[Node], None]] = {
            "save": self.op_save, "seal": self.op_seal, "release": self.op_release, "expire": self.op_expire,
            "evict": self.op_evict, "close_session": self.op_close_session, "reap": self.reap,
            "forget": self.op_forget, "cut": self.op_cut, "pause": self.op_pause, "corrupt": self.op_corrupt}
        async_ops: dict[str, Callable[[Node], Coroutine[Any, Any, None]]] = {
            "save_blocks": self.op_save_blocks, "stream": self.op_stream, "pull": self.op_pull,
            "lookup": self.op_lookup, "load": self.op_load, "migrate": self.op_migrate, "flush": self.op_flush,
            "write_back": self.op_write_back}
        weights = {"save": 10, "seal": 3, "release": 4, "expire": 1, "evict": 2, "close_session": 1, "reap": 1,
                   "forget": 1, "cut": 2, "pause": 1, "corrupt": 1, "save_blocks": 6, "stream": 12, "pull": 5,
                   "lookup": 3, "load": 3, "migrate": 3, "flush": 1, "write_back": 3,
                   "cancel": 3, "cancel_new": 8, "settle": 3, "server_bounce": 1, "restart": 1, "during": 10}
        names, w = list(weights), list(weights.values())
        try:
            for step in range(self.steps):
                op = rng.choices(names, w)[0]
                node = rng.choice(self.nodes)
                self.clock.now += rng.choice((0.0, 0.0, 0.5, 2.0))
                self.log.append(f"{step}: {op} on {node.name} (now {self.clock.now:g}, {len(self.inflight)} in flight)")
                if op in sync_ops:
                    sync_ops[op](node)
                elif op in async_ops:
                    task = asyncio.ensure_future(async_ops[op](node))
                    self.inflight[task] = f"{step}:{node.name}:{op}"
                    if rng.random() >= 0.5:
                        await self.finish(task)
                elif op == "cancel" and self.inflight:
                    task = rng.choice(list(self.inflight))
                    await self.turns(rng.randrange(0, 4))
                    task.cancel()
                    await self.finish(task)
                elif op == "cancel_new":
                    # a call whose client goes away at a random await point, sometimes twice
                    which = rng.choice(list(async_ops))
                    task = asyncio.ensure_future(async_ops[which](node))
                    self.inflight[task] = f"{step}:{node.name}:{which} (to cancel)"
                    await self.turns(rng.randrange(0, 16))
                    task.cancel()
                    if rng.random() < 0.3:
                        await self.turns(rng.randrange(0, 4))
                        task.cancel()
                    await self.finish(task)
                elif op == "during":
                    # a transfer under way when the other side is struck (cut, stalled, damaging,
                    # its listener closed, the node restarted) or evicts, flushes, forgets
                    which = rng.choice(("stream", "stream", "pull", "migrate", "save_blocks"))
                    task = asyncio.ensure_future(async_ops[which](node))
                    self.inflight[task] = f"{step}:{node.name}:{which} (struck)"
                    await self.turns(rng.randrange(0, 12))
                    target = self.other(node)
                    strike = rng.choice(("cut", "cut", "pause", "corrupt", "server_bounce", "restart", "evict",
                                         "forget", "flush", "write_back", "close_session"))
                    self.log.append(f"  strike {strike} on {target.name}")
                    if strike in sync_ops:
                        sync_ops[strike](target)
                    elif strike == "server_bounce":
                        await self.op_server_bounce(target)
                    elif strike == "restart":
                        await self.op_restart(target)
                    else:
                        await self.bounded(async_ops[strike](target), strike)
                    if rng.random() < 0.7 and task in self.inflight:
                        await self.finish(task)
                elif op == "settle":
                    await self.settle()
                elif op == "server_bounce":
                    await self.op_server_bounce(node)
                elif op == "restart":
                    await self.op_restart(node)
                await self.turns(rng.randrange(0, 4))
                if self.errors:
                    self.fail(f"the event loop reported {self.errors}")
                for n in self.up_nodes():
                    self.check(n)
                if not self.inflight:
                    await self.check_all_quiescent()
            await self.settle()
            for node in self.nodes:   # the cluster heals
                node.gate.set()
                node.corrupting = False
                if node.server_down:
                    await self.op_server_bounce(node)
            await self.check_all_quiescent()
            # every chain streamed from the cluster onto some node, then read back after restarts
            for ns in range(2):
                for keys in self.chains[ns]:
                    node = rng.choice(self.nodes)
                    s = node.sessions[0]
                    end = await self.bounded(streamer(node.store).stream_blocks(
                        s.session_id, NS_IDS[ns], KeyRequest(hashes=keys), 0, (), lambda _: None,
                        node.peers.fetch), f"{node.name}: final stream")
                    if end.lease_id:
                        lease = node.store.leasing.get(end.lease_id)
                        assert lease is not None
                        self.expect(f"{node.name}: final stream", ns, keys,
                                    [bytes(node.arena.view(b.offset, SIZES[ns])) for b in lease.pinned])
                        node.store.release(s.session_id, end.lease_id)
            await self.check_all_quiescent()
            for node in self.nodes:
                await self.close(node, write_back=True)
            for node in self.nodes:
                await self.open(node)
            await self.check_all_quiescent()
            if self.errors:
                self.fail(f"the event loop reported {self.errors}")
        finally:
            await self.cancel_all_quietly()

    async def cancel_all_quietly(self) -> None:
        for task in list(self.inflight):
            task.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
        self.inflight.clear()
        for node in self.nodes:
            if not node.up:
                continue
            node.gate.set()
            try:
                async with asyncio.timeout(HANG_S):
                    await node.peers.close()
                node.copy.close()
                node.ssd.close()
                node.arena.close()
            except Exception:
                pass
            for s in node.sessions:
                for _, engine in s.buffers.values():
                    engine.close()
        for engine in self.closed_engines:
            engine.close()


def run_seed(tmp: Path, seed: int, steps: int = 200) -> None:
    asyncio.run(Fuzz(tmp, seed, steps).run())


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_the_cluster_consistent(tmp_path: Path, seed: int) -> None:
    run_seed(tmp_path, seed)


# Seeds that failed before fixes (their interleaving with the sockets varies, so each bug is also
# pinned down by a hand-written test): a connection accepted as a node's listener closed (a node
# restarted while a peer dialled it) was served on by the closed listener, from the closed store.
@pytest.mark.parametrize("seed", [89])
def test_random_operations_regressions(tmp_path: Path, seed: int) -> None:
    run_seed(tmp_path, seed, 300)


if __name__ == "__main__":
    import logging
    logging.getLogger("kvstored").setLevel(logging.CRITICAL)   # expected peer trouble is logged as warnings
    sweep(run_seed, 200)
