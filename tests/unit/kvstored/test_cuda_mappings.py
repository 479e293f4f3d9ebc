"""kvstored.cuda's IPC mappings against a stand-in for cupy that behaves as the CUDA runtime does
with IPC handles: a handle is mapped once per process, opening it again fails ("already mapped",
CUDA_ERROR_ALREADY_MAPPED) until it is closed."""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from collections.abc import Iterator

import pytest

import kvstored

UUID = bytes(range(16))


class CUDARuntimeError(Exception):
    pass


class FakeRuntime:
    CUDARuntimeError = CUDARuntimeError

    def __init__(self) -> None:
        self.mapped: dict[bytes, int] = {}
        self.next_address = 1 << 40
        self.copies = 0

    def getDeviceCount(self) -> int:
        return 1

    def getDeviceProperties(self, index: int) -> dict[str, bytes]:
        return {"uuid": UUID}

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        if handle in self.mapped:
            raise CUDARuntimeError("cudaErrorAlreadyMapped: resource already mapped")
        self.mapped[handle] = self.next_address
        self.next_address += 1 << 30
        return self.mapped[handle]

    def memcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                      stream: int) -> None:
        """Done at once, on host addresses: the tests hand host memory in as "device" memory."""
        self.copies += 1
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    def ipcCloseMemHandle(self, address: int) -> None:
        for handle, mapped in list(self.mapped.items()):
            if mapped == address:
                del self.mapped[handle]
                return
        raise CUDARuntimeError("cudaErrorInvalidValue")


class _Device:
    def __init__(self, index: int) -> None:
        self.id = index

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = 0

    def synchronize(self) -> None:
        return None


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[types.ModuleType, FakeRuntime]]:
    runtime = FakeRuntime()
    cupy = types.ModuleType("cupy")
    cupy_cuda = types.ModuleType("cupy.cuda")
    cupy_cuda.Device = _Device  # type: ignore[attr-defined]
    cupy_cuda.Stream = _Stream  # type: ignore[attr-defined]
    cupy_cuda.runtime = runtime  # type: ignore[attr-defined]
    cupy.cuda = cupy_cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy_cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", runtime)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "kvstored.cuda", raising=False)
    monkeypatch.delattr(kvstored, "cuda", raising=False)
    module = importlib.import_module("kvstored.cuda")
    yield module, runtime
    # leave no trace of the stand-in: `from kvstored import cuda` elsewhere must fail as before
    sys.modules.pop("kvstored.cuda", None)
    if getattr(kvstored, "cuda", None) is module:
        delattr(kvstored, "cuda")


def test_tensors_and_registrations_of_one_allocation_share_its_mapping(cuda) -> None:  # type: ignore[no-untyped-def]
    """Each tensor's handle was opened on its own: the second tensor of one allocation (the
    layer views of one KV pool, which torch exports with the pool's handle and their offsets)
    failed with "already mapped", and the registration was refused; so was a second registration
    of the same memory while the first was held. And closing one registration must leave the
    other's mapping in place."""
    module, runtime = cuda
    a = module.DeviceMappings(UUID.hex())
    base = a.open(b"pool")
    assert a.open(b"pool") == base          # layer 1 of the same pool
    b = module.DeviceMappings(UUID.hex())   # another registration of the same engine memory
    assert b.open(b"pool") == base
    assert b.open(b"other") != base
    a.close()
    assert b"pool" in runtime.mapped, "closing one registration unmapped memory another still copies through"
    b.close()
    assert runtime.mapped == {}
    again = module.DeviceMappings(UUID.hex())   # reopened afresh once every user is gone
    assert again.open(b"pool")
    again.close()
    assert runtime.mapped == {}


@pytest.mark.parametrize("cuda_first", [True, False])
def test_a_registration_mixing_cuda_and_shared_memory_tensors_is_refused(cuda, tmp_path, cuda_first) -> None:  # type: ignore[no-untyped-def]
    """A registration of CUDA tensors and shared-memory tensors was accepted, and its copies then
    took every tensor for a device one: the shared-memory tensor's file offset went to
    cudaMemcpy2DAsync as a device address."""
    from kvstored.buffers import RegisteredBuffers, TensorSource
    from kvstored_client.contract.errors import InvalidArgument
    from kvstored_client.contract.layout import TensorLayout

    _module, runtime = cuda
    layout = TensorLayout((4, 4096), (4096, 1), "uint8", 0)
    (tmp_path / "engine-kv").write_bytes(bytes(layout.extent_bytes))
    shm = TensorSource("engine-kv", 0, layout)
    dev = TensorSource("", 0, layout, cuda_ipc_handle=b"pool", device_uuid=UUID.hex())
    with pytest.raises(InvalidArgument, match="all tensors of one registration"):
        RegisteredBuffers(1, str(tmp_path), [dev, shm] if cuda_first else [shm, dev])
    assert runtime.mapped == {}, "the refused registration left its IPC mapping open"


@pytest.mark.parametrize("to_arena", [True, False], ids=["save", "load"])
@pytest.mark.parametrize(("stacked", "copies"), [(True, 3), (False, 6)], ids=["stacked", "gaps-between-blocks"])
def test_device_copies_of_runs_move_exactly_the_bytes_of_their_blocks(  # type: ignore[no-untyped-def]
        cuda, tmp_path, stacked, copies, to_arena) -> None:
    """The CUDA twin of the copy engine's runs: a run of blocks stacked in the tensor and side by
    side in the arena is one 2-D copy, anything else one per block; either way each block's rows
    land where the per-block copies put them, and nothing else is written."""
    import numpy as np

    from kvstored.tensor_memory import TensorMemory
    from kvstored.tiers.dram import Arena
    from kvstored_client.contract.layout import BlockRegion
    from kvstored_client.contract.runs import runs

    module, runtime = cuda
    width, height = 64, 4   # a 256-byte payload: its slot is as wide, so slots sit row after row
    pitch = width + 32   # padded rows, one pitch from block to block when stacked
    region = BlockRegion(width, height, pitch, height * pitch + (0 if stacked else 64))
    rng = np.random.default_rng(30)
    engine = rng.integers(0, 256, 10 * region.block_stride, dtype=np.uint8)
    arena = Arena(str(tmp_path), 8 * width * height, prefault=False)
    arena.buf[:] = rng.integers(0, 256, arena.capacity, dtype=np.uint8)
    t = TensorMemory(region, 0, None, engine.ctypes.data)
    ids, slots = [3, 4, 5, 8, 0, 1], [5, 6, 7, 0, 2, 3]   # runs: 3, 1 and 2 blocks, the first at the arena's end
    step = width * height
    want_engine, want_arena = engine.copy(), arena.buf.copy()
    for block_id, slot in zip(ids, slots):
        for row in range(height):
            e, a = block_id * region.block_stride + row * pitch, slot * step + row * width
            if to_arena:
                want_arena[a: a + width] = engine[e: e + width]
            else:
                want_engine[e: e + width] = arena.buf[a: a + width]
    device = module.DeviceMappings(UUID.hex())
    try:
        device.copy(arena, t, runs([s * step for s in slots], step, ids), step, to_arena)
        assert runtime.copies == copies
        assert np.array_equal(engine, want_engine) and np.array_equal(arena.buf, want_arena)
    finally:
        device.close()
        arena.close()
