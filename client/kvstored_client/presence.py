"""The SDK's end of the presence table: lookups answered from the daemon's shared-memory table.

A :class:`PresenceReader` maps a daemon's table read-only (its header must name the instance the
daemon's ``Hello`` named) and holds a connection to the daemon's fast socket that says whether its
daemon is still there (the daemon never writes on it: closed or readable, it is gone). Each
lookup the table answers is sent to the daemon one-way (``frames.ONE_WAY``), on the connection
the caller's next call is likely to take (else on the table's own): the daemon records the hits
for its eviction policy and starts promoting SSD-only blocks as for any lookup, before that
call. The table is read first, then the daemon's presence checked and the lookup sent, so an
answer given was read while its daemon was still there.

:meth:`PresenceReader.locate` and :meth:`PresenceReader.confirm` are the two halves of a load
without a lease (a seqlock read of the table's where words, see the layout): where each block's
bytes are, then, after the caller copied them, whether every block was that block throughout.
Only on x86-64, whose loads are not reordered with each other (:data:`ORDERED_LOADS`); elsewhere
loads take the lease.
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import socket
import threading
from dataclasses import dataclass

import numpy as np

from kvstored_client.contract import frames
from kvstored_client.contract import presence as layout
from kvstored_client.contract.proto import kvstored_pb2 as pb

SCALAR_KEYS = 4   # chains this short are fingerprinted in plain Python (numpy's per-call cost is more)
_FP_MASK = np.uint64(~layout.STATE_MASK & ((1 << 64) - 1))
# Loads kept in program order by the hardware (x86-64's TSO), which a read without a lease needs;
# AArch64 and others would need barriers Python cannot issue.
ORDERED_LOADS = platform.machine().lower() in ("x86_64", "amd64")


@dataclass(frozen=True, slots=True)
class Located:
    """Where the blocks of a load are, as :meth:`PresenceReader.locate` read them: ``hits``
    (blocks of the longest cached prefix), and for blocks ``start`` to ``hits`` their slot
    indices, the slot words (fingerprint and state DRAM) and where words read, and the arena
    offsets those name."""

    hits: int
    slots: list[int]
    values: list[int]
    words: list[int]

    @property
    def offsets(self) -> list[int]:
        return [(w & layout.OFFSET_MASK) * layout.WHERE_UNIT for w in self.words]


class TableUnusable(Exception):
    """The table cannot be opened or is not the named daemon's."""


