"""The SSD tier's payload files: one per block size, in fixed slots, written and read with
O_DIRECT where the buffers allow; free slots are reused, or punched out to give disk space back."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from kvstored.tiers.holes import punch_hole

log = logging.getLogger("kvstored.ssd")

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the device's block


def _stride(length: int) -> int:
    return -(-length // ALIGN) * ALIGN


def _aligned(buf: np.ndarray) -> bool:
    return buf.ctypes.data % ALIGN == 0 and buf.nbytes % ALIGN == 0


class SlotFile:
    """The payload file of one block size: fixed slots, an O_DIRECT and a buffered descriptor."""

    def __init__(self, path: Path, length: int, used: set[int]) -> None:
        self.length = length
        self.stride = _stride(length)
        self.buffered = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            self.direct: int | None = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        except OSError:  # a filesystem without O_DIRECT (e.g. tmpfs): buffered I/O only
            self.direct = None
        top = max(used, default=-1) + 1
        # free slots, each list taken from its end (lowest slot first): those that hold disk
        # space, taken before those punched out (a write into a hole allocates it again)
        self.free = sorted(set(range(top)) - used, reverse=True)
        self.punched: list[int] = []
        self.top = top
        self.holes = True   # until the filesystem says it cannot punch them
        self._punch_failed = False   # a punch failed (logged once: the next commits try again)
        try:
            if os.fstat(self.buffered).st_size > top * self.stride:
                # slots past the highest one in use hold nothing anybody references (blocks
                # that left before the last stop): their disk space goes back
                os.ftruncate(self.buffered, top * self.stride)
        except OSError as exc:   # the tier works all the same
            log.warning("could not cut %s to its slots in use: %s", path, exc)

    @property
    def free_slots(self) -> int:
        return len(self.free) + len(self.punched)

    @property
    def allocated_bytes(self) -> int:
        """Payload bytes of the slots that hold disk space (in use, or free and not punched)."""
        return (self.top - len(self.punched)) * self.length

    def punch_free(self, nbytes: int) -> int:
        """Punch out free slots until ``nbytes`` of payload slots gave their disk space back, or
        none is left to punch; the bytes given back. 0 where the filesystem cannot punch holes
        (logged once; the space is then only reused, as before)."""
        done = 0
        while done < nbytes and self.free and self.holes:
            slot = self.free[-1]
            try:
                self.holes = punch_hole(self.buffered, slot * self.stride, self.stride)
            except OSError as exc:   # the slot is free all the same; its space is reused later
                if not self._punch_failed:
                    self._punch_failed = True
                    log.warning("could not give back the disk space of a free payload slot: %s", exc)
                break
            if not self.holes:
                log.info("this filesystem cannot punch holes: free payload slots keep their disk space until reused")
                break
            self.punched.append(self.free.pop())
            done += self.length
        return done

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.punched:
            return self.punched.pop()
        self.top += 1
        return self.top - 1

    def give_back(self, slot: int) -> None:
        """``slot`` is free again (nothing committed references it). When it was the last one in
        use, the file gives its disk space back: a size whose blocks have all left (a model no
        longer served, an eviction) does not keep the disk it once took beside the sizes in use."""
        if self.free_slots + 1 == self.top:
            self.free.clear()
            self.punched.clear()
            self.top = 0
            try:
                os.ftruncate(self.buffered, 0)
            except OSError as exc:   # the slots are free all the same; the space waits for a restart
                log.warning("could not truncate an empty payload file: %s", exc)
        else:
            self.free.append(slot)

    def write(self, slot: int, payload: np.ndarray) -> None:
        fd = self.direct if self.direct is not None and _aligned(payload) else self.buffered
        view = memoryview(payload).cast("B")  # type: ignore[arg-type]
        done = os.pwrite(fd, view, slot * self.stride)
        while done < len(view):  # short writes happen on some filesystems near full
            n = os.pwrite(fd, view[done:], slot * self.stride + done)
            if n == 0:
                raise OSError(28, "No space left on device")
            done += n

    def read(self, slot: int, dst: np.ndarray) -> int:
        return self.read_run(slot, [dst])

    def read_run(self, slot: int, dsts: list[np.ndarray]) -> int:
        """Read slots ``slot``, ``slot + 1``, ... into ``dsts`` in one call (slots of whole pages
        when more than one: the stride must equal the length); bytes read."""
        direct = self.direct is not None and all(_aligned(d) for d in dsts)
        fd = self.direct if direct and self.direct is not None else self.buffered
        return os.preadv(fd, [memoryview(d).cast("B") for d in dsts], slot * self.stride)  # type: ignore[arg-type]

    def sync(self) -> None:
        os.fdatasync(self.buffered)

    def close(self) -> None:
        os.close(self.buffered)
        if self.direct is not None:
            os.close(self.direct)
