"""Reservations: DRAM slots taken for the blocks of a chain that are not cached yet, block by
block under the chain's cached prefix, for a writer (a client's save, a peer's fetch) to fill."""

from __future__ import annotations

from kvstored.config import Config
from kvstored.index import NO_SLOT, PROMOTING
from kvstored.leases import Lease, LeaseKind, Session
from kvstored.store.catalog import NamespaceState
from kvstored.store.leasing import Leasing
from kvstored.store.placement import Placement
from kvstored_client.contract.errors import Reason, ResourceExhausted

# reserve_next's outcomes
RESERVED = "ok"       # a slot for the key
FULL = "full"         # no room can be made
BLOCKED = "blocked"   # another client is writing that block and will seal it
HERE = "here"         # another client stored it since the reservation's prefix was matched


class Reservations:
    """Reserving slots under a lease of kind RESERVATION: its ``pinned`` blocks are the cached
    prefix it writes after, its ``new`` blocks the slots it holds (unsealed until it ends)."""

    def __init__(self, config: Config, leasing: Leasing, placement: Placement) -> None:
        self._config = config
        self._leasing = leasing
        self._placement = placement

    def reserve_chain(self, session: Session, state: NamespaceState, chain: list[bytes]) -> Lease:
        """A reservation of the chain's blocks not cached yet (a suffix): fewer slots than asked
        when the tier cannot make room, none when another client is writing the next block;
        ResourceExhausted when no room at all can be made."""
        lease = self.reserve_present(session, state, chain)
        blocked = False
        for key in chain[len(lease.pinned):]:
            outcome = self.reserve_next(lease, state, key)
            if outcome != RESERVED:
                blocked = outcome in (BLOCKED, HERE)
                break
        if not lease.new and len(lease.pinned) < len(chain) and not blocked:
            self._leasing.end(lease, session, aborted=True)
            raise ResourceExhausted("DRAM tier full: every block that could make room is leased "
                                    "or being written; retry after releasing leases", Reason.TIER_FULL)
        return lease

    def reserve_present(self, session: Session, state: NamespaceState, chain: list[bytes]) -> Lease:
        """A reservation pinning the chain's cached prefix, with no slots yet."""
        dram = self._placement.dram
        dram.advance()
        present = state.index.match(chain)
        lease = self._leasing.pin(session, LeaseKind.RESERVATION, state.namespace_id, present,
                                  self._config.leases.reservation_ttl_s)
        # Not a hit for the policies: an engine saves a prompt after looking it up, and that lookup
        # counted; counting again would promote every extended prefix a reuse class. Its pages are in use.
        dram.mark_pages(present)
        return lease

    def reserve_next(self, lease: Lease, state: NamespaceState, key: bytes) -> str:
        """Reserve a slot for ``key``, the block after the reservation's last one: RESERVED, FULL,
        BLOCKED or HERE."""
        placement = self._placement
        tail = lease.new or lease.pinned
        parent = tail[-1] if tail else None
        sb = state.index.slot_bytes
        existing = state.index.get(key)
        if existing is not None:
            if existing.readable:
                return HERE
            if not (existing.sealed and not existing.readable and existing.pins == 0
                    and not existing.flags & PROMOTING):
                return BLOCKED
            # A hollow block (its bytes were lost): write it again in place. Making room may
            # evict its last child; that must not take the block along (out of the index).
            existing.pins += 1
            try:
                offset = placement.alloc(sb)
            finally:
                existing.pins -= 1
            if offset is None:
                placement.remove_if_hollow(existing)
                return FULL
            placement.bind(existing, offset)
            existing.flags = 0
            existing.check = None
            existing.pins += 1
            lease.new.append(existing)
            return RESERVED
        if parent is not None:
            parent.pins += 1   # making room must not evict the block we hang this one under
        try:
            offset = placement.alloc(sb)
        finally:
            if parent is not None:
                parent.pins -= 1
        if offset is None:
            return FULL
        lease.new.append(placement.bind(state.index.insert(key, parent, NO_SLOT), offset))
        return RESERVED
