"""The copy engine's per-tensor reports (review): ``tensor_done(i)`` means tensor ``i`` holds every
block, which is what ``LoadHandle.wait_layer(i)`` promises the engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kvstored.copy import CopyEngine
from kvstored.tensor_memory import TensorMemory
from kvstored.tiers.dram import Arena
from kvstored_client.contract.layout import TensorLayout

BLOCK = 4096


class AsyncDevice:
    """Stands in for kvstored.cuda.DeviceMappings: ``copy`` only queues (as cudaMemcpy2DAsync does),
    the bytes move when the stream is synchronized; the stream is slow (it finishes after
    ``gate`` opens)."""

    def __init__(self, gate: threading.Event) -> None:
        self.queued: list[tuple[np.ndarray, np.ndarray]] = []
        self.gate = gate

    def copy(self, arena, t, block_ids, offsets, to_arena):  # type: ignore[no-untyped-def]
        assert not to_arena
        for block_id, offset in zip(block_ids, offsets):
            dst = t.host[t.base + block_id * t.region.block_stride:][: BLOCK]
            self.queued.append((dst, arena.buf[offset + t.part_offset: offset + t.part_offset + BLOCK]))

    def synchronize(self) -> None:
        self.gate.wait(5)
        for dst, src in self.queued:
            dst[:] = src
        self.queued.clear()


def test_tensor_done_is_reported_only_once_the_tensors_copies_have_completed(tmp_path: Path) -> None:
    """On a CUDA host, copy._run queues each tensor's cudaMemcpy2DAsync and calls tensor_done(i)
    right after queueing, before the stream has run the copies (the only synchronize is after the
    last tensor): wait_layer(i) returns while layer i is still being written."""
    arena = Arena(str(tmp_path), 8 * BLOCK, prefault=False)
    engine = CopyEngine(arena)
    layers = [np.zeros(4 * BLOCK, np.uint8) for _ in range(2)]
    region = TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0).region()
    gate = threading.Event()
    device = AsyncDevice(gate)
    buffers = SimpleNamespace(tensors=[TensorMemory(region, 0, layers[0], 0),
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=device, busy=0)
    arena.buf[: 2 * BLOCK] = 7                           # one block of 2 tensors at offset 0
    in_place_when_reported: dict[int, bool] = {}

    def tensor_done(i: int) -> None:
        in_place_when_reported[i] = bool((layers[i][BLOCK: 2 * BLOCK] == 7).all())

    async def main() -> None:
        threading.Timer(0.5, gate.set).start()           # the device finishes a little later
        await engine.from_arena(buffers, [1], [0], tensor_done)  # type: ignore[arg-type]
        await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert (layers[0][BLOCK: 2 * BLOCK] == 7).all() and (layers[1][BLOCK: 2 * BLOCK] == 7).all()
        assert in_place_when_reported == {0: True, 1: True}, (
            f"tensor_done fired before the tensor's copies completed: {in_place_when_reported}")
    finally:
        gate.set()
        engine.close()
        arena.close()


class FailingDevice(AsyncDevice):
    """Queues tensor 0's copies, then fails to queue tensor 1's (a CUDA error from
    cudaMemcpy2DAsync): the copies already queued still run on the stream."""

    def copy(self, arena, t, block_ids, offsets, to_arena):  # type: ignore[no-untyped-def]
        if t.part_offset:
            raise RuntimeError("cudaErrorInvalidValue")
        super().copy(arena, t, block_ids, offsets, to_arena)


def test_a_failed_device_copy_waits_for_the_copies_already_queued(tmp_path: Path) -> None:
    """When queueing a later tensor's copies failed, _run raised at once without synchronizing
    the stream: the caller then freed the arena slots (and the engine may free its buffers) while
    the earlier tensors' DMA was still reading or writing them."""
    arena = Arena(str(tmp_path), 8 * BLOCK, prefault=False)
    engine = CopyEngine(arena)
    layers = [np.zeros(4 * BLOCK, np.uint8) for _ in range(2)]
    region = TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0).region()
    gate = threading.Event()
    gate.set()
    device = FailingDevice(gate)
    buffers = SimpleNamespace(tensors=[TensorMemory(region, 0, layers[0], 0),
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=device, busy=0)
    outcome: list[BaseException] = []

    async def main() -> None:
        try:
            await engine.from_arena(buffers, [1], [0])  # type: ignore[arg-type]
        except RuntimeError as exc:
            outcome.append(exc)

    try:
        asyncio.run(main())
        assert len(outcome) == 1, "the failed copy was not reported"
        assert device.queued == [], "the copy failed while copies it had queued were still running"
        assert buffers.busy == 0
    finally:
        engine.close()
        arena.close()


def test_a_copy_of_no_blocks_reports_every_tensor_before_it_returns(tmp_path: Path) -> None:
    """A load whose blocks were all copied out while they came up from SSD ends with a copy of no
    blocks. Its tensor reports went through the worker's thread-safe path and ran after the
    servicer had already sent "done": the client's wait_layer(i) raised "the load ended early"."""
    arena = Arena(str(tmp_path), 8 * BLOCK, prefault=False)
    engine = CopyEngine(arena)
    region = TensorLayout((4, BLOCK), (BLOCK, 1), "uint8", 0).region()
    layers = [np.zeros(4 * BLOCK, np.uint8) for _ in range(2)]
    buffers = SimpleNamespace(tensors=[TensorMemory(region, 0, layers[0], 0),
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=None, busy=0)
    reported: list[int] = []

    async def main() -> list[int]:
        await engine.from_arena(buffers, [], [], reported.append)  # type: ignore[arg-type]
        return list(reported)   # no other callback has run since the await returned

    try:
        assert asyncio.run(main()) == [0, 1]
    finally:
        engine.close()
        arena.close()
