"""The session's spare slots as the SDK keeps them: DRAM slots the daemon handed this session,
bound to no block, that a save copies its rows into before one Commit names the blocks."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable


class SpareSlots:
    """Offsets of spare slots by block size, for one session at a time (thread-safe). A slot is
    taken out before rows are copied into it and comes back only when the daemon says so (a
    Commit's ``spare_offsets``): after a Commit that got no answer, the slots it named may hold
    blocks now, and are never written again (the daemon frees them when the session ends)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._session = ""
        self._pid = os.getpid()
        self._by_size: dict[int, list[int]] = {}
        self.limit_bytes = 0   # what the session may hold (the daemon's dram.spare_bytes, capped)

    def renew(self, session_id: str, limit_bytes: int) -> None:
        """A new session: the old one's slots are not this one's."""
        with self._lock:
            self._session, self.limit_bytes = session_id, limit_bytes
            self._by_size = {}

    def wanted(self, block_bytes: int, blocks: int) -> int:
        """How many to ask the daemon to keep for saves of ``blocks`` blocks: four saves' worth
        (as many as fit), so that saves sent without waiting for their answers find slots while
        those answers are on their way (0: not even one save's fit)."""
        fit = self.limit_bytes // block_bytes if block_bytes else 0
        return min(4 * blocks, fit) if blocks <= fit else 0

    def usable(self, session_id: str) -> bool:
        """Whether this process may ask for and use spare slots of ``session_id`` (its own
        session, not a parent's it was forked with)."""
        return bool(self.limit_bytes) and session_id == self._session and os.getpid() == self._pid

    def take(self, session_id: str, block_bytes: int, n: int) -> list[int] | None:
        """``n`` slots of ``block_bytes`` (the lowest offsets, so that consecutive ones make one
        run to copy), or None when fewer are held (nothing is taken then)."""
        with self._lock:
            if session_id != self._session or os.getpid() != self._pid:
                return None   # (a forked child writing its parent's slots would corrupt the parent's saves)
            held = self._by_size.get(block_bytes)
            if held is None or len(held) < n:
                return None
            taken, held[:] = held[:n], held[n:]
            return taken

    def give(self, session_id: str, block_bytes: int, offsets: Iterable[int]) -> None:
        """Slots the daemon says the session holds (again), in no particular order."""
        with self._lock:
            if session_id != self._session or os.getpid() != self._pid:
                return
            held = self._by_size.setdefault(block_bytes, [])
            held.extend(offsets)
            held.sort()
