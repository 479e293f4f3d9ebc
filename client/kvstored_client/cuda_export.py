"""Export CUDA tensors to the daemon as IPC handles (torch or cupy; both optional)."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class DeviceExport:
    """An allocation's IPC handle, the tensor's byte offset inside it and its device's UUID."""

    handle: bytes
    offset: int
    device_uuid: str


def is_cuda(tensor: Any) -> bool:
    device = getattr(tensor, "device", None)
    if getattr(device, "type", None) == "cuda":  # torch
        return True
    return type(tensor).__module__.startswith("cupy")


def layout_info(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """Shape, strides in elements and dtype name of a CUDA tensor (torch or cupy)."""
    if callable(getattr(tensor, "stride", None)):   # torch: strides in elements already
        return tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype).removeprefix("torch.")
    item = tensor.dtype.itemsize                     # cupy: numpy-style strides in bytes
    if any(s % item for s in tensor.strides):
        raise ValueError("strides must be whole elements")
    return tuple(tensor.shape), tuple(s // item for s in tensor.strides), str(tensor.dtype)


def export(tensor: Any) -> DeviceExport:
    """Describe a CUDA tensor for registration; raises ValueError for anything else."""
    if getattr(getattr(tensor, "device", None), "type", None) == "cuda":
        import torch

        storage = tensor.untyped_storage()
        # (device, handle, size, offset of the storage in its allocation, ...)
        shared = storage._share_cuda_()
        handle, storage_offset = bytes(shared[1]), int(shared[3])
        offset = storage_offset + tensor.storage_offset() * tensor.element_size()
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        return DeviceExport(handle, offset, uuid)
    if type(tensor).__module__.startswith("cupy"):
        from cupy.cuda import runtime

        ptr = int(tensor.data.ptr)
        device = tensor.device
        # the array's device, not the current one: the driver call and the UUID are per device
        with device if hasattr(device, "__enter__") else contextlib.nullcontext():
            # The IPC handle opens the whole CUDA allocation; cupy's memory pool carves many
            # arrays out of one, so ``data.mem.ptr`` (the pool chunk) is not where it opens.
            base = _allocation_base(ptr)
            handle = bytes(runtime.ipcGetMemHandle(base))
            uuid = runtime.getDeviceProperties(device.id)["uuid"]
        return DeviceExport(handle, ptr - base, bytes(uuid).hex())
    raise ValueError("not a CUDA tensor")


def _allocation_base(ptr: int) -> int:
    """The start of the CUDA allocation holding device address ``ptr`` (the driver's
    cuMemGetAddressRange; the calling thread has the device's context current, as cupy leaves
    it). Raises ValueError when the driver does not know the address."""
    driver = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise ValueError(f"cuMemGetAddressRange({ptr:#x}) failed with CUDA error {rc}")
    return int(base.value)
