"""Reservations: DRAM slots taken for the blocks of a chain that are not cached yet, block by
block under the chain's cached prefix, for a writer (a client's save, a peer's fetch) to fill."""

from __future__ import annotations

import asyncio

from kvstored.config import Config
from kvstored.index import NO_SLOT, PROMOTING
from kvstored.leases import Lease, LeaseKind, Session
from kvstored.store.catalog import NamespaceState
from kvstored.store.leasing import Leasing
from kvstored.store.placement import Placement
from kvstored.store.promotion import Promotion
from kvstored.store.waits import WaitHistogram
from kvstored_client.contract.errors import LeaseExpired, Reason, ResourceExhausted

# reserve_next's outcomes
RESERVED = "ok"       # a slot for the key
FULL = "full"         # no room can be made
BLOCKED = "blocked"   # another client is writing that block and will seal it
HERE = "here"         # another client stored it since the reservation's prefix was matched


class Reservations:
    """Reserving slots under a lease of kind RESERVATION: its ``pinned`` blocks are the cached
    prefix it writes after, its ``new`` blocks the slots it holds (unsealed until it ends)."""

    def __init__(self, config: Config, leasing: Leasing, placement: Placement, promotion: Promotion) -> None:
        self._config = config
        self._leasing = leasing
        self._placement = placement
        self._promotion = promotion
        self.room_waits = WaitHistogram()   # how long reservations waited for the write-back

    def reserve_chain(self, session: Session, state: NamespaceState, chain: list[bytes]) -> Lease:
        """A reservation of the chain's blocks not cached yet (a suffix): fewer slots than asked
        when the tier cannot make room now, none when another client is writing the next block;
        ResourceExhausted when no room at all can be made."""
        lease = self.reserve_present(session, state, chain)
        outcome = RESERVED
        for key in chain[len(lease.pinned):]:
            outcome = self.reserve_next(lease, state, key)
            if outcome != RESERVED:
                break
        self._placement.dram.order_slots(lease.new)
        return self._checked(lease, session, chain, outcome)

    async def reserve_chain_waiting(self, session: Session, state: NamespaceState, chain: list[bytes],
                                    until: float) -> Lease:
        """:meth:`reserve_chain`, except that when DRAM holds only blocks that must reach the SSD
        tier before they leave (or blocks whose promotions are in flight), it waits for the
        write-back to copy some (or for those to land; until ``until``, the event loop's time)
        rather than store less: saves faster than the disk slow down to its speed instead of
        dropping blocks. Each wait is observed in :attr:`room_waits`."""
        lease = self.reserve_present(session, state, chain)
        outcome = RESERVED
        loop = asyncio.get_running_loop()
        began: float | None = None
        try:
            for key in chain[len(lease.pinned):]:
                outcome = self.reserve_next(lease, state, key)
                while outcome == FULL and await self._placement.wait_for_room(until, landing=len(self._promotion) > 0):
                    began = loop.time() if began is None else began
                    if not self._leasing.live(lease):   # its session ended (or it expired) meanwhile
                        raise LeaseExpired("session closed or reservation expired while it waited for room; "
                                           "nothing was stored", Reason.RESERVATION_EXPIRED)
                    outcome = self.reserve_next(lease, state, key)
                if outcome != RESERVED:
                    break
        except BaseException:   # cancelled while it waited: the slots go back
            if self._leasing.live(lease):
                self._leasing.end(lease, self._leasing.find_session(session.session_id), aborted=True)
            raise
        finally:
            if began is not None:
                self.room_waits.observe(loop.time() - began)
        self._placement.dram.order_slots(lease.new)
        return self._checked(lease, session, chain, outcome)

    def _checked(self, lease: Lease, session: Session, chain: list[bytes], outcome: str) -> Lease:
        """``lease`` unless it reserved nothing of a chain that needed slots for lack of room."""
        blocked = outcome in (BLOCKED, HERE)
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
            # unsealed before it has the slot: sealed and slotted, it would be announced readable
            # there (by the presence table, to SDKs reading without a lease) before its bytes are
            existing.flags = 0
            existing.index.changed(existing)
            placement.bind(existing, offset)
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
