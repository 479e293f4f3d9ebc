"""The store's side of the block exchange with peers: blocks checked out for a peer to read, and
blocks a peer pushes landed straight into DRAM slots (or adopted from a buffer), by key; also
what the peers ask of this node's catalog (which blocks it holds, namespaces, forgetting a
drained node's copies).

Built on the store's components (catalog, placement, promotion): the transport's block server
calls these methods, and nothing here speaks the wire format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import xxhash

from kvstored.index import NO_SLOT, PROMOTING, Block
from kvstored.peers.server import CheckedOut
from kvstored.store import BlockStore
from kvstored.store.catalog import NamespaceState


@dataclass(slots=True, eq=False)
class PeerLanding:
    """A DRAM slot a pushed block is being received into (see :meth:`PeerExchange.land`)."""

    exchange: PeerExchange
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
        return self.exchange.finish_landing(self, True, checksum)

    def abort(self) -> None:
        """The bytes did not arrive or failed their checksum: free the slot."""
        assert not self.done, "a landing is committed or aborted once"
        self.done = True
        self.exchange.finish_landing(self, False)


class PeerExchange:
    """Blocks in and out of one store by key, for its peers. Every method runs on the event loop."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store
        self._catalog = store.catalog
        self._placement = store.placement
        self._promotion = store.promotion
        self._arena = store.arena
        self._traffic = store.peer_traffic

    # -- what peers ask of the catalog --------------------------------------------------------
    def describe_namespace(self, namespace_id: int) -> bytes:
        """The namespace's spec as a peer learns it (JSON); NotFound for an unknown one."""
        return self._catalog.describe(namespace_id)

    def learn_namespace(self, namespace_id: int, description: bytes) -> str:
        """Open the namespace a peer described before pushing blocks of it; "" or why not."""
        return self._catalog.learn(namespace_id, description)

    def namespace_chains(self, model: str = "") -> list[tuple[int, bytes, list[bytes]]]:
        """Every readable block of ``model``'s namespaces (all when empty) as parent-first runs
        ``(namespace_id, parent key, keys)``: pushing them in this order never sends a block
        before its parent."""
        return [(ns_id, parent, run) for ns_id in sorted(self._catalog.ids_of(model))
                for parent, run in self._catalog.get(ns_id).index.chains()]

    def held(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` this node holds in any tier (unknown namespace: 0)."""
        state = self._catalog.find(namespace_id)
        return len(state.index.match(keys)) if state is not None else 0

    def forget(self, namespace_id: int, keys: Sequence[bytes]) -> int:
        """Drop these blocks from every tier (a drained node's copies), deepest first; pinned
        blocks and blocks with children outside ``keys`` stay. Returns how many left."""
        state = self._catalog.find(namespace_id)
        if state is None:
            return 0
        dropped = 0
        for key in reversed(keys):
            block = state.index.get(key)
            if block is not None and block.evictable and not block.flags & PROMOTING:
                self._placement.remove(block)
                dropped += 1
        return dropped

    # -- blocks out ---------------------------------------------------------------------------
    def serve(self, namespace_id: int, key: bytes) -> CheckedOut | Awaitable[CheckedOut | None] | None:
        """:meth:`checkout` for a peer fetching the block: the result itself when the block is in
        DRAM (no task per block on the peer channel's send path), else checkout's awaitable."""
        state = self._catalog.find(namespace_id)
        block = state.index.get(key) if state is not None else None
        if block is None or not block.readable:
            return None
        if block.in_dram and not block.flags & PROMOTING:
            block.pins += 1
            self._placement.dram.advance()   # as a promotion counts a request that reads DRAM
            return self._checked_out(block, self._arena.view(block.offset, block.index.block_bytes).data, True)
        return self.checkout(namespace_id, key)

    async def checkout(self, namespace_id: int, key: bytes, *, served: bool = True) -> CheckedOut | None:
        """Pin a block for a peer to read, bringing it to DRAM first (or, when DRAM has no slot for
        it, reading its SSD copy into a buffer of its own); its bytes and their xxh3-64
        checksum (computed once per block: a hot prefix served to many peers is hashed once), or
        None when this node does not hold it (or its SSD copy failed its checksum). Each view
        needs one :meth:`checkin`. ``served`` False: this node pushes the block (not a peer
        fetching it): neither a hit nor a served block, and the checksum only if known (a push
        checks out a chunk of blocks before sending any: the sender hashes each as it goes,
        while the receiver takes the one before)."""
        state = self._catalog.find(namespace_id)
        block = state.index.get(key) if state is not None else None
        if block is None or not block.readable:
            return None
        block.pins += 1
        try:
            if await self._promotion.ensure_dram([block]) == 1:
                view: memoryview | None = self._arena.view(block.offset, block.index.block_bytes).data
            else:
                view = await self._promotion.read_unslotted(block)
        except BaseException:   # cancelled while it was being read (the peer gave up): no pin left behind
            block.pins -= 1
            # a read that already failed its checksum kept the block for our pin: a hollow leaf goes
            self._placement.remove_if_hollow(block)
            raise
        if view is None:
            block.pins -= 1
            self._placement.remove_if_hollow(block)
            return None
        return self._checked_out(block, view, served)

    def _checked_out(self, block: Block, view: memoryview, served: bool) -> CheckedOut:
        """A pinned block's bytes go to a peer: counted (when ``served``) and hashed once."""
        if served:
            self._placement.hit([block])
            self._traffic.served += 1
        if block.check is None and served:
            block.check = xxhash.xxh3_64_intdigest(view)
        return view, block.check

    def checkin(self, namespace_id: int, key: bytes) -> None:
        """A peer is done reading a block :meth:`checkout` returned."""
        block = self._catalog.get(namespace_id).index.get(key)
        assert block is not None and block.pins > 0, "checkin of a block that is not checked out"
        block.pins -= 1
        # read from SSD into a buffer of its own, its last copy may have gone meanwhile (another
        # read found it corrupt): a hollow leaf nothing holds leaves the index
        self._placement.remove_if_hollow(block)

    def checkin_unsent(self, namespace_id: int, key: bytes) -> None:
        """:meth:`checkin` of a block :meth:`serve` (or checkout, ``served``) returned that never
        reached the peer whole (checked out ahead, then the transfer ended; or cut while it was
        written): it is not counted as served after all."""
        self.checkin(namespace_id, key)
        self._traffic.served -= 1

    # -- blocks in ----------------------------------------------------------------------------
    def adopt(self, namespace_id: int, parent: bytes, key: bytes, payload: memoryview) -> bool:
        """Store a block a peer pushed (checksum already verified) under ``parent`` (b"" = the
        chain's root). True when it is stored now or was already; False, storing nothing, when the
        namespace is unknown, the size is wrong, the parent is missing or DRAM has no room."""
        state = self._catalog.find(namespace_id)
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
        state = self._catalog.find(namespace_id)
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
        state = self._catalog.find(namespace_id)
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
            self._placement.dram.advance()
            offset = self._placement.alloc(state.index.slot_bytes)
        finally:
            if offset is None and above is not None:
                above.pins -= 1
                self._placement.remove_if_hollow(above)
        if offset is None:
            return None
        return PeerLanding(self, state, above, key, offset, self._arena.view(offset, length).data)

    def finish_landing(self, landing: PeerLanding, verified: bool, checksum: int | None = None) -> bool:
        """Finish a landing (its ``commit`` or ``abort``, exactly once): ``verified``, the block joins
        the index, sealed (keeping ``checksum``); otherwise, or when the chain changed meanwhile,
        its slot is freed."""
        state, above = landing.state, landing.parent
        placement = self._placement
        if above is not None:
            above.pins -= 1
        # While the bytes arrived, a reservation or another push may have indexed the key (the
        # push then counts it held if its bytes are readable), or the parent may have gone.
        if verified and state.index.get(landing.key) is None \
                and (above is None or state.index.get(above.key) is above):
            block = placement.bind(state.index.insert(landing.key, above, NO_SLOT), landing.offset)
            block.pins = 0
            block.check = checksum
            placement.sealed_now([block])
            self._traffic.received += 1
            return True
        placement.dram.free_unbound(landing.offset)
        if above is not None:
            placement.remove_if_hollow(above)   # a hollow parent kept only for children it no longer has
        existing = state.index.get(landing.key)
        return verified and existing is not None and existing.readable

    def _refill(self, block: Block, payload: memoryview) -> bool:
        """Give a hollow block (its bytes were lost, its children kept) the bytes a peer sent."""
        if block.flags & PROMOTING:
            return False
        placement = self._placement
        block.pins += 1   # making room may evict its last child; that must not take the block along
        try:
            offset = placement.alloc(block.index.slot_bytes)
        finally:
            block.pins -= 1
        if offset is None:
            placement.remove_if_hollow(block)
            return False
        self._arena.view(offset, payload.nbytes)[:] = payload
        placement.bind(block, offset)
        block.flags = 0
        block.index.changed(block)
        block.check = None
        placement.sealed_now([block])
        self._traffic.received += 1
        return True
