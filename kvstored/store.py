"""The block store: namespaces, the prefix index, the DRAM and SSD tiers and leases, composed.

Every method runs on the daemon's event loop thread, so bookkeeping needs no locks; byte copies
and disk I/O run on worker threads while the blocks involved are pinned (by a lease, a
promotion or a write-back), and nothing pinned is ever evicted, demoted twice or freed.

Tiers are exclusive in their eviction policies and inclusive in their bytes: a sealed block with a
DRAM slot is tracked by its slot size's DRAM policy, one without by the SSD policy; a block may
have both a slot and an SSD copy ("clean"), which makes evicting it from DRAM free. The policies
(``dram.policy``, ``ssd.policy``; :mod:`kvstored.policy`) decide which leaf of their tier goes
next and learn of every store, hit and removal; this module only carries their decisions out and
never hands them a block that may not go (pinned, being written out or promoted, unsealed). The
write-back task keeps the DRAM blocks without an SSD copy below ``dram.writeback_watermark`` of the
arena, oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import mmap
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash

from kvstored.buffers import BlockIds, RegisteredBuffers, TensorSource
from kvstored.config import Config
from kvstored.copy import CopyEngine
from kvstored.handover import Arrival, Handover
from kvstored.index import DEMOTING, HIT, NO_SLOT, ON_SSD, SEALED, Block, PrefixIndex, Tier
from kvstored.leases import Lease, LeaseKind, LeaseTable, Session
from kvstored.policy.admission import admit
from kvstored.policy.interface import BlockPolicy
from kvstored.policy.registry import make_policy
from kvstored.tiers.dram import Arena, SlotAllocator, slot_size
from kvstored.tiers.ssd import PROGRESS_EVERY, BlockRecord, Corrupt, MapFull, Progress, SSDError, SSDTier
from kvstored_client.contract.errors import (
    DaemonNotRunning,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    LeaseExpired,
    NotFound,
    Reason,
    ResourceExhausted,
)
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

log = logging.getLogger("kvstored.store")
T = TypeVar("T")

# The SSD tier holds blocks of every namespace's size; its policy's ghost list is sized as if they
# were of this many bytes (16 tokens of an 8B model at tensor parallel 2), a bound on its memory,
# and for at least MIN_GHOST_BLOCKS blocks (a small tier of large blocks still remembers some).
GHOST_BLOCK_BYTES = 1 << 20
MIN_GHOST_BLOCKS = 1024


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: int
    spec: Namespace
    index: PrefixIndex
    on_ssd: bool = False   # its record is written (or on its way) to the SSD tier


@dataclass(frozen=True, slots=True)
class KeyRequest:
    """A chain of blocks as the client named it: engine hashes, or token ids to hash here."""

    hashes: Sequence[bytes] = ()
    token_ids: Sequence[int] = ()
    cache_salt: str = ""
    lora_name: str = ""
    packed_hashes: bytes = b""   # the hashes end to end, each of the namespace's digest size


@dataclass(frozen=True, slots=True)
class LookupResult:
    blocks: int
    tiers: list[Tier]
    offsets: list[int]
    lease_id: int
    lease_ttl_s: float
    block_bytes: int
    block_size: int
    lease_lost: bool = False   # the hits' lease ended (released, reaped) while they came up from SSD


@dataclass(frozen=True, slots=True)
class Reservation:
    reservation_id: int
    present: int
    offsets: list[int]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int
    write_errors: int = 0
    read_errors: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    uptime_s: float
    tiers: list[TierStats]
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    hit_tokens: int
    saved_blocks: int
    active_leases: int
    clients: int
    namespaces: int
    index_blocks: int
    promotions: int
    demotions: int
    dropped_blocks: int
    peer_fetched_blocks: int = 0
    peer_served_blocks: int = 0
    peer_received_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a streamed load ended: ``blocks`` of ``requested`` arrived, then ``stop`` ("complete",
    or why it stopped short). ``lease_id``: arena mode, the lease holding the blocks (0: none)."""

    blocks: int
    requested: int
    stop: str
    detail: str
    lease_id: int
    lease_ttl_s: float


@dataclass(frozen=True, slots=True)
class Fetched:
    """What a :data:`Fetcher` brought: ``delivered`` leading blocks, then ``stop`` and why."""

    delivered: int
    stop: str
    detail: str = ""


# fetcher(namespace_id, keys, into, landed): fetch ``keys`` in order from some peer; receive block i
# into ``into(i, length)``, then await ``landed(i, peer)``. Never raises for a peer's failure.
Into = Callable[[int, int], Awaitable[memoryview]]
Served = tuple[memoryview, int | None] | None   # a block checked out for a peer: bytes, xxh3-64 (None: unknown)
Landed = Callable[[int, str], Awaitable[None]]
Fetcher = Callable[[int, list[bytes], Into, Landed], Awaitable[Fetched]]


PROMOTIONS_PER_STEP = 32   # SSD reads a lookup sets up before it lets other tasks run
_STORED_HERE = "stored_here"   # _fill_reservation: go on from blocks another client stored meanwhile
_FLUSH_ROUNDS = 6000   # write-back rounds (or 10 ms waits for other write-backs) a flush takes at most


@dataclass(frozen=True, slots=True)
class FlushProgress:
    """How far a flush is: blocks it wrote to SSD so far, and blocks of the flushed namespaces
    still only in DRAM (saves during the flush add to them)."""

    written: int
    left: int
    done: bool = False


@dataclass(frozen=True, slots=True)
class RestoreReport:
    namespaces: int
    blocks: int
    dropped: int
    evicted: int = 0   # over ssd.capacity (lowered since the blocks were written): evicted at once


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    saved_blocks: int = 0
    dram_evictions: int = 0
    ssd_evictions: int = 0
    promotions: int = 0
    demotions: int = 0
    dropped: int = 0
    ssd_write_errors: int = 0
    ssd_read_errors: int = 0
    peer_fetched: int = 0
    peer_served: int = 0
    peer_received: int = 0


def _tiers(blocks: Sequence[Block]) -> list[Tier]:
    """The tier of each block (the all-DRAM case, by far the most common, without a Python loop)."""
    if all(b.offset != NO_SLOT for b in blocks):
        return [Tier.DRAM] * len(blocks)
    return [Tier.DRAM if b.offset != NO_SLOT else Tier.SSD for b in blocks]


def _check_distinct(ids: np.ndarray, first: int = 0) -> None:
    """InvalidArgument naming two positions (counted from ``first``) that share an engine block:
    a save would store one block's bytes under the other's key, a load would overwrite one with
    the other."""
    if ids.size < 2:
        return
    ordered = np.sort(ids)   # finds out; the stable argsort (20x the cost at 16k ids) only names them
    if (ordered[1:] == ordered[:-1]).any():
        order = np.argsort(ids, kind="stable")
        repeats = np.flatnonzero(ids[order][1:] == ids[order][:-1])
        a, b = sorted((int(order[repeats[0]]), int(order[repeats[0] + 1])))
        raise InvalidArgument(f"block_ids[{first + a}] and block_ids[{first + b}] are both engine block "
                              f"{int(ids[a])}; each block needs its own")


PrefixUp = Callable[[list[Block], list[Tier], int], None]


class _EarlyCopy:
    """A load's copy of the blocks that come up from SSD during its lookup (``prefix_up``, given to
    ``_lookup_chain``), through a :class:`Handover` made at the first of them; ``finish`` waits
    for those and copies the rest, reporting tensors done only then; ``close`` always."""

    def __init__(self, copy: CopyEngine, buffers: RegisteredBuffers, block_ids: BlockIds,
                 copy_until: float | None) -> None:
        self._copy, self._buffers, self._block_ids, self._copy_until = copy, buffers, block_ids, copy_until
        self._handover: Handover | None = None
        self._given = 0

    def prefix_up(self, hits: list[Block], tiers: list[Tier], k: int) -> None:
        if self._handover is None:
            self._handover = Handover(_ignore_arrival, self._copy, self._buffers, self._block_ids, self._copy_until)
        self._handover.give(self._given, hits[self._given:k], tiers[self._given:k])
        self._given = k

    async def finish(self, offsets: Sequence[int], tensor_done: Callable[[int], None] | None) -> None:
        """Copy the prefix whose slots are ``offsets`` (raises DeadlineExceeded like the copy)."""
        if self._handover is not None:
            await self._handover.finish()
        assert self._given <= len(offsets), f"{self._given} blocks copied early of a {len(offsets)}-block prefix"
        await self._copy.from_arena(self._buffers, self._block_ids[self._given:len(offsets)],
                                    offsets[self._given:], tensor_done, not_after=self._copy_until)

    async def close(self) -> None:
        if self._handover is not None:
            await self._handover.close()


def _ignore_arrival(arrival: Arrival) -> None:
    """A pull's handover: the blocks are only brought to this node."""


@dataclass(slots=True, eq=False)
class PeerLanding:
    """A DRAM slot a pushed block is being received into (see :meth:`BlockStore.land`)."""

    store: BlockStore
    state: NamespaceState
    parent: Block | None
    key: bytes
    offset: int
    view: memoryview
    done: bool = False

    def commit(self, checksum: int | None = None) -> bool:
        """The bytes in ``view`` are verified (their xxh3-64 ``checksum``, when given, is kept with
        the block, so serving it on is not a second hash): store the block. False when the chain
        changed while they arrived (the slot is freed; nothing is stored)."""
        assert not self.done, "a landing is committed or aborted once"
        self.done = True
        return self.store._landed(self, True, checksum)

    def abort(self) -> None:
        """The bytes did not arrive or failed their checksum: free the slot."""
        assert not self.done, "a landing is committed or aborted once"
        self.done = True
        self.store._landed(self, False)


