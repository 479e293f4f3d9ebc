"""The copy engine: moves block bytes between engine buffers and arena slots off the event loop.

The primitive is ``numpy.copyto`` (CPU twin; numpy releases the GIL for it); a CUDA engine would
replace only ``_copy_in``/``_copy_out``. Decisions (which blocks, where) are made by the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstored.buffers import RegisteredBuffers
from kvstored.tiers.dram import Arena


def _copy_in(buffers: RegisteredBuffers, arena: Arena, block_ids: Sequence[int],
             offsets: Sequence[int]) -> None:
    for block_id, offset in zip(block_ids, offsets):
        for pos, src in buffers.parts(block_id):
            dst = arena.buf[offset + pos: offset + pos + src.nbytes].view(src.dtype).reshape(src.shape)
            np.copyto(dst, src, casting="no")


def _copy_out(buffers: RegisteredBuffers, arena: Arena, block_ids: Sequence[int],
              offsets: Sequence[int]) -> None:
    for block_id, offset in zip(block_ids, offsets):
        for pos, dst in buffers.parts(block_id):
            src = arena.buf[offset + pos: offset + pos + dst.nbytes].view(dst.dtype).reshape(dst.shape)
            np.copyto(dst, src, casting="no")


class CopyEngine:
    """Runs batches of block copies on worker threads; one batch per call."""

    def __init__(self, arena: Arena, workers: int = 2) -> None:
        self._arena = arena
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstored-copy")

    async def to_arena(self, buffers: RegisteredBuffers, block_ids: Sequence[int],
                       offsets: Sequence[int]) -> None:
        """Copy engine blocks ``block_ids`` into arena slots ``offsets`` (same order)."""
        await self._run(_copy_in, buffers, block_ids, offsets)

    async def from_arena(self, buffers: RegisteredBuffers, block_ids: Sequence[int],
                         offsets: Sequence[int]) -> None:
        """Copy arena slots ``offsets`` into engine blocks ``block_ids`` (same order)."""
        await self._run(_copy_out, buffers, block_ids, offsets)

    async def _run(self, fn, buffers, block_ids, offsets) -> None:  # type: ignore[no-untyped-def]
        if not block_ids:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, fn, buffers, self._arena, block_ids, offsets)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
