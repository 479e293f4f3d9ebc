"""CUDA copy primitive: engine tensors opened from IPC handles, copied on the daemon's own stream.

Imported only when a client registers device buffers or the daemon pins its arena; cupy stays an
optional dependency (extra ``cuda``). Device addresses are plain ints; a block's part of one tensor
(or a run of blocks whose rows follow each other, see :meth:`DeviceMappings.copy`) is one
``cudaMemcpy2DAsync`` (rows of ``width`` bytes, ``pitch`` apart) between the device and the arena,
which is pinned with ``cudaHostRegister`` so the copy runs at full PCIe/NVLink speed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

try:
    import cupy
    from cupy.cuda import runtime
except ImportError as exc:  # pragma: no cover - exercised only without cupy
    raise ImportError("cupy is not installed (pip install 'kvstored[cuda]')") from exc

from kvstored.tensor_memory import TensorMemory
from kvstored.tiers.dram import Arena
from kvstored_client.contract.runs import Run

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


# Every IPC mapping this process holds: (device index, handle) -> [address, users].
_mapped: dict[tuple[int, bytes], list[int]] = {}
_mapped_lock = threading.Lock()


class DeviceMappings:
    """IPC mappings of one engine registration on one device, and the stream its copies use."""

    def __init__(self, device_uuid: str) -> None:
        self.device_uuid = device_uuid
        self.index = device_index(device_uuid)
        self._device = cupy.cuda.Device(self.index)
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._opened: list[tuple[int, bytes]] = []

    def open(self, handle: bytes) -> int:
        """Map an allocation exported with cudaIpcGetMemHandle; returns its base address.

        CUDA maps a handle once per process (opening it again fails, "already mapped"): tensors
        of one allocation (layer views of one KV pool), and registrations of the same memory,
        share the mapping, which is closed when the last of them is."""
        key = (self.index, bytes(handle))
        with _mapped_lock:
            entry = _mapped.get(key)
            if entry is None:
                with self._device:
                    try:
                        address = int(runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER_ACCESS))
                    except runtime.CUDARuntimeError as exc:
                        raise CudaUnavailable(f"cannot open the CUDA IPC handle: {exc}") from None
                entry = _mapped[key] = [address, 0]
            entry[1] += 1
        self._opened.append(key)
        return entry[0]

    def copy(self, arena: Arena, t: TensorMemory, batch: Sequence[Run], step: int, to_arena: bool) -> None:
        """Queue the 2-D copies of ``batch``'s runs between device memory and arena slots (no
        wait): one per run when its blocks' rows follow each other at one pitch on both sides
        (blocks stacked in the tensor, slots holding only this tensor's part back to back), else
        one per block."""
        r = t.region
        host = arena.buf.ctypes.data
        stacked = r.block_stride == r.height * r.pitch and step == r.height * r.width
        with self._device:
            for run in batch:
                per_copy, copies = (run.count, 1) if stacked else (1, run.count)
                for i in range(copies):
                    device = t.base + (run.block_id + i) * r.block_stride
                    slot = host + run.offset + i * step + t.part_offset
                    if to_arena:
                        runtime.memcpy2DAsync(slot, r.width, device, r.pitch, r.width, r.height * per_copy, _D2H,
                                              self._stream.ptr)
                    else:
                        runtime.memcpy2DAsync(device, r.pitch, slot, r.width, r.width, r.height * per_copy, _H2D,
                                              self._stream.ptr)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        """Wait for queued copies, then unmap every handle (the engine may free after this)."""
        with self._device:
            self._stream.synchronize()
            with _mapped_lock:
                for key in self._opened:
                    entry = _mapped.get(key)
                    if entry is None:
                        continue
                    entry[1] -= 1
                    if entry[1] > 0:
                        continue   # another tensor or registration still copies through it
                    del _mapped[key]
                    try:
                        runtime.ipcCloseMemHandle(entry[0])
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
