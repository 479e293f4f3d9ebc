"""The DRAM tier: one shared-memory arena, pre-faulted at start, carved into fixed-size slots.

The arena is a file in the shared-memory directory that clients map too, so block bytes move by
plain memory copies on the node. It is split into pages; a page serves slots of one size only
(blocks of one payload size), and returns to the free pool when its last slot is freed.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstored_client.contract.shm_files import sweep_dead_owners

SLOT_ALIGN = 64  # a cache line: keeps every slot's copies aligned


def slot_size(block_bytes: int) -> int:
    """Bytes a block of ``block_bytes`` occupies in the arena."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


_ARENA_NAME = re.compile(r"^kvstored-(\d+)-[0-9a-f]+$")


def sweep_stale_arenas(shm_dir: str) -> list[str]:
    """Unlink arena files left by daemons that died without ``close`` (kill -9, OOM kill): files
    named like ours, owned by this user, whose creating process no longer exists and that no
    process holds locked (:func:`kvstored_client.contract.shm_files.sweep_dead_owners`). Returns their names.
    A daemon in another PID namespace (a container sharing the directory) keeps its arena: it
    holds it locked."""
    return sweep_dead_owners(shm_dir, _ARENA_NAME)


class ArenaTooLarge(ValueError):
    """The arena would not fit in the shared-memory directory."""


class Arena:
    """A shared-memory file mapped read-write, locked (shared) while this process has it open so
    that no other daemon's sweep takes it for a dead one's. ``close`` unmaps and unlinks it.

    With ``prefault``, every page is reserved and populated at start, a GiB at a time, calling
    ``progress(bytes done, capacity)`` after each (reserving counts for the first half); whatever
    ``progress`` raises ends the start with no file left.

    Raises ArenaTooLarge when ``capacity`` exceeds the directory's free space (touching pages
    beyond it would kill the process with SIGBUS), OSError when the file cannot be made."""

    def __init__(self, shm_dir: str, capacity: int, mode: int = 0o660, prefault: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> None:
        free = _free_bytes(shm_dir)
        if free is not None and capacity > free:
            raise ArenaTooLarge(f"dram.capacity of {capacity >> 20} MiB does not fit in {shm_dir}: "
                                f"{free >> 20} MiB free there")
        name = f"kvstored-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = Path(shm_dir) / name
        self.capacity = capacity
        # Made under a name the sweep ignores, locked, then renamed: another daemon's sweep never
        # sees the arena unlocked.
        making = Path(shm_dir) / f".{name}.new"
        old_umask = os.umask(0)
        try:
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        finally:
            os.umask(old_umask)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.rename(making, self.path)
            if prefault:
                # Reserve every page now: a full tmpfs is an error here, not a SIGBUS later.
                for start, end in _chunks(capacity):
                    os.posix_fallocate(fd, start, end - start)
                    if progress is not None:
                        progress(end // 2, capacity)
            else:
                os.ftruncate(fd, capacity)
            self._mmap = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            making.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)
        if prefault:
            try:
                self._prefault(progress)
            except BaseException:   # a stop asked for meanwhile (``progress`` raised): no arena left
                self.close()
                raise

    def _prefault(self, progress: Callable[[int, int], None] | None) -> None:
        # A fresh page costs ~10x a copy into a warm one: pay it once, at start.
        advice = getattr(mmap, "MADV_POPULATE_WRITE", None)
        for start, end in _chunks(self.capacity):
            if advice is not None:
                try:
                    self._mmap.madvise(advice, start, end - start)
                except OSError:
                    advice = None
            if advice is None:
                self.buf[start:end:mmap.PAGESIZE] = 0
            if progress is not None:
                progress((self.capacity + end) // 2, self.capacity)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buf[offset: offset + nbytes]

    def huge_page_bytes(self) -> int | None:
        """Bytes of the arena mapped here with huge pages (2 MiB; the shared-memory directory's
        tmpfs decides: ``huge=within_size``), from ``/proc/self/smaps``; None where it does not
        say. Copies into and out of 4 KiB pages run slower (TLB misses)."""
        return mapped_huge_bytes(self.buf.ctypes.data)

    def close(self) -> None:
        del self.buf
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping dies with the process
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)


def mapped_huge_bytes(address: int, smaps: str = "/proc/self/smaps") -> int | None:
    """``ShmemPmdMapped`` + ``FilePmdMapped`` of the mapping holding ``address`` in ``smaps``
    (bytes); None when the file or the fields are missing."""
    try:
        with open(smaps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside, total, seen = False, 0, False
    for line in lines:
        head, _, rest = line.partition(" ")
        if "-" in head and ":" not in head:   # a mapping's first line: "lo-hi perms offset dev inode path"
            if inside:
                break
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) <= address < int(hi, 16)
            except ValueError:
                inside = False
        elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
            total += int(rest.split()[0]) << 10
            seen = True
    return total if seen else None


PREFAULT_CHUNK = 1 << 30   # reserve and populate the arena a GiB at a time, reporting after each


def _chunks(total: int) -> list[tuple[int, int]]:
    return [(start, min(start + PREFAULT_CHUNK, total)) for start in range(0, total, PREFAULT_CHUNK)]


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None   # the open below reports what is wrong with the directory
    return st.f_bavail * st.f_frsize


@dataclass(slots=True)
class _Page:
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    used: int = 0


class SlotAllocator:
    """Pages of ``page_bytes`` carved into slots of one size each; pure bookkeeping of offsets."""

    def __init__(self, capacity: int, page_bytes: int) -> None:
        assert capacity >= page_bytes > 0, "arena must hold at least one page"
        self.page_bytes = page_bytes
        self.num_pages = capacity // page_bytes
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._pages: dict[int, _Page] = {}
        self._partial: dict[int, set[int]] = {}  # slot size -> pages with a free slot
        self.used_bytes = 0

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_bytes

    def alloc(self, slot_bytes: int) -> int | None:
        """A free slot's offset, or None when no page of this size has room and no page is free."""
        assert 0 < slot_bytes <= self.page_bytes, f"slot of {slot_bytes} B exceeds the page size"
        partial = self._partial.setdefault(slot_bytes, set())
        if not partial:
            if not self._free_pages:
                return None
            index = self._free_pages.pop()
            base = index * self.page_bytes
            count = self.page_bytes // slot_bytes
            self._pages[index] = _Page(slot_bytes, [base + k * slot_bytes for k in range(count - 1, -1, -1)])
            partial.add(index)
        index = next(iter(partial))
        page = self._pages[index]
        offset = page.free.pop()
        page.used += 1
        if not page.free:
            partial.discard(index)
        self.used_bytes += slot_bytes
        return offset

    def used_slots(self, index: int) -> int:
        """Slots in use in page ``index`` (0: a free page)."""
        page = self._pages.get(index)
        return page.used if page is not None else 0

    def pages(self) -> list[tuple[int, int]]:
        """``(index, slot_bytes)`` of every page that holds slots."""
        return [(index, page.slot_bytes) for index, page in self._pages.items()]

    def free(self, offset: int) -> None:
        index = offset // self.page_bytes
        page = self._pages.get(index)
        assert page is not None, f"free of offset {offset} in an unassigned page"
        page.free.append(offset)
        page.used -= 1
        self.used_bytes -= page.slot_bytes
        if page.used == 0:
            del self._pages[index]
            self._partial[page.slot_bytes].discard(index)
            self._free_pages.append(index)
        else:
            self._partial[page.slot_bytes].add(index)
