"""Saves that return without their answer (``save(wait=False)``): their Commits in flight on
one fast-path connection, in order, and the answers read back later (by the next call, a table
read, :meth:`WriteBehind.settle`)."""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.proto import kvstored_pb2 as pb
from kvstored_client.errors import from_rpc_error
from kvstored_client.fast_path import FastChannel, FrameCallError, Sent
from kvstored_client.spares import SpareSlots

MAX_IN_FLIGHT = 4   # a fifth save first reads the oldest answer: the spares it returns, back-pressure


@dataclass(frozen=True, slots=True)
class InFlight:
    """A Commit sent: rows for ``blocks`` blocks from block ``first`` on."""

    sent: Sent
    session: str
    block_bytes: int
    first: int
    blocks: int


class WriteBehind:
    """The Commits sent and not answered yet, oldest first (thread-safe). Their answers give the
    spare slots back; what they did not store is counted in :attr:`lost_blocks`, their failures
    in :attr:`failed` (the last in :attr:`last_error`): a save sent this way cannot raise them."""

    def __init__(self, fast: FastChannel, spares: SpareSlots) -> None:
        self._fast = fast
        self._spares = spares
        self._lock = threading.Lock()
        self._in_flight: deque[InFlight] = deque()
        self._pid = os.getpid()
        self.stored_blocks = 0   # blocks the answers said were stored
        self.lost_blocks = 0     # blocks whose rows were sent that are not cached after their Commit
        self.failed = 0          # Commits that failed (their rows' blocks are in lost_blocks)
        self.last_error: KVStoreError | None = None

    def __len__(self) -> int:
        return len(self._in_flight)

    def send(self, request: pb.CommitRequest, block_bytes: int, blocks: int, timeout_s: float | None) -> None:
        """Send ``request`` behind the Commits in flight (the daemon serves them in order).
        Raises as :meth:`FastChannel.send` (nothing in flight changes then)."""
        self._forked()
        with self._lock:
            while len(self._in_flight) >= MAX_IN_FLIGHT:
                self._settle_one()
            if self._in_flight and self._in_flight[-1].sent.sock.fileno() < 0:
                while self._in_flight:   # their connection failed: counted, and this goes on a new one
                    self._settle_one()
            after = self._in_flight[-1].sent if self._in_flight else None
            sent = self._fast.send("Commit", request, timeout_s, after=after)
            self._in_flight.append(InFlight(sent, request.session_id, block_bytes, request.first, blocks))

    def settle(self) -> None:
        """Read every answer still owed: the blocks of the saves sent so far are cached (or
        counted lost) when this returns."""
        self._forked()
        if not self._in_flight:
            return
        with self._lock:
            while self._in_flight:
                self._settle_one()

    def settle_oldest(self) -> bool:
        """Read the oldest answer still owed (the spare slots it gives back let the next save go
        on while the others are on their way); False when none is owed."""
        self._forked()
        with self._lock:
            if not self._in_flight:
                return False
            self._settle_one()
            return True

    def _forked(self) -> None:
        # (before taking the lock: a parent's thread may have held it, reading an answer, at the fork)
        if os.getpid() != self._pid:   # the parent's connections and answers are not a child's
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._in_flight.clear()

    def _settle_one(self) -> None:
        f = self._in_flight.popleft()
        try:
            done = self._fast.answer(f.sent, pb.CommitResponse)
        except FrameCallError as exc:
            # (no slot it named is used again: the daemon may have bound them; see SpareSlots)
            self.failed += 1
            self.lost_blocks += f.blocks
            self.last_error = from_rpc_error(exc)
            return
        self._spares.give(f.session, f.block_bytes, done.spare_offsets)
        self.stored_blocks += done.stored_blocks
        cached = done.present_blocks + done.stored_blocks
        self.lost_blocks += f.blocks if done.present_blocks < f.first else max(0, f.first + f.blocks - cached)
