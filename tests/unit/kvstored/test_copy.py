"""The copy engine's per-tensor reports (review): ``tensor_done(i)`` means tensor ``i`` holds every
block, which is what ``LoadHandle.wait_layer(i)`` promises the engine."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from unretrieved import unretrieved_errors

from kvstored.copy import CopyEngine
from kvstored.tensor_memory import TensorMemory
from kvstored.tiers.dram import Arena, slot_size
from kvstored_client.contract.layout import BlockRegion, TensorLayout

BLOCK = 4096


class AsyncDevice:
    """Stands in for kvstored.cuda.DeviceMappings: ``copy`` only queues (as cudaMemcpy2DAsync does),
    the bytes move when the stream is synchronized; the stream is slow (it finishes after
    ``gate`` opens)."""

    def __init__(self, gate: threading.Event) -> None:
        self.queued: list[tuple[np.ndarray, np.ndarray]] = []
        self.gate = gate

    def copy(self, arena, t, batch, step, to_arena):  # type: ignore[no-untyped-def]
        assert not to_arena
        for run in batch:
            for i in range(run.count):
                dst = t.host[t.base + (run.block_id + i) * t.region.block_stride:][: BLOCK]
                offset = run.offset + i * step + t.part_offset
                self.queued.append((dst, arena.buf[offset: offset + BLOCK]))

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
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=device, busy=0,
                              block_bytes=2 * BLOCK)
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

    def copy(self, arena, t, batch, step, to_arena):  # type: ignore[no-untyped-def]
        if t.part_offset:
            raise RuntimeError("cudaErrorInvalidValue")
        super().copy(arena, t, batch, step, to_arena)


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
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=device, busy=0,
                              block_bytes=2 * BLOCK)
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
                                       TensorMemory(region, BLOCK, layers[1], 0)], cuda=None, busy=0,
                              block_bytes=2 * BLOCK)
    reported: list[int] = []

    async def main() -> list[int]:
        await engine.from_arena(buffers, [], [], reported.append)  # type: ignore[arg-type]
        return list(reported)   # no other callback has run since the await returned

    try:
        assert asyncio.run(main()) == [0, 1]
    finally:
        engine.close()
        arena.close()


# -- runs of blocks: one copy per run must move exactly the bytes of the per-block copies ----------
# Two tensors of uneven shapes: A has padded rows (pitch > width) and an offset in its file, B gaps
# between blocks; a block's payload is A's part (120 bytes), then B's (48): 168, a slot of 192.
REGION_A = BlockRegion(width=40, height=3, pitch=48, block_stride=144)
REGION_B = BlockRegion(width=24, height=2, pitch=24, block_stride=56)
ENGINE_BLOCKS = 13
SLOT = slot_size(REGION_A.width * REGION_A.height + REGION_B.width * REGION_B.height)
SLOTS = 16

# (engine block ids, arena slots) per batch
BATCHES = {
    "one run": ([2, 3, 4, 5], [0, 1, 2, 3]),
    "ids broken mid-run": ([0, 1, 2, 7, 8], [4, 5, 6, 7, 8]),
    "slots broken mid-run": ([0, 1, 2, 3, 4], [0, 1, 5, 6, 7]),
    "nothing adjacent": ([9, 1, 5], [3, 10, 0]),
    "a single block at the arena's end": ([6], [SLOTS - 1]),
    "a run ending at the arena's end": ([10, 11, 12], [SLOTS - 3, SLOTS - 2, SLOTS - 1]),
    "descending": ([5, 4, 3], [2, 1, 0]),
    "slots adjacent, ids not": ([7, 2, 11, 0], [8, 9, 10, 11]),
}


def _tensors(rng: np.random.Generator) -> list[TensorMemory]:
    a = rng.integers(0, 256, 16 + ENGINE_BLOCKS * REGION_A.block_stride, dtype=np.uint8)
    b = rng.integers(0, 256, ENGINE_BLOCKS * REGION_B.block_stride + 8, dtype=np.uint8)
    return [TensorMemory(REGION_A, 0, a, 16),
            TensorMemory(REGION_B, REGION_A.width * REGION_A.height, b, 0)]


def _reference(arena: np.ndarray, tensors: list[TensorMemory], ids: list[int], offsets: list[int],
               to_arena: bool) -> None:
    """The copy row by row, as the copy engine did before it cut batches into runs."""
    for t in tensors:
        r = t.region
        assert t.host is not None
        for block_id, offset in zip(ids, offsets):
            for row in range(r.height):
                e = t.base + block_id * r.block_stride + row * r.pitch
                s = offset + t.part_offset + row * r.width
                if to_arena:
                    arena[s: s + r.width] = t.host[e: e + r.width]
                else:
                    t.host[e: e + r.width] = arena[s: s + r.width]


@pytest.mark.parametrize("inline", [True, False], ids=["on the loop", "on a worker thread"])
@pytest.mark.parametrize("to_arena", [True, False], ids=["save", "load"])
@pytest.mark.parametrize("case", list(BATCHES))
def test_a_batch_cut_into_runs_moves_exactly_the_bytes_of_its_blocks(tmp_path: Path, case: str, to_arena: bool,
                                                                      inline: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstored.copy as copy_mod

    if not inline:   # (these batches are small: on the loop unless the limit says otherwise)
        monkeypatch.setattr(copy_mod, "INLINE_COPY_BYTES", 0)
    ids, slots = BATCHES[case]
    offsets = [s * SLOT for s in slots]
    rng = np.random.default_rng(30)
    arena = Arena(str(tmp_path), SLOTS * SLOT, prefault=False)
    engine = CopyEngine(arena)
    try:
        arena.buf[:] = rng.integers(0, 256, arena.capacity, dtype=np.uint8)
        tensors = _tensors(rng)
        want_arena = arena.buf.copy()
        want_tensors = [SimpleNamespace(region=t.region, part_offset=t.part_offset, host=t.host.copy(), base=t.base)
                        for t in tensors if t.host is not None]
        _reference(want_arena, want_tensors, ids, offsets, to_arena)  # type: ignore[arg-type]
        buffers = SimpleNamespace(tensors=tensors, cuda=None, busy=0,
                                  block_bytes=sum(t.region.width * t.region.height for t in tensors))

        async def main() -> None:
            if to_arena:
                await engine.to_arena(buffers, np.asarray(ids, np.uint32), offsets)  # type: ignore[arg-type]
            else:
                await engine.from_arena(buffers, np.asarray(ids, np.uint32), offsets)  # type: ignore[arg-type]

        asyncio.run(main())
        assert np.array_equal(arena.buf, want_arena), "arena bytes differ from the per-block copy's"
        for got, want in zip(tensors, want_tensors):
            assert got.host is not None and np.array_equal(got.host, want.host), (
                "engine bytes differ from the per-block copy's")
    finally:
        engine.close()
        arena.close()


def test_a_copy_failing_after_its_caller_was_cancelled_leaves_no_unretrieved_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by tests/integration/test_sdk_random.py under load. Was: a load cancelled while its
    copy into the engine's buffers waited on the worker, whose copy then failed (the call's
    deadline had passed), left that error to nobody: the daemon logged "Future exception was
    never retrieved"."""
    import kvstored.copy
    from kvstored_client.contract.errors import DeadlineExceeded

    running, fail = threading.Event(), threading.Event()

    def late_failure(*args: object) -> None:
        running.set()
        fail.wait(5)
        raise DeadlineExceeded("the call's deadline passed before layer 0 of its blocks could be copied")

    monkeypatch.setattr(kvstored.copy, "_run", late_failure)
    monkeypatch.setattr(kvstored.copy, "INLINE_COPY_BYTES", 0)   # on a worker thread
    buffers = SimpleNamespace(busy=0, tensors=[], cuda=None, block_bytes=64)

    async def main() -> None:
        engine = CopyEngine(object(), workers=1)  # type: ignore[arg-type]
        try:
            copy = asyncio.ensure_future(engine.from_arena(buffers, [3], [0]))  # type: ignore[arg-type]
            await asyncio.to_thread(running.wait, 5)
            copy.cancel()      # the call ends (its client went away) while the copy runs ...
            await asyncio.sleep(0)
            fail.set()         # ... and the copy then fails
            with pytest.raises(asyncio.CancelledError):
                await copy
            assert buffers.busy == 0, "the buffers stay marked busy after their copy ended"
        finally:
            engine.close()

    assert unretrieved_errors(main) == []


@pytest.mark.parametrize("inline", [True, False], ids=["on the loop", "on a worker thread"])
def test_every_tensor_is_reported_before_the_copy_returns(tmp_path: Path, inline: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's stream ends once its copy returns: a layer reported after that was never heard
    of (the engine's wait_layer failed with 'the load ended early')."""
    import kvstored.copy as copy_mod

    if not inline:
        monkeypatch.setattr(copy_mod, "INLINE_COPY_BYTES", 0)
    arena = Arena(str(tmp_path), SLOTS * SLOT, prefault=False)
    engine = CopyEngine(arena)
    try:
        tensors = _tensors(np.random.default_rng(1))
        buffers = SimpleNamespace(tensors=tensors, cuda=None, busy=0,
                                  block_bytes=sum(t.region.width * t.region.height for t in tensors))
        reported: list[int] = []

        async def main() -> list[int]:
            await engine.from_arena(buffers, np.asarray([1, 2], np.uint32), [0, SLOT],  # type: ignore[arg-type]
                                    reported.append)
            return list(reported)

        assert asyncio.run(main()) == [0, 1]
    finally:
        engine.close()
        arena.close()