class BlockStore:
    """The daemon's domain. Expected failures raise :mod:`kvstored_client.contract.errors` types and change nothing."""

    def __init__(self, config: Config, arena: Arena, copy: CopyEngine, ssd: SSDTier | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 new_session_id: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        self._config = config
        self._arena = arena
        self._copy = copy
        self._ssd = ssd
        self._clock = clock
        self._new_session_id = new_session_id
        self._started = clock()
        self._allocator = SlotAllocator(arena.capacity, config.dram.page_bytes)
        self._tick = 0                                      # advances with every request that allocates
        self._page_tick = [0] * self._allocator.num_pages   # when each page was last used (sealed or hit)
        # the blocks holding a slot in each page (see _bind_slot); a used slot of none: a landing
        self._page_blocks: list[dict[Block, None]] = [{} for _ in range(self._allocator.num_pages)]
        self._dram_policies: dict[int, BlockPolicy] = {}   # one per slot size
        self._ssd_policy = make_policy(config.ssd.policy, clock,
                                       max(config.ssd.capacity // GHOST_BLOCK_BYTES, MIN_GHOST_BLOCKS),
                                       can_evict=self._ssd_can_evict)
        self._ssd_used = 0
        # blocks with an SSD copy (ON_SSD), kept as they gain and lose it: stats() (every scrape)
        # must not walk millions of blocks on the event loop to count them
        self._ssd_blocks = 0
        self._dirty_bytes = 0   # DRAM bytes of sealed blocks without an SSD copy ...
        self._dirty: dict[Block, None] = {}  # ... and those blocks, oldest first (the write-back order)
        self._namespaces: dict[int, NamespaceState] = {}
        self._sessions: dict[str, Session] = {}
        self._leases = LeaseTable(clock)
        self._buffers: dict[int, tuple[str, int, RegisteredBuffers]] = {}
        self._next_buffers_id = 1
        self._busy: set[int] = set()      # lease ids with a copy in flight
        self._lookups_in_flight = 0       # leased lookups waiting for SSD reads (quiesce)
        self._doomed: set[int] = set()    # busy leases to end once their copy is done
        self._stopping = False            # quiesce() began: no new copies nor leases (shutdown)
        self._promoting: dict[Block, asyncio.Future[bool]] = {}
        self._background: set[asyncio.Task[object]] = set()
        self._writeback_wanted = asyncio.Event()
        self._ssd_backoff_until = 0.0
        self._n = _Counters()

    # -- sessions ---------------------------------------------------------------------------
    def open_session(self, client_name: str, pid: int) -> Session:
        session = Session(self._new_session_id(), client_name, pid)
        self._sessions[session.session_id] = session
        return session

    def close_session(self, session_id: str) -> None:
        """End a session: its leases end, its reservations abort, its buffers are unregistered."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        for lease_id in list(session.leases):
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._end(lease, session, aborted=True)
        for buffers_id in list(session.buffers):
            self._drop_buffers(buffers_id)

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` names an open session."""
        return session_id in self._sessions

    def _working_session(self, session_id: str) -> Session:
        """:meth:`_session`, for a request that starts new work (a copy, a lease, a reservation):
        DaemonNotRunning once shutdown began. A call the server had taken before SIGTERM may start
        only after quiesce() found nothing in flight; its session then ends under its copy (a
        save stored nothing and said the session closed) or its lease (a load found nothing)."""
        if self._stopping:
            raise DaemonNotRunning("the daemon is stopping", Reason.DAEMON_STOPPING)
        return self._session(session_id)

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise FailedPrecondition(f"unknown session {session_id!r}: open a session first (the "
                                     "daemon may have restarted; reconnect)", Reason.UNKNOWN_SESSION)
        return session

    # -- namespaces -------------------------------------------------------------------------
    def open_namespace(self, spec: Namespace) -> NamespaceState:
        """Create or find the namespace of ``spec``; its block size in bytes is fixed once known."""
        why = self._refusal_of(spec)
        if why:
            raise InvalidArgument(why)
        namespace_id = spec.identity()
        state = self._namespaces.get(namespace_id)
        if state is None:
            state = self._add_namespace(namespace_id, spec)
        elif spec.block_bytes:
            self._fix_block_bytes(state, spec.block_bytes)
        return state

    def _refusal_of(self, spec: Namespace) -> str:
        """Why this daemon cannot hold ``spec``'s blocks as configured ("" when it can): opened
        by a client, or found on SSD at restart (the config may have changed since)."""
        try:
            spec.validate()
        except (TypeError, ValueError) as exc:
            return str(exc)
        if spec.hash_algo != "sha256_cbor" and not self._config.keys.allow_fast_hash:
            return (f"namespace.hash_algo {spec.hash_algo!r} is disabled on this daemon "
                    "(set keys.allow_fast_hash = true on trusted single-tenant nodes)")
        return self._too_large(spec.block_bytes)

    def _add_namespace(self, namespace_id: int, spec: Namespace) -> NamespaceState:
        state = NamespaceState(namespace_id, spec, PrefixIndex(namespace_id))
        self._namespaces[namespace_id] = state
        if spec.block_bytes:
            state.index.slot_bytes = slot_size(spec.block_bytes)
            self._persist_namespace(state)
        return state

    def _persist_namespace(self, state: NamespaceState) -> None:
        """Write the namespace's record to the SSD tier (restore needs it to take its blocks
        back); if the write fails, ``on_ssd`` turns False and the next write-back of one of its
        blocks writes the record again first."""
        if self._ssd is None:
            return
        state.on_ssd = True

        def written(fut: Future[None]) -> None:   # on the writer thread: one flag, read on the loop
            if fut.exception() is not None:
                state.on_ssd = False

        self._ssd.put_namespace(state.namespace_id,
                                json.dumps(dataclasses.asdict(state.spec)).encode()).add_done_callback(written)

    def _too_large(self, block_bytes: int) -> str:
        """Why blocks of ``block_bytes`` cannot have a DRAM slot here ("" when they can)."""
        if block_bytes > self._config.dram.page_bytes:
            return (f"block_bytes {block_bytes} exceeds dram.page_bytes {self._config.dram.page_bytes}; "
                    "raise it in the daemon config")
        return ""

    def _check_block_bytes(self, block_bytes: int) -> None:
        if why := self._too_large(block_bytes):
            raise InvalidArgument(why)

    def _fix_block_bytes(self, state: NamespaceState, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes must be positive")
        self._check_block_bytes(block_bytes)
        if state.spec.block_bytes == 0:
            state.spec = dataclasses.replace(state.spec, block_bytes=block_bytes)
            state.index.slot_bytes = slot_size(block_bytes)
            self._persist_namespace(state)
        elif state.spec.block_bytes != block_bytes:
            raise InvalidArgument(f"namespace {state.spec.model!r} stores blocks of "
                                  f"{state.spec.block_bytes} bytes; got {block_bytes}")

    def _namespace(self, namespace_id: int) -> NamespaceState:
        state = self._namespaces.get(namespace_id)
        if state is None:
            raise NotFound(f"unknown namespace {namespace_id}: open it first", Reason.UNKNOWN_NAMESPACE)
        return state

    def resolve_keys(self, namespace_id: int, keys: KeyRequest) -> tuple[NamespaceState, list[bytes]]:
        """The namespace and the chain of block keys named by ``keys`` (validated, within limits)."""
        state = self._namespace(namespace_id)
        spec = state.spec
        limit = self._config.server.max_batch_blocks
        if sum(map(bool, (keys.hashes, keys.packed_hashes, keys.token_ids))) > 1:
            raise InvalidArgument("give one of hashes, packed_hashes or token_ids (not several)", Reason.BAD_KEYS)
        if keys.hashes or keys.packed_hashes:
            if keys.cache_salt or keys.lora_name:
                raise InvalidArgument("cache_salt and lora_name apply to token ids only; "
                                      "engine hashes already include them", Reason.BAD_KEYS)
            size = spec.digest_size
            if keys.packed_hashes and len(keys.packed_hashes) % size:
                raise InvalidArgument(f"packed_hashes has {len(keys.packed_hashes)} bytes, not a whole number "
                                      f"of {size}-byte {spec.hash_algo} keys", Reason.BAD_KEYS)
            n = len(keys.packed_hashes) // size or len(keys.hashes)
            if n > limit:
                raise InvalidArgument(f"{n} blocks exceed server.max_batch_blocks={limit}", Reason.TOO_MANY_BLOCKS)
            if keys.packed_hashes:   # numpy cuts them apart in C, each a bytes object of its own
                return state, np.frombuffer(keys.packed_hashes, f"V{size}").tolist()
            chain = list(keys.hashes)
            if set(map(len, chain)) != {size}:  # the common case costs one C-level pass
                for i, h in enumerate(chain):
                    if len(h) != size:
                        raise InvalidArgument(f"hashes[{i}] has {len(h)} bytes; {spec.hash_algo} keys have "
                                              f"{size}", Reason.BAD_KEYS)
            return state, chain
        if len(keys.token_ids) // spec.block_size > limit:
            raise InvalidArgument(f"{len(keys.token_ids) // spec.block_size} blocks exceed "
                                  f"server.max_batch_blocks={limit}", Reason.TOO_MANY_BLOCKS)
        try:
            chain = block_hashes(keys.token_ids, spec.block_size, spec.hash_seed, spec.hash_algo,
                                 cache_salt=keys.cache_salt or None, lora_name=keys.lora_name or None)
        except ValueError as exc:
            raise InvalidArgument(str(exc), Reason.BAD_KEYS) from None
        return state, chain

    # -- reads ------------------------------------------------------------------------------
    async def lookup(self, namespace_id: int, keys: KeyRequest, lease: bool = False,
                     session_id: str = "") -> LookupResult:
        """Longest cached prefix of ``keys``, with the tier of each block.

        With ``lease``, the hit blocks are brought to DRAM (awaiting SSD reads; a block that
        fails its checksum ends the prefix there) and pinned for a direct read. Without, blocks
        found on a slower tier start moving to DRAM in the background (prefetch).
        """
        session = self._working_session(session_id) if lease else None
        state, chain = self.resolve_keys(namespace_id, keys)
        return await self._lookup_chain(state, chain, session)

    async def _lookup_chain(self, state: NamespaceState, chain: list[bytes], session: Session | None,
                            prefix_up: PrefixUp | None = None,
                            on_lease: Callable[[int], None] | None = None) -> LookupResult:
        """:meth:`lookup` of a resolved chain (``session``: lease the hits for it). With a session,
        ``on_lease`` learns the id of the hits' lease as it is taken, before any ``prefix_up``;
        ``prefix_up(hits, tiers, k)`` learns, while SSD reads are still running, that the first ``k``
        hits (found in ``tiers``) are in DRAM and leased (the result names no fewer, unless the
        lease was reaped meanwhile)."""
        namespace_id = state.namespace_id
        hits = state.index.match(chain)
        for block in hits:
            block.flags |= HIT
        self._tick += 1
        self._hit(hits)
        tiers = _tiers(hits)
        lease_id = 0
        lost = False
        ttl = self._config.leases.ttl_s
        if session is not None and hits:
            held = self._pin(session, LeaseKind.READ, namespace_id, hits, ttl)
            if on_lease is not None:
                on_lease(held.lease_id)
            # in flight for quiesce() while its blocks come up (its lease is not busy yet, unless a
            # stream's): a load or leased lookup at SIGTERM finishes before its session ends
            # and takes the lease
            self._lookups_in_flight += 1
            try:
                up = None if prefix_up is None else functools.partial(self._prefix_up, held, prefix_up, hits, tiers)
                n = await self._ensure_dram(hits, up, lambda: held.lease_id not in self._doomed)
            except BaseException:   # cancelled while blocks came up from SSD: the lease goes too
                if self._leases.get(held.lease_id) is held:
                    self._end(held, session, aborted=True)
                for block in reversed(hits):   # a read that already failed left a hollow block
                    if not block.readable:
                        self._remove_if_hollow(block)
                raise
            finally:
                self._lookups_in_flight -= 1
            if n < len(hits):
                if self._leases.get(held.lease_id) is held:   # else its end unpinned them all
                    for block in hits[n:]:
                        block.pins -= 1
                    del held.pinned[n:]
                for block in reversed(hits[n:]):
                    self._remove_if_hollow(block)
                hits = hits[:n]
                tiers = tiers[:n]
            lost = self._leases.get(held.lease_id) is not held or held.lease_id in self._doomed
            if hits and not lost:
                lease_id = held.lease_id
                if any(t is not Tier.DRAM for t in tiers):
                    # the reply says the reader has ``ttl`` from now: the reads took some of it
                    self._leases.renew(held, ttl)
            else:
                hits, tiers = [], []
                if self._leases.get(held.lease_id) is held:
                    self._end(held, session, aborted=True)
        elif hits and any(not b.in_dram for b in hits):
            self._prefetch_in_background(hits)
        self._n.lookups += 1
        self._n.lookup_blocks += len(chain)
        self._n.hit_blocks += len(hits)
        self._n.hit_tokens += len(hits) * state.spec.block_size
        return LookupResult(len(hits), tiers, [b.offset for b in hits] if session is not None else [],
                            lease_id, ttl, state.spec.block_bytes, state.spec.block_size, lost)

    def _prefix_up(self, held: Lease, prefix_up: PrefixUp, hits: list[Block], tiers: list[Tier], k: int) -> None:
        # Only while the lookup's lease holds: once it ended (reaped, its session closed) the hits
        # are unpinned, and one in DRAM may lose its slot to another block before it is copied.
        # One doomed (busy when its session closed) still pins them, but nobody is listening.
        if self._leases.get(held.lease_id) is held and held.lease_id not in self._doomed:
            prefix_up(hits, tiers, k)

    def prefetch(self, namespace_id: int, keys: KeyRequest) -> tuple[int, int]:
        """Start promoting the cached prefix's slower-tier blocks; returns (hit, promoting)."""
        state, chain = self.resolve_keys(namespace_id, keys)
        hits = state.index.match(chain)
        # Not a hit for the policies: the load that follows a prefetch is. Its pages are in use.
        self._mark_pages(hits)
        slow = sum(1 for b in hits if not b.in_dram and b not in self._promoting)
        if slow:
            self._prefetch_in_background(hits)
        return len(hits), slow

    def _prefetch_in_background(self, hits: list[Block]) -> None:
        for block in hits:
            block.pins += 1

        async def run() -> None:
            try:
                await self._ensure_dram(hits)
            finally:
                for block in hits:
                    block.pins -= 1
                for block in reversed(hits):
                    self._remove_if_hollow(block)
        self._spawn(run())

    def _spawn(self, coro: Coroutine[object, object, T]) -> asyncio.Future[T]:
        """Run ``coro`` as a background task that ``drain`` waits for; the task."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _ensure_dram(self, blocks: list[Block], ready: Callable[[int], None] | None = None,
                           wanted: Callable[[], bool] | None = None) -> int:
        """Give every block of a (pinned) prefix a valid DRAM slot, reading SSD copies as needed.

        Returns how many leading blocks are now readable in DRAM: fewer when the arena cannot
        make room or a copy is corrupt (that block becomes hollow and is dropped). ``ready(k)``
        is called each time that leading run grows while reads are outstanding (never past the
        count returned), so that a caller can use the first blocks before the last have landed.
        Other tasks run between steps of PROMOTIONS_PER_STEP reads set up; a block found unpinned
        at its turn (its reader's lease ended meanwhile), or ``wanted()`` false at a step (a busy
        lease doomed: it keeps its pins until its request ends), ends the prefix there.
        """
        waits: list[tuple[int, asyncio.Future[bool]]] = []
        # and its reuses on SSD, and the hits recorded on it there that had not reached its
        # ancestors (they never will: its parent left the SSD policy before it)
        started: list[tuple[Block, asyncio.Future[bool], int, int]] = []
        cut = len(blocks)
        landed = 0     # waits[:landed] are over (landed, or failed: then cut is at most there)
        reported = 0   # the leading run ready() was told of

        def report(upto: int) -> None:
            """Tell ready() of the leading run that is in DRAM, up to block ``upto``."""
            nonlocal landed, cut, reported
            while landed < len(waits) and waits[landed][1].done():
                if not waits[landed][1].result():
                    cut = min(cut, waits[landed][0])
                landed += 1
            k = min(waits[landed][0] if landed < len(waits) else upto, upto, cut)
            if ready is not None and k > reported:
                reported = k
                ready(k)

        self._tick += 1
        loop = asyncio.get_running_loop()
        set_up = 0   # reads started since the last step
        try:
            for i, block in enumerate(blocks):
                if set_up == PROMOTIONS_PER_STEP:
                    set_up = 0
                    # Let other clients' calls in: set up in one step, a long prompt's promotions
                    # held the event loop for ~35 us a block (70 ms for 2,048 blocks here); the
                    # reads queued so far go on meanwhile, and the blocks landed are used.
                    await asyncio.sleep(0)
                    report(i)
                    if cut < i:   # a read failed: the blocks past it are of no use
                        break
                    if wanted is not None and not wanted():   # its reader is gone, the pins stay
                        cut = min(cut, i)
                        break
                if block.pins == 0:   # its reader's lease ended during a step: nobody wants the rest
                    cut = min(cut, i)  # (and, unpinned, it may have left the index meanwhile)
                    break
                pending = self._promoting.get(block)
                if pending is not None:
                    waits.append((i, pending))
                    continue
                if block.in_dram:
                    continue
                if self._ssd is None or not block.on_ssd:
                    cut = min(cut, i)
                    break
                offset = self._alloc(block.index.slot_bytes)
                if offset is None:
                    cut = min(cut, i)
                    break
                reuses = self._ssd_policy.reuses(block) or 0   # its history goes up with it
                unfolded = self._ssd_policy.pending_hits(block)
                self._ssd_policy.removed(block, moved=True)   # up to DRAM; its SSD copy stays
                self._bind_slot(block, offset)
                done: asyncio.Future[bool] = loop.create_future()
                self._promoting[block] = done
                read: Future[int]
                try:
                    read = self._ssd.read_into(block.index.namespace_id, block.key,
                                               self._arena.view(offset, self._block_bytes(block)))
                except Exception as exc:   # it could not start (the tier is closed): a failed read,
                    read = Future()        # so that the slot goes back and the waiters learn of it
                    read.set_exception(exc)
                # a callback, not a task per block: the tasks' set-up cost as much as the rest
                read.add_done_callback(functools.partial(self._read_landed, loop, block, done, reuses))
                waits.append((i, done))
                started.append((block, done, reuses, unfolded))
                set_up += 1
        finally:   # cancelled between steps too: every slot bound here goes to the DRAM policy
            if started:
                self._spawn(self._track_promoted(started))
        if not waits:
            return cut
        report(cut)
        while landed < len(waits):
            # shielded: the promotion is shared (other readers, _finish_promotion, _track_promoted);
            # a caller that is cancelled (a client gone, a transfer timed out) must not cancel it.
            # One already done is not awaited: a wake-up per block costs as much as its set-up.
            fut = waits[landed][1]
            if not fut.done():
                await asyncio.shield(fut)
            report(cut)
        return cut

    def _read_landed(self, loop: asyncio.AbstractEventLoop, block: Block, done: asyncio.Future[bool],
                     reuses: int, read: Future[int]) -> None:
        """A promotion's read ended (on its read thread, or at once if it never started): finish
        the promotion on the event loop. Nothing to finish once the loop is closed (shutdown)."""
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._finish_promotion, block, read, done, reuses)

    def _finish_promotion(self, block: Block, read: Future[int], done: asyncio.Future[bool],
                          reuses: int) -> None:
        """``reuses``: the block's on SSD, which it takes back there when the read failed."""
        try:
            check = read.result()
        except Exception as exc:
            self._release_slot(block)
            self._promoting.pop(block, None)
            self._ssd_read_failed(block, exc, reuses)
            done.set_result(False)
            if isinstance(exc, Corrupt):
                self._remove_if_hollow(block)
            return
        self._promoting.pop(block, None)
        block.check = check   # verified against these bytes: a peer gets the block unhashed
        self._n.promotions += 1
        done.set_result(True)

    def _ssd_read_failed(self, block: Block, exc: Exception, reuses: int | None = None) -> None:
        """Count a failed read of a block's SSD copy (slotless: its DRAM slot, if it had one for
        the read, is already released). A corrupt copy is dropped; after any other error (the
        disk, the pool shutting down) the copy stays and goes back to the SSD policy, with the
        ``reuses`` it had there when a promotion took it out. A block is counted dropped once,
        however many reads of its copy fail (peers reading it at once into buffers of their own)."""
        self._n.ssd_read_errors += 1
        if isinstance(exc, Corrupt):
            if block.on_ssd:   # else an earlier failed read of this copy dropped it (and counted it)
                log.warning("dropping block %s: %s", block.key.hex()[:16], exc)
                self._drop_ssd_copy(block)
                self._n.dropped += 1
        else:
            log.warning("SSD read of %s failed: %s", block.key.hex()[:16], exc)
            if block not in self._ssd_policy:
                self._ssd_policy.inserted([block], None if reuses is None else [reuses])

    async def _track_promoted(self, started: list[tuple[Block, asyncio.Future[bool], int, int]]) -> None:
        """Hand a batch of promoted blocks to their DRAM policy once all have landed, parent first
        (batches of one chain, other readers' included, may land in any order: the policy counts
        a child tracked before its parent under it all the same). A task of its own, so that a
        cancelled lookup cannot leave a slot untracked (hence never evicted); the blocks are
        pinned until their readers are done."""
        await asyncio.gather(*(done for _, done, _, _ in started))
        if not started:
            return
        policy = self._dram_for(started[0][0])
        # A batch is one prefix, parent first, and a hit of a block was a hit of its ancestors,
        # which the SSD policy (recording hits on the deepest block only, folded into the parent
        # when the block leaves, but each parent here left first) had not counted: each block
        # adds the pending hits of those below it, and has at least the reuses of any of them.
        counted: list[tuple[Block, asyncio.Future[bool], int]] = []
        below = most = 0
        for block, done, reuses, unfolded in reversed(started):
            most = max(most, reuses + below)
            below += unfolded
            counted.append((block, done, most))
        counted.reverse()
        # not those tracked meanwhile: one that landed early may have lost its slot (its reader
        # gone) and come up again in a later batch, already tracked (and maybe hit) since
        landed = [(block, reuses) for block, done, reuses in counted
                  if done.result() and block.offset != NO_SLOT and block.flags & SEALED
                  and block not in self._promoting and block not in policy]
        if landed:
            policy.inserted([block for block, _ in landed], [reuses for _, reuses in landed])
        # One that landed early and went back down meanwhile (its reader gone, then evicted to
        # SSD) entered the SSD policy with the DRAM policy's count for it, none: it takes this
        # batch's back, with the hits it has had there since.
        ssd = self._ssd_policy
        for block, _, reuses in counted:
            if block.offset == NO_SLOT and block in ssd and block not in self._promoting:
                since = ssd.pending_hits(block)
                if reuses + since > (ssd.reuses(block) or 0):
                    ssd.inserted([block], [reuses + since])

    def _hit(self, blocks: Sequence[Block]) -> None:
        """Tell the tiers' policies that a lookup hit ``blocks``, a prefix of one namespace's chain.

        O(1) whatever the prefix length: the policies record a hit on the deepest block they track
        (:mod:`kvstored.policy.usage`). A DRAM-resident prefix is closed under ancestors (only
        leaves leave a tier), so the common case is a DRAM run, then an SSD-only run; the SSD
        policy is only asked when the prefix ends off DRAM, so an all-DRAM hit costs it nothing.
        """
        if not blocks:
            return
        # Usually a DRAM run, then an SSD-only run; but a block may come up alone (a peer's
        # checkout) or a chain's head lose its slots first (a stream's _drop_clean_slots), so a
        # prefix may also start on SSD and end in DRAM: the DRAM policy is asked then, and not the
        # SSD policy. Its record on the deepest DRAM block reaches the SSD-only blocks above once
        # they come up (this lookup brings them up) and are tracked above it; recorded on SSD too,
        # the hit came up with them in their reuses and was counted twice when that record did.
        first, last = blocks[0].offset != NO_SLOT, blocks[-1].offset != NO_SLOT
        if first or last:
            self._dram_for(blocks[0]).hit(blocks)
        if not last:
            self._ssd_policy.hit(blocks)
        self._mark_pages(blocks)

    def _mark_pages(self, blocks: Sequence[Block]) -> None:
        """Mark the arena pages of ``blocks`` used now (sampled: a chain's blocks share pages), so
        that pages drift to the slot sizes in use (see :meth:`_reclaim_dram`)."""
        page_bytes, tick, page_tick = self._allocator.page_bytes, self._tick, self._page_tick
        for block in blocks[:: max(1, len(blocks) // 8)]:
            if block.offset != NO_SLOT:
                page_tick[block.offset // page_bytes] = tick

    def _dram_for(self, block: Block) -> BlockPolicy:
        return self._policy_of_size(block.index.slot_bytes)

    def _policy_of_size(self, slot_bytes: int) -> BlockPolicy:
        policy = self._dram_policies.get(slot_bytes)
        if policy is None:
            policy = self._dram_policies[slot_bytes] = make_policy(
                self._config.dram.policy, self._clock, max(self._allocator.capacity // slot_bytes, MIN_GHOST_BLOCKS),
                can_evict=self._dram_can_evict)
        return policy

    def _dram_can_evict(self, block: Block) -> bool:
        """May ``block`` give up its DRAM slot now? Not while pinned, being written out, promoted
        or unsealed; with an SSD copy it just loses the slot, so it may have children in the index
        (the policy still offers only leaves of the DRAM-resident tree); without one it would
        leave the index, which only leaves may."""
        return block.pins == 0 and block.flags & (SEALED | DEMOTING) == SEALED and block not in self._promoting \
            and (block.flags & ON_SSD != 0 or block.children == 0)

    def _ssd_can_evict(self, block: Block) -> bool:
        """May an SSD-only block leave the index now (an evictable leaf not on its way to DRAM)?"""
        return block.evictable and block.offset == NO_SLOT and block not in self._promoting

    def _block_bytes(self, block: Block) -> int:
        return self._namespaces[block.index.namespace_id].spec.block_bytes

    def _pin(self, session: Session, kind: LeaseKind, namespace_id: int, blocks: list[Block],
             ttl_s: float) -> Lease:
        for block in blocks:
            block.pins += 1
        return self._leases.add(session, kind, namespace_id, list(blocks), [], ttl_s)

    def release(self, session_id: str, lease_id: int, reservation_only: bool = False) -> None:
        """End a read lease, or abort a reservation (only a reservation with ``reservation_only``).
        FailedPrecondition when it already expired."""
        session = self._session(session_id)
        lease = self._leases.get(lease_id)
        if lease is None or lease.session_id != session_id \
                or (reservation_only and lease.kind != LeaseKind.RESERVATION):
            kind = self._leases.was_expired(lease_id, session_id,
                                            LeaseKind.RESERVATION if reservation_only else None)
            if kind is LeaseKind.RESERVATION:
                raise LeaseExpired(f"reservation {lease_id} expired before it was released "
                                   f"(ttl {self._config.leases.reservation_ttl_s:g}s); nothing was stored",
                                   Reason.RESERVATION_EXPIRED)
            if kind is LeaseKind.READ:
                raise LeaseExpired(f"lease {lease_id} expired before it was released "
                                   f"(ttl {self._config.leases.ttl_s:g}s); bytes read under it "
                                   "may be stale", Reason.LEASE_EXPIRED)
            raise NotFound(f"unknown lease {lease_id}", Reason.UNKNOWN_LEASE)
        self._end(lease, session, aborted=True)

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, session_id: str, namespace_id: int, keys: KeyRequest,
                block_bytes: int) -> Reservation:
        """Allocate slots for the blocks of ``keys`` not cached yet (a suffix of the chain).

        Fewer slots than asked come back when the tier cannot make room; none when another
        client is writing the next block. Raises InvalidArgument for a wrong payload size.
        """
        session = self._working_session(session_id)
        state, chain = self.resolve_keys(namespace_id, keys)
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes must be positive")
        if state.spec.block_bytes and block_bytes != state.spec.block_bytes:
            raise InvalidArgument(f"namespace {state.spec.model!r} stores blocks of "
                                  f"{state.spec.block_bytes} bytes; got {block_bytes}")
        self._fix_block_bytes(state, block_bytes)
        lease = self._reserve_chain(session, state, chain)
        return Reservation(lease.lease_id, len(lease.pinned), [b.offset for b in lease.new],
                           self._config.leases.reservation_ttl_s)

    def _reserve_chain(self, session: Session, state: NamespaceState, chain: list[bytes]) -> Lease:
        lease = self._reserve_present(session, state, chain)
        blocked = False
        for key in chain[len(lease.pinned):]:
            outcome = self._reserve_next(lease, state, key)
            if outcome != "ok":
                blocked = outcome in ("blocked", "here")
                break
        if not lease.new and len(lease.pinned) < len(chain) and not blocked:
            self._end(lease, session, aborted=True)
            raise ResourceExhausted("DRAM tier full: every block that could make room is leased "
                                    "or being written; retry after releasing leases", Reason.TIER_FULL)
        return lease

    def _reserve_present(self, session: Session, state: NamespaceState, chain: list[bytes]) -> Lease:
        """A reservation pinning the chain's cached prefix, with no slots yet."""
        self._tick += 1
        present = state.index.match(chain)
        lease = self._pin(session, LeaseKind.RESERVATION, state.namespace_id, present,
                          self._config.leases.reservation_ttl_s)
        # Not a hit for the policies: an engine saves a prompt after looking it up, and that lookup
        # counted; counting again would promote every extended prefix a reuse class. Its pages are in use.
        self._mark_pages(present)
        return lease

    def _reserve_next(self, lease: Lease, state: NamespaceState, key: bytes) -> str:
        """Reserve a slot for ``key``, the block after the reservation's last one: "ok", "full"
        (no room can be made), "blocked" (another client is writing it and will seal it) or
        "here" (another client stored it since the reservation's prefix was matched)."""
        tail = lease.new or lease.pinned
        parent = tail[-1] if tail else None
        sb = state.index.slot_bytes
        existing = state.index.get(key)
        if existing is not None:
            if existing.readable:
                return "here"
            if not (existing.sealed and not existing.readable and existing.pins == 0
                    and existing not in self._promoting):
                return "blocked"
            # A hollow block (its bytes were lost): write it again in place. Making room may
            # evict its last child; that must not take the block along (out of the index).
            existing.pins += 1
            try:
                offset = self._alloc(sb)
            finally:
                existing.pins -= 1
            if offset is None:
                self._remove_if_hollow(existing)
                return "full"
            self._bind_slot(existing, offset)
            existing.flags = 0
            existing.check = None
            existing.pins += 1
            lease.new.append(existing)
            return "ok"
        if parent is not None:
            parent.pins += 1   # making room must not evict the block we hang this one under
        try:
            offset = self._alloc(sb)
        finally:
            if parent is not None:
                parent.pins -= 1
        if offset is None:
            return "full"
        lease.new.append(self._bind_slot(state.index.insert(key, parent, NO_SLOT), offset))
        return "ok"

    def _alloc(self, sb: int) -> int | None:
        offset = self._allocator.alloc(sb)
        while offset is None:
            if not self._reclaim_dram(sb):
                return None
            offset = self._allocator.alloc(sb)
        return offset

    def _reclaim_dram(self, sb: int) -> bool:
        """Make room for a slot of ``sb`` bytes: free one slot of this size, the victim of this
        size's policy, or a whole page of another size (see :meth:`_take_page`). A block with an
        SSD copy just loses its slot (and joins the SSD policy); one without leaves the index.

        DRAM admits every block (``admit`` is not asked): a block refused here would never reach
        the SSD tier, usually far larger, through write-back, and an engine's save would store
        less at a time when the arena is merely full of blocks that already have SSD copies.
        The policy's admission guards the SSD tier instead (see :meth:`_write_back`)."""
        self._writeback_wanted.set()
        own = self._dram_policies.get(sb)
        victim = own.victim() if own is not None else None
        if len(self._dram_policies) > (own is not None) and self._take_page(sb, victim):   # other sizes
            return True
        if victim is None:
            return False
        self._evict_slot(victim)
        return True

    def _take_page(self, sb: int, victim: Block | None) -> bool:
        """Make room from another slot size than ``sb``, so that pages drift to the sizes in use,
        when another size's policy victim sits in a page used less recently than the page of
        ``victim`` (this size's own; None: than any). In this order:

        - the least recently used such page whose blocks can all leave now, emptied at once;
        - else another size's page that can, used less recently than ``victim``'s (the policy
          orders blocks, not pages: its victim's page may hold a leased block, another not);
        - else, when the least recently used such page holds no block that must stay (it only
          has blocks whose children sit in other pages), that size's victim alone, as a step
          towards emptying it (chains that cross between pages free none whole).

        False when nothing left: no block leaves for a page that cannot empty."""
        page_bytes, page_tick = self._allocator.page_bytes, self._page_tick
        bound = page_tick[victim.offset // page_bytes] if victim is not None else None
        older: list[tuple[int, Block]] = []   # (page, victim in it) of the other sizes
        for size, policy in self._dram_policies.items():
            if size == sb or not len(policy):
                continue
            other = policy.victim()
            if other is not None:
                page = other.offset // page_bytes
                if bound is None or page_tick[page] < bound:
                    older.append((page, other))
        if not older:
            return False   # as before: no other size's victim is older than this size's own
        older.sort(key=lambda pv: page_tick[pv[0]])
        step: Block | None = None   # a victim whose page may empty once its children's pages do
        for page, other in older:
            held, leavers = self._page_leavers(page)
            if leavers is not None:
                self._empty_page(page, leavers)
                return True
            if not held and step is None:
                step = other
        tried = {page for page, _ in older}
        rest = [page for page, size in self._allocator.pages()
                if size != sb and page not in tried and (bound is None or page_tick[page] < bound)]
        for page in sorted(rest, key=page_tick.__getitem__):
            leavers = self._page_leavers(page)[1]
            if leavers is not None:
                self._empty_page(page, leavers)
                return True
        if step is None:
            return False
        self._evict_slot(step)
        return True

    def _empty_page(self, page: int, leavers: list[Block]) -> None:
        """Evict ``leavers``, every block of ``page`` (see :meth:`_page_leavers`): the page
        returns to the pool."""
        # leaving the index deepest first (a block after its children), then losing slots
        # parent first (the order the SSD policy is told of a run)
        for block in leavers:
            if not block.on_ssd:
                self._evict_slot(block)
        for block in reversed(leavers):
            if block.on_ssd:
                self._evict_slot(block)
        assert not self._page_blocks[page] and self._allocator.used_slots(page) == 0, "page not emptied"

    def _page_leavers(self, page: int) -> tuple[bool, list[Block] | None]:
        """``(held, leavers)`` of ``page``: ``held`` when a slot in it cannot be given up now,
        whatever else leaves; ``leavers``: its blocks, deepest first, when all may give up their
        slots now (else None). As :meth:`_dram_can_evict` asks of a victim: unpinned, sealed, not
        being written out or promoted; a slot held by no block (a peer's block landing) is held.
        A block with an SSD copy only loses its slot; one without leaves the index, so its
        children must too: all in this page and leaving as well (leaf-first within the page)."""
        blocks = self._page_blocks[page]
        used = self._allocator.used_slots(page)
        assert len(blocks) <= used, f"page {page}: {len(blocks)} blocks in {used} used slots"
        if len(blocks) < used:
            return True, None
        promoting = self._promoting
        for block in blocks:   # before sorting: pages of other sizes are scanned while none can empty
            if block.pins or block.flags & (SEALED | DEMOTING) != SEALED or block in promoting:
                return True, None
        order = sorted(blocks, key=lambda b: -b.depth)   # children before their parents
        leaving: dict[Block, int] = {}   # children of a block leaving the index with it
        stuck = False   # a block with a child outside this page or staying in the index
        for block in order:
            if block.flags & ON_SSD:
                continue
            if block.children != leaving.get(block, 0):
                stuck = True
                continue
            parent = block.parent
            if parent is not None and parent in blocks:
                leaving[parent] = leaving.get(parent, 0) + 1
        return False, None if stuck else order

    def _evict_slot(self, block: Block) -> None:
        """Evict ``block`` from DRAM: with an SSD copy it only loses its slot, else it is dropped."""
        if block.on_ssd:
            self._leave_dram_for_ssd(block)
        else:
            self._remove(block)
            self._n.dropped += 1
        self._n.dram_evictions += 1

    def _leave_dram_for_ssd(self, block: Block) -> None:
        """Give up the DRAM slot of ``block`` (sealed, with an SSD copy): it stays on SSD only,
        tracked by the SSD policy with the reuses the DRAM policy had counted for it."""
        reuses = self._dram_for(block).reuses(block)
        self._release_slot(block)
        self._ssd_policy.inserted([block], None if reuses is None else [reuses])

    def _release_slot(self, block: Block, leaving: bool = False) -> None:
        """Give back a block's DRAM slot (its bytes stay wherever else they are); ``leaving``:
        the block leaves the index too."""
        if block.offset == NO_SLOT:
            return
        # to the SSD tier (a move, not an eviction of its bytes), or gone
        self._dram_for(block).removed(block, moved=block.on_ssd and not leaving)
        if block.sealed and not block.on_ssd:
            self._set_clean(block)
        del self._page_blocks[block.offset // self._allocator.page_bytes][block]   # KeyError: never bound
        self._allocator.free(block.offset)
        block.offset = NO_SLOT

    def _bind_slot(self, block: Block, offset: int) -> Block:
        """Give ``block`` (slotless) the slot at ``offset``, just allocated: every slot a block
        holds is bound here and given back by :meth:`_release_slot`, so that each page knows its
        blocks (see :meth:`_page_leavers`)."""
        assert block.offset == NO_SLOT, "a block holds one slot at most"
        block.offset = offset
        self._page_blocks[offset // self._allocator.page_bytes][block] = None
        return block

    def _drop_ssd_copy(self, block: Block, leaving: bool = False) -> None:
        if not block.on_ssd:
            return
        self._ssd_policy.removed(block, moved=block.in_dram and not leaving)   # still in DRAM, or gone
        block.flags &= ~ON_SSD
        self._ssd_blocks -= 1
        self._ssd_used -= self._block_bytes(block)
        if block.in_dram and block.sealed:
            self._set_dirty(block)
        if self._ssd is not None:
            self._ssd.delete(block.index.namespace_id, block.key)

    def _set_dirty(self, block: Block) -> None:
        """``block`` (sealed, in DRAM) has no SSD copy: count it, and queue it for write-back."""
        self._dirty_bytes += block.index.slot_bytes
        self._dirty[block] = None

    def _set_clean(self, block: Block) -> None:
        """``block`` got an SSD copy or lost its slot."""
        self._dirty_bytes -= block.index.slot_bytes
        self._dirty.pop(block, None)

    def _remove(self, block: Block) -> None:
        """Take a leaf out of the index and out of every tier; hollow ancestors follow."""
        self._release_slot(block, leaving=True)
        self._drop_ssd_copy(block, leaving=True)
        block.index.remove(block)
        self._remove_if_hollow(block.parent)

    def _remove_if_hollow(self, block: Block | None) -> None:
        # a block may have gone already: callers walk a prefix deepest first, and a hollow child's
        # removal takes its hollow parent along
        while block is not None and block.sealed and not block.readable and block.children == 0 \
                and block.pins == 0 and block not in self._promoting and block.index.get(block.key) is block:
            parent = block.parent
            block.index.remove(block)
            block = parent

    def seal(self, session_id: str, reservation_id: int) -> int:
        """Make a reservation's written blocks visible; returns how many were sealed."""
        session = self._session(session_id)
        lease = self._leases.get(reservation_id)
        if lease is None or lease.kind != LeaseKind.RESERVATION or lease.session_id != session_id:
            if self._leases.was_expired(reservation_id, session_id, LeaseKind.RESERVATION):
                raise LeaseExpired(f"reservation {reservation_id} expired before it was sealed "
                                   f"(ttl {self._config.leases.reservation_ttl_s:g}s); "
                                   "nothing was stored", Reason.RESERVATION_EXPIRED)
            raise NotFound(f"unknown reservation {reservation_id}", Reason.UNKNOWN_LEASE)
        sealed = len(lease.new)
        self._end(lease, session, aborted=False)
        return sealed

    def reservation_chain(self, session_id: str, reservation_id: int) -> tuple[int, list[bytes]]:
        """The namespace and keys of a live reservation's chain (present blocks, then those being
        written); (0, []) when there is no such reservation."""
        lease = self._leases.get(reservation_id)
        if lease is None or lease.kind != LeaseKind.RESERVATION or lease.session_id != session_id:
            return 0, []
        return lease.namespace_id, [b.key for b in lease.pinned] + [b.key for b in lease.new]

    def _end(self, lease: Lease, session: Session | None, aborted: bool) -> None:
        if lease.lease_id in self._busy:
            self._doomed.add(lease.lease_id)
            return
        self._doomed.discard(lease.lease_id)   # doomed while busy, ended by its request (a cancelled save)
        self._leases.pop(lease, session)
        for block in lease.pinned:
            block.pins -= 1
        # A block whose SSD read failed its checksum while this lease held it is hollow (a request
        # cancelled before it could drop it, say): once nothing holds it, it leaves the index.
        for block in reversed(lease.pinned):
            if not block.readable:
                self._remove_if_hollow(block)
        if lease.kind != LeaseKind.RESERVATION:
            return
        if aborted:
            for block in reversed(lease.new):
                block.pins -= 1
                self._release_slot(block)
                if block.children:
                    block.flags = SEALED  # a hollow block we were rewriting: hollow again
                else:
                    block.index.remove(block)
            first = lease.new[0].parent if lease.new else None
            self._remove_if_hollow(lease.new[0] if lease.new and lease.new[0].children else first)
            return
        for block in lease.new:
            block.pins -= 1
        self._sealed_now(lease.new)
        self._n.saved_blocks += len(lease.new)

    def reap(self) -> int:
        """End leases past their deadline, idle ones only; returns the count."""
        # A busy lease (a copy or a stream in flight) is judged once it is idle: its blocks are
        # pinned meanwhile anyway, and a stream renews the lease it hands over at its end.
        expired = [lease for lease in self._leases.expired() if lease.lease_id not in self._busy]
        for lease in expired:
            self._leases.mark_expired(lease)
            self._end(lease, self._sessions.get(lease.session_id), aborted=True)
        return len(expired)

    # -- the SSD tier: write-back, room, restore --------------------------------------------
    async def writeback_loop(self, interval_s: float = 0.5) -> None:
        """Background task: keep DRAM's blocks without an SSD copy under the watermark."""
        while True:
            try:
                await asyncio.wait_for(self._writeback_wanted.wait(), interval_s)
            except TimeoutError:
                pass
            self._writeback_wanted.clear()
            limit = self._config.dram.writeback_watermark * self._allocator.capacity
            if self._ssd is None or self._clock() < self._ssd_backoff_until or self._dirty_bytes <= limit:
                continue
            try:
                wrote = await self._write_back(self._dirty_bytes - limit, force=False, models=None)
            except Exception:  # a bug here must not stop write-back for good
                log.exception("write-back round failed")
                wrote = 0
            if wrote:
                self._writeback_wanted.set()  # more to do: go again at once
            else:
                # Nothing could go (ssd.admission refused it all, no room): every save and every
                # reclaim asks again, and a round scans every DRAM-only block, so wait a while.
                await asyncio.sleep(interval_s)

    async def _write_back(self, nbytes: float, force: bool, models: set[int] | None,
                          among: Sequence[Block] | None = None) -> int:
        """Copy the DRAM blocks without an SSD copy to SSD, longest without first (a chain's parents
        are sealed, hence queued, before their children), up to ``nbytes``; with ``among``, only
        those of these blocks (in their order, parents first) and the parents they hang under.

        Without ``force``, ``ssd.admission`` and the SSD policy's ``admit`` (asked when the block
        would need an eviction) may pass a block over: it stays in DRAM without a copy.
        """
        if self._ssd is None:
            return 0
        chosen: list[Block] = []
        picked: set[Block] = set()
        too_big: set[Block] = set()
        held_above: dict[Block, int] = {}   # _ssd_bytes_above's memo for this round
        total = 0
        cfg = self._config.ssd
        # One round writes at most the gap between the watermarks, so room can always be made.
        batch_cap = min(256 << 20, max(1, (cfg.high_watermark - cfg.low_watermark) * cfg.capacity))
        room = cfg.high_watermark * cfg.capacity
        for block in self._dirty if among is None else among:  # not changed before the awaits below
            if total >= nbytes or total >= batch_cap:
                break
            if block.flags & (SEALED | ON_SSD | DEMOTING) != SEALED or block in self._promoting \
                    or block in picked:
                continue
            if models is not None and block.index.namespace_id not in models:
                continue
            size = self._block_bytes(block)
            if not force and not (
                    admit(cfg.admission, block.depth, bool(block.flags & HIT),
                          self._namespaces[block.index.namespace_id].spec)
                    and self._ssd_policy.admit(block.key, self._ssd_used + total + size > room)):
                continue
            # A block is of use on SSD only under its parents: those passed over earlier (refused)
            # go down with it. Left in DRAM without a copy, they could never leave it while it is
            # in the index (only leaves leave), nor be rebuilt at restart.
            run = [block]
            parent = block.parent
            while parent is not None and parent.flags & (SEALED | ON_SSD | DEMOTING) == SEALED \
                    and parent.in_dram and parent not in picked and parent not in self._promoting \
                    and parent not in too_big:
                run.append(parent)
                parent = parent.parent
            if parent in too_big or size * len(run) + self._ssd_bytes_above(parent, held_above) > room:
                # could never fit under the high watermark (beside its ancestors on SSD, which
                # cannot leave it while the run hangs under them): leave the chain in DRAM, whole
                # (its blocks stay evictable leaves first), rather than fail the round after
                # _make_ssd_room emptied the tier trying
                too_big.update(run)
                continue
            if chosen and total + size * len(run) > batch_cap:
                break   # this run goes first in a round of its own
            for b in reversed(run):
                chosen.append(b)
                picked.add(b)
            total += size * len(run)
        if not chosen:
            return 0
        if not self._make_ssd_room(total):
            # SSD bytes that cannot leave (ancestors of this round's other runs, of blocks left in
            # DRAM, pinned ones) were more than the runs were weighed against. What could leave
            # has left: write the part of the round that fits now rather than nothing. Any prefix
            # of ``chosen`` holds each block's parent before it (runs go parent first, under
            # blocks on SSD or picked before them).
            free = room - self._ssd_used
            keep = 0
            for block in chosen:
                free -= self._block_bytes(block)
                if free < 0:
                    break
                keep += 1
            if not keep:
                return 0
            del chosen[keep:]
        for namespace_id in {block.index.namespace_id for block in chosen}:
            state = self._namespaces.get(namespace_id)
            if state is not None and not state.on_ssd:
                # its record failed to reach the disk: blocks without one are dropped at restart
                self._persist_namespace(state)
        futures = []
        for block in chosen:
            block.flags |= DEMOTING
            block.pins += 1
            parent_key = block.parent.key if block.parent is not None else b""
            futures.append(asyncio.wrap_future(self._ssd.put(
                block.index.namespace_id, block.key, parent_key, block.depth,
                self._arena.view(block.offset, self._block_bytes(block)), block.check)))
            self._ssd_used += self._block_bytes(block)  # reserved now; returned on failure
        # A task of its own: a cancelled caller (a flush past its deadline) must not leave the
        # blocks DEMOTING and pinned, nor their bytes reserved on SSD.
        return await asyncio.shield(self._spawn(self._demoted(chosen, futures)))

    def _ssd_bytes_above(self, block: Block | None, memo: dict[Block, int]) -> int:
        """The SSD bytes of ``block`` and its ancestors (written or being written): none of them
        can leave the tier while a chain hangs under them."""
        path: list[Block] = []
        while block is not None and block not in memo:
            path.append(block)
            block = block.parent
        acc = memo[block] if block is not None else 0
        for b in reversed(path):
            if b.flags & (ON_SSD | DEMOTING):
                acc += self._block_bytes(b)
            memo[b] = acc
        return acc

    async def _demoted(self, chosen: list[Block], futures: list[asyncio.Future[int]]) -> int:
        results = await asyncio.gather(*futures, return_exceptions=True)
        written = 0
        for block, result in zip(chosen, results):
            block.flags &= ~DEMOTING
            block.pins -= 1
            if isinstance(result, BaseException):
                self._ssd_used -= self._block_bytes(block)
                self._n.ssd_write_errors += 1
                if isinstance(result, MapFull):
                    self._make_ssd_room(self._config.ssd.capacity * 0.05)
                elif isinstance(result, SSDError):
                    self._ssd_backoff_until = self._clock() + 1.0
                continue
            block.flags |= ON_SSD
            self._ssd_blocks += 1
            block.check = result   # the bytes it has in DRAM too (pinned meanwhile): a peer gets it unhashed
            if block.in_dram:
                self._set_clean(block)
            written += 1
        self._n.demotions += written
        return written

    def _make_ssd_room(self, nbytes: float, progress: Progress | None = None) -> bool:
        """Evict SSD-only leaves (the SSD policy's victims) so ``nbytes`` more fit under the high
        watermark; ``progress(what, evicted, 0)`` is called every PROGRESS_EVERY evictions."""
        cfg = self._config.ssd
        if self._ssd_used + nbytes <= cfg.high_watermark * cfg.capacity:
            return True
        target = max(0.0, min(cfg.low_watermark * cfg.capacity, cfg.high_watermark * cfg.capacity - nbytes))
        evicted = 0
        while self._ssd_used > target:
            victim = self._ssd_policy.victim()
            if victim is None:
                break
            self._remove(victim)  # untracks it: the next victim is another block
            self._n.ssd_evictions += 1
            self._n.dropped += 1   # SSD-only: its last copy
            evicted += 1
            if progress is not None and evicted % PROGRESS_EVERY == 0:
                progress("restoring blocks from SSD: evicting to fit ssd.capacity", evicted, 0)
        return self._ssd_used + nbytes <= cfg.high_watermark * cfg.capacity

    def restore(self, progress: Progress | None = None) -> RestoreReport:
        """Rebuild namespaces and the index from the SSD tier (at start, before serving);
        ``progress(what, done, total)`` is called every PROGRESS_EVERY records.

        Records that do not decode, whose namespace is unknown (or one this config refuses:
        blocks larger than ``dram.page_bytes``, a fast hash not allowed), whose parent is missing
        or whose length is wrong are deleted from disk and counted; payload checksums are
        verified when a block is read, so a corrupt payload is still never served.
        """
        if self._ssd is None:
            return RestoreReport(0, 0, 0)
        for namespace_id, raw in self._ssd.namespaces().items():
            try:
                spec = Namespace(**json.loads(raw))
            except (TypeError, ValueError):
                continue
            why = self._refusal_of(spec)
            if why:
                # the config changed since (dram.page_bytes lowered, keys.allow_fast_hash turned
                # off): a client could not open it now, so its blocks go as those of a namespace
                # restore does not know
                log.warning("not restoring namespace of model %r: %s", spec.model, why)
                continue
            if spec.identity() == namespace_id and namespace_id not in self._namespaces:
                self._add_namespace(namespace_id, spec)
        records: list[BlockRecord] = []
        dropped = 0
        for n, item in enumerate(self._ssd.scan(), 1):
            if progress is not None and n % PROGRESS_EVERY == 0:
                progress("restoring blocks from SSD: reading records", n, 0)
            if isinstance(item, BlockRecord):
                records.append(item)
            else:
                self._ssd.delete_raw(item[0])
                dropped += 1
        restored: list[Block] = []
        for n, rec in enumerate(sorted(records, key=lambda r: r.depth), 1):
            if progress is not None and n % PROGRESS_EVERY == 0:
                progress("restoring blocks from SSD: indexing", n, len(records))
            state = self._namespaces.get(rec.namespace_id)
            parent = state.index.get(rec.parent) if state is not None and rec.depth else None
            if state is None or rec.length != state.spec.block_bytes or (rec.depth and parent is None) \
                    or state.index.get(rec.key) is not None:
                self._ssd.delete(rec.namespace_id, rec.key)
                dropped += 1
                continue
            block = state.index.insert(rec.key, parent, NO_SLOT)
            block.flags = SEALED | ON_SSD
            block.pins = 0
            self._ssd_blocks += 1
            self._ssd_used += rec.length
            restored.append(block)
        self._ssd_policy.inserted(restored)  # parents first, as the policies expect
        self._n.dropped += dropped
        before = self._n.ssd_evictions
        # The capacity may have been lowered since: back under it now (a minute for a million
        # blocks here, told as the other steps are, or systemd takes the start for hung)
        self._make_ssd_room(0, progress)
        evicted = self._n.ssd_evictions - before
        return RestoreReport(len(self._namespaces), len(restored) - evicted, dropped, evicted)

    # -- administration ---------------------------------------------------------------------
    def _namespace_ids(self, model: str) -> set[int]:
        """The namespaces of ``model`` (all when empty); NotFound for a model this node has never
        seen, so a mistyped name is an error rather than a silent no-op."""
        ids = {ns_id for ns_id, s in self._namespaces.items() if not model or s.spec.model == model}
        if model and not ids:
            known = sorted({s.spec.model for s in self._namespaces.values()})
            raise NotFound(f"no namespace of model {model!r} on this node (models here: "
                           f"{', '.join(map(repr, known)) or 'none'})", Reason.UNKNOWN_MODEL)
        return ids

    def evict(self, model: str = "", tier: Tier | None = None) -> int:
        """Drop cached blocks of the namespaces of ``model`` (all when empty) from ``tier`` (all
        when None); pinned blocks stay, and so does the SSD copy of a block with a child that
        keeps one. Returns how many blocks lost a copy or left the index. FailedPrecondition for
        the SSD tier of a store without one (as :meth:`flushing`); NotFound for a model never seen."""
        if tier is Tier.SSD and self._ssd is None:
            raise FailedPrecondition("the SSD tier is disabled (ssd.enabled = false)", Reason.SSD_DISABLED)
        ids = self._namespace_ids(model)
        blocks = sorted((b for ns_id in ids for b in self._namespaces[ns_id].index), key=lambda b: -b.depth)
        count = 0
        # Blocks with a child that keeps an SSD copy (or is being written to SSD): theirs stays,
        # or a restart would drop the child, its record hanging under no parent record.
        under_ssd: set[Block] = set()
        for block in blocks:
            if block.index.get(block.key) is not block:
                continue   # left with a child removed before it (a hollow parent goes with its last child)
            if block.pins or block.flags & (SEALED | DEMOTING) != SEALED or block in self._promoting:
                pass
            elif tier is Tier.DRAM and block.in_dram:
                if block.on_ssd:
                    self._leave_dram_for_ssd(block)
                    count += 1
                elif block.children == 0:
                    self._remove(block)
                    count += 1
            elif tier is Tier.SSD and block.on_ssd:
                if block.in_dram and block not in under_ssd:
                    self._drop_ssd_copy(block)
                    count += 1
                elif block.children == 0:
                    self._remove(block)
                    count += 1
            elif tier is None and block.children == 0:
                self._remove(block)
                count += 1
            if block.flags & (ON_SSD | DEMOTING) and block.parent is not None \
                    and block.index.get(block.key) is block:
                under_ssd.add(block.parent)
        return count

    async def evict_committed(self, model: str = "", tier: Tier | None = None) -> int:
        """:meth:`evict`, returning once the SSD deletes it made are committed: a crash right
        after ``kvctl evict`` no longer brings the evicted blocks back at restart. A delete whose
        commit failed (counted in the SSD write errors) is made by the writer's next commit; the
        blocks are out of the index either way, so that is logged, not raised."""
        count = self.evict(model, tier)
        # evicting DRAM deletes nothing on SSD: no waiting behind a write-back in progress
        if self._ssd is not None and tier is not Tier.DRAM:
            try:
                await asyncio.wrap_future(self._ssd.barrier())
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

    async def flushing(self, model: str = "") -> AsyncGenerator[FlushProgress, None]:
        """Write every DRAM block of ``model`` (all when empty) without an SSD copy to SSD now,
        yielding progress before the first write round, after each (at most 256 MiB), and, done,
        at the end. ResourceExhausted, saying how many were written and how many were not, when
        some could not be (the tier is full of blocks that cannot leave, or writes failed): those
        blocks would not survive a restart. FailedPrecondition without an SSD tier; NotFound for
        a model never seen."""
        if self._ssd is None:
            raise FailedPrecondition("the SSD tier is disabled (ssd.enabled = false)", Reason.SSD_DISABLED)
        ids = self._namespace_ids(model)
        total = 0
        yield FlushProgress(0, self._dram_only(ids))
        for _ in range(_FLUSH_ROUNDS):
            written = await self._write_back(float("inf"), force=True, models=ids)
            total += written
            if written:
                yield FlushProgress(total, self._dram_only(ids))
                continue
            # Blocks another write-back is writing now are skipped above: wait for them to land
            # (or fail) rather than count them as left.
            if not any(b.flags & DEMOTING for ns_id in ids for b in self._namespaces[ns_id].index):
                break
            await asyncio.sleep(0.01)
        left = sum(1 for ns_id in ids for b in self._namespaces[ns_id].index
                   if b.sealed and b.in_dram and not b.on_ssd)
        if left:
            raise ResourceExhausted(f"wrote {total} block(s) to SSD, but {left} block(s) are still only in DRAM "
                                    f"(SSD tier of {self._config.ssd.capacity >> 20} MiB full, or write errors: "
                                    "see kvctl stats)")
        yield FlushProgress(total, 0, done=True)

    def _dram_only(self, ids: set[int]) -> int:
        """Sealed blocks of these namespaces in DRAM without an SSD copy (the write-back queue)."""
        return sum(1 for b in self._dirty if b.index.namespace_id in ids and b.sealed and b.in_dram and not b.on_ssd)

    # -- registered engine buffers ----------------------------------------------------------
    def register_buffers(self, session_id: str, namespace_id: int,
                         sources: Sequence[TensorSource]) -> RegisteredBuffers:
        """Map an engine's KV tensors; their block layout must match the namespace's."""
        session = self._working_session(session_id)
        state = self._namespace(namespace_id)
        buffers = RegisteredBuffers(self._next_buffers_id, self._config.dram.shm_dir, sources)
        try:
            if state.spec.layout and state.spec.layout != buffers.signature:
                raise InvalidArgument(f"buffers have layout {buffers.signature!r} but namespace "
                                      f"{state.spec.model!r} is {state.spec.layout!r}")
            self._fix_block_bytes(state, buffers.block_bytes)
        except BaseException:
            buffers.close()
            raise
        self._next_buffers_id += 1
        self._buffers[buffers.buffers_id] = (session_id, namespace_id, buffers)
        session.buffers.add(buffers.buffers_id)
        return buffers

    async def unregister_buffers(self, session_id: str, buffers_id: int) -> None:
        """Stop using an engine's buffers. Returns once no copy touches them and they are unmapped
        (CUDA handles closed): only then may the engine free the memory."""
        session = self._session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id)
        session.buffers.discard(buffers_id)
        del self._buffers[buffers_id]
        # A task of its own: a caller that goes away meanwhile (a request may hold the buffers
        # for a whole peer transfer) must not leave them mapped with nobody left to close them.
        await asyncio.shield(self._spawn(self._close_when_idle(buffers)))

    def _drop_buffers(self, buffers_id: int) -> None:
        entry = self._buffers.pop(buffers_id, None)
        if entry is not None:
            if entry[2].busy:
                self._spawn(self._close_when_idle(entry[2]))
            else:
                entry[2].close()

    async def _close_when_idle(self, buffers: RegisteredBuffers) -> None:
        while buffers.busy:
            await asyncio.sleep(0.001)
        buffers.close()

    def _owned_buffers(self, session_id: str, buffers_id: int, namespace_id: int | None = None
                       ) -> RegisteredBuffers:
        entry = self._buffers.get(buffers_id)
        if entry is None or entry[0] != session_id:
            raise NotFound(f"unknown buffers {buffers_id} for this session", Reason.UNKNOWN_BUFFERS)
        if namespace_id is not None and entry[1] != namespace_id:
            raise InvalidArgument(f"buffers {buffers_id} were registered for another namespace")
        return entry[2]

    def _check_block_ids(self, buffers: RegisteredBuffers, chain: Sequence[bytes],
                         block_ids: BlockIds, distinct: bool = True) -> None:
        """One id per block, each a block of ``buffers``, and (``distinct``) no id twice."""
        if len(block_ids) != len(chain):
            raise InvalidArgument(f"{len(block_ids)} block ids for {len(chain)} blocks")
        ids = np.asarray(block_ids)   # as the servicer passes them: no Python step per id
        if ids.size and (ids.min() < 0 or ids.max() >= buffers.num_blocks):
            i = next(i for i, b in enumerate(block_ids) if not 0 <= b < buffers.num_blocks)
            raise InvalidArgument(f"block_ids[{i}] = {block_ids[i]} out of range (buffers hold "
                                  f"{buffers.num_blocks} blocks)")
        if distinct:
            _check_distinct(ids)

    async def save_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: BlockIds) -> tuple[int, int]:
        """Copy the not-yet-cached blocks of a chain from engine buffers into the store.

        Returns (already present, newly stored); stored may fall short when the tier is full.
        """
        session = self._working_session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id, namespace_id)
        state, chain = self.resolve_keys(namespace_id, keys)
        # The ids of blocks cached already are not used: an engine that no longer holds them may
        # name them all by one placeholder (vLLM's null block, say); those copied must differ.
        self._check_block_ids(buffers, chain, block_ids, distinct=False)
        lease = self._reserve_chain(session, state, chain)
        present = len(lease.pinned)
        try:
            copied = np.asarray(block_ids[present: present + len(lease.new)])
            _check_distinct(copied, first=present)
            if present and copied.size:
                # a placeholder naming the cached prefix must never be copied: if the daemon lost
                # part of that prefix meanwhile, the placeholder's bytes would be stored as a block
                shared = np.intersect1d(copied, np.asarray(block_ids[:present]))
                if shared.size:
                    i = present + int(np.flatnonzero(copied == shared[0])[0])
                    raise InvalidArgument(f"block_ids[{i}] = {int(shared[0])} also names a cached block "
                                          f"(a placeholder?), but block {i} is not cached here any more "
                                          "and would be copied from it; save again with its real id")
            await self._copying(lease, self._copy.to_arena(buffers, copied, [b.offset for b in lease.new]))
        except BaseException:
            self._end(lease, self._sessions.get(session_id), aborted=True)
            raise
        if lease.lease_id in self._doomed or self._leases.get(lease.lease_id) is None:
            self._finish_doomed(lease)
            raise LeaseExpired("session closed or reservation expired during the copy; "
                               "nothing was stored", Reason.RESERVATION_EXPIRED)
        stored = len(lease.new)
        self._end(lease, session, aborted=False)
        return present, stored

    async def load_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: BlockIds,
                          started: Callable[[list[Tier]], None] | None = None,
                          tensor_done: Callable[[int], None] | None = None,
                          copy_until: float | None = None) -> list[Tier]:
        """Copy the longest cached prefix of a chain into engine buffers; returns its tiers.

        ``started`` learns the tiers of the blocks about to be copied, ``tensor_done(i)`` when
        registered tensor ``i`` (a layer) is in place for all of them. ``copy_until``: the event
        loop's time (the caller's deadline) after which no layer's copy starts (DeadlineExceeded;
        see ``CopyEngine.from_arena``).
        """
        session = self._working_session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id, namespace_id)
        state, chain = self.resolve_keys(namespace_id, keys)
        self._check_block_ids(buffers, chain, block_ids)
        with buffers.in_use():   # unregistering waits for the lookup too, not only the copy
            # Blocks coming up from SSD are copied out as they land, while later ones are still
            # read; each is pinned by the handover until its copy is done.
            early = _EarlyCopy(self._copy, buffers, block_ids, copy_until)
            try:
                result = await self._lookup_chain(state, chain, session, early.prefix_up)
                if started is not None:
                    started(result.tiers)
                if not result.blocks:
                    # its lease ended during the SSD reads: blocks copied before that are not
                    # reported, and no layer is reported done while such a copy still runs
                    await early.close()
                    if tensor_done is not None:
                        for i in range(len(buffers.tensors)):
                            tensor_done(i)
                    return []
                lease = self._leases.get(result.lease_id)
                assert lease is not None, "a fresh lease vanished"
                try:
                    await self._copying(lease, early.finish(result.offsets, tensor_done))
                finally:
                    doomed = lease.lease_id in self._doomed
                    self._finish_doomed(lease)
                    if not doomed and self._leases.get(lease.lease_id) is not None:
                        self._end(lease, session, aborted=True)
                return result.tiers
            finally:
                await early.close()

    async def _copying(self, lease: Lease, copy: object) -> None:
        self._busy.add(lease.lease_id)
        try:
            await copy  # type: ignore[misc]
        finally:
            self._busy.discard(lease.lease_id)

    def _end_busy(self, lease: Lease, session: Session, keep: bool = False) -> None:
        """The request that kept ``lease`` busy is over: end it if it was doomed meanwhile (or is
        gone), else abort it unless ``keep`` (a lease handed to the caller) and its session is
        still open."""
        self._busy.discard(lease.lease_id)
        if lease.lease_id in self._doomed or self._leases.get(lease.lease_id) is None:
            self._finish_doomed(lease)
        elif not keep or session.session_id not in self._sessions:
            # A lease taken after the session ended (a stream's, while its lookup awaited SSD
            # reads) was never doomed: kept, nobody could release it until the reaper came.
            self._end(lease, session if session.session_id in self._sessions else None, aborted=True)

    def _finish_doomed(self, lease: Lease) -> None:
        if lease.lease_id in self._doomed:
            self._doomed.discard(lease.lease_id)
            if self._leases.get(lease.lease_id) is not None:
                self._end(lease, self._sessions.get(lease.session_id), aborted=True)

    # -- peers: blocks in and out by key ----------------------------------------------------
    def namespace_description(self, namespace_id: int) -> bytes:
        """The namespace's spec as a peer learns it (JSON); NotFound for an unknown one."""
        return json.dumps(dataclasses.asdict(self._namespace(namespace_id).spec), sort_keys=True).encode()

    def learn_namespace(self, namespace_id: int, description: bytes) -> str:
        """Open the namespace a peer described before pushing blocks of it; "" or why not."""
        try:
            spec = Namespace(**json.loads(description))
            spec.validate()   # here, where a field of the wrong type (a TypeError) is the peer's fault
        except (TypeError, ValueError) as exc:
            return f"not a namespace description: {exc}"
        if spec.identity() != namespace_id:
            return f"namespace id {namespace_id} does not match its description"
        try:
            self.open_namespace(spec)
        except KVStoreError as exc:
            return str(exc)
        return ""

    def namespace_chains(self, model: str = "") -> list[tuple[int, bytes, list[bytes]]]:
        """Every readable block of ``model``'s namespaces (all when empty) as parent-first runs
        ``(namespace_id, parent key, keys)``: pushing them in this order never sends a block
        before its parent."""
        return [(ns_id, parent, run) for ns_id in sorted(self._namespace_ids(model))
                for parent, run in self._namespaces[ns_id].index.chains()]

    def forget(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        """Drop these blocks from every tier (a drained node's copies), deepest first; pinned
        blocks and blocks with children outside ``keys`` stay. Returns how many left."""
        state = self._namespaces.get(namespace_id)
        if state is None:
            return 0
        dropped = 0
        for key in reversed(keys):
            block = state.index.get(key)
            if block is not None and block.evictable and block not in self._promoting:
                self._remove(block)
                dropped += 1
        return dropped

    def held(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` this node holds in any tier (unknown namespace: 0)."""
        state = self._namespaces.get(namespace_id)
        return len(state.index.match(keys)) if state is not None else 0

    def serve(self, namespace_id: int, key: bytes) -> Served | Awaitable[Served]:
        """:meth:`checkout` for a peer fetching the block: the result itself when the block is in
        DRAM (no task per block on the peer channel's send path), else checkout's awaitable."""
        state = self._namespaces.get(namespace_id)
        block = state.index.get(key) if state is not None else None
        if block is None or not block.readable:
            return None
        if block.in_dram and block not in self._promoting:
            block.pins += 1
            self._tick += 1   # as _ensure_dram counts a request that reads DRAM
            return self._checked_out(block, self._arena.view(block.offset, self._block_bytes(block)).data, True)
        return self.checkout(namespace_id, key)

    async def checkout(self, namespace_id: int, key: bytes, *, served: bool = True) -> Served:
        """Pin a block for a peer to read, bringing it to DRAM first (or, when DRAM has no slot for
        it, reading its SSD copy into a buffer of its own); its bytes and their xxh3-64
        checksum (computed once per block: a hot prefix served to many peers is hashed once), or
        None when this node does not hold it (or its SSD copy failed its checksum). Each view
        needs one :meth:`checkin`. ``served`` False: this node pushes the block (not a peer
        fetching it): neither a hit nor a served block, and the checksum only if known (a push
        checks out a chunk of blocks before sending any: the sender hashes each as it goes,
        while the receiver takes the one before)."""
        state = self._namespaces.get(namespace_id)
        block = state.index.get(key) if state is not None else None
        if block is None or not block.readable:
            return None
        block.pins += 1
        try:
            if await self._ensure_dram([block]) == 1:
                view: memoryview | None = self._arena.view(block.offset, self._block_bytes(block)).data
            else:
                view = await self._read_unslotted(block)
        except BaseException:   # cancelled while it was being read (the peer gave up): no pin left behind
            block.pins -= 1
            # a read that already failed its checksum kept the block for our pin: a hollow leaf goes
            self._remove_if_hollow(block)
            raise
        if view is None:
            block.pins -= 1
            self._remove_if_hollow(block)
            return None
        return self._checked_out(block, view, served)

    def _checked_out(self, block: Block, view: memoryview, served: bool) -> Served:
        """A pinned block's bytes go to a peer: counted (when ``served``) and hashed once."""
        if served:
            self._hit([block])
            self._n.peer_served += 1
        if block.check is None and served:
            block.check = xxhash.xxh3_64_intdigest(view)
        return view, block.check

    async def _read_unslotted(self, block: Block) -> memoryview | None:
        """A (pinned) block that only SSD holds, read into a buffer of its own: DRAM had no slot
        for it (every slot pinned, or being written). Without this a peer was told "missing" for a
        block this node's lookup reports, and its pull or stream ended there. None when the block
        is not such a block, or the read failed (a corrupt copy is dropped, as on promotion).
        The buffer lives as long as the view the caller holds."""
        if self._ssd is None or not block.readable or block.in_dram or not block.on_ssd:
            return None
        # page aligned (mmap), so that the SSD tier reads it with O_DIRECT as it reads into the arena
        dst = np.frombuffer(mmap.mmap(-1, self._block_bytes(block)), dtype=np.uint8)
        try:
            read = self._ssd.read_into(block.index.namespace_id, block.key, dst)
            block.check = await asyncio.wrap_future(read)
        except Exception as exc:
            self._ssd_read_failed(block, exc)
            return None
        return dst.data

    def checkin(self, namespace_id: int, key: bytes) -> None:
        """A peer is done reading a block :meth:`checkout` returned."""
        block = self._namespaces[namespace_id].index.get(key)
        assert block is not None and block.pins > 0, "checkin of a block that is not checked out"
        block.pins -= 1

    def checkin_unsent(self, namespace_id: int, key: bytes) -> None:
        """:meth:`checkin` of a block :meth:`serve` (or checkout, ``served``) returned that never
        reached the peer whole (checked out ahead, then the transfer ended; or cut while it was
        written): it is not counted as served after all."""
        self.checkin(namespace_id, key)
        self._n.peer_served -= 1

    def adopt(self, namespace_id: int, parent: bytes, key: bytes, payload: memoryview) -> bool:
        """Store a block a peer pushed (checksum already verified) under ``parent`` (b"" = the
        chain's root). True when it is stored now or was already; False, storing nothing, when the
        namespace is unknown, the size is wrong, the parent is missing or DRAM has no room."""
        state = self._namespaces.get(namespace_id)
        if state is None or payload.nbytes != state.spec.block_bytes or not state.index.slot_bytes:
            return False
        existing = state.index.get(key)
        if existing is not None:
            return existing.readable or (existing.sealed and not existing.pins and self._refill(existing, payload))
        landing = self.land(namespace_id, parent, key, payload.nbytes)
        if landing is None:
            return False
        landing.view[:] = payload
        return landing.commit()

    def refusal(self, namespace_id: int, parent: bytes, length: int) -> str:
        """Why :meth:`adopt` would refuse a pushed block of ``length`` bytes under ``parent``
        (for the pusher's error message; changes nothing)."""
        state = self._namespaces.get(namespace_id)
        if state is None:
            return "the namespace is unknown here"
        if length != state.spec.block_bytes:
            return f"blocks of this namespace have {state.spec.block_bytes} bytes here, not {length}"
        above = state.index.get(parent) if parent else None
        if parent and (above is None or not above.sealed):
            return "the block before it is not held here"
        return ("the DRAM tier is full: every block that could make room is leased, being written, or "
                "holds up a chain")

    def land(self, namespace_id: int, parent: bytes, key: bytes, length: int) -> PeerLanding | None:
        """A DRAM slot for a pushed block to be received straight into (no copy after it lands),
        or None when this is not the plain case (unknown namespace, wrong size, key already
        indexed, parent missing, no room): the caller then receives into a buffer of its own and
        offers it to :meth:`adopt`, which decides. The parent stays pinned until the landing is
        committed or aborted; exactly one of the two must follow."""
        state = self._namespaces.get(namespace_id)
        if state is None or length != state.spec.block_bytes or not state.index.slot_bytes \
                or state.index.get(key) is not None:
            return None
        above = state.index.get(parent) if parent else None
        if parent and (above is None or not above.sealed):
            return None
        if above is not None:
            above.pins += 1   # making room (now or while the bytes arrive) must not evict the parent
        offset: int | None = None
        try:
            self._tick += 1
            offset = self._alloc(state.index.slot_bytes)
        finally:
            if offset is None and above is not None:
                above.pins -= 1
                self._remove_if_hollow(above)
        if offset is None:
            return None
        return PeerLanding(self, state, above, key, offset, self._arena.view(offset, length).data)

    def _landed(self, landing: PeerLanding, verified: bool, checksum: int | None = None) -> bool:
        """Finish a landing: ``verified``, the block joins the index, sealed (keeping ``checksum``);
        otherwise, or when the chain changed meanwhile, its slot is freed."""
        state, above = landing.state, landing.parent
        if above is not None:
            above.pins -= 1
        # While the bytes arrived, a reservation or another push may have indexed the key (the
        # push then counts it held if its bytes are readable), or the parent may have gone.
        if verified and state.index.get(landing.key) is None \
                and (above is None or state.index.get(above.key) is above):
            block = self._bind_slot(state.index.insert(landing.key, above, NO_SLOT), landing.offset)
            block.pins = 0
            block.check = checksum
            self._sealed_now([block])
            self._n.peer_received += 1
            return True
        self._allocator.free(landing.offset)
        if above is not None:
            self._remove_if_hollow(above)   # a hollow parent kept only for children it no longer has
        existing = state.index.get(landing.key)
        return verified and existing is not None and existing.readable

    def _refill(self, block: Block, payload: memoryview) -> bool:
        """Give a hollow block (its bytes were lost, its children kept) the bytes a peer sent."""
        if block in self._promoting:
            return False
        block.pins += 1   # making room may evict its last child; that must not take the block along
        try:
            offset = self._alloc(block.index.slot_bytes)
        finally:
            block.pins -= 1
        if offset is None:
            self._remove_if_hollow(block)
            return False
        self._arena.view(offset, payload.nbytes)[:] = payload
        self._bind_slot(block, offset)
        block.flags = 0
        block.check = None
        self._sealed_now([block])
        self._n.peer_received += 1
        return True

    def _drop_clean_slots(self, blocks: Sequence[Block], most: int) -> int:
        """Free the DRAM slots of up to ``most`` of ``blocks`` (in order) that have an SSD copy and
        nothing holding them; their bytes stay on SSD. Returns how many were freed."""
        freed = 0
        for block in blocks:
            if freed == most:
                break
            if block.in_dram and block.on_ssd and not block.pins and not block.flags & DEMOTING \
                    and block not in self._promoting:
                self._leave_dram_for_ssd(block)
                self._n.dram_evictions += 1
                freed += 1
        return freed

    def _sealed_now(self, blocks: list[Block]) -> None:
        """Blocks of one chain whose bytes just landed in their DRAM slots become visible."""
        if not blocks:
            return
        for block in blocks:
            block.flags |= SEALED
            self._set_dirty(block)
        self._dram_for(blocks[0]).inserted(blocks)  # one chain: one namespace, one slot size
        self._mark_pages(blocks)
        if self._dirty_bytes > self._config.dram.writeback_watermark * self._allocator.capacity:
            self._writeback_wanted.set()

    async def stream_blocks(self, session_id: str, namespace_id: int, keys: KeyRequest, buffers_id: int,
                            block_ids: BlockIds, emit: Callable[[Arrival], None] | None,
                            fetcher: Fetcher | None, on_lease: Callable[[int], None] | None = None,
                            copy_until: float | None = None) -> StreamEnd:
        """Hand a chain's blocks over one by one, in order, as each is in place: the cached prefix
        first, then (with ``fetcher``) the rest as a peer sends it, each block stored here and
        made visible the moment its checksum passed.

        With ``buffers_id`` each block is copied into ``block_ids[i]`` of those buffers before
        ``emit``; without, it is leased in the arena and the end names the lease (the caller
        releases it; ``on_lease`` learns that lease's id before the first ``emit``, for a caller
        that may stop listening before the end). With ``emit`` None (a pull) nothing is handed over: the blocks are only
        brought here, and nothing stays leased. A transfer that stops short keeps the complete
        blocks and drops the partial one; the end says why it stopped ("lease_ended": an arena
        reader released the lease on the local prefix while it came up from SSD; no peer is asked
        for blocks cached here). FailedPrecondition when the session closed while the local prefix
        came up (no peer is asked for the rest: nobody is left to take it). Raises the usual errors for
        bad input; with ``copy_until`` (the event loop's time: the caller's deadline),
        DeadlineExceeded when a copy into the engine's buffers would start after it (none does:
        the engine, told of the deadline, may be reusing those blocks).
        """
        session = self._working_session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id, namespace_id) if buffers_id else None
        state, chain = self.resolve_keys(namespace_id, keys)
        if buffers is not None:
            self._check_block_ids(buffers, chain, block_ids)
        elif len(block_ids):
            # (they were ignored: the blocks went to the arena, none to the engine's buffers)
            raise InvalidArgument("block_ids name blocks of engine buffers: give buffers_id too, or no "
                                  "block_ids for a stream through the arena")
        ttl = self._config.leases.ttl_s
        with buffers.in_use() if buffers is not None else contextlib.nullcontext():
            pull = emit is None
            if emit is None:
                emit = _ignore_arrival
                buffers = None
            handover = Handover(emit, self._copy, buffers, block_ids, copy_until) if buffers is not None \
                else Handover(emit)
            given = 0   # blocks of the local prefix handed over while the rest came up from SSD

            def prefix_up(hits: list[Block], tiers: list[Tier], k: int) -> None:
                nonlocal given
                handover.give(given, hits[given:k], tiers[given:k])
                given = k
            taken: list[int] = []   # the lookup's lease, busy from the start

            def lease_taken(lease_id: int) -> None:
                # Its first blocks go out while later ones still come up: an arena reader uses their
                # slots under this lease, which must not be reaped meanwhile (as a busy one is not);
                # nor may any stream's, whose end would otherwise stop short of blocks cached here.
                self._busy.add(lease_id)
                taken.append(lease_id)
                if on_lease is not None and buffers is None and not pull:
                    on_lease(lease_id)
            try:
                # The first blocks go out while later ones are read from SSD: into engine buffers
                # each is pinned by the handover until copied; an arena reader learns the lookup's
                # lease before its first block, and reads the blocks in their slots under it.
                local = await self._lookup_chain(state, chain, session, prefix_up, lease_taken)
            except BaseException:
                self._drop_taken(taken, session)
                await handover.close()
                raise
            if taken and taken[0] != local.lease_id:   # the lookup let it go (nothing came up, or
                self._drop_taken(taken, session)       # its session closed): ended now
            if session.session_id not in self._sessions:
                # The client is gone (its session closed while the prefix came up): nobody to take
                # the rest, so no peer is asked for it and nothing more is leased.
                await handover.close()
                if self._stopping:
                    raise DaemonNotRunning("the daemon is stopping", Reason.DAEMON_STOPPING)
                raise FailedPrecondition(f"session {session_id!r} closed during the stream, after {given} "
                                         f"of {len(chain)} blocks had come up")
            read = self._leases.get(local.lease_id) if local.lease_id else None
            if read is None:
                read = self._pin(session, LeaseKind.READ, namespace_id, [], ttl)
            reservation: Lease | None = None
            self._busy.add(read.lease_id)
            stop, detail = "complete", ""
            handed_lease = 0
            if on_lease is not None and buffers is None and not pull:
                on_lease(read.lease_id)   # the same, or (none leased by the lookup) the stream's own
            try:
                # the leased local prefix (none if the lease was reaped meanwhile: those handed
                # over early are in the engine's buffers all the same)
                handover.give(given, read.pinned[given:], local.tiers[given:])
                delivered = max(local.blocks, given)
                if delivered < len(chain) and local.lease_lost:
                    # Released by the arena reader while the prefix came up (busy, it is never
                    # reaped): the rest is cached here but no longer leased, and fetching it from a
                    # peer would be waste.
                    stop, detail = "lease_ended", (f"the reader released the lease on the cached prefix "
                                                   f"before block {delivered} was in DRAM")
                elif delivered < len(chain) and fetcher is None:
                    stop, detail = "missing", f"block {delivered} is not cached on this node"
                elif delivered < len(chain) and fetcher is not None:
                    reservation, delivered, stop, detail = await self._fetch_rest(
                        session, state, chain, read, delivered, handover, buffers is None and not pull, fetcher)
                await handover.finish()
                handed_lease = read.lease_id if buffers is None and read.pinned and not pull else 0
                if handed_lease:
                    self._leases.renew(read, ttl)   # the reader's time starts now, not at the lookup
                return StreamEnd(delivered, len(chain), stop, detail, handed_lease, ttl)
            finally:
                try:
                    await handover.close()
                finally:   # also when cancelled again while close waits for a copy in flight
                    for lease in (reservation, read):
                        if lease is not None:   # the caller keeps only the lease it was handed
                            self._end_busy(lease, session, keep=lease.lease_id == handed_lease)

    def _drop_taken(self, taken: list[int], session: Session) -> None:
        """End the lease a stream's lookup took (busy since), if it still exists."""
        lease = self._leases.get(taken[0]) if taken else None
        if lease is not None:
            self._end_busy(lease, session)
        elif taken:
            self._busy.discard(taken[0])

    async def _fetch_rest(self, session: Session, state: NamespaceState, chain: list[bytes], read: Lease,
                          delivered: int, handover: Handover, lease_arrivals: bool,
                          fetcher: Fetcher) -> tuple[Lease | None, int, str, str]:
        """Reserve the chain's missing blocks and let ``fetcher`` fill them in order; each block
        that lands is sealed, handed over (and with ``lease_arrivals`` leased in ``read``).
        Returns the reservation (still to be ended), how many blocks were handed over in all,
        and why it stopped."""
        if not state.spec.block_bytes:
            return None, delivered, "no_room", ("this node does not know the namespace's block size yet "
                                                "(give Namespace.block_bytes, or register buffers first)")
        reservation = self._reserve_present(session, state, chain)
        self._busy.add(reservation.lease_id)
        try:
            while True:
                _, delivered, stop, detail = await self._fill_reservation(
                    session, state, chain, read, reservation, delivered, handover, lease_arrivals, fetcher)
                if stop != _STORED_HERE:   # else: the next blocks are here now, then fetch the rest
                    return reservation, delivered, stop, detail
        except BaseException:
            # cancelled (the client left) or failed: stream_blocks never learns of the reservation,
            # which would stay busy, hence never reaped nor ended, for ever
            self._end_busy(reservation, session)
            raise

    async def _fill_reservation(self, session: Session, state: NamespaceState, chain: list[bytes], read: Lease,
                                reservation: Lease, delivered: int, handover: Handover, lease_arrivals: bool,
                                fetcher: Fetcher) -> tuple[Lease | None, int, str, str]:
        start = len(reservation.pinned)
        if start > delivered:   # another client stored blocks since our lookup: hand them over too
            extra = reservation.pinned[delivered:start]
            for block in extra:
                block.pins += 1
            read.pinned.extend(extra)
            tiers = _tiers(extra)   # where they were found, as the lookup reports its own
            ready = await self._ensure_dram(extra)
            # a copy that failed its checksum left its block hollow; one still readable found no
            # DRAM slot (or its read failed and its SSD copy stays)
            corrupt = ready < len(extra) and not extra[ready].readable
            for block in extra[ready:]:
                block.pins -= 2          # the read lease's and the reservation's
            del read.pinned[len(read.pinned) - len(extra) + ready:]
            del reservation.pinned[delivered + ready:]
            for block in reversed(extra[ready:]):
                self._remove_if_hollow(block)   # a copy that failed its checksum: a hollow leaf goes
            handover.give(delivered, extra[:ready], tiers[:ready])
            if corrupt:
                return reservation, delivered + ready, "corrupt", f"block {delivered + ready} could not be read here"
            if ready < len(extra):
                return reservation, delivered + ready, "no_room", (
                    f"block {delivered + ready} is on SSD here but could not be brought to DRAM: every block "
                    "that could make room is leased or being written (or the SSD read failed: see kvctl stats)")
            delivered = start
        if start == len(chain):
            return reservation, start, "complete", ""
        new = reservation.new
        block_bytes = state.spec.block_bytes
        sealed = 0
        here: int | None = None   # the block another client stored since the prefix was matched

        async def into(i: int, length: int) -> memoryview:
            nonlocal here
            # Slots are taken as blocks arrive, not up front: the first block of a long prompt
            # does not wait for thousands of reservations.
            if length != block_bytes:
                raise ValueError(f"peer sent block {start + i} of {length} bytes; expected {block_bytes}")
            assert i == len(new), "blocks must arrive in order"
            if start == 0 and i == 1:
                # The reader's first block goes out before the next one is received: while the
                # rest of a long prompt streams in, its copy and event would queue behind the
                # receiving (milliseconds on two cores). The sender fills the socket buffers
                # meanwhile, so the stream hardly pauses. (Here, not in ``landed``: block 0 is
                # counted as delivered by then, whatever happens while we wait.)
                await handover.settled()
            outcome = self._reserve_next(reservation, state, chain[start + i])
            for _ in range(3):
                # DRAM is full of this stream's own chain (a prompt larger than DRAM, each block
                # already in the engine's buffers): sink its oldest blocks to SSD and let them give
                # up their slots. The eviction policy cannot: they are interior blocks of a chain.
                # Its own blocks: the oldest DRAM-only blocks of the namespace may be another
                # client's, leased, whose slots writing them back does not free.
                if outcome != "full" or self._ssd is None:
                    break
                await self._write_back(8 * block_bytes, True, {state.namespace_id}, among=new[:i])
                await handover.settled()   # blocks still being copied to the engine are pinned till then
                if not self._drop_clean_slots(new[:i], 8):
                    break
                outcome = self._reserve_next(reservation, state, chain[start + i])
            if outcome == "here":
                here = i
                raise ResourceExhausted(f"block {start + i} was stored here meanwhile by another client")
            if outcome != "ok":
                raise ResourceExhausted(f"no DRAM slot for block {start + i}: " + (
                    "another client is writing it" if outcome == "blocked" else "every block that could "
                    "make room is leased or being written"))
            return self._arena.view(new[i].offset, length).data

        async def landed(i: int, peer: str) -> None:
            nonlocal sealed
            assert i == sealed, "blocks must land in order"
            block = new[i]
            # Stored now. The reservation's pin moves down the chain: the block the next one
            # will hang under stays pinned (an unpinned DRAM-only leaf is another client's first
            # victim, and the next block would be reserved under a block gone from the index).
            if i:
                new[i - 1].pins -= 1
            self._sealed_now([block])
            if lease_arrivals:
                block.pins += 1
                read.pinned.append(block)
            sealed += 1
            self._n.peer_fetched += 1
            handover.give(start + i, [block], [Tier.PEER], peer)

        ours: list[Block] = []
        try:
            got = await fetcher(state.namespace_id, chain[start:], into, landed)
        finally:
            if sealed:
                new[sealed - 1].pins -= 1   # the reservation's pin on the last block stored
            ours = new[:sealed]
            del new[:sealed]             # sealed blocks are no longer the reservation's to abort
        if here is not None and here == sealed and not new:
            # Another client stored the next blocks while the peers were asked (a second request
            # for the same prompt, say): they are cached here, not being written. The reservation
            # takes our blocks and those as its prefix, hands them over, then fetches what follows.
            found = state.index.match(chain[start + sealed:])
            if found:
                for block in ours + found:
                    block.pins += 1
                reservation.pinned.extend(ours + found)
                return reservation, start + sealed, _STORED_HERE, ""
        return reservation, start + sealed, got.stop, got.detail

    # -- introspection and shutdown ---------------------------------------------------------
    def stats(self) -> StoreStats:
        index_blocks = sum(len(s.index) for s in self._namespaces.values())
        dram_blocks = sum(len(policy) for policy in self._dram_policies.values())
        tiers = [TierStats("dram", self._allocator.capacity, self._allocator.used_bytes,
                           dram_blocks, self._n.dram_evictions)]
        if self._ssd is not None:
            tiers.append(TierStats("ssd", self._config.ssd.capacity, self._ssd_used, self._ssd_blocks,
                                   self._n.ssd_evictions, self._n.ssd_write_errors, self._n.ssd_read_errors))
        return StoreStats(self._clock() - self._started, tiers, self._n.lookups,
                          self._n.lookup_blocks, self._n.hit_blocks, self._n.hit_tokens,
                          self._n.saved_blocks, self._leases.count(LeaseKind.READ),
                          len(self._sessions), len(self._namespaces), index_blocks,
                          self._n.promotions, self._n.demotions, self._n.dropped,
                          self._n.peer_fetched, self._n.peer_served, self._n.peer_received)

    async def write_back_for_shutdown(self) -> int:
        """Shutdown: write DRAM blocks without an SSD copy to SSD (as write-back would, under
        ``ssd.admission`` and the SSD policy) until none is left that may go; returns how many
        were written. Cancelling it (a deadline) leaves the writes under way to finish."""
        written = 0
        while self._ssd is not None:
            n = await self._write_back(float("inf"), force=False, models=None)
            if not n:
                break
            written += n
        return written

    def dram_only_blocks(self) -> int:
        """Sealed blocks whose only copy is in DRAM (lost when the daemon stops)."""
        return sum(1 for block in self._dirty if block.sealed and block.in_dram and not block.on_ssd)

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait until no request has a copy in flight (no busy lease) nor a leased lookup waiting
        for SSD reads, for at most ``timeout_s``; whether none has. Shutdown waits so before it
        ends the sessions: ending one dooms its busy leases (a save whose reservation is doomed
        stores nothing) and ends the leases of lookups under way (a load then finds nothing).
        From the first call on, requests that would start new work are refused (DaemonNotRunning)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while (self._busy or self._lookups_in_flight) and loop.time() < end:
            await asyncio.sleep(0.01)   # shutdown only: polling costs nothing that matters
        return not (self._busy or self._lookups_in_flight)

    async def drain(self) -> None:
        """Wait for background promotions and write-backs in flight (shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
