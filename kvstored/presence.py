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
        self._slots = view[layout.HEADER.size: slots_end].cast("Q")
        self._rows = np.frombuffer(self._map, np.uint64, buckets * layout.SLOTS,
                                   layout.HEADER.size).reshape(buckets, layout.SLOTS)
        self._overflow = view[slots_end:]
        self.overflowed = 0   # buckets marked overflowed

    def set(self, namespace_id: int, key: bytes, state: int) -> None:
        """Record the presence ``state`` of a block (0: not readable)."""
        self._put(layout.fingerprint(namespace_id, key), state)

    def set_many(self, namespace_id: int, keys: list[bytes], states: list[int]) -> None:
        """:meth:`set` for each of ``keys`` (distinct, all of one size), with the same outcome
        slot for slot. A batch of blocks all new to the table (a seal's, a restore's) is placed
        by numpy, in order, each into the first free slot of its bucket left by those before it;
        any other, and a small one, one block at a time."""
        if not keys:
            return
        if len(keys) <= SMALL_BATCH:
            for key, st in zip(keys, states):
                self._put(layout.fingerprint(namespace_id, key), st)
            return
        fps = layout.fingerprints(namespace_id, b"".join(keys), len(keys[0]))
        state = np.asarray(states, np.uint64)
        buckets = ((fps >> np.uint64(layout.BUCKET_SHIFT)) & np.uint64(self.buckets - 1)).astype(np.intp)
        rows = self._rows[buckets]                       # a snapshot: nothing is written yet
        known = ((rows & _FP_MASK) == fps[:, None]).any(axis=1)
        if known.any():   # (a block leaving the table may free a slot for one after it)
            for fp, st in zip(fps.tolist(), states):
                self._put(fp, st)
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
            # each an aligned 8-byte store (numpy copies a uint64 element as one)
            self._rows[nb[fits], slot[fits]] = fps[new[fits]] | state[new[fits]]
            for bucket in np.unique(nb[~fits]).tolist():
                if not self._overflow[bucket]:
                    self._overflow[bucket] = 1
                    self.overflowed += 1

    def _put(self, fp: int, state: int) -> None:
        bucket = (fp >> layout.BUCKET_SHIFT) & (self.buckets - 1)
        slots = self._slots
        base = bucket * layout.SLOTS
        row = slots[base: base + layout.SLOTS].tolist()
        for old in (fp | layout.DRAM, fp | layout.SSD, fp | layout.PROMOTING):
            if old in row:
                new = fp | state if state else 0
                if old != new:
                    slots[base + row.index(old)] = new   # one aligned 8-byte store
                return
        if not state:
            return
        if 0 in row:
            slots[base + row.index(0)] = fp | state
        elif not self._overflow[bucket]:
            self._overflow[bucket] = 1
            self.overflowed += 1

    def verify(self, blocks: Iterable[tuple[int, bytes, int]]) -> list[str]:
        """How the table differs from ``blocks`` (namespace id, key, presence: every block of
        the index), one line a difference; [] when it matches (an overflowed bucket may lack
        blocks, never hold a wrong one)."""
        expected: dict[int, int] = {}
        for namespace_id, key, state in blocks:
            if state:
                expected[layout.fingerprint(namespace_id, key)] = state
        problems: list[str] = []
        slots = self._slots
        seen: set[int] = set()
        for i in range(len(slots)):
            value = slots[i]
            if not value:
                continue
            fp, state = value & ~layout.STATE_MASK, value & layout.STATE_MASK
            seen.add(fp)
            if expected.get(fp) != state:
                problems.append(f"slot {i}: fingerprint {fp:#x} state {state}, the index says "
                                f"{expected.get(fp, 'not readable')}")
        for fp, state in expected.items():
            if fp not in seen and not self._overflow[layout.bucket_of(fp, self.buckets)]:
                problems.append(f"fingerprint {fp:#x} (state {state}) missing from its bucket")
        return problems

    def close(self) -> None:
        """Unmap it and remove the file (unless another daemon has made its own there since)."""
        del self._rows   # (its export of the map: the last reference)
        self._slots.release()
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
