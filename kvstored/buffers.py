"""Engine KV buffers registered with the daemon (CPU twin: tensors in shared-memory files).

Registration maps each tensor's file and builds a strided byte view of it; ``block(b)`` gives the
views that make up block ``b``. The GPU path (CUDA IPC) plugs in behind the same interface.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstored.errors import InvalidArgument
from kvstored_client.layout import TensorLayout, layout_signature

_UINT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where one registered tensor lives: a file name in the shm directory and a byte offset."""

    shm_name: str
    offset: int
    layout: TensorLayout


class RegisteredBuffers:
    """A set of mapped engine tensors; all must have the same number of blocks."""

    def __init__(self, buffers_id: int, shm_dir: str, sources: Sequence[TensorSource]) -> None:
        if not sources:
            raise InvalidArgument("register_buffers: no tensors given")
        self.buffers_id = buffers_id
        self._maps: list[mmap.mmap] = []
        self._views: list[np.ndarray] = []
        self.layouts = [s.layout for s in sources]
        try:
            for i, src in enumerate(sources):
                self._views.append(self._map(i, shm_dir, src))
        except BaseException:
            self.close()
            raise
        counts = {lay.num_blocks for lay in self.layouts}
        if len(counts) != 1:
            raise InvalidArgument(f"register_buffers: tensors disagree on the number of blocks: {sorted(counts)}")
        self.num_blocks = counts.pop()
        self.block_bytes = sum(lay.block_bytes for lay in self.layouts)
        self.signature = layout_signature(self.layouts)
        # Where each tensor's part of a block starts inside the block payload.
        self._parts: list[int] = []
        pos = 0
        for lay in self.layouts:
            self._parts.append(pos)
            pos += lay.block_bytes

    def _map(self, i: int, shm_dir: str, src: TensorSource) -> np.ndarray:
        where = f"tensors[{i}]"
        name = src.shm_name
        if not name or "/" in name or name.startswith("."):
            raise InvalidArgument(f"{where}.shm_name: expected a plain file name, got {name!r}")
        try:
            src.layout.validate()
        except ValueError as exc:
            raise InvalidArgument(f"{where}: {exc}") from None
        path = Path(shm_dir) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise InvalidArgument(f"{where}.shm_name: cannot open {name!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            end = src.offset + src.layout.extent_bytes
            if end > size:
                raise InvalidArgument(f"{where}: tensor extends to byte {end} but {name!r} has {size}")
            # Populate the page tables now: a copy into a page not yet mapped here costs far more.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._maps.append(mm)
        lay = src.layout
        item = lay.itemsize
        return np.ndarray(lay.shape, dtype=_UINT_BY_SIZE[item], buffer=mm, offset=src.offset,
                          strides=tuple(s * item for s in lay.strides))

    def parts(self, block_id: int) -> list[tuple[int, np.ndarray]]:
        """For block ``block_id``: (byte offset inside the payload, strided view) per tensor."""
        out = []
        for pos, lay, view in zip(self._parts, self.layouts, self._views):
            index = (slice(None),) * lay.block_dim + (block_id,)
            out.append((pos, view[index]))
        return out

    def close(self) -> None:
        self._views.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a copy still holds a view; the mapping goes when it does
        self._maps.clear()
