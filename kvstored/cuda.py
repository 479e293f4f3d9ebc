"""CUDA copy primitive: engine tensors opened from IPC handles, copied on the daemon's own stream.

Imported only when a client registers device buffers or the daemon pins its arena; cupy stays an
optional dependency (extra ``cuda``). Device addresses are plain ints; a block's part of one tensor
is one ``cudaMemcpy2DAsync`` (rows of ``width`` bytes, ``pitch`` apart) between the device and the
arena, which is pinned with ``cudaHostRegister`` so the copy runs at full PCIe/NVLink speed.
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    import cupy
    from cupy.cuda import runtime
except ImportError as exc:  # pragma: no cover - exercised only without cupy
    raise ImportError("cupy is not installed (pip install 'kvstored[cuda]')") from exc

from kvstored.buffers import TensorMemory
from kvstored.tiers.dram import Arena

_IPC_LAZY_PEER_ACCESS = 1
_H2D, _D2H = 1, 2


class CudaUnavailable(Exception):
    """No such device, no driver, or a handle that cannot be opened."""


def normalize_uuid(uuid: str | bytes) -> str:
    """'GPU-1a2b...-...' (nvidia-smi, torch) or 16 raw bytes (cupy) -> 32 lowercase hex digits."""
    if isinstance(uuid, bytes | bytearray):
        return bytes(uuid).hex()
    return uuid.lower().removeprefix("gpu-").replace("-", "")


def device_index(uuid: str) -> int:
    """The CUDA device index (as this process numbers them) of the device with ``uuid``."""
    want = normalize_uuid(uuid)
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        raise CudaUnavailable(f"no CUDA devices: {exc}") from None
    for index in range(count):
        props = runtime.getDeviceProperties(index)
        if normalize_uuid(props.get("uuid", b"")) == want:
            return index
    raise CudaUnavailable(f"no device with UUID {uuid} on the daemon's host (wrong node or "
                          "CUDA_VISIBLE_DEVICES hides it)")


class DeviceMappings:
    """IPC mappings of one engine registration on one device, and the stream its copies use."""

    def __init__(self, device_uuid: str) -> None:
        self.device_uuid = device_uuid
        self.index = device_index(device_uuid)
        self._device = cupy.cuda.Device(self.index)
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._opened: list[int] = []

    def open(self, handle: bytes) -> int:
        """Map an allocation exported with cudaIpcGetMemHandle; returns its base address."""
        with self._device:
            try:
                address = int(runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))
            except runtime.CUDARuntimeError as exc:
                raise CudaUnavailable(f"cannot open the CUDA IPC handle: {exc}") from None
        self._opened.append(address)
        return address

    def copy(self, arena: Arena, t: TensorMemory, block_ids: Sequence[int], offsets: Sequence[int],
             to_arena: bool) -> None:
        """Queue one 2-D copy per block between device memory and arena slots (no wait)."""
        r = t.region
        host = arena.buf.ctypes.data
        with self._device:
            for block_id, offset in zip(block_ids, offsets):
                device = t.base + block_id * r.block_stride
                slot = host + offset + t.part_offset
                if to_arena:
                    runtime.memcpy2DAsync(slot, r.width, device, r.pitch, r.width, r.height, _D2H,
                                          self._stream.ptr)
                else:
                    runtime.memcpy2DAsync(device, r.pitch, slot, r.width, r.width, r.height, _H2D,
                                          self._stream.ptr)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        """Wait for queued copies, then unmap every handle (the engine may free after this)."""
        with self._device:
            self._stream.synchronize()
            for address in self._opened:
                try:
                    runtime.ipcCloseMemHandle(address)
                except runtime.CUDARuntimeError:
                    pass
        self._opened.clear()


def pin_host(arena: Arena) -> bool:
    """Page-lock the arena for DMA (cudaHostRegister, portable); False when no GPU is present."""
    try:
        if runtime.getDeviceCount() == 0:
            return False
        runtime.hostRegister(arena.buf.ctypes.data, arena.capacity, 1)  # cudaHostRegisterPortable
        return True
    except runtime.CUDARuntimeError:
        return False


def unpin_host(arena: Arena) -> None:
    try:
        runtime.hostUnregister(arena.buf.ctypes.data)
    except runtime.CUDARuntimeError:
        pass
