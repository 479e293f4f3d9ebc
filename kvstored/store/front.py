"""The block store: one front over the components that own the store's state.

Every method runs on the daemon's event loop thread, so bookkeeping needs no locks; byte copies
and disk I/O run on worker threads while the blocks involved are pinned (by a lease, a
promotion or a write-back), and nothing pinned is ever evicted, demoted twice or freed.

The components, each with its own state (see their modules): the catalog (namespaces and their
prefix indexes), placement over the DRAM and SSD residencies (slots, pages, copies, eviction,
the write-back queue), promotion (SSD to DRAM), write-back (DRAM to SSD), leasing (sessions,
leases, reservations' lifetimes), reservations (slots for new blocks), reads (lookups) and the
engine buffers. The policies (``dram.policy``, ``ssd.policy``; :mod:`kvstored.policy`) decide
which leaf of their tier goes next; the components carry their decisions out.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from kvstored.buffers import BlockIds, RegisteredBuffers, TensorSource
from kvstored.config import Config
from kvstored.copy import CopyEngine
from kvstored.index import Tier
from kvstored.leases import LeaseKind, Session
from kvstored.presence import PresenceTable
from kvstored.store.background import Background
from kvstored.store.catalog import Catalog, NamespaceState
from kvstored.store.dram_residency import DramResidency, never
from kvstored.store.engine_buffers import EngineBuffers
from kvstored.store.events import TierEvents
from kvstored.store.leasing import Leasing
from kvstored.store.placement import Placement
from kvstored.store.promotion import Promotion
from kvstored.store.quarantine import Quarantine
from kvstored.store.reads import Reads
from kvstored.store.reservations import Reservations
from kvstored.store.restore import restore
from kvstored.store.spares import Spares
from kvstored.store.ssd_residency import SsdResidency
from kvstored.store.values import (
    CachedPrefix,
    Commit,
    FlushProgress,
    KeyRequest,
    Reservation,
    RestoreReport,
    StoreStats,
    TierStats,
)
from kvstored.store.writeback import WriteBack, keep_for_ssd
from kvstored.tiers.dram import Arena
from kvstored.tiers.ssd import Progress, SSDError, SSDTier
from kvstored_client.contract.errors import FailedPrecondition, InvalidArgument, Reason
from kvstored_client.contract.namespace import Namespace

log = logging.getLogger("kvstored.store")


@dataclass(slots=True)
class PeerTraffic:
    """Blocks exchanged with peers (the peer exchange counts them; the store reports them)."""

    fetched: int = 0    # stored here from a peer that a stream fetched them from
    served: int = 0     # sent whole to a peer that fetched them
    received: int = 0   # pushed here by a peer and stored


class BlockStore:
    """The daemon's domain. Expected failures raise :mod:`kvstored_client.contract.errors` types and change nothing."""

    def __init__(self, config: Config, arena: Arena, copy: CopyEngine, ssd: SSDTier | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 new_session_id: Callable[[], str] = lambda: secrets.token_hex(16),
                 presence: PresenceTable | None = None) -> None:
        self.config = config
        self.arena = arena
        self.copy = copy
        self.ssd_tier = ssd
        self._clock = clock
        self._started = clock()
        self.background = Background()
        self.catalog = Catalog(config, ssd)
        self.presence = presence
        if presence is not None:   # before any namespace: every index tells it of every change
            self.catalog.observer = presence
        keep = keep_for_ssd(config, self.catalog) if ssd is not None else never
        self.placement = Placement(DramResidency(config, arena.capacity, clock, keep),
                                   SsdResidency(config, clock, ssd),
                                   config.dram.writeback_watermark * arena.capacity, clock)
        self.promotion = Promotion(self.placement, arena, ssd, self.background)
        self.writeback = WriteBack(config, clock, self.catalog, self.placement, arena, ssd, self.background, keep)
        quarantine_s = config.dram.quarantine_s
        self.leasing = Leasing(config, clock, self.placement, Quarantine(self.placement.dram, clock, quarantine_s),
                               new_session_id)
        self.reservations = Reservations(config, self.leasing, self.placement, self.promotion)
        self.spares = Spares(self.placement, min(config.dram.spare_bytes, arena.capacity // 16),
                             arena.capacity // 8, Quarantine(self.placement.dram, clock, quarantine_s))
        self.reads = Reads(config, self.leasing, self.placement, self.promotion)
        self.buffers = EngineBuffers(config, self.catalog, self.leasing, self.reservations, self.reads, copy,
                                     self.background)
        self.peer_traffic = PeerTraffic()
        self._catching_up = False
        self.placement.deferred = self._catch_up_soon

    def _catch_up_soon(self) -> None:
        """The policies put work off (their shadows' replay): do it on the event loop's next turn,
        after the reply of the request that caused it; without a running loop (a store driven
        directly) their next call does it."""
        if self._catching_up:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._catching_up = True
        loop.call_soon(self._catch_up)

    def _catch_up(self) -> None:
        self._catching_up = False
        self.placement.catch_up()

    # -- sessions ---------------------------------------------------------------------------
    def open_session(self, client_name: str, pid: int) -> Session:
        return self.leasing.open_session(client_name, pid)

    def close_session(self, session_id: str) -> None:
        """End a session: its leases end, its reservations abort, its buffers are unregistered."""
        session = self.leasing.close_session(session_id)
        self.spares.drop(session_id)
        if session is not None:
            for buffers_id in list(session.buffers):
                self.buffers.drop(buffers_id)

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` names an open session."""
        return self.leasing.has_session(session_id)

    # -- namespaces and keys ----------------------------------------------------------------
    def open_namespace(self, spec: Namespace) -> NamespaceState:
        """Create or find the namespace of ``spec``; its block size in bytes is fixed once known."""
        return self.catalog.open(spec)

    def resolve_keys(self, namespace_id: int, keys: KeyRequest) -> tuple[NamespaceState, list[bytes]]:
        """The namespace and the chain of block keys named by ``keys`` (validated, within limits)."""
        return self.catalog.resolve_keys(namespace_id, keys)

    # -- reads ------------------------------------------------------------------------------
    async def lookup(self, namespace_id: int, keys: KeyRequest, lease: bool = False,
                     session_id: str = "", prompt_blocks: int = 0) -> CachedPrefix:
        """Longest cached prefix of ``keys``, with the tier of each block.

        With ``lease``, the hit blocks are brought to DRAM (awaiting SSD reads; a block that
        fails its checksum ends the prefix there) and pinned for a direct read. Without, blocks
        found on a slower tier start moving to DRAM in the background (prefetch).
        ``prompt_blocks``: the prompt's length in blocks when ``keys`` are only its first ones
        (counted as asked for; capped at ``server.max_batch_blocks``).
        """
        session = self.leasing.working_session(session_id) if lease else None
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        asked = max(len(chain), min(prompt_blocks, self.config.server.max_batch_blocks))
        return await self.reads.lookup_chain(state, chain, session, asked=asked)

    def prefetch(self, namespace_id: int, keys: KeyRequest) -> tuple[int, int]:
        """Start promoting the cached prefix's slower-tier blocks; returns (hit, promoting)."""
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        return self.reads.prefetch(state, chain)

    def release(self, session_id: str, lease_id: int, reservation_only: bool = False) -> None:
        """End a read lease, or abort a reservation (only a reservation with ``reservation_only``).
        FailedPrecondition when it already expired."""
        self.leasing.release(session_id, lease_id, reservation_only)

    # -- writes -----------------------------------------------------------------------------
    def _check_block_bytes(self, state: NamespaceState, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes must be positive")
        if state.spec.block_bytes and block_bytes != state.spec.block_bytes:
            raise InvalidArgument(f"namespace {state.spec.model!r} stores blocks of "
                                  f"{state.spec.block_bytes} bytes; got {block_bytes}")
        self.catalog.fix_block_bytes(state, block_bytes)

    def reserve(self, session_id: str, namespace_id: int, keys: KeyRequest,
                block_bytes: int) -> Reservation:
        """Allocate slots for the blocks of ``keys`` not cached yet (a suffix of the chain).

        Fewer slots than asked come back when the tier cannot make room now (see
        :meth:`reserve_waiting`); none when another client is writing the next block. Raises
        InvalidArgument for a wrong payload size.
        """
        session = self.leasing.working_session(session_id)
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        self._check_block_bytes(state, block_bytes)
        lease = self.reservations.reserve_chain(session, state, chain)
        return Reservation(lease.lease_id, len(lease.pinned), [b.offset for b in lease.new],
                           self.config.leases.reservation_ttl_s)

    async def reserve_waiting(self, session_id: str, namespace_id: int, keys: KeyRequest, block_bytes: int,
                              until: float | None = None) -> Reservation:
        """:meth:`reserve`, waiting (up to ``dram.room_wait_s``, and not past ``until``, the event
        loop's time) for the write-back when DRAM is full of blocks that must reach SSD first."""
        session = self.leasing.working_session(session_id)
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        self._check_block_bytes(state, block_bytes)
        lease = await self.reservations.reserve_chain_waiting(session, state, chain, self._room_deadline(until))
        return Reservation(lease.lease_id, len(lease.pinned), [b.offset for b in lease.new],
                           self.config.leases.reservation_ttl_s)

    def _room_deadline(self, until: float | None) -> float:
        end = asyncio.get_running_loop().time() + self.config.dram.room_wait_s
        return end if until is None else min(end, until)

    def seal(self, session_id: str, reservation_id: int) -> int:
        """Make a reservation's written blocks visible; returns how many were sealed."""
        return self.leasing.seal(session_id, reservation_id)

    def commit(self, session_id: str, namespace_id: int, keys: KeyRequest, first: int, offsets: Sequence[int],
               block_bytes: int, spares_wanted: int) -> Commit:
        """A save in one call: store the blocks of ``keys`` from ``first`` on whose rows the
        session copied into its spare slots ``offsets`` (see :meth:`Spares.commit`), then top
        its spares of this slot size up to ``spares_wanted`` (see :meth:`Spares.top_up`; none
        wait for room). Keys may be empty: spares only. InvalidArgument for a wrong payload size
        or slots that are not the session's spares."""
        session = self.leasing.working_session(session_id)
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        self._check_block_bytes(state, block_bytes)
        present, stored, unused = self.spares.commit(session.session_id, state, chain, first, offsets)
        self.leasing.saved_blocks += stored
        new = self.spares.top_up(session.session_id, state.index.slot_bytes, spares_wanted)
        return Commit(present, stored, unused + new)

    @property
    def spare_bytes(self) -> int:
        """The bytes of spare slots a session may hold (see :meth:`commit`)."""
        return self.spares.limit_bytes

    def reservation_chain(self, session_id: str, reservation_id: int) -> tuple[int, list[bytes]]:
        """The namespace and keys of a live reservation's chain (present blocks, then those being
        written); (0, []) when there is no such reservation."""
        return self.leasing.reservation_chain(session_id, reservation_id)

    def reap(self) -> int:
        """End leases past their deadline, idle ones only, and free the slots (spare or
        reserved) whose quarantine is over; returns the count of leases."""
        self.spares.quarantine.release_due()
        return self.leasing.reap()

    # -- registered engine buffers ----------------------------------------------------------
    def register_buffers(self, session_id: str, namespace_id: int,
                         sources: Sequence[TensorSource]) -> RegisteredBuffers:
        """Map an engine's KV tensors; their block layout must match the namespace's."""
        session = self.leasing.working_session(session_id)
        return self.buffers.register(session, self.catalog.get(namespace_id), sources)

    async def unregister_buffers(self, session_id: str, buffers_id: int) -> None:
        """Stop using an engine's buffers. Returns once no copy touches them and they are unmapped
        (CUDA handles closed): only then may the engine free the memory."""
        await self.buffers.unregister(self.leasing.session(session_id), buffers_id)

    async def save_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: BlockIds, until: float | None = None) -> tuple[int, int]:
        """Copy the not-yet-cached blocks of a chain from engine buffers into the store.

        Returns (already present, newly stored); stored may fall short when the tier is full
        (after waiting for room as :meth:`reserve_waiting` does).
        """
        session = self.leasing.working_session(session_id)
        buffers = self.buffers.owned(session_id, buffers_id, namespace_id)
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        return await self.buffers.save(session, buffers, state, chain, block_ids, self._room_deadline(until))

    async def load_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: BlockIds,
                          started: Callable[[list[Tier]], None] | None = None,
                          tensor_done: Callable[[int], None] | None = None,
                          copy_until: float | None = None) -> list[Tier]:
        """Copy the longest cached prefix of a chain into engine buffers; returns its tiers
        (see :meth:`EngineBuffers.load`)."""
        session = self.leasing.working_session(session_id)
        buffers = self.buffers.owned(session_id, buffers_id, namespace_id)
        state, chain = self.catalog.resolve_keys(namespace_id, keys)
        return await self.buffers.load(session, buffers, state, chain, block_ids, started, tensor_done,
                                       copy_until)

    # -- administration ---------------------------------------------------------------------
    def evict(self, model: str = "", tier: Tier | None = None) -> int:
        """Drop cached blocks of the namespaces of ``model`` (all when empty) from ``tier`` (all
        when None); pinned blocks stay, and so does the SSD copy of a block with a child that
        keeps one. Returns how many blocks lost a copy or left the index. FailedPrecondition for
        the SSD tier of a store without one (as :meth:`flushing`); NotFound for a model never seen."""
        if tier is Tier.SSD and self.ssd_tier is None:
            raise FailedPrecondition("the SSD tier is disabled (ssd.enabled = false)", Reason.SSD_DISABLED)
        ids = self.catalog.ids_of(model)
        return self.placement.evict_blocks([b for ns_id in ids for b in self.catalog.get(ns_id).index], tier)

    async def evict_committed(self, model: str = "", tier: Tier | None = None) -> int:
        """:meth:`evict`, returning once the SSD deletes it made are committed: a crash right
        after ``kvctl evict`` no longer brings the evicted blocks back at restart. A delete whose
        commit failed (counted in the SSD write errors) is made by the writer's next commit; the
        blocks are out of the index either way, so that is logged, not raised."""
        count = self.evict(model, tier)
        # evicting DRAM deletes nothing on SSD: no waiting behind a write-back in progress
        if self.ssd_tier is not None and tier is not Tier.DRAM:
            try:
                await asyncio.wrap_future(self.ssd_tier.barrier())
            except SSDError as exc:
                log.warning("evicted blocks' SSD deletes did not commit yet: %s", exc)
        return count

    async def flush(self, model: str = "") -> int:
        """Write every DRAM block of ``model`` (all when empty) without an SSD copy to SSD now;
        returns how many were written. Failures as :meth:`flushing`."""
        written = 0
        async for progress in self.flushing(model):
            written = progress.written
        return written

    def flushing(self, model: str = "") -> AsyncGenerator[FlushProgress, None]:
        """:meth:`flush` with its progress (see :meth:`WriteBack.flushing`)."""
        return self.writeback.flushing(model)

    def restore(self, progress: Progress | None = None) -> RestoreReport:
        """Rebuild namespaces and the index from the SSD tier (at start, before serving);
        ``progress(what, done, total)`` is called every PROGRESS_EVERY records."""
        return restore(self.catalog, self.placement, self.ssd_tier, progress)

    async def writeback_loop(self, interval_s: float = 0.5) -> None:
        """Background task: keep DRAM's blocks without an SSD copy under the watermark."""
        await self.writeback.loop(interval_s)

    def observe(self, events: TierEvents) -> None:
        """Tell ``events`` of every copy a block gains or loses from now on (the KV events)."""
        self.placement.events = events

    # -- introspection and shutdown ---------------------------------------------------------
    def verify_presence(self) -> list[str]:
        """How the presence table differs from the index, the where words of blocks in DRAM
        included ([]: it matches, or there is none)."""
        if self.presence is None:
            return []
        return self.presence.verify((b.index.namespace_id, b.key, b.presence, b.offset)
                                    for b in self.catalog.blocks())

    def stats(self) -> StoreStats:
        p, dram = self.placement, self.placement.dram
        tiers = [TierStats("dram", dram.capacity, dram.used_bytes, dram.blocks(), p.dram_evictions)]
        if self.ssd_tier is not None:
            tiers.append(TierStats("ssd", self.config.ssd.capacity, p.ssd.used_bytes, p.ssd.blocks,
                                   p.ssd_evictions, self.writeback.write_errors, self.promotion.read_errors))
        r = self.reads
        return StoreStats(self._clock() - self._started, tiers, r.lookups, r.lookup_blocks, r.hit_blocks,
                          r.hit_tokens, self.leasing.saved_blocks, self.leasing.count(LeaseKind.READ),
                          self.leasing.sessions(), len(self.catalog), self.catalog.block_count(),
                          self.promotion.promotions, self.writeback.demotions, p.dropped,
                          self.peer_traffic.fetched, self.peer_traffic.served, self.peer_traffic.received,
                          dict(p.dropped_by), self.reservations.room_waits.snapshot())

    async def write_back_for_shutdown(self) -> int:
        """Shutdown: write DRAM blocks without an SSD copy to SSD (under ``ssd.admission`` and the
        SSD policy) until none is left that may go; returns how many were written."""
        return await self.writeback.for_shutdown()

    async def record_reuses(self) -> int:
        """Shutdown: keep each reused block's count with its SSD record, and what the policies
        learned (see :meth:`WriteBack.record_reuses`); how many records were updated."""
        return await self.writeback.record_reuses()

    def dram_only_blocks(self) -> int:
        """Sealed blocks whose only copy is in DRAM (lost when the daemon stops)."""
        return self.placement.dram_only()

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait until no request has a copy in flight nor a leased lookup waiting for SSD reads,
        for at most ``timeout_s``; whether none has. From then on, requests that would start new
        work are refused (DaemonNotRunning). See :meth:`Leasing.quiesce`."""
        return await self.leasing.quiesce(timeout_s)

    async def finish_background(self) -> None:
        """Wait for background promotions and write-backs in flight (shutdown)."""
        await self.background.finish()