class PresenceReader:
    """The table at ``path`` of daemon ``instance_id``, whose fast socket is ``fast_socket``;
    :class:`TableUnusable` when it cannot be opened, is another daemon's, or the socket refuses."""

    def __init__(self, path: str, instance_id: int, fast_socket: str, timeout_s: float,
                 arena_path: str = "") -> None:
        self.arena_path = arena_path   # the arena of the same daemon (its Hello's), whose offsets the table names
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TableUnusable(f"{path}: {exc.strerror or exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size < layout.HEADER.size:
                raise TableUnusable(f"{path}: {size} bytes, no header")
            table = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as exc:
            raise TableUnusable(f"{path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        magic, version, buckets, instance, _ = layout.HEADER.unpack_from(table)
        if magic != layout.MAGIC or version != layout.VERSION or instance != instance_id \
                or buckets <= 0 or buckets & (buckets - 1) or size != layout.file_bytes(buckets):
            raise TableUnusable(f"{path}: not the table of daemon instance {instance_id}")
        self.buckets = buckets
        self._mask = buckets - 1
        slots_end = layout.HEADER.size + buckets * layout.SLOTS * 8
        where_end = slots_end + buckets * layout.SLOTS * 8
        # views keep the map alive (never closed here: another thread may be reading it)
        self._slots = np.frombuffer(table, np.uint64, buckets * layout.SLOTS, layout.HEADER.size)
        self._rows = self._slots.reshape(buckets, layout.SLOTS)
        self._where = np.frombuffer(table, np.uint64, buckets * layout.SLOTS, slots_end)
        self._overflow = np.frombuffer(table, np.uint8, buckets, where_end)
        self._words = memoryview(table)[layout.HEADER.size: slots_end].cast("Q")
        self._where_words = memoryview(table)[slots_end: where_end].cast("Q")
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._fast_socket = fast_socket
        self._timeout = timeout_s
        try:
            self._sock: socket.socket | None = self._connect()
        except OSError as exc:
            raise TableUnusable(f"{fast_socket}: {exc.strerror or exc}") from None
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP)
        self._poll_lock = threading.Lock()   # a poll object serves one poll() at a time

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            sock.connect(self._fast_socket)
        except OSError:
            sock.close()
            raise
        return sock

    def lookup(self, namespace_id: int, packed: bytes, size: int) -> tuple[int, int] | None:
        """(blocks of the longest cached prefix, how many of them are on SSD only) of the
        ``size``-byte keys laid end to end in ``packed``; None when the table cannot say (the
        first miss falls in an overflowed bucket)."""
        n = len(packed) // size
        if n <= SCALAR_KEYS:
            return self._lookup_few(namespace_id, packed, size, n)
        if self._lookup_few(namespace_id, packed, size, 1) == (0, 0):
            return 0, 0   # a new prompt: its first block says so, without fingerprinting the rest
        fps = layout.fingerprints(namespace_id, packed, size)
        buckets = ((fps >> np.uint64(layout.BUCKET_SHIFT)) & np.uint64(self._mask)).astype(np.intp)
        rows = self._rows[buckets]                       # (n, 8): one gather
        match = (rows & _FP_MASK) == fps[:, None]
        present = match.view(np.uint64).ravel() != 0    # a row's 8 bools as one word: any of them
        hits = n if present.all() else int(present.argmin())
        if hits < n and self._overflow[buckets[hits]]:
            return None
        ssd = match[:hits] & ((rows[:hits] & np.uint64(layout.STATE_MASK)) == layout.SSD)
        return hits, int(np.count_nonzero(ssd))

    def _lookup_few(self, namespace_id: int, packed: bytes, size: int, n: int) -> tuple[int, int] | None:
        words, mask, shift = self._words, self._mask, layout.BUCKET_SHIFT
        ssd = 0
        for i in range(n):
            fp = layout.fingerprint(namespace_id, packed[i * size: (i + 1) * size])
            bucket = (fp >> shift) & mask
            base = bucket * layout.SLOTS
            for j in range(base, base + layout.SLOTS):
                value = words[j]
                if value & ~layout.STATE_MASK == fp:
                    ssd += (value & layout.STATE_MASK) == layout.SSD
                    break
            else:
                if self._overflow[bucket]:
                    return None
                return i, ssd
        return n, ssd

    def locate(self, namespace_id: int, packed: bytes, size: int, start: int) -> Located | None:
        """Where to read blocks ``start`` on of the longest cached prefix of the ``size``-byte
        keys in ``packed`` without a lease: each must be in DRAM with its where word set (blocks
        before ``start`` need only be cached). None when the table cannot say so: a block to read
        is on SSD, being promoted or not published, or the first miss falls in an overflowed
        bucket. Reads each slot word before its where word (see :meth:`confirm`)."""
        n = len(packed) // size
        if n <= SCALAR_KEYS:
            return self._locate_few(namespace_id, packed, size, n, start)
        fps = layout.fingerprints(namespace_id, packed, size)
        buckets = ((fps >> np.uint64(layout.BUCKET_SHIFT)) & np.uint64(self._mask)).astype(np.intp)
        rows = self._rows[buckets]                       # (n, 8): every slot word, then...
        match = (rows & _FP_MASK) == fps[:, None]
        present = match.view(np.uint64).ravel() != 0
        hits = n if present.all() else int(present.argmin())
        if hits < n and self._overflow[buckets[hits]]:
            return None
        if hits <= start:
            return Located(hits, [], [], [])
        column = match[start:hits].argmax(axis=1)
        slots = buckets[start:hits] * layout.SLOTS + column
        values = rows[np.arange(start, hits), column]
        if ((values & np.uint64(layout.STATE_MASK)) != layout.DRAM).any():
            return None
        words = self._where[slots]                       # ...the where words, after them
        if not words.all():
            return None
        return Located(hits, slots.tolist(), values.tolist(), words.tolist())

    def _locate_few(self, namespace_id: int, packed: bytes, size: int, n: int, start: int) -> Located | None:
        words, where, mask, shift = self._words, self._where_words, self._mask, layout.BUCKET_SHIFT
        slots: list[int] = []
        values: list[int] = []
        found: list[int] = []
        hits = n
        for i in range(n):
            fp = layout.fingerprint(namespace_id, packed[i * size: (i + 1) * size])
            bucket = (fp >> shift) & mask
            base = bucket * layout.SLOTS
            for j in range(base, base + layout.SLOTS):
                value = words[j]
                if value & ~layout.STATE_MASK == fp:
                    if i >= start:
                        if value & layout.STATE_MASK != layout.DRAM:
                            return None
                        word = where[j]   # after the slot word
                        if not word:
                            return None
                        slots.append(j)
                        values.append(value)
                        found.append(word)
                    break
            else:
                if self._overflow[bucket]:
                    return None
                hits = i
                break
        return Located(hits, slots, values, found)

    def confirm(self, located: Located) -> bool:
        """Whether the bytes copied after :meth:`locate` are its blocks': each slot word, then
        each where word, read again, unchanged. (A where word read twice the same names one
        publication throughout, during which its slot word and bytes stayed as they were; the
        slot word read between says whose publication it was.)"""
        slots = located.slots
        if len(slots) <= SCALAR_KEYS:
            words, where = self._words, self._where_words
            return [words[j] for j in slots] == located.values and [where[j] for j in slots] == located.words
        idx = np.asarray(slots, np.intp)
        values = self._slots[idx]
        return values.tolist() == located.values and self._where[idx].tolist() == located.words

    def alive(self) -> bool:
        """Whether the table's daemon is still there: its end of the table's connection, on
        which it never writes, is neither closed nor readable (one poll, no waiting)."""
        sock = self._sock
        if sock is None or self._pid != os.getpid():
            return sock is not None   # (a forked child's first tell() connects anew)
        try:
            with self._poll_lock:
                return not self._poll.poll(0)
        except (OSError, ValueError):
            return False

    @staticmethod
    def frame(request: pb.LookupRequest) -> bytes:
        """``request`` as a one-way frame."""
        return frames.one_way_frame("Lookup", request)

    def tell(self, frame: bytes) -> None:
        """Send ``frame`` (see :meth:`frame`) to the daemon on the table's own connection;
        OSError when it is gone (or the socket is)."""
        if self._pid != os.getpid():
            # a forked child: the connection is its parent's, and so is the lock (another thread
            # of the parent may have held it at the fork)
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._sock = self._connect()
            self._poll = select.poll()
            self._poll.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP)
            self._poll_lock = threading.Lock()
        with self._lock:
            if self._sock is None:
                raise ConnectionResetError(0, "the presence table's connection is closed")
            self._sock.sendall(frame)

    def close(self) -> None:
        """Close the connection (the map goes with the last reference to it)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
