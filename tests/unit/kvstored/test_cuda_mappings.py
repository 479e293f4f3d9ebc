"""kvstored.cuda's IPC mappings against a stand-in for cupy that behaves as the CUDA runtime does
with IPC handles: a handle is mapped once per process, opening it again fails ("already mapped",
CUDA_ERROR_ALREADY_MAPPED) until it is closed."""

from __future__ import annotations

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
