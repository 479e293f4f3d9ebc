"""The copy engine: moves block bytes between engine buffers and arena slots, off the event loop.

Copies go tensor by tensor (layer by layer), each block of a tensor one 2-D region; after each
tensor a callback fires, so a load can tell the engine that layer N is in place while layer N+1
is still copying. A batch is cut into runs of blocks consecutive in the engine's buffers and side
by side in the arena (:mod:`kvstored_client.contract.runs`), each moved by one call of the
primitive: a strided numpy copy for shared-memory buffers (the CPU twin) and
``cudaMemcpy2DAsync`` on the daemon's own stream for device buffers (``kvstored.cuda``). A small
batch between host buffers is copied on the loop itself (:data:`INLINE_COPY_BYTES`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from kvstored.buffers import BlockIds, RegisteredBuffers
from kvstored.tensor_memory import TensorMemory
from kvstored.tiers.dram import Arena, slot_size
from kvstored_client.contract.errors import DeadlineExceeded
from kvstored_client.contract.runs import Run, runs

TensorDone = Callable[[int], None]
# A host copy of at most this many bytes in all runs on the event loop itself: handing it to a
# worker thread and waking the loop again cost 0.1-0.3 ms a call on a busy machine, as much as the
# copy (a 2 MiB block: 0.2-0.5 ms, which other calls wait for, as they wait for a long lookup).
INLINE_COPY_BYTES = 2 << 20


def _host_copy(arena: Arena, t: TensorMemory, batch: Sequence[Run], step: int, to_arena: bool) -> None:
    # One strided copy per run: its blocks' rows in the engine tensor (``block_stride`` apart)
    # against their slots in the arena (``step`` apart), as one 3-D view on each side.
    assert t.host is not None, "host copy of a device tensor"
    r = t.region
    for run in batch:
        engine = as_strided(t.host[t.base + run.block_id * r.block_stride:], shape=(run.count, r.height, r.width),
                            strides=(r.block_stride, r.pitch, 1), writeable=True)
        slot = as_strided(arena.buf[run.offset + t.part_offset:], shape=(run.count, r.height, r.width),
                          strides=(step, r.width, 1), writeable=True)
        if to_arena:
            np.copyto(slot, engine)
        else:
            np.copyto(engine, slot)


def _run(arena: Arena, buffers: RegisteredBuffers, block_ids: npt.NDArray[np.int64], offsets: Sequence[int],
         to_arena: bool, tensor_done: TensorDone | None, not_after: float | None = None) -> None:
    device = buffers.cuda
    step = slot_size(buffers.block_bytes)   # a namespace's slots in one arena page lie this far apart
    batch = runs(offsets, step, block_ids)
    try:
        for index, t in enumerate(buffers.tensors):
            if not_after is not None and time.monotonic() >= not_after:
                raise DeadlineExceeded(f"the call's deadline passed before layer {index} of its blocks could be "
                                       "copied into the engine's buffers")
            if device is None:
                t.check_backing(index)
                _host_copy(arena, t, batch, step, to_arena)
            else:
                device.copy(arena, t, batch, step, to_arena)  # type: ignore[attr-defined]
            if tensor_done is not None:
                if device is not None:
                    # The device copies are only queued: a layer is complete once its stream has run
                    # them (reporting it earlier let an engine compute on a half-copied layer).
                    device.synchronize()  # type: ignore[attr-defined]
                tensor_done(index)
    except BaseException:
        if device is not None:
            # Copies queued before the failure still run on the stream: wait for them before the
            # caller frees the slots (or the engine its buffers) they are reading or writing.
            with contextlib.suppress(Exception):
                device.synchronize()  # type: ignore[attr-defined]
        raise
    if device is not None:
        device.synchronize()  # type: ignore[attr-defined]


class CopyEngine:
    """Runs batches of block copies on a worker thread, one batch per call; a small batch between
    host buffers (:data:`INLINE_COPY_BYTES`) on the event loop."""

    def __init__(self, arena: Arena, workers: int = 2) -> None:
        self._arena = arena
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstored-copy")

    async def to_arena(self, buffers: RegisteredBuffers, block_ids: BlockIds,
                       offsets: Sequence[int]) -> None:
        """Copy engine blocks ``block_ids`` into arena slots ``offsets`` (same order)."""
        await self._submit(buffers, block_ids, offsets, True, None)

    async def from_arena(self, buffers: RegisteredBuffers, block_ids: BlockIds, offsets: Sequence[int],
                         tensor_done: TensorDone | None = None, *, not_after: float | None = None) -> None:
        """Copy arena slots ``offsets`` into engine blocks ``block_ids``; ``tensor_done(i)`` is
        called on the event loop once tensor ``i`` is complete for every block.

        ``not_after`` (the event loop's time: the deadline of the engine's call) is checked on the
        worker thread right before each tensor's copy: past it, DeadlineExceeded and the engine's
        buffers are not written (any more). The engine, whose call failed at its deadline, may be
        reusing those blocks already: a daemon frozen or starved past the deadline (a copy queued
        behind others, the process stopped between queueing and running it) must not write them
        then. A copy already running when the deadline passes still completes."""
        if not len(block_ids):
            # nothing to copy: report at once, before the caller goes on (say, to end the call);
            # through the worker's thread-safe path the reports would come after that
            if tensor_done is not None:
                for i in range(len(buffers.tensors)):
                    tensor_done(i)
            return
        loop = asyncio.get_running_loop()
        if not_after is not None:   # the worker thread reads time.monotonic(): the loop's clock may differ
            not_after = time.monotonic() + (not_after - loop.time())
        notify: TensorDone | None = None
        if tensor_done is not None:
            callback = tensor_done

            def notify(index: int) -> None:
                loop.call_soon_threadsafe(callback, index)
        await self._submit(buffers, block_ids, offsets, False, notify, not_after)

    async def _submit(self, buffers: RegisteredBuffers, block_ids: BlockIds, offsets: Sequence[int],
                      to_arena: bool, notify: TensorDone | None, not_after: float | None = None) -> None:
        if not len(block_ids):
            if notify is not None:
                for i in range(len(buffers.tensors)):
                    notify(i)
            return
        if buffers.cuda is None and len(block_ids) * buffers.block_bytes <= INLINE_COPY_BYTES:
            buffers.busy += 1
            try:
                _run(self._arena, buffers, np.array(block_ids, dtype=np.int64), offsets, to_arena, notify, not_after)
            finally:
                buffers.busy -= 1
            if notify is not None:
                # its reports are queued on the loop (call_soon_threadsafe): they run before the
                # caller goes on (say, to end the stream that reports them), as after a worker's copy
                await asyncio.sleep(0)
            return
        buffers.busy += 1
        try:
            fut = asyncio.get_running_loop().run_in_executor(
                self._pool, _run, self._arena, buffers, np.array(block_ids, dtype=np.int64), list(offsets), to_arena,
                notify, not_after)
            # its error is ours to raise, unless we were cancelled first: then nobody's
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                # a running copy cannot be stopped: slots and buffers stay held until it is done
                while not fut.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([fut])
                raise
        finally:
            buffers.busy -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
