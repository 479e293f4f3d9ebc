"""The block store: namespaces, the prefix index, the DRAM tier and leases, composed.

Every method runs on the daemon's event loop thread, so bookkeeping needs no locks; byte copies
run on the copy engine's threads while the blocks involved are pinned by a busy lease, which the
reaper and session teardown leave alone until the copy is done.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstored.buffers import RegisteredBuffers, TensorSource
from kvstored.config import Config
from kvstored.copy import CopyEngine
from kvstored.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvstored.index import Block, BlockState, PrefixIndex, Tier
from kvstored.leases import Lease, LeaseKind, LeaseTable, Session
from kvstored.policy.eviction import LRUOrder
from kvstored.tiers.dram import Arena, SlotAllocator, slot_size
from kvstored_client.hashing import block_hashes
from kvstored_client.namespace import Namespace


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: int
    spec: Namespace
    index: PrefixIndex


@dataclass(frozen=True, slots=True)
class KeyRequest:
    """A chain of blocks as the client named it: engine hashes, or token ids to hash here."""

    hashes: Sequence[bytes] = ()
    token_ids: Sequence[int] = ()
    cache_salt: str = ""
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class LookupResult:
    blocks: int
    tiers: list[Tier]
    offsets: list[int]
    lease_id: int
    lease_ttl_s: float
    block_bytes: int
    block_size: int


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


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    saved_blocks: int = 0
    evictions: int = 0


class BlockStore:
    """The daemon's domain. Expected failures raise :mod:`kvstored.errors` types and change nothing."""

    def __init__(self, config: Config, arena: Arena, copy: CopyEngine,
                 clock: Callable[[], float] = time.monotonic,
                 new_session_id: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        self._config = config
        self._arena = arena
        self._copy = copy
        self._clock = clock
        self._new_session_id = new_session_id
        self._started = clock()
        self._allocator = SlotAllocator(arena.capacity, config.dram.page_bytes)
        self._lru: dict[int, LRUOrder] = {}
        self._namespaces: dict[int, NamespaceState] = {}
        self._sessions: dict[str, Session] = {}
        self._leases = LeaseTable(clock)
        self._buffers: dict[int, tuple[str, int, RegisteredBuffers]] = {}
        self._next_buffers_id = 1
        self._busy: set[int] = set()      # lease ids with a copy in flight
        self._doomed: set[int] = set()    # busy leases to end once their copy is done
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

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise FailedPrecondition(f"unknown session {session_id!r}: open a session first (the "
                                     "daemon may have restarted; reconnect)")
        return session

    # -- namespaces -------------------------------------------------------------------------
    def open_namespace(self, spec: Namespace) -> NamespaceState:
        """Create or find the namespace of ``spec``; its block size in bytes is fixed once known."""
        try:
            spec.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if spec.hash_algo != "sha256_cbor" and not self._config.keys.allow_fast_hash:
            raise InvalidArgument(f"namespace.hash_algo {spec.hash_algo!r} is disabled on this daemon "
                                  "(set keys.allow_fast_hash = true on trusted single-tenant nodes)")
        self._check_block_bytes(spec.block_bytes)
        namespace_id = spec.identity()
        state = self._namespaces.get(namespace_id)
        if state is None:
            state = NamespaceState(namespace_id, spec, PrefixIndex(namespace_id))
            state.index.slot_bytes = slot_size(spec.block_bytes) if spec.block_bytes else 0
            self._namespaces[namespace_id] = state
        elif spec.block_bytes:
            self._fix_block_bytes(state, spec.block_bytes)
        return state

    def _check_block_bytes(self, block_bytes: int) -> None:
        if block_bytes > self._config.dram.page_bytes:
            raise InvalidArgument(f"block_bytes {block_bytes} exceeds dram.page_bytes "
                                  f"{self._config.dram.page_bytes}; raise it in the daemon config")

    def _fix_block_bytes(self, state: NamespaceState, block_bytes: int) -> None:
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes must be positive")
        self._check_block_bytes(block_bytes)
        if state.spec.block_bytes == 0:
            state.spec = dataclasses.replace(state.spec, block_bytes=block_bytes)
            state.index.slot_bytes = slot_size(block_bytes)
        elif state.spec.block_bytes != block_bytes:
            raise InvalidArgument(f"namespace {state.spec.model!r} stores blocks of "
                                  f"{state.spec.block_bytes} bytes; got {block_bytes}")

    def _namespace(self, namespace_id: int) -> NamespaceState:
        state = self._namespaces.get(namespace_id)
        if state is None:
            raise NotFound(f"unknown namespace {namespace_id}: open it first")
        return state

    def resolve_keys(self, namespace_id: int, keys: KeyRequest) -> tuple[NamespaceState, list[bytes]]:
        """The namespace and the chain of block keys named by ``keys`` (validated, within limits)."""
        state = self._namespace(namespace_id)
        spec = state.spec
        limit = self._config.server.max_batch_blocks
        if keys.hashes and keys.token_ids:
            raise InvalidArgument("give either block hashes or token ids, not both")
        if keys.hashes:
            if keys.cache_salt or keys.lora_name:
                raise InvalidArgument("cache_salt and lora_name apply to token ids only; "
                                      "engine hashes already include them")
            if len(keys.hashes) > limit:
                raise InvalidArgument(f"{len(keys.hashes)} blocks exceed server.max_batch_blocks={limit}")
            for i, h in enumerate(keys.hashes):
                if len(h) != spec.digest_size:
                    raise InvalidArgument(f"hashes[{i}] has {len(h)} bytes; {spec.hash_algo} keys have "
                                          f"{spec.digest_size}")
            return state, list(keys.hashes)
        if len(keys.token_ids) // spec.block_size > limit:
            raise InvalidArgument(f"{len(keys.token_ids) // spec.block_size} blocks exceed "
                                  f"server.max_batch_blocks={limit}")
        try:
            chain = block_hashes(keys.token_ids, spec.block_size, spec.hash_seed, spec.hash_algo,
                                 cache_salt=keys.cache_salt or None, lora_name=keys.lora_name or None)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        return state, chain

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, namespace_id: int, keys: KeyRequest, lease: bool = False,
               session_id: str = "") -> LookupResult:
        """Longest cached prefix of ``keys``; with ``lease``, pins the hit blocks for a direct read."""
        session = self._session(session_id) if lease else None
        state, chain = self.resolve_keys(namespace_id, keys)
        hits = state.index.match(chain)
        self._touch(hits)
        self._n.lookups += 1
        self._n.lookup_blocks += len(chain)
        self._n.hit_blocks += len(hits)
        self._n.hit_tokens += len(hits) * state.spec.block_size
        lease_id = 0
        ttl = self._config.leases.ttl_s
        if session is not None and hits:
            lease_id = self._pin(session, LeaseKind.READ, namespace_id, hits, ttl).lease_id
        return LookupResult(len(hits), [b.tier for b in hits],
                            [b.offset for b in hits] if session is not None else [],
                            lease_id, ttl, state.spec.block_bytes, state.spec.block_size)

    def _touch(self, blocks: Sequence[Block]) -> None:
        # Deepest first, so each parent ends up more recent than its children (leaf-first LRU).
        for block in reversed(blocks):
            self._lru_for(block.index.slot_bytes).touch(block)

    def _lru_for(self, slot_bytes: int) -> LRUOrder:
        lru = self._lru.get(slot_bytes)
        if lru is None:
            lru = self._lru[slot_bytes] = LRUOrder()
        return lru

    def _pin(self, session: Session, kind: LeaseKind, namespace_id: int, blocks: list[Block],
             ttl_s: float, new: list[Block] | None = None) -> Lease:
        for block in blocks:
            block.pins += 1
        return self._leases.add(session, kind, namespace_id, blocks, new or [], ttl_s)

    def release(self, session_id: str, lease_id: int) -> None:
        """End a read lease, or abort a reservation. FailedPrecondition when it already expired."""
        session = self._session(session_id)
        lease = self._leases.get(lease_id)
        if lease is None or lease.session_id != session_id:
            if self._leases.was_expired(lease_id):
                raise FailedPrecondition(f"lease {lease_id} expired before it was released "
                                         f"(ttl {self._config.leases.ttl_s:g}s); bytes read under it "
                                         "may be stale")
            raise NotFound(f"unknown lease {lease_id}")
        self._end(lease, session, aborted=True)

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, session_id: str, namespace_id: int, keys: KeyRequest,
                block_bytes: int) -> Reservation:
        """Allocate slots for the blocks of ``keys`` not cached yet (a suffix of the chain).

        Fewer slots than asked come back when the tier cannot make room; none when another
        client is writing the next block. Raises InvalidArgument for a wrong payload size.
        """
        session = self._session(session_id)
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
        present = state.index.match(chain)
        ttl = self._config.leases.reservation_ttl_s
        lease = self._pin(session, LeaseKind.RESERVATION, state.namespace_id, present, ttl)
        self._touch(present)
        parent = present[-1] if present else None
        sb = state.index.slot_bytes
        for key in chain[len(present):]:
            if state.index.get(key) is not None:
                break  # another client is writing this block; it will seal it
            offset = self._alloc(sb)
            if offset is None:
                break
            parent = state.index.insert(key, parent, offset)
            lease.new.append(parent)
        if not lease.new and len(present) < len(chain) and state.index.get(chain[len(present)]) is None:
            self._end(lease, session, aborted=True)
            raise ResourceExhausted("DRAM tier full: every block that could make room is leased "
                                    "or being written; retry after releasing leases")
        return lease

    def _alloc(self, sb: int) -> int | None:
        offset = self._allocator.alloc(sb)
        while offset is None:
            if not self._evict_one(sb):
                return None
            offset = self._allocator.alloc(sb)
        return offset

    def _evict_one(self, sb: int) -> bool:
        """Evict the least recently used evictable leaf, of this slot size first."""
        order = [sb, *sorted((s for s in self._lru if s != sb), key=lambda s: -len(self._lru[s]))]
        for size in order:
            lru = self._lru.get(size)
            if lru is None:
                continue
            for victim in lru.victims():
                self._remove(victim)
                self._n.evictions += 1
                return True
        return False

    def _remove(self, block: Block) -> None:
        self._lru_for(block.index.slot_bytes).discard(block)
        block.index.remove(block)
        self._allocator.free(block.offset)

    def seal(self, session_id: str, reservation_id: int) -> int:
        """Make a reservation's written blocks visible; returns how many were sealed."""
        session = self._session(session_id)
        lease = self._leases.get(reservation_id)
        if lease is None or lease.kind != LeaseKind.RESERVATION or lease.session_id != session_id:
            if self._leases.was_expired(reservation_id):
                raise FailedPrecondition(f"reservation {reservation_id} expired before it was sealed "
                                         f"(ttl {self._config.leases.reservation_ttl_s:g}s); "
                                         "nothing was stored")
            raise NotFound(f"unknown reservation {reservation_id}")
        sealed = len(lease.new)
        self._end(lease, session, aborted=False)
        return sealed

    def _end(self, lease: Lease, session: Session | None, aborted: bool) -> None:
        if lease.lease_id in self._busy:
            self._doomed.add(lease.lease_id)
            return
        self._leases.pop(lease, session)
        for block in lease.pinned:
            block.pins -= 1
        if lease.kind == LeaseKind.RESERVATION:
            if aborted:
                for block in reversed(lease.new):
                    block.pins -= 1
                    self._remove(block)
            else:
                for block in lease.new:
                    block.pins -= 1
                    block.state = BlockState.SEALED
                self._touch(lease.new)
                self._n.saved_blocks += len(lease.new)

    def reap(self) -> int:
        """End leases past their deadline (busy ones once their copy finishes); returns the count."""
        expired = self._leases.expired()
        for lease in expired:
            self._leases.mark_expired(lease.lease_id)
            self._end(lease, self._sessions.get(lease.session_id), aborted=True)
        return len(expired)

    # -- registered engine buffers ----------------------------------------------------------
    def register_buffers(self, session_id: str, namespace_id: int,
                         sources: Sequence[TensorSource]) -> RegisteredBuffers:
        """Map an engine's KV tensors; their block layout must match the namespace's."""
        session = self._session(session_id)
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

    def unregister_buffers(self, session_id: str, buffers_id: int) -> None:
        session = self._session(session_id)
        self._owned_buffers(session_id, buffers_id)
        session.buffers.discard(buffers_id)
        self._drop_buffers(buffers_id)

    def _drop_buffers(self, buffers_id: int) -> None:
        entry = self._buffers.pop(buffers_id, None)
        if entry is not None:
            entry[2].close()

    def _owned_buffers(self, session_id: str, buffers_id: int, namespace_id: int | None = None
                       ) -> RegisteredBuffers:
        entry = self._buffers.get(buffers_id)
        if entry is None or entry[0] != session_id:
            raise NotFound(f"unknown buffers {buffers_id} for this session")
        if namespace_id is not None and entry[1] != namespace_id:
            raise InvalidArgument(f"buffers {buffers_id} were registered for another namespace")
        return entry[2]

    def _check_block_ids(self, buffers: RegisteredBuffers, chain: Sequence[bytes],
                         block_ids: Sequence[int]) -> None:
        if len(block_ids) != len(chain):
            raise InvalidArgument(f"{len(block_ids)} block ids for {len(chain)} blocks")
        for i, b in enumerate(block_ids):
            if b >= buffers.num_blocks:
                raise InvalidArgument(f"block_ids[{i}] = {b} out of range (buffers hold "
                                      f"{buffers.num_blocks} blocks)")

    async def save_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: Sequence[int]) -> tuple[int, int]:
        """Copy the not-yet-cached blocks of a chain from engine buffers into the store.

        Returns (already present, newly stored); stored may fall short when the tier is full.
        """
        session = self._session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id, namespace_id)
        state, chain = self.resolve_keys(namespace_id, keys)
        self._check_block_ids(buffers, chain, block_ids)
        lease = self._reserve_chain(session, state, chain)
        present = len(lease.pinned)
        try:
            await self._copying(lease, self._copy.to_arena(
                buffers, block_ids[present: present + len(lease.new)], [b.offset for b in lease.new]))
        except BaseException:
            self._end(lease, self._sessions.get(session_id), aborted=True)
            raise
        if lease.lease_id in self._doomed or self._leases.get(lease.lease_id) is None:
            self._finish_doomed(lease)
            raise FailedPrecondition("session closed or reservation expired during the copy; "
                                     "nothing was stored")
        stored = len(lease.new)
        self._end(lease, session, aborted=False)
        return present, stored

    async def load_blocks(self, session_id: str, namespace_id: int, buffers_id: int,
                          keys: KeyRequest, block_ids: Sequence[int]) -> list[Tier]:
        """Copy the longest cached prefix of a chain into engine buffers; returns its tiers."""
        session = self._session(session_id)
        buffers = self._owned_buffers(session_id, buffers_id, namespace_id)
        _, chain = self.resolve_keys(namespace_id, keys)
        self._check_block_ids(buffers, chain, block_ids)
        result = self.lookup(namespace_id, KeyRequest(hashes=chain), lease=True, session_id=session_id)
        if not result.blocks:
            return []
        lease = self._leases.get(result.lease_id)
        assert lease is not None, "a fresh lease vanished"
        try:
            await self._copying(lease, self._copy.from_arena(
                buffers, block_ids[: result.blocks], result.offsets))
        finally:
            doomed = lease.lease_id in self._doomed
            self._finish_doomed(lease)
            if not doomed and self._leases.get(lease.lease_id) is not None:
                self._end(lease, session, aborted=True)
        return result.tiers

    async def _copying(self, lease: Lease, copy: object) -> None:
        self._busy.add(lease.lease_id)
        try:
            await copy  # type: ignore[misc]
        finally:
            self._busy.discard(lease.lease_id)

    def _finish_doomed(self, lease: Lease) -> None:
        if lease.lease_id in self._doomed:
            self._doomed.discard(lease.lease_id)
            if self._leases.get(lease.lease_id) is not None:
                self._end(lease, self._sessions.get(lease.session_id), aborted=True)

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> StoreStats:
        index_blocks = sum(len(s.index) for s in self._namespaces.values())
        dram_blocks = sum(len(lru) for lru in self._lru.values())
        dram = TierStats("dram", self._allocator.capacity, self._allocator.used_bytes,
                         dram_blocks, self._n.evictions)
        return StoreStats(self._clock() - self._started, [dram], self._n.lookups,
                          self._n.lookup_blocks, self._n.hit_blocks, self._n.hit_tokens,
                          self._n.saved_blocks, self._leases.count(LeaseKind.READ),
                          len(self._sessions), len(self._namespaces), index_blocks)
