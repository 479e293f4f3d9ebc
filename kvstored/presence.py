"""The daemon's end of the presence table: every readable block, in a shared-memory file.

Layout, fingerprints and states: :mod:`kvstored_client.contract.presence`. The file is made anew
at each start (a stale one, a dead daemon's, is unlinked first: a reader never takes a table
whose daemon is gone for this one's) with the sockets' mode in their directory, so exactly who may
open the socket may read it, and is written only here, on the event loop: each prefix index tells
:meth:`PresenceTable.set` of every change of a block's presence (``PrefixIndex.changed``), before
the loop runs anything else, so the table equals the index whenever a client can look. A bucket
that has no free slot for a block is marked overflowed for good (the SDK then asks the daemon for
any miss there): the table is sized from the configured capacities instead of grown, since a
larger one would have to be filled from the whole index on the loop, seconds for millions of
blocks.

Beside each slot of a block in DRAM it publishes where the block's bytes are (see the layout's
where words), so that the SDK can copy them without a lease: :meth:`PresenceTable.set` is told
the block's arena offset and clears the word before anything else of the slot changes (the
index tells it before the arena slot is given back or written again).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvstored_client.contract import presence as layout

# A block's size for sizing the table: smaller blocks than this (KV blocks of 16 tokens are
# larger for most models) fill it faster than planned, and overflowing buckets fall back.
TYPICAL_BLOCK_BYTES = 64 << 10
_FP_MASK = np.uint64(((1 << 64) - 1) & ~layout.STATE_MASK)
# Up to this many blocks a batch is placed one block at a time: numpy's fixed cost (~20 calls)
# was most of a one-block seal's time in the daemon, where each block alone costs ~2-3 us.
SMALL_BATCH = 16
_SERIALS = (1 << layout.SERIAL_BITS) - 1   # serials run 1 .. this, then again


def planned_buckets(dram_bytes: int, ssd_bytes: int) -> int:
    """Buckets for the blocks the tiers can hold at :data:`TYPICAL_BLOCK_BYTES` each."""
    return layout.bucket_count((dram_bytes + ssd_bytes) // TYPICAL_BLOCK_BYTES)


class PresenceTable:
    """A new table at ``path`` (file mode ``mode``) of ``buckets`` buckets (a power of two)."""

    def __init__(self, path: Path, buckets: int, mode: int) -> None:
        assert buckets > 0 and buckets & (buckets - 1) == 0, "buckets must be a power of two"
        self.path = path
        self.buckets = buckets
        self.instance_id = secrets.randbits(63) or 1
        with contextlib.suppress(FileNotFoundError):
            path.unlink()   # a dead daemon's: readers that hold it see its daemon gone, not this one
        size = layout.file_bytes(buckets)
        old_umask = os.umask(0o777 & ~mode)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        finally:
            os.umask(old_umask)
        try:
            os.fchmod(fd, mode)
            # zeros: every slot free; allocated now, so that a full tmpfs refuses the table here
            # rather than kill the daemon with SIGBUS at the first write to a page it has no room for
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink()
            raise
        self._fd = fd   # kept: whether the path is still this file (see close)
        self._map[: layout.HEADER.size] = layout.HEADER.pack(layout.MAGIC, layout.VERSION, buckets,
                                                              self.instance_id, 1)
        self._view = view = memoryview(self._map)
        slots_end = layout.HEADER.size + buckets * layout.SLOTS * 8
        where_end = slots_end + buckets * layout.SLOTS * 8
        self._slots = view[layout.HEADER.size: slots_end].cast("Q")
        self._rows = np.frombuffer(self._map, np.uint64, buckets * layout.SLOTS,
                                   layout.HEADER.size).reshape(buckets, layout.SLOTS)
        self._where = view[slots_end: where_end].cast("Q")
        self._where_rows = np.frombuffer(self._map, np.uint64, buckets * layout.SLOTS,
                                         slots_end).reshape(buckets, layout.SLOTS)
        self._overflow = view[where_end:]
        self._serial = 0   # the last publication's (see _publish)
        self.overflowed = 0   # buckets marked overflowed

    def set(self, namespace_id: int, key: bytes, state: int, offset: int = -1) -> None:
        """Record the presence ``state`` of a block (0: not readable) and, in state DRAM, the
        arena ``offset`` of its bytes, final now (-1: none to publish; see the layout's where
        words)."""
        self._put(layout.fingerprint(namespace_id, key), state, offset)

    def set_many(self, namespace_id: int, keys: list[bytes], states: list[int],
                 offsets: list[int] | None = None) -> None:
        """:meth:`set` for each of ``keys`` (distinct, all of one size) with its state and
        offset, with the same outcome slot for slot. A batch of blocks all new to the table (a
        seal's, a restore's) is placed by numpy, in order, each into the first free slot of its
        bucket left by those before it; any other, and a small one, one block at a time."""
        if not keys:
            return
        offs = offsets if offsets is not None else [-1] * len(keys)
        if len(keys) <= SMALL_BATCH:
            for key, st, off in zip(keys, states, offs):
                self._put(layout.fingerprint(namespace_id, key), st, off)
            return
        fps = layout.fingerprints(namespace_id, b"".join(keys), len(keys[0]))
        state = np.asarray(states, np.uint64)
        buckets = ((fps >> np.uint64(layout.BUCKET_SHIFT)) & np.uint64(self.buckets - 1)).astype(np.intp)
        rows = self._rows[buckets]                       # a snapshot: nothing is written yet
        known = ((rows & _FP_MASK) == fps[:, None]).any(axis=1)
        if known.any():   # (a block leaving the table may free a slot for one after it)
            for fp, st, off in zip(fps.tolist(), states, offs):
                self._put(fp, st, off)
            return
        new = np.flatnonzero(state != 0)
        if new.size:
            nb = buckets[new]
            order = np.argsort(nb, kind="stable")
            sb = nb[order]
            starts = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
            rank = np.empty(new.size, np.intp)   # how many new ones before it in its bucket
            rank[order] = np.arange(new.size) - np.repeat(starts, np.diff(np.r_[starts, new.size]))
            free = rows[new] == 0
            nth = np.cumsum(free, axis=1)
            fits = nth[:, -1] > rank
            slot = np.argmax(free & (nth == (rank + 1)[:, None]), axis=1)
            # each an aligned 8-byte store (numpy copies a uint64 element as one); the where
            # words after all the slots (a free slot's is 0)
            placed = new[fits]
            self._rows[nb[fits], slot[fits]] = fps[placed] | state[placed]
            at = np.asarray(offs, np.int64)[placed]
            publish = (state[placed] == layout.DRAM) & (at >= 0)
            if publish.any():
                count = int(np.count_nonzero(publish))
                serials = (np.arange(self._serial, self._serial + count, dtype=np.uint64)
                           % np.uint64(_SERIALS)) + np.uint64(1)
                self._serial = (self._serial + count - 1) % _SERIALS + 1
                self._where_rows[nb[fits][publish], slot[fits][publish]] = \
                    (serials << np.uint64(layout.OFFSET_BITS)) \
                    | (at[publish] // layout.WHERE_UNIT).astype(np.uint64)
            for bucket in (np.unique(nb[~fits]).tolist() if not fits.all() else ()):
                if not self._overflow[bucket]:
                    self._overflow[bucket] = 1
                    self.overflowed += 1

    def _put(self, fp: int, state: int, offset: int) -> None:
        bucket = (fp >> layout.BUCKET_SHIFT) & (self.buckets - 1)
        slots, where = self._slots, self._where
        base = bucket * layout.SLOTS
        row = slots[base: base + layout.SLOTS].tolist()
        new = fp | state if state else 0
        for old in (fp | layout.DRAM, fp | layout.SSD, fp | layout.PROMOTING):
            if old in row:
                i = base + row.index(old)
                published = where[i]
                if published and (new != old or layout.where_offset(published) != offset):
                    where[i] = 0   # first: a reader's second look sees the publication over
                    published = 0
                if old != new:
                    slots[i] = new   # one aligned 8-byte store
                if not published and state == layout.DRAM and offset >= 0:
                    where[i] = self._publish(offset)
                return
        if not state:
            return
        if 0 in row:
            i = base + row.index(0)
            slots[i] = new
            if state == layout.DRAM and offset >= 0:
                where[i] = self._publish(offset)   # after the slot word (its where word is 0)
        elif not self._overflow[bucket]:
            self._overflow[bucket] = 1
            self.overflowed += 1

    def _publish(self, offset: int) -> int:
        """A where word for ``offset`` under the next serial."""
        self._serial = self._serial % _SERIALS + 1
        return layout.where(offset, self._serial)

    def verify(self, blocks: Iterable[tuple[int, bytes, int, int]]) -> list[str]:
        """How the table differs from ``blocks`` (namespace id, key, presence, arena offset or
        -1: every block of the index), one line a difference; [] when it matches (an overflowed
        bucket may lack blocks, never hold a wrong one). A block in DRAM with an offset must
        have its where word name that offset; every other slot's where word must be 0."""
        expected: dict[int, tuple[int, int]] = {}
        for namespace_id, key, state, offset in blocks:
            if state:
                expected[layout.fingerprint(namespace_id, key)] = (state, offset)
        problems: list[str] = []
        slots, where = self._slots, self._where
        seen: set[int] = set()
        for i in range(len(slots)):
            value, word = slots[i], where[i]
            if not value:
                if word:
                    problems.append(f"slot {i}: free, but its where word is {word:#x}")
                continue
            fp, state = value & ~layout.STATE_MASK, value & layout.STATE_MASK
            seen.add(fp)
            want_state, offset = expected.get(fp, (0, -1))
            if want_state != state:
                problems.append(f"slot {i}: fingerprint {fp:#x} state {state}, the index says "
                                f"{want_state or 'not readable'}")
            elif state == layout.DRAM and offset >= 0:
                if not word or layout.where_offset(word) != offset:
                    problems.append(f"slot {i}: fingerprint {fp:#x} in DRAM at offset {offset}, its "
                                    f"where word is {word:#x}")
            elif word:
                problems.append(f"slot {i}: fingerprint {fp:#x} state {state} (no bytes to read "
                                f"without a lease), but its where word is {word:#x}")
        for fp, (state, _) in expected.items():
            if fp not in seen and not self._overflow[layout.bucket_of(fp, self.buckets)]:
                problems.append(f"fingerprint {fp:#x} (state {state}) missing from its bucket")
        return problems

    def close(self) -> None:
        """Unmap it and remove the file (unless another daemon has made its own there since)."""
        del self._rows, self._where_rows   # (their exports of the map: the last references)
        self._slots.release()
        self._where.release()
        self._overflow.release()
        self._view.release()
        self._map.close()
        # ours while it has a link and the path names its inode (an unlinked file's inode number
        # may be a successor's now)
        mine = os.fstat(self._fd)
        with contextlib.suppress(OSError):
            there = self.path.lstat()
            if mine.st_nlink and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                self.path.unlink()
        os.close(self._fd)
