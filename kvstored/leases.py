"""Sessions and the leases they own: who pins which blocks, until when.

A session is one client connection. A lease pins blocks against eviction: a *read* lease while the
client copies bytes out, a *reservation* while it writes new blocks in. Every lease has a deadline
from the injected clock and belongs to one session; closing the session ends all of them.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstored.index import Block


class LeaseKind(enum.Enum):
    READ = "read"
    RESERVATION = "reservation"


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    session_id: str
    kind: LeaseKind
    namespace_id: int
    pinned: list[Block]          # existing blocks pinned by this lease
    new: list[Block]             # RESERVATION only: blocks it created, in chain order
    expires_at: float


@dataclass(slots=True, eq=False)
class Session:
    session_id: str
    client_name: str
    pid: int
    leases: set[int] = field(default_factory=set)
    buffers: set[int] = field(default_factory=set)


class LeaseTable:
    """Leases by id and by session; remembers recently ended ids to tell 'expired' from 'unknown'."""

    def __init__(self, clock: Callable[[], float], remember: int = 65536) -> None:
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._next_id = 1
        self._expired: deque[int] = deque(maxlen=remember)
        self._expired_of: dict[int, tuple[str, LeaseKind]] = {}   # id -> its session and kind

    def __len__(self) -> int:
        return len(self._leases)

    def all(self) -> list[Lease]:
        """The live leases, in the order they were taken."""
        return list(self._leases.values())

    def count(self, kind: LeaseKind) -> int:
        return sum(1 for lease in self._leases.values() if lease.kind == kind)

    def add(self, session: Session, kind: LeaseKind, namespace_id: int, pinned: list[Block],
            new: list[Block], ttl_s: float) -> Lease:
        lease = Lease(self._next_id, session.session_id, kind, namespace_id, pinned, new,
                      self._clock() + ttl_s)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        session.leases.add(lease.lease_id)
        return lease

    def renew(self, lease: Lease, ttl_s: float) -> None:
        """The lease runs ``ttl_s`` from now (a lease handed to its reader at the end of a long
        stream, say, which started its clock when the stream began)."""
        lease.expires_at = self._clock() + ttl_s

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease: Lease, session: Session | None) -> None:
        del self._leases[lease.lease_id]
        if session is not None:
            session.leases.discard(lease.lease_id)

    def was_expired(self, lease_id: int, session_id: str, kind: LeaseKind | None = None) -> LeaseKind | None:
        """The kind of ``lease_id`` if it expired as a lease of ``session_id`` (and of ``kind``,
        when given); None otherwise: another session's id is unknown to this one, whatever
        became of it."""
        ended = self._expired_of.get(lease_id)
        if ended is None or ended[0] != session_id or (kind is not None and ended[1] != kind):
            return None
        return ended[1]

    def expired(self) -> list[Lease]:
        """Leases whose deadline has passed, as of the clock now (not removed)."""
        now = self._clock()
        return [lease for lease in self._leases.values() if lease.expires_at <= now]

    def mark_expired(self, lease: Lease) -> None:
        if len(self._expired) == self._expired.maxlen:
            self._expired_of.pop(self._expired[0], None)
        self._expired.append(lease.lease_id)
        self._expired_of[lease.lease_id] = (lease.session_id, lease.kind)
