"""Leasing: client sessions and the lifetimes of the leases and reservations they own, including
those a request keeps busy (a copy in flight) past their session's end or their deadline.

A lease pins blocks; ending it unpins them, and ending a reservation seals the blocks it wrote
(or, aborted, takes them back out of the index).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable, Iterator

from kvstored.config import Config
from kvstored.index import NO_SLOT, ON_SSD, SEALED, Block
from kvstored.leases import Lease, LeaseKind, LeaseTable, Session
from kvstored.store.placement import Placement
from kvstored.store.quarantine import Quarantine
from kvstored_client.contract.errors import DaemonNotRunning, FailedPrecondition, LeaseExpired, NotFound, Reason


class Leasing:
    """Sessions by id, the lease table, and the leases' request-side states: *busy* (a request
    is copying under it: never reaped, and ending it is deferred), *doomed* (its end was asked
    for while busy: it ends when its request is done). Once :meth:`quiesce` began, requests that
    would start new work are refused.

    A reservation that ends without its client asking (its session ended, it expired) puts its
    slots in ``quarantine``: the client may still be copying rows into them."""

    def __init__(self, config: Config, clock: Callable[[], float], placement: Placement, quarantine: Quarantine,
                 new_session_id: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        self._config = config
        self._placement = placement
        self.quarantine = quarantine
        self._new_session_id = new_session_id
        self._sessions: dict[str, Session] = {}
        self._leases = LeaseTable(clock)
        self._busy: set[int] = set()      # lease ids with a copy in flight
        self._doomed: set[int] = set()    # busy leases to end once their copy is done
        self._lookups_in_flight = 0       # leased lookups waiting for SSD reads (quiesce)
        self._stopping = False            # quiesce() began: no new copies nor leases (shutdown)
        self.saved_blocks = 0             # blocks sealed by reservations (and commits: BlockStore.commit)

    # -- sessions ---------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    def sessions(self) -> int:
        return len(self._sessions)

    def open_session(self, client_name: str, pid: int) -> Session:
        session = Session(self._new_session_id(), client_name, pid)
        self._sessions[session.session_id] = session
        return session

    def close_session(self, session_id: str) -> Session | None:
        """End a session and its leases (its reservations abort); the session, for its owner
        to drop what else it held (buffers), or None when there was no such session."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return None
        for lease_id in list(session.leases):
            lease = self._leases.get(lease_id)
            if lease is not None:
                self.end(lease, session, aborted=True, quarantine=True)
        return session

    def has_session(self, session_id: str) -> bool:
        """Whether ``session_id`` names an open session."""
        return session_id in self._sessions

    def find_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def session(self, session_id: str) -> Session:
        """The open session; FailedPrecondition for any other id."""
        session = self._sessions.get(session_id)
        if session is None:
            raise FailedPrecondition(f"unknown session {session_id!r}: open a session first (the "
                                     "daemon may have restarted; reconnect)", Reason.UNKNOWN_SESSION)
        return session

    def working_session(self, session_id: str) -> Session:
        """:meth:`session`, for a request that starts new work (a copy, a lease, a reservation):
        DaemonNotRunning once shutdown began. A call the server had taken before SIGTERM may start
        only after quiesce() found nothing in flight; its session then ends under its copy (a
        save stored nothing and said the session closed) or its lease (a load found nothing)."""
        if self._stopping:
            raise DaemonNotRunning("the daemon is stopping", Reason.DAEMON_STOPPING)
        return self.session(session_id)

    # -- leases -----------------------------------------------------------------------------
    def pin(self, session: Session, kind: LeaseKind, namespace_id: int, blocks: list[Block],
            ttl_s: float) -> Lease:
        """A new lease of ``session`` pinning ``blocks`` for ``ttl_s``."""
        for block in blocks:
            block.pins += 1
        return self._leases.add(session, kind, namespace_id, list(blocks), [], ttl_s)

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def live(self, lease: Lease) -> bool:
        """Whether ``lease`` has not ended."""
        return self._leases.get(lease.lease_id) is lease

    def leases(self) -> list[Lease]:
        """The live leases and reservations."""
        return self._leases.all()

    def count(self, kind: LeaseKind) -> int:
        return self._leases.count(kind)

    def renew(self, lease: Lease, ttl_s: float) -> None:
        self._leases.renew(lease, ttl_s)

    def release(self, session_id: str, lease_id: int, reservation_only: bool = False) -> None:
        """End a read lease, or abort a reservation (only a reservation with ``reservation_only``).
        FailedPrecondition when it already expired."""
        session = self.session(session_id)
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
                                   f"(ttl {self._config.leases.ttl_s:g}s); bytes read under it may be stale",
                                   Reason.LEASE_EXPIRED)
            raise NotFound(f"unknown lease {lease_id}", Reason.UNKNOWN_LEASE)
        self.end(lease, session, aborted=True)

    def seal(self, session_id: str, reservation_id: int) -> int:
        """Make a reservation's written blocks visible; returns how many were sealed."""
        session = self.session(session_id)
        lease = self._leases.get(reservation_id)
        if lease is None or lease.kind != LeaseKind.RESERVATION or lease.session_id != session_id:
            if self._leases.was_expired(reservation_id, session_id, LeaseKind.RESERVATION):
                raise LeaseExpired(f"reservation {reservation_id} expired before it was sealed "
                                   f"(ttl {self._config.leases.reservation_ttl_s:g}s); nothing was stored",
                                   Reason.RESERVATION_EXPIRED)
            raise NotFound(f"unknown reservation {reservation_id}", Reason.UNKNOWN_LEASE)
        sealed = len(lease.new)
        self.end(lease, session, aborted=False)
        return sealed

    def reservation_chain(self, session_id: str, reservation_id: int) -> tuple[int, list[bytes]]:
        """The namespace and keys of a live reservation's chain (present blocks, then those being
        written); (0, []) when there is no such reservation."""
        lease = self._leases.get(reservation_id)
        if lease is None or lease.kind != LeaseKind.RESERVATION or lease.session_id != session_id:
            return 0, []
        return lease.namespace_id, [b.key for b in lease.pinned] + [b.key for b in lease.new]

    def end(self, lease: Lease, session: Session | None, aborted: bool, quarantine: bool = False) -> None:
        """End ``lease`` (deferred while it is busy: it is doomed then). A reservation's new
        blocks are sealed, or with ``aborted`` taken back out of the index, their slots freed
        (with ``quarantine``, put in quarantine: a client may still be writing them)."""
        if lease.lease_id in self._busy:
            self._doomed.add(lease.lease_id)
            return
        self._doomed.discard(lease.lease_id)   # doomed while busy, ended by its request (a cancelled save)
        self._leases.pop(lease, session)
        placement = self._placement
        hollow = False
        for block in lease.pinned:
            block.pins -= 1
            # inline Block.readable: a long prefix's lease ends here, once per block
            flags = block.flags
            if not flags & SEALED or (block.offset == NO_SLOT and not flags & ON_SSD):
                hollow = True
        # A block whose SSD read failed its checksum while this lease held it is hollow (a request
        # cancelled before it could drop it, say): once nothing holds it, it leaves the index.
        if hollow:
            for block in reversed(lease.pinned):
                if not block.readable:
                    placement.remove_if_hollow(block)
        if lease.kind != LeaseKind.RESERVATION:
            return
        if aborted:
            held: list[int] = []
            for block in reversed(lease.new):
                block.pins -= 1
                offset = placement.release_slot(block, free=not quarantine)
                if quarantine and offset is not None:
                    held.append(offset)
                if block.children:
                    block.flags = SEALED  # a hollow block we were rewriting: hollow again
                    block.index.changed(block)
                else:
                    block.index.remove(block)
            if held:
                self.quarantine.hold(lease.new[0].index.slot_bytes, held)
            first = lease.new[0].parent if lease.new else None
            placement.remove_if_hollow(lease.new[0] if lease.new and lease.new[0].children else first)
            return
        for block in lease.new:
            block.pins -= 1
        placement.sealed_now(lease.new)
        self.saved_blocks += len(lease.new)

    def reap(self) -> int:
        """End leases past their deadline, idle ones only (an expired reservation's slots go to
        quarantine), and free the slots whose quarantine is over; returns the count of leases."""
        # A busy lease (a copy or a stream in flight) is judged once it is idle: its blocks are
        # pinned meanwhile anyway, and a stream renews the lease it hands over at its end.
        expired = [lease for lease in self._leases.expired() if lease.lease_id not in self._busy]
        for lease in expired:
            self._leases.mark_expired(lease)
            self.end(lease, self._sessions.get(lease.session_id), aborted=True, quarantine=True)
        self.quarantine.release_due()
        return len(expired)

    # -- requests under way -----------------------------------------------------------------
    def busy_leases(self) -> set[int]:
        """The ids of the busy leases (a copy of the set)."""
        return set(self._busy)

    def doomed_leases(self) -> set[int]:
        """The ids of the doomed leases (a copy of the set)."""
        return set(self._doomed)

    @property
    def lookups_in_flight(self) -> int:
        """Leased lookups waiting for SSD reads now."""
        return self._lookups_in_flight

    def doomed(self, lease_id: int) -> bool:
        return lease_id in self._doomed

    def busy(self, lease_id: int) -> bool:
        return lease_id in self._busy

    def set_busy(self, lease_id: int) -> None:
        """A request works under this lease from now on (see :meth:`end_busy`)."""
        self._busy.add(lease_id)

    def clear_busy(self, lease_id: int) -> None:
        self._busy.discard(lease_id)

    async def copying(self, lease: Lease, copy: Awaitable[object]) -> None:
        """Await ``copy`` with ``lease`` busy meanwhile."""
        self._busy.add(lease.lease_id)
        try:
            await copy
        finally:
            self._busy.discard(lease.lease_id)

    def end_busy(self, lease: Lease, session: Session, keep: bool = False) -> None:
        """The request that kept ``lease`` busy is over: end it if it was doomed meanwhile (or is
        gone), else abort it unless ``keep`` (a lease handed to the caller) and its session is
        still open."""
        self._busy.discard(lease.lease_id)
        if lease.lease_id in self._doomed or self._leases.get(lease.lease_id) is None:
            self.finish_doomed(lease)
        elif not keep or session.session_id not in self._sessions:
            # A lease taken after the session ended (a stream's, while its lookup awaited SSD
            # reads) was never doomed: kept, nobody could release it until the reaper came.
            self.end(lease, session if session.session_id in self._sessions else None, aborted=True)

    def finish_doomed(self, lease: Lease) -> None:
        """End ``lease`` now if it was doomed while busy."""
        if lease.lease_id in self._doomed:
            self._doomed.discard(lease.lease_id)
            if self._leases.get(lease.lease_id) is not None:
                self.end(lease, self._sessions.get(lease.session_id), aborted=True)

    @contextlib.contextmanager
    def lookup_in_flight(self) -> Iterator[None]:
        """A leased lookup waits for SSD reads meanwhile: :meth:`quiesce` waits for it."""
        self._lookups_in_flight += 1
        try:
            yield
        finally:
            self._lookups_in_flight -= 1

    def idle(self) -> bool:
        """No request has a copy in flight (no busy lease) nor a leased lookup waiting for SSD."""
        return not (self._busy or self._lookups_in_flight)

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait until :meth:`idle`, for at most ``timeout_s``; whether it is. Shutdown waits so
        before it ends the sessions: ending one dooms its busy leases (a save whose reservation
        is doomed stores nothing) and ends the leases of lookups under way (a load then finds
        nothing). From the first call on, requests that would start new work are refused
        (DaemonNotRunning)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not self.idle() and loop.time() < end:
            await asyncio.sleep(0.01)   # shutdown only: polling costs nothing that matters
        return self.idle()
